"""studies/: a tiny sweep end to end, checking the CSV's columns and eval points, and reuse."""

import csv
import importlib.util
from pathlib import Path

import pytest

from conftest import TEST_WARMUP, needs
from studies import experiment, runner, staleness

# Trains or decodes a model: CI runs these again under ATEN_CPU_CAPABILITY=default (plain kernels).
pytestmark = pytest.mark.model


def sweep_args(tmp_path, warm_cache, *extra):
    return [
        "--configs",
        "v1",
        "v4",
        "--seeds",
        "0",
        "--lrs",
        "5e-5",
        "--steps",
        "3",
        "--eval-every",
        "2",
        "--eval-size",
        "10",
        "--warmup-steps",
        str(TEST_WARMUP),
        "--cache-dir",
        warm_cache,
        "--out-dir",
        str(tmp_path / "results"),
        "--runs-dir",
        str(tmp_path / "runs"),
        *extra,
    ]


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_tiny_sweep_writes_csv_table_and_plot(tmp_path, warm_cache, capsys):
    assert experiment.main(sweep_args(tmp_path, warm_cache)) == 0
    results = tmp_path / "results"
    rows = read_csv(results / "offpolicy.csv")
    assert list(rows[0].keys()) == experiment.CSV_COLUMNS
    # Per run: the start (0), the eval after step index 1 (2 completed steps), the final (3).
    # Step index 2 is the last step: train.py leaves its eval to the final evaluation.
    for name, v in (("v1", "1"), ("v4", "4")):
        run = [r for r in rows if r["config"] == name]
        assert [r["step"] for r in run] == ["0", "2", "3"], run
        assert {r["offpolicy_steps"] for r in run} == {v} and {r["seed"] for r in run} == {"0"}
        assert {r["loss"] for r in run} == {"grpo"} and {r["clip_center"] for r in run} == {"pi_k"}
        assert run[0]["reward"] == "" and run[0]["wall_s"] == "0.0"  # no training before the start eval
        assert all(0 <= float(r["eval_accuracy"]) <= 1 for r in run)
        assert all(0 <= float(r["reward"]) <= 1 for r in run[1:])
        assert 0 < float(run[1]["wall_s"]) < float(run[2]["wall_s"])
        assert run[0]["clip_frac"] == "" and all(0 <= float(r["clip_frac"]) <= 1 for r in run[1:])
    # On-policy, rho = 1 exactly at the gradient: no token can sit outside the clip interval.
    assert all(float(r["clip_frac"]) == 0.0 for r in rows if r["config"] == "v1" and r["step"] != "0")
    assert len(rows) == 6
    table = (results / "offpolicy_table.md").read_text()
    assert table.count("\n| v") == 2 and "| v4 | 5e-05 | 1 |" in table

    # A second call reuses both finished runs (same config) instead of training again.
    capsys.readouterr()
    assert experiment.main(sweep_args(tmp_path, warm_cache)) == 0
    assert capsys.readouterr().out.count("(existing run)") == 2
    assert read_csv(results / "offpolicy.csv") == rows

    needs("matplotlib", "plot")
    assert (results / "offpolicy.png").stat().st_size > 10_000


