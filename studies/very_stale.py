"""How stale can it go? Nine corrections at a constant lag of 1 to 256 updates, on the built-in task.

    python -m studies.very_stale --workers 2                         # the grid at lr 1e-4 (cost: below)
    python -m studies.very_stale --find-lr 3e-5 1e-5 3e-6 1e-6       # which gentler rate keeps lag 256's M2 <= 0.04
    python -m studies.very_stale --workers 2 --gentle-lr RATE        # the grid plus lag 0 and 256 at that rate
    python -m studies.very_stale --table-only                        # table and picture again from very_stale.csv

Asynchronous trainers (TRL's AsyncGRPOTrainer, verl's one-step-off and fully async modes, AReaL, prime-rl) train
each batch a fixed number of updates after the policy that sampled it. `--lag s` is that schedule: the batch of
step k is sampled by pi_theta as it stood at step max(0, k - s). M2PO (Zheng et al. 2025) reports matching
on-policy with data 256 updates stale at lr 1e-6 with 4 updates a step; this study asks the same of nine
corrections, all at one inner step and lr 1e-4 (the rate at which studies/staleness.py saw staleness cost
accuracy), and of the same corrections at a gentler rate (--gentle-lr) where lag 256 is that paper's drift:
  current         [A]'s surrogate, --clip-center pi_k (the project's default; the arm names are
                  studies/staleness.py's). With one inner step the clip never acts: rho'-weighted REINFORCE.
  behaviour       PPO / TRL, --clip-center alpha: the same surrogate with the interval centred at 1.
  decoupled-tis2  AReaL's decoupled objective, the weight rho' = pi_k / alpha capped at 2 (--is-cap 2).
  mis2            MIS, --is-mask 2: tokens with rho' outside [1/2, 2] leave the loss and its normaliser (the
                  bound of the TIS arm, as a mask; verl's token-level default threshold is 2).
  m2po            M2PO as AReaL runs it, --m2-threshold 0.04 (AReaL's default): the step's tokens of largest
                  (log alpha - log pi_k)^2 leave until the mean of the rest is < 0.04.
  m2po-clip       M2PO as its authors' released code runs it, --m2po-clip-threshold 0.04: no token leaves; M2
                  over the tokens moved the way A pushes sets a PPO clip around alpha (no floor, as they run it).
  m2po-quadrant   the M2PO paper's final mask, --m2po-quadrant-threshold 0.04: the active-quadrant tokens of
                  largest M2 lose their term, the token count kept.
  dppo            DPPO's probability-difference mask, --dppo-delta 0.2 (prime-rl's default loss).
  opsm            DeepSeek-V3.2's off-policy sequence mask, --opsm-delta 0.5 (TRL's off_policy_mask_threshold
                  has no default; 0.5 is the value its documentation gives): a sequence with A < 0 whose mean
                  log alpha - log pi_theta exceeds 0.5 leaves the loss.
  The masks of mis2, m2po and opsm act on [A]'s default centre, so each differs from `current` by its mask
  alone; m2po-clip, m2po-quadrant and dppo set their own trust region (variants/corrections.py).
At lag 0 with one inner step all of them take the same gradient: alpha = pi_k = pi_theta where the gradient is
taken, so rho = rho' = r = 1 (no clip acts, no weight differs from 1, MIS keeps every token), M2PO's
v_t = (log alpha - log pi_k)^2 = 0 (nothing leaves: the mean 0 is below the M2 threshold) and OPSM's
mean of log alpha - log pi_theta is 0 (not > delta) (tests/test_very_stale.py). So ONE set of lag-0 runs per
learning rate is every correction's baseline: its CSV rows read correction "all (lag 0 baseline)",
shared_baseline True, and each other run is paired with the baseline run of its seed and rate.

The grid (defaults; each a flag), sent out cell by cell, every cell's seeds one after another, so that a study
cut short keeps whole seed sets (every cell but the one or --workers running when it stopped has all its seeds;
--collect makes the table from them):
  1. lag 0, the shared baseline at --lr 1e-4, seeds 0-2;                                               3 runs
  2. lag 256 (the question, at the far end) x the nine corrections;                                 27 runs
  3. with --gentle-lr R: lag 0 and 256 (--gentle-lags) at R, the nine corrections at 256;          30 runs
  4. lags 2 (the drift at M2PO's M2 threshold, issue 57), 8, 32, 4, 16 (the transition), 128 (the plateau
     that 32 and 256 bracket), 1 (drift below that threshold) x the nine corrections;                 189 runs
  5. [A]'s periodic refresh (--offpolicy-steps v) at v = 256, then 64, for current and m2po;         12 runs
  6. the rerun (--rerun, default behaviour-lag8): that cell's seeds again into <run>-rerun folders;   3 runs
  7. the seeds rule: every cell whose paired difference to lag 0 (over the seeds of --seeds) is within
     --close 0.05 of 0 gets --extra-seeds 3 4 (5 seeds), after the baseline of its rate gets them:
     2 runs a cell, 2 per rate. Decided from the first pass's seeds only, so a rerun of the study
     schedules the same extra runs.
  Without --gentle-lr: 234 runs before the seeds rule; with it 264.
Steps and evaluation: 520 steps per run, 500 held-out problems every 65 steps (8 equal windows). At lag s the
steps 0, ..., s all train on batches of the starting policy, so at s = 256 the batches sampled after the start
are those of steps 257 on: 263 of 520, most of the run.

Cost: on a quiet core a run takes ~75 s (0.14 s a step: sampling 0.03, log alpha's forward 0.025, the update
0.08; behaviour-lag8's t_* metrics, issue 50's study), so the 264 runs take ~5.5 core-hours, ~2.8 h as two
1-thread workers on two quiet cores; issue 50's 87 runs took 7541 s as two workers on a 2-core machine shared
with other work (87 s a run), at which rate the 264 take ~6.4 h. The seeds rule adds 2 runs (2.5 core-minutes)
per close cell; --find-lr ~50 s per candidate rate (lag + 64 = 320 steps, evaluations at the start and end).
Runs reuse finished run folders under --runs-dir like the other studies: a run trained before every metrics row
carried m2 and mismatch_kl_k1 is reused but has no drift figures ("—"); delete it (or --fresh) to measure them.

--find-lr R1 R2 ...: no study; one run per rate at lag --find-lr-lag 256 for --find-lr-steps (lag + 64) steps,
--find-lr-correction current, the first seed, and a table (printed, and very_stale_find_lr.md) of the mean M2
and KL(alpha || pi_k) over the steps whose batch was exactly that lag stale; the gentlest rate to use is the
largest whose mean M2 is at or below --find-lr-threshold 0.04 (M2PO's M2 threshold). Pass it as --gentle-lr.

Verdicts: per cell, d_s = final accuracy - the same rate's lag-0 final at the same seed; its mean and 95%
t-interval (mean +- t_{0.975, n-1} sd / sqrt(n), n >= 2 seeds). holds: the whole interval lies above -MARGIN
(-0.05: not worse than lag 0 by 5 points, at 95%); falls: the whole interval lies below -0.05; unresolved
otherwise (the seeds cannot tell). 0.05 is about the run-to-run spread of one run's final accuracy (issue 57:
+-0.04-0.08) and 1.6 times the binomial standard error of a difference of two 500-problem evaluations (3.1 points).

Outputs (--out-dir): very_stale.csv (one row per run and eval point: reward, clip_frac, staleness (k minus the
step whose weights sampled the batch), rho_prime_p99, rho_prime_max, masked_frac (the fraction of loss tokens
the arm's mask dropped: MIS's, M2PO's, the quadrant mask's, DPPO's or OPSM's), grad_norm (before clipping at
--max-grad-norm 1), the drift m2 (mean (log rho')^2 over the loss tokens, what M2PO thresholds),
mismatch_kl_k1 and mismatch_kl_k3 (KL(alpha || pi_k)), each averaged over the steps since the previous eval;
rerun True on the rerun's rows), very_stale_table.md (per correction, rate and lag: final accuracy, the paired
difference with its interval, the verdict, the drift, the tails; the rerun side by side), very_stale.png.

Caveats: wall_s includes the held-out evaluations and, on shared cores, whatever else the machine was doing;
compare it between runs of one study only. The limits of the other toy studies hold: a 1M-parameter model,
3-4-token completions, no KL term, 3-5 seeds. At a gentle rate 520 steps may move the policy little, so a
verdict there says the lag costs nothing, not that training works.
"""

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

