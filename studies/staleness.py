"""The staleness study: every correction for a stale sampler, side by side, on the built-in task.

    python -m studies.staleness --workers 2    # the whole study, 2 runs at a time (cost: below)
    python -m studies.staleness --table-only   # table and picture again from results/staleness.csv

The sampler alpha is refreshed from the policy every v steps (--offpolicy-steps), so at step k the data
come from a policy up to v-1 updates old. Five ways to correct for that, all at lr 1e-4 (the rate at which
the on/off-policy sweep saw staleness cost accuracy):
  current         [A]'s surrogate (objective.policy_loss), --clip-center pi_k: the interval around rho' = pi_k/alpha.
                  With one inner step the gradient is taken at rho = rho', so the clip never acts: v > 1 is
                  rho'-weighted REINFORCE.
  behaviour       PPO / TRL, --clip-center alpha: the same surrogate with the interval centred at 1.
  (The arms keep the names their committed records were made under, before the flag's values were renamed.)
  decoupled       AReaL: rho' * min(r A, clip(r, 1 - eps, 1 + eps) A), r = pi_theta/pi_k, the weight rho' constant.
  decoupled-tis2  decoupled with the weight rho' capped at 2 (truncated importance sampling, --is-cap 2).
  rec             [B]'s REC: -A log pi_theta with a one-sided clip mask on rho, no importance weight.
With v = 1 and one inner step all five take the same gradient (rho = rho' = r = 1 where it is taken;
tests/test_staleness.py), so ONE set of v = 1 runs is every correction's baseline: its CSV rows read
correction "all (v=1 baseline)", shared_baseline True. The same holds for the three clipped forms at v = 1
with two inner steps (rho' = 1 there, so all three clip r = rho around 1), which gives the inner-steps
block its own shared baseline. And at any v, with one inner step, current and (uncapped) decoupled take
the same gradient, rho' A grad log pi_theta (tests/test_staleness.py::
test_one_stale_inner_step_current_equals_uncapped_decoupled): their one-inner-step runs differ only by
floating-point rounding, so the gap between them measures how far rounding alone moves a run.

The grid (defaults; each a flag), 87 runs, sent out in this order so that a study cut short keeps whole
seed sets:
  1. v = 1 (the shared baseline), then v = 4 and 16 x the five corrections: one inner step, lr 1e-4,
     seeds 0-4 (--seeds);
  2. two inner steps at lr 5e-5 (the same distance per batch as one step of 1e-4; the on/off-policy sweep
     found reuse at an unmatched rate collapses) for current, behaviour and decoupled at v = 4, plus the
     v = 1 two-inner-step baseline, seeds 0-2 (--inner-seeds): on the second inner step rho != rho', so
     here the clips can act;
  3. v = 2 and 8 x the five corrections, seeds 0-1 (--sparse-vs, --sparse-seeds).
  Fewer seeds in 2 and 3 because of time (~45 s a run per worker on the shared 2-core machine): the 87 runs
  took 3099 s as two niced 1-thread workers beside other work (results/staleness_study.log).

Steps and evaluation: 200 steps per run, 500 held-out problems every 50 steps. One 200-step run takes
41 s on one thread (v = 4, measured with one other process on the machine): 0.12 s a step updating,
0.07 s sampling and scoring, 0.03 s the behaviour log-prob pass; the five evaluations of 500 problems add
under 2 s, so the sweep's eval size costs nothing worth saving, and its 500 problems keep one eval's
binomial standard error at ~2.2 points (300 would give 2.8). The steps are what the budget buys: 250 (the
on/off-policy sweep's) x 87 runs would not fit ~40 minutes of two workers; 200 still spans 12 refreshes of
the sampler at v = 16, and the sweep's curves at lr 1e-4 had separated by step 150.

Outputs (--out-dir): staleness.csv (one row per run and eval point: reward, clip_frac, rho_prime_p99,
is_capped_frac, is_masked_frac and mismatch_kl_k3 averaged over the steps since the previous eval),
staleness_table.md (per correction and v: final accuracy, its paired difference to the v = 1 baseline at
the same seed, wins, clipped share, rho' p99; then every pair of corrections head to head at each v),
staleness.png. Runs reuse finished run folders under --runs-dir like the on/off-policy sweep.

Caveats: wall_s includes the held-out evaluations and, with --workers > 1 on shared cores, whatever else
the machine was doing; compare it between runs of one study only. The limits of the on/off-policy sweep
(a 1M-parameter model, 3-4-token completions, no KL) hold here too.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

from config import Config
from studies import runner

CORRECTIONS = {
    "current": dict(clip_center="pi_k"),
    "behaviour": dict(clip_center="alpha"),
    "decoupled": dict(clip_center="decoupled"),
    "decoupled-tis2": dict(clip_center="decoupled", is_cap=2.0),
    "rec": dict(loss="rec"),
}
CLIPPED = ("current", "behaviour", "decoupled")  # the arms whose clip acts once rho != rho' (inner steps > 1)
BASELINE = "all (v=1 baseline)"  # at v = 1 the corrections coincide: one set of runs serves them all
RUN_COLUMNS = ["offpolicy_steps", "inner_steps", "lr", "clip_center", "loss", "is_cap"]
CSV_COLUMNS = [
    "correction",
    "shared_baseline",
    *RUN_COLUMNS,
    "seed",
    "step",
    "wall_s",
    "eval_accuracy",
    "reward",
    "clip_frac",
    "rho_prime_p99",
    "is_capped_frac",
    "is_masked_frac",
    "mismatch_kl_k3",
]
# Per-step metrics averaged between eval points; steps without an update (no group had a signal) have none.
STEP_MEANS = {
    **runner.STEP_MEANS,
    **{k: (lambda m, k=k: m.get(k)) for k in ("rho_prime_p99", "mismatch_kl_k3")},
    # TIS's and MIS's figures: 0 where the unit is off (it reports nothing), None on a step without an update
    **{k: (lambda m, k=k: m.get(k, 0.0) if "loss" in m else None) for k in ("is_capped_frac", "is_masked_frac")},
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m studies.staleness",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # --- the grid ------------------------------------------------------------------------------
    p.add_argument("--corrections", nargs="+", choices=list(CORRECTIONS), default=list(CORRECTIONS), help="(all)")
    p.add_argument("--vs", nargs="+", type=int, default=[1, 2, 4, 8, 16], help="refresh periods v (1 = baseline)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4], help="seeds at every v not sparse")
    p.add_argument("--sparse-vs", nargs="*", type=int, default=[2, 8], help="the v that get only --sparse-seeds")
    p.add_argument("--sparse-seeds", nargs="+", type=int, default=[0, 1], help="seeds at the --sparse-vs")
    p.add_argument("--lr", type=float, default=1e-4, help="learning rate of the one-inner-step grid")
    p.add_argument(
        "--inner-steps", type=int, default=2, help="inner steps of the second block, at lr / inner-steps (0: none)"
    )
    p.add_argument("--inner-vs", nargs="*", type=int, default=[4], help="v of the inner-steps block (besides v = 1)")
    p.add_argument("--inner-seeds", nargs="+", type=int, default=[0, 1, 2], help="seeds of the inner-steps block")
    p.add_argument("--curve-v", type=int, default=8, help="the v whose accuracy-vs-step curves the picture shows")
    # --- each run ---------------------------------------------------------------------------------
    p.add_argument("--steps", type=int, default=200, help="training steps per run")
    p.add_argument("--eval-every", type=int, default=50, help="held-out accuracy every this many steps")
    p.add_argument("--eval-size", type=int, default=500, help="held-out problems per evaluation")
    p.add_argument("--warmup-steps", type=int, default=Config.warmup_steps, help="warm-up of the tiny policy")
    runner.add_run_flags(p)
    # --- output -----------------------------------------------------------------------------------
    p.add_argument("--out-dir", default="results", help="where staleness.csv/.png and staleness_table.md go")
    p.add_argument("--runs-dir", default="runs/staleness", help="per-run folders")
    p.add_argument("--fresh", action="store_true", help="rerun every run, even one whose summary.json exists")
    p.add_argument("--table-only", action="store_true", help="no training: table and picture from the CSV")
    return p


def grid(args) -> list[tuple[str, dict]]:
    """(correction, Config changes) of every run, in order of priority, so that a study cut short keeps
    whole seed sets: the v = 1 baseline and the fully seeded v, then the inner-steps block, then the
    sparse v seed by seed (seed 0 at every sparse v and correction, then seed 1, ...)."""
    one = dict(inner_steps=1, lr=args.lr)
    jobs = [(BASELINE, dict(offpolicy_steps=1, **one, seed=s)) for s in args.seeds] if 1 in args.vs else []
    dense = [v for v in args.vs if v > 1 and v not in args.sparse_vs]
    sparse = [v for v in args.vs if v > 1 and v in args.sparse_vs]
    for v in dense:
        jobs += [
            (c, dict(offpolicy_steps=v, **one, **CORRECTIONS[c], seed=s)) for c in args.corrections for s in args.seeds
        ]
    if args.inner_steps > 1:
        inner = dict(inner_steps=args.inner_steps, lr=args.lr / args.inner_steps)
        jobs += [(BASELINE, dict(offpolicy_steps=1, **inner, seed=s)) for s in args.inner_seeds]
        for v in args.inner_vs:
            jobs += [
                (c, dict(offpolicy_steps=v, **inner, **CORRECTIONS[c], seed=s))
                for c in args.corrections
                if c in CLIPPED
                for s in args.inner_seeds
            ]
    for s in args.sparse_seeds:
        jobs += [
            (c, dict(offpolicy_steps=v, **one, **CORRECTIONS[c], seed=s)) for v in sparse for c in args.corrections
        ]
    return jobs


def run_name(correction: str, changes: dict) -> str:
    name = "baseline" if correction == BASELINE else correction
    return f"{name}-v{changes['offpolicy_steps']}-i{changes['inner_steps']}-lr{changes['lr']:g}-s{changes['seed']}"


def run_study(args) -> tuple[list[dict], list[str]]:
    """Train (or reuse) every run of the grid; returns the CSV rows (in grid order) and the failed runs."""
    jobs = grid(args)
    cfgs = [runner.make_config(args, Path(args.runs_dir) / run_name(c, ch), **ch) for c, ch in jobs]
    by_job, failed = {}, []
    for count, (i, reused, error) in enumerate(runner.run_jobs(cfgs, args), 1):
        (correction, changes), cfg = jobs[i], cfgs[i]
        tag = (
            f"[{count:>3}/{len(jobs)}] {correction:<18} v={cfg.offpolicy_steps:<2} i={cfg.inner_steps} seed={cfg.seed}"
        )
        if error:
            print(f"{tag}  FAILED: {error[0]}\n{error[1]}", flush=True)
            failed.append(f"{run_name(correction, changes)}: {error[0]}")
            continue
        base = {
            "correction": correction,
            "shared_baseline": correction == BASELINE,
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
    """staleness.csv back into typed rows (blank cells stay "")."""
    return runner.read_csv(
        path, ints={"offpolicy_steps", "inner_steps", "seed", "step"}, texts={"correction", "clip_center", "loss"}
    )


# ---- the table ---------------------------------------------------------------------------------------


def runs_of(rows: list[dict]) -> dict[tuple, list[dict]]:
    """(correction, v, inner_steps, lr, seed) -> that run's rows, by step."""
    runs = {}
    for r in rows:
        runs.setdefault((r["correction"], r["offpolicy_steps"], r["inner_steps"], r["lr"], r["seed"]), []).append(r)
    return {k: sorted(rs, key=lambda r: r["step"]) for k, rs in runs.items()}


