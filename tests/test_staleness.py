"""The staleness corrections, the units variants.recipe builds from a run's flags (variants/corrections.py: the
Decoupled objective of AReaL, TIS's truncated and MIS's masked sampler weights, kl-is) around objective.policy_loss,
against plain Python loops, hand-computed cases and identities; the k1 / k2 / k3 KL estimators, the sampler-mismatch
statistics (bookkeeping.diagnostics.drift_stats, the units' step figures), and [A]'s current-centred clip as a
decoupled objective."""

import math

import pytest
import torch

import variants
from bookkeeping.diagnostics import drift_stats
from config import Config, ConfigError, resolve, validate
from objective import LossInput, aggregation_total, kl_penalty
from variants.corrections import mis_keep_mask
from variants.reinforce import rec_loss

EPS_LO, EPS_HI, MAX_NEW = 0.2, 0.28, 7


def corrected_loss(logp, alpha_logp, pi_k_logp, ref_logp, adv, mask, *, max_new_tokens=None, total=None, **flags):
    """The loss train.update computes for a run with these flags (config.Config's fields), on one batch: the units
    variants.recipe builds; the tokens their `step_keep` drops (MIS, M2PO) leave the loss mask and its normaliser Z
    (total None: this batch's as the whole step's; also used by test_sequence_is.py, test_m2po_opsm.py and
    test_review.py)."""
    recipe = variants.recipe(Config(**flags))
    keep, _ = recipe.step_keep(alpha_logp, pi_k_logp, mask)  # (N, T) bool
    kept = mask * keep  # (N, T)
    if total is None:
        total = aggregation_total(kept, recipe.settings["agg"], max_new_tokens)
    return recipe.loss(LossInput(logp, alpha_logp, pi_k_logp, ref_logp, adv, kept, total))


def step_figures(alpha_logp, pi_k_logp, mask, **flags):
    """The whole step's figures of a run with these flags, as train.update gathers them: drift_stats, the units'
    `step_keep` figures (is_masked_frac, m2po_masked_frac) and their `step_stats` (is_capped_frac)."""
    recipe = variants.recipe(Config(**flags))
    kept = recipe.step_keep(alpha_logp, pi_k_logp, mask)[1]
    return drift_stats(alpha_logp, pi_k_logp, mask) | kept | recipe.step_stats(alpha_logp, pi_k_logp, mask)


def loop_loss(logp, alpha_logp, pi_k_logp, ref_logp, adv, mask, *, center, agg, beta, kl_estimator, is_cap, is_mask):
    """The objective of policy_loss's docstring with the units' corrections, token by token in Python floats.

    Returns (loss, number of loss tokens MIS dropped, number of kept tokens TIS capped, figures over the kept
    tokens: the fractions of clipped tokens on each side and the mean ratio, rho or, decoupled, r)."""
    n, t = len(logp), len(logp[0])
    seq_terms, all_terms, dropped, capped = [], [], 0, 0
    clip_low, clip_high, ratios = 0, 0, []
    for i in range(n):
        terms = []
        for j in range(t):
            if not mask[i][j]:
                continue
            rho_p = 1.0 if pi_k_logp is None else math.exp(pi_k_logp[i][j] - alpha_logp[i][j])
            if is_mask is not None and not (1.0 / is_mask <= rho_p <= is_mask):
                # MIS: the token leaves the sum and every count below.
                dropped += 1
                continue
            a = adv[i]
            if center == "decoupled":
                pi_k_t = alpha_logp[i][j] if pi_k_logp is None else pi_k_logp[i][j]
                r = math.exp(logp[i][j] - pi_k_t)
                w = rho_p if is_cap is None else min(rho_p, is_cap)
                capped += is_cap is not None and rho_p > is_cap
                s = w * min(r * a, min(max(r, 1 - EPS_LO), 1 + EPS_HI) * a)
                ratio, lo, hi = r, 1 - EPS_LO, 1 + EPS_HI
            else:
                rho = math.exp(logp[i][j] - alpha_logp[i][j])
                if center == "pi_k":
                    lo, hi = max(rho_p - EPS_LO, 0.0), rho_p + EPS_HI
                else:
                    lo, hi = 1 - EPS_LO, 1 + EPS_HI
                s = min(rho * a, min(max(rho, lo), hi) * a)
                ratio = rho
            # clipped: the ratio left the interval on the side the advantage pushes it towards (no gradient)
            clip_low, clip_high, ratios = (
                clip_low + (ratio < lo and a < 0),
                clip_high + (ratio > hi and a > 0),
                ratios + [ratio],
            )
            if ref_logp is not None:
                d = logp[i][j] - ref_logp[i][j]
                s -= beta * {"k1": d, "k2": 0.5 * d * d, "k3": math.exp(-d) + d - 1}[kl_estimator]
            terms.append(s)
        all_terms += terms
        if terms:
            seq_terms.append(sum(terms) / len(terms))
    if agg == "token-mean":
        loss = -sum(all_terms) / max(len(all_terms), 1)
    elif agg == "seq-mean":
        loss = -sum(seq_terms) / max(len(seq_terms), 1)
    else:
        loss = -sum(all_terms) / (n * MAX_NEW)
    k = max(len(ratios), 1)
    return loss, dropped, capped, dict(clip_low=clip_low / k, clip_high=clip_high / k, rho_mean=sum(ratios) / k)


