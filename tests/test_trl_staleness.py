"""studies/trl_staleness.py's bookkeeping, without training: the arms' TRL arguments and the comparison table."""

import json

from conftest import needs
from studies import runner
from studies import trl_staleness as ts


def test_the_arms_are_the_12_step_recipe_with_trls_stale_sampler_4_steps_long(tmp_path):
    on, v4 = (ts.trl_arguments(arm, 1, tmp_path) for arm in ts.ARMS)
    assert on["per_device_train_batch_size"] * on["gradient_accumulation_steps"] == 8 * on["num_generations"]
    assert on["steps_per_generation"] == on["gradient_accumulation_steps"] == 4
    assert v4["steps_per_generation"] == 4 * v4["gradient_accumulation_steps"] == 16
    assert {k: v for k, v in on.items() if k != "steps_per_generation"} == {
        k: v for k, v in v4.items() if k != "steps_per_generation"
    }
    assert (on["max_steps"], on["learning_rate"], on["max_completion_length"], on["seed"]) == (12, 2e-4, 48, 1)


def test_trl_accepts_the_arguments_and_samples_one_generation_per_4_optimizer_steps(tmp_path):
    needs("trl", "trl")
    from trl import GRPOConfig

    on, v4 = (GRPOConfig(**ts.trl_arguments(arm, 0, tmp_path)) for arm in ts.ARMS)
    # The generation batch: 64 completions (one optimizer step's) on-policy, 256 (four steps') at v = 4.
    assert (on.generation_batch_size, v4.generation_batch_size) == (64, 256)
    assert on.lr_scheduler_type == v4.lr_scheduler_type == "constant" and v4.beta == 0.0


def record(runs_dir, arm, seed, acc):
    (runs_dir / f"{arm}-s{seed}").mkdir(parents=True)
    summary = dict(arm=arm, seed=seed, eval_accuracy_end=acc, steps=12, wall_s=1.0, eval_size=200)
    (runs_dir / f"{arm}-s{seed}" / "summary.json").write_text(json.dumps(summary))


def test_the_table_pairs_each_v4_run_with_the_on_policy_run_of_its_seed(tmp_path):
    runs = tmp_path / "runs"
    for arm, seed, acc in (("on-policy", 0, 0.35), ("v4", 0, 0.30), ("on-policy", 1, 0.33), ("v4", 1, 0.20)):
        record(runs, arm, seed, acc)
    record(runs, "v4", 2, 0.5)  # no on-policy run of seed 2: no gap
    # Ours, as the 12-step study's CSV has them: the v = 1 baseline and --clip-center alpha at v = 4, per step.
    rows = [
        dict(correction=c, offpolicy_steps=v, seed=s, step=step, eval_accuracy=acc)
        for c, v, s, accs in (
            ("all (v=1 baseline)", 1, 0, (0.07, 0.35)),
            ("behaviour", 4, 0, (0.07, 0.225)),
            ("behaviour", 8, 0, (0.07, 0.9)),  # another v: not compared
            ("current", 4, 0, (0.07, 0.9)),  # another correction: not compared
        )
        for step, acc in zip((0, 12), accs)
    ]
    csv = tmp_path / "ours.csv"
    runner.write_csv(rows, ["correction", "offpolicy_steps", "seed", "step", "eval_accuracy"], csv)
    trl, ours = ts.finals(runs), ts.our_finals(csv)
    assert ts.gaps(trl) == {0: 0.30 - 0.35, 1: 0.20 - 0.33} and ours == {("on-policy", 0): 0.35, ("v4", 0): 0.225}
    text = ts.table(trl, ours)
    assert "| stock TRL GRPOTrainer (steps_per_generation) | 1 | 0.330 | 0.200 | -0.130 |" in text
    assert "| stock TRL GRPOTrainer (steps_per_generation) | 2 | — | 0.500 | — |" in text
    assert "| this repository (--clip-center alpha) | 0 | 0.350 | 0.225 | -0.125 |" in text
    # the mean and sample std of the two TRL gaps, -0.05 and -0.13: -0.090 +- 0.057
    assert "gap -0.090 ± 0.057 over 2 seed(s)" in text


def test_the_steps_table_averages_what_each_implementation_logged_over_its_steps(tmp_path):
    trl_runs, our_runs = tmp_path / "trl", tmp_path / "ours"
    record(trl_runs, "v4", 0, 0.3)
    # TRL's log history: a row per optimizer step, then its summary row (no step metrics).
    history = [
        {"step": 1, "reward": 0.1, "frac_reward_zero_std": 0.5, "clip_ratio/region_mean": 0.0},
        {"step": 2, "reward": 0.3, "frac_reward_zero_std": 0.25, "clip_ratio/region_mean": 0.02},
        {"train_runtime": 99.0, "step": 2},
    ]
    (trl_runs / "v4-s0" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in history))
    # Ours: step 1 had no signal (no update, no clip logged).
    ours = [
        {"step": 0, "reward": 0.2, "zero_std_frac": 0.5, "clip_low": 0.0, "clip_high": 0.0},
        {"step": 1, "reward": 0.0, "zero_std_frac": 1.0, "skipped_no_signal": 1},
        {"step": 2, "reward": 0.1, "zero_std_frac": 0.75, "clip_low": 0.03, "clip_high": 0.01},
    ]
    (our_runs / "behaviour-v4-s0").mkdir(parents=True)
    (our_runs / "behaviour-v4-s0" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ours))
    text = ts.steps_table(trl_runs, our_runs, seeds=[0])
    # TRL: reward (0.1 + 0.3) / 2, zero-std (0.5 + 0.25) / 2, clipped (0 + 0.02) / 2.
    assert "| stock TRL | v4 | 0 | 0.200 | 37.5% | 1.00% |" in text
    # Ours: reward (0.2 + 0 + 0.1) / 3, zero-std (0.5 + 1 + 0.75) / 3, clipped over the two updates (0 + 0.04) / 2.
    assert "| this repository | v4 | 0 | 0.100 | 75.0% | 2.00% |" in text
    assert "on-policy" not in text  # neither implementation has an on-policy record here
