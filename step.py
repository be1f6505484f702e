"""One GRPO step, steps 1-6 of [A]'s Algorithm 1 (docs/design.md): what train.py's loop and the benchmark call.

One training step k:
  1. refresh: if k % v == 0 (v = --offpolicy-steps), alpha <- pi_theta, and the batches of steps
     k, ..., k + v - 1 are sampled now (`sample_cycle`, 2-3 below, and log alpha);
  2. sample G completions for each of B prompts from alpha;
  3. score them with a reward function (train.py: the verifier of reward.py; the benchmark: synthetic);
  4. group-relative advantages within the step's own groups, zero-std groups masked out (advantage.py);
  5. log-probs under pi_ref (only when beta > 0); log alpha came with the batch, log pi_k comes from 6;
  6. --inner-steps optimizer steps over the batch, each accumulated over --micro-batch chunks,
     on [A]'s clipped surrogate, or a loss of [B] (objective.py, reinforce.py).

The stale policy is a batch, not a model. [A] samples step k + j's batch from alpha, the policy of the last
refresh k, frozen for j = 0, ..., v - 1 steps. Between two refreshes alpha does not change, so drawing those
v batches from it at step k is drawing them from the frozen alpha later: the same distribution, and alpha
never has to exist as a second copy of the weights. At the refresh pi_theta *is* alpha; the v x B x G rows
go to `generate` in as few calls as --sample-rows allows, and log alpha of the later batches is either
recomputed then by a no-grad forward of pi_theta (--alpha-logp recompute, the training forward's numerics)
or taken from what the sampler recorded (sampler: no extra forward). The cycle's batches live in a `Cycle`,
which checkpoints hold, so a run killed mid-cycle resumes bit for bit.

Deviations from [A]:
  1. log pi_k is not a separate forward pass: until the step's first optimizer update,
     pi_theta *is* pi_k, so the first inner epoch records logp.detach() of its own forward.
     At refresh steps alpha = pi_k too (with recompute), so on-policy steps run no extra forward at all.
  2. A step whose cycle is missing (its refresh's sampling failed, a checkpoint without one) samples the
     rest of its cycle, steps k, ..., up to the next multiple of v, from pi_theta then.
"""

import contextlib
import copy
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from advantage import group_advantages, red_drop, red_weight
from config import Config
from logprobs import token_logprobs
from objective import aggregation_total, mis_keep_mask, policy_loss, sampler_mismatch_stats
from reinforce import opmd_loss, rec_loss
from rollout import Cycle, Rollout, Sampled, generate_batches
from run_io import fit_policy


@dataclass
class Models:
    """What a step reads and changes: the trained policy, its optimizer, and pi_ref. alpha is no model: it is
    the policy at the last refresh, which sampled the cycle's batches then (module docstring)."""

    policy: torch.nn.Module  # pi_theta
    opt: torch.optim.Optimizer
    ref: torch.nn.Module | None  # pi_ref, a frozen copy; None without KL (beta = 0) and under LoRA (adapter off)


def make_models(cfg: Config, policy: torch.nn.Module) -> Models:
    """The policy fitted to memory (run_io.fit_policy), AdamW over its trainable weights (BF16AdamW for bfloat16
    ones), and pi_ref when beta > 0: a copy without gradients in eval mode, none under LoRA (the adapter off)."""
    policy = fit_policy(cfg, policy)
    params = [p for p in policy.parameters() if p.requires_grad]  # LoRA: the adapter only
    if cfg.param_dtype == "bfloat16":
        opt = BF16AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, seed=cfg.seed)
    else:
        opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    ref = copy.deepcopy(policy).requires_grad_(False).eval() if cfg.beta > 0 and not cfg.lora_rank else None
    return Models(policy, opt, ref)


