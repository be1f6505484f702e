"""The harness around Algorithm 1's outer loop: what the run keeps and checks between its steps, one call a stage.

    Harness.begin    resume from the newest intact checkpoint, or evaluate the starting policy
    Harness.attempt  run step k; a sampler gone non-finite is a skipped step, a reward that fails checkpoints the
                     run as it stood before the step and ends it (--resume redoes step k)
    Harness.record   the step's metrics row (with its diagnostics: sampler_mismatch), completions, evaluation every
                     --eval-every steps, the divergence guard, checkpoints every --save-every steps
    Harness.end      held-out accuracy, summary.json, final/ and curves.png

train.train builds one and calls these; the step itself (train.grpo_step) knows nothing of them.
"""

import time
from collections.abc import Callable

import torch
from tqdm import tqdm

from bookkeeping.checkpoint import rng_state, save_checkpoint, set_rng_state
from bookkeeping.diagnostics import sampler_mismatch
from bookkeeping.evaluation import eval_line, evaluation, logged_rows
from bookkeeping.failures import Diverged, check_finite_weights, signals_wait, stop_if_collapsed, stop_if_diverged
from bookkeeping.metrics import metrics_row, reward_metrics, show
from bookkeeping.resume import restore, run_state
from bookkeeping.run_io import RunWriter
from config import Config
from engine.compiled import compile_line, compile_seconds
from problems.user_rewards import RewardError


