"""The staleness question asked of stock TRL: does TRL's own GRPOTrainer lose as much at v = 4 as ours does?

    python -m studies.trl_staleness                 # 2 arms x seeds 0, 1, one run at a time (1 thread each)
    python -m studies.trl_staleness --table-only    # results/trl_staleness_table.md again from the records

Our real-model study (studies/real_staleness.py, results/real_staleness_table.md) found every correction at v = 4
below v = 1 on SmolLM2-135M-Instruct with the 12-step LoRA recipe; PPO's centre (`behaviour`, --clip-center alpha)
lost 0.115 +- 0.014. If stock TRL, whose stale sampler is `steps_per_generation` and whose clip is centred on
alpha, loses about as much, the loss belongs to the regime and not to this repository's code; if it does not,
the difference is a defect here to find.

Each run is TRL's `trl.GRPOTrainer` as shipped (not integrations/trl_grpo.py's subclass) with this repository's
verifier (`reward.math_reward`), prompts (`tasks.format_prompt` of the word problems), model (the SmolLM2 GGUF,
`policy.load_gguf`), LoRA (r 16, alpha 32, all-linear, no dropout) and the 12-step recipe's sizes: 12 optimizer
steps of 8 prompts x 8 completions (per-device batch 16 x 4 accumulation steps), at most 48 tokens at
temperature 0.7, lr 2e-4 constant, no KL, eps 0.2. The two arms:
    on-policy   steps_per_generation = gradient_accumulation_steps: each optimizer step samples its own batch
    v4          steps_per_generation = 4 x gradient_accumulation_steps: one generation serves 4 optimizer steps,
                clipped around alpha (TRL's old_per_token_logps, computed at the generation)
What stays TRL's own and differs from ours: its prompt order (RepeatSampler), its loss normaliser (`dapo`: the
generation's tokens) and its zero-variance groups (advantage 0, but counted in the normaliser, where our recipe
masks them out). Held-out accuracy is this repository's `bookkeeping.evaluation.evaluate` (greedy, the same 200
problems) at the end; the start is the base model's, 0.070 in every run of the 12-step study.

Records (config.json: the TRL arguments that differ from TRL's defaults; metrics.jsonl: TRL's log history;
summary.json) go to results/trl_staleness/<arm>-s<seed>/; the table compares the gap v4 - on-policy, per seed,
with ours from results/real_staleness.csv, then sets what each run's steps saw side by side (training reward,
groups with equal rewards, clipped tokens; STEP_KEYS), ours from the records in results/real_staleness/.
"""

import argparse
import json
import sys
import time
from pathlib import Path

from bookkeeping.evaluation import evaluate
from studies import real_staleness, runner

