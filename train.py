"""On- and off-policy GRPO on one device: [A]'s Algorithm 1, the step and the loop that runs it.

    python train.py --offpolicy-steps 4

`grpo_step` is step k of Algorithm 1, and the step the loop runs. v = --offpolicy-steps, mu = --inner-steps; B
prompts a step (--prompts-per-step), G completions a prompt (--group-size), N = B x G rows:

  1. draw ahead: alpha <- pi_theta as it stands before step k's update, and the batches of the steps the schedule
     names are sampled now (`steps_to_draw`, `sample_ahead`): a refresh when the queue holds no batch for step k
     (k mod v = 0, or a lost queue: deviation 2), the batches of steps k, ..., k + v - 1; with a constant lag s
     (--lag), the batch of step k + s (at step 0, or after a lost queue, those of steps k, ..., k + s);
  2. sample G completions for each of B prompts from alpha (rollout.generate_batches);
  3. score each with the reward: reward.py's verifier, or reward functions of your own (problems/user_rewards.py);
  4. group-relative advantages within the step's own groups; a group whose rewards are all equal leaves the loss
     (advantage.group_advantages);
  5. log-probs (logprobs.py): log alpha came with the batch (at a refresh, with --alpha-logp-from recompute, it is
     pi_k's), log pi_ref is computed here when beta > 0, log pi_k is the update's first forward;
  6. mu optimizer steps on [A]'s clipped surrogate with its KL term (`update`, objective.policy_loss).

The stale policy is a batch, not a model: between two refreshes alpha does not change, so drawing its v batches
at the refresh is drawing them from the frozen alpha later, and alpha never exists as a second copy of the
weights. A constant lag is the same queue filled one batch a step: step k's batch was drawn at step k - s, by the
weights before that step's update. The batches drawn ahead live in a `rollout.Queue`, which checkpoints hold: a run
killed mid-queue resumes bit for bit.

Two optimisations, each chosen in one line and tested equal to its textbook form: `completion_logprobs` (engine/
chunked_logprobs.py, logprobs.token_logprobs without the N x T x V logits) and `sampling_loop` (engine/decoding.py, a
static KV cache, rollout.sample's loop). Micro-batches are a loop around the same loss (`update`); bfloat16 is an
autocast context. The options -- [B]'s losses, other engines' staleness corrections, RED, the null control -- hang
off one place, "The options" below: `advantages_of` and `loss_of`.

`train` is the run, top to bottom: the settings, the setup, the loop with the step in it, the end. What it keeps
(the run folder, checkpoints, metrics, evaluation, signals) is bookkeeping/'s, called in a line each.

Deviations from [A]:
  1. log pi_k gets no forward of its own: until the step's first optimizer step pi_theta *is* pi_k, so the first
     inner step records logp.detach() of its own forward. At a refresh with --alpha-logp-from recompute alpha is
     pi_k too, and log alpha is that same forward. (MIS or M2PO on a stale step needs all of pi_k before the
     first micro-batch, so there pi_k gets a no-grad pass; a refresh step without signal runs no update, and its
     sampler_mismatch figure costs one forward.)
  2. A step whose batch is missing from the queue (its sampling failed, a checkpoint without one) samples the rest
     of its cycle, steps k, ..., up to the next multiple of v, or with --lag s steps k, ..., k + s, from pi_theta
     then.
  3. A group whose rewards are all equal leaves the loss whole, its KL term included: the KL is averaged over the
     loss's tokens, so beta pulls only on the groups that carry signal (--no-mask-zero-std keeps them in).
  4. Held-out accuracy is greedy (temperature 0), the usual way to report it; training samples at --temperature.
  5. A run whose steps keep going non-finite stops (exit status 3), and weights that are not finite are never
     saved; bad input exits 2, Ctrl-C 130, SIGTERM 143, each with one line (docs/failure-modes.md).
"""

import contextlib
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm import tqdm

from advantage import group_advantages, red_drop, red_weight
from bookkeeping.checkpoint import rng_state, save_checkpoint, set_rng_state
from bookkeeping.evaluation import eval_line, evaluation, logged_rows
from bookkeeping.failures import (
    Diverged,
    Stopped,
    check_finite_weights,
    out_of_memory,
    signals_wait,
    stop_if_diverged,
    stop_on_signals,
    where_the_run_stands,
)
from bookkeeping.metrics import StepStats, Timer, metrics_row, reward_metrics, show
from bookkeeping.resume import newest_intact, restore, run_state
from bookkeeping.run_io import RunWriter
from config import Config, ConfigError, config_from_args, parse_args, validate
from engine.chunked_logprobs import chunked_token_logprobs
from engine.compiled import compile_hot_paths, compile_line, compile_seconds
from engine.decoding import sampling_path, static_loop
from engine.policy import (
    Models,
    auto_micro_batch,
    auto_sample_rows,
    autocast,
    available_bytes,
    load_policy,
    make_models,
)
from objective import aggregation_total, masked_mean, policy_loss
from problems.prompts import Draw, PromptStream, fit_to_context, load_problems, run_rewards, warn_of_overlap
from problems.tasks import TaskError, prompt_record, render_prompt
from problems.user_rewards import RewardError
from rollout import Queue, Rollout, Sampled, end_ids, generate_batches, sample
from variants.corrections import correction_args, m2po_keep_mask, mis_keep_mask, opsm_keep_mask, staleness_stats
from variants.reinforce import opmd_loss, rec_loss

