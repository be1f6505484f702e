"""One GRPO step, [A]'s Algorithm 1: `reference_step` as plainly as it can be written, then `grpo_step`, the
engine the loop and the benchmark call, which computes the same update (tests/test_reference.py) with what a real
run needs beside it: micro-batches, the staleness corrections and [B]'s losses, LoRA, autocast, the fast sampler and
log-probs, timers.

Step k (v = --offpolicy-steps; docs/design.md walks through it with the papers' notation):
  1. refresh: when the cycle holds no batch for step k (k % v == 0, or a cycle lost: below), alpha <- pi_theta,
     and the batches of steps k, ..., k + v - 1 are sampled now;
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
from engine.chunked_logprobs import chunked_token_logprobs
from engine.decoding import static_sampler
from engine.policy import BF16AdamW, auto_micro_batch, fit_policy
from logprobs import token_logprobs
from objective import aggregation_total, policy_loss
from rollout import Cycle, Rollout, Sampled, generate_batches, sample
from variants.corrections import corrected_policy_loss, mis_keep_mask, sampler_mismatch_stats
from variants.reinforce import opmd_loss, rec_loss


def reference_step(cfg: Config, policy, opt, ref, tokenizer, k: int, gen, cycle: list | None, draw) -> list:
    """Step k of Algorithm 1 on [A]'s loss, one batch at once, float32: what `grpo_step` computes for the same
    flags (tests/test_reference.py), without micro-batches, timers, LoRA, autocast or fast paths. `ref` is pi_ref
    (None when beta = 0); `draw(n)` gives the next n steps' (prompt_ids, prompt_mask, reward_fn); `cycle` is the
    previous call's result (None at first). Not here: --ref-refresh, --red, --reward-shuffle, --asymre-shift,
    --is-cap/--is-mask, the decoupled clip, [B]'s losses, --alpha-logp-from sampler."""
    v, G = cfg.offpolicy_steps, cfg.group_size

    def logp_of(model, ro):  # log pi(y_t) (N, T) of the completions: logprobs.token_logprobs, the textbook line
        ids, mask, completion_mask = ro.input_ids, ro.attention_mask, ro.completion_mask
        return token_logprobs(model, ids, mask, completion_mask, cfg.temperature, cfg.truncation)

    # 1-3. refresh: alpha <- pi_theta samples the batches of steps k, ..., k + v - 1 now, scores them, and records
    # log alpha (alpha is frozen until the next refresh, so these are the batches it would sample later).
    if k % v == 0:
        draws = draw(min(v, cfg.steps - k))
        rollouts = generate_batches(
            policy,
            [(ids, mask) for ids, mask, _ in draws],
            group_size=G,
            max_rows=cfg.sample_rows,
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            truncation=cfg.truncation,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            generator=gen,
        )
        with torch.no_grad():
            cycle = [(ro, reward_fn(ro), logp_of(policy, ro)) for ro, (_, _, reward_fn) in zip(rollouts, draws)]
    ro, rewards, alpha_logp = cycle[k % v]

    # 4. group-relative advantages; the groups whose rewards are all equal leave the loss
    advantages, valid = group_advantages(rewards, G, mask_zero_std=cfg.mask_zero_std)  # (N,) each
    loss_mask = ro.completion_mask * valid[:, None]  # (N, T)
    if loss_mask.sum() == 0:
        return cycle  # no group carries signal: no update

    # 5. log pi_ref, a constant (the KL term's reference)
    with torch.no_grad():
        ref_logp = logp_of(ref, ro) if cfg.beta > 0 else None  # (N, T)

    # 6. mu = --inner-steps optimizer steps on [A]'s clipped surrogate; pi_k is pi_theta before the first one
    pi_k_logp = None
    for i in range(cfg.inner_steps):
        logp = logp_of(policy, ro)  # (N, T) log pi_theta, with grad
        if i == 0:
            pi_k_logp = logp.detach()
        loss, _ = policy_loss(
            logp,
            alpha_logp,
            pi_k_logp,
            ref_logp,
            advantages,
            loss_mask,
            clip_eps=cfg.clip_eps,
            clip_eps_high=cfg.clip_eps_high,
            clip_center=cfg.clip_center,
            beta=cfg.beta,
            kl_estimator=cfg.kl_estimator,
            kl_importance_weight=cfg.kl_importance_weight,
            agg=cfg.agg,
            max_new_tokens=cfg.max_new_tokens,
        )
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm)
        opt.step()
    return cycle


# --- the engine ------------------------------------------------------------------------------------------------


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
    alpha_logp: torch.Tensor | None  # (N, T) log alpha as the cycle recorded it; None: alpha = pi_k (rollout.Sampled)


