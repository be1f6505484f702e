"""How stale can it go? Six corrections at a constant lag of up to 256 updates, on the built-in task.

    python -m studies.very_stale --workers 2    # the whole study, 2 runs at a time (cost: below)
    python -m studies.very_stale --table-only   # table and picture again from results/very_stale.csv

Asynchronous trainers (TRL's AsyncGRPOTrainer, verl's one-step-off and fully async modes, AReaL) train each
batch a fixed number of updates after the policy that sampled it. `--lag s` is that schedule: the batch of step
k is sampled by pi_theta as it stood at step max(0, k - s). M2PO (Zheng et al. 2025) reports matching
on-policy with data 256 updates stale; this study asks the same of six corrections, all at one inner step and
lr 1e-4 (the rate at which studies/staleness.py saw staleness cost accuracy):
  current         [A]'s surrogate, --clip-center pi_k (the project's default; the arm names are
                  studies/staleness.py's). With one inner step the clip never acts: rho'-weighted REINFORCE.
  behaviour       PPO / TRL, --clip-center alpha: the same surrogate with the interval centred at 1.
  decoupled-tis2  AReaL's decoupled objective, the weight rho' = pi_k / alpha capped at 2 (--is-cap 2).
  mis2            MIS, --is-mask 2: tokens with rho' outside [1/2, 2] leave the loss and its normaliser (the
                  bound of the TIS arm, as a mask; the project's docs recommend no value, verl's token-level
                  default threshold is 2).
  m2po            M2PO, --m2-threshold 0.04 (AReaL's default): the step's tokens of largest
                  (log alpha - log pi_k)^2 leave until the mean of the rest is < 0.04.
  opsm            DeepSeek-V3.2's off-policy sequence mask, --opsm-delta 0.5 (TRL's off_policy_mask_threshold
                  has no default; 0.5 is the value its documentation gives): a sequence with A < 0 whose mean
                  log alpha - log pi_theta exceeds 0.5 leaves the loss.
  The three masks act on [A]'s default centre, so each mask arm differs from `current` by its mask alone.
At lag 0 with one inner step all six take the same gradient: alpha = pi_k = pi_theta where the gradient is
taken, so rho = rho' = r = 1 (no clip acts, no weight differs from 1, MIS keeps every token), M2PO's
v_t = (log alpha - log pi_k)^2 = 0 (nothing leaves: the mean 0 is < the M2 threshold) and OPSM's
mean of log alpha - log pi_theta is 0 (not > delta) (tests/test_very_stale.py). So ONE set of lag-0 runs is
every correction's baseline: its CSV rows read correction "all (lag 0 baseline)", shared_baseline True, and
each other run is paired with the baseline run of its seed.

The grid (defaults; each a flag), 87 runs, sent out in this order so that a study cut short keeps whole seed
sets (every cell that finished has all its seeds):
  1. lag 0, the shared baseline, seeds 0-2;
  2. lag 256, 128, 32, 8 (the far end, the study's question, first) x the six corrections, seeds 0-2;
  3. [A]'s periodic refresh (--offpolicy-steps v) at v = 256, then 64, for current and m2po, seeds 0-2: the
     two schedules side by side. Within a refresh period the lag runs 0, 1, ..., v - 1 (mean (v - 1) / 2).
Steps and evaluation: 520 steps per run, 500 held-out problems every 65 steps (8 equal windows). At lag s the
steps 0, ..., s all train on batches of the starting policy, so at s = 256 the batches sampled after the start
are those of steps 257 on: 263 of 520, most of the run (the issue's 2 x 256 = 512 steps would give 255 of 512;
515 is the least that gives most). Cost: on a quiet core a run takes ~75 s (0.14 s a step: sampling 0.03,
log alpha's forward 0.025, the update 0.08; behaviour-lag8, its metrics' t_* fields); the 87 runs took 7541 s as
two 1-thread workers on a 2-core machine shared with other work (runs 74-454 s each; results/very_stale_study.log),
from commit 18113a4. A shorter budget drops the periodic v = 64 block first, the last in the order
(results/README.md says what ran).

Outputs (--out-dir): very_stale.csv (one row per run and eval point: reward, clip_frac, staleness (k minus the
step whose weights sampled the batch), rho_prime_p99, rho_prime_max, masked_frac (the fraction of loss tokens
the arm's mask dropped: MIS's, M2PO's or OPSM's), grad_norm (before clipping at --max-grad-norm 1) and
mismatch_kl_k3, each averaged over the steps since the previous eval), very_stale_table.md (per correction and
lag: final accuracy, its paired difference to the lag-0 baseline at the same seed, the verdict, the tails),
very_stale.png. Runs reuse finished run folders under --runs-dir like the other studies.

Caveats: wall_s includes the held-out evaluations and, on shared cores, whatever else the machine was doing;
compare it between runs of one study only. The limits of the other toy studies hold: a 1M-parameter model,
3-4-token completions, no KL term, 3 seeds.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

from config import Config
from studies import runner
from studies.staleness import _paired

CORRECTIONS = {
    "current": dict(clip_center="pi_k"),
    "behaviour": dict(clip_center="alpha"),
    "decoupled-tis2": dict(clip_center="decoupled", is_cap=2.0),
    "mis2": dict(clip_center="pi_k", is_mask=2.0),
    "m2po": dict(clip_center="pi_k", m2_threshold=0.04),
    "opsm": dict(clip_center="pi_k", opsm_delta=0.5),
}
MASKED = ("mis2", "m2po", "opsm")  # the arms with a mask, whose masked_frac is not 0 by construction
BASELINE = "all (lag 0 baseline)"  # at lag 0 the corrections coincide: one set of runs serves them all
HOLDS, FALLS = -0.03, "falls"  # the verdict's threshold on the paired mean difference to lag 0 (summary_table)
RUN_COLUMNS = ["lag", "offpolicy_steps", "lr", "clip_center", "is_cap", "is_mask", "m2_threshold", "opsm_delta"]
CSV_COLUMNS = [
    "correction",
    "shared_baseline",
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
    "mismatch_kl_k3",
]
# The metrics.jsonl fields of the three masks' fractions: a run has at most one mask, so masked_frac is their sum.
MASK_FIELDS = ("is_masked_frac", "m2po_masked_frac", "opsm_masked_frac")


def masked_frac(m: dict):
    """The fraction of the step's loss tokens the run's mask dropped (0 without one: a unit that is off reports
    nothing); None for a step without an update."""
    return sum(m.get(k, 0.0) for k in MASK_FIELDS) if "loss" in m else None


# Per-step metrics averaged between eval points; steps without an update (no group had a signal) have none.
STEP_MEANS = {
    **runner.STEP_MEANS,
    **{
        k: (lambda m, k=k: m.get(k))
        for k in ("staleness", "rho_prime_p99", "rho_prime_max", "grad_norm", "mismatch_kl_k3")
    },
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
        "--lags", nargs="+", type=int, default=[0, 256, 128, 32, 8], help="constant lags s, in order (0 = baseline)"
    )
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="seeds of every cell")
    p.add_argument("--periodic-vs", nargs="*", type=int, default=[256, 64], help="refresh periods v, in order")
    p.add_argument(
        "--periodic-corrections",
        nargs="*",
        choices=list(CORRECTIONS),
        default=["current", "m2po"],
        help="the corrections run with the periodic refresh",
    )
    p.add_argument("--lr", type=float, default=1e-4, help="learning rate (one inner step)")
    p.add_argument("--curve-lag", type=int, default=256, help="the lag whose accuracy-vs-step curves the picture shows")
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


def grid(args) -> list[tuple[str, dict]]:
    """(correction, Config changes) of every run, in order of priority, cell by cell with all its seeds: the
    lag-0 baseline, the lags as --lags orders them, then the periodic refresh in the order of --periodic-vs."""
    one = dict(inner_steps=1, lr=args.lr)
    jobs = [(BASELINE, dict(lag=0, **one, seed=s)) for s in args.seeds] if 0 in args.lags else []
    for lag in [s for s in args.lags if s > 0]:
        jobs += [(c, dict(lag=lag, **one, **CORRECTIONS[c], seed=s)) for c in args.corrections for s in args.seeds]
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


def run_name(correction: str, changes: dict) -> str:
    name = "baseline" if correction == BASELINE else correction
    schedule, n = schedule_of(changes)
    return f"{name}-{'lag' if schedule == 'lag' else 'v'}{n}-lr{changes['lr']:g}-s{changes['seed']}"


def run_study(args) -> tuple[list[dict], list[str]]:
    """Train (or reuse) every run of the grid; returns the CSV rows (in grid order) and the failed runs."""
    jobs = grid(args)
    cfgs = [runner.make_config(args, Path(args.runs_dir) / run_name(c, ch), **ch) for c, ch in jobs]
    by_job, failed = {}, []
    if args.collect:  # only what finished, as run_jobs reports a reused run; the rest listed as not finished
        finished = [runner.finished(cfg) for cfg in cfgs]
        failed = [f"{run_name(*job)}: not finished (--collect)" for job, f in zip(jobs, finished) if not f]
        results = [(i, True, None) for i, f in enumerate(finished) if f]
    else:
        results = runner.run_jobs(cfgs, args)
    for count, (i, reused, error) in enumerate(results, 1):
        (correction, changes), cfg = jobs[i], cfgs[i]
        schedule, n = schedule_of(changes)
        tag = f"[{count:>3}/{len(jobs)}] {correction:<20} {schedule}={n:<3} seed={cfg.seed}"
        if error:
            print(f"{tag}  FAILED: {error[0]}\n{error[1]}", flush=True)
            failed.append(f"{run_name(correction, changes)}: {error[0]}")
            continue
        base = {
            "correction": correction,
            "shared_baseline": correction == BASELINE,
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
    return [row for i in sorted(by_job) for row in by_job[i]], failed


def read_rows(path: Path) -> list[dict]:
    """very_stale.csv back into typed rows (blank cells stay "")."""
    return runner.read_csv(
        path, ints={"lag", "offpolicy_steps", "seed", "step"}, texts={"correction", "schedule", "clip_center"}
    )


# ---- the table ---------------------------------------------------------------------------------------


def cell_of(r: dict) -> tuple[str, str, int]:
    """(correction, schedule, s or v) of a row: the cell of the grid it belongs to."""
    return r["correction"], r["schedule"], r["lag"] if r["schedule"] == "lag" else r["offpolicy_steps"]


def runs_of(rows: list[dict]) -> dict[tuple, list[dict]]:
    """(correction, schedule, s or v, seed) -> that run's rows, by step."""
    runs = {}
    for r in rows:
        runs.setdefault((*cell_of(r), r["seed"]), []).append(r)
    return {k: sorted(rs, key=lambda r: r["step"]) for k, rs in runs.items()}