def test_summary_table_hand_computed():
    # Two seeds, two configs, eval points at steps 0, 2, 4, 6 (steps = 6). Hand-computed below.
    def run(config, seed, accs, clip):
        base = {"config": config, "lr": 1e-4, "seed": seed}
        return [
            {**base, "step": 2 * i, "wall_s": 10.0 * i, "eval_accuracy": a, "clip_frac": "" if i == 0 else clip}
            for i, a in enumerate(accs)
        ]

    rows = (
        run("v1", 0, [0.3, 0.4, 0.5, 0.6], 0.0)
        + run("v1", 1, [0.3, 0.5, 0.5, 0.5], 0.0)
        + run("v4", 0, [0.3, 0.4, 0.6, 0.7], 0.02)
        + run("v4", 1, [0.3, 0.4, 0.4, 0.4], 0.04)
    )
    args = type("Args", (), {"lrs": [1e-4], "configs": ["v1", "v4", "v8"], "steps": 6})()
    lines = experiment.summary_table(rows, args).splitlines()
    assert len(lines) == 4  # header, rule, v1, v4 (v8 has no runs: no row)
    # v1: finals 0.6, 0.5 -> 0.550 ± 0.071; last-3 means 0.5, 0.5 -> 0.500 ± 0.000; no clipping.
    assert lines[2] == "| v1 | 0.0001 | 2 | 0.550 ± 0.071 | — | 0.500 ± 0.000 | 0.00% | 30 |"
    # v4: finals 0.7, 0.4 -> 0.550 ± 0.212; paired 0.7-0.6, 0.4-0.5 -> +0.000 ± 0.141;
    # last-3 means 0.5667, 0.4 -> 0.483 ± 0.118; clipped mean(0.02 x3, 0.04 x3) = 3.00%.
    assert lines[3] == "| v4 | 0.0001 | 2 | 0.550 ± 0.212 | +0.000 ± 0.141 | 0.483 ± 0.118 | 3.00% | 30 |"


# ---- the staleness study (`python -m studies.staleness`) ------------------------------


def staleness_args(tmp_path, warm_cache, *extra):
    return [
        "--corrections",
        "current",
        "rec",
        "--vs",
        "1",
        "4",
        "--sparse-vs",
        "--seeds",
        "0",
        "--inner-seeds",
        "0",
        "--inner-vs",
        "4",
        "--steps",
        "3",
        "--eval-every",
        "2",
        "--eval-size",
        "10",
        "--warmup-steps",
        str(TEST_WARMUP),
        "--cache-dir",
        warm_cache,
        "--out-dir",
        str(tmp_path / "results"),
        "--runs-dir",
        str(tmp_path / "runs"),
        *extra,
    ]


def test_tiny_staleness_study_csv_shared_baseline_and_table_only(tmp_path, warm_cache, capsys):
    # Two worker processes: the parallel path (spawned interpreters) is the one the full study uses.
    assert staleness.main(staleness_args(tmp_path, warm_cache, "--workers", "2")) == 0
    results = tmp_path / "results"
    rows = read_csv(results / "staleness.csv")
    assert list(rows[0].keys()) == staleness.CSV_COLUMNS
    runs = {}
    for r in rows:
        runs.setdefault((r["correction"], r["offpolicy_steps"], r["inner_steps"], r["lr"]), []).append(r)
    # One v = 1 baseline per block, shared by every correction; REC is not in the inner-steps block.
    assert set(runs) == {
        (staleness.BASELINE, "1", "1", "0.0001"),
        ("current", "4", "1", "0.0001"),
        ("rec", "4", "1", "0.0001"),
        (staleness.BASELINE, "1", "2", "5e-05"),
        ("current", "4", "2", "5e-05"),
    }
    for (correction, v, inner, _), run in runs.items():
        assert [r["step"] for r in run] == ["0", "2", "3"], run
        assert {r["shared_baseline"] for r in run} == {str(correction == staleness.BASELINE)}
        assert {r["loss"] for r in run} == {"rec" if correction == "rec" else "grpo"}
        assert run[0]["reward"] == run[0]["rho_prime_p99"] == "" and run[0]["wall_s"] == "0.0"
        assert all(float(r["is_capped_frac"]) == 0.0 for r in run[1:])  # no TIS in this grid
        if v == "1":  # pi_k = alpha at every step: rho' = 1
            assert all(float(r["rho_prime_p99"]) == 1.0 for r in run[1:])
            if inner == "1":  # and rho = 1 at the gradient: nothing can be clipped
                assert all(float(r["clip_frac"]) == 0.0 for r in run[1:])
    table = (results / "staleness_table.md").read_text()
    assert f"| {staleness.BASELINE} | 1 | 2 | 5e-05 | 1 |" in table and "| rec | 4 | 1 | 0.0001 | 1 |" in table
    assert (results / "staleness.png").is_file() or importlib.util.find_spec("matplotlib") is None

    # Again: every run is reused; --table-only rebuilds the same table from the CSV alone.
    capsys.readouterr()
    assert staleness.main(staleness_args(tmp_path, warm_cache)) == 0
    assert capsys.readouterr().out.count("(existing run)") == 5
    assert read_csv(results / "staleness.csv") == rows
    (results / "staleness_table.md").unlink()
    assert staleness.main(staleness_args(tmp_path, warm_cache, "--table-only")) == 0
    assert (results / "staleness_table.md").read_text() == table


