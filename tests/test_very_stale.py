"""studies/very_stale.py: its grid, its table and verdict computed by hand from a CSV, and the fact that lets one
set of lag-0 runs serve every correction (M2PO's and OPSM's masks keep every token on-policy)."""

import importlib.util

import pytest

from studies import runner
from studies import very_stale as vs


def test_grid_order_keeps_whole_seed_sets_and_counts():
    args = vs.build_parser().parse_args([])
    jobs = vs.grid(args)
    # 3 baseline runs, 4 lags x 6 corrections x 3 seeds, 2 v x 2 corrections x 3 seeds.
    assert len(jobs) == 3 + 4 * 6 * 3 + 2 * 2 * 3 == 87
    cells = [(c, vs.schedule_of(ch)) for c, ch in jobs]
    # Every cell's seeds run one after another (a study cut short keeps whole seed sets), in the stated order.
    order = list(dict.fromkeys(cells))
    assert [cells[3 * i : 3 * i + 3] for i in range(len(order))] == [[cell] * 3 for cell in order]
    assert [sch for _, sch in order[:2]] == [("lag", 0), ("lag", 256)]
    assert [sch[1] for _, sch in order if sch[0] == "lag"][1::6] == [256, 128, 32, 8]
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


def _run(correction, schedule, n, seed, accs, masked=0.0, rho=1.0):
    """A run's CSV rows at steps 0, 4, 8 as runner.run_rows writes them (step 0: no training, blank means)."""
    lag, v = (n, 1) if schedule == "lag" else (0, n)
    base = dict(correction=correction, shared_baseline=correction == vs.BASELINE, schedule=schedule, lag=lag)
    base.update(offpolicy_steps=v, lr=1e-4, clip_center="pi_k", seed=seed)
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
                mismatch_kl_k3=0.0,
            )
        rows.append({**base, "step": 4 * i, "wall_s": 5.0 * i, "eval_accuracy": a, **means})
    return rows


def test_table_and_verdict_hand_computed(tmp_path):
    b = vs.BASELINE
    rows = (
        _run(b, "lag", 0, 0, [0.3, 0.4, 0.5])
        + _run(b, "lag", 0, 1, [0.3, 0.5, 0.6])
        + _run(b, "lag", 0, 2, [0.3, 0.4, 0.4])
        # current at lag 8: finals 0.52, 0.55, 0.41; paired +0.02, -0.05, +0.01 -> mean -0.0067 > -0.03: holds
        + _run("current", "lag", 8, 0, [0.3, 0.5, 0.52], rho=1.5)
        + _run("current", "lag", 8, 1, [0.3, 0.5, 0.55], rho=1.5)
        + _run("current", "lag", 8, 2, [0.3, 0.4, 0.41], rho=1.5)
        # current at lag 32: paired -0.05, +0.02, -0.10 -> mean -0.0433, one seed above: unclear
        + _run("current", "lag", 32, 0, [0.3, 0.4, 0.45])
        + _run("current", "lag", 32, 1, [0.3, 0.4, 0.62])
        + _run("current", "lag", 32, 2, [0.3, 0.4, 0.30])
        # m2po at lag 8: paired -0.1, -0.1, -0.09, every seed below: falls; masked 2% then 4% of tokens -> 3.00%
        + _run("m2po", "lag", 8, 0, [0.3, 0.4, 0.4], masked=0.02)
        + _run("m2po", "lag", 8, 1, [0.3, 0.4, 0.5], masked=0.02)
        + _run("m2po", "lag", 8, 2, [0.3, 0.4, 0.31], masked=0.02)
        # the periodic refresh at v = 64, two seeds: paired +0.1, -0.2
        + _run("current", "periodic", 64, 0, [0.3, 0.4, 0.6])
        + _run("current", "periodic", 64, 1, [0.3, 0.4, 0.4])
    )
    runner.write_csv(rows, vs.CSV_COLUMNS, tmp_path / "v.csv")
    lines = vs.summary_table(vs.read_rows(tmp_path / "v.csv")).splitlines()
    # Baseline: finals 0.5, 0.6, 0.4 -> 0.500 ± 0.100; last-3 means 0.4, 0.4667, 0.3667 -> 0.411 ± 0.051;
    # staleness min(4, 0), min(8, 0) -> 0; rho' p99 mean(1, 2) = 1.5, max mean(10, 20) = 15; grad norm 0.15.
    assert lines[2] == (
        f"| {b} | lag | 0 | 3 | 0.500 ± 0.100 | 0.400–0.600 | — | baseline | 0.411 ± 0.051 | 0.0 | 1.50 | 15 "
        "| 0.00% | 0.150 | 10 |"
    )
    # current, lag 8: 0.493 ± 0.074; paired +0.02, -0.05, +0.01 -> -0.007 ± 0.038, 2 wins, t = -0.3; last-3 means
    # 0.44, 0.45, 0.37 -> 0.420 ± 0.044; staleness mean(4, 8) = 6; rho' p99 mean(1.5, 3) = 2.25, max mean(15, 30).
    assert lines[3] == (
        "| current | lag | 8 | 3 | 0.493 ± 0.074 | 0.410–0.550 | -0.007 ± 0.038 (2/3, t -0.3) | holds "
        "| 0.420 ± 0.044 | 6.0 | 2.25 | 22.5 | 0.00% | 0.150 | 10 |"
    )
    # m2po: finals 0.4, 0.5, 0.31 -> 0.403 ± 0.095; paired mean -0.0967, std 0.0058, t = -0.0967 / (0.0058/√3) = -29.0.
    assert lines[4].startswith(
        "| m2po | lag | 8 | 3 | 0.403 ± 0.095 | 0.310–0.500 | -0.097 ± 0.006 (0/3, t -29.0) | falls |"
    )
    assert "| 3.00% |" in lines[4]
    assert lines[5].startswith("| current | lag | 32 | 3 | 0.457 ± 0.160 | 0.300–0.620 | -0.043 ± 0.060 (1/3, t -1.2)")
    assert "| unclear |" in lines[5]
    # periodic rows after every lag; two seeds paired with seeds 0, 1 of the baseline: +0.1, -0.2.
    assert lines[6].startswith("| current | periodic | 64 | 2 | 0.500 ± 0.141 | 0.400–0.600 | -0.050 ± 0.212 (1/2")
    assert "| unclear |" in lines[6]
    i = lines.index("| correction | holds up to lag | verdict at each lag |")
    assert lines[i + 2 :] == ["| current | 8 | 8: holds, 32: unclear |", "| m2po | 0 | 8: falls |"]