class BF16AdamW(torch.optim.Optimizer):
    """AdamW for bfloat16 weights (--param-dtype bfloat16): float32 moments, the update computed in float32 as
    torch's AdamW computes it, then rounded stochastically into the bfloat16 weight, so that E[w_new] is the
    float32 result. Plain AdamW on bfloat16 weights rounds to nearest, which loses every update smaller than half
    a weight's bfloat16 spacing (2^-9 of its size: at lr 2e-5 most of them). Costs 12 bytes a parameter (weight
    2, gradient 2, moments 8) against float32's 16. Float32 parameters (a LoRA adapter) take the same update,
    unrounded. Step s of parameter i draws its rounding noise from a generator seeded by (seed, s, i): a resumed
    run rounds as the uninterrupted one would."""

    def __init__(self, params, lr: float, weight_decay: float = 0.0, betas=(0.9, 0.999), eps=1e-8, seed: int = 0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.seed = seed

    @torch.no_grad()
    def step(self):
        params = (p for group in self.param_groups for p in group["params"])
        index = {id(p): i for i, p in enumerate(params)}  # the parameter's place: its own rounding stream
        for group in self.param_groups:
            (b1, b2), lr = group["betas"], group["lr"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p, dtype=torch.float32))
                    st["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                st["step"] += 1
                s, g, w = int(st["step"]), p.grad.float(), p.float()  # float32 copies
                w.mul_(1 - lr * group["weight_decay"])
                st["exp_avg"].lerp_(g, 1 - b1)
                st["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
                denom = (st["exp_avg_sq"].sqrt() / (1 - b2**s) ** 0.5).add_(group["eps"])
                w.addcdiv_(st["exp_avg"], denom, value=-lr / (1 - b1**s))
                if p.dtype == torch.bfloat16:
                    seed = (self.seed * 1_000_003 + s) * 65_537 + index[id(p)]
                    gen = torch.Generator(device=p.device).manual_seed(seed)
                    noise = torch.randint(0, 1 << 16, w.shape, generator=gen, device=p.device, dtype=torch.int32)
                    w = ((w.view(torch.int32) + noise) & -65536).view(torch.float32)  # low 16 bits: exact in bf16
                p.copy_(w)

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's, which casts the moments to the parameter's dtype; here they stay float32."""
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        for i, st in state_dict["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                self.state[params[i]][key] = st[key].to(params[i].device, torch.float32, copy=True)


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
    alpha_logp: torch.Tensor | None  # (N, T) log alpha from a full forward; None: no update, or none ran
    stats: dict  # update()'s averages, or skipped_no_signal when no group had signal
    times: dict  # seconds: refresh, sample, score, logprob, update


def sample_cycle(cfg: Config, models: Models, tokenizer, start: int, draws: list, gen, *, ignore_eos, fast) -> Cycle:
    """Steps 1-3 for the steps start, ..., start + len(draws) - 1 at once, from alpha = pi_theta now.

    draws: one (prompt_ids, prompt_mask, reward_fn) per step, in the order the steps would have drawn them.
    log alpha (--alpha-logp): `recompute`, a no-grad forward of pi_theta over the batches after the first
    (the first is pi_k's own: its update's first epoch records it); or `sampler`, the log-probs `generate`
    recorded while sampling, for every batch. Raises FloatingPointError when the sampler's logits are not
    finite (a diverged policy).
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
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            generator=gen,
            ignore_eos=ignore_eos,
            fast=fast,
        )
    times["sample"], t = clock(device) - t, clock(device)
    rewards = [reward_fn(ro) for ro, (_, _, reward_fn) in zip(rollouts, draws)]  # (N,) each
    times["score"], t = clock(device) - t, clock(device)
    alpha = []
    with torch.no_grad(), autocast(cfg, device):
        for j, ro in enumerate(rollouts):
            if cfg.alpha_logp == "sampler":
                alpha.append(ro.sampler_logp)
            elif j == 0:
                alpha.append(None)  # alpha = pi_k: the update's first epoch records it
            else:
                alpha.append(
                    token_logprobs(models.policy, ro.input_ids, ro.attention_mask, ro.completion_mask, cfg.temperature)
                )  # (N, T)
    times["logprob"] = clock(device) - t
    return Cycle(start, [Sampled(*b) for b in zip(rollouts, rewards, alpha)], times)


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
            is_level=cfg.is_level,
            kl_estimator=cfg.kl_estimator,
            **clip,
            **common,
        )
    if cfg.loss in ("rec", "rec-is"):
        return rec_loss(**logps, importance_weight=cfg.loss == "rec-is", **clip, **common)
    return opmd_loss(**logps, tau_reg=cfg.tau_reg, **common)