@dataclass
class StepResult:
    """What `grpo_step` did: the samples, their rewards, the update's statistics, each phase's seconds."""

    refresh: bool  # this step refreshed alpha and sampled its cycle
    rollout: Rollout
    rewards: torch.Tensor  # (N,)
    batch: Batch
    stats: dict  # update()'s averages (or skipped_no_signal when no group had signal), and sampler_mismatch
    times: dict  # seconds: refresh, sample, score, logprob, update (Timer)


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
    timer = Timer(device)
    with timer("refresh"):  # pi_ref <- pi_theta every --ref-refresh steps
        if models.ref is not None and cfg.ref_refresh and step > 0 and step % cfg.ref_refresh == 0:
            models.ref.load_state_dict(models.policy.state_dict())

    # ---- 1-3. a refresh: alpha <- pi_theta samples and scores the batches of its cycle ----
    refresh = cycle is None or not cycle.covers(step)  # k % v == 0, or a cycle lost (module docstring)
    if refresh:
        n = min(cfg.offpolicy_steps - step % cfg.offpolicy_steps, cfg.steps - step)  # to the next refresh or the end
        cycle = sample_cycle(cfg, models, tokenizer, step, draw(n), gen, timer, ignore_eos=ignore_eos)
    sampled = cycle.batches[step - cycle.start]
    ro, rewards = sampled.rollout, sampled.rewards

    # ---- 4. group-relative advantages within the step's own groups (zero-std groups leave the loss) ----
    with timer("score"):
        advantages, valid = compute_advantages(cfg, rewards, gen)  # (N,) each
        batch = Batch(
            input_ids=ro.input_ids,
            attention_mask=ro.attention_mask,
            completion_mask=ro.completion_mask,
            loss_mask=ro.completion_mask * valid[:, None],
            advantages=advantages,
            alpha_logp=sampled.alpha_logp,
        )

    # ---- 5. log pi_ref without grad, with a KL term ----
    with timer("logprob"):
        ref_logp = ref_logprobs(cfg, models, ro)  # (N, T), None without a KL term

    # ---- 6. update: --inner-steps optimizer steps on the loss ----
    with timer("update"):
        if batch.loss_mask.sum() > 0:
            stats, pi_k_logp = update(cfg, models.policy, models.opt, batch, ref_logp)
        else:  # every group had equal rewards: no optimizer step
            stats, pi_k_logp = {"nonfinite_updates": 0, "skipped_no_signal": 1}, None
        stats.update(sampler_mismatch(cfg, models.policy, batch, ro, refresh, pi_k_logp))
    return StepResult(refresh, ro, rewards, batch, stats, timer.seconds), cycle


