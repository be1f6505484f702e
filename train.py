"""On- and off-policy GRPO on one device: [A]'s Algorithm 1, the step and the loop that runs it.

    python train.py --offpolicy-steps 4

`grpo_step` is step k of Algorithm 1, and the step the loop runs. v = --offpolicy-steps, mu = --inner-steps; B
prompts a step (--prompts-per-step), G completions a prompt (--group-size), N = B x G rows. Its six stages
("step" is always step k; mu "inner steps" are the optimizer steps of stage 6):

  1. draw ahead: when the queue holds no batch for step k (k mod v = 0), alpha <- pi_theta as it stands before
     step k's update, and the batches of steps k, ..., k + v - 1 are sampled now (`steps_to_draw`, the schedule;
     `sample_ahead`); with a constant lag s (--lag), every step draws the batch of step k + s;
  2. sample G completions for each of B prompts from alpha (rollout.generate_batches);
  3. score each with the reward: reward.py's verifier, or reward functions of your own (problems/user_rewards.py);
  4. group-relative advantages within the step's own groups; a group whose rewards are all equal leaves the loss
     (advantage.group_advantages);
  5. log-probs (logprobs.py): log alpha came with the batch (for step k's own batch at a refresh it is pi_k's,
     the update's first forward), log pi_ref is computed here when beta > 0, log pi_k is the update's first forward;
  6. mu optimizer steps on [A]'s clipped surrogate with its KL term (`update`, objective.policy_loss).

The stale policy is a batch, not a model: between two refreshes alpha does not change, so drawing its v batches
at the refresh is drawing them from the frozen alpha later, and alpha never exists as a second copy of the
weights. A constant lag is the same queue filled one batch a step: step k's batch was drawn at step k - s, by the
weights before that step's update. The batches drawn ahead live in a `rollout.Queue`, which checkpoints hold: a run
killed mid-queue resumes bit for bit.

The variants (other engines' corrections, [B]'s losses and data shaping, the null control) are variants/'s named
units, chosen from the flags once a run (`variants.recipe`); the step calls its stages 4 and 6 through that
`Recipe` and never reads a variant's flag. The harness between steps (metrics, evaluation, checkpoints, failures)
is bookkeeping/harness.py's, one call a stage. Two optimisations, each chosen in one line and tested equal to its
textbook form: `completion_logprobs` (engine/chunked_logprobs.py, logprobs.token_logprobs without the N x T x V
logits) and `sampling_loop` (engine/decoding.py, a static KV cache, rollout.sample's loop). Micro-batches are a
loop around the same loss (`update`); bfloat16 is an autocast context.

Deviations from [A]:
  1. log pi_k gets no forward of its own: until the step's first optimizer step pi_theta *is* pi_k, so the first
     inner step records logp.detach() of its own forward. At a refresh with --alpha-logp-from recompute alpha is
     pi_k too, and log alpha is that same forward. (A variant that keeps tokens by pi_k against alpha, MIS or M2PO,
     needs all of pi_k before the first micro-batch of a stale step: there pi_k gets a no-grad pass.)
  2. A step whose batch is missing from the queue (its sampling failed, a checkpoint without one) samples the rest
     of its refresh period, steps k, ..., up to the next multiple of v, or with --lag s steps k, ..., k + s, from
     pi_theta then.
  3. A group whose rewards are all equal leaves the loss whole, its KL term included: the KL is averaged over the
     loss's tokens, so beta pulls only on the groups that carry signal (--no-mask-zero-std keeps them in).
  4. Held-out accuracy is greedy (temperature 0), the usual way to report it; training samples at --temperature.
  5. A run whose steps keep going non-finite stops (exit status 3), and weights that are not finite are never
     saved; bad input exits 2, Ctrl-C 130, SIGTERM 143, each with one line (docs/failure-modes.md).
"""

import contextlib
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

