"""What a checkpoint holds, and a resume reads back: everything the next step reads, so that a resumed run
continues bit for bit (checkpoint.py writes and reads the files atomically).

    run_state   the policy, optimizer, pi_ref, generator, data position, the queue of batches drawn ahead and their
                scores, and
                the start's held-out metrics, all of them, so that a resumed run's summary reads like one run's
    newest_intact the newest checkpoint whose sha256 is the one recorded, read, before anything is written
    restore     that checkpoint back into the models, the generator and the prompt stream
"""

import json
from pathlib import Path

from bookkeeping.checkpoint import (
    checkpoint_dir,
    checkpoints,
    file_sha256,
    load_checkpoint,
    load_policy_state,
    policy_state,
    rng_state,
    set_rng_state,
)
from bookkeeping.run_io import RunWriter, to_json
from config import Config, ConfigError
from engine.policy import Models
from problems.prompts import PromptStream
from problems.user_rewards import Scores
from rollout import Queue


def run_state(
    models: Models, gen, stream: PromptStream, queue: Queue | None, step: int, start: dict, wall: float, scored=None
) -> dict:
    """Everything the next step reads, so that a resumed run continues bit for bit.

    The queue of batches drawn ahead is saved too (the unfinished refresh period's, or a constant lag's s batches):
    they were drawn from alpha, a policy up to v - 1 (or s) steps old that the current weights cannot reproduce
    (with their rewards, log alpha and the step that sampled each). The sampling generator's state and the data
    position (already past the queue's prompts) make the next draws those of the uninterrupted run. So are the
    reward functions' own figures for the queue's steps
    (`scored`: each step's Scores), which its metrics rows report.
    """
    state = {
        "policy": policy_state(models.policy),
        "optimizer": models.opt.state_dict(),
        "rng": rng_state(gen),
        "step": step,
        "data_position": stream.position,
        # The start's held-out metrics, every one (with rewards of one's own eval_reward, eval_rewards/NAME, ...):
        # the summary's *_start fields after a resume are the uninterrupted run's. The two keys before it are what
        # checkpoints held before (`restore` reads either).
        "eval_start": dict(start),
        "eval_accuracy_start": start.get("eval_accuracy"),
        "eval_pass1_start": start.get("eval_pass1"),
        "wall_s": wall,
    }
    if queue is not None and queue.covers(step):
        state["queue"] = queue.state()
        state["scores"] = {
            k: {
                "parts": sc.parts,
                "total": sc.total,
                "metrics": sc.metrics,
                "extras": to_json(sc.extras, default=str),
            }
            for k, sc in (scored or {}).items()
            if k >= step
        }
    if models.ref is not None:
        state["ref"] = models.ref.state_dict()
    return state


NEEDED = ("policy", "optimizer", "rng", "step", "data_position", "wall_s")  # what every checkpoint of a run holds


def newest_intact(cfg: Config, writer: RunWriter) -> tuple[Path, dict]:
    """The checkpoint a resume continues from, read and checked before anything is written: the newest one whose
    bytes have the sha256 the run recorded when it wrote them (manifest.json), that torch reads and that holds a
    run's state for its own step. Each one passed over is one line saying why (damaged, not this run's, unreadable);
    none left is a ConfigError. A --steps below the steps the run has taken (its checkpoint's, or metrics.jsonl's
    rows) is refused: a resume continues the run, it does not cut it short."""
    found = checkpoints(cfg.out)
    if not found:
        raise ConfigError(f"--resume: no complete checkpoint in {checkpoint_dir(cfg.out)}")
    for path in reversed(found):
        recorded = writer.manifest.files.get(f"checkpoints/{path.name}", "unlisted")
        if recorded == "unlisted":
            writer.log(f"--resume: skipped {path}: this run did not write it (its manifest.json does not list it)")
            continue
        if recorded is not None and file_sha256(path) != recorded:
            writer.log(f"--resume: skipped {path}: damaged (its sha256 is not the one recorded when it was written)")
            continue
        try:
            ck = load_checkpoint(path)  # torch.load(weights_only=True): a checkpoint is data, never code
        except Exception as e:  # a damaged file raises whatever the zip or unpickling layer meets first
            reason = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
            writer.log(f"--resume: skipped {path}: it cannot be read ({reason})")
            continue
        missing = [k for k in NEEDED if not isinstance(ck, dict) or k not in ck]
        if missing or ck["step"] != int(path.stem.split("-")[1]):
            what = f"no '{missing[0]}'" if missing else f"it holds step {ck['step']}"
            writer.log(f"--resume: skipped {path}: not a checkpoint this run wrote ({what})")
            continue
        if recorded is None:  # an old run's, written before checkpoints were hashed
            writer.log(f"--resume: {path} has no recorded sha256 (a run from before they were kept): not verified")
        break
    else:
        raise ConfigError(f"--resume: no intact checkpoint in {checkpoint_dir(cfg.out)} (newest: {found[-1]})")
    taken = max(ck["step"], writer.steps_logged())
    if cfg.steps < taken:
        raise ConfigError(
            f"--resume --steps {cfg.steps}: the run has taken {taken} steps, and a resume continues it: give --steps "
            f"{taken} or more (a shorter run is a new one: another --out, or --overwrite)"
        )
    return path, ck


def restore(cfg: Config, models: Models, gen, stream: PromptStream, writer: RunWriter, picked: tuple[Path, dict]):
    """Load the checkpoint `newest_intact` picked into the models; returns (step, the start's held-out metrics, wall
    seconds, the queue of batches drawn ahead or None, the reward functions' Scores of its steps)."""
    path, ck = picked
    load_policy_state(models.policy, ck["policy"])
    saved = ck.get("queue", ck.get("cycle"))  # "cycle": a checkpoint from before the lag, its refresh period's
    queue = None if saved is None else Queue.from_state(saved, cfg.device)
    if models.ref is not None:
        models.ref.load_state_dict(ck["ref"])
    models.opt.load_state_dict(ck["optimizer"])
    set_rng_state(ck["rng"], gen)
    stream.position = ck["data_position"]
    # Steps after the checkpoint were logged by the run that died; they will be logged again.
    writer.truncate_metrics(ck["step"])
    if ck["step"] < cfg.steps:
        writer.end_passed()
    writer.log(f"resumed from {path} at step {ck['step']}")
    start = ck.get("eval_start")
    if start is None:  # a checkpoint from before the whole start was kept: its two figures
        old = {"eval_accuracy": ck.get("eval_accuracy_start"), "eval_pass1": ck.get("eval_pass1_start")}
        start = {k: x for k, x in old.items() if x is not None}
    scored = {
        k: Scores(sc["parts"], sc["total"], sc["metrics"], json.loads(sc["extras"]))
        for k, sc in ck.get("scores", {}).items()
    }
    return ck["step"], start, ck["wall_s"], queue, scored
