"""One GRPO step, steps 1-6 of [A]'s Algorithm 1 (docs/design.md): what train.py's loop and the benchmark call.

One training step k:
  1. refresh the sampler: if k % v == 0, alpha <- pi_theta (v = --offpolicy-steps; v = 1 keeps
     no copy: the live model samples);
  2. sample G completions for each of B prompts from alpha;
  3. score them with a reward function (train.py: the verifier of reward.py; bench.py: synthetic);
  4. group-relative advantages, zero-std groups masked out (advantage.py);
  5. log-probs under alpha (stale steps only), pi_k and pi_ref (only when beta > 0) (rollout.py);
  6. --inner-steps optimizer steps over the batch, each accumulated over --micro-batch chunks,
     on the clipped surrogate with k3 KL, or a loss of [B] (objective.py).

Deviations from [A]:
  1. log pi_k is not a separate forward pass: until the step's first optimizer update,
     pi_theta *is* pi_k, so the first inner epoch records logp.detach() of its own forward.
     At refresh steps alpha = pi_k too, so then the behaviour pass is skipped as well: on-policy
     steps run no extra forward at all.
"""

import copy
import time
from dataclasses import dataclass

import torch

from advantage import group_advantages, red_drop, red_weight
from config import Config
from logprobs import token_logprobs
from objective import aggregation_total, mis_keep_mask, policy_loss, sampler_mismatch_stats
from reinforce import opmd_loss, rec_loss
from rollout import Rollout, generate


@dataclass
class Models:
    """What a step reads and changes: the trained policy, its optimizer, and the two frozen copies."""

    policy: torch.nn.Module  # pi_theta
    opt: torch.optim.Optimizer
    sampler: torch.nn.Module | None  # alpha, refreshed every v steps; None when v = 1 (the live policy samples)
    ref: torch.nn.Module | None  # pi_ref; None when beta = 0 (no KL term)


def make_models(cfg: Config, policy: torch.nn.Module) -> Models:
    """AdamW on the policy, and the frozen copies the flags ask for: alpha (v > 1) and pi_ref (beta > 0).

    Frozen means no gradients and eval mode. With v = 1 there is no alpha (the live policy samples) and
    with beta = 0 no pi_ref, so neither costs memory when it is not needed.
    """
    frozen = lambda: copy.deepcopy(policy).requires_grad_(False).eval()  # noqa: E731
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    return Models(policy, opt, sampler=frozen() if cfg.offpolicy_steps > 1 else None,
                  ref=frozen() if cfg.beta > 0 else None)  # fmt: skip


@dataclass
class Batch:
    """One step's samples as the update reads them."""

    input_ids: torch.Tensor  # (N, P+T) prompts left-padded, then completions
    attention_mask: torch.Tensor  # (N, P+T)
    completion_mask: torch.Tensor  # (N, T) 1 up to and including EOS
    loss_mask: torch.Tensor  # (N, T) completion tokens of valid groups: what the loss averages over
    advantages: torch.Tensor  # (N,)


@dataclass
class StepResult:
    """What `grpo_step` did: the samples, their rewards, the update's statistics, each phase's seconds."""

    rollout: Rollout
    rewards: torch.Tensor  # (N,)
    batch: Batch
    alpha_logp: torch.Tensor | None  # (N, T) log alpha from a full forward (pi_k's at refresh steps); None: no update
    stats: dict  # update()'s averages, or skipped_no_signal when no group had signal
    times: dict  # seconds: refresh, sample, score, logprob, update


def autocast(cfg: Config, device):
    """bfloat16 autocast on CUDA (float32 master weights); a no-op with --dtype float32."""
    device = torch.device(device)
    return torch.autocast(
        device.type, dtype=cfg.autocast_dtype or torch.float32, enabled=cfg.autocast_dtype is not None
    )


def clock(device) -> float:
    """time.time() once the device's queued work is done: CUDA runs asynchronously, so the phase
    timers would otherwise bill one phase's kernels to the next phase that waits for them."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.time()


def compute_advantages(cfg: Config, rewards: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and valid mask for the chosen loss and data shaping (advantage.py)."""
    # The null control: the same rewards, each credited to a random sample.
    if cfg.reward_shuffle:
        rewards = rewards[torch.randperm(rewards.numel(), generator=gen, device=rewards.device)]  # (N,)
    keep = red_drop(rewards, cfg.group_size, gen) if cfg.red == "drop" else None
    scale_std = cfg.loss in ("grpo", "rec", "rec-is") and cfg.asymre_shift == 0.0
    adv, valid = group_advantages(
        rewards,
        cfg.group_size,
        mask_zero_std=cfg.mask_zero_std,
        scale_std=scale_std,
        baseline_shift=cfg.asymre_shift,
        keep=keep,
    )
    if cfg.red == "weight":
        adv = red_weight(adv, cfg.red_tau)
    return adv, valid


