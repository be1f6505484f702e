"""The on/off-policy experiment on the built-in arithmetic task: one command, many `train.train` runs.

    python experiment.py            # the full sweep: 10 configs x 3 seeds x 2 learning rates (47 min on 2 CPU cores)
    python experiment.py --quick    # 5 configs x 2 seeds x 1 learning rate, 60 steps (minutes)
    python experiment.py --study staleness --workers 2   # the staleness corrections side by side (staleness.py)

Both studies take --workers N (N runs at once, in separate processes of --threads threads each) and pass
--model, --task, --data-files, --eval-files and --max-new-tokens through to every run, so the same study
runs on a real model: `--model Qwen/Qwen2.5-0.5B-Instruct --task gsm8k --data-files ../shared/data/...`.

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
  v1-inner4            the other road off-policy: 4 optimizer steps on each batch (sample reuse, [A]'s i).
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
  3. With the default warm-up the tiny policy is still undertrained, so part of any gain is what more
     low-learning-rate training of any kind would give (README, "What the numbers mean"); compare
     configs with each other, not with zero.
"""

import argparse
import contextlib
import csv
import io
import json
import multiprocessing
import shutil
import statistics
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import fields
from pathlib import Path

from config import Config, ConfigError, resolve

# name -> the Config fields it changes. Ordered as the plots and the table list them.
CONFIGS = {
    "v1": dict(offpolicy_steps=1),
    "v2": dict(offpolicy_steps=2),
    "v4": dict(offpolicy_steps=4),
    "v8": dict(offpolicy_steps=8),
    "v1-inner4": dict(offpolicy_steps=1, inner_steps=4),
    "v4-behaviour-centre": dict(offpolicy_steps=4, clip_center="behaviour"),
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
    p.add_argument(
        "--study",
        choices=STUDIES,
        default="offpolicy",
        help="offpolicy (this sweep) or staleness (staleness.py; `--study staleness --help` lists its flags)",
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
    return p


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


def settings(argv: list[str] | None) -> argparse.Namespace:
    """Parsed flags with the full-sweep or --quick defaults filled in where a flag was not given."""
    args = build_parser().parse_args(argv)
    for key, default in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, default)
    return args


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


def run_config(args, name: str, lr: float, seed: int) -> Config:
    return make_config(args, Path(args.runs_dir) / f"{name}-lr{lr:g}-s{seed}", **CONFIGS[name], lr=lr, seed=seed)


def finished(cfg: Config) -> bool:
    """True when cfg.out holds a completed run of exactly this config (so it can be reused)."""
    out = Path(cfg.out)
    if not (out / "summary.json").is_file() or not (out / "config.json").is_file():
        return False
    saved = json.loads((out / "config.json").read_text())
    ignore = {"progress", "resume"}  # do not change the result
    # A field the saved config lacks was added to Config after that run: it ran with the default.
    return all(saved.get(f.name, f.default) == getattr(cfg, f.name) for f in fields(Config) if f.name not in ignore)


def clip_frac(m: dict):
    """Fraction of the step's loss tokens whose clip was active; None for a step without a clipped loss."""
    return m["clip_low"] + m["clip_high"] if "clip_low" in m else None


# CSV column -> the per-step value it averages over the steps since the previous eval (None: no value that step).
STEP_MEANS = {"reward": lambda m: m.get("reward"), "clip_frac": clip_frac}


def run_rows(name: str, cfg: Config, base: dict | None = None, means: dict = STEP_MEANS) -> list[dict]:
    """The CSV rows of one finished run: start (step 0), every intermediate eval, final (step = steps).

    `step` counts completed steps; each column of `means` averages its per-step value over the steps since
    the previous eval point: `reward` the mean training reward, `clip_frac` the fraction of loss tokens
    whose clip was active (clip_low + clip_high). Blank at step 0, where no training has happened, and
    where no step had a value (`clip_frac` of OPMD, which has no clip; a step whose sampler produced
    non-finite logits logs no reward). `base` (default: the config's columns) starts every row.
    """
    out = Path(cfg.out)
    summary = json.loads((out / "summary.json").read_text())
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if base is None:
        base = {"config": name, **{c: getattr(cfg, c) for c in CONFIG_COLUMNS}, "seed": cfg.seed}
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
    except (ConfigError, train.Diverged) as e:  # e.g. a diverged run at an aggressive lr: report it, go on
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
        r = by_job[i] = run_rows(name, cfgs[i])
        print(
            f"{tag}  held-out acc {r[0]['eval_accuracy']:.3f} -> {r[-1]['eval_accuracy']:.3f} "
            f"({r[-1]['eval_accuracy'] - r[0]['eval_accuracy']:+.3f})  {r[-1]['wall_s']:6.1f} s"
            + ("  (existing run)" if reused else ""),
            flush=True,
        )
    return [row for i in sorted(by_job) for row in by_job[i]], failed


def _mean_sd(xs: list[float], signed: bool = False) -> str:
    """ "mean ± sample std" (std 0 for a single value); `signed` writes the mean's sign, for differences."""
    return f"{statistics.fmean(xs):{'+' if signed else ''}.3f} ± {statistics.stdev(xs) if len(xs) > 1 else 0.0:.3f}"


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
            vs = "—" if name == baseline or not paired else _mean_sd(paired, signed=True)
            clip = f"{100 * statistics.fmean(clips):.2f}%" if clips else "—"
            lines.append(
                f"| {name} | {lr:g} | {len(seeds)} | {_mean_sd(ends)} | {vs} | {_mean_sd(late)} | "
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


def write_csv(rows: list[dict], columns: list[str], path: Path) -> None:
    """The rows as CSV (floats rounded to 6 digits, except the learning rate)."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        w.writerows({k: round(v, 6) if isinstance(v, float) and k != "lr" else v for k, v in r.items()} for r in rows)


STUDIES = ("offpolicy", "staleness")


def main(argv: list[str] | None = None) -> int:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--study", choices=STUDIES, default="offpolicy")
    if pre.parse_known_args(argv)[0].study == "staleness":
        import staleness  # the staleness study lives in its own file; it imports this one's machinery

        return staleness.main(argv)
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
    t0 = time.time()
    rows, failed = sweep(args)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, CSV_COLUMNS, out / "offpolicy.csv")
    table = summary_table(rows, args)
    if failed:
        table += "\nFailed runs (left out above):\n" + "".join(f"- {f}\n" for f in failed)
    (out / "offpolicy_table.md").write_text(table)
    (out / "offpolicy.png").unlink(missing_ok=True)  # never leave a stale plot beside a new CSV
    png = ", offpolicy.png" if plot(rows, args, out / "offpolicy.png") else ""
    print(f"\n{table}\nwrote {out}/offpolicy.csv, offpolicy_table.md{png} in {time.time() - t0:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