import variants
from bookkeeping.diagnostics import drift_stats
from bookkeeping.failures import Diverged, Stopped, out_of_memory, stop_on_signals, where_the_run_stands
from bookkeeping.harness import Harness
from bookkeeping.metrics import StepStats, Timer
from bookkeeping.resume import newest_intact
from bookkeeping.run_io import RunWriter
from config import Config, ConfigError, config_from_args, parse_args, validate
from engine.chunked_logprobs import chunked_token_logprobs
from engine.compiled import compile_hot_paths
from engine.decoding import sampling_path, static_loop
from engine.memory import plan_line
from engine.policy import Models, auto_micro_batch, auto_sample_rows, autocast, load_policy, make_models
from engine.queue_fit import check_queue_fits
from objective import LossInput, aggregation_total
from problems.prompts import Draw, PromptStream, fit_to_context, load_problems, run_rewards, warn_of_overlap
from problems.tasks import TaskError, prompt_record
from problems.user_rewards import RewardError
from rollout import Queue, Rollout, Sampled, end_ids, generate_batches, sample
from variants import Recipe

# ---- one step of Algorithm 1 -----------------------------------------------------------------------------------


@dataclass
class Batch:
    """One step's samples as the update reads them."""

    input_ids: torch.Tensor  # (N, P+T) prompts left-padded, then completions
    attention_mask: torch.Tensor  # (N, P+T)
    completion_mask: torch.Tensor  # (N, T) 1 up to and including EOS
    loss_mask: torch.Tensor  # (N, T) completion tokens of the groups with signal: what the loss averages over
    advantages: torch.Tensor  # (N,)
    alpha_logp: torch.Tensor | None  # (N, T) log alpha as recorded when drawn; None: alpha = pi_k (rollout.Sampled)


@dataclass
class StepResult:
    """What `grpo_step` did: the samples, their rewards, the update's statistics, each phase's seconds."""

    drew_ahead: bool  # this step sampled batches (periodic: a refresh; --lag: every step but the last s)
    sampled_at: int  # the step whose weights sampled this step's batch
    rollout: Rollout
    rewards: torch.Tensor  # (N,)
    batch: Batch
    stats: dict  # the update's averages (or skipped_no_signal when no group had signal)
    times: dict  # seconds: sample, score, logprob, update (bookkeeping.metrics.Timer)
    pi_k_logp: torch.Tensor | None  # (N, T) log pi_k, the update's first forward; None when no update ran


