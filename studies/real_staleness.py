"""The staleness study on a real model: every correction side by side on SmolLM2-135M-Instruct.

    python -m studies.real_staleness                # the grid below, one run at a time (~15 min a run, 1 thread)
    python -m studies.real_staleness --table-only   # table and picture again from results/real_staleness.csv
    python -m studies.real_staleness --recipe gentle --vs 1 4 --corrections current behaviour
                                                    # issue 30's gentler regime: half the lr, twice the steps

The toy study (studies/staleness.py, results/staleness.csv) asks its question of a 1M-parameter model with
3-4-token answers. This one asks it of a pretrained chat model on --task wordproblems, with the LoRA variant
of the real-model recipe (results/real_model/README.md: r = 16, alpha 32, lr 2e-4, 12 steps of 8 prompts x 8
completions of at most 48 tokens at temperature 0.7; 0.070 -> 0.350 on v = 1): the recipe with LoRA because
it learnt more (+28 points against +20) in two thirds of the time, which is what buys seeds here.
The grid, in the order it runs (seed by seed, so a study cut short keeps whole seed sets):
  v = 1 once per seed (at v = 1 every correction takes the same gradient: the shared baseline), then
  v in {4, 8} x five corrections:
    current          [A]'s surrogate, --clip-center pi_k: the interval centred at rho' = pi_k / alpha (objective.py)
    behaviour        PPO / TRL, --clip-center alpha: the interval centred at 1
                     (the arms keep the names their committed records were made under)
    decoupled-tis2   AReaL's decoupled objective, the weight rho' capped at 2 (token-level TIS)
    decoupled-geomis decoupled, a sequence dropped from the loss and its normaliser when the geometric mean of
                     its rho'_t leaves [1/M, M], M = 1.02 (verl's Geo-RS, --is-level geometric --is-mask 1.02;
                     verl's default M = 1.001 is sized for engine mismatch, not for v - 1 stale updates; 1.02
                     is TRL's sequence-mask cap 3 spread over the recipe's 48 tokens, 3^(1/48) = 1.023)
    rec              [B]'s REC: -A log pi_theta with a one-sided clip mask on rho, no importance weight
  With 12 steps, v = 4 refreshes 3 times and v = 8 twice (steps 1-7 sample from the step-0 policy).
Evaluation: 200 held-out problems at the start and the end (--eval-every 0: the intermediate evaluations
would cost as much as the training). Every run keeps its config.json, metrics.jsonl and summary.json under
--runs-dir (committed; the weights are deleted), so a study stopped at any run continues where it stopped,
and this file's table is the CSV's, nothing else (`--table-only`). Two studies started side by side (one
thread each, one per core) share the grid: each claims a run before training it (`<run>.claim`).
"""

import argparse
import json
import os
import shutil
import statistics
import sys
from dataclasses import replace
from pathlib import Path

from config import Config, resolve
from studies import runner, staleness