def random_batch(seed, n=6, t=5, spread=0.4):
    """float64 log-probs of a stale step; row 0 fully masked, row 1 so stale that MIS drops all of it."""
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(n, t, generator=g, dtype=torch.float64) * 2  # (N, T)
    alpha_logp = logp + (torch.rand(n, t, generator=g, dtype=torch.float64) - 0.5) * 2 * spread  # (N, T)
    pi_k_logp = logp + (torch.rand(n, t, generator=g, dtype=torch.float64) - 0.5) * 2 * spread  # (N, T)
    ref_logp = logp + (torch.rand(n, t, generator=g, dtype=torch.float64) - 0.5)  # (N, T)
    adv = torch.randn(n, generator=g, dtype=torch.float64)  # (N,)
    mask = (torch.rand(n, t, generator=g) > 0.3).long()  # (N, T)
    mask[0] = 0
    mask[1, :2] = 1
    # rho' = e^2 on every token of row 1.
    pi_k_logp[1] = alpha_logp[1] + 2.0
    return logp, alpha_logp, pi_k_logp, ref_logp, adv, mask


# (is_mask, is_cap for the decoupled centre, kl_estimator, beta, seed offset)
VARIANTS = {
    "mis-k1": (1.5, None, "k1", 0.1, 1),
    "tis-k2": (None, 1.2, "k2", 0.1, 2),
    "tis-mis-k3": (1.4, 1.1, "k3", 0.05, 3),
}


@pytest.mark.parametrize("center,seed_c", [("pi_k", 100), ("alpha", 200), ("decoupled", 300)])
@pytest.mark.parametrize("agg,seed_a", [("token-mean", 0), ("seq-mean", 10), ("constant", 20)])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_policy_loss_matches_loop_value_and_gradient(center, seed_c, agg, seed_a, variant):
    is_mask, is_cap, kl_estimator, beta, seed_v = VARIANTS[variant]
    is_cap = is_cap if center == "decoupled" else None
    logp, alpha_logp, pi_k_logp, ref_logp, adv, mask = random_batch(seed_c + seed_a + seed_v, n=10, t=6, spread=0.5)
    kw = dict(clip_eps=EPS_LO, clip_eps_high=EPS_HI, clip_center=center, beta=beta, agg=agg, max_new_tokens=MAX_NEW)
    x = logp.clone().requires_grad_(True)
    loss, stats = corrected_loss(
        x, alpha_logp, pi_k_logp, ref_logp, adv, mask, **kw, is_cap=is_cap, is_mask=is_mask, kl_estimator=kl_estimator
    )
    loss.backward()

    def loop(lp):
        return loop_loss(
            lp,
            alpha_logp.tolist(),
            pi_k_logp.tolist(),
            ref_logp.tolist(),
            adv.tolist(),
            mask.tolist(),
            center=center,
            agg=agg,
            beta=beta,
            kl_estimator=kl_estimator,
            is_cap=is_cap,
            is_mask=is_mask,
        )

    value, dropped, capped, figures = loop(logp.tolist())
    assert loss.item() == pytest.approx(value, rel=1e-10, abs=1e-12)
    # Gradient of the loop by central finite differences, token by token.
    h = 1e-6
    for i in range(logp.shape[0]):
        for j in range(logp.shape[1]):
            up, dn = logp.tolist(), logp.tolist()
            up[i][j] += h
            dn[i][j] -= h
            fd = (loop(up)[0] - loop(dn)[0]) / (2 * h)
            assert x.grad[i, j].item() == pytest.approx(fd, abs=1e-6), (i, j)
    n_counted = mask.sum().item()
    assert stats["tokens"] == n_counted - dropped  # the loss's statistics are over the tokens MIS keeps
    for key in ("clip_low", "clip_high", "rho_mean"):
        assert stats[key] == pytest.approx(figures[key], rel=1e-12, abs=1e-15), key
    mismatch = step_figures(alpha_logp, pi_k_logp, mask, clip_center=center, is_cap=is_cap, is_mask=is_mask)
    assert mismatch.get("is_masked_frac", 0.0) == pytest.approx(dropped / n_counted)  # of the loss tokens
    assert ("is_masked_frac" in mismatch) == (is_mask is not None)
    if is_cap is not None:  # of the tokens the loss keeps: a token MIS dropped is dropped, not capped
        assert mismatch["is_capped_frac"] == pytest.approx(capped / (n_counted - dropped))
    else:
        assert "is_capped_frac" not in mismatch
    # The case exercises what it claims to: MIS drops, TIS caps, the clip acts somewhere.
    assert (dropped > 0) == (is_mask is not None) and (capped > 0) == (is_cap is not None)
    assert stats["clip_low"] + stats["clip_high"] > 0


