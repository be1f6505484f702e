"""studies/very_stale.py: its grid, its table and verdict computed by hand from a CSV, and the fact that lets one
set of lag-0 runs serve every correction (M2PO's and OPSM's masks keep every token on-policy)."""

import importlib.util

import pytest

from studies import runner
from studies import very_stale as vs


def test_grid_order_keeps_whole_seed_sets_and_counts():
    args = vs.build_parser().parse_args([])
    jobs = vs.grid(args)
    # 3 baseline runs, 8 lags x 9 corrections x 3 seeds, 2 v x 2 corrections x 3 seeds; the rerun 3 more.
    assert len(jobs) == 3 + 8 * 9 * 3 + 2 * 2 * 3 == 231
    assert len(jobs) + len(vs.rerun_jobs(args, jobs)) == 234  # the docstring's count
    cells = [(c, vs.schedule_of(ch)) for c, ch in jobs]
    # Every cell's seeds run one after another (a study cut short keeps whole seed sets), in the stated order.
    order = list(dict.fromkeys(cells))
    assert [cells[3 * i : 3 * i + 3] for i in range(len(order))] == [[cell] * 3 for cell in order]
    assert [sch for _, sch in order[:2]] == [("lag", 0), ("lag", 256)]
    assert [sch[1] for _, sch in order if sch[0] == "lag"][1::9] == [256, 2, 8, 32, 4, 16, 128, 1]
    assert [c for c, _ in order[1:10]] == list(vs.CORRECTIONS)
    assert order[-4:] == [
        ("current", ("periodic", 256)),
        ("m2po", ("periodic", 256)),
        ("current", ("periodic", 64)),
        ("m2po", ("periodic", 64)),
    ]
    assert {ch["seed"] for _, ch in jobs} == {0, 1, 2} and {ch["lr"] for _, ch in jobs} == {1e-4}
    assert all(ch["inner_steps"] == 1 for _, ch in jobs)
    assert dict(jobs[-1][1], seed=0) == dict(
        offpolicy_steps=64, inner_steps=1, lr=1e-4, seed=0, **vs.CORRECTIONS["m2po"]
    )
    assert vs.run_name(*jobs[0]) == "baseline-lag0-lr0.0001-s0" and vs.run_name(*jobs[-1]) == "m2po-v64-lr0.0001-s2"
    # The new arms set their own trust region: no clip centre passed (config.py refuses one beside them).
    assert vs.CORRECTIONS["m2po-clip"] == dict(m2po_clip_threshold=0.04)
    assert vs.CORRECTIONS["m2po-quadrant"] == dict(m2po_quadrant_threshold=0.04)
    assert vs.CORRECTIONS["dppo"] == dict(dppo_delta=0.2)


def test_gentle_rate_block_follows_the_first_lag():
    args = vs.build_parser().parse_args(["--gentle-lr", "1e-5"])
    jobs = vs.grid(args)
    assert len(jobs) + len(vs.rerun_jobs(args, jobs)) == 264  # the docstring's count with --gentle-lr
    cells = list(dict.fromkeys(vs.job_cell(c, ch) for c, ch in jobs))
    # lag 0 and 256 at 1e-4, then the gentle rate's baseline and lag 256, then lag 2 at 1e-4.
    assert cells[0] == (vs.BASELINE, "lag", 0, 1e-4) and cells[1][2:] == (256, 1e-4)
    assert cells[10] == (vs.BASELINE, "lag", 0, 1e-5)
    assert [c[2:] for c in cells[11:20]] == [(256, 1e-5)] * 9 and cells[20][2:] == (2, 1e-4)
    assert vs.run_name(*jobs[30]) == "baseline-lag0-lr1e-05-s0"