GGUF = "~/.cache/offpolicy-grpo/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
RECIPE = dict(
    task="wordproblems",
    prompts_per_step=8,
    group_size=8,
    max_new_tokens=48,
    temperature=0.7,
    lr=2e-4,
    lora_rank=16,
    lora_alpha=32.0,
    micro_batch=16,
    eval_every=0,
    eval_size=200,
)
# The recipes, by name: each has its own records (results/<stem>/) and table (results/<stem>_table.md).
# "gentle" takes half the learning rate over twice the steps: about the same total movement, each refresh
# period drifting about half as far, the regime [A] trains in (small lr, many steps).
# "12-step-unmasked" keeps the groups whose rewards are all equal in the loss's normaliser, as TRL's `dapo` loss
# does (their advantage is 0, so they only dilute the step): the control that sets our code beside stock TRL's
# at the same normaliser (studies/trl_staleness.py).
RECIPES = {
    "12-step": dict(lr=2e-4, steps=12),
    "gentle": dict(lr=1e-4, steps=24),
    "12-step-unmasked": dict(lr=2e-4, steps=12, mask_zero_std=False),
}
STEMS = {"12-step": "real_staleness", "gentle": "real_staleness_gentle", "12-step-unmasked": "real_staleness_unmasked"}
CORRECTIONS = {
    "current": dict(clip_center="pi_k"),
    "behaviour": dict(clip_center="alpha"),
    "decoupled-tis2": dict(clip_center="decoupled", is_cap=2.0),
    "decoupled-geomis": dict(clip_center="decoupled", is_mask=1.02, is_level="geometric"),
    "rec": dict(loss="rec"),
}
BASELINE = staleness.BASELINE
TOY = {"current": "current", "behaviour": "behaviour", "decoupled-tis2": "decoupled-tis2", "rec": "rec"}
RUN_COLUMNS = ["offpolicy_steps", "lr", "clip_center", "loss", "is_cap", "is_mask", "is_level"]
CSV_COLUMNS = ["correction", "shared_baseline", *RUN_COLUMNS, "seed", *staleness.CSV_COLUMNS[9:]]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m studies.real_staleness",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--recipe", choices=list(RECIPES), default="12-step", help="lr and steps (see RECIPES)")
    p.add_argument("--model", default=GGUF, help="the GGUF file (or model folder) every run trains (SmolLM2)")
    p.add_argument("--corrections", nargs="+", choices=list(CORRECTIONS), default=list(CORRECTIONS), help="(all)")
    p.add_argument("--vs", nargs="+", type=int, default=[1, 4, 8], help="refresh periods v (1 = the baseline)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1], help="seeds, each a whole set of runs")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per run")
    p.add_argument("--runs-dir", help="per-run records (config, metrics, summary) (results/<the recipe's stem>)")
    p.add_argument("--out-dir", default="results", help="where <stem>.csv/.png and <stem>_table.md go")
    p.add_argument("--toy-csv", default="results/staleness.csv", help="the toy study's CSV, for the side-by-side")
    p.add_argument("--table-only", action="store_true", help="no training: table and picture from the CSV")
    p.add_argument("--fresh", action="store_true", help="rerun every run, even a finished one")
    return p


def runs_dir(args) -> Path:
    return Path(args.runs_dir or Path("results") / STEMS[args.recipe])


def grid(args) -> list[tuple[str, dict]]:
    """(correction, Config changes) of every run, seed by seed: v = 1, then each v > 1 and correction."""
    jobs = []
    for s in args.seeds:
        jobs += [(BASELINE, dict(offpolicy_steps=1, seed=s))] if 1 in args.vs else []
        stale = [v for v in args.vs if v > 1]
        jobs += [(c, dict(offpolicy_steps=v, seed=s, **CORRECTIONS[c])) for v in stale for c in args.corrections]
    return jobs


def run_name(correction: str, changes: dict) -> str:
    return f"{'baseline' if correction == BASELINE else correction}-v{changes['offpolicy_steps']}-s{changes['seed']}"


def config(args, correction: str, changes: dict) -> Config:
    """The run's Config. Only the v = 1 run evaluates the start: every run of a seed starts from the same
    weights (LoRA's B is zero at init, so the adapted model is the base model), and greedy evaluation draws
    no random numbers, so it is the same 200 decodes each time (the first six runs each read 0.070)."""
    out = runs_dir(args) / run_name(correction, changes)
    recipe = RECIPE | RECIPES[args.recipe]
    cfg = Config(model=str(Path(args.model).expanduser()), **recipe, **changes, out=str(out), progress=False)
    cfg = resolve(replace(cfg, eval_start=correction == BASELINE))
    # A run finished before the start evaluation was left to v = 1 evaluated it itself: the same run.
    return cfg if runner.finished(cfg) or not runner.finished(done := replace(cfg, eval_start=True)) else done