from config import Config
from studies import runner

CORRECTIONS = {
    "current": dict(clip_center="pi_k"),
    "behaviour": dict(clip_center="alpha"),
    "decoupled-tis2": dict(clip_center="decoupled", is_cap=2.0),
    "mis2": dict(clip_center="pi_k", is_mask=2.0),
    "m2po": dict(clip_center="pi_k", m2_threshold=0.04),
    "m2po-clip": dict(m2po_clip_threshold=0.04),
    "m2po-quadrant": dict(m2po_quadrant_threshold=0.04),
    "dppo": dict(dppo_delta=0.2),
    "opsm": dict(clip_center="pi_k", opsm_delta=0.5),
}
MASKED = ("mis2", "m2po", "m2po-quadrant", "dppo", "opsm")  # the arms with a mask: masked_frac not 0 by construction
BASELINE = "all (lag 0 baseline)"  # at lag 0 the corrections coincide: one set of runs serves them all
MARGIN = 0.05  # the verdict's margin on the paired difference to lag 0 (`verdict`)
CLOSE, MIN_SEEDS = 0.05, 5  # the seeds rule: a cell whose mean paired difference is within CLOSE gets MIN_SEEDS
M2_THRESHOLD = 0.04  # M2PO's threshold on M2: the drift the gentle rate is chosen to keep lag 256 under (--find-lr)
RUN_COLUMNS = [
    "lag",
    "offpolicy_steps",
    "lr",
    "clip_center",
    "is_cap",
    "is_mask",
    "m2_threshold",
    "m2po_clip_threshold",
    "m2po_quadrant_threshold",
    "dppo_delta",
    "opsm_delta",
]
DRIFT = ("m2", "mismatch_kl_k1", "mismatch_kl_k3")  # how far alpha is from pi_k, over the loss tokens
CSV_COLUMNS = [
    "correction",
    "shared_baseline",
    "rerun",
    "schedule",
    *RUN_COLUMNS,
    "seed",
    "step",
    "wall_s",
    "eval_accuracy",
    "reward",
    "clip_frac",
    "staleness",
    "rho_prime_p99",
    "rho_prime_max",
    "masked_frac",
    "grad_norm",
    *DRIFT,
]
# The metrics.jsonl fields of the masks' fractions: a run has at most one mask, so masked_frac is their sum.
MASK_FIELDS = ("is_masked_frac", "m2po_masked_frac", "m2po_quadrant_masked_frac", "dppo_masked_frac")
MASK_FIELDS += ("opsm_masked_frac",)


def masked_frac(m: dict):
    """The fraction of the step's loss tokens the run's mask dropped (0 without one: a unit that is off reports
    nothing); None for a step without an update."""
    return sum(m.get(k, 0.0) for k in MASK_FIELDS) if "loss" in m else None