def loss_fn(cfg: Config, logp, behaviour_logp, current_logp, ref_logp, adv, mask, total):
    """The per-micro-batch loss selected by --loss (objective.py, reinforce.py)."""
    logps = dict(logp=logp, behaviour_logp=behaviour_logp, advantages=adv, completion_mask=mask)
    common = dict(agg=cfg.agg, max_new_tokens=cfg.max_new_tokens, total=total)
    clip = dict(clip_eps=cfg.clip_eps, clip_eps_high=cfg.clip_eps_high)
    if cfg.loss == "grpo":
        return policy_loss(
            **logps,
            current_logp=current_logp,
            ref_logp=ref_logp,
            clip_center=cfg.clip_center,
            beta=cfg.beta,
            is_cap=cfg.is_cap,
            is_mask=cfg.is_mask,
            kl_estimator=cfg.kl_estimator,
            **clip,
            **common,
        )
    if cfg.loss in ("rec", "rec-is"):
        return rec_loss(**logps, importance_weight=cfg.loss == "rec-is", **clip, **common)
    return opmd_loss(**logps, tau_reg=cfg.tau_reg, **common)


def policy_logprobs(cfg: Config, policy, batch: Batch, rows=slice(None)) -> torch.Tensor:
    """log pi_theta (mb, T) of the batch's completions (rows), with grad when grad is enabled."""
    with autocast(cfg, batch.input_ids.device):
        return token_logprobs(
            policy, batch.input_ids[rows], batch.attention_mask[rows], batch.completion_mask[rows], cfg.temperature
        )


def update(cfg: Config, policy, opt, batch: Batch, behaviour_logp, ref_logp) -> tuple[dict, torch.Tensor]:
    """--inner-steps optimizer steps over the batch, micro-batched.

    behaviour_logp=None means alpha = pi_k (a refresh step): it is recorded from the first
    inner epoch, like log pi_k. Micro-batch losses are normalised by the whole step's total,
    so their summed gradients equal the whole-batch gradient.

    The policy runs in eval mode: dropout off in every log-prob pass, so that pi_theta, pi_k and alpha are
    one network (with dropout, rho would differ from 1 even where pi_theta = alpha; TRL's `disable_dropout`
    makes the same choice). Gradients flow as in train mode.

    Returns the statistics averaged over tokens and inner steps, and log pi_k (N, T): the first
    epoch's log-probs, taken before any optimizer step moved the policy.
    """
    ids, mask, adv = batch.input_ids, batch.loss_mask, batch.advantages
    n = ids.shape[0]
    mb = cfg.micro_batch or n
    policy.eval()
    pi_k_logp = torch.zeros_like(mask, dtype=torch.float32)  # (N, T) log pi_k, filled in epoch 0
    keep = torch.ones_like(mask, dtype=torch.bool)  # (N, T) the tokens in the normaliser
    pi_k_first = cfg.is_mask is not None and behaviour_logp is not None
    if pi_k_first:
        # MIS drops tokens by rho' = pi_k / alpha, and the dropped ones leave the normaliser: on a stale step
        # every micro-batch needs log pi_k of the whole step first, so here pi_k gets a no-grad pass of its own.
        with torch.no_grad():
            for s in range(0, n, mb):
                pi_k_logp[s : s + mb] = policy_logprobs(cfg, policy, batch, slice(s, s + mb))
        keep = mis_keep_mask(behaviour_logp, pi_k_logp, cfg.is_mask)  # (N, T)
    total = aggregation_total(mask * keep, cfg.agg, cfg.max_new_tokens)
    sums, tokens, grad_norms, skipped, loss_sum = {}, 0.0, [], 0, 0.0
    for epoch in range(cfg.inner_steps):
        opt.zero_grad(set_to_none=True)
        epoch_loss = 0.0
        for s in range(0, n, mb):
            rows = slice(s, s + mb)
            if mask[rows].sum() == 0 and epoch > 0:
                # No valid token here: zero loss and zero gradient.
                continue
            logp = policy_logprobs(cfg, policy, batch, rows)  # (mb, T)
            if epoch == 0 and not pi_k_first:
                # pi_theta == pi_k until the first optimizer step.
                pi_k_logp[rows] = logp.detach()
            b_logp = pi_k_logp[rows] if behaviour_logp is None else behaviour_logp[rows]
            r_logp = ref_logp[rows] if ref_logp is not None else None
            loss, st = loss_fn(cfg, logp, b_logp, pi_k_logp[rows], r_logp, adv[rows], mask[rows], total)
            loss.backward()
            w = st.pop("tokens")
            tokens += w
            for key, v in st.items():
                sums[key] = sums.get(key, 0.0) + v * w
            # Micro-batch losses add up to the step's loss.
            epoch_loss += loss.item()
        loss_sum += epoch_loss
        norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm)
        if torch.isfinite(norm):
            opt.step()
        else:
            skipped += 1  # non-finite gradient: no optimizer step
        grad_norms.append(norm.item())
    stats = {k: v / max(tokens, 1.0) for k, v in sums.items()}
    alpha_logp = pi_k_logp if behaviour_logp is None else behaviour_logp
    # rho' = pi_k / alpha does not depend on pi_theta: its quantiles, max and the TIS / MIS fractions are
    # the whole step's, exact whatever the micro-batching.
    stats.update(sampler_mismatch_stats(alpha_logp, pi_k_logp, mask, is_cap=cfg.is_cap, is_mask=cfg.is_mask))
    stats.update(
        loss=loss_sum / cfg.inner_steps,
        grad_norm=sum(grad_norms) / len(grad_norms),
        nonfinite_updates=skipped,
    )
    return stats, pi_k_logp