def test_mis_drops_tokens_from_the_sum_and_the_normaliser():
    # One sequence of 4 tokens and one of 2; alpha = pi_theta everywhere (rho = 1), A = 1.
    # rho' = 1, 1, 3, 1/3 | 3, 3 with is_mask = 2: tokens 3, 4 and the whole second sequence leave.
    log_rho_p = torch.log(torch.tensor([[1.0, 1.0, 3.0, 1 / 3], [3.0, 3.0, 1.0, 1.0]], dtype=torch.float64))
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    alpha_logp = torch.full((2, 4), -1.0, dtype=torch.float64)
    pi_k_logp = alpha_logp + log_rho_p
    adv = torch.ones(2, dtype=torch.float64)
    keep = mis_keep_mask(alpha_logp, pi_k_logp, 2.0)
    assert keep[mask > 0].tolist() == [True, True, False, False, False, False]
    for center in ("pi_k", "alpha", "decoupled"):
        # The kept tokens have rho' = 1 and rho = r = 1: each contributes o_t = A = 1.
        kw = dict(clip_center=center, is_mask=2.0, max_new_tokens=4)
        assert (
            corrected_loss(alpha_logp, alpha_logp, pi_k_logp, None, adv, mask, agg="token-mean", **kw)[0].item()
            == -2 / 2
        )
        # seq-mean: the second sequence has no kept token, so it leaves the count of sequences too.
        assert (
            corrected_loss(alpha_logp, alpha_logp, pi_k_logp, None, adv, mask, agg="seq-mean", **kw)[0].item() == -1.0
        )
        # constant: N * max_new_tokens does not count tokens, so only the sum changes.
        assert (
            corrected_loss(alpha_logp, alpha_logp, pi_k_logp, None, adv, mask, agg="constant", **kw)[0].item() == -2 / 8
        )
    stats = step_figures(alpha_logp, pi_k_logp, mask, is_mask=2.0)
    assert stats["is_masked_frac"] == 4 / 6 and "is_capped_frac" not in stats  # MIS alone: nothing capped
    # The loss's statistics count the kept tokens only: 2 of them.
    assert corrected_loss(alpha_logp, alpha_logp, pi_k_logp, None, adv, mask, is_mask=2.0)[1]["tokens"] == 2
    # Without is_mask every token counts.
    assert "is_masked_frac" not in step_figures(alpha_logp, pi_k_logp, mask)
    assert corrected_loss(alpha_logp, alpha_logp, pi_k_logp, None, adv, mask)[1]["tokens"] == 6


