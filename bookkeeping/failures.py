"""How a run stops when it must: a diverged policy, Ctrl-C and SIGTERM, device memory; each ends in one line.

Diverged             the steps keep going non-finite, or the weights are: exit status 3
Stopped              Ctrl-C (130) or SIGTERM (143); `signals_wait` holds them while a checkpoint is written
stop_if_diverged     the rule: 3 non-finite steps in a row, or 4 of the last 20
check_finite_weights weights that are not finite are never saved nor evaluated
stop_if_collapsed    a policy whose held-out accuracy and reward fell to 0, every group equal: exit status 3 too
where_the_run_stands the steps done, the newest checkpoint, the command that continues (shell-quoted)
out_of_memory        the line of a run that ran out of device memory: the flags that bound it
"""

import contextlib
import json
import math
import shlex
import signal
from pathlib import Path

import torch

from bookkeeping.checkpoint import latest_checkpoint
from config import Config


class Diverged(Exception):
    """The run's steps keep going non-finite (`stop_if_diverged`), or its weights are: the run stops with exit
    status 3, and its newest checkpoint on disk is a good one."""


class Stopped(BaseException):
    """Ctrl-C (SIGINT) or SIGTERM: train.main prints one line, where the run stands and how to resume it. A
    BaseException, as KeyboardInterrupt is: code that catches errors (a reward function's call) lets it through."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.exit_status = 128 + signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM


# A signal that arrives while a checkpoint or final/ is being written waits for the write to finish: cut short,
# torch.save raises an error of its own, and the stopped run would not end in its one line.
_writing, _pending_signal = False, None


def stop_on_signal(signum, frame):
    global _pending_signal
    if _writing:
        _pending_signal = signum
        return
    raise Stopped(signum)


@contextlib.contextmanager
def stop_on_signals():
    """Ctrl-C and SIGTERM raise `Stopped` inside the block; the handlers before it come back after."""
    handlers = {sig: signal.signal(sig, stop_on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def signals_wait():
    """Ctrl-C and SIGTERM take effect once the block is done (`stop_on_signal`)."""
    global _writing, _pending_signal
    _writing = True
    try:
        yield
    finally:
        _writing = False
        if _pending_signal is not None:
            signum, _pending_signal = _pending_signal, None
            raise Stopped(signum)


NONFINITE_IN_A_ROW, NONFINITE_WINDOW, NONFINITE_IN_WINDOW = 3, 20, 4


def stop_if_diverged(nonfinite_steps: list[int], step: int) -> None:
    """The run stops when 3 steps in a row, or 4 of the last 20, were not finite (their updates skipped).

    One bad step is skipped and the run goes on. A streak means the run has diverged; so do bad steps that keep
    coming back between good ones (a learning rate far too high can leave the loss finite every other step while
    the policy collapses). No checkpoint is written after a non-finite step until the next finite one, so the
    newest checkpoint on disk is a good one."""
    recent = [k for k in nonfinite_steps if k > step - NONFINITE_WINDOW]
    streak = all(step - j in nonfinite_steps for j in range(NONFINITE_IN_A_ROW))
    if streak or len(recent) >= NONFINITE_IN_WINDOW:
        why = f"{NONFINITE_IN_A_ROW} in a row" if streak else f"{len(recent)} of the last {NONFINITE_WINDOW} steps"
        raise Diverged(f"step {step}: loss or gradient not finite, {why}; stopping ({LEVERS})")


# What to try: a --lr too high is the usual cause, but not the only one (at --lr 0 the loss itself can overflow).
LEVERS = "a --lr too high is the usual cause; else a flag that scales the loss, the logits or the ratio (docs/flags.md)"


def check_finite_weights(policy, when: str) -> None:
    """Weights that are not finite are never saved (as a checkpoint or final/) nor evaluated: the run stops."""
    if not all(torch.isfinite(p).all() for p in policy.parameters()):
        raise Diverged(f"{when}: the policy's weights are not finite; stopping ({LEVERS})")


COLLAPSE_ROWS = 5  # the last metrics rows that must all show the collapse (reward 0, every group equal)


def stop_if_collapsed(out, start: dict, end: dict) -> None:
    """A run whose policy collapsed does not end successfully: held-out accuracy 0 at the end, where it was above 0
    at the start (or some step's reward was), and the last COLLAPSE_ROWS steps each with reward 0 and every group
    equal (no signal left to learn from). `Diverged` (exit status 3), before final/ and summary.json are written:
    the newest checkpoint stays. train.train calls it after the end's evaluation; a run that never learned (0 at
    the start and at every step) is not a collapse, nor is a run shorter than COLLAPSE_ROWS steps."""
    if end.get("eval_accuracy") != 0:
        return
    rows = []
    with contextlib.suppress(OSError), open(Path(out) / "metrics.jsonl", errors="replace") as f:
        for line in f:
            with contextlib.suppress(json.JSONDecodeError):
                row = json.loads(line)
                if isinstance(row, dict):
                    rows.append(row)
    rows = [r for r in rows if isinstance(r.get("reward"), (int, float))]
    last = rows[-COLLAPSE_ROWS:]
    if len(last) < COLLAPSE_ROWS or not all(r["reward"] == 0 and r.get("zero_std_frac") == 1 for r in last):
        return
    had = (start.get("eval_accuracy") or 0) > 0 or any(r["reward"] > 0 for r in rows[:-COLLAPSE_ROWS])
    if not had:
        return
    before = start.get("eval_accuracy")
    was = f"from {before:.3f} " if isinstance(before, float) and math.isfinite(before) else ""
    raise Diverged(
        f"the policy collapsed: held-out accuracy {was}to 0, and reward 0 with every group equal in the last "
        f"{COLLAPSE_ROWS} steps (no signal left); no final/ written ({LEVERS})"
    )


def where_the_run_stands(out: str, steps: int) -> str:
    """The steps done, the newest checkpoint, and how to continue: for the line of a stopped run."""
    last = None
    try:
        with open(Path(out) / "metrics.jsonl", errors="replace") as f:
            for line in f:
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    last = json.loads(line)["step"]
    except OSError:
        pass
    done = f"{0 if last is None else last + 1} of {steps} steps done"
    try:
        ck = latest_checkpoint(out)
    except OSError:  # the folder cannot be read (the error being reported may be why): say what is known
        return done
    if ck is None:
        return f"{done}; no checkpoint to resume from (--save-every writes them)"
    return f"{done}, newest checkpoint {ck.name}; continue with: python train.py --resume --out {shlex.quote(str(out))}"


def out_of_memory(cfg: Config, e: torch.OutOfMemoryError) -> str:
    """The line of a run that ran out of device memory: what ran out, the flags that bound it, where the run stands."""
    what = (str(e).strip().splitlines() or ["out of memory"])[0][:160]
    mb, rows = cfg.micro_batch or "auto", cfg.sample_rows or "auto"
    levers = (
        f"lower --micro-batch (now {mb}: sequences per forward/backward) or --sample-rows (now {rows}: "
        "rows per generate call), or add --gradient-checkpointing"
    )
    return f"out of memory ({what}); {levers}; {where_the_run_stands(cfg.out, cfg.steps)}"
