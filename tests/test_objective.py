"""advantage.py, objective.py and reinforce.py against hand-computed cases and plain Python loops."""

import math
import zlib

import pytest
import torch

from advantage import group_advantages, red_drop, red_weight
from objective import aggregation_total, policy_loss, surrogate
from variants.corrections import correction_args
from variants.reinforce import opmd_loss, opmd_per_token, rec_loss, rec_per_token

# --------------------------------------------------------------------------- advantages


def test_group_advantages_hand_computed():
    # Group 0: rewards 1,0,0,1 -> mu 0.5, population var 0.25, sigma 0.5 -> A = +-1 (up to eps).
    # Group 1: all equal -> zero advantages, invalid.  Group 2: 1,0,0,0 -> mu .25, var .1875.
    r = torch.tensor([1.0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0])
    adv, valid = group_advantages(r, 4, guard=0.0)
    s2 = math.sqrt(0.1875)
    expected = [1, -1, -1, 1, 0, 0, 0, 0, 0.75 / s2, -0.25 / s2, -0.25 / s2, -0.25 / s2]
    assert torch.allclose(adv, torch.tensor(expected), atol=1e-6)
    assert valid.tolist() == [True] * 4 + [False] * 4 + [True] * 4


def test_group_advantages_eps_and_no_mask():
    r = torch.tensor([1.0, 0.0, 0.5, 0.5])
    adv, valid = group_advantages(r, 2, guard=1e-2, mask_zero_std=False)
    assert torch.allclose(adv[:2], torch.tensor([0.5, -0.5]) / math.sqrt(0.25 + 1e-2))
    assert adv[2:].tolist() == [0.0, 0.0] and valid.all()  # all-equal group: kept, zero advantage


def test_asymre_and_red():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0])
    adv, _ = group_advantages(r, 4, scale_std=False, baseline_shift=0.1)
    assert torch.allclose(adv, torch.tensor([1 - 0.15, -0.15, -0.15, -0.15]))  # baseline .25 - .1
    keep = red_drop(r, 4, torch.Generator().manual_seed(0))
    assert keep[0] and keep.sum() == 2  # one positive: keep it and exactly one negative
    adv, valid = group_advantages(r, 4, guard=0.0, keep=keep)
    assert torch.allclose(adv[keep], torch.tensor([1.0, -1.0])) and (adv[~keep] == 0).all() and (valid == keep).all()
    a = torch.tensor([-1.0, 0.0, 2.0])
    assert torch.allclose(red_weight(a, 2.0), a * torch.exp(a / 2.0))


# --------------------------------------------------------------------------- policy_loss vs a loop


def loop_policy_loss(logp, alpha_logp, pi_k_logp, ref_logp, adv, mask, eps_lo, eps_hi, center, beta, agg, max_new):
    """The objective written token by token in plain Python floats (the spec: policy_loss's docstring)."""
    n, t = len(logp), len(logp[0])
    seq_terms, all_terms = [], []
    for i in range(n):
        terms = []
        for j in range(t):
            if not mask[i][j]:
                continue
            rho = math.exp(logp[i][j] - alpha_logp[i][j])
            rho_p = 1.0 if pi_k_logp is None else math.exp(pi_k_logp[i][j] - alpha_logp[i][j])
            lo, hi = (max(rho_p - eps_lo, 0.0), rho_p + eps_hi) if center == "pi_k" else (1 - eps_lo, 1 + eps_hi)
            s = min(rho * adv[i], min(max(rho, lo), hi) * adv[i])
            if ref_logp is not None:
                d = ref_logp[i][j] - logp[i][j]
                s -= beta * (math.exp(d) - d - 1)
            terms.append(s)
        all_terms += terms
        if terms:
            seq_terms.append(sum(terms) / len(terms))
    if agg == "token-mean":
        return -sum(all_terms) / max(len(all_terms), 1)
    if agg == "seq-mean":
        return -sum(seq_terms) / max(len(seq_terms), 1)
    return -sum(all_terms) / (n * max_new)