ARMS = ("on-policy", "v4")
GGUF = "~/.cache/offpolicy-grpo/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# The 12-step recipe (studies/real_staleness.RECIPE) in TRL's arguments.
TRL_RECIPE = dict(
    max_steps=12,
    per_device_train_batch_size=16,
    gradient_accumulation_steps=4,  # 16 x 4 = 64 completions = 8 prompts x 8 a step
    num_generations=8,
    max_completion_length=48,
    temperature=0.7,
    learning_rate=2e-4,
    lr_scheduler_type="constant",
    beta=0.0,
    epsilon=0.2,
    num_iterations=1,
    disable_dropout=True,  # as ours (policy.fit_policy): one network for pi_theta, pi_k and alpha
    bf16=False,
    use_cpu=True,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
)
LORA = dict(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM")
EVAL_SIZE, MAX_NEW_TOKENS = 200, 48
OURS = {"on-policy": ("all (v=1 baseline)", 1), "v4": ("behaviour", 4)}  # real_staleness.csv's rows to compare
# What the optimizer steps saw, under the name each implementation logs it (metrics.jsonl, a row per step; a tuple
# is summed). Both count clipped tokens over their own loss tokens: TRL's include the zero-advantage tokens of
# groups whose rewards were all equal, ours leave those groups out (--mask-zero-std), so TRL's share is diluted.
STEP_KEYS = {
    "trl": {"reward": "reward", "zero_std": "frac_reward_zero_std", "clipped": ("clip_ratio/region_mean",)},
    "ours": {"reward": "reward", "zero_std": "zero_std_frac", "clipped": ("clip_low", "clip_high")},
}


def trl_arguments(arm: str, seed: int, out: Path) -> dict:
    """The GRPOConfig arguments of one run: the recipe, the arm's steps_per_generation, the seed."""
    ga = TRL_RECIPE["gradient_accumulation_steps"]
    return dict(TRL_RECIPE, steps_per_generation=ga * (4 if arm == "v4" else 1), seed=seed, output_dir=str(out))


def train_one(arm: str, seed: int, runs_dir: Path, model_path: str, threads: int) -> dict:
    """One stock-TRL run: train, evaluate the end, write the record; returns its summary."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    from engine.policy import load_gguf
    from problems.tasks import format_prompt, load_task
    from reward import math_reward

    torch.set_num_threads(threads)
    out = runs_dir / f"{arm}-s{seed}"
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    train_set, heldout = load_task("wordproblems", eval_size=EVAL_SIZE)
    model, tokenizer = load_gguf(str(Path(model_path).expanduser()))
    tokenizer.padding_side = "left"
    prompts = [format_prompt(tokenizer, p.question, p.instruction) for p in train_set]
    data = Dataset.from_dict({"prompt": prompts, "gold": [p.gold for p in train_set]})

    def reward_func(completions, gold, **kwargs) -> list[float]:
        return [math_reward(c, g) for c, g in zip(completions, gold)]

    args = trl_arguments(arm, seed, out)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_func,
        args=GRPOConfig(**args),
        train_dataset=data,
        processing_class=tokenizer,
        peft_config=LoraConfig(**LORA),
    )
    trainer.train()
    acc_end = evaluate(trainer.model, tokenizer, heldout, MAX_NEW_TOKENS, "cpu")
    summary = dict(arm=arm, seed=seed, eval_accuracy_end=acc_end, steps=trainer.state.global_step)
    summary.update(wall_s=time.time() - t0, eval_size=len(heldout))
    (out / "config.json").write_text(json.dumps(dict(args, lora=LORA), indent=1, default=str) + "\n")
    (out / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in trainer.state.log_history))
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")  # last: its presence means finished
    return summary


def finals(runs_dir: Path) -> dict[tuple[str, int], float]:
    """(arm, seed) -> final held-out accuracy, from every finished record under runs_dir."""
    out = {}
    for summary in sorted(runs_dir.glob("*/summary.json")):
        s = json.loads(summary.read_text())
        out[s["arm"], s["seed"]] = s["eval_accuracy_end"]
    return out


def our_finals(csv: Path) -> dict[tuple[str, int], float]:
    """(arm, seed) -> our final accuracy for the rows OURS names, from the 12-step study's CSV."""
    rows = real_staleness.read_rows(csv)
    last = {}
    for r in rows:
        for arm, (correction, v) in OURS.items():
            if r["correction"] == correction and r["offpolicy_steps"] == v:
                key = (arm, r["seed"])
                if key not in last or r["step"] > last[key][0]:
                    last[key] = (r["step"], r["eval_accuracy"])
    return {k: acc for k, (_, acc) in last.items()}


def gaps(f: dict[tuple[str, int], float]) -> dict[int, float]:
    """seed -> v4's final accuracy minus on-policy's, for the seeds that have both."""
    return {s: f["v4", s] - f["on-policy", s] for (arm, s) in f if arm == "v4" and ("on-policy", s) in f}


def step_means(metrics: Path, keys: dict[str, tuple | str]) -> dict[str, float | None]:
    """Each quantity's mean over the steps of a metrics.jsonl that logged it (None if none did). TRL's log
    history ends with a summary row (train_runtime, ...) that has none of them; our skipped steps (every group's
    rewards equal: no update) log a reward but no clip."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    out = {}
    for name, key in keys.items():
        parts = key if isinstance(key, tuple) else (key,)
        values = [sum(r[k] for k in parts) for r in rows if all(r.get(k) is not None for k in parts)]
        out[name] = sum(values) / len(values) if values else None
    return out


def steps_table(trl_runs: Path, our_runs: Path, seeds: list[int]) -> str:
    """Markdown: per run of both implementations, the mean over its steps of the training reward, the share of
    groups whose rewards were all equal, and the share of clipped tokens; ours for `seeds`."""
    lines = [
        "| implementation | arm | seed | train reward | groups with equal rewards | clipped tokens |",
        "|---|---|---:|---:|---:|---:|",
    ]
    runs = [("stock TRL", arm, seed, trl_runs / f"{arm}-s{seed}", STEP_KEYS["trl"]) for arm, seed in finals(trl_runs)]
    for arm, (correction, v) in OURS.items():
        for seed in seeds:
            run = our_runs / real_staleness.run_name(correction, dict(offpolicy_steps=v, seed=seed))
            runs.append(("this repository", arm, seed, run, STEP_KEYS["ours"]))
    for name, arm, seed, run, keys in runs:
        if (run / "metrics.jsonl").is_file():
            m = step_means(run / "metrics.jsonl", keys)
            lines.append(
                f"| {name} | {arm} | {seed} | {runner.cell(m['reward'], '.3f')} | {runner.cell(m['zero_std'], '.1%')} "
                f"| {runner.cell(m['clipped'], '.2%')} |"
            )
    return "\n".join(lines) + "\n"


def table(trl: dict, ours: dict) -> str:
    """Markdown: per implementation, the two arms' final accuracy per seed and the gap v4 - on-policy."""
    lines = [
        "| implementation | seed | on-policy (v = 1) | v = 4, clip around alpha | gap |",
        "|---|---:|---:|---:|---:|",
    ]
    summary = []
    for name, f in (
        ("stock TRL GRPOTrainer (steps_per_generation)", trl),
        ("this repository (--clip-center alpha)", ours),
    ):
        g = gaps(f)
        for s in sorted({s for _, s in f}):
            cells = [f"{f[a, s]:.3f}" if (a, s) in f else "—" for a in ARMS]
            lines.append(f"| {name} | {s} | {cells[0]} | {cells[1]} | {f'{g[s]:+.3f}' if s in g else '—'} |")
        if g:
            summary.append(f"{name}: gap {runner.mean_sd(list(g.values()), signed=True)} over {len(g)} seed(s)")
        else:
            summary.append(f"{name}: no seed with both arms recorded yet")
    return "\n".join(lines) + "\n\n" + "\n".join(f"- {line}" for line in summary) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m studies.trl_staleness",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default=GGUF, help="the SmolLM2 GGUF file")
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--runs-dir", default="results/trl_staleness", help="per-run records")
    p.add_argument("--ours", default="results/real_staleness.csv", help="the 12-step study's CSV, to compare")
    p.add_argument("--ours-runs", default="results/real_staleness", help="the 12-step study's records, to compare")
    p.add_argument("--out", default="results/trl_staleness_table.md", help="the comparison table")
    p.add_argument("--table-only", action="store_true", help="no training: the table from the records")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    runs_dir = Path(args.runs_dir)
    if not args.table_only:
        for seed in args.seeds:
            for arm in args.arms:
                if (runs_dir / f"{arm}-s{seed}" / "summary.json").is_file():
                    continue  # finished: its record is the result
                s = train_one(arm, seed, runs_dir, args.model, args.threads)
                print(
                    f"{arm} seed {seed}: held-out accuracy {s['eval_accuracy_end']:.3f}, {s['wall_s']:.0f} s",
                    flush=True,
                )
    text = table(finals(runs_dir), our_finals(Path(args.ours)))
    text += "\nWhat the optimizer steps saw (means over each run's logged steps):\n\n"
    text += steps_table(runs_dir, Path(args.ours_runs), args.seeds)
    Path(args.out).write_text(text)
    print(text + f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
