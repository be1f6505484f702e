"""The real-model staleness study's bookkeeping (studies/real_staleness.py), without training a model."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from config import Config
from conftest import ROOT
from studies import real_staleness as rs
from studies import runner


def test_the_grid_runs_seed_by_seed_the_baseline_first_and_every_config_is_valid():
    args = rs.build_parser().parse_args([])
    jobs = rs.grid(args)
    assert len(jobs) == 2 * (1 + 2 * 5)
    assert [c for c, _ in jobs[:11]] == [rs.BASELINE, *rs.CORRECTIONS, *rs.CORRECTIONS]
    assert [ch["seed"] for _, ch in jobs] == [0] * 11 + [1] * 11
    cfgs = [rs.config(args, c, ch) for c, ch in jobs]  # resolve() rejects a flag that cannot act
    assert len({c.out for c in cfgs}) == len(cfgs)
    geo = cfgs[4]
    assert (geo.clip_center, geo.is_mask, geo.is_level, geo.offpolicy_steps) == ("decoupled", 1.02, "geometric", 4)
    assert all(c.lora_rank == 16 and c.lr == 2e-4 and c.steps == 12 and c.task == "wordproblems" for c in cfgs)


def test_a_claim_is_exclusive_while_its_process_lives_and_taken_over_after(tmp_path):
    cfg = Config(out=str(tmp_path / "run"))
    held = rs.claim(cfg)
    assert held is not None and rs.claim(cfg) is None  # this process holds it (alive)
    held.unlink()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    held.write_text(dead.stdout.strip())  # a claim whose process has exited
    again = rs.claim(cfg)
    assert again is not None and again.read_text() == str(os.getpid())
    other = subprocess.Popen(["sleep", "30"])  # alive, but not a Python process: its PID holds no claim
    try:
        again.write_text(str(other.pid))
        taken = rs.claim(cfg)
        assert taken is not None and taken.read_text() == str(os.getpid())
    finally:
        other.kill()


def test_a_run_that_skipped_its_start_takes_the_start_of_its_seeds_v1_run(tmp_path):
    args = rs.build_parser().parse_args(["--runs-dir", str(tmp_path)])
    (c, ch), base_job = rs.grid(args)[1], rs.grid(args)[0]  # seed 0: current at v = 4; the v = 1 run
    cfg = rs.config(args, c, ch)
    assert not cfg.eval_start and rs.config(args, *base_job).eval_start  # only v = 1 evaluates the start
    out = tmp_path / rs.run_name(c, ch)
    out.mkdir()
    (out / "summary.json").write_text(
        json.dumps(dict(eval_accuracy_start=None, eval_accuracy_end=0.2, steps=12, wall_s=9.0))
    )
    (out / "metrics.jsonl").write_text(json.dumps(dict(step=0, reward=0.5, wall_s=3.0)) + "\n")
    assert rs.rows_of(cfg, c, tmp_path)[0]["eval_accuracy"] == ""  # v = 1 not finished yet: blank
    v1 = tmp_path / rs.run_name(*base_job)
    v1.mkdir()
    (v1 / "summary.json").write_text(json.dumps(dict(eval_accuracy_start=0.07, eval_accuracy_end=0.3, steps=12)))
    rows = rs.rows_of(cfg, c, tmp_path)
    assert rows[0]["eval_accuracy"] == 0.07 and rows[-1]["eval_accuracy"] == 0.2
    # A run finished before only v = 1 evaluated the start (eval_start on) is found, not trained again.
    (out / "config.json").write_text(json.dumps(dataclasses.asdict(dataclasses.replace(cfg, eval_start=True))))
    assert rs.config(args, c, ch).eval_start and runner.finished(rs.config(args, c, ch))


def row(correction, v, seed, step, acc, **extra):
    base = dict(correction=correction, offpolicy_steps=v, seed=seed, step=step, eval_accuracy=acc, wall_s=10.0 * step)
    return {**base, **dict.fromkeys(["clip_frac", "is_capped_frac", "is_masked_frac", "rho_prime_p99"], ""), **extra}


def test_the_table_pairs_each_run_with_the_baseline_of_its_seed():
    rows = [row(rs.BASELINE, 1, s, k, a) for s, end in ((0, 0.30), (1, 0.40)) for k, a in ((0, 0.07), (12, end))]
    rows += [row("rec", 4, 0, 0, 0.07), row("rec", 4, 0, 12, 0.40, is_masked_frac=0.0)]
    rows += [row("rec", 4, 1, 0, 0.07), row("rec", 4, 1, 12, 0.35, is_masked_frac=0.5)]
    table = rs.summary_table(rows, toy={("rec", 4): [0.04, 0.02]})
    line = next(x for x in table.splitlines() if x.startswith("| rec | 4 |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    # 0.40 - 0.30 = +0.10 and 0.35 - 0.40 = -0.05: mean +0.025, sample std 0.075 * sqrt(2) = 0.106, one win of two
    assert cells[3] == "0.375 ± 0.035" and cells[4] == "+0.025 ± 0.106 (1/2)"
    assert cells[5] == "+0.030 ± 0.014 (2)" and cells[8] == "25.0%"
    base = next(x for x in table.splitlines() if x.startswith(f"| {rs.BASELINE} | 1 |"))
    assert "0.350 ± 0.071" in base


def test_the_toy_deltas_come_from_the_toy_csv(tmp_path):
    cols = [
        "correction",
        "shared_baseline",
        "offpolicy_steps",
        "inner_steps",
        "lr",
        "clip_center",
        "loss",
        "is_cap",
        "seed",
        "step",
        "wall_s",
        "eval_accuracy",
        "reward",
        "clip_frac",
        "rho_prime_p99",
        "is_capped_frac",
        "is_masked_frac",
        "mismatch_kl_k3",
    ]
    rows = []
    for c, v, ends in ((rs.BASELINE, 1, (0.5, 0.6)), ("rec", 4, (0.55, 0.7)), ("current", 4, (0.4, 0.5))):
        for s, end in enumerate(ends):
            for k, a in ((0, 0.3), (200, end)):
                rows.append(
                    dict(
                        correction=c,
                        offpolicy_steps=v,
                        inner_steps=1,
                        lr=1e-4,
                        seed=s,
                        step=k,
                        eval_accuracy=a,
                        wall_s=1.0,
                    )
                )
    runner.write_csv(rows, cols, tmp_path / "toy.csv")
    toy = rs.toy_deltas(tmp_path / "toy.csv")
    assert toy[("rec", 4)] == pytest.approx([0.05, 0.1]) and toy[("current", 4)] == pytest.approx([-0.1, -0.1])


def test_table_only_reproduces_the_committed_table():
    csv = ROOT / "results" / "real_staleness.csv"
    if not csv.is_file():
        pytest.skip("the study has not written results/real_staleness.csv yet")
    rows, toy = rs.read_rows(csv), rs.toy_deltas(ROOT / "results" / "staleness.csv")
    table = rs.summary_table(rows, toy) + "\n" + rs.ranking_table(rows, toy)
    assert table == (ROOT / "results" / "real_staleness_table.md").read_text()


def test_the_ranking_orders_by_the_paired_difference_and_counts_agreeing_pairs():
    rows = [row(rs.BASELINE, 1, s, 12, a) for s, a in ((0, 0.30), (1, 0.40))]
    for c, ends in (("current", (0.10, 0.20)), ("behaviour", (0.25, 0.35)), ("rec", (0.30, 0.44))):
        rows += [row(c, 4, s, 12, a) for s, a in enumerate(ends)]  # differences -0.2, -0.05, +0.02 (mean)
    toy = {("current", 4): [-0.1], ("behaviour", 4): [0.02], ("rec", 4): [0.03]}
    line = rs.ranking_table(rows, toy).splitlines()[2]
    assert line.startswith("| 4 | rec (+0.020), behaviour (-0.050), current (-0.200) |")
    assert "| rec (+0.030), behaviour (+0.020), current (-0.100) | 3/3 |" in line
    toy[("rec", 4)] = [0.0]  # the toy now puts behaviour above rec: one pair of three disagrees
    assert rs.ranking_table(rows, toy).splitlines()[2].endswith("| 2/3 |")