def random_batch(seed, n=6, t=5, spread=0.4):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(n, t, generator=g, dtype=torch.float64) * 2
    alpha_logp = logp + (torch.rand(n, t, generator=g, dtype=torch.float64) - 0.5) * 2 * spread
    pi_k_logp = logp + (torch.rand(n, t, generator=g, dtype=torch.float64) - 0.5) * 2 * spread
    ref_logp = logp + (torch.rand(n, t, generator=g, dtype=torch.float64) - 0.5)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = (torch.rand(n, t, generator=g) > 0.3).long()
    mask[0] = 0  # one fully masked sequence (an invalid group's member)
    return logp, alpha_logp, pi_k_logp, ref_logp, adv, mask


@pytest.mark.parametrize("center", ["pi_k", "alpha"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean", "constant"])
@pytest.mark.parametrize("stale,beta", [(True, 0.0), (True, 0.1), (False, 0.05)])
def test_policy_loss_matches_loop_value_and_gradient(center, agg, stale, beta):
    # A fixed seed per case (hash() of a str is randomised per process, so a failure would not reproduce).
    logp, alpha_logp, pi_k_logp, ref_logp, adv, mask = random_batch(
        seed=zlib.crc32(f"{center}-{agg}-{stale}".encode()) % 1000
    )
    pi_k_logp = pi_k_logp if stale else alpha_logp  # not stale: a refresh step, pi_k = alpha
    ref_logp = ref_logp if beta > 0 else None
    kw = dict(clip_eps=0.2, clip_eps_high=0.28, clip_center=center, beta=beta, agg=agg, max_new_tokens=7)
    x = logp.clone().requires_grad_(True)
    loss, stats = policy_loss(x, alpha_logp, pi_k_logp, ref_logp, adv, mask, **kw)
    loss.backward()

    L = lambda lp: loop_policy_loss(
        lp,
        alpha_logp.tolist(),
        pi_k_logp.tolist(),
        None if ref_logp is None else ref_logp.tolist(),
        adv.tolist(),
        mask.tolist(),
        0.2,
        0.28,
        center,
        beta,
        agg,
        7,
    )
    assert loss.item() == pytest.approx(L(logp.tolist()), rel=1e-10, abs=1e-12)
    # Gradient of the loop by central finite differences, token by token.
    h = 1e-6
    for i in range(logp.shape[0]):
        for j in range(logp.shape[1]):
            up, dn = logp.tolist(), logp.tolist()
            up[i][j] += h
            dn[i][j] -= h
            fd = (L(up) - L(dn)) / (2 * h)
            assert x.grad[i, j].item() == pytest.approx(fd, abs=1e-6), (i, j)
    # The clip fractions, counted token by token: a token is clipped when its ratio has left the interval
    # on the side its advantage pushes it towards (the min() then takes the flat branch).
    low = high = valid = 0
    for i in range(logp.shape[0]):
        for j in range(logp.shape[1]):
            if mask[i, j]:
                rho = math.exp(logp[i, j].item() - alpha_logp[i, j].item())
                rho_p = 1.0 if pi_k_logp is None else math.exp(pi_k_logp[i, j].item() - alpha_logp[i, j].item())
                lo, hi = (max(rho_p - 0.2, 0.0), rho_p + 0.28) if center == "pi_k" else (0.8, 1.28)
                valid += 1
                low += int(rho < lo and adv[i].item() < 0)
                high += int(rho > hi and adv[i].item() > 0)
    assert (stats["clip_low"], stats["clip_high"]) == pytest.approx((low / valid, high / valid), abs=1e-12)


def test_clipped_tokens_get_zero_gradient_on_the_pushed_side():
    # One token per case; the alpha centre [0.8, 1.2].
    ratios = torch.tensor([1.5, 1.5, 0.5, 0.5, 1.0], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0], dtype=torch.float64)
    logp = torch.log(ratios).unsqueeze(1).requires_grad_(True)  # log alpha = log pi_k = 0
    loss, stats = policy_loss(
        logp,
        torch.zeros(5, 1, dtype=torch.float64),
        torch.zeros(5, 1, dtype=torch.float64),
        None,
        adv,
        torch.ones(5, 1),
        clip_center="alpha",
        agg="constant",
        max_new_tokens=1,
    )
    loss.backward()
    g = logp.grad.squeeze(1)
    assert g[0] == 0  # A > 0 and rho above 1+eps: more probability would not pay, no gradient
    assert g[2] == 0  # A < 0 and rho below 1-eps: already pushed down enough, no gradient
    assert g[1] != 0 and g[3] != 0 and g[4] != 0  # pulled back towards the interval / inside it
    assert stats["clip_high"] == pytest.approx(0.2) and stats["clip_low"] == pytest.approx(0.2)


def test_current_centre_follows_rho_prime():
    # A stale sampler: rho' = 2 (pi_k twice as likely as alpha), so the current-centre interval is
    # [1.8, 2.2]: rho = 2.0 (no update yet) keeps its gradient, rho = 2.3 is clipped for A > 0.
    # Under the alpha centre [0.8, 1.2] the token is clipped already at rho = rho' = 2.
    alpha_logp = torch.zeros(1, 1, dtype=torch.float64)
    pi_k_logp = torch.full((1, 1), math.log(2.0), dtype=torch.float64)
    for r, clipped_current in ((2.0, False), (2.3, True)):
        x = torch.full((1, 1), math.log(r), dtype=torch.float64, requires_grad=True)
        policy_loss(x, alpha_logp, pi_k_logp, None, torch.ones(1, dtype=torch.float64), torch.ones(1, 1))[0].backward()
        assert (x.grad.item() == 0) == clipped_current
    x = torch.full((1, 1), math.log(2.0), dtype=torch.float64, requires_grad=True)
    policy_loss(
        x, alpha_logp, pi_k_logp, None, torch.ones(1, dtype=torch.float64), torch.ones(1, 1), clip_center="alpha"
    )[0].backward()
    assert x.grad.item() == 0


def test_one_inner_step_current_centre_is_rho_prime_weighted_reinforce():
    # With --inner-steps 1 the gradient is taken at pi_theta = pi_k, so rho = rho' on every token:
    # the current-centred interval [rho' - eps, rho' + eps] always holds rho and nothing is clipped,
    # however stale alpha is (spread 1.5: rho' from e^-1.5 to e^1.5). The step is then
    #     grad = - (1/|tokens|) sum_t rho'_t A_i grad log pi(y_t),
    # importance-weighted REINFORCE. The alpha centre does clip these tokens.
    _, alpha_logp, pi_k_logp, _, adv, mask = random_batch(seed=7, n=8, t=6, spread=1.5)
    logp = pi_k_logp.clone().requires_grad_(True)
    loss, stats = policy_loss(logp, alpha_logp, pi_k_logp, None, adv, mask, clip_center="pi_k")
    loss.backward()
    rho_prime = torch.exp(pi_k_logp - alpha_logp)
    expected = -rho_prime * adv[:, None] * mask / mask.sum()  # d loss / d logp, token by token
    torch.testing.assert_close(logp.grad, expected)
    assert stats["clip_low"] == 0 and stats["clip_high"] == 0
    _, stats_b = policy_loss(pi_k_logp, alpha_logp, pi_k_logp, None, adv, mask, clip_center="alpha")
    assert stats_b["clip_low"] + stats_b["clip_high"] > 0.2


def test_micro_batch_totals_add_up():
    logp, alpha_logp, pi_k_logp, ref_logp, adv, mask = random_batch(3, n=8)
    for agg in ("token-mean", "seq-mean", "constant"):
        whole, _ = policy_loss(logp, alpha_logp, pi_k_logp, ref_logp, adv, mask, beta=0.1, agg=agg, max_new_tokens=5)
        total = aggregation_total(mask, agg, 5)
        parts = sum(
            policy_loss(
                logp[s : s + 2],
                alpha_logp[s : s + 2],
                pi_k_logp[s : s + 2],
                ref_logp[s : s + 2],
                adv[s : s + 2],
                mask[s : s + 2],
                beta=0.1,
                agg=agg,
                max_new_tokens=5,
                total=total,
            )[0]
            for s in range(0, 8, 2)
        )
        assert parts.item() == pytest.approx(whole.item(), rel=1e-12)


# --------------------------------------------------------------------------- the losses of [B]


@pytest.mark.parametrize("iw", [False, True])
def test_rec_loss_matches_loop(iw):
    logp, alpha_logp, _, _, adv, mask = random_batch(7, spread=0.5)
    x = logp.clone().requires_grad_(True)
    loss, _ = rec_loss(x, alpha_logp, adv, mask, clip_eps=0.2, clip_eps_high=0.3, importance_weight=iw)
    loss.backward()
    value, grad, count = 0.0, torch.zeros_like(logp), mask.sum().item()
    for i in range(logp.shape[0]):
        for j in range(logp.shape[1]):
            if not mask[i, j]:
                continue
            rho = math.exp(logp[i, j].item() - alpha_logp[i, j].item())
            a = adv[i].item()
            m = (a > 0 and rho <= 1.3) or (a < 0 and rho >= 0.8)
            w = rho if iw else 1.0
            value -= a * w * logp[i, j].item() * m / count
            grad[i, j] = -a * w * m / count
    assert loss.item() == pytest.approx(value, rel=1e-10)
    assert torch.allclose(x.grad, grad, atol=1e-12)


def test_opmd_loss_matches_loop():
    logp, alpha_logp, _, _, adv, mask = random_batch(11)
    x = logp.clone().requires_grad_(True)
    loss, _ = opmd_loss(x, alpha_logp, adv, mask, tau_reg=0.3, agg="seq-mean")
    loss.backward()
    seqs, grad = [], torch.zeros_like(logp)
    n_seq = sum(1 for i in range(len(mask)) if mask[i].sum() > 0)
    for i in range(logp.shape[0]):
        k = mask[i].sum().item()
        if k == 0:
            continue
        terms = []
        for j in range(logp.shape[1]):
            if mask[i, j]:
                d = logp[i, j].item() - alpha_logp[i, j].item()
                terms.append(-adv[i].item() * logp[i, j].item() + 0.15 * d * d)
                grad[i, j] = (-adv[i].item() + 0.3 * d) / k / n_seq
        seqs.append(sum(terms) / k)
    assert loss.item() == pytest.approx(sum(seqs) / n_seq, rel=1e-10)
    assert torch.allclose(x.grad, grad, atol=1e-12)


# --------------------------------------------------------------------------- per-token terms


@pytest.mark.parametrize("center", ["pi_k", "alpha", "decoupled"])
def test_per_token_terms_take_per_sequence_or_per_token_advantages(center):
    # verl_grpo.py passes A already broadcast over the response, (N, T); the losses pass (N,). Same terms.
    logp, alpha_logp, pi_k_logp, _, adv, _ = random_batch(1, n=8, t=6, spread=0.5)
    adv_tok = adv.unsqueeze(1).expand_as(logp)  # (N, T)
    extra = correction_args(alpha_logp, pi_k_logp, None, clip_center=center, is_mask=2.0)  # MIS's keep
    kw = dict(clip_eps=0.2, clip_eps_high=0.28, clip_center=center, **extra)
    per_seq = surrogate(logp, alpha_logp, pi_k_logp, adv, **kw)
    per_tok = surrogate(logp, alpha_logp, pi_k_logp, adv_tok, **kw)
    for a, b in zip(per_seq, per_tok, strict=True):
        assert a.shape == logp.shape and torch.equal(a, b)
    # The batch has clipped tokens on both sides and MIS-dropped ones, so the masks are not trivially equal.
    _, _, clip_low, clip_high = per_seq
    assert clip_low.any() and clip_high.any() and not extra["keep"].all()
    for a, b in zip(
        rec_per_token(logp, alpha_logp, adv, importance_weight=True),
        rec_per_token(logp, alpha_logp, adv_tok, importance_weight=True),
        strict=True,
    ):
        assert a.shape == logp.shape and torch.equal(a, b)
    for a, b in zip(
        opmd_per_token(logp, alpha_logp, adv, tau_reg=0.3),
        opmd_per_token(logp, alpha_logp, adv_tok, tau_reg=0.3),
        strict=True,
    ):
        assert a.shape == logp.shape and torch.equal(a, b)


@pytest.mark.parametrize("center", ["pi_k", "alpha", "decoupled"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean", "constant"])
def test_neutral_weight_and_keep_are_the_plain_loss_bit_for_bit(center, agg):
    # The training step always passes **correction_args(...): without TIS or MIS it passes nothing, and a keep that
    # keeps every token (and, for the decoupled centre, an explicit weight w = rho') must be the plain loss exactly,
    # in value, gradient and statistics: the corrections add operations only where they act.
    logp, alpha_logp, pi_k_logp, ref_logp, adv, mask = random_batch(seed=11)
    assert correction_args(alpha_logp, pi_k_logp, mask, clip_center=center) == {"weight": None, "keep": None}
    alpha_logp[mask == 0] -= 1000.0  # rho' = inf on padding: an explicit weight must not turn it into nan
    kw = dict(clip_eps=0.2, clip_eps_high=0.28, clip_center=center, beta=0.1, agg=agg, max_new_tokens=7)
    neutral = [{}, {"keep": torch.ones_like(mask, dtype=torch.bool)}]
    if center == "decoupled":
        neutral.append({"weight": torch.exp(pi_k_logp - alpha_logp)})
    results = []
    for extra in neutral:
        x = logp.clone().requires_grad_(True)
        loss, stats = policy_loss(x, alpha_logp, pi_k_logp, ref_logp, adv, mask, **kw, **extra)
        loss.backward()
        results.append((loss.detach(), x.grad, stats))
    loss_a, grad_a, stats_a = results[0]
    assert torch.isfinite(grad_a).all() and stats_a["clip_low"] + stats_a["clip_high"] > 0  # the clip acts here
    for loss_b, grad_b, stats_b in results[1:]:
        assert torch.equal(loss_a, loss_b) and torch.equal(grad_a, grad_b) and stats_a == stats_b


@pytest.mark.parametrize("center", ["pi_k", "alpha"])
def test_a_weight_needs_the_decoupled_centre(center):
    logp, alpha_logp, pi_k_logp, _, adv, mask = random_batch(seed=12)
    with pytest.raises(ValueError, match="weight"):
        policy_loss(logp, alpha_logp, pi_k_logp, None, adv, mask, clip_center=center, weight=torch.ones_like(logp))


def test_the_rho_weighted_kl_estimates_kl_to_the_reference_under_alphas_samples():
    """One KL (--kl-importance-weight): tokens drawn from a stale alpha, the per-token k3 and k1 weighted by
    rho = pi_theta / alpha average to KL(pi_theta || pi_ref), computed exactly over the vocabulary; unweighted they
    average to E_alpha[k], another number. 400k samples: the standard error is about 1e-3."""
    g = torch.Generator().manual_seed(0)
    logits = {name: torch.randn(6, generator=g, dtype=torch.float64) for name in ("theta", "ref", "alpha")}
    log = {name: torch.log_softmax(z, dim=0) for name, z in logits.items()}
    exact = (log["theta"].exp() * (log["theta"] - log["ref"])).sum().item()  # KL(pi_theta || pi_ref)
    y = torch.multinomial(log["alpha"].exp(), 400_000, replacement=True, generator=g)[None]  # (1, T) from alpha
    logp, alpha_logp, ref_logp = log["theta"][y], log["alpha"][y], log["ref"][y]  # (1, T) each
    ones = torch.ones_like(logp)
    for estimator in ("k1", "k3"):
        means = {}
        for weighted in (False, True):
            kl = dict(beta=1.0, kl_estimator=estimator, kl_importance_weight=weighted)
            _, st = policy_loss(logp, alpha_logp, logp, ref_logp, torch.zeros(1), ones, **kl)
            means[weighted] = st["kl"]
        assert abs(means[True] - exact) < 0.01, (estimator, means, exact)
        assert abs(means[False] - exact) > 0.1, (estimator, means, exact)
