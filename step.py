"""One GRPO step, [A]'s Algorithm 1: what train.py's loop and the benchmark call.

Step k (v = --offpolicy-steps; docs/design.md walks through it with the papers' notation):
  1. refresh: if k % v == 0, alpha <- pi_theta, and the batches of steps k, ..., k + v - 1 are sampled now;
  2. sample G completions for each of B prompts from alpha (rollout.py);
  3. score them with a reward function (train.py: the verifier of reward.py; the benchmark: synthetic);
  4. group-relative advantages within the step's own groups, zero-std groups masked out (advantage.py);
  5. log-probs: log alpha came with the batch, log pi_ref is computed here (beta > 0), log pi_k in 6;
  6. --inner-steps optimizer steps over the batch on the chosen loss (objective.py, corrections.py,
     reinforce.py), each accumulated over --micro-batch chunks.

The stale policy is a batch, not a model: between two refreshes alpha does not change, so drawing its v batches
at the refresh is drawing them from the frozen alpha later, and alpha never exists as a second copy of the
weights. The cycle's batches live in a `rollout.Cycle`, which checkpoints hold: a run killed mid-cycle resumes
bit for bit.

Deviations from [A]:
  1. log pi_k gets no forward pass of its own: until the step's first optimizer update pi_theta *is* pi_k, so
     the first inner epoch records logp.detach() of its own forward. At a refresh alpha is pi_k too (with
     --alpha-logp-from recompute), so an on-policy step runs no extra forward at all.
  2. A step whose cycle is missing (its refresh's sampling failed, a checkpoint without one) samples the rest
     of its cycle, steps k, ..., up to the next multiple of v, from pi_theta then.
"""

import contextlib
import copy
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from advantage import group_advantages, red_drop, red_weight
from config import Config
from corrections import corrected_policy_loss, mis_keep_mask, sampler_mismatch_stats
from logprobs import chunked_token_logprobs
from objective import aggregation_total, policy_loss
from policy import BF16AdamW, auto_micro_batch, fit_policy
from reinforce import opmd_loss, rec_loss
from rollout import Cycle, Rollout, Sampled, generate_batches


@dataclass
class Models:
    """What a step reads and changes: the trained policy, its optimizer, and pi_ref. alpha is no model: it is the
    policy at the last refresh, which sampled the cycle's batches then (module docstring)."""

    policy: torch.nn.Module  # pi_theta
    opt: torch.optim.Optimizer
    ref: torch.nn.Module | None  # pi_ref, a frozen copy; None without KL (beta = 0) and under LoRA (adapter off)


def make_models(cfg: Config, policy: torch.nn.Module) -> Models:
    """The policy fitted to memory (policy.fit_policy), AdamW over its trainable weights (BF16AdamW for bfloat16
    ones), and pi_ref when beta > 0: a copy without gradients in eval mode, none under LoRA (the adapter off)."""
    policy = fit_policy(cfg, policy)
    params = [p for p in policy.parameters() if p.requires_grad]  # LoRA: the adapter only
    if cfg.param_dtype == "bfloat16":
        opt = BF16AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, seed=cfg.seed)
    else:
        opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    ref = copy.deepcopy(policy).requires_grad_(False).eval() if cfg.beta > 0 and not cfg.lora_rank else None
    return Models(policy, opt, ref)


@dataclass
class Batch:
    """One step's samples as the update reads them."""

    input_ids: torch.Tensor  # (N, P+T) prompts left-padded, then completions
    attention_mask: torch.Tensor  # (N, P+T)
    completion_mask: torch.Tensor  # (N, T) 1 up to and including EOS
    loss_mask: torch.Tensor  # (N, T) completion tokens of the groups with signal: what the loss averages over
    advantages: torch.Tensor  # (N,)
    alpha_logp: torch.Tensor  # (N, T) log alpha as the cycle recorded it (rollout.Sampled)
    alpha_is_pi_k: bool  # the refresh step's batch with log alpha recomputed: the loss takes log pi_k for log alpha