class Harness:
    """The run's state between steps (the queue of batches drawn ahead, the clock, the start's held-out metrics,
    the steps that went non-finite) and the calls that keep it."""

    def __init__(
        self,
        cfg: Config,
        writer: RunWriter,
        models,
        tokenizer,
        heldout,
        rewards,
        gen,
        stream,
        draw,
        *,
        loop: Callable,
        logprobs: Callable,
    ):
        self.cfg, self.writer, self.models, self.tokenizer = cfg, writer, models, tokenizer
        self.heldout, self.rewards, self.gen, self.stream, self.draw = heldout, rewards, gen, stream, draw
        self.loop = loop  # the sampling loop evaluation uses: training's (train.sampling_loop)
        self.logprobs = logprobs  # seq -> log pi_theta (N, T), no grad: sampler_mismatch's forward
        self.device = torch.device(cfg.device)
        self.queue, self.start, self.first_step, self.t0 = None, {}, 0, time.time()
        self.nonfinite: list[int] = []  # the steps whose update was skipped as not finite (stop_if_diverged)

    # ---- the run's start ---------------------------------------------------------------------------------------

    def begin(self, picked) -> None:
        """Resume from `picked` (bookkeeping.resume.newest_intact's), or evaluate the starting policy (no random
        number of the sampling generator is drawn). A resumed run keeps its wall clock and its start's held-out
        metrics, so its summary reads like one run's."""
        wall_before = 0.0
        if picked is not None:
            self.first_step, self.start, wall_before, self.queue, self.draw.scored = restore(
                self.cfg, self.models, self.gen, self.stream, self.writer, picked
            )
        self.t0 = time.time() - wall_before
        if picked is None and self.cfg.eval_start:
            self.start = self.evaluate(-1)
        if self.start:
            self.writer.log(eval_line(self.cfg, self.start, len(self.heldout)))

    def steps(self):
        """The steps still to run, k = first ... --steps - 1, with the progress bar."""
        cfg = self.cfg
        self.bar = tqdm(
            range(self.first_step, cfg.steps),
            desc="grpo",
            dynamic_ncols=True,
            disable=not cfg.progress,
            initial=self.first_step,
            total=cfg.steps,
        )
        return self.bar

    # ---- each step ---------------------------------------------------------------------------------------------

    def attempt(self, k: int, step: Callable):
        """step() -> (StepResult, queue): step k. Returns its result, or None when the sampler's logits were not
        finite (a diverged policy: a non-finite step, counted by the divergence guard)."""
        self.t_step, before = time.time(), (rng_state(self.gen), self.stream.position)
        try:
            res, self.queue = step()
        except FloatingPointError:
            self.writer.metrics({"step": k, "wall_s": self.wall(), "nonfinite_updates": 1, "nonfinite_logits": 1})
            self.nonfinite.append(k)
            stop_if_diverged(self.nonfinite, k)
            return None
        except RewardError:  # a reward failed at step k's draw, before any update: --resume redoes step k
            if k > 0:
                set_rng_state(before[0], self.gen)
                self.stream.position = before[1]
                self.checkpoint(k)
            raise
        return res

    def record(self, k: int, res, lr: float) -> None:
        """Step k's metrics row, its completions, evaluation and checkpoint as the flags ask; the divergence guard."""
        cfg = self.cfg
        row = metrics_row(k, res, cfg.group_size, self.wall(), time.time() - self.t_step, self.device)
        scores = self.draw.scored.pop(k, None)
        row.update(lr=lr, **reward_metrics(scores, self.rewards.names), **self.mismatch(k, res))
        row.update(sampled_at=res.sampled_at, staleness=k - res.sampled_at)  # the queue's schedule, as it ran
        if cfg.compile:
            row.update(compile_s=compile_seconds())  # torch.compile's seconds so far (most in step 0)
        if cfg.log_completions:
            self.writer.completions(logged_rows(cfg, self.tokenizer, k, res, scores, self.rewards.names))
        if cfg.eval_every and (k + 1) % cfg.eval_every == 0 and k + 1 < cfg.steps:
            try:
                row.update(self.evaluate(k))
            except RewardError:  # a reward failed on the held-out set after step k's update: resume after step k
                self.writer.metrics(row)
                self.checkpoint(k + 1)
                raise
        self.writer.metrics(row)
        show(self.bar, row)
        if res.stats.get("nonfinite_updates"):
            self.nonfinite.append(k)
        stop_if_diverged(self.nonfinite, k)
        # No checkpoint of a non-finite step, nor of weights that are not finite: the newest one stays a good one.
        if cfg.save_every and (k + 1) % cfg.save_every == 0 and k not in self.nonfinite:
            self.checkpoint(k + 1)

    def mismatch(self, k: int, res) -> dict:
        """sampler_mismatch over the loss's tokens (all the completion tokens on a step without signal), where the
        step has both log alphas: a batch sampled at its own step (alpha = pi_k: the update's first forward, or a
        forward of its own when no update ran), or a batch drawn ahead with log alpha recomputed."""
        batch, ro = res.batch, res.rollout
        if res.sampled_at == k:
            forward = res.pi_k_logp if res.pi_k_logp is not None else self.logprobs(batch)  # (N, T)
        elif self.cfg.alpha_logp_from == "recompute":
            forward = batch.alpha_logp  # (N, T)
        else:
            return {}
        on = batch.loss_mask if batch.loss_mask.sum() > 0 else ro.completion_mask  # (N, T)
        return sampler_mismatch(ro.sampler_logp, forward, on)

    # ---- what the run keeps ------------------------------------------------------------------------------------

    def wall(self) -> float:
        return time.time() - self.t0

    def evaluate(self, at_step: int) -> dict:
        """Held-out metrics after step at_step (-1: before training), with training's sampling loop."""
        cfg = self.cfg
        return evaluation(
            cfg,
            self.models.policy,
            self.tokenizer,
            self.heldout,
            self.device,
            self.rewards,
            at_step,
            self.writer,
            self.loop,
        )

    def checkpoint(self, done: int) -> None:
        """The run after `done` steps, written atomically; Ctrl-C waits for it."""
        check_finite_weights(self.models.policy, f"step {done - 1}")
        state = run_state(
            self.models, self.gen, self.stream, self.queue, done, self.start, self.wall(), self.draw.scored
        )
        with signals_wait():
            save_checkpoint(self.cfg.out, state, done, self.cfg.keep_checkpoints, self.writer.manifest)

    # ---- the end -----------------------------------------------------------------------------------------------

    def end(self) -> dict:
        """Held-out accuracy, summary.json, final/ and curves.png; returns the summary."""
        cfg = self.cfg
        if self.nonfinite and len(self.nonfinite) == cfg.steps - self.first_step:  # no update applied: no result
            raise Diverged(
                f"steps {self.first_step}-{cfg.steps - 1}: loss or gradient not finite at every step, no update "
                "applied; stopping (try a lower --lr)"
            )
        check_finite_weights(self.models.policy, "the end of the run")
        try:
            end = self.evaluate(cfg.steps - 1)
        except RewardError:  # a reward failed on the held-out set: every step is done, --resume redoes the end
            self.checkpoint(cfg.steps)
            raise
        start = self.start
        summary = {f"{key}_{when}": m.get(key) for key in end for when, m in (("start", start), ("end", end))}
        summary.update(steps=cfg.steps, wall_s=self.wall(), eval_size=len(self.heldout), out=str(self.writer.out))
        self.writer.log(eval_line(cfg, end, len(self.heldout), start=start))
        stop_if_collapsed(self.writer.out, start, end)  # a collapsed policy does not end successfully (exit 3)
        if cfg.compile:
            self.writer.log(compile_line())
        with signals_wait():
            self.writer.finish(self.models.policy, self.tokenizer, summary)
        return summary