def test_tis_caps_the_weight_of_the_decoupled_objective():
    # r = 1 (pi_theta = pi_k): the gradient of each token is -w_t A / count, w = min(rho', C).
    rho_p = torch.tensor([[0.5, 1.5, 3.0, 8.0]], dtype=torch.float64)
    pi_k_logp = torch.full((1, 4), -1.0, dtype=torch.float64)
    alpha_logp = pi_k_logp - torch.log(rho_p)
    adv = torch.tensor([2.0], dtype=torch.float64)
    mask = torch.ones(1, 4)
    for cap, w in ((None, [0.5, 1.5, 3.0, 8.0]), (2.0, [0.5, 1.5, 2.0, 2.0])):
        x = pi_k_logp.clone().requires_grad_(True)
        loss, _ = corrected_loss(x, alpha_logp, pi_k_logp, None, adv, mask, clip_center="decoupled", is_cap=cap)
        loss.backward()
        torch.testing.assert_close(x.grad, -2.0 * torch.tensor([w], dtype=torch.float64) / 4)
        assert loss.item() == pytest.approx(-2.0 * sum(w) / 4)
        figures = step_figures(alpha_logp, pi_k_logp, mask, clip_center="decoupled", is_cap=cap)
        assert figures.get("is_capped_frac") == (None if cap is None else 0.5)  # no TIS: no figure
    # With MIS as well, a dropped token counts as dropped, not capped: rho' = 8 leaves (1 of 4 loss tokens),
    # rho' = 3 is capped (1 of the 3 tokens the loss keeps).
    stats = step_figures(alpha_logp, pi_k_logp, mask, clip_center="decoupled", is_cap=2.0, is_mask=4.0)
    assert stats["is_capped_frac"] == pytest.approx(1 / 3) and stats["is_masked_frac"] == 0.25
    x = pi_k_logp.clone().requires_grad_(True)
    loss, _ = corrected_loss(
        x, alpha_logp, pi_k_logp, None, adv, mask, clip_center="decoupled", is_cap=2.0, is_mask=4.0
    )
    loss.backward()
    torch.testing.assert_close(x.grad, -2.0 * torch.tensor([[0.5, 1.5, 2.0, 0.0]], dtype=torch.float64) / 3)


def test_decoupled_weight_is_a_constant_for_the_gradient():
    # log pi_k taken from the live forward without .detach() (train.update records logp.detach(); a caller may
    # not): the weight rho' must still carry no gradient, so passing x or x.detach() gives the same gradient.
    logp, alpha_logp, _, _, adv, mask = random_batch(5)
    grads = []
    for detach in (True, False):
        x = logp.clone().requires_grad_(True)
        cur = x.detach() if detach else x
        corrected_loss(x, alpha_logp, cur, None, adv, mask, clip_center="decoupled", is_cap=1.3)[0].backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)


def test_kl_estimators_hand_computed():
    # pi_theta = 1/2, pi_ref = 1/4: d = log pi_theta - log pi_ref = log 2.
    logp = torch.full((1, 2), math.log(0.5), dtype=torch.float64)
    ref = torch.full((1, 2), math.log(0.25), dtype=torch.float64)
    d = math.log(2.0)
    # value, and d value / d logp
    expected = {"k1": (d, 1.0), "k2": (0.5 * d * d, d), "k3": (0.5 - 1 + d, 1 - 0.5)}
    for est, (value, slope) in expected.items():
        assert kl_penalty(logp, ref, est)[0, 0].item() == pytest.approx(value, rel=1e-12)
        # A = 0: the loss is beta * mean(kl_t).
        x = logp.clone().requires_grad_(True)
        loss, stats = corrected_loss(
            x,
            x.detach(),
            x.detach(),
            ref,
            torch.zeros(1, dtype=torch.float64),
            torch.ones(1, 2),
            beta=0.1,
            kl_estimator=est,
        )
        loss.backward()
        assert loss.item() == pytest.approx(0.1 * value, rel=1e-12) and stats["kl"] == pytest.approx(value)
        torch.testing.assert_close(x.grad, torch.full((1, 2), 0.1 * slope / 2, dtype=torch.float64))
    # k3 is the default.
    assert corrected_loss(logp, logp, logp, ref, torch.zeros(1), torch.ones(1, 2), beta=0.1)[1]["kl"] == pytest.approx(
        expected["k3"][0]
    )
    with pytest.raises(ValueError, match="'k4'"):
        corrected_loss(logp, logp, logp, ref, torch.zeros(1), torch.ones(1, 2), beta=0.1, kl_estimator="k4")
    with pytest.raises(ValueError, match="'k4'"):
        kl_penalty(logp, ref, "k4")