def grpo_step(
    cfg: Config,
    models: Models,
    tokenizer,
    k: int,
    gen: torch.Generator,
    queue: Queue | None,
    draw: Callable[[int, int, int], list],  # draw(k, n, now): n batches from step k on, drawn at step now
    *,
    recipe: Recipe | None = None,
    ignore_eos: bool = False,
) -> tuple[StepResult, Queue]:
    """Step k of Algorithm 1 (the module docstring's stages 1-6); returns what it did and the queue the next step
    reads.

    Args:
        models: pi_theta, its optimizer and pi_ref (engine.policy.make_models).
        tokenizer: gives the EOS and pad ids.
        gen: the sampling generator (also drives the variants that draw: RED-Drop, the null control).
        queue: the batches drawn ahead (None at the start).
        draw: (k, n, now) -> the (prompt_ids, prompt_mask, reward_fn) of steps k, ..., k + n - 1, drawn at step
            `now`: prompts (B, P) left-padded on the policy's device, reward_fn: Rollout -> (N,) rewards. Called
            when a step draws ahead.
        recipe: the run's variants (variants.recipe(cfg), built once by the loop; None: built here).
        ignore_eos: sample fixed-length completions (the benchmark).
    Raises FloatingPointError when the sampler's logits are not finite (a diverged policy).
    """
    recipe = variants.recipe(cfg) if recipe is None else recipe
    timer = Timer(next(models.policy.parameters()).device)

    # 1-3. draw ahead: alpha <- pi_theta, before step k's update, samples and scores the batches of the steps the
    # schedule names, now. The used batches leave the queue first; a lost queue starts again at k (deviation 2).
    queue = queue.from_step(k) if queue is not None and queue.covers(k) else Queue(k, [])
    ahead = steps_to_draw(cfg, k, queue)
    if ahead:
        drawn = sample_ahead(cfg, models.policy, tokenizer, k, ahead, draw, gen, timer, ignore_eos=ignore_eos)
        queue = Queue(queue.start, queue.batches + drawn)
    sampled = queue.batches[0]  # step k's
    ro, rewards = sampled.rollout, sampled.rewards

    # 4. group-relative advantages within the step's own groups; the groups whose rewards are all equal leave the loss
    with timer("score"):
        advantages, valid = recipe.advantages(check_rewards(rewards), gen)  # (N,) each
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
            stats, pi_k_logp = update(cfg, models.policy, models.opt, batch, ref_logp, recipe=recipe)
        else:  # every group had equal rewards: no optimizer step
            stats, pi_k_logp = {"nonfinite_updates": 0, "skipped_no_signal": 1}, None
    return StepResult(len(ahead) > 0, sampled.sampled_at, ro, rewards, batch, stats, timer.seconds, pi_k_logp), queue


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
    """Stages 1-3 at step k for the steps `ahead` at once, from alpha = pi_theta now (before step k's update):
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
    rows = sum(ids.shape[0] for ids, _, _ in draws) * cfg.group_size  # the completions drawn now
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
                alpha_logp = no_grad_logprobs(cfg, policy, ro)  # (N, T)
            batches.append(Sampled(ro, r, alpha_logp, sampled_at=k))
    return batches


def update(cfg: Config, policy, opt, batch: Batch, ref_logp, *, recipe: Recipe | None = None):
    """Stage 6: mu = --inner-steps optimizer steps on the batch's loss, each one's gradient accumulated over
    micro-batches of --micro-batch rows. Returns the statistics, averaged over tokens and inner steps, and log pi_k
    (N, T): the first inner step's log-probs, taken before any optimizer step moved the policy.

    Each micro-batch's loss is divided by the whole step's normaliser Z (`total`), so their summed gradients equal
    the whole batch's. Dropout is off in every pass (engine.policy.fit_policy), so that pi_theta, pi_k and alpha are
    one network: with dropout, rho would differ from 1 even where pi_theta = alpha (TRL's `disable_dropout` too).
    The loss is objective.policy_loss through the run's variants (`recipe.loss`); a variant that keeps tokens for
    the whole step (MIS, M2PO) sees all of pi_k first, and the tokens it drops leave the loss and Z.
    """
    recipe = variants.recipe(cfg) if recipe is None else recipe
    n, length = batch.input_ids.shape
    mb = cfg.micro_batch or auto_micro_batch(policy, n, length, cfg.gradient_checkpointing, cfg.autocast_dtype)
    micro_batches = [slice(i, i + mb) for i in range(0, n, mb)]
    policy.train(cfg.gradient_checkpointing)  # checkpointing acts in train mode only; dropout is 0 either way
    loss_mask, pi_k_logp, kept = batch.loss_mask, None, {}
    if recipe.keeps_tokens and batch.alpha_logp is not None:  # a stale batch: all of pi_k before the first step
        pi_k_logp = no_grad_logprobs(cfg, policy, batch, mb)  # (N, T)
        keep, kept = recipe.step_keep(batch.alpha_logp, pi_k_logp, loss_mask)  # (N, T)
        loss_mask = loss_mask * keep  # (N, T)
    total = aggregation_total(loss_mask, cfg.agg, cfg.max_new_tokens)  # Z
    stats = StepStats()
    for i in range(cfg.inner_steps):
        opt.zero_grad(set_to_none=True)
        pi_k_parts = []  # log pi_k of each micro-batch, recorded by the first inner step
        for rows in micro_batches:
            if i > 0 and loss_mask[rows].sum() == 0:
                continue  # no token in the loss here: zero gradient (the first inner step runs it all for log pi_k)
            logp = completion_logprobs(cfg, policy, batch, rows)  # (mb, T) log pi_theta, with grad
            pi_k_logp_mb = logp.detach() if pi_k_logp is None else pi_k_logp[rows]  # pi_theta is pi_k until a step
            x = LossInput(
                logp=logp,
                alpha_logp=pi_k_logp_mb if batch.alpha_logp is None else batch.alpha_logp[rows],  # None: alpha = pi_k
                pi_k_logp=pi_k_logp_mb,
                ref_logp=None if ref_logp is None else ref_logp[rows],
                advantages=batch.advantages[rows],
                loss_mask=loss_mask[rows],
                total=total,
            )
            loss, st = recipe.loss(x)
            loss.backward()
            stats.add(loss, st)
            pi_k_parts.append(pi_k_logp_mb)
        if pi_k_logp is None:
            pi_k_logp = torch.cat(pi_k_parts)  # (N, T)
        norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm)
        if torch.isfinite(norm):
            opt.step()
        stats.optimizer_step(norm)  # a non-finite gradient takes no optimizer step
    # rho' = pi_k / alpha does not depend on pi_theta: its figures are the whole step's, whatever the micro-batching.
    alpha_logp = pi_k_logp if batch.alpha_logp is None else batch.alpha_logp
    if recipe.keeps_tokens and batch.alpha_logp is None:  # alpha = pi_k: every token kept, the figures say so
        kept = recipe.step_keep(alpha_logp, pi_k_logp, batch.loss_mask)[1]
    step = drift_stats(alpha_logp, pi_k_logp, batch.loss_mask) | kept
    step |= recipe.step_stats(alpha_logp, pi_k_logp, batch.loss_mask)
    return stats.result(step) | {"micro_batch": mb}, pi_k_logp


def check_rewards(rewards: torch.Tensor) -> torch.Tensor:
    """The rewards, refused when their group statistics would overflow: float32 squares rewards that each fit it
    (|r| ~ 1e20) beyond it, and every advantage would silently be 0 or NaN."""
    if not torch.isfinite(rewards.float().square().sum()):
        big = rewards.abs().max().item()
        raise RewardError(f"--reward: a reward of {big:.3g} is beyond what float32 group statistics hold; rescale it")
    return rewards


def completion_logprobs(cfg: Config, model, seq, rows=slice(None)) -> torch.Tensor:
    """log pi (n, T) of the completions of `seq` (a Batch or a Rollout; its rows `rows`) under `model`, with grad
    when grad is enabled, under the run's autocast. The one choice of log-prob function: chunked_token_logprobs is
    logprobs.token_logprobs without the (N, T, V) logits (tests/test_rollout.py, tests/test_gpu_path.py)."""
    ids, mask, completion_mask = seq.input_ids[rows], seq.attention_mask[rows], seq.completion_mask[rows]
    with autocast(cfg, ids.device):
        return chunked_token_logprobs(model, ids, mask, completion_mask, cfg.temperature, cfg.truncation)


def no_grad_logprobs(cfg: Config, model, seq, rows_per_pass: int | None = None) -> torch.Tensor:
    """log pi (N, T) of `seq`'s completions under `model` without grad, in eval mode, in passes of rows_per_pass
    rows (the update's micro-batch; None: --micro-batch, else all), so that no no-grad pass holds more activations
    than the update's own: log alpha's recompute, pi_ref's, MIS's and M2PO's pi_k, sampler_mismatch's forward."""
    n = seq.input_ids.shape[0]
    mb = rows_per_pass or cfg.micro_batch or n
    with evaluating(model):
        return torch.cat([completion_logprobs(cfg, model, seq, slice(i, i + mb)) for i in range(0, n, mb)])


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
    with adapter_off:
        return no_grad_logprobs(cfg, ref, ro)


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
    """Run GRPO as configured, top to bottom: the settings, the setup, Algorithm 1's outer loop, the end. Returns the
    summary (also written to --out/summary.json)."""
    # ---- the settings: the flags, the seeds, the rewards, the data, the variants (bad input fails here) ----
    validate(cfg)
    from transformers import set_seed  # here: transformers (and peft through it) take seconds to import (--help)

    set_seed(cfg.seed)  # Python's, numpy's and torch's generators, as TRL seeds them (a reward may use any)
    rewards = run_rewards(cfg)
    train_set, heldout = load_problems(cfg, rewards)
    recipe = variants.recipe(cfg)  # the named units the flags ask for, looked up once
    # --out, claimed: a folder holding another run or files of the user's, or one another process writes, is refused;
    # nothing in it is written or deleted before writer.open below
    with RunWriter(cfg, open_now=False) as writer:
        # ---- the setup: the policy, its optimizer and pi_ref; the prompts that fit; the sampling generator ----
        warn_of_overlap(train_set, heldout, log=writer.log)
        policy, tokenizer = load_policy(cfg, log=writer.log)  # the built-in tiny policy, or a transformers causal LM
        train_set, heldout = fit_to_context(cfg, policy, tokenizer, train_set, heldout, log=writer.log)
        models = make_models(cfg, policy.to(cfg.device))
        if cfg.compile:  # the fast sampling loop's step and the head's chunk functions, compiled at their first calls
            compile_hot_paths()
        check_queue_fits(cfg, tokenizer, train_set, torch.device(cfg.device))  # a queue that cannot fit: refused
        plan = plan_line(cfg, models.policy, tokenizer, train_set, heldout)  # every byte of a step, predicted
        picked = newest_intact(cfg, writer) if cfg.resume else None  # verified; a --steps below the run's refused
        # Every check that can refuse the run has passed: --overwrite now sets the old run aside, the new one starts.
        writer.open({"reward_names": rewards.names, **prompt_record(tokenizer, train_set[0])})
        writer.log(f"sampling path: {sampling_path(models.policy, cfg.fast)}; {schedule_line(cfg, recipe)}")
        writer.log(plan)
        gen = torch.Generator(device=cfg.device).manual_seed(cfg.seed)  # the sampling generator
        stream = PromptStream(train_set, cfg.seed)
        draw = Draw(cfg, tokenizer, stream, rewards, torch.device(cfg.device))  # the prompts of the steps drawn
        run = Harness(
            cfg,
            writer,
            models,
            tokenizer,
            heldout,
            rewards,
            gen,
            stream,
            draw,
            loop=sampling_loop(cfg),
            logprobs=lambda seq: no_grad_logprobs(cfg, models.policy, seq),
        )
        run.begin(picked)  # resume, or evaluate the starting policy

        # ---- Algorithm 1's outer loop: step k, then what the run keeps of it ----
        for k in run.steps():
            for group in models.opt.param_groups:  # --lr-scheduler: a function of the step
                group["lr"] = lr_at(cfg, k)
            res = run.attempt(k, lambda: grpo_step(cfg, models, tokenizer, k, gen, run.queue, draw, recipe=recipe))
            if res is not None:  # None: the sampler's logits were not finite, a skipped step
                run.record(k, res, lr_at(cfg, k))
        return run.end()  # held-out accuracy, summary.json, final/, curves.png


def schedule_line(cfg: Config, recipe: Recipe) -> str:
    """The run's schedule and variants, as its log says them."""
    v, s = cfg.offpolicy_steps, cfg.lag
    if s:
        schedule = f"at each step k the batch of step k + {s}, a constant lag (log alpha: {cfg.alpha_logp_from})"
    elif v > 1:
        schedule = f"every {v} steps, the next {v} batches at once (log alpha: {cfg.alpha_logp_from})"
    else:
        schedule = "every step"
    named = f"; variants: {', '.join(recipe.names)}" if recipe.names else ""
    return f"the policy samples {schedule}{named}"


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