def test_rerun_names_a_cell_or_a_run():
    args = vs.build_parser().parse_args([])
    jobs = vs.grid(args)
    again = vs.rerun_jobs(args, jobs)  # the default: behaviour at lag 8, every seed of --seeds
    assert [vs.run_name(*j) for j in again] == [f"behaviour-lag8-lr0.0001-s{s}" for s in range(3)]
    args = vs.build_parser().parse_args(["--rerun", "opsm-lag32-lr0.0001-s1", "current-v64-lr0.0001"])
    names = [vs.run_name(*j) for j in vs.rerun_jobs(args, jobs)]
    assert names == ["opsm-lag32-lr0.0001-s1"] + [f"current-v64-lr0.0001-s{s}" for s in range(3)]
    assert vs.rerun_jobs(vs.build_parser().parse_args(["--rerun"]), jobs) == []
    with pytest.raises(ValueError, match="--rerun opsm-lag3: no such cell"):
        vs.rerun_jobs(vs.build_parser().parse_args(["--rerun", "opsm-lag3"]), jobs)
    small = vs.build_parser().parse_args(["--lags", "0", "2"])  # the default where the grid lacks it: nothing
    assert vs.rerun_jobs(small, vs.grid(small)) == []
    assert vs.main(["--lags", "0", "2", "--rerun", "nope"]) == 2  # refused before anything trains


def _run(correction, schedule, n, seed, accs, masked=0.0, rho=1.0, lr=1e-4, m2=None, rerun=False):
    """A run's CSV rows at steps 0, 4, 8 as runner.run_rows writes them (step 0: no training, blank means)."""
    lag, v = (n, 1) if schedule == "lag" else (0, n)
    base = dict(correction=correction, shared_baseline=correction == vs.BASELINE, rerun=rerun, schedule=schedule)
    base.update(lag=lag, offpolicy_steps=v, lr=lr, clip_center="pi_k", seed=seed)
    rows = []
    for i, a in enumerate(accs):
        means = dict.fromkeys(vs.STEP_MEANS, "")
        if i:
            means.update(
                reward=0.5,
                clip_frac=0.0,
                staleness=float(min(4 * i, n)),
                rho_prime_p99=rho * i,
                rho_prime_max=10.0 * rho * i,
                masked_frac=masked * i,
                grad_norm=0.1 * i,
                m2="" if m2 is None else m2 * i,
                mismatch_kl_k1="" if m2 is None else m2 * i / 2,
                mismatch_kl_k3=0.0,
            )
        rows.append({**base, "step": 4 * i, "wall_s": 5.0 * i, "eval_accuracy": a, **means})
    return rows