def rows_of(cfg: Config, correction: str, runs_dir: Path) -> list[dict]:
    """The run's CSV rows; a run that did not evaluate its start takes the start of its seed's v = 1 run
    (blank until that run has finished)."""
    base = {"correction": correction, "shared_baseline": correction == BASELINE, "seed": cfg.seed}
    rows = runner.run_rows(cfg, {**base, **{c: getattr(cfg, c) for c in RUN_COLUMNS}}, means=staleness.STEP_MEANS)
    if rows[0]["eval_accuracy"] is None:
        v1 = runs_dir / run_name(BASELINE, dict(offpolicy_steps=1, seed=cfg.seed)) / "summary.json"
        rows[0]["eval_accuracy"] = json.loads(v1.read_text())["eval_accuracy_start"] if v1.is_file() else ""
    return rows


def holds(pid: str) -> bool:
    """Whether process `pid` is alive and a Python process: a PID reused by another program holds no claim."""
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, ValueError):
        return False
    cmdline = Path(f"/proc/{pid}/cmdline")
    return not cmdline.is_file() or b"python" in cmdline.read_bytes()


def claim(cfg: Config) -> Path | None:
    """Take the run for this process (a claim file beside its folder), or None if a live process holds it:
    two studies started side by side (one per core) share the grid without training a run twice."""
    path = Path(f"{cfg.out}.claim")
    path.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            if holds(path.read_text()):  # the holder is alive: leave the run to it
                return None
            path.unlink(missing_ok=True)  # a claim left by a killed study: take it over
            continue
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        return path
    return None


def collect(args, jobs: list[tuple[str, dict]]) -> list[dict]:
    """The CSV rows of every finished run of the grid, in grid order: the run records are the truth."""
    return [
        row for c, ch in jobs if runner.finished(cfg := config(args, c, ch)) for row in rows_of(cfg, c, runs_dir(args))
    ]


def write_rows(rows: list[dict], csv: Path) -> None:
    tmp = csv.with_suffix(".tmp")
    runner.write_csv(rows, CSV_COLUMNS, tmp)
    tmp.replace(csv)  # a reader (or a second study) never sees half a file


def run_study(args, csv: Path) -> list[dict]:
    """Train every run of the grid that is neither finished nor claimed; after each, the CSV is rewritten
    from every finished run's record (this process's and any other's)."""
    jobs = grid(args)
    for n, (correction, changes) in enumerate(jobs, 1):
        cfg = config(args, correction, changes)
        tag = f"[{n:>2}/{len(jobs)}] {correction:<18} v={cfg.offpolicy_steps} seed={cfg.seed}"
        if not args.fresh and runner.finished(cfg):
            continue
        if (held := claim(cfg)) is None:
            print(f"{tag}  trained by another process", flush=True)
            continue
        try:
            error = runner.train_one(cfg, args.threads)
        finally:
            held.unlink(missing_ok=True)
        if error:
            print(f"{tag}  FAILED: {error[0]}\n{error[1]}", flush=True)
            continue
        for heavy in ("final", "checkpoints"):  # the record is the metrics; the weights stay out of git
            shutil.rmtree(Path(cfg.out) / heavy, ignore_errors=True)
        r = rows_of(cfg, correction, runs_dir(args))
        write_rows(collect(args, jobs), csv)
        start = r[0]["eval_accuracy"]
        acc = f"{float('nan') if start == '' else start:.3f} -> {r[-1]['eval_accuracy']:.3f}"
        print(f"{tag}  held-out acc {acc}  {r[-1]['wall_s']:6.1f} s", flush=True)
    rows = collect(args, jobs)
    write_rows(rows, csv)
    return rows


def read_rows(path: Path) -> list[dict]:
    return runner.read_csv(
        path, ints={"offpolicy_steps", "seed", "step"}, texts={"correction", "clip_center", "loss", "is_level"}
    )


def finals(rows: list[dict]) -> dict[tuple[str, int], dict[int, float]]:
    """(correction, v) -> {seed: final held-out accuracy}; the baseline under (BASELINE, 1)."""
    last = {}
    for r in rows:
        key = (r["correction"], r["offpolicy_steps"], r["seed"])
        if key not in last or r["step"] > last[key]["step"]:
            last[key] = r
    out = {}
    for (c, v, s), r in last.items():
        out.setdefault((c, v), {})[s] = r["eval_accuracy"]
    return out