# ---- one step of Algorithm 1 -----------------------------------------------------------------------------------


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

    refresh: bool  # this step sampled batches ahead (periodic: a refresh; --lag: every step but the last s)
    sampled_at: int  # the step whose weights sampled this step's batch
    rollout: Rollout
    rewards: torch.Tensor  # (N,)
    batch: Batch
    stats: dict  # the update's averages (or skipped_no_signal when no group had signal), and sampler_mismatch
    times: dict  # seconds: sample, score, logprob, update (bookkeeping.metrics.Timer)


def grpo_step(
    cfg: Config,
    models: Models,
    tokenizer,
    k: int,
    gen: torch.Generator,
    queue: Queue | None,
    draw: Callable[[int, int, int], list],  # draw(k, n, now): n batches from step k on, drawn at step now
    *,
    ignore_eos: bool = False,
) -> tuple[StepResult, Queue]:
    """Step k of Algorithm 1 (the module docstring's steps 1-6); returns what it did and the queue the next step
    reads.

    Args:
        models: pi_theta, its optimizer and pi_ref (engine.policy.make_models).
        tokenizer: gives the EOS and pad ids.
        gen: the sampling generator (also drives RED-Drop and --reward-shuffle).
        queue: the batches drawn ahead (None at the start).
        draw: (k, n, now) -> the (prompt_ids, prompt_mask, reward_fn) of steps k, ..., k + n - 1, drawn at step
            `now`: prompts (B, P) left-padded on the policy's device, reward_fn: Rollout -> (N,) rewards. Called
            when a step draws ahead.
        ignore_eos: sample fixed-length completions (the benchmark).
    Raises FloatingPointError when the sampler's logits are not finite (a diverged policy).
    """
    timer = Timer(next(models.policy.parameters()).device)

    # 1-3. draw ahead: alpha <- pi_theta, before step k's update, samples and scores the batches of the steps the
    # schedule names, now. The used batches leave the queue first; a lost queue starts again at k (deviation 2).
    queue = queue.from_step(k) if queue is not None and queue.covers(k) else Queue(k, [])
    ahead = steps_to_draw(cfg, k, queue)
    refresh = len(ahead) > 0
    if refresh:
        drawn = sample_ahead(cfg, models.policy, tokenizer, k, ahead, draw, gen, timer, ignore_eos=ignore_eos)
        queue = Queue(queue.start, queue.batches + drawn)
    sampled = queue.batches[0]  # step k's
    ro, rewards = sampled.rollout, sampled.rewards

    # 4. group-relative advantages within the step's own groups; the groups whose rewards are all equal leave the loss
    with timer("score"):
        advantages, valid = advantages_of(cfg, rewards, gen)  # (N,) each
        batch = Batch(
            input_ids=ro.input_ids,
            attention_mask=ro.attention_mask,
            completion_mask=ro.completion_mask,
            loss_mask=ro.completion_mask * valid[:, None],
            advantages=advantages,
            alpha_logp=sampled.alpha_logp,
        )

    # 5. log-probs: log alpha came with the batch (sample_ahead; None if sampled now: alpha = pi_k), log pi_k is the
    # update's first forward (update); here log pi_ref, a constant, the KL term's reference
    with timer("logprob"):
        ref_logp = ref_logprobs(cfg, models, ro, k)  # (N, T), None without a KL term

    # 6. mu optimizer steps on the loss
    with timer("update"):
        if batch.loss_mask.sum() > 0:
            stats, pi_k_logp = update(cfg, models.policy, models.opt, batch, ref_logp)
        else:  # every group had equal rewards: no optimizer step
            stats, pi_k_logp = {"nonfinite_updates": 0, "skipped_no_signal": 1}, None
        stats |= sampler_mismatch(cfg, models.policy, batch, ro, sampled.sampled_at == k, pi_k_logp)
    return StepResult(refresh, sampled.sampled_at, ro, rewards, batch, stats, timer.seconds), queue


