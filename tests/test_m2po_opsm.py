"""M2PO and OPSM (variants.corrections.m2po_keep_mask / opsm_keep_mask, and the units M2PO (a step_keep: the tokens
leave the loss mask and Z) and OPSM (a loss hook: A <- 0 on a dropped sequence) around objective.policy_loss)
against plain Python loops written from their definitions (float64, hand-built ties, the case where no cut brings
the mean below the M2 threshold, masked tokens), TRL's stock `GRPOTrainer.get_off_policy_mask`, and train.py runs.

The references read:
- M2PO: AReaL (inclusionAI/AReaL, areal/trainer/ppo/actor.py, `_apply_m2po_masking` / `_get_m2po_loss_mask`):
  M2 = (log behaviour - log proximal)^2 over the loss tokens, sorted descending; the first index j whose suffix
  mean is < m2_threshold is the number of tokens masked; none: all but the last (the smallest) are masked.
- OPSM: TRL 1.16 (trl/trainer/grpo_trainer.py, `get_off_policy_mask`): keep = (A >= 0) | (mean over the mask of
  log pi_sampling - log pi_theta.detach() <= threshold); `_compute_loss` multiplies the per-token loss by it before
  adding beta * KL and divides by the unchanged mask's count.
"""

import math

import pytest
import torch

from conftest import error_line, jsonl, needs, tiny_run_args
from objective import LossInput, policy_loss
from test_staleness import corrected_loss, step_figures
from variants.corrections import M2PO, OPSM, m2po_keep_mask, opsm_keep_mask

EPS_LO, EPS_HI = 0.2, 0.28


# ---- the loops, from the definitions ---------------------------------------------------------------------------


def m2po_loop(alpha, pi_k, mask, m2_threshold):
    """M2PO's kept tokens (lists of bools), True off the mask: the largest M2 = (log alpha - log pi_k)^2 leave, in
    descending order (ties: the earlier token first, Python's stable sort), until the rest's mean is < the threshold; if
    no count does it, all but the smallest leave."""
    tokens = [(i, j) for i in range(len(mask)) for j in range(len(mask[i])) if mask[i][j]]
    m2 = {(i, j): (alpha[i][j] - pi_k[i][j]) ** 2 for i, j in tokens}
    order = sorted(tokens, key=lambda ij: -m2[ij])  # stable: equal M2 keep the tokens' order
    n, cut = len(order), max(len(order) - 1, 0)
    for m in range(n):
        rest = [m2[ij] for ij in order[m:]]
        if sum(rest) / len(rest) < m2_threshold:
            cut = m
            break
    keep = [[True] * len(row) for row in mask]
    for i, j in order[:cut]:
        keep[i][j] = False
    return keep


def opsm_loop(alpha, logp, adv, mask, delta):
    """OPSM's kept sequences (a list of bools): sequence i leaves iff A_i < 0 and the mean over its loss tokens of
    log alpha - log pi_theta is > delta (0 without a token; a NaN token gives no evidence, as TRL)."""
    keep = []
    for i in range(len(mask)):
        diffs = [alpha[i][j] - logp[i][j] for j in range(len(mask[i])) if mask[i][j]]
        d = sum(0.0 if math.isnan(x) else x for x in diffs) / max(len(diffs), 1)
        keep.append(not (adv[i] < 0 and d > delta))
    return keep


def loss_loop(logp, alpha, pi_k, ref, adv, mask, center, beta, keep, seq_keep):
    """The loss's token-mean in floats: a token keep drops leaves the sum and the count with its KL term (M2PO); a
    sequence seq_keep drops loses its surrogate term only (OPSM)."""
    terms = []
    for i in range(len(logp)):
        for j in range(len(logp[i])):
            if not mask[i][j] or not keep[i][j]:
                continue
            rho, rho_p = math.exp(logp[i][j] - alpha[i][j]), math.exp(pi_k[i][j] - alpha[i][j])
            a = adv[i]
            if center == "decoupled":
                r = rho / rho_p
                o = rho_p * min(r * a, min(max(r, 1 - EPS_LO), 1 + EPS_HI) * a)
            else:
                lo, hi = (max(rho_p - EPS_LO, 0.0), rho_p + EPS_HI) if center == "pi_k" else (1 - EPS_LO, 1 + EPS_HI)
                o = min(rho * a, min(max(rho, lo), hi) * a)
            d = ref[i][j] - logp[i][j]
            terms.append((o if seq_keep[i] else 0.0) - beta * (math.exp(d) - d - 1))
    return -sum(terms) / max(len(terms), 1)