def toy_deltas(path: Path) -> dict[tuple[str, int], list[float]]:
    """The toy study's paired differences to its v = 1 baseline (one inner step), per (correction, v)."""
    if not path.is_file():
        return {}
    rows = [r for r in staleness.read_rows(path) if r["inner_steps"] == 1]
    f = finals(rows)
    base = f.get((BASELINE, 1), {})
    return {k: [a[s] - base[s] for s in a if s in base] for k, a in f.items() if k[0] != BASELINE}


def _steps_mean(rows: list[dict], col: str, pct: bool = False) -> str:
    xs = [r[col] for r in rows if r["step"] > 0 and r[col] != ""]
    return "—" if not xs else f"{100 * statistics.fmean(xs):.1f}%" if pct else f"{statistics.fmean(xs):.3f}"


def summary_table(rows: list[dict], toy: dict) -> str:
    """Markdown: per correction and v, over seeds (mean ± sample std): final accuracy; its paired difference to
    the v = 1 baseline at the same seed (wins/n); the toy study's difference at the same v (its 5 or 2 seeds);
    clipped / TIS-capped / MIS-masked token shares and rho' p99 averaged over the trained steps; wall s."""
    f = finals(rows)
    base = f.get((BASELINE, 1), {})
    lines = [
        "| correction | v | seeds | final accuracy | vs v=1, same seed (wins/n) | toy: vs v=1 (seeds) | clipped "
        "| TIS capped | MIS masked | rho' p99 | wall s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    order = [BASELINE, *CORRECTIONS]
    for c, v in sorted(f, key=lambda cv: (cv[1], order.index(cv[0]))):
        seeds = sorted(f[c, v])
        mine = [r for r in rows if r["correction"] == c and r["offpolicy_steps"] == v]
        d = [f[c, v][s] - base[s] for s in seeds if s in base and c != BASELINE]
        vs = f"{runner.mean_sd(d, signed=True)} ({sum(x > 0 for x in d)}/{len(d)})" if d else "—"
        t = toy.get((TOY.get(c), v), [])
        toy_cell = f"{runner.mean_sd(t, signed=True)} ({len(t)})" if t else "—"
        wall = statistics.fmean(r["wall_s"] for r in mine if r["step"] == max(x["step"] for x in mine))
        lines.append(
            f"| {c} | {v} | {len(seeds)} | {runner.mean_sd([f[c, v][s] for s in seeds])} | {vs} | {toy_cell} | "
            f"{_steps_mean(mine, 'clip_frac', True)} | {_steps_mean(mine, 'is_capped_frac', True)} | "
            f"{_steps_mean(mine, 'is_masked_frac', True)} | {_steps_mean(mine, 'rho_prime_p99')} | {wall:.0f} |"
        )
    return "\n".join(lines) + "\n"


def _best_first(diffs: dict[str, float]) -> str:
    return ", ".join(f"{c} ({x:+.3f})" for c, x in sorted(diffs.items(), key=lambda cx: -cx[1]))


def ranking_table(rows: list[dict], toy: dict) -> str:
    """Markdown: per v, the corrections best first by their mean difference to v = 1, on the real model and on the
    toy (the four the toy has), and how many of the pairs of those four the two put in the same order."""
    f = finals(rows)
    base = f.get((BASELINE, 1), {})
    lines = [
        "| v | real model, best first (mean vs v=1) | toy, best first (mean vs v=1) | pairs in the same order |",
        "|---:|---|---|---:|",
    ]
    for v in sorted({v for _, v in f if v > 1}):
        real = {
            c: statistics.fmean(f[c, v][s] - base[s] for s in f[c, v] if s in base)
            for c in CORRECTIONS
            if (c, v) in f and any(s in base for s in f[c, v])
        }
        theirs = {c: statistics.fmean(t) for c in real if (t := toy.get((TOY.get(c), v)))}
        both = sorted(theirs)
        pairs = [(a, b) for i, a in enumerate(both) for b in both[i + 1 :]]
        same = sum((real[a] - real[b]) * (theirs[a] - theirs[b]) > 0 for a, b in pairs)
        lines.append(f"| {v} | {_best_first(real)} | {_best_first(theirs) or '—'} | {same}/{len(pairs)} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], toy: dict, path: Path, recipe: str = "12-step") -> bool:
    """Two panels: final accuracy vs v per correction (mean ± std over seeds, the shared baseline at v = 1);
    the difference to v = 1 at each v, the real model's beside the toy's, per correction."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib not installed (pip install -e '.[plot]'): no plot")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    f = finals(rows)
    base = f.get((BASELINE, 1), {})
    colours = {c: plt.get_cmap("tab10")(i + 1) for i, c in enumerate(CORRECTIONS)}
    fig, (ax_v, ax_d) = plt.subplots(1, 2, figsize=(13, 5))
    vs = sorted({v for _, v in f})
    for n, c in enumerate(CORRECTIONS):
        pts = [(v, list((f.get((c, v)) if v > 1 else base).values())) for v in vs if (c, v) in f or v == 1]
        pts = [(v, a) for v, a in pts if a]
        if not any(v > 1 for v, _ in pts):
            continue
        x = [v * 1.03 ** (n - 2) for v, _ in pts]
        sd = [statistics.stdev(a) if len(a) > 1 else 0.0 for _, a in pts]
        mean = [statistics.fmean(a) for _, a in pts]
        ax_v.errorbar(x, mean, yerr=sd, marker="o", capsize=3, color=colours[c], label=c)
    ax_v.set_xscale("log", base=2)
    ax_v.set_xticks(vs, [str(v) for v in vs])
    ax_v.set_xlabel("refresh period v (v = 1: on-policy, the shared baseline)")
    ax_v.set_ylabel("final held-out greedy accuracy (200 problems)")
    lr, steps = RECIPES[recipe]["lr"], RECIPES[recipe]["steps"]
    title = f"SmolLM2-135M-Instruct, LoRA recipe, lr {lr:g}, {steps} steps\n(mean ± std over seeds)"
    ax_v.set_title(title, fontsize=10)
    ax_v.grid(alpha=0.3)
    ax_v.legend(fontsize=8)
    labels, k = [], 0
    for v in [v for v in vs if v > 1]:
        for c in CORRECTIONS:
            if (c, v) not in f:
                continue
            d = [f[c, v][s] - base[s] for s in f[c, v] if s in base]
            ax_d.bar(k - 0.2, statistics.fmean(d), 0.4, color=colours[c])
            ax_d.scatter([k - 0.2] * len(d), d, s=10, color="k", zorder=3)
            if t := toy.get((TOY.get(c), v)):
                ax_d.bar(k + 0.2, statistics.fmean(t), 0.4, color=colours[c], alpha=0.35, hatch="//")
            labels.append(f"{c}\nv={v}")
            k += 1
    ax_d.axhline(0, color="k", lw=0.8)
    ax_d.set_xticks(range(len(labels)), labels, rotation=50, ha="right", fontsize=7)
    ax_d.set_ylabel("final accuracy minus v = 1's, same seed")
    ax_d.set_title("difference to on-policy: the real model (solid, dots: seeds)\nand the toy (hatched)", fontsize=10)
    ax_d.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out_dir)
    stem = STEMS[args.recipe]
    csv = out / f"{stem}.csv"
    if args.table_only:
        rows = read_rows(csv)
    else:
        out.mkdir(parents=True, exist_ok=True)
        rows = run_study(args, csv)
    toy = toy_deltas(Path(args.toy_csv))
    table = summary_table(rows, toy) + "\n" + ranking_table(rows, toy)
    (out / f"{stem}_table.md").write_text(table)
    png = f", {stem}.png" if plot(rows, toy, out / f"{stem}.png", args.recipe) else ""
    print(f"\n{table}\nwrote {out}/{stem}_table.md{png}" + ("" if args.table_only else f", {stem}.csv"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