def _table_rows():
    b = vs.BASELINE
    return (
        _run(b, "lag", 0, 0, [0.3, 0.4, 0.5], m2=0.0)
        + _run(b, "lag", 0, 1, [0.3, 0.5, 0.6], m2=0.0)
        + _run(b, "lag", 0, 2, [0.3, 0.4, 0.4], m2=0.0)
        # current at lag 8: finals 0.52, 0.55, 0.41; paired +0.02, -0.05, +0.01: mean -0.0067, sd 0.0379,
        # half-width 4.303 x 0.0379 / sqrt 3 = 0.0941 -> [-0.101, +0.087]: unresolved (within 0.05: rule 5 seeds)
        + _run("current", "lag", 8, 0, [0.3, 0.5, 0.52], rho=1.5, m2=0.02)
        + _run("current", "lag", 8, 1, [0.3, 0.5, 0.55], rho=1.5, m2=0.02)
        + _run("current", "lag", 8, 2, [0.3, 0.4, 0.41], rho=1.5, m2=0.04)
        # current at lag 32: paired -0.05, +0.02, -0.10: mean -0.0433, sd 0.0603 -> [-0.193, +0.106]: unresolved
        + _run("current", "lag", 32, 0, [0.3, 0.4, 0.45])
        + _run("current", "lag", 32, 1, [0.3, 0.4, 0.62])
        + _run("current", "lag", 32, 2, [0.3, 0.4, 0.30])
        # m2po at lag 8: paired -0.1, -0.1, -0.09: mean -0.0967, sd 0.00577, half-width 0.0143 -> [-0.111, -0.082]:
        # falls; masked 2% then 4% of tokens -> 3.00%
        + _run("m2po", "lag", 8, 0, [0.3, 0.4, 0.4], masked=0.02)
        + _run("m2po", "lag", 8, 1, [0.3, 0.4, 0.5], masked=0.02)
        + _run("m2po", "lag", 8, 2, [0.3, 0.4, 0.31], masked=0.02)
        # behaviour at lag 8: paired +0.01, 0.0, +0.02: [-0.015, +0.035] -> holds
        + _run("behaviour", "lag", 8, 0, [0.3, 0.4, 0.51])
        + _run("behaviour", "lag", 8, 1, [0.3, 0.4, 0.60])
        + _run("behaviour", "lag", 8, 2, [0.3, 0.4, 0.42])
        # the periodic refresh at v = 64, two seeds: paired +0.1, -0.2
        + _run("current", "periodic", 64, 0, [0.3, 0.4, 0.6])
        + _run("current", "periodic", 64, 1, [0.3, 0.4, 0.4])
        # a gentler rate: its own baseline, lag 256 paired with it (+0.0, +0.01)
        + _run(b, "lag", 0, 0, [0.3, 0.32, 0.33], lr=1e-5)
        + _run(b, "lag", 0, 1, [0.3, 0.33, 0.34], lr=1e-5)
        + _run("current", "lag", 256, 0, [0.3, 0.32, 0.33], lr=1e-5, m2=0.01)
        + _run("current", "lag", 256, 1, [0.3, 0.33, 0.35], lr=1e-5, m2=0.01)
        # the rerun of current lag 8 seed 0: the same until the final evaluation
        + _run("current", "lag", 8, 0, [0.3, 0.5, 0.48], rho=1.5, m2=0.02, rerun=True)
    )