def sample_cycle(cfg: Config, models: Models, tokenizer, start: int, draws: list, gen, timer, *, ignore_eos) -> Cycle:
    """Steps 1-3 for the steps start, ..., start + len(draws) - 1 at once, from alpha = pi_theta now.

    draws: one (prompt_ids, prompt_mask, reward_fn) per step, in the order the steps would have drawn them.
    log alpha (--alpha-logp-from): `recompute`, a no-grad forward of pi_theta over the batches after the first
    (the first batch's alpha is pi_k, whose log-probs its update's first epoch records: None here); or `sampler`,
    the log-probs `generate` recorded while sampling, for every batch. Raises FloatingPointError when the sampler's
    logits are not finite (a diverged policy).
    """
    device = draws[0][0].device
    models.policy.eval()
    with timer("sample"), autocast(cfg, device):
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
            sampler=sampler(cfg),
        )
    with timer("score"):
        rewards = [reward_fn(ro) for ro, (_, _, reward_fn) in zip(rollouts, draws)]  # (N,) each
    with timer("logprob"), torch.no_grad():
        batches = []
        for j, (ro, r) in enumerate(zip(rollouts, rewards)):
            if cfg.alpha_logp_from == "sampler":
                alpha_logp = ro.sampler_logp
            elif j == 0:
                alpha_logp = None  # alpha = pi_k: the update's first forward gives log alpha
            else:
                alpha_logp = logprobs(cfg, models.policy, ro)  # (N, T)
            batches.append(Sampled(ro, r, alpha_logp))
    return Cycle(start, batches)


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
    # log alpha: the batch's, or pi_k's where alpha = pi_k (the same tensor, filled as epoch 0 goes)
    alpha_logp = pi_k_logp if batch.alpha_logp is None else batch.alpha_logp  # (N, T)
    # MIS drops tokens by rho' = pi_k / alpha, and the dropped ones leave the normaliser: on a stale step every
    # micro-batch needs log pi_k of the whole step first, so here pi_k gets a no-grad pass of its own.
    pi_k_first = cfg.is_mask is not None and batch.alpha_logp is not None
    if pi_k_first:
        with torch.no_grad():
            for s in range(0, n, mb):
                pi_k_logp[s : s + mb] = logprobs(cfg, policy, batch, slice(s, s + mb))
        keep = mis_keep_mask(alpha_logp, pi_k_logp, cfg.is_mask, loss_mask=loss_mask, is_level=cfg.is_level)
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
            logp = logprobs(cfg, policy, batch, rows)  # (mb, T)
            if epoch == 0 and not pi_k_first:
                pi_k_logp[rows] = logp.detach()  # pi_theta is pi_k until the first optimizer step
            loss, st = loss_fn(
                cfg,
                logp,
                alpha_logp[rows],
                pi_k_logp[rows],
                None if ref_logp is None else ref_logp[rows],
                batch.advantages[rows],
                loss_mask[rows],
                total,
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
        kl = dict(beta=cfg.beta, kl_estimator=cfg.kl_estimator, kl_importance_weight=cfg.kl_importance_weight)
        if cfg.clip_center == "decoupled" or cfg.is_mask is not None:  # another engine's correction
            corrections = dict(is_cap=cfg.is_cap, is_mask=cfg.is_mask, is_level=cfg.is_level)
            return corrected_policy_loss(**logps, clip_center=cfg.clip_center, **corrections, **kl, **clip, **common)
        return policy_loss(**logps, clip_center=cfg.clip_center, **kl, **clip, **common)
    logps = dict(logp=logp, alpha_logp=alpha_logp, advantages=advantages, loss_mask=loss_mask)
    if cfg.loss in ("rec", "rec-is"):
        return rec_loss(**logps, importance_weight=cfg.loss == "rec-is", **clip, **common)
    return opmd_loss(**logps, tau_reg=cfg.tau_reg, **common)


def logprobs(cfg: Config, model, seq, rows=slice(None)) -> torch.Tensor:
    """log pi (n, T) of the completions of `seq` (a Batch or a Rollout; its rows `rows`) under `model`, with grad
    when grad is enabled. The engine's one choice of log-prob function:"""
    ids, mask, completion_mask = seq.input_ids[rows], seq.attention_mask[rows], seq.completion_mask[rows]
    with autocast(cfg, ids.device):
        # = logprobs.token_logprobs without the (N, T, V) logits (tests/test_rollout.py, tests/test_gpu_path.py)
        return chunked_token_logprobs(model, ids, mask, completion_mask, cfg.temperature, cfg.truncation)


def sampler(cfg: Config) -> Callable[..., dict]:
    """The engine's one choice of sampling loop (--sampling): rollout.sample, the reference, or decoding.py's static
    KV cache (a CUDA graph on a GPU) where it applies, tested equal (tests/test_fastpath.py)."""
    return sample if cfg.sampling == "plain" else static_sampler(cfg.fast)


def ref_logprobs(cfg: Config, models: Models, ro: Rollout) -> torch.Tensor | None:
    """log pi_ref (N, T) without grad, None without a KL term; under LoRA pi_ref is the policy, adapter off."""
    if cfg.beta == 0:
        return None
    ref = models.ref if models.ref is not None else models.policy
    adapter_off = models.policy.disable_adapter() if models.ref is None else contextlib.nullcontext()
    with torch.no_grad(), adapter_off:
        return logprobs(cfg, ref, ro)


def sampler_mismatch(cfg: Config, policy, batch: Batch, ro: Rollout, refresh: bool, pi_k_logp) -> dict:
    """{"sampler_mismatch": the mean |log alpha while sampling - log alpha of a full forward|} over the loss's
    tokens (all the completion tokens on a step without signal), where the step has both: pi_k's forward at a
    refresh (alpha = pi_k; a forward of its own when no update ran), the recomputed log alpha after it. A large
    value means sampling and training see different models (the KV cache, the fast path, autocast)."""
    if refresh:
        if pi_k_logp is None:
            with torch.no_grad():
                pi_k_logp = logprobs(cfg, policy, batch)  # (N, T)
        forward = pi_k_logp
    elif cfg.alpha_logp_from == "recompute":
        forward = batch.alpha_logp
    else:
        return {}
    on = batch.loss_mask if batch.loss_mask.sum() > 0 else ro.completion_mask  # (N, T)
    gap = (ro.sampler_logp - forward).abs() * on  # (N, T)
    return {"sampler_mismatch": gap.sum().item() / max(on.sum().item(), 1)}


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


class Timer:
    """Seconds per phase of a step, kept out of the maths: `with timer("sample"): ...` adds the block's time
    (`clock`) to seconds["sample"]."""

    def __init__(self, device):
        self.device = device
        self.seconds = dict.fromkeys(("refresh", "sample", "score", "logprob", "update"), 0.0)

    @contextlib.contextmanager
    def __call__(self, phase: str):
        t = clock(self.device)
        try:
            yield
        finally:
            self.seconds[phase] += clock(self.device) - t