def steps_to_draw(cfg: Config, k: int, queue: Queue) -> range:
    """The schedule: the steps whose batches step k samples ahead, from pi_theta before its update. `queue` holds
    the batches from step k on. One queue, two schedules:

      periodic (--offpolicy-steps v): none while the queue holds step k's batch; else a refresh, steps k, ..., up
          to the next multiple of v. Step k's batch was sampled at k - (k mod v): staleness 0, 1, ..., v - 1.
      constant (--lag s): every step up to k + s not yet drawn: at step 0 (or after a lost queue) steps 0, ..., s;
          then step k + s alone. Step k's batch was sampled at max(0, k - s): staleness min(k, s).

    No step past the run's last is drawn. --lag s over its first s + 1 steps is --offpolicy-steps s + 1."""
    if cfg.lag is not None:
        last = k + cfg.lag
    elif queue.covers(k):
        return range(0)
    else:
        last = (k // cfg.offpolicy_steps + 1) * cfg.offpolicy_steps - 1
    return range(queue.end, min(last + 1, cfg.steps))


def sample_ahead(cfg: Config, policy, tokenizer, k: int, ahead: range, draw, gen, timer, *, ignore_eos=False) -> list:
    """Steps 1-3 at step k for the steps `ahead` at once, from alpha = pi_theta now (before step k's update):
    one `Sampled` a step, in order.

    draw(first, n, now=k): one (prompt_ids, prompt_mask, reward_fn) per step, in the order the steps would have
    drawn them; the reward functions see step k as trainer_state.global_step.
    log alpha (--alpha-logp-from) comes with each batch, computed now, by the weights that sample it: `recompute`,
    a no-grad forward of pi_theta over each batch drawn ahead (step k's own batch, where drawn now, has alpha =
    pi_k, whose log-probs its update's first forward records: None here); or `sampler`, the log-probs `generate`
    recorded while sampling, for every batch. Raises FloatingPointError when the sampler's logits are not finite (a
    diverged policy).
    """
    draws = draw(ahead.start, len(ahead), now=k)
    policy.eval()
    rows = sum(ids.shape[0] for ids, _, _ in draws) * cfg.group_size  # the cycle's completions
    longest = max(ids.shape[1] for ids, _, _ in draws) + cfg.max_new_tokens  # a row's prompt and completion
    # As few calls as memory allows.
    max_rows = cfg.sample_rows or auto_sample_rows(policy, rows, longest, cfg.autocast_dtype)
    with timer("sample"), autocast(cfg, draws[0][0].device):
        rollouts = generate_batches(
            policy,
            [(ids, mask) for ids, mask, _ in draws],
            group_size=cfg.group_size,
            max_rows=max_rows,
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            truncation=cfg.truncation,
            eos_token_id=end_ids(policy, tokenizer),
            pad_token_id=tokenizer.pad_token_id,
            generator=gen,
            ignore_eos=ignore_eos,
            loop=sampling_loop(cfg),
        )
    with timer("score"):
        rewards = [reward_fn(ro) for ro, (_, _, reward_fn) in zip(rollouts, draws)]  # (N,) each
    with timer("logprob"), torch.no_grad():
        batches = []
        for step, ro, r in zip(ahead, rollouts, rewards):
            if cfg.alpha_logp_from == "sampler":
                alpha_logp = ro.sampler_logp
            elif step == k:
                alpha_logp = None  # alpha = pi_k: the update's first forward gives log alpha
            else:
                alpha_logp = completion_logprobs(cfg, policy, ro)  # (N, T)
            batches.append(Sampled(ro, r, alpha_logp, sampled_at=k))
    return batches


def update(cfg: Config, policy, opt, batch: Batch, ref_logp) -> tuple[dict, torch.Tensor]:
    """Step 6: mu = --inner-steps optimizer steps on the batch's loss (`loss_of`), each one's gradient accumulated
    over micro-batches of --micro-batch rows. Returns the statistics, averaged over tokens and inner steps, and log
    pi_k (N, T): the first inner step's log-probs, taken before any optimizer step moved the policy (with MIS or
    M2PO on a stale step, `mask_prepass`'s).

    Each micro-batch's loss is divided by the whole step's normaliser (`total`), so their summed gradients equal the
    whole batch's. Dropout is off in every pass (engine.policy.fit_policy), so that pi_theta, pi_k and alpha are one
    network: with dropout, rho would differ from 1 even where pi_theta = alpha (TRL's `disable_dropout` too).
    """
    n, loss_mask = batch.input_ids.shape[0], batch.loss_mask
    length = batch.input_ids.shape[1]
    mb = cfg.micro_batch or auto_micro_batch(policy, n, length, cfg.gradient_checkpointing, cfg.autocast_dtype)
    micro_batches = [slice(s, s + mb) for s in range(0, n, mb)]
    policy.train(cfg.gradient_checkpointing)  # checkpointing acts in train mode only; dropout is 0 either way
    pi_k_logp, total = None, aggregation_total(loss_mask, cfg.agg, cfg.max_new_tokens)
    m2po_keep = None  # (N, T) the tokens M2PO keeps, the whole step's; None: all (alpha = pi_k: every M2 is 0)
    if (cfg.is_mask is not None or cfg.m2_threshold is not None) and batch.alpha_logp is not None:
        pi_k_logp, m2po_keep, total = mask_prepass(cfg, policy, batch, micro_batches)
    stats = StepStats()
    for i in range(cfg.inner_steps):
        opt.zero_grad(set_to_none=True)
        pi_k_parts = []  # log pi_k of each micro-batch, recorded by the first inner step
        for rows in micro_batches:
            if i > 0 and loss_mask[rows].sum() == 0:
                continue  # no token in the loss here: zero gradient (the first inner step runs it all for log pi_k)
            logp = completion_logprobs(cfg, policy, batch, rows)  # (mb, T) log pi_theta, with grad
            # The micro-batch's rows of log pi_k, log alpha and log pi_ref, each (mb, T):
            pi_k_logp_mb = logp.detach() if pi_k_logp is None else pi_k_logp[rows]  # pi_theta is pi_k until a step
            alpha_logp_mb = pi_k_logp_mb if batch.alpha_logp is None else batch.alpha_logp[rows]  # None: a refresh
            ref_logp_mb = None if ref_logp is None else ref_logp[rows]
            loss, st = loss_of(
                cfg,
                logp,
                alpha_logp_mb,
                pi_k_logp_mb,
                ref_logp_mb,
                batch.advantages[rows],
                loss_mask[rows],
                total,
                m2po_keep=None if m2po_keep is None else m2po_keep[rows],
            )
            loss.backward()
            stats.add(loss, st)
            pi_k_parts.append(pi_k_logp_mb)
        if pi_k_logp is None:
            pi_k_logp = torch.cat(pi_k_parts)  # (N, T)
        norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm)
        if torch.isfinite(norm):
            opt.step()
        stats.optimizer_step(norm)  # a non-finite gradient takes no optimizer step
    # rho' = pi_k / alpha does not depend on pi_theta: its quantiles, max and the TIS / MIS fractions are the whole
    # step's, exact whatever the micro-batching.
    alpha_logp = pi_k_logp if batch.alpha_logp is None else batch.alpha_logp
    staleness = staleness_stats(
        alpha_logp, pi_k_logp, loss_mask, is_cap=cfg.is_cap, is_mask=cfg.is_mask, is_level=cfg.is_level
    )
    if cfg.m2_threshold is not None:  # the share of the loss's tokens M2PO dropped, the whole step's
        dropped = 0 if m2po_keep is None else ((loss_mask > 0) & ~m2po_keep).sum().item()
        staleness["m2po_masked_frac"] = dropped / max(loss_mask.sum().item(), 1)
    return stats.result(staleness) | {"micro_batch": mb}, pi_k_logp