def _paired(a: dict, b: dict) -> str:
    """Paired difference over the seeds both dicts (seed -> value) hold: "mean ± std (wins/n[, ties], t)".

    A tie (the same final accuracy) is common here: runs whose gradients agree up to rounding can sample
    the same batches for a whole run (see the module docstring)."""
    seeds = sorted(a.keys() & b.keys())
    if not seeds:
        return "—"
    d = [a[s] - b[s] for s in seeds]
    sd = statistics.stdev(d) if len(d) > 1 else 0.0
    ties = sum(x == 0 for x in d)
    tied = f", {ties} tied" if ties else ""
    t = f", t {statistics.fmean(d) / (sd / len(d) ** 0.5):+.1f}" if sd > 0 else ""
    return f"{runner.mean_sd(d, signed=True)} ({sum(x > 0 for x in d)}/{len(d)}{tied}{t})"


def _pct(xs: list) -> str:
    xs = [x for x in xs if x != ""]
    return f"{100 * statistics.fmean(xs):.2f}%" if xs else "—"


def summary_table(rows: list[dict]) -> str:
    """Markdown: per (inner steps, lr) block, per correction and v, over seeds (mean ± sample std):
    final      held-out accuracy after the last step;
    vs v=1     final minus the block's shared v = 1 baseline's final at the same seed, then
               (wins: seeds where it is higher / seeds, ties if any, t = mean / (std / sqrt(n)));
    last 3     mean of each run's last three eval points;
    clipped    share of loss tokens whose clip was active; rho' p99 the mean per-step 99th percentile of
               rho' = pi_k / alpha; capped the share of tokens whose weight TIS capped;
    wall       seconds per run, evaluations included.
    Then each pair of corrections at each v > 1, paired by seed: row minus column, (wins/n, t)."""
    runs = runs_of(rows)
    blocks = sorted({(k[2], k[3]) for k in runs})
    order = [BASELINE, *CORRECTIONS]
    lines = [
        "| correction | v | inner | lr | seeds | final accuracy | vs v=1, same seed (wins/n, t) | last 3 evals "
        "| clipped | rho' p99 | TIS capped | wall s |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    heads = ["", "Head to head at each v, paired by seed (row minus column: mean ± std (wins/n, t)):", ""]
    for inner, lr in blocks:
        final = {}  # (correction, v) -> {seed: final accuracy}
        for (c, v, i, lr_, s), rs in runs.items():
            if (i, lr_) == (inner, lr):
                final.setdefault((c, v), {})[s] = rs[-1]["eval_accuracy"]
        base = final.get((BASELINE, 1), {})
        for c, v in sorted(final, key=lambda cv: (cv[1], order.index(cv[0]))):
            keys = [k for k in runs if k[:4] == (c, v, inner, lr)]
            seeds = sorted(k[4] for k in keys)
            ends = [final[c, v][s] for s in seeds]
            late = [statistics.fmean(r["eval_accuracy"] for r in runs[k][-3:]) for k in keys]
            trained = [r for k in keys for r in runs[k] if r["step"] > 0]
            vs = "—" if c == BASELINE else _paired(final[c, v], base)
            rho = [r["rho_prime_p99"] for r in trained if r["rho_prime_p99"] != ""]
            rho = f"{statistics.fmean(rho):.2f}" if rho else "—"
            lines.append(
                f"| {c} | {v} | {inner} | {lr:g} | {len(seeds)} | {runner.mean_sd(ends)} | {vs} | "
                f"{runner.mean_sd(late)} | {_pct([r['clip_frac'] for r in trained])} | "
                f"{rho} | {_pct([r['is_capped_frac'] for r in trained])} | "
                f"{statistics.fmean(runs[k][-1]['wall_s'] for k in keys):.0f} |"
            )
        for v in sorted({v for _, v in final if v > 1}):
            names = [c for c in CORRECTIONS if (c, v) in final]
            if len(names) < 2:
                continue
            heads += [
                f"inner steps {inner}, lr {lr:g}, v = {v}:",
                "",
                "| | " + " | ".join(names[1:]) + " |",
                "|---|" + "---:|" * (len(names) - 1),
            ]
            for i, a in enumerate(names[:-1]):
                cells = ["" if j <= i else _paired(final[a, v], final[b, v]) for j, b in enumerate(names) if j > 0]
                heads.append(f"| {a} | " + " | ".join(cells) + " |")
            heads.append("")
    return "\n".join(lines + heads).rstrip() + "\n"


# ---- the picture ---------------------------------------------------------------------------------------


def plot(rows: list[dict], path: Path, curve_v: int) -> bool:
    """Three panels: final accuracy vs v per correction (one inner step; mean ± std over seeds, the
    shared v = 1 baseline drawn at v = 1 on every line); accuracy vs step at v = curve_v; the inner-steps
    block (final accuracy per seed and the mean, next to the same corrections with one inner step)."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib not installed (pip install -e '.[plot]'): no plot")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = runs_of(rows)
    colours = {c: plt.get_cmap("tab10")(i) for i, c in enumerate([BASELINE, *CORRECTIONS])}
    one = [k for k in runs if k[2] == 1]
    lr1 = one[0][3] if one else None
    fig, (ax_v, ax_t, ax_i) = plt.subplots(1, 3, figsize=(18, 5.2), gridspec_kw={"width_ratios": [1.2, 1.2, 0.8]})

    def finals(c, v, inner, lr):
        return [rs[-1]["eval_accuracy"] for k, rs in runs.items() if k[:4] == (c, v, inner, lr)]

    base1 = finals(BASELINE, 1, 1, lr1)
    vs = sorted({k[1] for k in one})
    for n, c in enumerate(CORRECTIONS):
        pts = [(v, finals(c, v, 1, lr1) if v > 1 else base1) for v in vs]
        pts = [(v, a) for v, a in pts if a]
        if len(pts) < 2 and not any(v > 1 for v, _ in pts):
            continue
        x = [v * 1.04 ** (n - 2) for v, _ in pts]  # a small offset per line, so the error bars do not overlap
        mean = [statistics.fmean(a) for _, a in pts]
        sd = [statistics.stdev(a) if len(a) > 1 else 0.0 for _, a in pts]
        ax_v.errorbar(x, mean, yerr=sd, marker="o", ms=4, capsize=3, color=colours[c], label=c)
    ax_v.set_xscale("log", base=2)
    ax_v.set_xticks(vs, [str(v) for v in vs])
    ax_v.set_xlabel("refresh period v (staleness; v = 1 on-policy, the shared baseline)")
    ax_v.set_ylabel("final held-out greedy accuracy")
    ax_v.set_title(f"final accuracy vs staleness, 1 inner step, lr {lr1:g}\n(mean ± std over seeds)", fontsize=10)
    ax_v.grid(alpha=0.3)
    ax_v.legend(fontsize=8, title="correction", title_fontsize=8)

    for c in [BASELINE, *CORRECTIONS]:
        v = 1 if c == BASELINE else curve_v
        keys = [k for k in one if k[0] == c and k[1] == v]
        if not keys:
            continue
        steps = [r["step"] for r in runs[keys[0]]]
        acc = [[runs[k][j]["eval_accuracy"] for k in keys] for j in range(len(steps))]
        mean = [statistics.fmean(a) for a in acc]
        style = dict(color=colours[c], linestyle=":" if c == BASELINE else "-")
        ax_t.plot(steps, mean, marker="o", ms=3, label=f"{c} ({len(keys)} seeds)", **style)
        ax_t.fill_between(steps, [min(a) for a in acc], [max(a) for a in acc], color=colours[c], alpha=0.1, lw=0)
    ax_t.set_xlabel("training step")
    ax_t.set_ylabel("held-out greedy accuracy")
    ax_t.set_title(f"accuracy vs step at v = {curve_v}, lr {lr1:g}\n(line: seed mean, band: min-max)", fontsize=10)
    ax_t.grid(alpha=0.3)
    ax_t.legend(fontsize=8)

    ticks = []  # the third panel: each inner-steps run set next to the same correction with one inner step
    for i_, lr_ in sorted({(k[2], k[3]) for k in runs if k[2] > 1}):
        for v in sorted({k[1] for k in runs if k[2:4] == (i_, lr_)}):
            for c in [BASELINE] if v == 1 else [c for c in CORRECTIONS if finals(c, v, i_, lr_)]:
                for i, lr in ((1, lr1), (i_, lr_)):
                    a = finals(c, v, i, lr)
                    if not a:
                        continue
                    x = len(ticks)
                    ax_i.scatter([x] * len(a), a, s=14, color=colours[c], alpha=0.6)
                    ax_i.hlines(statistics.fmean(a), x - 0.3, x + 0.3, color=colours[c], lw=2.5 if i > 1 else 1.2)
                    ticks.append(f"{'baseline' if c == BASELINE else c}, v={v}\n{i} inner, lr {lr:g}")
    ax_i.set_xticks(range(len(ticks)), ticks, rotation=50, ha="right", fontsize=7)
    ax_i.set_ylabel("final held-out greedy accuracy")
    ax_i.set_title("the clips acting: 2 inner steps at half the lr\n(dot: a seed, bar: the mean)", fontsize=10)
    ax_i.grid(alpha=0.3, axis="y")
    steps = max(r["step"] for r in rows)
    fig.suptitle(f"Staleness corrections on the built-in arithmetic task ({steps} steps per run)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out_dir)
    if args.table_only:
        rows, failed = read_rows(out / "staleness.csv"), []
    else:
        if min(args.steps, args.eval_size, args.workers) < 1 or args.eval_every < 0 or not args.seeds:
            print(
                "error: --steps, --eval-size, --workers must be >= 1, --eval-every >= 0, --seeds given", file=sys.stderr
            )
            return 2
        t0 = time.time()
        rows, failed = run_study(args)
        out.mkdir(parents=True, exist_ok=True)
        runner.write_csv(rows, CSV_COLUMNS, out / "staleness.csv")
        print(f"{len(runs_of(rows))} runs trained or reused in {time.time() - t0:.0f} s")
    table = summary_table(rows)
    if failed:
        table += "\nFailed runs (left out above):\n" + "".join(f"- {f}\n" for f in failed)
    (out / "staleness_table.md").write_text(table)
    (out / "staleness.png").unlink(missing_ok=True)  # never leave a stale plot beside a new CSV
    png = ", staleness.png" if plot(rows, out / "staleness.png", args.curve_v) else ""
    print(f"\n{table}\nwrote {out}/staleness_table.md{png}" + ("" if args.table_only else ", staleness.csv"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