def test_identity_current_centre_is_a_decoupled_objective():
    # [A]: min(rho A, clip(rho, rho' - eps_lo, rho' + eps_hi) A)
    #    = rho' min(r A, clip(r, 1 - eps_lo/rho', 1 + eps_hi/rho') A),  rho = r rho', token by token,
    # for values and gradients, including rho' <= eps_lo (where both lower bounds are vacuous).
    g = torch.Generator().manual_seed(2024)
    n = 200
    log_rho_p = torch.rand(n, generator=g, dtype=torch.float64) * 5 - 3  # rho' from e^-3 to e^2
    log_r = (torch.rand(n, generator=g, dtype=torch.float64) - 0.5) * 1.2  # r from e^-0.6 to e^0.6
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    alpha_logp = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    pi_k_logp, logp = alpha_logp + log_rho_p, alpha_logp + log_rho_p + log_r
    one = torch.ones(1, 1)
    clipped = 0
    for k in range(n):
        rho_p, a = math.exp(log_rho_p[k].item()), adv[k : k + 1]
        b, c = alpha_logp[k].view(1, 1), pi_k_logp[k].view(1, 1)
        # Left: [A]'s surrogate through policy_loss (one token: loss = -o_t).
        x = logp[k].view(1, 1).clone().requires_grad_(True)
        left, st = corrected_loss(x, b, c, None, a, one, clip_eps=EPS_LO, clip_eps_high=EPS_HI)
        left.backward()
        clipped += st["clip_low"] + st["clip_high"] > 0
        # Right, written out: rho' * min(r A, clip(r, 1 - eps_lo/rho', 1 + eps_hi/rho') A).
        y = logp[k].view(1, 1).clone().requires_grad_(True)
        r = torch.exp(y - c)
        right = -rho_p * torch.min(r * a, torch.clamp(r, 1 - EPS_LO / rho_p, 1 + EPS_HI / rho_p) * a).sum()
        right.backward()
        # Right again, through the shipped decoupled centre with the rescaled widths.
        z = logp[k].view(1, 1).clone().requires_grad_(True)
        dec, _ = corrected_loss(
            z, b, c, None, a, one, clip_center="decoupled", clip_eps=EPS_LO / rho_p, clip_eps_high=EPS_HI / rho_p
        )
        dec.backward()
        for other, grad in ((right, y.grad), (dec, z.grad)):
            assert left.item() == pytest.approx(other.item(), rel=1e-12, abs=1e-14), k
            assert x.grad.item() == pytest.approx(grad.item(), rel=1e-12, abs=1e-14), k
    assert 20 < clipped < n - 20  # both branches of min() are exercised
    assert (log_rho_p < math.log(EPS_LO)).sum() > 20  # and rho' <= eps_lo occurs