def completion_logprobs(cfg: Config, model, seq, rows=slice(None)) -> torch.Tensor:
    """log pi (n, T) of the completions of `seq` (a Batch or a Rollout; its rows `rows`) under `model`, with grad
    when grad is enabled, under the run's autocast. The one choice of log-prob function: chunked_token_logprobs is
    logprobs.token_logprobs without the (N, T, V) logits (tests/test_rollout.py, tests/test_gpu_path.py)."""
    ids, mask, completion_mask = seq.input_ids[rows], seq.attention_mask[rows], seq.completion_mask[rows]
    with autocast(cfg, ids.device):
        return chunked_token_logprobs(model, ids, mask, completion_mask, cfg.temperature, cfg.truncation)


@contextlib.contextmanager
def evaluating(model):
    """A no-grad pass in eval mode, the model's mode restored after. The update leaves the policy in train mode
    (gradient checkpointing acts there only), where some transformers versions drop the KV cache that the chunked
    log-prob's shared-prompt pass uses: pi_ref's and MIS's forwards must not depend on what the update left."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def sampling_loop(cfg: Config) -> Callable[..., dict]:
    """The one choice of sampling loop (--sampling): rollout.sample, the reference, or engine/decoding.py's static
    KV cache (a CUDA graph on a GPU) where it applies, tested equal (tests/test_fastpath.py)."""
    return sample if cfg.sampling == "plain" else static_loop(cfg.fast)


def ref_logprobs(cfg: Config, models: Models, ro: Rollout, k: int) -> torch.Tensor | None:
    """log pi_ref (N, T) at step k without grad, None without a KL term; under LoRA pi_ref is the policy, adapter
    off. --ref-refresh R: pi_ref <- pi_theta first, every R steps."""
    if models.ref is not None and cfg.ref_refresh and k > 0 and k % cfg.ref_refresh == 0:
        models.ref.load_state_dict(models.policy.state_dict())
    if cfg.beta == 0:
        return None
    ref = models.ref if models.ref is not None else models.policy
    adapter_off = models.policy.disable_adapter() if models.ref is None else contextlib.nullcontext()
    with evaluating(ref), adapter_off:
        return completion_logprobs(cfg, ref, ro)


def sampler_mismatch(cfg: Config, policy, batch: Batch, ro: Rollout, sampled_now: bool, pi_k_logp) -> dict:
    """{"sampler_mismatch": the mean |log alpha while sampling - log alpha of a full forward|} over the loss's
    tokens (all the completion tokens on a step without signal), where the step has both: pi_k's forward for a
    batch sampled at its own step (alpha = pi_k; a forward of its own when no update ran), the recomputed log alpha
    of a batch drawn ahead. A large value means sampling and training see different models (the KV cache, the fast
    path, autocast)."""
    if sampled_now:
        if pi_k_logp is None:
            with evaluating(policy):
                pi_k_logp = completion_logprobs(cfg, policy, batch)  # (N, T)
        forward = pi_k_logp
    elif cfg.alpha_logp_from == "recompute":
        forward = batch.alpha_logp
    else:
        return {}
    on = batch.loss_mask if batch.loss_mask.sum() > 0 else ro.completion_mask  # (N, T)
    gap = (ro.sampler_logp - forward).abs() * on  # (N, T)
    return {"sampler_mismatch": gap.sum().item() / max(on.sum().item(), 1)}


# ---- the options: [B]'s losses, other engines' staleness corrections, RED, the null control (variants/) ----------


def advantages_of(cfg: Config, rewards: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 4: the advantages and the valid mask (advantage.group_advantages), with [B]'s data shaping where asked:
    AsymRE's shifted baseline (--asymre-shift), RED-Drop or RED-Weight (--red); --reward-shuffle, the null control,
    credits each reward to a random sample of the step."""
    # The group statistics square the rewards in float32: rewards that each fit it can still overflow them
    # (|r| ~ 1e20), and every advantage would silently be 0 or NaN.
    if not torch.isfinite(rewards.float().square().sum()):
        big = rewards.abs().max().item()
        raise RewardError(f"--reward: a reward of {big:.3g} is beyond what float32 group statistics hold; rescale it")
    if cfg.reward_shuffle:
        rewards = rewards[torch.randperm(rewards.numel(), generator=gen, device=rewards.device)]  # (N,)
    keep = red_drop(rewards, cfg.group_size, gen) if cfg.red == "drop" else None
    advantages, valid = group_advantages(
        rewards,
        cfg.group_size,
        mask_zero_std=cfg.mask_zero_std,
        scale_std=cfg.loss in ("grpo", "rec", "rec-is") and cfg.asymre_shift == 0.0,  # OPMD, AsymRE: r - mean(r)
        baseline_shift=cfg.asymre_shift,
        keep=keep,
    )
    if cfg.red == "weight":
        advantages = red_weight(advantages, cfg.red_tau)
    return advantages, valid


