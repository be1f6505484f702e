"""What both studies share: the run flags, one run's Config, training runs (here or in worker processes),
reusing finished runs, and turning a run's metrics into CSV rows.

A study (experiment.py, staleness.py) builds a list of Configs, hands them to `run_jobs`, and turns each
finished run into rows with `run_rows`; `write_csv` and `mean_sd` format what it reports.
"""

import argparse
import contextlib
import csv
import io
import json
import multiprocessing
import shutil
import statistics
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import fields
from pathlib import Path

from bookkeeping.failures import Diverged
from config import Config, ConfigError, absolute, resolve

# Config fields a study passes through to every run unchanged (None: the run's own default).
PASSTHROUGH = ("model", "task", "data_files", "eval_files", "max_new_tokens")


def add_run_flags(p: argparse.ArgumentParser) -> None:
    """The flags both studies share: how each run executes, and what it trains (the pass-through)."""
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per run (1 keeps shared cores sane)")
    p.add_argument(
        "--workers", type=int, default=1, help="runs trained at once, each in its own process (default 1: in this one)"
    )
    p.add_argument(
        "--cache-dir", default=Config.cache_dir, help="where the warmed-up tiny policy is cached, shared by all runs"
    )
    p.add_argument("--model", help="passed to every run (default: the built-in tiny policy)")
    p.add_argument("--task", choices=["arithmetic", "gsm8k"], help="passed to every run (default arithmetic)")
    p.add_argument("--data-files", help="passed to every run: local JSONL for --task gsm8k")
    p.add_argument("--eval-files", help="passed to every run: local JSONL of held-out rows")
    p.add_argument("--max-new-tokens", type=int, help="passed to every run (default: 8 arithmetic, 512 gsm8k)")


def make_config(args, out: Path, **changes) -> Config:
    """One run's Config: the study's `changes` (config, lr, seed) on top of the run flags and the pass-through."""
    given = {k: getattr(args, k) for k in PASSTHROUGH if getattr(args, k, None) is not None}
    return resolve(
        Config(
            **changes,
            **given,
            steps=args.steps,
            eval_every=args.eval_every,
            eval_size=args.eval_size,
            warmup_steps=args.warmup_steps,
            cache_dir=args.cache_dir,
            out=str(out),
            progress=False,
        )
    )


# Flags and values renamed after records in results/ were made (2026-12, one name per quantity): a record's
# old name means the new one.
RENAMED_FLAGS = {"alpha_logp": "alpha_logp_from"}
RENAMED_VALUES = {"clip_center": {"current": "pi_k", "behaviour": "alpha"}}


def finished(cfg: Config) -> bool:
    """True when cfg.out holds a completed run of exactly this config (so it can be reused)."""
    out = Path(cfg.out)
    if not (out / "summary.json").is_file() or not (out / "config.json").is_file():
        return False
    saved = {RENAMED_FLAGS.get(k, k): v for k, v in json.loads((out / "config.json").read_text()).items()}
    saved = {k: RENAMED_VALUES[k].get(v, v) if k in RENAMED_VALUES else v for k, v in saved.items()}
    # Paths are stored absolute since 2026-12; older records hold them relative to the repository root.
    saved.update({k: absolute(saved[k]) for k in ("out", "cache_dir", "data_files", "eval_files") if k in saved})
    ignore = {"progress", "resume"}  # do not change the result
    # A field the saved config lacks was added to Config after that run: it ran with the default.
    return all(saved.get(f.name, f.default) == getattr(cfg, f.name) for f in fields(Config) if f.name not in ignore)


def clip_frac(m: dict):
    """Fraction of the step's loss tokens whose clip was active; None for a step without a clipped loss."""
    return m["clip_low"] + m["clip_high"] if "clip_low" in m else None


# CSV column -> the per-step value it averages over the steps since the previous eval (None: no value that step).
STEP_MEANS = {"reward": lambda m: m.get("reward"), "clip_frac": clip_frac}