@dataclass
class StepResult:
    """What `grpo_step` did: the samples, their rewards, the update's statistics, each phase's seconds."""

    refresh: bool  # this step refreshed alpha and sampled its cycle
    rollout: Rollout
    rewards: torch.Tensor  # (N,)
    batch: Batch
    stats: dict  # update()'s averages (or skipped_no_signal when no group had signal), and sampler_mismatch
    times: dict  # seconds: refresh, sample, score, logprob, update


def grpo_step(
    cfg: Config,
    models: Models,
    tokenizer,
    step: int,
    gen: torch.Generator,
    cycle: Cycle | None,
    draw: Callable[[int], list],
    *,
    ignore_eos: bool = False,
) -> tuple[StepResult, Cycle]:
    """Steps 1-6 of one GRPO step (module docstring), shared by `train` and the benchmark.

    Args:
        tokenizer: gives the EOS and pad ids.
        step: k, the index of this step.
        gen: the sampling generator (also drives RED-Drop and --reward-shuffle).
        cycle: the current refresh cycle (None at the start); the returned one is the next call's.
        draw: n -> the next n steps' (prompt_ids, prompt_mask, reward_fn), prompts (B, P) left-padded on the
            policy's device, reward_fn: Rollout -> (N,) rewards (the verifier in training); called at refreshes.
        ignore_eos: passed to `generate` (the benchmark samples fixed-length completions).
    Raises FloatingPointError when the sampler's logits are not finite (a diverged policy).
    """
    device = next(models.policy.parameters()).device
    times = dict.fromkeys(("refresh", "sample", "score", "logprob"), 0.0)
    t = clock(device)
    # ---- pi_ref <- pi_theta every --ref-refresh steps ----
    if models.ref is not None and cfg.ref_refresh and step > 0 and step % cfg.ref_refresh == 0:
        models.ref.load_state_dict(models.policy.state_dict())
    times["refresh"] = clock(device) - t

    # ---- 1-3. a refresh: alpha <- pi_theta samples and scores the batches of its cycle ----
    refresh = cycle is None or not cycle.covers(step)  # k % v == 0, or a cycle lost (module docstring)
    if refresh:
        n = min(cfg.offpolicy_steps - step % cfg.offpolicy_steps, cfg.steps - step)  # to the next refresh or the end
        cycle = sample_cycle(cfg, models, tokenizer, step, draw(n), gen, ignore_eos=ignore_eos)
        times.update(cycle.times)  # the refresh step carries the cycle's sampling, scoring and log alpha
    sampled = cycle.batches[step - cycle.start]
    ro, rewards = sampled.rollout, sampled.rewards
    t = clock(device)

    # ---- 4. group-relative advantages within the step's own groups (zero-std groups leave the loss) ----
    advantages, valid = compute_advantages(cfg, rewards, gen)  # (N,) each
    batch = Batch(
        input_ids=ro.input_ids,
        attention_mask=ro.attention_mask,
        completion_mask=ro.completion_mask,
        loss_mask=ro.completion_mask * valid[:, None],
        advantages=advantages,
        alpha_logp=sampled.alpha_logp,
        alpha_is_pi_k=sampled.alpha_is_pi_k,
    )
    times["score"], t = times["score"] + clock(device) - t, clock(device)

    # ---- 5. log pi_ref without grad, with a KL term ----
    ref_logp = ref_logprobs(cfg, models, ro)  # (N, T), None without a KL term
    times["logprob"], t = times["logprob"] + clock(device) - t, clock(device)

    # ---- 6. update: --inner-steps optimizer steps on the loss ----
    updated = batch.loss_mask.sum() > 0
    if updated:
        stats, pi_k_logp = update(cfg, models.policy, models.opt, batch, ref_logp)
    else:  # every group had equal rewards: no optimizer step
        stats = {"nonfinite_updates": 0, "skipped_no_signal": 1}
    # The sampler's own log alpha (KV cache, maybe the fast path) against a full forward of the same policy: pi_k's
    # at a refresh (alpha = pi_k), the recomputed one after it. They should agree to rounding.
    if refresh:
        if not updated:
            with torch.no_grad():
                pi_k_logp = policy_logprobs(cfg, models.policy, batch)  # (N, T)
        stats["sampler_mismatch"] = sampler_mismatch(ro, pi_k_logp, batch.loss_mask)
    elif cfg.alpha_logp_from == "recompute":
        stats["sampler_mismatch"] = sampler_mismatch(ro, batch.alpha_logp, batch.loss_mask)
    times["update"] = clock(device) - t
    return StepResult(refresh, ro, rewards, batch, stats, times), cycle