def batch(seed, n=8, t=6, spread=0.6):
    g = torch.Generator().manual_seed(seed)
    u = lambda: torch.rand(n, t, generator=g, dtype=torch.float64) - 0.5  # noqa: E731
    logp = -torch.rand(n, t, generator=g, dtype=torch.float64) * 2
    alpha, pi_k, ref = logp + 2 * spread * u(), logp + spread * u(), logp + u()
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = (torch.rand(n, t, generator=g) > 0.25).long()
    mask[0] = 0  # a sequence without a loss token
    alpha[mask == 0] += 300.0  # padding far off: neither mask may see it
    return logp, alpha, pi_k, ref, adv, mask


# ---- M2PO ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("m2_threshold", [0.01, 0.04, 0.08])
def test_m2po_mask_is_the_loop(seed, m2_threshold):
    _, alpha, pi_k, _, _, mask = batch(seed)
    keep = m2po_keep_mask(alpha, pi_k, mask, m2_threshold)
    assert keep.dtype == torch.bool and keep.shape == mask.shape
    assert keep.tolist() == m2po_loop(alpha.tolist(), pi_k.tolist(), mask.tolist(), m2_threshold)
    kept = keep & (mask > 0)
    m2 = (alpha - pi_k).square()
    assert 0 < (~keep).sum() < mask.sum()  # the case is not trivial: some leave, some stay
    assert m2[kept].mean() < m2_threshold  # what M2PO guarantees of the rest
    assert m2[kept].max() <= m2[(mask > 0) & ~keep].min()  # the largest left


def test_m2po_ties_at_the_cut_leave_in_token_order():
    # M2 = 0.09 three times, then 0.01 twice: suffix means 0.058, 0.05, 0.0367 < 0.04: two of the three ties leave.
    d = [0.3, -0.3, 0.3, 0.1, -0.1]
    alpha = torch.tensor([d], dtype=torch.float64)
    pi_k, mask = torch.zeros_like(alpha), torch.ones(1, 5, dtype=torch.long)
    keep = m2po_keep_mask(alpha, pi_k, mask, 0.04)
    assert keep.tolist() == [[False, False, True, True, True]]
    assert keep.tolist() == m2po_loop(alpha.tolist(), pi_k.tolist(), mask.tolist(), 0.04)


def test_m2po_when_no_cut_reaches_the_threshold_all_but_the_smallest_leave():
    alpha = torch.tensor([[1.0, -0.5, 0.7], [0.5, 2.0, 0.0]], dtype=torch.float64)
    pi_k, mask = torch.zeros_like(alpha), torch.tensor([[1, 1, 1], [1, 1, 0]])
    # every M2 on the mask is >= 0.25 >= m2_threshold: only the smallest stays; its tie (-0.5 vs 0.5) is broken by order
    keep = m2po_keep_mask(alpha, pi_k, mask, 0.1)
    assert keep.tolist() == [[False, False, False], [True, False, True]]
    assert keep.tolist() == m2po_loop(alpha.tolist(), pi_k.tolist(), mask.tolist(), 0.1)


def test_m2po_masked_tokens_and_non_finite_values():
    alpha = torch.tensor([[0.0, 0.1, 50.0], [-math.inf, 0.0, 0.0]], dtype=torch.float64)
    pi_k = torch.zeros_like(alpha)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    keep = m2po_keep_mask(alpha, pi_k, mask, 0.04)
    # padding's M2 = 2500 counts for nothing; the -inf token (M2 = inf) leaves first, and the rest's mean is 0.0025
    assert keep.tolist() == [[True, True, True], [False, True, True]]
    # on-policy (alpha = pi_k: every M2 is 0), an empty mask: nothing leaves
    assert m2po_keep_mask(pi_k, pi_k, mask, 0.04).all()
    assert m2po_keep_mask(alpha, pi_k, torch.zeros_like(mask), 0.04).all()
    with pytest.raises(ValueError, match="m2_threshold must be > 0"):
        m2po_keep_mask(alpha, pi_k, mask, 0.0)