def loss_of(cfg: Config, logp, alpha_logp, pi_k_logp, ref_logp, advantages, loss_mask, total, *, m2po_keep=None):
    """A micro-batch's loss and statistics: [A]'s clipped surrogate with its KL term (objective.policy_loss), where
    another engine's staleness correction enters as the arguments it changes (variants/corrections.py); or, with
    --loss, one of [B]'s losses (variants/reinforce.py). m2po_keep: the micro-batch's rows of M2PO's kept tokens,
    computed on the whole step (`mask_prepass`); None: all."""
    if cfg.loss == "grpo":
        # correction_args gives TIS's weight and MIS's kept tokens: both None (the plain surrogate) by default.
        args = correction_args(
            alpha_logp,
            pi_k_logp,
            loss_mask,
            clip_center=cfg.clip_center,
            is_cap=cfg.is_cap,
            is_mask=cfg.is_mask,
            is_level=cfg.is_level,
        )
        if m2po_keep is not None:  # a token stays where MIS and M2PO both keep it
            args["keep"] = m2po_keep if args["keep"] is None else args["keep"] & m2po_keep
        # OPSM: by this forward's pi_theta, so per inner step; a whole sequence, so exact in any micro-batch
        opsm_keep = (
            None if cfg.opsm_delta is None else opsm_keep_mask(alpha_logp, logp, advantages, loss_mask, cfg.opsm_delta)
        )
        loss, st = policy_loss(
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
            total=total,
            keep_objective=opsm_keep,
            **args,
        )
        if opsm_keep is not None:  # the share of the loss's tokens whose surrogate term OPSM dropped
            st["opsm_masked_frac"] = masked_mean((~opsm_keep).expand_as(loss_mask).double(), loss_mask)
        return loss, st
    if cfg.loss in ("rec", "rec-is"):
        return rec_loss(
            logp,
            alpha_logp,
            advantages,
            loss_mask,
            clip_eps=cfg.clip_eps,
            clip_eps_high=cfg.clip_eps_high,
            importance_weight=cfg.loss == "rec-is",
            agg=cfg.agg,
            max_new_tokens=cfg.max_new_tokens,
            total=total,
        )
    return opmd_loss(
        logp,
        alpha_logp,
        advantages,
        loss_mask,
        tau_reg=cfg.tau_reg,
        agg=cfg.agg,
        max_new_tokens=cfg.max_new_tokens,
        total=total,
    )