# Per-step metrics averaged between eval points; steps without an update (no group had a signal) have none.
STEP_MEANS = {
    **runner.STEP_MEANS,
    **{k: (lambda m, k=k: m.get(k)) for k in ("staleness", "rho_prime_p99", "rho_prime_max", "grad_norm", *DRIFT)},
    "masked_frac": masked_frac,
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m studies.very_stale",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # --- the grid ------------------------------------------------------------------------------
    p.add_argument("--corrections", nargs="+", choices=list(CORRECTIONS), default=list(CORRECTIONS), help="(all)")
    p.add_argument(
        "--lags",
        nargs="+",
        type=int,
        default=[0, 256, 2, 8, 32, 4, 16, 128, 1],
        help="constant lags s, in order (0 = baseline)",
    )
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="seeds of every cell (the first pass)")
    p.add_argument("--periodic-vs", nargs="*", type=int, default=[256, 64], help="refresh periods v, in order")
    p.add_argument(
        "--periodic-corrections",
        nargs="*",
        choices=list(CORRECTIONS),
        default=["current", "m2po"],
        help="the corrections run with the periodic refresh",
    )
    p.add_argument("--lr", type=float, default=1e-4, help="learning rate of the grid (one inner step)")
    p.add_argument("--gentle-lr", type=float, help="a gentler rate for --gentle-lags too (find it with --find-lr)")
    p.add_argument(
        "--gentle-lags", nargs="+", type=int, default=[0, 256], help="the lags run at --gentle-lr (0 = its baseline)"
    )
    p.add_argument(
        "--extra-seeds",
        nargs="*",
        type=int,
        default=[3, 4],  # with --seeds 0 1 2: MIN_SEEDS
        help="seeds added to every cell whose paired difference is within --close of 0 (none: no seeds rule)",
    )
    p.add_argument("--close", type=float, default=CLOSE, help="the seeds rule's bound on |mean paired difference|")
    p.add_argument(
        "--rerun",
        nargs="*",
        help="cells (behaviour-lag8, behaviour-lag8-lr0.0001) or runs (...-s0) trained again into <run>-rerun "
        "folders, their seeds of --seeds (default: behaviour-lag8 where the grid has it; no value: none)",
    )
    p.add_argument("--curve-lag", type=int, default=256, help="the lag whose accuracy-vs-step curves the picture shows")
    # --- finding the gentle rate ----------------------------------------------------------------
    p.add_argument(
        "--find-lr",
        nargs="+",
        type=float,
        metavar="LR",
        help="no study: a short run at lag --find-lr-lag per rate, reporting the mean M2 there",
    )
    p.add_argument("--find-lr-lag", type=int, default=256, help="the lag --find-lr measures (default 256)")
    p.add_argument("--find-lr-steps", type=int, help="steps of each --find-lr run (default: the lag + 64)")
    p.add_argument("--find-lr-correction", choices=list(CORRECTIONS), default="current", help="its arm (current)")
    p.add_argument(
        "--find-lr-threshold", type=float, default=M2_THRESHOLD, help="the M2 the gentle rate must not exceed (0.04)"
    )
    # --- each run ---------------------------------------------------------------------------------
    p.add_argument("--steps", type=int, default=520, help="training steps per run")
    p.add_argument("--eval-every", type=int, default=65, help="held-out accuracy every this many steps")
    p.add_argument("--eval-size", type=int, default=500, help="held-out problems per evaluation")
    p.add_argument("--warmup-steps", type=int, default=Config.warmup_steps, help="warm-up of the tiny policy")
    runner.add_run_flags(p)
    # --- output -----------------------------------------------------------------------------------
    p.add_argument("--out-dir", default="results", help="where very_stale.csv/.png and very_stale_table.md go")
    p.add_argument("--runs-dir", default="runs/very_stale", help="per-run folders")
    p.add_argument("--fresh", action="store_true", help="rerun every run, even one whose summary.json exists")
    p.add_argument("--table-only", action="store_true", help="no training: table and picture from the CSV")
    p.add_argument(
        "--collect",
        action="store_true",
        help="no training: the CSV, table and picture from the runs of the grid already finished under --runs-dir "
        "(a study cut short, or one still running); the others are listed as missing",
    )
    return p


# ---- the grid ---------------------------------------------------------------------------------------


def lag_jobs(corrections: list[str], lag: int, lr: float, seeds: list[int]) -> list[tuple[str, dict]]:
    """One lag's cells at one rate, each with all its seeds: the shared baseline at lag 0, else every correction."""
    one = dict(inner_steps=1, lr=lr)
    if lag == 0:
        return [(BASELINE, dict(lag=0, **one, seed=s)) for s in seeds]
    return [(c, dict(lag=lag, **one, **CORRECTIONS[c], seed=s)) for c in corrections for s in seeds]


def grid(args) -> list[tuple[str, dict]]:
    """(correction, Config changes) of every run of the first pass, in order of priority, cell by cell with all
    its seeds: the lag-0 baseline, the first positive lag of --lags, the --gentle-lr block, the other lags as
    --lags orders them, then the periodic refresh in the order of --periodic-vs."""
    jobs = lag_jobs(args.corrections, 0, args.lr, args.seeds) if 0 in args.lags else []
    lags = [s for s in args.lags if s > 0]
    for i, lag in enumerate(lags):
        jobs += lag_jobs(args.corrections, lag, args.lr, args.seeds)
        if i == 0 and args.gentle_lr is not None:
            for g in sorted(args.gentle_lags, key=lambda s: s > 0):  # its baseline first
                jobs += lag_jobs(args.corrections, g, args.gentle_lr, args.seeds)
    if not lags and args.gentle_lr is not None:
        for g in sorted(args.gentle_lags, key=lambda s: s > 0):
            jobs += lag_jobs(args.corrections, g, args.gentle_lr, args.seeds)
    one = dict(inner_steps=1, lr=args.lr)
    for v in args.periodic_vs:
        jobs += [
            (c, dict(offpolicy_steps=v, **one, **CORRECTIONS[c], seed=s))
            for c in args.periodic_corrections
            for s in args.seeds
        ]
    return jobs


def schedule_of(changes: dict) -> tuple[str, int]:
    """("lag", s) or ("periodic", v): the schedule that fills the queue of stale batches, and its size."""
    return ("periodic", changes["offpolicy_steps"]) if "offpolicy_steps" in changes else ("lag", changes["lag"])


def cell_name(correction: str, changes: dict) -> str:
    """A cell's name, its run's without the seed: current-lag8-lr0.0001, baseline-lag0-lr0.0001, m2po-v64-lr0.0001."""
    name = "baseline" if correction == BASELINE else correction
    schedule, n = schedule_of(changes)
    return f"{name}-{'lag' if schedule == 'lag' else 'v'}{n}-lr{changes['lr']:g}"


def run_name(correction: str, changes: dict) -> str:
    return f"{cell_name(correction, changes)}-s{changes['seed']}"


def job_cell(correction: str, changes: dict) -> tuple:
    """The (correction, schedule, s or v, lr) cell of a job, as `cell_of` reads it from a CSV row."""
    return (correction, *schedule_of(changes), changes["lr"])