def _mean(xs: list, spec: str, scale: float = 1.0, unit: str = "") -> str:
    xs = [x for x in xs if x != ""]
    return format(scale * statistics.fmean(xs), spec) + unit if xs else "—"


def verdict(diffs: list[float]) -> str:
    """holds: the mean paired difference to lag 0 is above HOLDS (-3 points: about one evaluation's binomial
    standard error of a difference, sqrt(2) x 2.2 points at 500 problems); falls: below it, in every seed;
    unclear: below it on average, but some seed at or above its baseline."""
    if not diffs:
        return "—"
    if statistics.fmean(diffs) > HOLDS:
        return "holds"
    return FALLS if all(d < 0 for d in diffs) else "unclear"


def summary_table(rows: list[dict]) -> str:
    """Markdown: per schedule, lag (or v) and correction, over seeds (mean ± sample std):
    final        held-out accuracy after the last step; range: the seeds' lowest and highest;
    vs lag 0     final minus the shared lag-0 baseline's final at the same seed, then
                 (wins: seeds where it is higher / seeds, ties if any, t = mean / (std / sqrt(n)));
    verdict      `verdict` of those differences;
    staleness    mean over the trained steps of k minus the step whose weights sampled the batch;
    rho' p99, rho' max   the mean over trained steps of the step's 99th percentile and maximum of rho' = pi_k/alpha;
    masked       share of loss tokens the arm's mask dropped; grad norm the mean norm before clipping;
    wall         seconds per run, evaluations included.
    Then, per correction, the largest lag up to which it holds at every lag of the grid."""
    runs = runs_of(rows)
    order = [BASELINE, *CORRECTIONS]
    final = {}  # (correction, schedule, n) -> {seed: final accuracy}
    for (c, sch, n, s), rs in runs.items():
        final.setdefault((c, sch, n), {})[s] = rs[-1]["eval_accuracy"]
    base = final.get((BASELINE, "lag", 0), {})
    lines = [
        "| correction | schedule | s or v | seeds | final accuracy | range | vs lag 0, same seed (wins/n, t) | verdict "
        "| last 3 evals | staleness | rho' p99 | rho' max | masked | grad norm | wall s |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    verdicts = {}  # (correction, schedule, n) -> verdict
    cells = sorted(final, key=lambda k: (k[1] == "periodic", k[2], order.index(k[0])))
    for c, sch, n in cells:
        keys = [k for k in runs if k[:3] == (c, sch, n)]
        ends = [final[c, sch, n][k[3]] for k in keys]
        late = [statistics.fmean(r["eval_accuracy"] for r in runs[k][-3:]) for k in keys]
        trained = [r for k in keys for r in runs[k] if r["step"] > 0]
        if c == BASELINE:
            vs, v = "—", "baseline"
        else:
            seeds = sorted(final[c, sch, n].keys() & base.keys())
            vs = _paired(final[c, sch, n], base)
            v = verdicts[c, sch, n] = verdict([final[c, sch, n][s] - base[s] for s in seeds])
        col = {k: [r[k] for r in trained] for k in ("staleness", "rho_prime_p99", "rho_prime_max")}
        lines.append(
            f"| {c} | {sch} | {n} | {len(keys)} | {runner.mean_sd(ends)} | {min(ends):.3f}–{max(ends):.3f} | {vs} "
            f"| {v} | {runner.mean_sd(late)} | {_mean(col['staleness'], '.1f')} | {_mean(col['rho_prime_p99'], '.2f')} "
            f"| {_mean(col['rho_prime_max'], '.3g')} | {_mean([r['masked_frac'] for r in trained], '.2f', 100, '%')} "
            f"| {_mean([r['grad_norm'] for r in trained], '.3f')} "
            f"| {statistics.fmean(runs[k][-1]['wall_s'] for k in keys):.0f} |"
        )
    lags = sorted({n for _, sch, n in final if sch == "lag" and n > 0})
    out = [
        "",
        f"Holds up to: the largest lag s at which, and at every smaller lag of the grid ({lags}), it holds (0: none).",
        "",
    ]
    out += ["| correction | holds up to lag | verdict at each lag |", "|---|---:|---|"]
    for c in CORRECTIONS:
        mine = [(s, verdicts[c, "lag", s]) for s in lags if (c, "lag", s) in verdicts]
        if not mine:
            continue
        upto = 0
        for s, v in mine:
            if v != "holds":
                break
            upto = s
        out.append(f"| {c} | {upto} | " + ", ".join(f"{s}: {v}" for s, v in mine) + " |")
    return "\n".join(lines + out).rstrip() + "\n"


# ---- the picture ---------------------------------------------------------------------------------------


def plot(rows: list[dict], path: Path, curve_lag: int) -> bool:
    """Six panels: final accuracy vs lag per correction (mean ± std over seeds; the shared lag-0 baseline on
    every line; the periodic refresh at v as hollow squares), accuracy vs step at lag = curve_lag (and the
    periodic refresh at v = curve_lag), rho' p99 vs step there; rho' p99, the masked fraction and the gradient
    norm vs lag, each the mean over a run's trained steps, averaged over seeds."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib not installed (pip install -e '.[plot]'): no plot")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = runs_of(rows)
    colours = {c: plt.get_cmap("tab10")(i) for i, c in enumerate([BASELINE, *CORRECTIONS])}
    fig, axes = plt.subplots(2, 3, figsize=(18, 10))
    (ax_acc, ax_t, ax_rt), (ax_rho, ax_mask, ax_g) = axes
    lags = sorted({k[2] for k in runs if k[1] == "lag"})

    def keys(c, sch, n):
        return [k for k in runs if k[:3] == (c, sch, n)]

    def run_mean(k, col):
        xs = [r[col] for r in runs[k] if r["step"] > 0 and r[col] != ""]
        return statistics.fmean(xs) if xs else None

    def by_lag(c, sch, value, ns):
        """(n, mean over seeds, std over seeds) of value(run key) for each n; lag 0 is the shared baseline."""
        pts = []
        for n in ns:
            ks = keys(BASELINE if sch == "lag" and n == 0 else c, sch, n)
            xs = [x for x in (value(k) for k in ks) if x is not None]
            if xs:
                pts.append((n, statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0))
        return pts

    def final_acc(k):
        return runs[k][-1]["eval_accuracy"]

    def line(ax, c, pts, n_offset, periodic=False, err=True):
        if not pts:
            return
        x = [n * 1.05 ** (n_offset - 2.5) for n, _, _ in pts]  # a small offset per line: error bars apart
        style = dict(color=colours[c], marker="s" if periodic else "o", ms=5, capsize=3)
        if periodic:
            style.update(mfc="none", linestyle="--")
        label = f"{c}, periodic v" if periodic else c
        if err:
            ax.errorbar(x, [m for _, m, _ in pts], yerr=[s for _, _, s in pts], label=label, **style)
        else:
            style.pop("capsize")
            ax.plot(x, [m for _, m, _ in pts], label=label, **style)

    periodic = {(k[0], k[2]) for k in runs if k[1] == "periodic"}
    for i, c in enumerate(CORRECTIONS):
        line(ax_acc, c, by_lag(c, "lag", final_acc, lags), i)
        vs = sorted(v for cc, v in periodic if cc == c)
        line(ax_acc, c, by_lag(c, "periodic", final_acc, vs), i, periodic=True)
        line(ax_rho, c, by_lag(c, "lag", lambda k: run_mean(k, "rho_prime_p99"), lags), i, err=False)
        line(ax_g, c, by_lag(c, "lag", lambda k: run_mean(k, "grad_norm"), lags), i, err=False)
        if c in MASKED:
            line(ax_mask, c, by_lag(c, "lag", lambda k: 100 * (run_mean(k, "masked_frac") or 0.0), lags), i)
    base = [final_acc(k) for k in keys(BASELINE, "lag", 0)]
    for ax, title, ylabel, log in (
        (
            ax_acc,
            "final accuracy vs staleness\n(mean ± std over seeds; lag 0 the shared baseline)",
            "final held-out greedy accuracy",
            False,
        ),
        (ax_rho, "rho' = pi_k / alpha: the per-step p99, mean over a run", "rho' p99", True),
        (ax_mask, "the mask's share of loss tokens dropped\n(mean over a run, ± std over seeds)", "masked (%)", False),
        (ax_g, "gradient norm before clipping (at 1), mean over a run", "grad norm", False),
    ):
        ax.set_xscale("symlog", base=2, linthresh=4)
        ticks = sorted(set(lags) | {v for _, v in periodic}) if ax is ax_acc else lags
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_xlabel("lag s (constant); hollow squares: periodic refresh at v" if ax is ax_acc else "lag s")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
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

    # The curves at lag = curve_lag: accuracy and rho' p99 per eval window, with the periodic refresh at v = curve_lag.
    curves = [(BASELINE, "lag", 0, ":")] + [(c, "lag", curve_lag, "-") for c in CORRECTIONS]
    curves += [(c, "periodic", curve_lag, "--") for c in CORRECTIONS if (c, curve_lag) in periodic]
    for c, sch, n, ls in curves:
        ks = keys(c, sch, n)
        if not ks:
            continue
        steps = [r["step"] for r in runs[ks[0]]]
        label = f"{c} ({len(ks)} seeds)" if sch == "lag" else f"{c}, periodic v={n}"
        for ax, col in ((ax_t, "eval_accuracy"), (ax_rt, "rho_prime_p99")):
            # (step, its values over seeds) at each eval point that has one (rho' has none at step 0)
            at = [(s, [runs[k][j][col] for k in ks if j < len(runs[k])]) for j, s in enumerate(steps)]
            pts = [(s, [x for x in a if x != ""]) for s, a in at]
            pts = [(s, a) for s, a in pts if a]
            if not pts:
                continue
            xs = [s for s, _ in pts]
            ax.plot(xs, [statistics.fmean(a) for _, a in pts], marker="o", ms=3, color=colours[c], ls=ls, label=label)
            if col == "eval_accuracy":
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
    lr = rows[0]["lr"]
    steps = max(r["step"] for r in rows)
    fig.suptitle(f"How stale can it go? The built-in arithmetic task, one inner step, lr {lr:g}, {steps} steps per run")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out_dir)
    if args.table_only:
        rows, failed = read_rows(out / "very_stale.csv"), []
    else:
        if min(args.steps, args.eval_size, args.workers) < 1 or args.eval_every < 0 or not args.seeds:
            print(
                "error: --steps, --eval-size, --workers must be >= 1, --eval-every >= 0, --seeds given", file=sys.stderr
            )
            return 2
        t0 = time.time()
        rows, failed = run_study(args)
        out.mkdir(parents=True, exist_ok=True)
        runner.write_csv(rows, CSV_COLUMNS, out / "very_stale.csv")
        print(f"{len(runs_of(rows))} runs trained or reused in {time.time() - t0:.0f} s")
    table = summary_table(rows)
    if failed:
        what = "Runs not finished when collected" if args.collect else "Failed runs"
        table += f"\n{what} (left out above):\n" + "".join(f"- {f}\n" for f in failed)
    (out / "very_stale_table.md").write_text(table)
    (out / "very_stale.png").unlink(missing_ok=True)  # never leave a stale plot beside a new CSV
    png = ", very_stale.png" if plot(rows, out / "very_stale.png", args.curve_lag) else ""
    print(f"\n{table}\nwrote {out}/very_stale_table.md{png}" + ("" if args.table_only else ", very_stale.csv"))
    return 1 if failed and not args.collect else 0


if __name__ == "__main__":
    sys.exit(main())