def ref_logprobs(cfg: Config, models: Models, ro: Rollout) -> torch.Tensor | None:
    """log pi_ref (N, T) without grad, None without a KL term; under LoRA pi_ref is the policy, adapter off."""
    if cfg.beta == 0:
        return None
    ref = models.ref if models.ref is not None else models.policy
    off = models.policy.disable_adapter() if models.ref is None else contextlib.nullcontext()
    with torch.no_grad(), autocast(cfg, ro.input_ids.device), off:
        return token_logprobs(ref, ro.input_ids, ro.attention_mask, ro.completion_mask, cfg.temperature)


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

    Dropout is off in every log-prob pass, so that pi_theta, pi_k and alpha are one network (with dropout, rho
    would differ from 1 even where pi_theta = alpha; TRL's `disable_dropout` makes the same choice): the policy
    runs in eval mode, or, with --gradient-checkpointing (which acts in train mode only), in train mode with
    every dropout probability 0 (run_io.fit_policy). Gradients flow the same in both.

    Returns the statistics averaged over tokens and inner steps, and log pi_k (N, T): the first
    epoch's log-probs, taken before any optimizer step moved the policy.
    """
    ids, mask, adv = batch.input_ids, batch.loss_mask, batch.advantages
    n = ids.shape[0]
    mb = cfg.micro_batch or n
    policy.train(cfg.gradient_checkpointing)
    pi_k_logp = torch.zeros_like(mask, dtype=torch.float32)  # (N, T) log pi_k, filled in epoch 0
    keep = torch.ones_like(mask, dtype=torch.bool)  # (N, T) the tokens in the normaliser
    pi_k_first = cfg.is_mask is not None and behaviour_logp is not None
    if pi_k_first:
        # MIS drops tokens by rho' = pi_k / alpha, and the dropped ones leave the normaliser: on a stale step
        # every micro-batch needs log pi_k of the whole step first, so here pi_k gets a no-grad pass of its own.
        with torch.no_grad():
            for s in range(0, n, mb):
                pi_k_logp[s : s + mb] = policy_logprobs(cfg, policy, batch, slice(s, s + mb))
        keep = mis_keep_mask(behaviour_logp, pi_k_logp, cfg.is_mask, completion_mask=mask, is_level=cfg.is_level)
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
    corrections = dict(is_cap=cfg.is_cap, is_mask=cfg.is_mask, is_level=cfg.is_level)
    stats.update(sampler_mismatch_stats(alpha_logp, pi_k_logp, mask, **corrections))
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
    step: int,
    gen: torch.Generator,
    cycle: Cycle | None,
    draw: Callable[[int], list],
    *,
    ignore_eos: bool = False,
    fast: bool | None = None,
) -> tuple[StepResult, Cycle]:
    """Steps 1-6 of one GRPO step (module docstring), shared by `train` and the benchmark.

    Args:
        tokenizer: gives the EOS and pad ids.
        step: k, the index of this step; alpha is refreshed when k % v == 0.
        gen: the sampling generator (also drives RED-Drop and --reward-shuffle).
        cycle: the current refresh cycle (None at the start); the returned one is the next call's.
        draw: n -> the next n steps' (prompt_ids, prompt_mask, reward_fn), prompts (B, P) left-padded on the
            policy's device, reward_fn: Rollout -> (N,) rewards (the verifier in training); called at refreshes.
        ignore_eos, fast: passed to `generate` (the benchmark samples fixed-length completions).
    Raises FloatingPointError when the sampler's logits are not finite (a diverged policy).
    """
    device = next(models.policy.parameters()).device
    times = dict.fromkeys(("refresh", "sample", "score", "logprob"), 0.0)
    t = clock(device)
    # ---- 1. refresh pi_ref every --ref-refresh steps; alpha needs nothing: it is pi_theta at a refresh ----
    if models.ref is not None and cfg.ref_refresh and step > 0 and step % cfg.ref_refresh == 0:
        models.ref.load_state_dict(models.policy.state_dict())
    times["refresh"] = clock(device) - t
    # ---- 1-3. at a refresh, sample and score the cycle's batches from alpha = pi_theta ----
    if cycle is None or not cycle.covers(step):
        n = min(cfg.offpolicy_steps - step % cfg.offpolicy_steps, cfg.steps - step)  # to the next refresh or the end
        cycle = sample_cycle(cfg, models, tokenizer, step, draw(n), gen, ignore_eos=ignore_eos, fast=fast)
        times.update(cycle.times)  # the refresh step carries the cycle's sampling, scoring and log alpha
    sampled = cycle.batches[step - cycle.start]
    ro, rewards, behaviour_logp = sampled.rollout, sampled.rewards, sampled.alpha_logp
    t = clock(device)

    # ---- 4. group-relative advantages within the step's own groups (zero-std groups leave the loss) ----
    adv, valid = compute_advantages(cfg, rewards, gen)  # (N,) each
    batch = Batch(ro.input_ids, ro.attention_mask, ro.completion_mask, ro.completion_mask * valid[:, None], adv)
    times["score"], t = times["score"] + clock(device) - t, clock(device)

    # ---- 5. log pi_ref without grad, with a KL term ----
    ref_logp = ref_logprobs(cfg, models, ro)  # (N, T), None without a KL term
    times["logprob"], t = times["logprob"] + clock(device) - t, clock(device)

    # ---- 6. update: --inner-steps optimizer steps on the clipped surrogate ----
    first = step == cycle.start  # a refresh: pi_theta is alpha
    if batch.loss_mask.sum() > 0:
        stats, pi_k_logp = update(cfg, models.policy, models.opt, batch, behaviour_logp, ref_logp)
    else:  # every group had equal rewards: no optimizer step; a refresh still gets log alpha (sampler_mismatch)
        stats = {"nonfinite_updates": 0, "skipped_no_signal": 1}
        with torch.no_grad():
            pi_k_logp = policy_logprobs(cfg, models.policy, batch) if first else None  # (N, T)
    # log alpha of a full forward: pi_k's at the refresh step, the recomputed one after it.
    alpha_logp = pi_k_logp if first else behaviour_logp if cfg.alpha_logp == "recompute" else None
    times["update"] = clock(device) - t
    return StepResult(ro, rewards, batch, alpha_logp, stats, times), cycle