def _linear_policy(seed, n=6, t=5, v=7, dim=4):
    """A tiny softmax policy, logits = features @ W^T: returns W (V, D), W -> logp (N, T), A (N,), mask (N, T)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(v, dim, generator=g, dtype=torch.float64, requires_grad=True)  # (V, D)
    feats = torch.randn(n, t, dim, generator=g, dtype=torch.float64)  # (N, T, D)
    tokens = torch.randint(0, v, (n, t), generator=g)  # (N, T)
    adv = torch.randn(n, generator=g, dtype=torch.float64)  # (N,)
    mask = (torch.rand(n, t, generator=g) > 0.3).long()  # (N, T)

    def logp_of(weight):
        return torch.log_softmax(feats @ weight.T, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # (N, T)

    return w, logp_of, adv, mask


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean", "constant"])
def test_on_policy_every_correction_gives_the_reinforce_gradient(agg):
    # v = 1, one inner step: alpha = pi_k = pi_theta where the gradient is taken, so rho = rho' = r = 1:
    # no clip acts, no weight differs from 1, no mask drops a token, and every correction is group-baseline
    # REINFORCE.
    w, logp_of, adv, mask = _linear_policy(31)
    kw = dict(agg=agg, max_new_tokens=MAX_NEW)
    corrections = {
        "pi_k": lambda lp: corrected_loss(lp, lp.detach(), lp.detach(), None, adv, mask, **kw),
        "alpha": lambda lp: corrected_loss(lp, lp.detach(), lp.detach(), None, adv, mask, clip_center="alpha", **kw),
        "decoupled": lambda lp: corrected_loss(
            lp, lp.detach(), lp.detach(), None, adv, mask, clip_center="decoupled", **kw
        ),
        "decoupled+tis": lambda lp: corrected_loss(
            lp, lp.detach(), lp.detach(), None, adv, mask, clip_center="decoupled", is_cap=2.0, **kw
        ),
        "mis": lambda lp: corrected_loss(lp, lp.detach(), lp.detach(), None, adv, mask, is_mask=1.5, **kw),
        "m2po": lambda lp: corrected_loss(lp, lp.detach(), lp.detach(), None, adv, mask, m2_threshold=1e-6, **kw),
        "opsm": lambda lp: corrected_loss(lp, lp.detach(), lp.detach(), None, adv, mask, opsm_delta=0.0, **kw),
        "rec": lambda lp: rec_loss(
            LossInput(lp, lp.detach(), lp.detach(), None, adv, mask, aggregation_total(mask, agg, MAX_NEW)), agg=agg
        ),
        "rec unit": lambda lp: corrected_loss(lp, lp.detach(), lp.detach(), None, adv, mask, loss="rec", **kw),
    }
    # REINFORCE, - agg(A * logp), written out.
    lp = logp_of(w)
    total = aggregation_total(mask, agg, MAX_NEW)
    m = mask.to(lp.dtype)
    if agg == "seq-mean":
        reinforce = -((adv[:, None] * lp * m).sum(1) / m.sum(1).clamp(min=1)).sum() / total
    else:
        reinforce = -(adv[:, None] * lp * m).sum() / total
    (expected,) = torch.autograd.grad(reinforce, w)
    for name, fn in corrections.items():
        (grad,) = torch.autograd.grad(fn(logp_of(w))[0], w)
        torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-14, msg=name)
    assert expected.abs().max() > 1e-3


def test_one_stale_inner_step_current_equals_uncapped_decoupled():
    # v > 1, one inner step: r = 1 but rho' != 1. [A] and the uncapped decoupled form both give the
    # rho'-weighted REINFORCE gradient; TIS caps the weight, so it differs wherever rho' > C.
    w, logp_of, adv, mask = _linear_policy(47)
    g = torch.Generator().manual_seed(48)
    pi_k = logp_of(w).detach()  # (N, T)
    alpha = pi_k - torch.randn(pi_k.shape, generator=g, dtype=torch.float64)  # (N, T) rho' = e^N(0,1)

    def grad(**kw):
        return torch.autograd.grad(corrected_loss(logp_of(w), alpha, pi_k, None, adv, mask, **kw)[0], w)[0]

    torch.testing.assert_close(grad(clip_center="decoupled"), grad(clip_center="pi_k"), rtol=1e-12, atol=1e-14)
    assert (grad(clip_center="decoupled", is_cap=2.0) - grad(clip_center="pi_k")).abs().max() > 1e-3


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean", "constant"])
@pytest.mark.parametrize("center,is_cap", [("pi_k", None), ("alpha", None), ("decoupled", 1.2)])
def test_micro_batches_with_mis_add_up_to_the_whole_step(agg, center, is_cap):
    logp, alpha_logp, pi_k_logp, ref_logp, adv, mask = random_batch(71, n=8)
    kw = dict(clip_center=center, is_cap=is_cap, is_mask=1.5, beta=0.1, agg=agg, max_new_tokens=MAX_NEW)
    x = logp.clone().requires_grad_(True)
    whole, _ = corrected_loss(x, alpha_logp, pi_k_logp, ref_logp, adv, mask, **kw)
    whole.backward()
    # The caller folds MIS into the loss mask before taking the step's normaliser.
    keep = mis_keep_mask(alpha_logp, pi_k_logp, 1.5)
    for total, should_match in (
        (aggregation_total(mask * keep, agg, MAX_NEW), True),
        (aggregation_total(mask, agg, MAX_NEW), agg == "constant"),
    ):
        y = logp.clone().requires_grad_(True)
        parts = 0.0
        for s in range(0, 8, 3):
            rows = slice(s, s + 3)
            part, _ = corrected_loss(
                y[rows], alpha_logp[rows], pi_k_logp[rows], ref_logp[rows], adv[rows], mask[rows], total=total, **kw
            )
            part.backward()
            parts += part.item()
        if should_match:
            assert parts == pytest.approx(whole.item(), rel=1e-12)
            torch.testing.assert_close(y.grad, x.grad, rtol=1e-12, atol=1e-15)
        else:
            # The normaliser of all loss tokens is the wrong one: MIS really changes it here.
            assert parts != pytest.approx(whole.item(), rel=1e-6)


def test_staleness_stats_hand_computed():
    # rho' = 1, 2.5, 0.5, 4 on the loss tokens (a fifth, masked, token has rho' = 100).
    rho_p = torch.tensor([[1.0, 2.5, 0.5, 4.0, 100.0]], dtype=torch.float64)
    alpha_logp = torch.full((1, 5), -2.0, dtype=torch.float64)
    pi_k_logp = alpha_logp + torch.log(rho_p)
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    vals = [1.0, 2.5, 0.5, 4.0]
    st = step_figures(alpha_logp, pi_k_logp, mask, clip_center="decoupled", is_cap=2.0, is_mask=3.0)
    assert st["mismatch_kl_k1"] == pytest.approx(sum(-math.log(v) for v in vals) / 4)
    assert st["mismatch_kl_k3"] == pytest.approx(sum(v - 1 - math.log(v) for v in vals) / 4)
    assert st["rho_prime_mean"] == pytest.approx(2.0) and st["rho_prime_max"] == pytest.approx(4.0)
    # Sorted 0.5, 1, 2.5, 4: the median interpolates 1 and 2.5; p99 sits at 0.97 of the way from 2.5 to 4.
    assert st["rho_prime_p50"] == pytest.approx(1.75) and st["rho_prime_p99"] == pytest.approx(2.5 + 0.97 * 1.5)
    assert st["m2"] == pytest.approx(sum(math.log(v) ** 2 for v in vals) / 4)  # M2PO's second moment
    # MIS drops rho' = 4 (outside [1/3, 3]: 1 of 4 loss tokens); TIS caps rho' = 2.5 (1 of the 3 kept tokens: the
    # dropped 4 is not counted as capped).
    assert st["is_masked_frac"] == 0.25 and st["is_capped_frac"] == pytest.approx(1 / 3)
    # policy_loss does not compute them (a step does, once): its statistics are pi_theta's.
    _, ps = corrected_loss(
        pi_k_logp, alpha_logp, pi_k_logp, None, torch.ones(1), mask, clip_center="decoupled", is_cap=2.0, is_mask=3.0
    )
    assert set(ps) == {"clip_low", "clip_high", "kl", "rho_mean", "tokens"}
    # Without a cap or a mask there are no fractions; a refreshed sampler (pi_k = alpha) shows no mismatch.
    st = step_figures(alpha_logp, pi_k_logp, mask)
    assert "is_masked_frac" not in st and "is_capped_frac" not in st and st == drift_stats(alpha_logp, pi_k_logp, mask)
    st = step_figures(alpha_logp, alpha_logp, mask, clip_center="decoupled", is_cap=2.0, is_mask=3.0)
    assert st["mismatch_kl_k1"] == 0.0 and st["mismatch_kl_k3"] == 0.0 and st["rho_prime_p99"] == 1.0
    assert st["m2"] == 0.0 and st["is_masked_frac"] == 0.0 and st["is_capped_frac"] == 0.0


def test_invalid_arguments_raise():
    logp, alpha_logp, pi_k_logp, _, adv, mask = random_batch(3)
    for center in ("pi_k", "alpha"):  # TIS is the decoupled objective's weight: the flags say so or are refused
        with pytest.raises(ConfigError, match="--is-cap needs --loss grpo --clip-center decoupled"):
            validate(resolve(Config(clip_center=center, is_cap=2.0, out="/tmp/unused")))
    with pytest.raises(ValueError, match="is_cap must be >= 1"):
        corrected_loss(logp, alpha_logp, pi_k_logp, None, adv, mask, clip_center="decoupled", is_cap=0.0)
    with pytest.raises(ValueError, match="is_mask must be >= 1"):
        corrected_loss(logp, alpha_logp, pi_k_logp, None, adv, mask, is_mask=0.5)
    with pytest.raises(ValueError, match="'centre'"):
        corrected_loss(logp, alpha_logp, pi_k_logp, None, adv, mask, clip_center="centre")
