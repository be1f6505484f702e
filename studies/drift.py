"""Drift against gap: how far each stale run's policy moved from its sampler, set against the accuracy it lost.

    python -m studies.drift              # table and picture from the committed records (no training)
    python -m studies.drift --by-recipe  # the 12-step and the gentle recipe side by side (drift_by_recipe.md)

Reads the 22 run records of the real-model staleness study (studies/real_staleness.py, results/real_staleness/:
SmolLM2-135M-Instruct, LoRA, 12 steps; v = 1 once per seed, then v in {4, 8} x five corrections, seeds 0 and 1).
For every off-policy run (v > 1):

  drift k3   the mean over its stale steps of `mismatch_kl_k3`, the k3 estimate of KL(alpha || pi_k) between the
             policy that sampled the batch and the policy at the start of the step (metrics.jsonl, one a step).
  rho' p99   the mean over its stale steps of the per-step `rho_prime_p99` (the 99th percentile of that step's
             per-token rho' = pi_k / alpha). It is not the p99 of the run's rho' values: the per-token values
             are not stored, only each step's percentiles, so a true run-level p99 cannot be computed from the
             records; the mean of the per-step p99s is what they allow.
  gap        the run's final held-out accuracy (summary.json `eval_accuracy_end`, 200 problems) minus that of
             the v = 1 run of the same seed.

A stale step is one that is not a refresh: step k (counted from 0) with k % v != 0. At a refresh (k = 0, 4, 8 for
v = 4) the batch is sampled by the policy being trained, rho' = 1 and the k3 is 0, so those steps are left out. A
stale step at which every group's rewards were equal (`skipped_no_signal`) took no update and logged neither
number; the means are over the stale steps that logged one (the table's "stale steps" column: logged / all).

Over the 20 off-policy runs: the Spearman rank correlation (average ranks for ties) of drift k3 with gap and of
rho' p99 with gap, each with a bootstrap 95% interval (runs resampled with replacement, 10,000 resamples, a fixed
seed, the 2.5th and 97.5th percentiles). The arm names "current" and "behaviour" are historical: they are
--clip-center pi_k and --clip-center alpha. Writes results/drift_vs_gap.md and results/drift_vs_gap.png
(matplotlib, the `plot` extra; without it the picture is skipped).

`--by-recipe` sets the study's recipes side by side (results/<the recipe's stem>/: the 12-step one above and the
gentle one, lr 1e-4 over 24 steps): for each (arm, v) that every recipe ran, each recipe's gap per seed, its mean
and sample std over seeds, and the mean over those runs of drift k3 and rho' p99; with each recipe's v = 1 finals.
It writes results/drift_by_recipe.md.
"""

import argparse
import json
import math
import random
import statistics
import sys
from pathlib import Path

from studies import real_staleness as rs
from studies import runner

RESAMPLES = 10_000
BY_RECIPE = ("12-step", "gentle")  # --by-recipe: the recipes set side by side (real_staleness.RECIPES)
SEED = 0


def read_record(run: Path) -> tuple[dict, list[dict], dict]:
    """A run folder's config.json, metrics.jsonl (one dict a step) and summary.json."""
    config = json.loads((run / "config.json").read_text())
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return config, metrics, json.loads((run / "summary.json").read_text())


def stale_drift(run: Path) -> dict:
    """The drift a run's stale steps saw: {"v", "seed", "drift_k3", "rho_p99", "stale", "logged"}.

    `drift_k3` is the mean of `mismatch_kl_k3` and `rho_p99` the mean of the per-step `rho_prime_p99` over the
    stale steps (k % v != 0) that logged a value; `stale` counts the stale steps, `logged` those with a value
    (None for a mean over no step)."""
    config, metrics, _ = read_record(run)
    v = config["offpolicy_steps"]
    stale = [m for m in metrics if m["step"] % v != 0]
    k3 = [m["mismatch_kl_k3"] for m in stale if m.get("mismatch_kl_k3") is not None]
    p99 = [m["rho_prime_p99"] for m in stale if m.get("rho_prime_p99") is not None]
    return {
        "v": v,
        "seed": config["seed"],
        "drift_k3": statistics.fmean(k3) if k3 else None,
        "rho_p99": statistics.fmean(p99) if p99 else None,
        "stale": len(stale),
        "logged": len(k3),
    }