# ---- OPSM ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("delta", [0.0, 0.05, 0.15])
def test_opsm_mask_is_the_loop(seed, delta):
    logp, alpha, _, _, adv, mask = batch(seed)
    keep = opsm_keep_mask(alpha, logp, adv, mask, delta)
    assert keep.dtype == torch.bool and keep.shape == (mask.shape[0], 1)
    assert keep.squeeze(1).tolist() == opsm_loop(alpha.tolist(), logp.tolist(), adv.tolist(), mask.tolist(), delta)
    # per-token advantages (N, T) broadcast from A_i give the same mask on every token
    assert torch.equal(opsm_keep_mask(alpha, logp, adv.unsqueeze(1).expand_as(logp), mask, delta), keep.expand_as(logp))


def test_opsm_edges_by_hand():
    logp = torch.zeros(5, 2, dtype=torch.float64)
    alpha = torch.tensor([[0.2, 0.0], [0.2, 0.0], [0.1, 0.1], [math.nan, 0.3], [0.0, 0.0]], dtype=torch.float64)
    adv = torch.tensor([-1.0, 1.0, -1.0, -1.0, 0.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 1], [1, 1], [1, 1], [0, 0]])
    keep = opsm_keep_mask(alpha, logp, adv, mask, 0.1).squeeze(1).tolist()
    # D = 0.1 > 0.1 is False: kept (the bound is inclusive, as TRL's <=); A > 0 always stays; the NaN token gives
    # no evidence: D = (0 + 0.3) / 2 = 0.15 > 0.1 with A < 0 leaves; no loss token, A = 0: stays
    assert keep == [True, True, True, False, True]
    assert keep == opsm_loop(alpha.tolist(), logp.tolist(), adv.tolist(), mask.tolist(), 0.1)
    with pytest.raises(ValueError, match="opsm delta must be >= 0"):
        opsm_keep_mask(alpha, logp, adv, mask, -0.1)


def test_opsm_is_trls_stock_get_off_policy_mask():
    needs("trl", "trl")
    from trl import GRPOTrainer

    dropped = kept_negative = 0
    for seed, delta in [(0, 0.0), (1, 0.05), (2, 0.1), (3, 0.02)]:
        logp, alpha, _, _, adv, mask = batch(seed)
        logp, alpha, adv = logp.float(), alpha.float(), adv.float()
        alpha = torch.where(mask > 0, alpha, torch.zeros_like(alpha))  # TRL multiplies by the mask: finite padding
        theirs = GRPOTrainer.get_off_policy_mask(
            advantages=adv.unsqueeze(1),
            per_token_logps=logp,
            sampling_per_token_logps=alpha,
            mask=mask.float(),
            off_policy_threshold=delta,
        )  # (N, 1) 1.0 keep, 0.0 drop
        ours = opsm_keep_mask(alpha, logp, adv, mask, delta)
        assert theirs.shape == ours.shape and torch.equal(theirs.bool(), ours), (seed, delta)
        dropped += int((~ours).sum())
        kept_negative += int((ours & (adv.unsqueeze(1) < 0) & (mask.sum(1, keepdim=True) > 0)).sum())
    assert dropped > 0 and kept_negative > 0  # both sides of delta were tried


# ---- in the loss, with every clip centre -------------------------------------------------------------------