def test_table_and_verdict_hand_computed(tmp_path):
    b = vs.BASELINE
    runner.write_csv(_table_rows(), vs.CSV_COLUMNS, tmp_path / "v.csv")
    lines = vs.summary_table(vs.read_rows(tmp_path / "v.csv")).splitlines()
    # Baseline: finals 0.5, 0.6, 0.4 -> 0.500 ± 0.100; last-3 means 0.4, 0.4667, 0.3667 -> 0.411 ± 0.051;
    # M2 0 (m2 * i); staleness min(4, 0), min(8, 0) -> 0; rho' p99 mean(1, 2) = 1.5, max mean(10, 20) = 15.
    assert lines[2] == (
        f"| {b} | 0.0001 | lag | 0 | 3 | 0.500 ± 0.100 | 0.400–0.600 | — | baseline | 0.411 ± 0.051 | 0.000 | 0.000 "
        "| 0.000 | 0.0 | 1.50 | 15 | 0.00% | 0.150 | 10 |"
    )
    # current, lag 8: 0.493 ± 0.074; paired -0.007 [-0.101, +0.087], 2 wins; last-3 means 0.44, 0.45, 0.37 ->
    # 0.420 ± 0.044; M2: seeds' rows (0.02, 0.04), (0.02, 0.04), (0.04, 0.08) -> 0.040, KL k1 half of it 0.020.
    assert lines[3] == (
        "| current | 0.0001 | lag | 8 | 3 (rule: 5) | 0.493 ± 0.074 | 0.410–0.550 | -0.007 [-0.101, +0.087] (2/3) "
        "| unresolved | 0.420 ± 0.044 | 0.040 | 0.020 | 0.000 | 6.0 | 2.25 | 22.5 | 0.00% | 0.150 | 10 |"
    )
    # behaviour, lag 8: paired +0.01, 0, +0.02: mean +0.010, sd 0.01, half-width 0.0248 -> [-0.015, +0.035]: holds.
    # No m2 in its rows ("", as an old CSV's): "—". Within 0.05 of 0 on 3 seeds: the rule asks for 5.
    assert lines[4].startswith(
        "| behaviour | 0.0001 | lag | 8 | 3 (rule: 5) | 0.510 ± 0.090 | 0.420–0.600 | +0.010 [-0.015, +0.035] (2/3) "
        "| holds | "
    )
    assert "| — | — | 0.000 |" in lines[4]
    assert lines[5].startswith(
        "| m2po | 0.0001 | lag | 8 | 3 | 0.403 ± 0.095 | 0.310–0.500 | -0.097 [-0.111, -0.082] (0/3) | falls |"
    )
    assert "| 3.00% |" in lines[5]
    assert lines[6].startswith(
        "| current | 0.0001 | lag | 32 | 3 (rule: 5) | 0.457 ± 0.160 | 0.300–0.620 | -0.043 [-0.193, +0.106] (1/3) "
        "| unresolved |"
    )
    # periodic rows after every lag; two seeds paired with seeds 0, 1 of the baseline: +0.1, -0.2 -> mean -0.05,
    # sd 0.2121, half-width 12.706 x 0.2121 / sqrt 2 = 1.906.
    assert lines[7].startswith(
        "| current | 0.0001 | periodic | 64 | 2 (rule: 5) | 0.500 ± 0.141 | 0.400–0.600 "
        "| -0.050 [-1.956, +1.856] (1/2) | unresolved |"
    )
    # the gentler rate after, paired with its own baseline: +0.00, +0.01 -> [-0.059, +0.069]: unresolved
    assert lines[8].startswith(f"| {b} | 1e-05 | lag | 0 | 2 |")
    assert lines[9].startswith("| current | 1e-05 | lag | 256 | 2 (rule: 5) | 0.340 ± 0.014 |")
    assert "| +0.005 [-0.059, +0.069] (1/2) | unresolved |" in lines[9]
    i = lines.index(
        "lr 0.0001, holds up to: the largest lag s at which, and at every smaller lag of the grid ([8, 32]), "
        "it holds (0: none)."
    )
    assert lines[i + 4 : i + 7] == [
        "| current | 0 | 8: unresolved, 32: unresolved |",
        "| behaviour | 8 | 8: holds |",
        "| m2po | 0 | 8: falls |",
    ]
    i = lines.index("| lr | lag | corrections | M2 | KL(alpha‖pi_k) k1 | KL(alpha‖pi_k) k3 |")
    # lag 8: current's seeds 0.03, 0.03, 0.06 -> 0.04; behaviour and m2po have no m2 (only k3 = 0).
    assert lines[i + 2 : i + 6] == [
        "| 0.0001 | 0 | 1 | 0.000–0.000 | 0.000–0.000 | 0.000–0.000 |",
        "| 0.0001 | 8 | 3 | 0.040–0.040 | 0.020–0.020 | 0.000–0.000 |",
        "| 0.0001 | 32 | 1 | — | — | 0.000–0.000 |",
        "| 1e-05 | 0 | 1 | — | — | 0.000–0.000 |",
    ]
    # The rerun beside its first run: 0.52 then 0.48; the evaluations at steps 0 and 4 agree, step 8 differs.
    assert lines[-1] == "| current | 0.0001 | lag | 8 | 0 | 0.520 | 0.480 | -0.040 | 2/3 | 8 |"