def test_verdict_rule():
    assert vs.verdict([]) == "—"
    assert vs.verdict([-0.02, -0.03, -0.035]) == "holds"  # mean -0.0283 > -0.03
    assert vs.verdict([-0.05, -0.04, -0.01]) == "falls"  # mean -0.0333, every seed below
    assert vs.verdict([-0.08, -0.04, 0.0]) == "unclear"  # a tie is not below its baseline


def test_table_only_rebuilds_table_and_picture_from_the_csv(tmp_path):
    b = vs.BASELINE
    rows = _run(b, "lag", 0, 0, [0.3, 0.4, 0.5]) + _run("m2po", "lag", 8, 0, [0.3, 0.4, 0.4], masked=0.02)
    rows += _run("m2po", "periodic", 8, 0, [0.3, 0.4, 0.45], masked=0.01)
    runner.write_csv(rows, vs.CSV_COLUMNS, tmp_path / "very_stale.csv")
    assert vs.main(["--table-only", "--out-dir", str(tmp_path), "--curve-lag", "8"]) == 0
    assert "| m2po | lag | 8 | 1 |" in (tmp_path / "very_stale_table.md").read_text()
    assert (tmp_path / "very_stale.png").is_file() or importlib.util.find_spec("matplotlib") is None


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
def test_tiny_study_end_to_end_staleness_and_collect(tmp_path, warm_cache, capsys):
    from conftest import TEST_WARMUP

    def args(*extra):
        return [
            "--corrections",
            "m2po",
            "--lags",
            "0",
            "2",
            "--seeds",
            "0",
            "--periodic-vs",
            "2",
            "--periodic-corrections",
            "m2po",
            "--steps",
            "4",
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

    assert vs.main(args()) == 0
    results = tmp_path / "results"
    with open(results / "very_stale.csv") as f:
        assert f.readline().strip().split(",") == vs.CSV_COLUMNS
    runs = vs.runs_of(vs.read_rows(results / "very_stale.csv"))
    assert set(runs) == {(vs.BASELINE, "lag", 0, 0), ("m2po", "lag", 2, 0), ("m2po", "periodic", 2, 0)}
    for run in runs.values():
        assert [r["step"] for r in run] == [0, 2, 4]
    # staleness = k - sampled_at. Lag 2: steps 0, 1, 2, 3 train on batches of steps 0, 0, 0, 1: 0, 1 | 2, 2.
    # Periodic v = 2: k mod 2: 0, 1 | 0, 1. Lag 0: 0 everywhere, rho' = 1, and M2PO keeps every token.
    assert [r["staleness"] for r in runs["m2po", "lag", 2, 0][1:]] == [0.5, 2.0]
    assert [r["staleness"] for r in runs["m2po", "periodic", 2, 0][1:]] == [0.5, 0.5]
    base = runs[vs.BASELINE, "lag", 0, 0][1:]
    assert all(r["staleness"] == 0 and r["rho_prime_p99"] == 1.0 and r["masked_frac"] == 0.0 for r in base)
    assert runs["m2po", "lag", 2, 0][-1]["rho_prime_max"] > 1.0  # stale batches: rho' moves off 1
    # --collect: only the runs already finished (here, all three; lag 8 never ran), listed as not finished.
    capsys.readouterr()
    assert vs.main(args("--collect", "--lags", "0", "2", "8")) == 0
    assert "m2po-lag8-lr0.0001-s0: not finished (--collect)" in (results / "very_stale_table.md").read_text()
    assert vs.runs_of(vs.read_rows(results / "very_stale.csv")).keys() == runs.keys()