def final_accuracy(run: Path) -> float:
    return json.loads((run / "summary.json").read_text())["eval_accuracy_end"]


def collect(runs_dir: Path) -> list[dict]:
    """One row per finished off-policy run of the study's grid, in grid order: {"arm", "run", "gap", **stale_drift}.

    The gap is to the v = 1 run of the run's own seed; a run whose seed has no finished v = 1 run, or that has no
    summary.json (unfinished), is left out. A record whose config.json disagrees with its folder's v or seed is
    an error, not a row."""
    rows = []
    for arm, changes in rs.grid(rs.build_parser().parse_args([])):
        if changes["offpolicy_steps"] == 1:
            continue
        run = runs_dir / rs.run_name(arm, changes)
        base = runs_dir / rs.run_name(rs.BASELINE, dict(offpolicy_steps=1, seed=changes["seed"]))
        if not (run / "summary.json").is_file() or not (base / "summary.json").is_file():
            continue
        d = stale_drift(run)
        if (d["v"], d["seed"]) != (changes["offpolicy_steps"], changes["seed"]):
            raise ValueError(f"{run}: config.json says v={d['v']} seed={d['seed']}, the folder's name does not")
        rows.append({"arm": arm, "run": run.name, "gap": final_accuracy(run) - final_accuracy(base), **d})
    return rows


def ranks(xs: list[float]) -> list[float]:
    """1-based ranks of xs; tied values share the mean of the ranks they span."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    out = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in order[i : j + 1]:
            out[k] = (i + j) / 2 + 1  # ranks i+1 .. j+1, averaged
        i = j + 1
    return out


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rank correlation: Pearson's correlation of the average ranks. NaN when either side is constant."""
    if len(x) != len(y):
        raise ValueError(f"{len(x)} x values against {len(y)} y values")
    rx, ry = ranks(x), ranks(y)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx = sum((a - mx) ** 2 for a in rx)
    syy = sum((b - my) ** 2 for b in ry)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else math.nan


def percentile(xs: list[float], q: float) -> float:
    """The q-th quantile (0 <= q <= 1) of xs, interpolating linearly between order statistics (numpy's default)."""
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (pos - lo) * (s[hi] - s[lo])


def bootstrap_ci(
    x: list[float], y: list[float], resamples: int = RESAMPLES, seed: int = SEED, level: float = 0.95
) -> tuple[float, float]:
    """Percentile bootstrap interval of spearman(x, y): the points (x_i, y_i) resampled with replacement
    `resamples` times from random.Random(seed). A resample in which x or y is constant has no correlation and
    is dropped (with 20 distinct runs, about one chance in 10^24)."""
    rng = random.Random(seed)
    n = len(x)
    stats = []
    for _ in range(resamples):
        idx = [rng.randrange(n) for _ in range(n)]
        r = spearman([x[i] for i in idx], [y[i] for i in idx])
        if not math.isnan(r):
            stats.append(r)
    if not stats:
        return math.nan, math.nan
    tail = (1 - level) / 2
    return percentile(stats, tail), percentile(stats, 1 - tail)


def correlations(rows: list[dict], resamples: int = RESAMPLES, seed: int = SEED) -> dict[str, tuple]:
    """{"drift_k3": (rho, lo, hi), "rho_p99": (rho, lo, hi)}: each measure's Spearman correlation with the gap,
    over the runs that have the measure."""
    out = {}
    for key in ("drift_k3", "rho_p99"):
        have = [r for r in rows if r[key] is not None]  # a run whose stale steps logged nothing has no drift
        x, gap = [r[key] for r in have], [r["gap"] for r in have]
        out[key] = (spearman(x, gap), *bootstrap_ci(x, gap, resamples, seed))
    return out