def test_verdict_rule():
    assert vs.verdict([]) == "—" and vs.verdict([0.1]) == "—"  # one seed: no interval
    assert vs.t975(2) == 4.303 and vs.t975(4) == 2.776 and abs(vs.t975(60) - 2.0003) < 1e-3
    # The example, PPO at lag 8 (3 seeds, mean +0.001, sd 0.043): [-0.106, +0.108] -> unresolved.
    m, lo, hi = vs.interval([0.001 + 0.043, 0.001, 0.001 - 0.043])
    assert (round(lo, 3), round(hi, 3)) == (-0.106, 0.108)
    assert vs.verdict([-0.02, -0.03, -0.025]) == "holds"  # [-0.037, -0.013]: wholly above -0.05
    assert vs.verdict([-0.10, -0.09, -0.08]) == "falls"  # [-0.115, -0.065]: wholly below -0.05
    assert vs.verdict([-0.06, -0.04, -0.05]) == "unresolved"  # [-0.075, -0.025] straddles -0.05
    assert vs.verdict([0.0, 0.0, 0.0]) == "holds"  # ties: a zero-width interval at 0


def test_seeds_rule_schedules_extra_seeds_for_close_cells(tmp_path):
    args = vs.build_parser().parse_args(["--lags", "0", "8", "32", "--corrections", "current", "m2po", "behaviour"])
    args.periodic_vs = [64]
    args.periodic_corrections = ["current"]
    jobs = vs.grid(args)
    runner.write_csv(_table_rows(), vs.CSV_COLUMNS, tmp_path / "v.csv")
    extra = vs.extra_seed_jobs(args, jobs, vs.read_rows(tmp_path / "v.csv"))
    # |mean| <= 0.05: current lag 8 (-0.007), behaviour lag 8 (+0.010), current lag 32 (-0.043), periodic v 64
    # (-0.050); not m2po lag 8 (-0.097). The baseline's seeds 3, 4 first.
    assert [vs.run_name(*j) for j in extra] == [
        f"{name}-lr0.0001-s{s}"
        for name in ("baseline-lag0", "current-lag8", "behaviour-lag8", "current-lag32", "current-v64")
        for s in (3, 4)
    ]
    assert vs.extra_seed_jobs(vs.build_parser().parse_args(["--extra-seeds"]), jobs, []) == []


def test_table_only_rebuilds_table_and_picture_from_the_csv(tmp_path):
    b = vs.BASELINE
    rows = _run(b, "lag", 0, 0, [0.3, 0.4, 0.5]) + _run("m2po", "lag", 8, 0, [0.3, 0.4, 0.4], masked=0.02)
    rows += _run("m2po", "periodic", 8, 0, [0.3, 0.4, 0.45], masked=0.01)
    runner.write_csv(rows, vs.CSV_COLUMNS, tmp_path / "very_stale.csv")
    assert vs.main(["--table-only", "--out-dir", str(tmp_path), "--curve-lag", "8"]) == 0
    assert "| m2po | 0.0001 | lag | 8 | 1 |" in (tmp_path / "very_stale_table.md").read_text()
    assert (tmp_path / "very_stale.png").is_file() or importlib.util.find_spec("matplotlib") is None


def test_table_only_reads_a_csv_from_before_the_drift_columns(tmp_path):
    # issue 50's CSV: no rerun, m2, mismatch_kl_k1 nor the new arms' columns. Its rows read "—" for the drift.
    old = [c for c in vs.CSV_COLUMNS if c not in ("rerun", "m2", "mismatch_kl_k1", "m2po_clip_threshold")]
    old = [c for c in old if c not in ("m2po_quadrant_threshold", "dppo_delta")]
    rows = _run(vs.BASELINE, "lag", 0, 0, [0.3, 0.4, 0.5]) + _run(vs.BASELINE, "lag", 0, 1, [0.3, 0.4, 0.45])
    rows += _run("m2po", "lag", 8, 0, [0.3, 0.4, 0.4], masked=0.02, m2=0.5)
    rows += _run("m2po", "lag", 8, 1, [0.3, 0.4, 0.35], masked=0.02, m2=0.5)
    runner.write_csv(rows, old, tmp_path / "very_stale.csv")
    assert vs.main(["--table-only", "--out-dir", str(tmp_path), "--curve-lag", "8"]) == 0
    text = (tmp_path / "very_stale_table.md").read_text()
    assert (
        "| m2po | 0.0001 | lag | 8 | 2 | 0.375 ± 0.035 | 0.350–0.400 | -0.100 [-0.100, -0.100] (0/2) | falls " in text
    )
    assert "| — | — | 0.000 |" in text and "Run to run" not in text