def mask_prepass(cfg: Config, policy, batch: Batch, micro_batches: list[slice]):
    """MIS (--is-mask) and M2PO (--m2-threshold) on a stale step: log pi_k (N, T) from a no-grad pass over the whole
    batch, M2PO's kept tokens (N, T) (None without it), and the loss's normaliser over the tokens both keep. Each
    drops tokens by pi_k against alpha -- M2PO by a ranking of the whole step's tokens -- and the dropped ones leave
    the normaliser, so every micro-batch needs pi_k of the whole step before the first one."""
    with evaluating(policy):
        pi_k_logp = torch.cat([completion_logprobs(cfg, policy, batch, rows) for rows in micro_batches])  # (N, T)
    keep = mis_keep_mask(batch.alpha_logp, pi_k_logp, cfg.is_mask, loss_mask=batch.loss_mask, is_level=cfg.is_level)
    m2po_keep = None
    if cfg.m2_threshold is not None:
        m2po_keep = m2po_keep_mask(batch.alpha_logp, pi_k_logp, batch.loss_mask, cfg.m2_threshold)  # (N, T)
        keep = keep & m2po_keep  # (N, T)
    return pi_k_logp, m2po_keep, aggregation_total(batch.loss_mask * keep, cfg.agg, cfg.max_new_tokens)


def queue_batch_bytes(cfg: Config, prompt_len: int) -> int:
    """The most bytes one batch in the queue holds (rollout.Sampled), N = B x G rows, P = prompt_len (the longest
    prompt), T = --max-new-tokens: prompt_ids and prompt_mask (N, P) and completion_ids and completion_mask (N, T),
    int64 each; sampler_logp and entropy (N, T) float32 each; truncated (N,) bool; rewards (N,) float32; under
    --alpha-logp-from recompute, log alpha (N, T) float32 (under sampler it is sampler_logp itself):

        N x (16 P + 24 T + 5) bytes, + 4 N T with recompute.
    """
    n, t = cfg.prompts_per_step * cfg.group_size, cfg.max_new_tokens
    return n * (16 * prompt_len + 24 * t + 5) + (4 * n * t if cfg.alpha_logp_from == "recompute" else 0)