def verdict(corr: dict[str, tuple], n: int) -> str:
    """The one sentence on choosing v, from the intervals alone."""
    names = {"drift_k3": "drift k3", "rho_p99": "rho' p99"}
    nums = ", ".join(f"{names[k]} {r:+.2f} [{lo:+.2f}, {hi:+.2f}]" for k, (r, lo, hi) in corr.items())
    below = [names[k] for k, (_, _, hi) in corr.items() if hi < 0]
    above = [names[k] for k, (_, lo, _) in corr.items() if lo > 0]
    if not below and not above:  # every interval includes 0 (or is undefined)
        return (
            f"Every 95% interval includes 0 ({nums}), so these {n} runs cannot tell whether a v (or correction) "
            "whose stale steps drift less loses less held-out accuracy against v = 1."
        )
    went = [f"a larger {' and '.join(below)} went with a larger loss against v = 1"] if below else []
    went += [f"a larger {' and '.join(above)} went with a smaller loss against v = 1"] if above else []
    return (
        f"Over these {n} runs {' while '.join(went)} (95% intervals that exclude 0: {nums}), which ranks these runs "
        "by their measured drift but, with v, correction and seed mixed in every rank, does not by itself say "
        "which v to pick."
    )


def table(rows: list[dict], corr: dict[str, tuple], resamples: int = RESAMPLES, seed: int = SEED) -> str:
    """Markdown: a row per off-policy run, then the two correlations with their intervals, then the sentence."""
    lines = [
        "| arm | v | seed | drift k3 | rho' p99 | gap | stale steps (logged/all) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['arm']} | {r['v']} | {r['seed']} | {runner.cell(r['drift_k3'], '.4f')} "
            f"| {runner.cell(r['rho_p99'], '.3f')} | {r['gap']:+.3f} | {r['logged']}/{r['stale']} |"
        )
    lines += [
        "",
        "drift k3: mean `mismatch_kl_k3` over a run's stale steps (k % v != 0). rho' p99: mean over the same steps "
        "of the per-step `rho_prime_p99` (the per-token rho' is not stored, so this is not a run-level p99). gap: "
        "final held-out accuracy minus the same seed's v = 1 run's. Arms `current` and `behaviour` are "
        "--clip-center pi_k and --clip-center alpha.",
        "",
        f"| gap against | Spearman rho (n = {len(rows)}) | bootstrap 95% interval |",
        "|---|---:|---:|",
    ]
    for key, name in (("drift_k3", "drift k3"), ("rho_p99", "rho' p99")):
        rho, lo, hi = corr[key]
        lines.append(f"| {name} | {rho:+.3f} | [{lo:+.3f}, {hi:+.3f}] |")
    lines += [
        "",
        f"Bootstrap: runs resampled with replacement, {resamples:,} resamples, seed {seed}, percentile interval.",
        "",
        verdict(corr, len(rows)),
    ]
    return "\n".join(lines) + "\n"


def mean_of(xs: list) -> float | None:
    """The mean of the values that are not None (None if there are none)."""
    have = [x for x in xs if x is not None]
    return statistics.fmean(have) if have else None


def baseline_finals(runs_dir: Path) -> dict[int, float]:
    """seed -> the final held-out accuracy of that seed's finished v = 1 run."""
    out = {}
    for run in sorted(p.parent for p in runs_dir.glob("*/summary.json")):
        config, _, summary = read_record(run)
        if config["offpolicy_steps"] == 1:
            out[config["seed"]] = summary["eval_accuracy_end"]
    return out


