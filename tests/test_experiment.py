"""experiment.py: a tiny sweep end to end, checking the CSV's columns and eval points, and reuse."""

import csv
import importlib.util

import pytest

import experiment
from conftest import TEST_WARMUP

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
        assert {r["loss"] for r in run} == {"grpo"} and {r["clip_center"] for r in run} == {"current"}
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

    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib not installed: the plot is optional")
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