def test_masked_frac_reads_whichever_mask_the_run_has():
    assert vs.masked_frac({"skipped_no_signal": 1}) is None  # a step without an update has no loss
    assert vs.masked_frac({"loss": 1.0}) == 0.0  # an update without a mask: its unit off, nothing dropped
    assert vs.masked_frac({"loss": 1.0, "is_masked_frac": 0.125}) == 0.125
    assert vs.masked_frac({"loss": 1.0, "m2po_masked_frac": 0.25}) == 0.25


@pytest.mark.parametrize("seed", [0, 1])
def test_on_policy_m2po_and_opsm_keep_every_token(seed):
    # The shared lag-0 baseline: at lag 0 with one inner step log alpha = log pi_k = log pi_theta where the gradient
    # is taken, so M2PO's v_t = 0 (mean 0 < the M2 threshold) and OPSM's mean of log alpha - log pi_theta = 0 (not >
    # delta): neither mask drops anything, and both arms take [A]'s default gradient there.
    torch = pytest.importorskip("torch")
    corrections = pytest.importorskip("variants.corrections")
    if not hasattr(corrections, "m2po_keep_mask") or not hasattr(corrections, "opsm_keep_mask"):
        pytest.skip("variants.corrections has no m2po_keep_mask / opsm_keep_mask yet")
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(6, 5, generator=g, dtype=torch.float64) * 3  # (N, T)
    mask = (torch.rand(6, 5, generator=g) > 0.3).long()  # (N, T)
    adv = torch.randn(6, generator=g, dtype=torch.float64)  # (N,) some negative: OPSM looks at those
    assert (adv < 0).any()
    keep = corrections.m2po_keep_mask(logp, logp, mask, 0.04)
    assert bool(keep[mask > 0].all())
    keep = corrections.opsm_keep_mask(logp, logp, adv, mask, 0.5)
    assert bool(keep.reshape(6, -1)[mask.sum(1) > 0].all())


