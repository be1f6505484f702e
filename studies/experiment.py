"""The on/off-policy experiment on the built-in arithmetic task: one command, many `train.train` runs.

    python -m studies.experiment               # the full sweep: 10 configs x 3 seeds x 2 lrs (47 min on 2 CPU cores)
    python -m studies.experiment --quick       # 5 configs x 2 seeds x 1 learning rate, 60 steps (minutes)
    python -m studies.experiment --table-only  # table and picture again from results/offpolicy.csv

The staleness study is its sibling, `python -m studies.staleness` (staleness.py). Both take --workers N
(N runs at once, in separate processes of --threads threads each) and pass --model, --task, --data-files,
--eval-files and --max-new-tokens through to every run, so the same study runs on a real model:
`--model Qwen/Qwen2.5-0.5B-Instruct --task gsm8k --data-files gsm8k/train.jsonl` (a local JSONL of openai/gsm8k).

What the two papers claim, and what this sweep can show about it:
  [A] Mroueh et al. 2025: off-policy GRPO, whose sampler alpha is refreshed from the policy only every
      v steps and whose clip interval is centred at rho' = pi_k / alpha, matches or beats on-policy
      GRPO (v=1) at the same number of steps; masking zero-std groups out of the loss matters.
  [B] Yao et al. 2025: group-relative REINFORCE is off-policy by nature; importance weights are not what
      makes it work off-policy. What matters is to regularise the update (clip masks, a proximal term)
      and to shape the data. REC (one-sided clip mask, no importance weight) and OPMD (a quadratic
      pull towards alpha) should therefore hold up at v>1 as well as the clipped surrogate does.

Configs (all others at Config's defaults; every run shares the warmed-up tiny policy in --cache-dir):
  v1, v2, v4, v8       [A]'s surrogate at growing staleness v (v1 = on-policy: rho = 1 at the gradient,
                       so the step is exactly group-baseline REINFORCE). With one inner step the gradient
                       is taken at rho = rho', the centre of [A]'s interval, so its clip never acts and
                       v>1 is rho'-weighted REINFORCE (tests/test_objective.py checks this identity).
  v1-inner4            the other road off-policy: 4 optimizer steps on each batch (sample reuse, [A]'s mu).
  v4-behaviour-centre  v=4 with the PPO/TRL clip interval [1-eps, 1+eps] instead of [A]'s rho'-centred one.
  v1-no-mask           [A]'s zero-std masking switched off: all-equal groups stay in the normaliser.
  rec-v4, opmd-v4      [B]'s REC and OPMD losses at v=4.
  v1-shuffled-rewards  the null control: v1 with each step's rewards dealt to random samples (same reward
                       rate, no signal), so a gain that is not the reward's shows up here.

Outputs (--out-dir): offpolicy.csv (one row per run and eval point, with the start and the final point),
offpolicy_table.md (final accuracy per config and lr, mean +- std over seeds), offpolicy.png
(needs the `plot` extra, matplotlib). Each run keeps its own folder under --runs-dir; a run whose
summary.json exists with the same config is reused, so an interrupted sweep continues (--fresh: rerun all).

Caveats, so nobody over-reads the numbers:
  1. On this single CPU process, v>1 costs *more* wall-clock than v=1 (a sampler copy and a behaviour
     log-prob pass on stale steps). [A]'s speed argument is about distributed set-ups where syncing the
     sampler's weights is expensive; here the wall-clock panels show only the extra compute.
  2. wall_s includes the held-out evaluations (train.py starts its clock before the start eval).
  3. With the default warm-up the tiny policy is un-annealed, so a gain could be any movement of it; the
     null control (v1-shuffled-rewards) tells: accuracy falls without the reward's signal. Compare configs
     with each other, not with zero.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

from config import Config
from studies.runner import add_run_flags, make_config, mean_sd, read_csv, run_jobs, run_rows, write_csv

# name -> the Config fields it changes. Ordered as the plots and the table list them.
CONFIGS = {
    "v1": dict(offpolicy_steps=1),
    "v2": dict(offpolicy_steps=2),
    "v4": dict(offpolicy_steps=4),
    "v8": dict(offpolicy_steps=8),
    "v1-inner4": dict(offpolicy_steps=1, inner_steps=4),
    "v4-behaviour-centre": dict(offpolicy_steps=4, clip_center="alpha"),
    "v1-no-mask": dict(offpolicy_steps=1, mask_zero_std=False),
    "rec-v4": dict(offpolicy_steps=4, loss="rec"),
    "opmd-v4": dict(offpolicy_steps=4, loss="opmd"),
    "v1-shuffled-rewards": dict(offpolicy_steps=1, reward_shuffle=True),
}
CONFIG_COLUMNS = ["offpolicy_steps", "inner_steps", "clip_center", "loss", "mask_zero_std", "reward_shuffle", "lr"]
CSV_COLUMNS = ["config", *CONFIG_COLUMNS, "seed", "step", "wall_s", "eval_accuracy", "reward", "clip_frac"]

# Defaults of the full sweep and of --quick; a flag given explicitly wins over both.
# Full: 60 runs x 250 steps, ~35-45 s a run (v1-inner4: ~105 s), measured 2600 + 217 s = 47 min on 2 CPU cores.
FULL = dict(
    configs=list(CONFIGS),
    seeds=[0, 1, 2],
    lrs=[5e-5, 1e-4],
    steps=250,
    eval_every=50,
    eval_size=500,
    out_dir="results",
    runs_dir="runs/experiment",
)
QUICK = dict(
    configs=["v1", "v4", "rec-v4", "opmd-v4", "v1-shuffled-rewards"],
    seeds=[0, 1],
    lrs=[5e-5],
    steps=60,
    eval_every=20,
    eval_size=200,
    out_dir="results/quick",
    runs_dir="runs/experiment-quick",
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    # --- the sweep --------------------------------------------------------------------------
    p.add_argument("--quick", action="store_true", help=f"a few-minute variant: {QUICK}")
    p.add_argument(
        "--configs", nargs="+", choices=list(CONFIGS), help=f"subset of configs (default: all {len(CONFIGS)})"
    )
    p.add_argument("--seeds", nargs="+", type=int, help="seeds per config and lr (default 0 1 2)")
    p.add_argument("--lrs", nargs="+", type=float, help="learning rates (default 5e-5 1e-4; 1e-4 is aggressive here)")
    # --- each run ----------------------------------------------------------------------------
    p.add_argument("--steps", type=int, help="training steps per run, the same budget for every config (default 250)")
    p.add_argument("--eval-every", type=int, help="held-out accuracy every this many steps (default 50)")
    p.add_argument("--eval-size", type=int, help="held-out problems per evaluation (default 500)")
    p.add_argument(
        "--warmup-steps", type=int, default=Config.warmup_steps, help="supervised warm-up of the tiny policy (cached)"
    )
    add_run_flags(p)
    # --- output ------------------------------------------------------------------------------
    p.add_argument(
        "--out-dir", help="where offpolicy.csv/.png and offpolicy_table.md go (default results, quick: results/quick)"
    )
    p.add_argument("--runs-dir", help="per-run folders (default runs/experiment, quick: runs/experiment-quick)")
    p.add_argument("--fresh", action="store_true", help="rerun every run, even one whose summary.json exists")
    p.add_argument("--table-only", action="store_true", help="no training: table and picture from offpolicy.csv")
    return p


def settings(argv: list[str] | None) -> argparse.Namespace:
    """Parsed flags with the full-sweep or --quick defaults filled in where a flag was not given."""
    args = build_parser().parse_args(argv)
    for key, default in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, default)
    return args


def run_config(args, name: str, lr: float, seed: int) -> Config:
    return make_config(args, Path(args.runs_dir) / f"{name}-lr{lr:g}-s{seed}", **CONFIGS[name], lr=lr, seed=seed)


def sweep(args) -> tuple[list[dict], list[str]]:
    """Run (or reuse) every config x lr x seed; returns all CSV rows (in job order) and the runs that failed."""
    jobs = [(n, lr, s) for lr in args.lrs for n in args.configs for s in args.seeds]
    cfgs = [run_config(args, *job) for job in jobs]
    by_job, failed = {}, []
    for count, (i, reused, error) in enumerate(run_jobs(cfgs, args), 1):
        name, lr, seed = jobs[i]
        tag = f"[{count:>2}/{len(jobs)}] {name:<20} lr={lr:<7g} seed={seed}"
        if error:
            print(f"{tag}  FAILED: {error[0]}\n{error[1]}", flush=True)
            failed.append(f"{name} lr={lr:g} seed={seed}: {error[0]}")
            continue
        base = {"config": name, **{c: getattr(cfgs[i], c) for c in CONFIG_COLUMNS}, "seed": seed}
        r = by_job[i] = run_rows(cfgs[i], base)
        print(
            f"{tag}  held-out acc {r[0]['eval_accuracy']:.3f} -> {r[-1]['eval_accuracy']:.3f} "
            f"({r[-1]['eval_accuracy'] - r[0]['eval_accuracy']:+.3f})  {r[-1]['wall_s']:6.1f} s"
            + ("  (existing run)" if reused else ""),
            flush=True,
        )
    return [row for i in sorted(by_job) for row in by_job[i]], failed


def summary_table(rows: list[dict], args, baseline: str = "v1") -> str:
    """Markdown table per config and lr, over seeds (mean ± sample std):
    final      held-out accuracy after the last step;
    vs v1      final minus the on-policy baseline's final *at the same seed* (same start policy and
               prompt stream), so the shared part of the seed-to-seed noise cancels;
    late       mean of the last three eval points per run (less held-out sampling noise than one point);
    clipped    mean fraction of loss tokens whose clip was active over the run (— without a clip);
    wall       seconds per run, evaluations included."""
    lines = [
        f"| config | lr | seeds | final accuracy | vs {baseline}, same seed | last 3 evals | clipped tokens | wall s |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for lr in args.lrs:
        final = {}  # (name, seed) -> final accuracy
        for r in rows:
            if r["lr"] == lr and r["step"] == args.steps:
                final[r["config"], r["seed"]] = r["eval_accuracy"]
        for name in args.configs:
            runs = [r for r in rows if r["config"] == name and r["lr"] == lr]
            seeds = sorted({r["seed"] for r in runs if r["step"] == args.steps})
            if not seeds:
                continue
            ends = [final[name, s] for s in seeds]
            paired = [final[name, s] - final[baseline, s] for s in seeds if (baseline, s) in final]
            late = [
                statistics.fmean(
                    r["eval_accuracy"]
                    for r in sorted((r for r in runs if r["seed"] == s), key=lambda r: r["step"])[-3:]
                )
                for s in seeds
            ]
            clips = [r["clip_frac"] for r in runs if r["step"] > 0 and r["clip_frac"] != ""]
            walls = [r["wall_s"] for r in runs if r["step"] == args.steps]
            vs = "—" if name == baseline or not paired else mean_sd(paired, signed=True)
            clip = f"{100 * statistics.fmean(clips):.2f}%" if clips else "—"
            lines.append(
                f"| {name} | {lr:g} | {len(seeds)} | {mean_sd(ends)} | {vs} | {mean_sd(late)} | "
                f"{clip} | {statistics.fmean(walls):.0f} |"
            )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], args, path: Path) -> bool:
    """One row of panels per lr: held-out accuracy vs step and vs wall-clock (seed mean and min-max
    band), then each config's final accuracy (one dot per seed, the mean as a bar)."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib not installed (pip install -e '.[plot]'): no plot")
        return False
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    colours = plt.get_cmap("tab10")
    fig, axes = plt.subplots(
        len(args.lrs),
        3,
        figsize=(17, 4.4 * len(args.lrs)),
        squeeze=False,
        sharey=True,
        gridspec_kw={"width_ratios": [1, 1, 0.55]},
    )
    for row, lr in enumerate(args.lrs):
        names = [n for n in args.configs if any(r["config"] == n and r["lr"] == lr for r in rows)]
        for i, name in enumerate(names):
            runs = [r for r in rows if r["config"] == name and r["lr"] == lr]
            steps = sorted({r["step"] for r in runs})
            # Seeds share eval steps; on the wall-clock axis each point sits at the seeds' mean time.
            at = {s: [r for r in runs if r["step"] == s] for s in steps}
            acc = [[r["eval_accuracy"] for r in at[s]] for s in steps]
            mean = [statistics.fmean(a) for a in acc]
            lo, hi = [min(a) for a in acc], [max(a) for a in acc]
            wall = [statistics.fmean(r["wall_s"] for r in at[s]) for s in steps]
            # Colour by position in CONFIGS, so a config keeps its colour in any subset (--configs, --quick);
            # [A]'s GRPO configs solid, [B]'s REINFORCE losses dashed.
            style = dict(
                color=colours(list(CONFIGS).index(name) % 10), linestyle="--" if CONFIGS[name].get("loss") else "-"
            )
            for col, x in enumerate((steps, wall)):  # the same points against steps, then seconds
                ax = axes[row][col]
                ax.plot(x, mean, marker="o", markersize=3, label=name, **style)
                ax.fill_between(x, lo, hi, color=style["color"], alpha=0.12, linewidth=0)
            x = i + 1  # the third panel: final accuracy per config, one column each
            axes[row][2].scatter([x] * len(acc[-1]), acc[-1], s=14, color=style["color"], alpha=0.6)
            axes[row][2].hlines(mean[-1], x - 0.3, x + 0.3, color=style["color"], linewidth=2.5)
        final = axes[row][2]
        final.set_xticks(range(1, len(names) + 1), names, rotation=40, ha="right", fontsize=8)
        final.set_xlim(0.3, len(names) + 0.7)
        final.set_title(f"final accuracy, lr = {lr:g}\n(dot: a seed, bar: the mean)", fontsize=10)
        final.grid(alpha=0.3, axis="y")
        for col, xlabel in enumerate(("training step", "wall-clock (s, incl. evals)")):
            ax = axes[row][col]
            ax.set_xlabel(xlabel)
            ax.set_title(f"held-out accuracy vs {xlabel.split(' (')[0]}, lr = {lr:g}")
            ax.grid(alpha=0.3)
        axes[row][0].set_ylabel("held-out greedy accuracy")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(
        handles,
        labels,
        loc="center right",
        fontsize=9,
        title="config\n(line: seed mean,\nband: min-max)",
        title_fontsize=9,
    )
    n_seeds = len(args.seeds)
    fig.suptitle(
        f"On- vs off-policy GRPO and [B]'s REINFORCE family, built-in arithmetic task "
        f"({n_seeds} seeds, {args.steps} steps, {args.eval_size} held-out problems)"
    )
    fig.tight_layout(rect=(0, 0, 0.885, 1))  # the right margin holds the legend
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    args = settings(argv)
    if (
        args.steps < 1
        or args.eval_every < 0
        or args.eval_size < 1
        or not args.seeds
        or not args.lrs
        or args.workers < 1
    ):
        print(
            "error: --steps, --eval-size and --workers must be >= 1, --eval-every >= 0, and --seeds/--lrs non-empty",
            file=sys.stderr,
        )
        return 2
    t0, out = time.time(), Path(args.out_dir)
    if args.table_only:
        ints = {"offpolicy_steps", "inner_steps", "seed", "step"}
        rows, failed = read_csv(out / "offpolicy.csv", ints, texts={"config", "clip_center", "loss"}), []
    else:
        rows, failed = sweep(args)
        out.mkdir(parents=True, exist_ok=True)
        write_csv(rows, CSV_COLUMNS, out / "offpolicy.csv")
    table = summary_table(rows, args)
    if failed:
        table += "\nFailed runs (left out above):\n" + "".join(f"- {f}\n" for f in failed)
    (out / "offpolicy_table.md").write_text(table)
    (out / "offpolicy.png").unlink(missing_ok=True)  # never leave a stale plot beside a new CSV
    png = ", offpolicy.png" if plot(rows, args, out / "offpolicy.png") else ""
    wrote = "offpolicy_table.md" if args.table_only else "offpolicy.csv, offpolicy_table.md"
    print(f"\n{table}\nwrote {out}/{wrote}{png} in {time.time() - t0:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