def test_staleness_table_hand_computed(tmp_path):
    # Eval points at steps 0, 2, 4; written to CSV and read back, as --table-only does.
    def run(correction, v, seed, accs, clip=0.0, rho=(1.0, 1.0), inner=1, lr=1e-4):
        base = dict(correction=correction, shared_baseline=correction == staleness.BASELINE, offpolicy_steps=v)
        base.update(inner_steps=inner, lr=lr, seed=seed, is_capped_frac=0.0)
        return [
            {**base, "step": 2 * i, "wall_s": 10.0 * i, "eval_accuracy": a}
            | ({"clip_frac": clip, "rho_prime_p99": rho[i - 1]} if i else {"clip_frac": "", "rho_prime_p99": ""})
            for i, a in enumerate(accs)
        ]

    b = staleness.BASELINE
    rows = (
        run(b, 1, 0, [0.3, 0.4, 0.5])
        + run(b, 1, 1, [0.3, 0.5, 0.6])
        + run(b, 1, 2, [0.3, 0.4, 0.4])
        + run("current", 4, 0, [0.3, 0.5, 0.6], rho=(1.2, 1.4))
        + run("current", 4, 1, [0.3, 0.4, 0.5], rho=(1.2, 1.4))
        + run("current", 4, 2, [0.3, 0.5, 0.7], rho=(1.2, 1.4))
        + run("rec", 4, 0, [0.3, 0.3, 0.4], clip=0.02, rho=(1.5, 1.5))
        + run("rec", 4, 1, [0.3, 0.5, 0.8], clip=0.04, rho=(1.5, 1.5))
        + run(b, 1, 0, [0.3, 0.3, 0.3], inner=2, lr=5e-5)
        + run("current", 4, 0, [0.3, 0.4, 0.45], inner=2, lr=5e-5, clip=0.1)
    )
    runner.write_csv(rows, staleness.CSV_COLUMNS, tmp_path / "s.csv")
    lines = staleness.summary_table(staleness.read_rows(tmp_path / "s.csv")).splitlines()
    # Baseline finals 0.5, 0.6, 0.4 -> 0.500 ± 0.100; last-3 means 0.4, 0.4667, 0.3667 -> 0.411 ± 0.051.
    assert lines[2] == f"| {b} | 1 | 1 | 0.0001 | 3 | 0.500 ± 0.100 | — | 0.411 ± 0.051 | 0.00% | 1.00 | 0.00% | 20 |"
    # current: finals 0.6, 0.5, 0.7; paired 0.1, -0.1, 0.3 -> +0.100 ± 0.200, 2 wins of 3, t = 0.1 / (0.2/√3) = 0.87;
    # last-3 0.4667, 0.4, 0.5 -> 0.456 ± 0.051; rho' p99 mean(1.2, 1.4).
    assert lines[3] == (
        "| current | 4 | 1 | 0.0001 | 3 | 0.600 ± 0.100 | +0.100 ± 0.200 (2/3, t +0.9) | 0.456 ± 0.051 "
        "| 0.00% | 1.30 | 0.00% | 20 |"
    )
    # rec: seeds 0, 1 only; paired -0.1, +0.2 -> +0.050 ± 0.212, t = 0.05 / (0.2121/√2) = 0.33; clipped mean 3%.
    assert lines[4] == (
        "| rec | 4 | 1 | 0.0001 | 2 | 0.600 ± 0.283 | +0.050 ± 0.212 (1/2, t +0.3) | 0.433 ± 0.141 "
        "| 3.00% | 1.50 | 0.00% | 20 |"
    )
    # The inner-steps block pairs with its own baseline (0.3), not the one-inner-step one (0.5).
    assert lines[5].startswith(f"| {b} | 1 | 2 | 5e-05 | 1 | 0.300 ± 0.000 | — |")
    assert lines[6].startswith("| current | 4 | 2 | 5e-05 | 1 | 0.450 ± 0.000 | +0.150 ± 0.000 (1/1) |")
    # Head to head at v = 4 over the seeds both have (0, 1): current - rec = 0.2, -0.3 -> -0.050 ± 0.354, t -0.2.
    i = lines.index("inner steps 1, lr 0.0001, v = 4:")
    assert lines[i + 2 : i + 5] == ["| | rec |", "|---|---:|", "| current | -0.050 ± 0.354 (1/2, t -0.2) |"]
    assert "inner steps 2, lr 5e-05, v = 4:" not in lines  # one correction there: nothing to pair
    # A tie is neither a win nor a loss, and is counted: differences 0 and +0.1 -> 0.05 ± 0.0707, t = 1.0.
    assert staleness._paired({0: 0.5, 1: 0.4}, {0: 0.5, 1: 0.3}) == "+0.050 ± 0.071 (1/2, 1 tied, t +1.0)"