def run_rows(cfg: Config, base: dict, means: dict = STEP_MEANS) -> list[dict]:
    """The CSV rows of one finished run: start (step 0), every intermediate eval, final (step = steps).

    `step` counts completed steps; each column of `means` averages its per-step value over the steps since
    the previous eval point: `reward` the mean training reward, `clip_frac` the fraction of loss tokens
    whose clip was active (clip_low + clip_high). Blank at step 0, where no training has happened, and
    where no step had a value (`clip_frac` of OPMD, which has no clip; a step whose sampler produced
    non-finite logits logs no reward). `base` (the study's columns for this run) starts every row.
    """
    out = Path(cfg.out)
    summary = json.loads((out / "summary.json").read_text())
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [
        {**base, "step": 0, "wall_s": 0.0, "eval_accuracy": summary["eval_accuracy_start"], **dict.fromkeys(means, "")}
    ]
    window = {k: [] for k in means}  # column -> the values since the last eval point

    def since_last_eval() -> dict:
        row = {k: statistics.fmean(xs) if xs else "" for k, xs in window.items()}
        for xs in window.values():
            xs.clear()
        return row

    for m in metrics:
        for k, value_of in means.items():
            if (x := value_of(m)) is not None:
                window[k].append(x)
        if "eval_accuracy" in m:  # logged after step m["step"], i.e. after m["step"] + 1 completed steps
            rows.append(
                {
                    **base,
                    "step": m["step"] + 1,
                    "wall_s": m["wall_s"],
                    "eval_accuracy": m["eval_accuracy"],
                    **since_last_eval(),
                }
            )
    final = {"step": summary["steps"], "wall_s": summary["wall_s"], "eval_accuracy": summary["eval_accuracy_end"]}
    rows.append({**base, **final, **since_last_eval()})
    return rows


def train_one(cfg: Config, threads: int) -> tuple[str, str] | None:
    """Train one run in this process, its messages captured; None, or (error, the run's messages) if it failed.

    A module-level function so that a worker process (--workers) can run it. torch and transformers load
    here, not at import of this module.
    """
    import torch
    import transformers

    import train

    # One thread: as fast as two for this ~1M-parameter model (measured here, ~0.15 s a step either
    # way), and it cannot oversubscribe cores shared with another process (2 threads then took 2-6 s a step).
    torch.set_num_threads(threads)
    transformers.utils.logging.disable_progress_bar()  # no weight-loading bars between the run lines
    # A half-written folder must go: train.py appends to an existing metrics.jsonl.
    shutil.rmtree(cfg.out, ignore_errors=True)
    log = io.StringIO()  # train's own messages; shown only if the run fails
    try:
        with contextlib.redirect_stdout(log):
            train.train(cfg)
    except (ConfigError, Diverged) as e:  # e.g. a diverged run at an aggressive lr: report it, go on
        return str(e), log.getvalue().rstrip()
    return None


def run_jobs(cfgs: list[Config], args) -> Iterator[tuple[int, bool, tuple[str, str] | None]]:
    """Train (or reuse) every run; yields (index into cfgs, reused, train_one's result) as each finishes.

    A run whose folder holds a finished run of the same config is reused unless --fresh. With --workers 1
    the runs train here, in order; with more, in that many spawned processes (a fresh interpreter each:
    no forked torch thread pools), and they are reported in the order they finish.
    """
    todo = []
    for i, cfg in enumerate(cfgs):
        if not args.fresh and finished(cfg):
            yield i, True, None
        else:
            todo.append(i)
    if args.workers <= 1:
        for i in todo:
            yield i, False, train_one(cfgs[i], args.threads)
        return
    with ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        running = {pool.submit(train_one, cfgs[i], args.threads): i for i in todo}
        for done in as_completed(running):
            yield running[done], False, done.result()


def cell(x: float | None, spec: str) -> str:
    """A table cell: x formatted by spec, or "—" for no value."""
    return "—" if x is None else format(x, spec)


def mean_sd(xs: list[float], signed: bool = False) -> str:
    """ "mean ± sample std" (std 0 for a single value); `signed` writes the mean's sign, for differences."""
    return f"{statistics.fmean(xs):{'+' if signed else ''}.3f} ± {statistics.stdev(xs) if len(xs) > 1 else 0.0:.3f}"


def write_csv(rows: list[dict], columns: list[str], path: Path) -> None:
    """The rows as CSV (floats rounded to 6 digits, except the learning rate)."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        w.writerows({k: round(v, 6) if isinstance(v, float) and k != "lr" else v for k, v in r.items()} for r in rows)


def read_csv(path: Path, ints: set[str], texts: set[str]) -> list[dict]:
    """A study's CSV back into typed rows: `ints` as int, `texts` as str, True/False as bool, the rest as
    float; blank cells stay "" (what `write_csv` wrote for "no value")."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        for k, x in row.items():
            if k in texts or x == "":
                continue
            row[k] = x == "True" if x in ("True", "False") else int(x) if k in ints else float(x)
    return rows
