"""Drift against gap (studies/drift.py): the stale-step drift of a run record, Spearman's rank correlation, its
bootstrap interval, and the pairing of each run with its own seed's v = 1 run. No model is trained."""

import json
import math

import pytest

from conftest import ROOT
from studies import drift

# Steps 0-6 of a synthetic run; step 2 was skipped for no signal (it logs neither number).
METRICS = [
    {"step": 0, "mismatch_kl_k3": 0.0, "rho_prime_p99": 1.0},
    {"step": 1, "mismatch_kl_k3": 0.01, "rho_prime_p99": 1.2},
    {"step": 2, "skipped_no_signal": 1},
    {"step": 3, "mismatch_kl_k3": 0.03, "rho_prime_p99": 1.6, "eval_accuracy": 0.1},
    {"step": 4, "mismatch_kl_k3": 0.0, "rho_prime_p99": 1.0},
    {"step": 5, "mismatch_kl_k3": 0.05, "rho_prime_p99": 1.3},
    {"step": 6, "mismatch_kl_k3": 0.02, "rho_prime_p99": 1.1},
]


def write_run(folder, v, seed, end, metrics=METRICS, start=0.07):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"offpolicy_steps": v, "seed": seed}))
    (folder / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    summary = {"eval_accuracy_start": start, "eval_accuracy_end": end, "steps": len(metrics)}
    (folder / "summary.json").write_text(json.dumps(summary))
    return folder


@pytest.mark.parametrize(
    "v, k3, p99, stale, logged",
    [
        # v = 4: steps 0 and 4 refresh; stale 1, 2, 3, 5, 6, of which 2 logged nothing.
        (4, (0.01 + 0.03 + 0.05 + 0.02) / 4, (1.2 + 1.6 + 1.3 + 1.1) / 4, 5, 4),
        # v = 2: steps 0, 2, 4, 6 refresh; stale 1, 3, 5.
        (2, (0.01 + 0.03 + 0.05) / 3, (1.2 + 1.6 + 1.3) / 3, 3, 3),
    ],
)
def test_the_drift_is_the_mean_over_stale_steps_and_leaves_the_refreshes_out(tmp_path, v, k3, p99, stale, logged):
    d = drift.stale_drift(write_run(tmp_path / "run", v=v, seed=3, end=0.2))
    assert d["v"] == v and d["seed"] == 3
    assert d["drift_k3"] == pytest.approx(k3) and d["rho_p99"] == pytest.approx(p99)
    assert (d["stale"], d["logged"]) == (stale, logged)
    assert k3 == pytest.approx({4: 0.0275, 2: 0.03}[v])  # the hand arithmetic, written out
    assert p99 == pytest.approx({4: 1.3, 2: 4.1 / 3}[v])
    everything = sum(m.get("mismatch_kl_k3", 0.0) for m in METRICS) / 6  # what keeping the refreshes would give
    assert d["drift_k3"] != pytest.approx(everything)


def test_a_run_whose_stale_steps_logged_nothing_has_no_drift(tmp_path):
    only_refreshes = [{"step": 0, "mismatch_kl_k3": 0.0, "rho_prime_p99": 1.0}, {"step": 1, "skipped_no_signal": 1}]
    d = drift.stale_drift(write_run(tmp_path / "run", v=4, seed=0, end=0.2, metrics=only_refreshes))
    assert (d["drift_k3"], d["rho_p99"], d["stale"], d["logged"]) == (None, None, 1, 0)


def test_ranks_average_over_ties():
    assert drift.ranks([10, 20, 20, 5]) == [2, 3.5, 3.5, 1]
    assert drift.ranks([7, 7, 7]) == [2, 2, 2]
    assert drift.ranks([3, 1, 2]) == [3, 1, 2]


def test_spearman_against_hand_computed_cases():
    assert drift.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert drift.spearman([1, 2, 3, 4], [1, 8, 27, 64]) == pytest.approx(1.0)  # monotone, not linear
    assert drift.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # No ties: d = (1, -1, 1, -1, 0), 1 - 6 * 4 / (5 * 24) = 0.8.
    assert drift.spearman([1, 2, 3, 4, 5], [2, 1, 4, 3, 5]) == pytest.approx(0.8)
    # Ties: ranks x (1, 2.5, 2.5, 4), y (1, 2, 3, 4); sxy = 4.5, sxx = 4.5, syy = 5: rho = sqrt(0.9).
    assert drift.spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(math.sqrt(0.9))
    assert math.isnan(drift.spearman([1, 1, 1], [1, 2, 3]))  # a constant side has no rank correlation
    with pytest.raises(ValueError):
        drift.spearman([1, 2], [1, 2, 3])


def test_percentile_interpolates_between_order_statistics():
    assert drift.percentile([4, 1, 3, 2], 0.5) == pytest.approx(2.5)
    assert drift.percentile([4, 1, 3, 2], 0.25) == pytest.approx(1.75)
    assert (drift.percentile([4, 1, 3, 2], 0.0), drift.percentile([4, 1, 3, 2], 1.0)) == (1, 4)


def test_the_bootstrap_interval_holds_the_estimate_and_is_fixed_by_its_seed():
    x = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    y = [2, 1, 4, 3, 6, 5, 9, 10, 7, 8]
    rho = drift.spearman(x, y)
    lo, hi = drift.bootstrap_ci(x, y, resamples=2000, seed=0)
    assert lo <= rho <= hi and lo < hi <= 1.0
    assert drift.bootstrap_ci(x, y, resamples=2000, seed=0) == (lo, hi)
    assert drift.bootstrap_ci(x, y, resamples=2000, seed=1) != (lo, hi)


def test_the_gap_is_to_the_v1_run_of_the_same_seed(tmp_path):
    write_run(tmp_path / "baseline-v1-s0", v=1, seed=0, end=0.30)
    write_run(tmp_path / "baseline-v1-s1", v=1, seed=1, end=0.50)
    write_run(tmp_path / "current-v4-s0", v=4, seed=0, end=0.20)
    write_run(tmp_path / "current-v4-s1", v=4, seed=1, end=0.45)
    write_run(tmp_path / "rec-v8-s1", v=8, seed=1, end=0.55)
    rows = drift.collect(tmp_path)
    assert [(r["run"], r["arm"], r["v"], r["seed"]) for r in rows] == [
        ("current-v4-s0", "current", 4, 0),
        ("current-v4-s1", "current", 4, 1),
        ("rec-v8-s1", "rec", 8, 1),
    ]
    assert [r["gap"] for r in rows] == pytest.approx([0.20 - 0.30, 0.45 - 0.50, 0.55 - 0.50])


def test_a_run_without_its_seeds_v1_run_is_left_out_and_a_misfiled_record_is_an_error(tmp_path):
    write_run(tmp_path / "baseline-v1-s0", v=1, seed=0, end=0.30)
    write_run(tmp_path / "behaviour-v4-s1", v=4, seed=1, end=0.2)  # no baseline-v1-s1
    assert drift.collect(tmp_path) == []
    write_run(tmp_path / "behaviour-v4-s0", v=8, seed=0, end=0.2)  # config.json says v = 8
    with pytest.raises(ValueError, match="behaviour-v4-s0"):
        drift.collect(tmp_path)


def test_the_committed_table_rows_are_the_committed_records():
    rows = drift.collect(ROOT / "results" / "real_staleness")
    assert len(rows) == 20 and {(r["v"], r["seed"]) for r in rows} == {(4, 0), (4, 1), (8, 0), (8, 1)}
    committed = (ROOT / "results" / "drift_vs_gap.md").read_text()
    placeholder = {k: (math.nan, math.nan, math.nan) for k in ("drift_k3", "rho_p99")}
    runs = [line for line in drift.table(rows, placeholder).splitlines() if line.startswith("| ")]
    runs = runs[1 : 1 + len(rows)]  # the per-run rows, after the header
    assert len(runs) == 20 and all(line in committed for line in runs)


def test_the_recipes_side_by_side_give_each_cells_gaps_their_spread_and_drift(tmp_path):
    """Two recipes' synthetic records; every figure of the table written out by hand."""
    for recipe, ends in (("12-step", (0.30, 0.50, 0.10, 0.40)), ("gentle", (0.40, 0.40, 0.35, 0.30))):
        d = tmp_path / recipe
        write_run(d / "baseline-v1-s0", v=1, seed=0, end=ends[0])
        write_run(d / "baseline-v1-s1", v=1, seed=1, end=ends[1])
        write_run(d / "current-v4-s0", v=4, seed=0, end=ends[2])
        write_run(d / "current-v4-s1", v=4, seed=1, end=ends[3])
    write_run(tmp_path / "12-step" / "rec-v8-s0", v=8, seed=0, end=0.2)  # a cell only one recipe ran: no row
    rows = {name: drift.collect(tmp_path / name) for name in ("12-step", "gentle")}
    finals = {name: drift.baseline_finals(tmp_path / name) for name in ("12-step", "gentle")}
    assert finals == {"12-step": {0: 0.30, 1: 0.50}, "gentle": {0: 0.40, 1: 0.40}}
    text = drift.by_recipe_table(rows, finals)
    assert "| 12-step | s0 0.300, s1 0.500 | 0.400 ± 0.141 |" in text  # sd of (0.3, 0.5) = 0.1 * sqrt(2)
    # 12-step gaps: 0.10 - 0.30 = -0.20 and 0.40 - 0.50 = -0.10; gentle: -0.05 and -0.10. METRICS' stale-step
    # means at v = 4 are k3 0.0275 and rho' p99 1.3 in every run (the first test's hand arithmetic).
    assert "| current | 4 | 12-step | s0 -0.200, s1 -0.100 | -0.150 ± 0.071 | 0.0275 | 1.300 |" in text
    assert "| current | 4 | gentle | s0 -0.050, s1 -0.100 | -0.075 ± 0.035 | 0.0275 | 1.300 |" in text
    assert "| rec |" not in text