def sample_cycle(cfg: Config, models: Models, tokenizer, start: int, draws: list, gen, *, ignore_eos) -> Cycle:
    """Steps 1-3 for the steps start, ..., start + len(draws) - 1 at once, from alpha = pi_theta now.

    draws: one (prompt_ids, prompt_mask, reward_fn) per step, in the order the steps would have drawn them.
    log alpha (--alpha-logp-from): `recompute`, a no-grad forward of pi_theta over the batches after the first
    (the first batch's alpha is pi_k, whose log-probs its update's first epoch records); or `sampler`, the
    log-probs `generate` recorded while sampling, for every batch. Raises FloatingPointError when the sampler's
    logits are not finite (a diverged policy).
    """
    device, times = draws[0][0].device, {}
    t = clock(device)
    models.policy.eval()
    with autocast(cfg, device):
        rollouts = generate_batches(
            models.policy,
            [(ids, mask) for ids, mask, _ in draws],
            group_size=cfg.group_size,
            max_rows=cfg.sample_rows,
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            truncation=cfg.truncation,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            generator=gen,
            ignore_eos=ignore_eos,
            fast=cfg.fast,
        )
    times["sample"], t = clock(device) - t, clock(device)
    rewards = [reward_fn(ro) for ro, (_, _, reward_fn) in zip(rollouts, draws)]  # (N,) each
    times["score"], t = clock(device) - t, clock(device)
    batches = []
    with torch.no_grad(), autocast(cfg, device):
        for j, (ro, r) in enumerate(zip(rollouts, rewards)):
            if cfg.alpha_logp_from == "sampler":
                batches.append(Sampled(ro, r, ro.alpha_logp, alpha_is_pi_k=False))
            elif j == 0:
                batches.append(Sampled(ro, r, ro.alpha_logp, alpha_is_pi_k=True))  # the update records log pi_k
            else:
                alpha_logp = chunked_token_logprobs(
                    models.policy, ro.input_ids, ro.attention_mask, ro.completion_mask, cfg.temperature, cfg.truncation
                )  # (N, T)
                batches.append(Sampled(ro, r, alpha_logp, alpha_is_pi_k=False))
    times["logprob"] = clock(device) - t
    return Cycle(start, batches, times)