@pytest.mark.parametrize("center", ["pi_k", "alpha", "decoupled"])
@pytest.mark.parametrize("which", ["m2po", "opsm", "both"])
def test_the_masks_in_policy_loss_match_the_loop_in_value_and_gradient(center, which):
    logp, alpha, pi_k, ref, adv, mask = batch(seed=4)
    beta, m2_threshold, delta = 0.1, 0.01, 0.05
    flags = dict(clip_eps=EPS_LO, clip_eps_high=EPS_HI, clip_center=center, beta=beta)
    flags |= dict(m2_threshold=m2_threshold) if which != "opsm" else {}
    flags |= dict(opsm_delta=delta) if which != "m2po" else {}
    x = logp.clone().requires_grad_(True)
    loss, stats = corrected_loss(x, alpha, pi_k, ref, adv, mask, **flags)  # the units through variants.recipe
    loss.backward()

    a, pk, rf, ad, mk = (t.tolist() for t in (alpha, pi_k, ref, adv, mask))
    n, t = mask.shape
    k = m2po_loop(a, pk, mk, m2_threshold) if which != "opsm" else [[True] * t for _ in range(n)]
    # OPSM's D_i runs over the loss's tokens: with M2PO, those M2PO keeps (a step_keep's tokens leave the step)
    kept_mask = [[mk[i][j] and k[i][j] for j in range(t)] for i in range(n)]
    s = opsm_loop(a, logp.tolist(), ad, kept_mask, delta) if which != "m2po" else [True] * n
    if which != "opsm":
        assert 0 < sum(not x for row in k for x in row) < mask.sum()  # some tokens leave, some stay
    if which != "m2po":
        assert 0 < s.count(False) < n - 1  # some sequences lose their surrogate, some keep it

    def loop(lp):  # OPSM's mask reads pi_theta detached: it is held at logp's, as the gradient sees it
        return loss_loop(lp, a, pk, rf, ad, mk, center, beta, k, s)

    assert loss.item() == pytest.approx(loop(logp.tolist()), rel=1e-10, abs=1e-12)
    h = 1e-6  # the loop's gradient by central differences, token by token
    for i in range(n):
        for j in range(t):
            up, dn = logp.tolist(), logp.tolist()
            up[i][j] += h
            dn[i][j] -= h
            assert x.grad[i, j].item() == pytest.approx((loop(up) - loop(dn)) / (2 * h), abs=1e-6), (i, j)
    # The figures: M2PO's share of the loss tokens (the step's), OPSM's share of the tokens the loss keeps.
    counted = [(i, j) for i in range(n) for j in range(t) if mk[i][j]]
    kept = [(i, j) for i, j in counted if k[i][j]]
    assert stats["tokens"] == len(kept)
    figures = step_figures(alpha, pi_k, mask, **flags)
    if which != "opsm":
        assert figures["m2po_masked_frac"] == pytest.approx((len(counted) - len(kept)) / len(counted), abs=1e-15)
    else:
        assert "m2po_masked_frac" not in figures
    if which != "m2po":
        assert stats["opsm_masked_frac"] == pytest.approx(sum(not s[i] for i, _ in kept) / len(kept), abs=1e-15)
    else:
        assert "opsm_masked_frac" not in stats


def test_the_units_are_the_masks():
    # M2PO.step_keep is m2po_keep_mask with its share of the mask's tokens; OPSM.loss hands the loss A = 0 exactly on
    # the sequences opsm_keep_mask drops, and the rest unchanged.
    logp, alpha, pi_k, ref, adv, mask = batch(seed=4)
    keep, figures = M2PO(0.02).step_keep(alpha, pi_k, mask)
    assert torch.equal(keep, m2po_keep_mask(alpha, pi_k, mask, 0.02))
    assert figures == {"m2po_masked_frac": pytest.approx(((~keep) & (mask > 0)).sum().item() / mask.sum().item())}
    seen = {}
    x = LossInput(logp, alpha, pi_k, ref, adv, mask)
    _, st = OPSM(0.05).loss(x, inner=lambda y, **settings: seen.update(y=y) or (torch.zeros(()), {}))
    seq_keep = opsm_keep_mask(alpha, logp, adv, mask, 0.05)  # (N, 1)
    assert 0 < (~seq_keep).sum() < mask.shape[0] - 1
    assert torch.equal(seen["y"].advantages, torch.where(seq_keep, adv.unsqueeze(1), 0.0))
    assert seen["y"].loss_mask is mask and seen["y"].logp is logp and seen["y"].alpha_logp is alpha
    dropped_tokens = ((~seq_keep) & (mask > 0)).sum().item()
    assert st["opsm_masked_frac"] == pytest.approx(dropped_tokens / mask.sum().item())