def by_recipe_table(rows: dict[str, list[dict]], baselines: dict[str, dict[int, float]]) -> str:
    """Markdown: each recipe's v = 1 finals; then, for each (arm, v) every recipe ran, a row per recipe with its
    gap per seed, the gaps' mean ± sample std, and the mean over those runs of drift k3 and rho' p99.

    `rows` is recipe -> `collect`'s rows; `baselines` recipe -> `baseline_finals`."""
    lines = ["| recipe | v = 1 final, by seed | mean ± sd |", "|---|---|---:|"]
    for name, finals in baselines.items():
        by_seed = ", ".join(f"s{s} {acc:.3f}" for s, acc in sorted(finals.items()))
        lines.append(f"| {name} | {by_seed or '—'} | {runner.mean_sd(list(finals.values())) if finals else '—'} |")
    ran = [{(r["arm"], r["v"]) for r in rr} for rr in rows.values()]  # each recipe's (arm, v) cells
    in_order = dict.fromkeys((r["arm"], r["v"]) for r in next(iter(rows.values())))  # the first recipe's grid order
    cells = [c for c in in_order if all(c in cells_of for cells_of in ran)]
    lines += [
        "",
        "| arm | v | recipe | gap by seed | gap mean ± sd | drift k3 | rho' p99 |",
        "|---|---:|---|---|---:|---:|---:|",
    ]
    for arm, v in cells:
        for name, rr in rows.items():
            runs = [r for r in rr if (r["arm"], r["v"]) == (arm, v)]
            by_seed = ", ".join(f"s{r['seed']} {r['gap']:+.3f}" for r in runs)
            lines.append(
                f"| {arm} | {v} | {name} | {by_seed} | {runner.mean_sd([r['gap'] for r in runs], signed=True)} "
                f"| {runner.cell(mean_of([r['drift_k3'] for r in runs]), '.4f')} "
                f"| {runner.cell(mean_of([r['rho_p99'] for r in runs]), '.3f')} |"
            )
    lines += [
        "",
        "gap: final held-out accuracy (200 problems) minus the same seed's v = 1 run's; mean ± sample std over "
        "seeds. drift k3 and rho' p99: as in drift_vs_gap.md, each run's mean over its stale steps, then the mean "
        "over the cell's runs. Arms `current` and `behaviour` are --clip-center pi_k and --clip-center alpha.",
    ]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> bool:
    """Gap against drift k3, a point per off-policy run: colour by arm, marker by v."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib not installed (pip install -e '.[plot]'): no picture")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    colours = {c: plt.get_cmap("tab10")(i + 1) for i, c in enumerate(rs.CORRECTIONS)}  # as real_staleness.png
    markers = {4: "o", 8: "^"}
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for r in [r for r in rows if r["drift_k3"] is not None]:
        ax.scatter(
            r["drift_k3"], r["gap"], color=colours[r["arm"]], marker=markers.get(r["v"], "s"), s=55, edgecolor="k"
        )
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xlabel("drift: mean mismatch KL (k3) over the run's stale steps")
    ax.set_ylabel("gap: final held-out accuracy minus v = 1's, same seed")
    ax.set_title("SmolLM2-135M-Instruct, LoRA, 12 steps: drift against gap\n(a point per off-policy run)", fontsize=10)
    ax.grid(alpha=0.3)
    handles = [Line2D([], [], ls="", marker="o", color=colours[c], label=c) for c in rs.CORRECTIONS]
    handles += [
        Line2D([], [], ls="", marker=m, color="0.5", markeredgecolor="k", label=f"v = {v}") for v, m in markers.items()
    ]
    ax.legend(handles=handles, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m studies.drift",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--runs-dir", default="results/real_staleness", help="the real-model staleness study's records")
    p.add_argument("--out-dir", default="results", help="where drift_vs_gap.md and .png go")
    p.add_argument("--resamples", type=int, default=RESAMPLES, help="bootstrap resamples")
    p.add_argument("--seed", type=int, default=SEED, help="bootstrap seed")
    p.add_argument("--by-recipe", action="store_true", help="the recipes side by side: drift_by_recipe.md")
    args = p.parse_args(argv)
    if args.by_recipe:
        dirs = {name: Path("results") / rs.STEMS[name] for name in BY_RECIPE}
        rows = {name: collect(d) for name, d in dirs.items()}
        text = by_recipe_table(rows, {name: baseline_finals(d) for name, d in dirs.items()})
        path = Path(args.out_dir) / "drift_by_recipe.md"
        path.write_text(text)
        print(f"{text}\nwrote {path}")
        return 0
    rows = collect(Path(args.runs_dir))
    if len(rows) < 3:
        print(f"{len(rows)} finished off-policy runs with a v = 1 run of their seed under {args.runs_dir}: too few")
        return 1
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = table(rows, correlations(rows, args.resamples, args.seed), args.resamples, args.seed)
    (out / "drift_vs_gap.md").write_text(text)
    png = ", drift_vs_gap.png" if plot(rows, out / "drift_vs_gap.png") else ""
    print(f"{text}\nwrote {out}/drift_vs_gap.md{png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