def compute_advantages(cfg: Config, rewards: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and the valid mask for the chosen loss and data shaping (advantage.py)."""
    # The null control: the same rewards, each credited to a random sample.
    if cfg.reward_shuffle:
        rewards = rewards[torch.randperm(rewards.numel(), generator=gen, device=rewards.device)]  # (N,)
    keep = red_drop(rewards, cfg.group_size, gen) if cfg.red == "drop" else None
    scale_std = cfg.loss in ("grpo", "rec", "rec-is") and cfg.asymre_shift == 0.0
    advantages, valid = group_advantages(
        rewards,
        cfg.group_size,
        mask_zero_std=cfg.mask_zero_std,
        scale_std=scale_std,
        baseline_shift=cfg.asymre_shift,
        keep=keep,
    )
    if cfg.red == "weight":
        advantages = red_weight(advantages, cfg.red_tau)
    return advantages, valid


def update(cfg: Config, policy, opt, batch: Batch, ref_logp) -> tuple[dict, torch.Tensor]:
    """--inner-steps optimizer steps over the batch, micro-batched; returns the statistics averaged over tokens and
    inner steps, and log pi_k (N, T): the first epoch's log-probs, taken before any optimizer step moved the policy.

    Micro-batch losses are divided by the whole step's normaliser, so their summed gradients equal the whole batch's.
    Dropout is off in every pass (policy.fit_policy), so that pi_theta, pi_k and alpha are one network: with dropout,
    rho would differ from 1 even where pi_theta = alpha (TRL's `disable_dropout` makes the same choice).
    """
    loss_mask, n = batch.loss_mask, batch.input_ids.shape[0]
    mb = cfg.micro_batch or auto_micro_batch(policy, n, batch.input_ids.shape[1], cfg.gradient_checkpointing)
    policy.train(cfg.gradient_checkpointing)  # checkpointing acts in train mode only; dropout is 0 either way
    pi_k_logp = torch.zeros_like(loss_mask, dtype=torch.float32)  # (N, T) log pi_k, filled in epoch 0
    # MIS drops tokens by rho' = pi_k / alpha, and the dropped ones leave the normaliser: on a stale step every
    # micro-batch needs log pi_k of the whole step first, so here pi_k gets a no-grad pass of its own.
    pi_k_first = cfg.is_mask is not None and not batch.alpha_is_pi_k
    if pi_k_first:
        with torch.no_grad():
            for s in range(0, n, mb):
                pi_k_logp[s : s + mb] = policy_logprobs(cfg, policy, batch, slice(s, s + mb))
        keep = mis_keep_mask(batch.alpha_logp, pi_k_logp, cfg.is_mask, loss_mask=loss_mask, is_level=cfg.is_level)
        total = aggregation_total(loss_mask * keep, cfg.agg, cfg.max_new_tokens)
    else:
        total = aggregation_total(loss_mask, cfg.agg, cfg.max_new_tokens)
    sums, tokens, grad_norms, skipped, loss_sum = {}, 0.0, [], 0, 0.0
    for epoch in range(cfg.inner_steps):
        opt.zero_grad(set_to_none=True)
        for s in range(0, n, mb):
            rows = slice(s, s + mb)
            if loss_mask[rows].sum() == 0 and epoch > 0:
                continue  # no token in the loss here: zero loss and zero gradient
            logp = policy_logprobs(cfg, policy, batch, rows)  # (mb, T)
            if epoch == 0 and not pi_k_first:
                pi_k_logp[rows] = logp.detach()  # pi_theta is pi_k until the first optimizer step
            alpha_logp = pi_k_logp[rows] if batch.alpha_is_pi_k else batch.alpha_logp[rows]
            r_logp = ref_logp[rows] if ref_logp is not None else None
            loss, st = loss_fn(
                cfg, logp, alpha_logp, pi_k_logp[rows], r_logp, batch.advantages[rows], loss_mask[rows], total
            )
            loss.backward()
            w = st.pop("tokens")
            tokens += w
            for key, value in st.items():
                sums[key] = sums.get(key, 0.0) + value * w
            loss_sum += loss.item()  # the micro-batch losses add up to the step's
        norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm)
        if torch.isfinite(norm):
            opt.step()
        else:
            skipped += 1  # a non-finite gradient: no optimizer step
        grad_norms.append(norm.item())
    stats = {k: v / max(tokens, 1.0) for k, v in sums.items()}
    # rho' = pi_k / alpha does not depend on pi_theta: its quantiles, max and the TIS / MIS fractions are the whole
    # step's, exact whatever the micro-batching.
    alpha_logp = pi_k_logp if batch.alpha_is_pi_k else batch.alpha_logp
    corrections = dict(is_cap=cfg.is_cap, is_mask=cfg.is_mask, is_level=cfg.is_level)
    stats.update(sampler_mismatch_stats(alpha_logp, pi_k_logp, loss_mask, **corrections))
    stats.update(
        loss=loss_sum / cfg.inner_steps,
        grad_norm=sum(grad_norms) / len(grad_norms),
        nonfinite_updates=skipped,
    )
    return stats, pi_k_logp


def loss_fn(cfg: Config, logp, alpha_logp, pi_k_logp, ref_logp, advantages, loss_mask, total):
    """The micro-batch loss chosen by --loss, and for grpo by its staleness correction: [A]'s surrogate
    (objective.py), another engine's correction (corrections.py), or a loss of [B] (reinforce.py)."""
    common = dict(agg=cfg.agg, max_new_tokens=cfg.max_new_tokens, total=total)
    clip = dict(clip_eps=cfg.clip_eps, clip_eps_high=cfg.clip_eps_high)
    if cfg.loss == "grpo":
        logps = dict(
            logp=logp,
            alpha_logp=alpha_logp,
            pi_k_logp=pi_k_logp,
            ref_logp=ref_logp,
            advantages=advantages,
            loss_mask=loss_mask,
        )
        kl = dict(beta=cfg.beta, kl_estimator=cfg.kl_estimator)
        if cfg.clip_center == "decoupled" or cfg.is_mask is not None:  # another engine's correction
            corrections = dict(is_cap=cfg.is_cap, is_mask=cfg.is_mask, is_level=cfg.is_level)
            return corrected_policy_loss(**logps, clip_center=cfg.clip_center, **corrections, **kl, **clip, **common)
        return policy_loss(**logps, clip_center=cfg.clip_center, **kl, **clip, **common)
    logps = dict(logp=logp, alpha_logp=alpha_logp, advantages=advantages, loss_mask=loss_mask)
    if cfg.loss in ("rec", "rec-is"):
        return rec_loss(**logps, importance_weight=cfg.loss == "rec-is", **clip, **common)
    return opmd_loss(**logps, tau_reg=cfg.tau_reg, **common)


def policy_logprobs(cfg: Config, policy, batch: Batch, rows=slice(None)) -> torch.Tensor:
    """log pi_theta (mb, T) of the batch's completions (rows), with grad when grad is enabled."""
    with autocast(cfg, batch.input_ids.device):
        ids, mask, completion_mask = batch.input_ids[rows], batch.attention_mask[rows], batch.completion_mask[rows]
        return chunked_token_logprobs(policy, ids, mask, completion_mask, cfg.temperature, cfg.truncation)


def ref_logprobs(cfg: Config, models: Models, ro: Rollout) -> torch.Tensor | None:
    """log pi_ref (N, T) without grad, None without a KL term; under LoRA pi_ref is the policy, adapter off."""
    if cfg.beta == 0:
        return None
    ref = models.ref if models.ref is not None else models.policy
    adapter_off = models.policy.disable_adapter() if models.ref is None else contextlib.nullcontext()
    with torch.no_grad(), autocast(cfg, ro.input_ids.device), adapter_off:
        return chunked_token_logprobs(
            ref, ro.input_ids, ro.attention_mask, ro.completion_mask, cfg.temperature, cfg.truncation
        )


def sampler_mismatch(ro: Rollout, forward_alpha_logp: torch.Tensor, loss_mask: torch.Tensor) -> float:
    """The mean |log alpha while sampling - log alpha of a full forward| over the loss's tokens (all the completion
    tokens on a step without signal): a large value means sampling and training see different models."""
    on = loss_mask if loss_mask.sum() > 0 else ro.completion_mask  # (N, T)
    gap = (ro.alpha_logp - forward_alpha_logp).abs() * on  # (N, T)
    return gap.sum().item() / max(on.sum().item(), 1)


def autocast(cfg: Config, device):
    """bfloat16 autocast on CUDA (float32 master weights); a no-op with --dtype float32."""
    device = torch.device(device)
    return torch.autocast(
        device.type, dtype=cfg.autocast_dtype or torch.float32, enabled=cfg.autocast_dtype is not None
    )


def clock(device) -> float:
    """time.time() once the device's queued work is done: CUDA runs asynchronously, so the phase timers would
    otherwise bill one phase's kernels to the next phase that waits for them."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.time()
