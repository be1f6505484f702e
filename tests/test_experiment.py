"""experiment.py: a tiny sweep end to end, checking the CSV's columns and eval points, and reuse."""

import csv
import importlib.util

import pytest

import experiment
from conftest import TEST_WARMUP


def sweep_args(tmp_path, warm_cache, *extra):
    return ["--configs", "v1", "v4", "--seeds", "0", "--lrs", "5e-5", "--steps", "3", "--eval-every", "2",
            "--eval-size", "10", "--warmup-steps", str(TEST_WARMUP), "--cache-dir", warm_cache,
            "--out-dir", str(tmp_path / "results"), "--runs-dir", str(tmp_path / "runs"), *extra]


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