def test_model_and_task_pass_through_to_every_run(tmp_path):
    given = ["--model", "Qwen/Qwen2.5-0.5B-Instruct", "--task", "gsm8k", "--data-files", "gsm8k.jsonl"]
    sweep = experiment.settings([*given, "--max-new-tokens", "256"])
    cfg = experiment.run_config(sweep, "v4", 1e-4, 0)
    assert (cfg.model, cfg.task, cfg.data_files, cfg.max_new_tokens, cfg.offpolicy_steps) == (
        "Qwen/Qwen2.5-0.5B-Instruct",
        "gsm8k",
        str(Path("gsm8k.jsonl").absolute()),  # paths are stored absolute (config.resolve)
        256,
        4,
    )
    study = staleness.build_parser().parse_args(given)
    cfgs = [runner.make_config(study, tmp_path / "r", **ch) for _, ch in staleness.grid(study)]
    assert {(c.model, c.task, c.data_files, c.max_new_tokens) for c in cfgs} == {
        ("Qwen/Qwen2.5-0.5B-Instruct", "gsm8k", str(Path("gsm8k.jsonl").absolute()), 512)
    }
    assert len(cfgs) == 87
    # Without the flags the runs keep Config's defaults (the built-in policy and task).
    cfg = experiment.run_config(experiment.settings([]), "v1", 5e-5, 0)
    assert (cfg.model, cfg.task, cfg.data_files, cfg.max_new_tokens) == ("tiny", "arithmetic", None, 8)


def test_moved_table_pairs_runs_by_seed(tmp_path):
    from studies.moved import moved_table

    def rows(finals):
        out = []
        for (c, v, seed), acc in finals.items():
            base = dict(correction=c, shared_baseline=False, offpolicy_steps=v, inner_steps=1, lr=1e-4, seed=seed)
            out += [{**base, "step": 0, "eval_accuracy": 0.3}, {**base, "step": 10, "eval_accuracy": acc}]
        return out

    old = rows({("rec", 4, 0): 0.50, ("rec", 4, 1): 0.40, ("rec", 4, 2): 0.9, ("current", 16, 0): 0.30})
    new = rows({("rec", 4, 0): 0.55, ("rec", 4, 1): 0.40, ("current", 16, 0): 0.20, ("current", 16, 1): 0.9})
    lines = moved_table(old, new).splitlines()
    # rec v=4: seeds 0 and 1 in both (seed 2 only in old): before 0.45, after 0.475, differences +0.05, 0.
    assert lines[2] == "| rec | 4 | 1 | 0.0001 | 2 | 0.450 | 0.475 | +0.025 ± 0.035 |"
    assert lines[3] == "| current | 16 | 1 | 0.0001 | 1 | 0.300 | 0.200 | -0.100 ± 0.000 |"
    assert len(lines) == 4