@pytest.mark.model  # trains the tiny policy: CI runs it again under ATEN_CPU_CAPABILITY=default
def test_tiny_study_end_to_end_staleness_rerun_seeds_rule_and_collect(tmp_path, warm_cache, capsys):
    from conftest import TEST_WARMUP

    def args(*extra):
        return [
            *("--corrections", "m2po", "dppo", "--lags", "0", "2", "--seeds", "0"),
            *("--periodic-vs", "2", "--periodic-corrections", "m2po"),
            *("--rerun", "m2po-lag2", "--extra-seeds", "1", "--close", "1"),  # every cell is "close": seed 1 too
            *("--steps", "4", "--eval-every", "2", "--eval-size", "10", "--warmup-steps", str(TEST_WARMUP)),
            *("--cache-dir", warm_cache, "--out-dir", str(tmp_path / "results"), "--runs-dir", str(tmp_path / "runs")),
            *extra,
        ]

    assert vs.main(args()) == 0
    results = tmp_path / "results"
    with open(results / "very_stale.csv") as f:
        assert f.readline().strip().split(",") == vs.CSV_COLUMNS
    rows = vs.read_rows(results / "very_stale.csv")
    runs = vs.runs_of(rows)
    cells = {(vs.BASELINE, "lag", 0), ("m2po", "lag", 2), ("dppo", "lag", 2), ("m2po", "periodic", 2)}
    assert set(runs) == {(*c, 1e-4, s) for c in cells for s in (0, 1)}  # the first pass, then the seeds rule
    for run in runs.values():
        assert [r["step"] for r in run] == [0, 2, 4]
    # staleness = k - sampled_at. Lag 2: steps 0, 1, 2, 3 train on batches of steps 0, 0, 0, 1: 0, 1 | 2, 2.
    # Periodic v = 2: k mod 2: 0, 1 | 0, 1. Lag 0: 0 everywhere, rho' = 1, M2 = 0, and M2PO keeps every token.
    assert [r["staleness"] for r in runs["m2po", "lag", 2, 1e-4, 0][1:]] == [0.5, 2.0]
    assert [r["staleness"] for r in runs["m2po", "periodic", 2, 1e-4, 0][1:]] == [0.5, 0.5]
    base = runs[vs.BASELINE, "lag", 0, 1e-4, 0][1:]
    assert all(r["staleness"] == 0 and r["rho_prime_p99"] == 1.0 and r["masked_frac"] == 0.0 for r in base)
    assert all(r["m2"] == 0.0 and r["mismatch_kl_k1"] == 0.0 for r in base)
    stale = runs["m2po", "lag", 2, 1e-4, 0]
    assert stale[-1]["rho_prime_max"] > 1.0 and stale[-1]["m2"] > 0.0  # stale batches: rho' moves off 1, M2 > 0
    assert runs["dppo", "lag", 2, 1e-4, 0][-1]["dppo_delta"] == 0.2
    # The rerun: its own folder and rows, beside the first run in the table.
    again = vs.runs_of(rows, reruns=True)
    assert set(again) == {("m2po", "lag", 2, 1e-4, 0)}
    assert (tmp_path / "runs" / "m2po-lag2-lr0.0001-s0-rerun" / "summary.json").is_file()
    table = (results / "very_stale_table.md").read_text()
    assert "Run to run" in table and "| m2po | 0.0001 | lag | 2 | 0 |" in table
    assert "| dppo | 0.0001 | lag | 2 | 2" in table  # two seeds: an interval, a verdict
    out = capsys.readouterr().out
    assert "the seeds rule: 4 runs more" in out  # the baseline and 3 cells, seed 1 and "(rerun)" in out
    # Resumable: a second call reuses every run.
    assert vs.main(args()) == 0
    assert capsys.readouterr().out.count("(existing run)") == 4 + 1 + 4
    # --collect: only the runs already finished (lag 8 never ran), listed as not finished.
    assert vs.main(args("--collect", "--lags", "0", "2", "8")) == 0
    assert "m2po-lag8-lr0.0001-s0: not finished (--collect)" in (results / "very_stale_table.md").read_text()
    assert vs.runs_of(vs.read_rows(results / "very_stale.csv")).keys() == runs.keys()


@pytest.mark.model
def test_find_lr_reports_the_drift_at_the_lag(tmp_path, warm_cache):
    from conftest import TEST_WARMUP

    argv = [
        *("--find-lr", "1e-3", "1e-6", "--find-lr-lag", "2", "--find-lr-steps", "5", "--eval-size", "10"),
        *("--warmup-steps", str(TEST_WARMUP), "--cache-dir", warm_cache),
        *("--out-dir", str(tmp_path / "results"), "--runs-dir", str(tmp_path / "runs")),
    ]
    assert vs.main(argv) == 0
    lines = (tmp_path / "results" / "very_stale_find_lr.md").read_text().splitlines()
    assert lines[0].startswith("Drift at lag 2, current, seed 0, 5 steps")
    big, small = lines[4].split("|"), lines[5].split("|")  # sorted by rate, largest first
    assert big[1].strip() == "0.001" and small[1].strip() == "1e-06"
    # steps 2, 3, 4 trained on batches 2 updates stale (a step whose groups all tie takes no update and logs no M2)
    assert 1 <= int(big[2]) <= 3 and 1 <= int(small[2]) <= 3
    assert float(small[3]) < float(big[3])  # the gentler rate drifts less
    chosen = "0.001" if float(big[3]) <= 0.04 else "1e-06"  # the largest rate at or below the M2 threshold
    assert float(small[3]) <= 0.04 and lines[-1].endswith(f"pass --gentle-lr {chosen}")