def grpo_step(
    cfg: Config,
    models: Models,
    tokenizer,
    prompt_ids,
    prompt_mask,
    step: int,
    gen: torch.Generator,
    reward_fn,
    *,
    ignore_eos: bool = False,
    fast: bool | None = None,
) -> StepResult:
    """Steps 1-6 of one GRPO step (module docstring), shared by `train` and bench.py.

    Args:
        tokenizer: gives the EOS and pad ids.
        prompt_ids, prompt_mask: (B, P) left-padded prompts on the policy's device.
        step: k, the index of this step; the sampler is refreshed when k % v == 0.
        gen: the sampling generator (also drives RED-Drop and --reward-shuffle).
        reward_fn: Rollout -> (N,) rewards: the verifier in training, a synthetic reward in bench.py.
        ignore_eos, fast: passed to `generate` (bench.py samples fixed-length completions).
    Raises FloatingPointError when the sampler's logits are not finite (a diverged policy).
    """
    device, times = prompt_ids.device, {}
    t = clock(device)
    refresh = step % cfg.offpolicy_steps == 0
    # ---- 1. refresh the sampler: alpha <- pi_theta every v steps (and pi_ref every --ref-refresh) ----
    if models.sampler is not None and refresh:
        models.sampler.load_state_dict(models.policy.state_dict())
    if models.ref is not None and cfg.ref_refresh and step > 0 and step % cfg.ref_refresh == 0:
        models.ref.load_state_dict(models.policy.state_dict())
    times["refresh"], t = clock(device) - t, clock(device)

    # ---- 2. sample G completions of each prompt from alpha ----
    models.policy.eval()
    with autocast(cfg, device):
        ro = generate(
            models.sampler or models.policy,
            prompt_ids,
            prompt_mask,
            group_size=cfg.group_size,
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            generator=gen,
            ignore_eos=ignore_eos,
            fast=fast,
        )
    times["sample"], t = clock(device) - t, clock(device)

    # ---- 3. reward, 4. group-relative advantages (zero-std groups leave the loss) ----
    rewards = reward_fn(ro)  # (N,)
    adv, valid = compute_advantages(cfg, rewards, gen)  # (N,) each
    batch = Batch(
        ro.input_ids,
        ro.attention_mask,
        ro.completion_mask,
        loss_mask=ro.completion_mask * valid.unsqueeze(1),
        advantages=adv,
    )  # loss_mask (N, T)
    times["score"], t = clock(device) - t, clock(device)

    # ---- 5. log-probs without grad: alpha on stale steps (at refresh steps alpha = pi_k), pi_ref with KL ----
    with torch.no_grad(), autocast(cfg, device):
        behaviour_logp = (
            None
            if refresh
            else token_logprobs(models.sampler, ro.input_ids, ro.attention_mask, ro.completion_mask, cfg.temperature)
        )  # (N, T)
        ref_logp = (
            None
            if models.ref is None
            else token_logprobs(models.ref, ro.input_ids, ro.attention_mask, ro.completion_mask, cfg.temperature)
        )  # (N, T)
    times["logprob"], t = clock(device) - t, clock(device)

    # ---- 6. update: --inner-steps optimizer steps on the clipped surrogate ----
    if batch.loss_mask.sum() > 0:
        stats, pi_k_logp = update(cfg, models.policy, models.opt, batch, behaviour_logp, ref_logp)
        alpha_logp = pi_k_logp if behaviour_logp is None else behaviour_logp
    else:
        # Every group had equal rewards: nothing to learn from, no optimizer step.
        stats, alpha_logp = {"nonfinite_updates": 0, "skipped_no_signal": 1}, None
    times["update"] = clock(device) - t
    return StepResult(ro, rewards, batch, alpha_logp, stats, times)