def check_queue_fits(cfg: Config, tokenizer, train_set, device: torch.device) -> None:
    """Refuse a queue that cannot fit: s + 1 batches (--lag s) or v (--offpolicy-steps v), at most --steps, each at most
    `queue_batch_bytes`, must take no more than half the memory free on the device now (the rest is sampling's and
    the update's). CUDA: what the driver and the allocator leave (engine.policy.available_bytes); a CPU: Linux's
    MemAvailable (os.sysconf's available pages elsewhere)."""
    held = min(cfg.lag + 1 if cfg.lag is not None else cfg.offpolicy_steps, cfg.steps)  # none past the last step
    if held == 1:
        return  # on-policy: the step's own batch, as any run holds
    texts = [render_prompt(tokenizer, p) for p in train_set]
    longest = max(len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"])
    per_batch = queue_batch_bytes(cfg, longest)
    free = available_bytes(device) if device.type == "cuda" else host_available_bytes()
    if held * per_batch > free / 2:
        flag = f"--lag {cfg.lag}" if cfg.lag is not None else f"--offpolicy-steps {cfg.offpolicy_steps}"
        raise ConfigError(
            f"{flag}: the queue of {held} batches drawn ahead needs {held * per_batch / 1e9:.3g} GB ({held} x "
            f"{per_batch / 1e6:.3g} MB), more than half the {free / 1e9:.3g} GB free on {device}; lower it, or "
            f"--prompts-per-step, --group-size, --max-new-tokens"
        )


def host_available_bytes() -> int:
    """The CPU memory a process can take now: Linux's MemAvailable, else the free pages os.sysconf reports."""
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


# ---- the run ------------------------------------------------------------------------------------------------------


def lr_at(cfg: Config, k: int) -> float:
    """The learning rate of step k (every inner step of it), as transformers' schedulers give it for optimizer step
    k (TRL's lr_scheduler_type): a warm-up from 0 over the first W = ceil(--warmup-ratio x --steps) steps, then
    constant, linear to 0 or cosine to 0 at --steps. A function of the step alone: a resume needs no state."""
    warmup = math.ceil(cfg.warmup_ratio * cfg.steps)
    if k < warmup:
        return cfg.lr * (float(k) / float(max(1, warmup)))
    if cfg.lr_scheduler == "constant":
        return cfg.lr
    if cfg.lr_scheduler == "linear":
        return cfg.lr * max(0.0, float(cfg.steps - k) / float(max(1, cfg.steps - warmup)))
    progress = float(k - warmup) / float(max(1, cfg.steps - warmup))
    return cfg.lr * max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


def train(cfg: Config) -> dict:
    """Run GRPO as configured, top to bottom: the settings, the setup, resume or the first evaluation, the loop with
    the step in it, the end. Returns the summary (also written to --out/summary.json)."""
    # ---- the settings: the flags, the seeds, the rewards and the data (bad input fails here, before any write) ----
    validate(cfg)
    from transformers import set_seed  # here: transformers (and peft through it) take seconds to import (--help)

    set_seed(cfg.seed)  # Python's, numpy's and torch's generators, as TRL seeds them (a reward may use any)
    rewards = run_rewards(cfg)
    train_set, heldout = load_problems(cfg, rewards)
    # --out, claimed: a folder holding another run or files of the user's, or one another process writes, is refused;
    # nothing in it is written or deleted before writer.open below
    with RunWriter(cfg, open_now=False) as writer:
        # ---- the setup: the policy, its optimizer and pi_ref; the prompts that fit; the sampling generator ----
        device = torch.device(cfg.device)
        warn_of_overlap(train_set, heldout, log=writer.log)
        policy, tokenizer = load_policy(cfg, log=writer.log)  # the built-in tiny policy, or a transformers causal LM
        train_set, heldout = fit_to_context(cfg, policy, tokenizer, train_set, heldout, log=writer.log)
        models = make_models(cfg, policy.to(cfg.device))
        if cfg.compile:  # the fast sampler's step and the head's chunk functions, compiled at their first calls
            compile_hot_paths()
        check_queue_fits(cfg, tokenizer, train_set, device)  # the batches drawn ahead: a queue that cannot fit refused
        picked = newest_intact(cfg, writer) if cfg.resume else None  # verified; a --steps below the run's refused
        # Every check that can refuse the run has passed: now --overwrite deletes the old run, and the new one starts.
        writer.open({"reward_names": rewards.names, **prompt_record(tokenizer, train_set[0])})
        v, s = cfg.offpolicy_steps, cfg.lag
        if s:
            schedule = f"at each step k the batch of step k + {s}, a constant lag (log alpha: {cfg.alpha_logp_from})"
        elif v > 1:
            schedule = f"every {v} steps, the next {v} batches at once (log alpha: {cfg.alpha_logp_from})"
        else:
            schedule = "every step"
        writer.log(f"sampling path: {sampling_path(models.policy, cfg.fast)}; the policy samples {schedule}")
        gen = torch.Generator(device=device).manual_seed(cfg.seed)  # the sampling generator
        stream = PromptStream(train_set, cfg.seed)
        draw = Draw(cfg, tokenizer, stream, rewards, device)  # the prompts of a refresh's steps, and their scorers

        def evaluate(at_step: int) -> dict:  # held-out metrics after step at_step (-1: before training)
            loop = sampling_loop(cfg)  # the sampling loop training uses
            return evaluation(cfg, models.policy, tokenizer, heldout, device, rewards, at_step, writer, loop)

        # ---- resume, or evaluate the starting policy (no random number of the sampling generator is drawn) ----
        # A resumed run keeps its wall clock and its start's held-out metrics, so its summary reads like one run's.
        start_step, wall_before, queue, start = 0, 0.0, None, {}
        if cfg.resume:
            start_step, start, wall_before, queue, draw.scored = restore(cfg, models, gen, stream, writer, picked)
        t0 = time.time() - wall_before
        if not cfg.resume and cfg.eval_start:
            start = evaluate(-1)
        if start:
            writer.log(eval_line(cfg, start, len(heldout)))

        def checkpoint(done: int) -> None:  # the run after `done` steps, written atomically; Ctrl-C waits for it
            check_finite_weights(models.policy, f"step {done - 1}")
            state = run_state(models, gen, stream, queue, done, start, time.time() - t0, draw.scored)
            with signals_wait():
                save_checkpoint(cfg.out, state, done, cfg.keep_checkpoints, writer.manifest)

        # ---- the loop: step k of Algorithm 1, its metrics row, held-out evaluation, divergence guard, checkpoints ----
        nonfinite = []  # the steps whose update was skipped as not finite (stop_if_diverged)
        bar = tqdm(
            range(start_step, cfg.steps),
            desc="grpo",
            dynamic_ncols=True,
            disable=not cfg.progress,
            initial=start_step,
            total=cfg.steps,
        )
        for k in bar:
            t_step = time.time()
            for group in models.opt.param_groups:  # --lr-scheduler: a function of the step
                group["lr"] = lr_at(cfg, k)
            before = rng_state(gen), stream.position
            try:
                res, queue = grpo_step(cfg, models, tokenizer, k, gen, queue, draw)
            except FloatingPointError:  # the sampler's logits are not finite: a diverged policy, a non-finite step
                writer.metrics({"step": k, "wall_s": time.time() - t0, "nonfinite_updates": 1, "nonfinite_logits": 1})
                nonfinite.append(k)
                stop_if_diverged(nonfinite, k)
                continue
            except RewardError:  # a reward failed at step k's refresh, before any update: --resume redoes step k
                if k > 0:
                    set_rng_state(before[0], gen)
                    stream.position = before[1]
                    checkpoint(k)
                raise
            row = metrics_row(k, res, cfg.group_size, time.time() - t0, time.time() - t_step, device)
            scores = draw.scored.pop(k, None)
            row.update(lr=lr_at(cfg, k), **reward_metrics(scores, rewards.names))
            row.update(sampled_at=res.sampled_at, staleness=k - res.sampled_at)  # the queue's schedule, as it ran
            if cfg.compile:
                row.update(compile_s=compile_seconds())  # torch.compile's seconds so far (most in step 0)
            if cfg.log_completions:
                writer.completions(logged_rows(cfg, tokenizer, k, res, scores, rewards.names))
            if cfg.eval_every and (k + 1) % cfg.eval_every == 0 and k + 1 < cfg.steps:
                try:
                    row.update(evaluate(k))
                except RewardError:  # a reward failed on the held-out set after step k's update: resume after step k
                    writer.metrics(row)
                    checkpoint(k + 1)
                    raise
            writer.metrics(row)
            show(bar, row)
            if res.stats.get("nonfinite_updates"):
                nonfinite.append(k)
            stop_if_diverged(nonfinite, k)
            # No checkpoint of a non-finite step, nor of weights that are not finite: the newest one stays a good one.
            if cfg.save_every and (k + 1) % cfg.save_every == 0 and k not in nonfinite:
                checkpoint(k + 1)

        # ---- the end: held-out accuracy, summary.json, final/ and curves.png ----
        if nonfinite and len(nonfinite) == cfg.steps - start_step:  # no update was applied: no result to report
            raise Diverged(
                f"steps {start_step}-{cfg.steps - 1}: loss or gradient not finite at every step, no update applied; "
                "stopping (try a lower --lr)"
            )
        check_finite_weights(models.policy, "the end of the run")
        try:
            end = evaluate(cfg.steps - 1)
        except RewardError:  # a reward failed on the held-out set: every step is done, --resume redoes the end
            checkpoint(cfg.steps)
            raise
        summary = {f"{key}_{when}": m.get(key) for key in end for when, m in (("start", start), ("end", end))}
        summary.update(steps=cfg.steps, wall_s=time.time() - t0, eval_size=len(heldout), out=str(writer.out))
        writer.log(eval_line(cfg, end, len(heldout), start=start))
        if cfg.compile:
            writer.log(compile_line())
        with signals_wait():
            writer.finish(models.policy, tokenizer, summary)
        return summary


def main(argv: list[str] | None = None) -> int:
    """The CLI. Every expected failure is one line on stderr: exit 2 for bad input (or a disk that fails), 3 for a
    diverged run, 130 for Ctrl-C and 143 for SIGTERM."""
    with stop_on_signals():
        args, given = parse_args(argv)
        cfg = None
        try:
            cfg = config_from_args(args, given)
            train(cfg)
        except (ConfigError, TaskError, RewardError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        except Diverged as e:  # not bad input: its own status, so scripts can tell the two apart
            print(f"error: {e}", file=sys.stderr)
            return 3
        except Stopped as e:
            where = "" if cfg is None else f"; {where_the_run_stands(cfg.out, cfg.steps)}"
            print(f"stopped by {e}{where}", file=sys.stderr)
            return e.exit_status
        except torch.OutOfMemoryError as e:
            print(f"error: {out_of_memory(cfg, e)}", file=sys.stderr)
            return 2
        except OSError as e:  # a full disk, a folder made read-only under the run, ...
            where = "" if cfg is None else f"; {where_the_run_stands(cfg.out, cfg.steps)}"
            print(f"error: {e}{where}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