def rerun_jobs(args, jobs: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    """The first-pass jobs --rerun names (a cell, a cell without its rate meaning --lr's, or one run). Raises
    ValueError for a name that is no cell or run of the grid; the default, behaviour-lag8, only where it is one."""
    names = ["behaviour-lag8"] if args.rerun is None else args.rerun

    def named(x, c, ch):
        cell = cell_name(c, ch)
        return x in (cell, run_name(c, ch)) or f"{x}-lr{args.lr:g}" == cell

    out = [(c, ch) for c, ch in jobs if any(named(x, c, ch) for x in names)]
    missing = [x for x in names if not any(named(x, c, ch) for c, ch in jobs)]
    if missing and args.rerun is not None:
        example = f" (e.g. {cell_name(*jobs[-1])})" if jobs else ""
        raise ValueError(f"--rerun {missing[0]}: no such cell or run in this grid{example}")
    return out


def extra_seed_jobs(args, jobs: list[tuple[str, dict]], rows: list[dict]) -> list[tuple[str, dict]]:
    """The seeds rule: --extra-seeds for every first-pass cell whose mean paired difference to its rate's lag 0,
    over the seeds of --seeds, is within --close of 0, each rate's baseline first (its pairs need them)."""
    if not args.extra_seeds:
        return []
    final = finals(runs_of(rows))
    close = []
    for c, ch in jobs:
        cell = job_cell(c, ch)
        if c == BASELINE or cell in close or cell not in final:
            continue
        base = {s: a for s, a in final.get((BASELINE, "lag", 0, ch["lr"]), {}).items() if s in args.seeds}
        mine = {s: a for s, a in final[cell].items() if s in args.seeds}
        d = [mine[s] - base[s] for s in sorted(mine.keys() & base.keys())]
        if d and abs(statistics.fmean(d)) <= args.close:
            close.append(cell)
    out, firsts = [], {}
    for c, ch in jobs:  # one job per cell, in grid order: the cell's changes for seed 0 to vary
        firsts.setdefault(job_cell(c, ch), (c, ch))
    for lr in dict.fromkeys(cell[3] for cell in close):
        base = (BASELINE, "lag", 0, lr)
        if base in firsts:
            out += [(BASELINE, dict(firsts[base][1], seed=s)) for s in args.extra_seeds]
    for cell in close:
        c, ch = firsts[cell]
        out += [(c, dict(ch, seed=s)) for s in args.extra_seeds]
    return out


def run_config(args, correction: str, changes: dict, rerun: bool = False):
    folder = run_name(correction, changes) + ("-rerun" if rerun else "")
    return runner.make_config(args, Path(args.runs_dir) / folder, **changes)


def train_jobs(args, jobs: list[tuple[str, dict]], rerun: bool, count0: int, total: str):
    """Train (or reuse; with --collect only read) the jobs; returns {index: rows}, the failed runs."""
    cfgs = [run_config(args, c, ch, rerun) for c, ch in jobs]
    by_job, failed = {}, []
    label = " (rerun)" if rerun else ""
    if args.collect:  # only what finished, as run_jobs reports a reused run; the rest listed as not finished
        done = [runner.finished(cfg) for cfg in cfgs]
        failed = [f"{Path(cfg.out).name}: not finished (--collect)" for cfg, f in zip(cfgs, done) if not f]
        results = [(i, True, None) for i, f in enumerate(done) if f]
    else:
        results = runner.run_jobs(cfgs, args)
    for count, (i, reused, error) in enumerate(results, count0 + 1):
        (correction, changes), cfg = jobs[i], cfgs[i]
        schedule, n = schedule_of(changes)
        tag = f"[{count:>3}/{total}] {correction:<20} {schedule}={n:<3} lr={cfg.lr:<7g} seed={cfg.seed}{label}"
        if error:
            print(f"{tag}  FAILED: {error[0]}\n{error[1]}", flush=True)
            failed.append(f"{Path(cfg.out).name}: {error[0]}")
            continue
        base = {
            "correction": correction,
            "shared_baseline": correction == BASELINE,
            "rerun": rerun,
            "schedule": schedule,
            **{c: getattr(cfg, c) for c in RUN_COLUMNS},
            "seed": cfg.seed,
        }
        r = by_job[i] = runner.run_rows(cfg, base, means=STEP_MEANS)
        print(
            f"{tag}  held-out acc {r[0]['eval_accuracy']:.3f} -> {r[-1]['eval_accuracy']:.3f}  "
            f"{r[-1]['wall_s']:6.1f} s" + ("  (existing run)" if reused else ""),
            flush=True,
        )
    return by_job, failed


def run_study(args) -> tuple[list[dict], list[str]]:
    """Train (or reuse) the first pass, the rerun, then the seeds rule's extra seeds; returns the CSV rows (in
    that order) and the failed runs."""
    jobs = grid(args)
    again = rerun_jobs(args, jobs)
    first, failed = train_jobs(args, jobs, False, 0, f"{len(jobs) + len(again)}+")
    rows = [row for i in sorted(first) for row in first[i]]
    second, failed2 = train_jobs(args, again, True, len(jobs), f"{len(jobs) + len(again)}+")
    rows += [row for i in sorted(second) for row in second[i]]
    extra = extra_seed_jobs(args, jobs, rows)
    if extra:
        print(f"the seeds rule: {len(extra)} runs more ({', '.join(dict.fromkeys(cell_name(*j) for j in extra))})")
    third, failed3 = train_jobs(args, extra, False, len(jobs) + len(again), str(len(jobs) + len(again) + len(extra)))
    rows += [row for i in sorted(third) for row in third[i]]
    return rows, failed + failed2 + failed3


def read_rows(path: Path) -> list[dict]:
    """very_stale.csv back into typed rows (blank cells stay ""; a CSV written before a column existed lacks it:
    `col` reads it as "")."""
    return runner.read_csv(
        path, ints={"lag", "offpolicy_steps", "seed", "step"}, texts={"correction", "schedule", "clip_center"}
    )


def col(r: dict, k: str):
    """Row r's value of column k; "" where the CSV has no such column (rows from before it existed)."""
    return r.get(k, "")


# ---- finding the gentle rate -----------------------------------------------------------------------------


def find_lr(args) -> tuple[str, list[str]]:
    """--find-lr: one run per rate at lag --find-lr-lag (its first seed, evaluations at the start and end only);
    returns a markdown table of the drift over the steps whose batch was exactly that lag stale, and the failed
    runs. The rate to use as --gentle-lr: the largest whose mean M2 is at or below --find-lr-threshold."""
    lag, threshold = args.find_lr_lag, args.find_lr_threshold
    steps = args.find_lr_steps or lag + 64
    short = argparse.Namespace(**{**vars(args), "steps": steps, "eval_every": 0})
    c, seed = args.find_lr_correction, args.seeds[0]
    jobs = [dict(lag=lag, inner_steps=1, lr=lr, **CORRECTIONS[c], seed=seed) for lr in args.find_lr]
    cfgs = [
        runner.make_config(short, Path(args.runs_dir) / "find_lr" / f"{run_name(c, ch)}-steps{steps}", **ch)
        for ch in jobs
    ]
    lines = [
        f"Drift at lag {lag}, {c}, seed {seed}, {steps} steps: means over the steps whose batch was {lag} updates "
        f"stale (steps {lag}-{steps - 1}).",
        "",
        "| lr | steps at the lag | M2 | M2 max | KL k1 | KL k3 | final accuracy | M2 <= threshold |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    found, failed = {}, []
    for i, _reused, error in runner.run_jobs(cfgs, args):
        cfg = cfgs[i]
        if error:
            print(f"lr {cfg.lr:g}  FAILED: {error[0]}\n{error[1]}", flush=True)
            failed.append(f"{Path(cfg.out).name}: {error[0]}")
            continue
        text = (Path(cfg.out) / "metrics.jsonl").read_text().splitlines()
        at = [m for m in map(json.loads, filter(str.strip, text)) if m.get("staleness") == lag and "m2" in m]
        end = json.loads((Path(cfg.out) / "summary.json").read_text())["eval_accuracy_end"]
        m2 = [m["m2"] for m in at]
        found[cfg.lr] = statistics.fmean(m2) if m2 else None
        kl = {k: _mean([m[k] for m in at], ".4f") for k in ("mismatch_kl_k1", "mismatch_kl_k3")}
        ok = "—" if not m2 else "yes" if found[cfg.lr] <= threshold else "no"
        lines.append(
            f"| {cfg.lr:g} | {len(at)} | {_mean(m2, '.4f')} | {max(m2) if m2 else 0:.4f} | {kl['mismatch_kl_k1']} "
            f"| {kl['mismatch_kl_k3']} | {end:.3f} | {ok} |"
        )
        print(lines[-1], flush=True)
    lines[4:] = sorted(lines[4:], key=lambda line: -float(line.split("|")[1]))
    under = [lr for lr, m in found.items() if m is not None and m <= threshold]
    lines += [
        "",
        f"Gentle rate (the largest at or below the M2 threshold {threshold:g}): {max(under):g}: "
        f"pass --gentle-lr {max(under):g}"
        if under
        else f"No rate kept M2 at or below the M2 threshold {threshold:g}: try smaller ones.",
    ]
    return "\n".join(lines) + "\n", failed


# ---- the table ---------------------------------------------------------------------------------------


def cell_of(r: dict) -> tuple[str, str, int, float]:
    """(correction, schedule, s or v, lr) of a row: the cell of the grid it belongs to."""
    return r["correction"], r["schedule"], r["lag"] if r["schedule"] == "lag" else r["offpolicy_steps"], r["lr"]


def runs_of(rows: list[dict], reruns: bool = False) -> dict[tuple, list[dict]]:
    """(correction, schedule, s or v, lr, seed) -> that run's rows, by step; the rerun's runs with reruns=True,
    the others without (a CSV from before the rerun column has none)."""
    runs = {}
    for r in rows:
        if (col(r, "rerun") is True) == reruns:
            runs.setdefault((*cell_of(r), r["seed"]), []).append(r)
    return {k: sorted(rs, key=lambda r: r["step"]) for k, rs in runs.items()}


def finals(runs: dict[tuple, list[dict]]) -> dict[tuple, dict[int, float]]:
    """cell -> {seed: final held-out accuracy}."""
    final = {}
    for (*cell, s), rs in runs.items():
        final.setdefault(tuple(cell), {})[s] = rs[-1]["eval_accuracy"]
    return final


def _mean(xs: list, spec: str, scale: float = 1.0, unit: str = "") -> str:
    xs = [x for x in xs if x != ""]
    return format(scale * statistics.fmean(xs), spec) + unit if xs else "—"


# t_{0.975, df} for df = 1..30 (scipy.stats.t.ppf(0.975, df), to 3 decimals); beyond, the Cornish-Fisher expansion.
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131)
T975 += (2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t975(df: int) -> float:
    """The two-sided 95% quantile of Student's t with df degrees of freedom."""
    if df <= len(T975):
        return T975[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def interval(diffs: list[float]) -> tuple[float, float, float] | None:
    """(mean, low, high): the mean and its 95% t-interval, mean +- t_{0.975, n-1} sd / sqrt(n); None below 2."""
    if len(diffs) < 2:
        return None
    m = statistics.fmean(diffs)
    half = t975(len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs))
    return m, m - half, m + half


def verdict(diffs: list[float]) -> str:
    """From the paired differences to lag 0: holds when their 95% interval lies wholly above -MARGIN, falls when
    it lies wholly below, unresolved otherwise; "—" with fewer than 2 seeds (no interval)."""
    ci = interval(diffs)
    if ci is None:
        return "—"
    return "holds" if ci[1] > -MARGIN else "falls" if ci[2] < -MARGIN else "unresolved"


def paired(a: dict, b: dict) -> str:
    """The paired difference over the seeds both dicts (seed -> value) hold: "mean [low, high] (wins/n)", the
    interval `interval`'s ("mean (wins/n)" for one seed)."""
    seeds = sorted(a.keys() & b.keys())
    if not seeds:
        return "—"
    d = [a[s] - b[s] for s in seeds]
    ci = interval(d)
    span = f" [{ci[1]:+.3f}, {ci[2]:+.3f}]" if ci else ""
    return f"{statistics.fmean(d):+.3f}{span} ({sum(x > 0 for x in d)}/{len(d)})"


def summary_table(rows: list[dict]) -> str:
    """Markdown: per rate, schedule, lag (or v) and correction, over seeds (mean ± sample std):
    seeds        how many; "(rule: 5)" where the mean paired difference is within CLOSE of 0 on fewer than
                 MIN_SEEDS seeds (the seeds rule asks for more);
    final        held-out accuracy after the last step; range: the seeds' lowest and highest;
    vs lag 0     final minus the same rate's shared lag-0 baseline's final at the same seed: mean, its 95%
                 t-interval [low, high] (`interval`), (wins: seeds where it is higher / seeds);
    verdict      `verdict` of those differences: holds / falls / unresolved;
    M2, KL k1, KL k3   the drift: mean (log rho')^2 and KL(alpha || pi_k) over the loss tokens, each the mean over
                 a run's trained steps ("—": runs from before every metrics row carried them);
    staleness    mean over the trained steps of k minus the step whose weights sampled the batch;
    rho' p99, rho' max   the mean over trained steps of the step's 99th percentile and maximum of rho' = pi_k/alpha;
    masked       share of loss tokens the arm's mask dropped; grad norm the mean norm before clipping;
    wall         seconds per run, evaluations included.
    Then, per correction and rate, the largest lag up to which it holds at every lag of the grid; the drift by
    lag; the rerun's runs beside the first."""
    runs = runs_of(rows)
    order = [BASELINE, *CORRECTIONS]
    final = finals(runs)
    lines = [
        "| correction | lr | schedule | s or v | seeds | final accuracy | range "
        "| vs lag 0, same seed: mean [95% interval] (wins/n) | verdict | last 3 evals | M2 | KL k1 | KL k3 "
        "| staleness | rho' p99 | rho' max | masked | grad norm | wall s |",
        "|---|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    verdicts = {}  # cell -> verdict
    cells = sorted(final, key=lambda k: (-k[3], k[1] == "periodic", k[2], order.index(k[0])))
    for cell in cells:
        c, sch, n, lr = cell
        keys = [k for k in runs if k[:4] == cell]
        ends = [final[cell][k[4]] for k in keys]
        late = [statistics.fmean(r["eval_accuracy"] for r in runs[k][-3:]) for k in keys]
        trained = [r for k in keys for r in runs[k] if r["step"] > 0]
        seeds = str(len(keys))
        if c == BASELINE:
            vs, v = "—", "baseline"
        else:
            base = final.get((BASELINE, "lag", 0, lr), {})
            d = [final[cell][s] - base[s] for s in sorted(final[cell].keys() & base.keys())]
            vs, v = paired(final[cell], base), verdict(d)
            verdicts[cell] = v
            if d and abs(statistics.fmean(d)) <= CLOSE and len(d) < MIN_SEEDS:
                seeds += f" (rule: {MIN_SEEDS})"

        def m(k, spec=".3f", scale=1.0, unit=""):
            return _mean([col(r, k) for r in trained], spec, scale, unit)

        lines.append(
            f"| {c} | {lr:g} | {sch} | {n} | {seeds} | {runner.mean_sd(ends)} | {min(ends):.3f}–{max(ends):.3f} "
            f"| {vs} | {v} | {runner.mean_sd(late)} | {m('m2')} | {m('mismatch_kl_k1')} | {m('mismatch_kl_k3')} "
            f"| {m('staleness', '.1f')} | {m('rho_prime_p99', '.2f')} | {m('rho_prime_max', '.3g')} "
            f"| {m('masked_frac', '.2f', 100, '%')} | {m('grad_norm')} "
            f"| {statistics.fmean(runs[k][-1]['wall_s'] for k in keys):.0f} |"
        )
    out = [
        "",
        f"Verdict: d = final minus the lag-0 final of the same seed and rate; holds if d's 95% t-interval lies wholly "
        f"above {-MARGIN:+.2f}, falls if wholly below, unresolved otherwise (— with one seed). The seeds rule: "
        f"cells whose mean d is within {CLOSE:.2f} of 0 get {MIN_SEEDS} seeds.",
    ]
    for lr in sorted({k[3] for k in final}, reverse=True):
        lags = sorted({n for _, sch, n, r in final if sch == "lag" and n > 0 and r == lr})
        out += [
            "",
            f"lr {lr:g}, holds up to: the largest lag s at which, and at every smaller lag of the grid ({lags}), "
            "it holds (0: none).",
            "",
            "| correction | holds up to lag | verdict at each lag |",
            "|---|---:|---|",
        ]
        for c in CORRECTIONS:
            mine = [(s, verdicts[c, "lag", s, lr]) for s in lags if (c, "lag", s, lr) in verdicts]
            if not mine:
                continue
            upto = 0
            for s, v in mine:
                if v != "holds":
                    break
                upto = s
            out.append(f"| {c} | {upto} | " + ", ".join(f"{s}: {v}" for s, v in mine) + " |")
    out += drift_by_lag(runs) + rerun_table(rows, runs)
    return "\n".join(lines + out).rstrip() + "\n"


def run_mean(run: list[dict], k: str) -> float | None:
    """The mean of column k over a run's trained rows (None: no value, or no such column)."""
    xs = [col(r, k) for r in run if r["step"] > 0]
    xs = [x for x in xs if x != ""]
    return statistics.fmean(xs) if xs else None


def drift_by_lag(runs: dict) -> list[str]:
    """Markdown lines: per rate and lag, the lowest and highest over the corrections of the seed-mean M2, KL k1
    and KL k3 (each a run's mean over its trained steps; "—" where no run has it); none when no run has any."""
    per = {}  # (lr, lag) -> {correction: [(M2, KL k1, KL k3) of each seed]}
    for (c, sch, n, lr, _), run in runs.items():
        drift = tuple(run_mean(run, k) for k in DRIFT)
        if sch == "lag" and any(x is not None for x in drift):
            per.setdefault((lr, n), {}).setdefault(c, []).append(drift)
    if not per:
        return []
    out = [
        "",
        "Drift by lag: the seed mean of each run's mean over its trained steps, lowest–highest over the corrections.",
        "",
        "| lr | lag | corrections | M2 | KL(alpha‖pi_k) k1 | KL(alpha‖pi_k) k3 |",
        "|---|---:|---:|---:|---:|---:|",
    ]

    def span(cells, j):
        xs = [statistics.fmean(d[j] for d in v if d[j] is not None) for v in cells if any(d[j] is not None for d in v)]
        return f"{min(xs):.3f}–{max(xs):.3f}" if xs else "—"

    for lr, n in sorted(per, key=lambda k: (-k[0], k[1])):
        cells = list(per[lr, n].values())
        out.append(f"| {lr:g} | {n} | {len(cells)} | {span(cells, 0)} | {span(cells, 1)} | {span(cells, 2)} |")
    return out


def rerun_table(rows: list[dict], runs: dict) -> list[str]:
    """Markdown lines: each rerun beside its first run (same config, same seed): final accuracies, their
    difference, and the first evaluation at which they differ."""
    again = runs_of(rows, reruns=True)
    if not again:
        return []
    out = [
        "",
        "Run to run: the same config and seed trained twice (--rerun), side by side.",
        "",
        "| correction | lr | schedule | s or v | seed | final, first | final, rerun | rerun − first "
        "| evaluations equal | first step that differs |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key, run in sorted(again.items(), key=lambda kv: kv[0][1:]):
        c, sch, n, lr, s = key
        first = runs.get(key)
        if not first:
            out.append(f"| {c} | {lr:g} | {sch} | {n} | {s} | — | {run[-1]['eval_accuracy']:.3f} | — | — | — |")
            continue
        pairs = [(a["step"], a["eval_accuracy"], b["eval_accuracy"]) for a, b in zip(first, run)]
        equal = sum(a == b for _, a, b in pairs)
        differs = next((str(step) for step, a, b in pairs if a != b), "none")
        a, b = first[-1]["eval_accuracy"], run[-1]["eval_accuracy"]
        out.append(
            f"| {c} | {lr:g} | {sch} | {n} | {s} | {a:.3f} | {b:.3f} | {b - a:+.3f} | {equal}/{len(pairs)} "
            f"| {differs} |"
        )
    return out


# ---- the picture ---------------------------------------------------------------------------------------


def positive(ax, axis: str) -> bool:
    """True when the panel's data lines (not its axhline / axvline, which span the axes) hold only positive values
    on `axis`, and some: a log scale can show them."""
    data = [line for line in ax.get_lines() if line.get_transform() == ax.transData]
    xs = [float(x) for line in data for x in (line.get_xdata() if axis == "x" else line.get_ydata())]
    return bool(xs) and min(xs) > 0


def plot(rows: list[dict], path: Path, curve_lag: int, lr: float | None = None) -> bool:
    """Eight panels at the grid's rate lr (default: the largest in the rows; a gentler rate's cells dashed, with
    triangles): final accuracy vs lag per correction (mean ± std over seeds; the shared lag-0 baseline on every
    line; the periodic refresh at v as hollow squares); final accuracy vs the measured drift (each cell's seed
    mean of its runs' mean M2; KL k3 where the CSV has no m2); accuracy vs step and rho' p99 vs step at lag =
    curve_lag (and the periodic refresh at v = curve_lag); M2, rho' p99, the masked fraction and the gradient
    norm vs lag, each the mean over a run's trained steps, averaged over seeds."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib not installed (pip install -e '.[plot]'): no plot")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = runs_of(rows)
    rates = sorted({k[3] for k in runs}, reverse=True)
    lr = lr if lr in rates else rates[0]
    gentle = [r for r in rates if r != lr]
    colours = {c: plt.get_cmap("tab10")(i) for i, c in enumerate([BASELINE, *CORRECTIONS])}
    fig, axes = plt.subplots(2, 4, figsize=(24, 10))
    (ax_acc, ax_drift, ax_t, ax_rt), (ax_m2, ax_rho, ax_mask, ax_g) = axes
    lags = sorted({k[2] for k in runs if k[1] == "lag"})

    def keys(c, sch, n, rate):
        return [k for k in runs if k[:4] == (c, sch, n, rate)]

    def by_lag(c, sch, value, ns, rate):
        """(n, mean over seeds, std over seeds) of value(run key) for each n; lag 0 is the shared baseline."""
        pts = []
        for n in ns:
            ks = keys(BASELINE if sch == "lag" and n == 0 else c, sch, n, rate)
            xs = [x for x in (value(k) for k in ks) if x is not None]
            if xs:
                pts.append((n, statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0))
        return pts if any(n > 0 for n, _, _ in pts) else []  # the baseline alone is no line of c's

    def final_acc(k):
        return runs[k][-1]["eval_accuracy"]

    def line(ax, c, pts, n_offset, periodic=False, err=True, rate=lr):
        if not pts:
            return
        x = [n * 1.05 ** (n_offset - 4) for n, _, _ in pts]  # a small offset per line: error bars apart
        style = dict(color=colours[c], marker="s" if periodic else "o" if rate == lr else "^", ms=5, capsize=3)
        if periodic or rate != lr:
            style.update(mfc="none", linestyle="--")
        label = f"{c}, periodic v" if periodic else c if rate == lr else f"{c}, lr {rate:g}"
        if err:
            ax.errorbar(x, [m for _, m, _ in pts], yerr=[s for _, _, s in pts], label=label, **style)
        else:
            style.pop("capsize")
            ax.plot(x, [m for _, m, _ in pts], label=label, **style)

    periodic = {(k[0], k[2]) for k in runs if k[1] == "periodic" and k[3] == lr}
    # The drift: M2 where the runs logged it; a CSV from before has KL(alpha || pi_k) k3 only, and the panels say so.
    drift = "m2" if any(run_mean(run, "m2") is not None for run in runs.values()) else "mismatch_kl_k3"
    drift_label = "M2 = mean (log rho')^2" if drift == "m2" else "KL(alpha || pi_k) k3 (these runs predate m2)"
    for i, c in enumerate(CORRECTIONS):
        for rate in [lr, *gentle]:
            line(ax_acc, c, by_lag(c, "lag", final_acc, lags, rate), i, rate=rate)
            pts = by_lag(c, "lag", lambda k: run_mean(runs[k], drift), lags, rate)
            line(ax_m2, c, [p for p in pts if p[0] > 0], i, err=False, rate=rate)
        vs = sorted(v for cc, v in periodic if cc == c)
        line(ax_acc, c, by_lag(c, "periodic", final_acc, vs, lr), i, periodic=True)
        line(ax_rho, c, by_lag(c, "lag", lambda k: run_mean(runs[k], "rho_prime_p99"), lags, lr), i, err=False)
        line(ax_g, c, by_lag(c, "lag", lambda k: run_mean(runs[k], "grad_norm"), lags, lr), i, err=False)
        if c in MASKED:
            pts = by_lag(c, "lag", lambda k: 100 * (run_mean(runs[k], "masked_frac") or 0.0), lags, lr)
            line(ax_mask, c, pts, i)
    base = [final_acc(k) for k in keys(BASELINE, "lag", 0, lr)]
    for ax, title, ylabel, log in (
        (
            ax_acc,
            f"final accuracy vs staleness, lr {lr:g}\n(mean ± std over seeds; lag 0 the shared baseline)",
            "final held-out greedy accuracy",
            False,
        ),
        (ax_m2, f"the drift: {drift_label},\nmean over the loss tokens and a run", drift, True),
        (ax_rho, "rho' = pi_k / alpha: the per-step p99, mean over a run", "rho' p99", True),
        (ax_mask, "the mask's share of loss tokens dropped\n(mean over a run, ± std over seeds)", "masked (%)", False),
        (ax_g, "gradient norm before clipping (at 1), mean over a run", "grad norm", False),
    ):
        ax.set_xscale("symlog", base=2, linthresh=1)
        ticks = sorted(set(lags) | {v for _, v in periodic}) if ax is ax_acc else lags
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_xlabel("lag s (constant); hollow squares: periodic refresh at v" if ax is ax_acc else "lag s")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        if log and positive(ax, "y"):  # a panel without positive values stays linear: log of nothing warns
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    if drift == "m2":
        ax_m2.axhline(M2_THRESHOLD, color="grey", lw=0.8, ls=":")
    if base:
        ax_acc.axhspan(
            statistics.fmean(base) - (statistics.stdev(base) if len(base) > 1 else 0),
            statistics.fmean(base) + (statistics.stdev(base) if len(base) > 1 else 0),
            color=colours[BASELINE],
            alpha=0.12,
            lw=0,
            label="lag 0 (mean ± std)",
        )
    ax_acc.legend(fontsize=7, ncol=2)

    # Accuracy against the measured drift: one point per cell (seed means), joined along the lags.
    drawn = False
    for c in CORRECTIONS:
        for rate in [lr, *gentle]:
            pts = []
            for n in lags:
                ks = keys(c, "lag", n, rate) if n else []
                m2 = [x for x in (run_mean(runs[k], drift) for k in ks) if x is not None]
                if m2:
                    pts.append((statistics.fmean(m2), statistics.fmean(final_acc(k) for k in ks)))
            if pts:
                drawn = True
                style = dict(marker="o", ls="-") if rate == lr else dict(marker="^", ls="--", mfc="none")
                label = c if rate == lr else f"{c}, lr {rate:g}"
                ax_drift.plot(*zip(*sorted(pts)), color=colours[c], ms=5, label=label, **style)
    for rate in [lr, *gentle]:
        b = [final_acc(k) for k in keys(BASELINE, "lag", 0, rate)]
        if b:
            ls = "-" if rate == lr else "--"
            ax_drift.axhline(statistics.fmean(b), color=colours[BASELINE], lw=1, ls=ls, label=f"lag 0, lr {rate:g}")
    ax_drift.set_title(
        "final accuracy vs measured drift (seed means; dotted: M2PO's M2 threshold 0.04)"
        if drift == "m2"
        else "final accuracy vs measured drift: KL k3 (these runs predate m2)",
        fontsize=10,
    )
    if drawn and positive(ax_drift, "x"):
        ax_drift.set_xscale("log")
        ax_drift.legend(fontsize=7, ncol=2)
    if drift == "m2":
        ax_drift.axvline(M2_THRESHOLD, color="grey", lw=0.8, ls=":")
    ax_drift.set_xlabel(
        "M2 = mean (log rho')^2 over the loss tokens, mean over a run"
        if drift == "m2"
        else "KL(alpha || pi_k), k3, mean over the loss tokens and a run"
    )
    ax_drift.set_ylabel("final held-out greedy accuracy")
    ax_drift.grid(alpha=0.3)

    # The curves at lag = curve_lag: accuracy and rho' p99 per eval window, with the periodic refresh at v = curve_lag.
    curves = [(BASELINE, "lag", 0, ":")] + [(c, "lag", curve_lag, "-") for c in CORRECTIONS]
    curves += [(c, "periodic", curve_lag, "--") for c in CORRECTIONS if (c, curve_lag) in periodic]
    for c, sch, n, ls in curves:
        ks = keys(c, sch, n, lr)
        if not ks:
            continue
        steps = [r["step"] for r in runs[ks[0]]]
        label = f"{c} ({len(ks)} seeds)" if sch == "lag" else f"{c}, periodic v={n}"
        for ax, column in ((ax_t, "eval_accuracy"), (ax_rt, "rho_prime_p99")):
            # (step, its values over seeds) at each eval point that has one (rho' has none at step 0)
            at = [(s, [runs[k][j][column] for k in ks if j < len(runs[k])]) for j, s in enumerate(steps)]
            pts = [(s, [x for x in a if x != ""]) for s, a in at]
            pts = [(s, a) for s, a in pts if a]
            if not pts:
                continue
            xs = [s for s, _ in pts]
            ax.plot(xs, [statistics.fmean(a) for _, a in pts], marker="o", ms=3, color=colours[c], ls=ls, label=label)
            if column == "eval_accuracy":
                ax.fill_between(xs, [min(a) for _, a in pts], [max(a) for _, a in pts], color=colours[c], alpha=0.08)
    ax_t.set_title(f"accuracy vs step at lag {curve_lag} (line: seed mean, band: min-max)", fontsize=10)
    ax_t.set_ylabel("held-out greedy accuracy")
    ax_rt.set_title(f"rho' p99 vs step at lag {curve_lag} (mean over the steps since the last eval)", fontsize=10)
    ax_rt.set_ylabel("rho' p99")
    ax_rt.set_yscale("log")
    for ax in (ax_t, ax_rt):
        ax.axvline(curve_lag, color="grey", lw=0.8, ls=":")  # the first step whose batch is not the start's
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
    ax_t.legend(fontsize=7)
    steps = max(r["step"] for r in rows)
    fig.suptitle(
        f"How stale can it go? The built-in arithmetic task, one inner step, lr {lr:g}"
        + (f" (dashed: lr {', '.join(f'{g:g}' for g in gentle)})" if gentle else "")
        + f", {steps} steps per run"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out_dir)
    if args.find_lr:
        table, failed = find_lr(args)
        out.mkdir(parents=True, exist_ok=True)
        (out / "very_stale_find_lr.md").write_text(table)
        print(f"\n{table}\nwrote {out}/very_stale_find_lr.md")
        return 1 if failed else 0
    if args.table_only:
        rows, failed = read_rows(out / "very_stale.csv"), []
    else:
        if min(args.steps, args.eval_size, args.workers) < 1 or args.eval_every < 0 or not args.seeds:
            print(
                "error: --steps, --eval-size, --workers must be >= 1, --eval-every >= 0, --seeds given", file=sys.stderr
            )
            return 2
        try:
            rerun_jobs(args, grid(args))
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        t0 = time.time()
        rows, failed = run_study(args)
        out.mkdir(parents=True, exist_ok=True)
        runner.write_csv(rows, CSV_COLUMNS, out / "very_stale.csv")
        n = len(runs_of(rows)) + len(runs_of(rows, reruns=True))
        print(f"{n} runs trained or reused in {time.time() - t0:.0f} s")
    table = summary_table(rows)
    if failed:
        what = "Runs not finished when collected" if args.collect else "Failed runs"
        table += f"\n{what} (left out above):\n" + "".join(f"- {f}\n" for f in failed)
    (out / "very_stale_table.md").write_text(table)
    (out / "very_stale.png").unlink(missing_ok=True)  # never leave a stale plot beside a new CSV
    png = ", very_stale.png" if plot(rows, out / "very_stale.png", args.curve_lag, args.lr) else ""
    print(f"\n{table}\nwrote {out}/very_stale_table.md{png}" + ("" if args.table_only else ", very_stale.csv"))
    return 1 if failed and not args.collect else 0


if __name__ == "__main__":
    sys.exit(main())