def test_opsm_keeps_dropped_sequences_in_the_normaliser_and_their_kl_term():
    logp, alpha, pi_k, ref, adv, mask = batch(seed=6)
    seq_keep = opsm_keep_mask(alpha, logp, adv, mask, 0.0)
    assert not seq_keep[mask.sum(1) > 0].all()
    x = logp.clone().requires_grad_(True)
    loss, stats = corrected_loss(x, alpha, pi_k, ref, adv, mask, beta=0.5, opsm_delta=0.0)
    loss.backward()
    assert stats["tokens"] == mask.sum().item()  # every token stays in the normaliser
    # a dropped sequence's gradient is its KL term's alone: the loss with only beta * KL on those rows
    dropped = (~seq_keep.squeeze(1)) & (mask.sum(1) > 0)
    y = logp.clone().requires_grad_(True)
    kl_only, _ = policy_loss(LossInput(y, alpha, pi_k, ref, torch.zeros_like(adv), mask), beta=0.5)
    kl_only.backward()
    assert torch.allclose(x.grad[dropped], y.grad[dropped], rtol=0, atol=1e-15)
    assert x.grad[dropped].abs().sum() > 0
    # and the kept sequences' gradient is the plain loss's
    z = logp.clone().requires_grad_(True)
    plain, _ = policy_loss(LossInput(z, alpha, pi_k, ref, adv, mask), beta=0.5)
    plain.backward()
    assert torch.equal(x.grad[~dropped], z.grad[~dropped])


# ---- train.py ----------------------------------------------------------------------------------------------


@pytest.mark.model
def test_train_py_logs_each_masked_fraction_and_a_mask_that_drops_nothing_is_the_plain_run(main, warm_cache, tmp_path):
    import safetensors.torch

    base = ["--lag", "2", "--lr", "1e-3", "--prompts-per-step", "4", "--group-size", "4", "--micro-batch", "8"]
    runs = {
        "plain": [],
        "m2po": ["--m2-threshold", "0.001"],
        "opsm": ["--opsm-delta", "0"],
        "m2po_none": ["--m2-threshold", "1e9"],
        "opsm_none": ["--opsm-delta", "1e9"],
    }
    for name, flags in runs.items():
        r = main(*tiny_run_args(warm_cache, tmp_path / name, steps=5), *base, *flags)  # the later flag wins
        assert r.returncode == 0, r.stderr[-2000:]
    rows = {name: jsonl(tmp_path / name / "metrics.jsonl") for name in runs}
    for name, key in [("m2po", "m2po_masked_frac"), ("opsm", "opsm_masked_frac")]:
        trained = [r for r in rows[name] if "skipped_no_signal" not in r]
        assert trained and all(0 <= r[key] < 1 for r in trained)
        assert max(r[key] for r in trained) > 0  # stale steps (lag 2) lost tokens
        assert trained[0]["staleness"] == 0 and trained[0][key] == 0  # step 0: alpha = pi_k, nothing to mask
        assert all(key not in r for r in rows["plain"])
    weights = {n: safetensors.torch.load_file(tmp_path / n / "final" / "model.safetensors") for n in runs}
    for name in ("m2po_none", "opsm_none"):
        assert all(r.get(f"{name[:4]}_masked_frac", 0) == 0 for r in rows[name])
        assert all(torch.equal(weights[name][k], weights["plain"][k]) for k in weights["plain"]), name
    assert not all(torch.equal(weights["m2po"][k], weights["plain"][k]) for k in weights["plain"])


def test_bad_values_are_one_line_errors(main, tmp_path):
    for flags, line in [
        (["--m2-threshold", "0"], "error: --m2-threshold 0.0: M2PO needs --loss grpo and a threshold > 0"),
        (["--opsm-delta", "-0.5"], "error: --opsm-delta -0.5: OPSM needs --loss grpo and a delta >= 0"),
        (["--loss", "opmd", "--opsm-delta", "0.5"], "error: --opsm-delta 0.5: OPSM needs --loss grpo and a delta >= 0"),
    ]:
        assert error_line(main("--steps", "1", "--out", tmp_path / "bad", *flags)) == line


def test_the_progress_bar_shows_the_masked_fractions():
    from bookkeeping.metrics import show

    class Bar:
        def set_postfix(self, **kw):
            self.postfix = kw

    bar, row = Bar(), {"reward": 0.5, "accuracy": 0.5, "tokens_per_s": 100.0}
    show(bar, row)
    assert "m2po_masked" not in bar.postfix and "opsm_masked" not in bar.postfix
    show(bar, row | {"m2po_masked_frac": 0.0123, "opsm_masked_frac": 0.25})
    assert bar.postfix["m2po_masked"] == "0.012" and bar.postfix["opsm_masked"] == "0.250"
