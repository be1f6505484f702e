"""advantage.py, objective.py, variants/shaping.py and variants/reinforce.py against hand-computed cases and plain
Python loops; the units through variants.recipe(Config(...)), as a run builds them."""

import math
import zlib

import pytest
import torch

import variants
from advantage import group_advantages
from config import Config
from objective import LossInput, aggregation_total, policy_loss, surrogate
from variants.corrections import Decoupled, mis_keep_mask
from variants.reinforce import opmd_loss, opmd_per_token, rec_loss, rec_per_token
from variants.shaping import REDWeight, red_drop


def li(logp, alpha_logp, pi_k_logp, ref_logp, adv, mask, total=None):
    """The LossInput of these tensors (total None: the batch's own normaliser)."""
    return LossInput(logp, alpha_logp, pi_k_logp, ref_logp, adv, mask, total)


# --------------------------------------------------------------------------- advantages


def test_group_advantages_hand_computed():
    # Group 0: rewards 1,0,0,1 -> mu 0.5, population var 0.25, sigma 0.5 -> A = +-1 (up to the guard).
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
    gen = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    r = torch.tensor([1.0, 0.0, 0.0, 0.0])
    # AsymRE (--asymre-shift): the baseline mean(r) - shift, not divided by the std; an all-equal group stays 0.
    asymre = variants.recipe(Config(group_size=4, asymre_shift=0.1))
    assert asymre.names == ["asymre"]
    adv, valid = asymre.advantages(torch.cat([r, torch.ones(4)]), gen())
    assert torch.allclose(adv[:4], torch.tensor([1 - 0.15, -0.15, -0.15, -0.15]))  # baseline .25 - .1
    assert adv[4:].tolist() == [0.0] * 4 and valid.tolist() == [True] * 4 + [False] * 4
    # OPMD's advantages: r - mean(r), not divided by the std.
    adv, _ = variants.recipe(Config(group_size=4, loss="opmd")).advantages(r, gen())
    assert torch.allclose(adv, torch.tensor([0.75, -0.25, -0.25, -0.25]))
    keep = red_drop(r, 4, gen())
    assert keep[0] and keep.sum() == 2  # one positive: keep it and exactly one negative
    adv, valid = group_advantages(r, 4, guard=0.0, keep=keep)
    assert torch.allclose(adv[keep], torch.tensor([1.0, -1.0])) and (adv[~keep] == 0).all() and (valid == keep).all()
    # RED-Drop (--red drop) through the recipe: the same draw, the same advantages (the guard 1e-6 there).
    adv_r, valid_r = variants.recipe(Config(group_size=4, red="drop")).advantages(r, gen())
    assert torch.equal(valid_r, keep) and torch.allclose(adv_r[keep], torch.tensor([1.0, -1.0]), atol=1e-5)
    assert (adv_r[~keep] == 0).all()
    # RED-Weight (--red weight): A <- A exp(A / red_tau) (RED-Weight's scale), the unit alone and through the recipe.
    a = torch.tensor([-1.0, 0.0, 2.0])
    weighted, _ = REDWeight(2.0).advantages(a, None, inner=lambda rewards: (rewards, torch.ones(3, dtype=torch.bool)))
    assert torch.allclose(weighted, a * torch.exp(a / 2.0))
    plain, _ = group_advantages(r, 4)
    adv, _ = variants.recipe(Config(group_size=4, red="weight", red_tau=2.0)).advantages(r, gen())
    assert torch.allclose(adv, plain * torch.exp(plain / 2.0)) and not torch.allclose(adv, plain)


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
    kw = dict(clip_eps=0.2, clip_eps_high=0.28, clip_center=center, beta=beta, agg=agg)
    x = logp.clone().requires_grad_(True)
    total = aggregation_total(mask, agg, 7)  # "constant": N * max_new_tokens; the others the batch's own count
    loss, stats = policy_loss(li(x, alpha_logp, pi_k_logp, ref_logp, adv, mask, total), **kw)
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
    low = high = counted = 0
    for i in range(logp.shape[0]):
        for j in range(logp.shape[1]):
            if mask[i, j]:
                rho = math.exp(logp[i, j].item() - alpha_logp[i, j].item())
                rho_p = 1.0 if pi_k_logp is None else math.exp(pi_k_logp[i, j].item() - alpha_logp[i, j].item())
                lo, hi = (max(rho_p - 0.2, 0.0), rho_p + 0.28) if center == "pi_k" else (0.8, 1.28)
                counted += 1
                low += int(rho < lo and adv[i].item() < 0)
                high += int(rho > hi and adv[i].item() > 0)
    assert (stats["clip_low"], stats["clip_high"]) == pytest.approx((low / counted, high / counted), abs=1e-12)


def test_clipped_tokens_get_zero_gradient_on_the_pushed_side():
    # One token per case; the alpha centre [0.8, 1.2].
    ratios = torch.tensor([1.5, 1.5, 0.5, 0.5, 1.0], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0], dtype=torch.float64)
    logp = torch.log(ratios).unsqueeze(1).requires_grad_(True)  # log alpha = log pi_k = 0
    zeros = torch.zeros(5, 1, dtype=torch.float64)
    loss, stats = policy_loss(
        li(logp, zeros, zeros, None, adv, torch.ones(5, 1), total=aggregation_total(torch.ones(5, 1), "constant", 1)),
        clip_center="alpha",
        agg="constant",
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
        one = torch.ones(1, dtype=torch.float64)
        policy_loss(li(x, alpha_logp, pi_k_logp, None, one, torch.ones(1, 1)))[0].backward()
        assert (x.grad.item() == 0) == clipped_current
    x = torch.full((1, 1), math.log(2.0), dtype=torch.float64, requires_grad=True)
    policy_loss(
        li(x, alpha_logp, pi_k_logp, None, torch.ones(1, dtype=torch.float64), torch.ones(1, 1)), clip_center="alpha"
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
    loss, stats = policy_loss(li(logp, alpha_logp, pi_k_logp, None, adv, mask), clip_center="pi_k")
    loss.backward()
    rho_prime = torch.exp(pi_k_logp - alpha_logp)
    expected = -rho_prime * adv[:, None] * mask / mask.sum()  # d loss / d logp, token by token
    torch.testing.assert_close(logp.grad, expected)
    assert stats["clip_low"] == 0 and stats["clip_high"] == 0
    _, stats_b = policy_loss(li(pi_k_logp, alpha_logp, pi_k_logp, None, adv, mask), clip_center="alpha")
    assert stats_b["clip_low"] + stats_b["clip_high"] > 0.2


def test_micro_batch_totals_add_up():
    logp, alpha_logp, pi_k_logp, ref_logp, adv, mask = random_batch(3, n=8)
    for agg in ("token-mean", "seq-mean", "constant"):
        total = aggregation_total(mask, agg, 5)
        whole, _ = policy_loss(li(logp, alpha_logp, pi_k_logp, ref_logp, adv, mask, total), beta=0.1, agg=agg)
        if agg != "constant":  # the batch's own normaliser, when it can count it, is the whole step's
            own, _ = policy_loss(li(logp, alpha_logp, pi_k_logp, ref_logp, adv, mask), beta=0.1, agg=agg)
            assert own.item() == whole.item()
        parts = sum(
            policy_loss(
                li(*(v[s : s + 2] for v in (logp, alpha_logp, pi_k_logp, ref_logp, adv, mask)), total=total),
                beta=0.1,
                agg=agg,
            )[0]
            for s in range(0, 8, 2)
        )
        assert parts.item() == pytest.approx(whole.item(), rel=1e-12)
    with pytest.raises(ValueError, match="max_new_tokens"):  # "constant" cannot count its own normaliser
        policy_loss(li(logp, alpha_logp, pi_k_logp, ref_logp, adv, mask), agg="constant")


# --------------------------------------------------------------------------- the losses of [B]


@pytest.mark.parametrize("iw", [False, True])
def test_rec_loss_matches_loop(iw):
    logp, alpha_logp, _, _, adv, mask = random_batch(7, spread=0.5)
    x = logp.clone().requires_grad_(True)
    loss, _ = rec_loss(li(x, alpha_logp, None, None, adv, mask), clip_eps=0.2, clip_eps_high=0.3, importance_weight=iw)
    loss.backward()
    # The unit --loss rec / rec-is: the same loss in place of the surrogate (pi_k, the ref and beta unused).
    recipe = variants.recipe(Config(loss="rec-is" if iw else "rec", clip_eps=0.2, clip_eps_high=0.3, beta=0.5))
    y = logp.clone().requires_grad_(True)
    unit, _ = recipe.loss(li(y, alpha_logp, alpha_logp - 1.0, logp + 1.0, adv, mask))
    unit.backward()
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
    assert loss.item() == pytest.approx(value, rel=1e-10) and unit.item() == pytest.approx(value, rel=1e-10)
    assert torch.allclose(x.grad, grad, atol=1e-12) and torch.allclose(y.grad, grad, atol=1e-12)


def test_opmd_loss_matches_loop():
    logp, alpha_logp, _, _, adv, mask = random_batch(11)
    x = logp.clone().requires_grad_(True)
    loss, _ = opmd_loss(li(x, alpha_logp, None, None, adv, mask), tau_reg=0.3, agg="seq-mean")
    loss.backward()
    # The unit --loss opmd, through the recipe (its KL and clip settings unused).
    y = logp.clone().requires_grad_(True)
    recipe = variants.recipe(Config(loss="opmd", tau_reg=0.3, agg="seq-mean", beta=0.5))
    unit, _ = recipe.loss(li(y, alpha_logp, alpha_logp - 1.0, logp + 1.0, adv, mask))
    unit.backward()
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
    assert unit.item() == pytest.approx(sum(seqs) / n_seq, rel=1e-10)
    assert torch.allclose(x.grad, grad, atol=1e-12) and torch.allclose(y.grad, grad, atol=1e-12)


# --------------------------------------------------------------------------- per-token terms


def terms(x: LossInput, clip_center: str, **kw):
    """`surrogate` of x, as the loss sees it: for clip_center="decoupled" on the Decoupled unit's input (alpha <-
    pi_k, A <- rho' A) and with its centre ("alpha": 1 +- eps)."""
    if clip_center == "decoupled":
        seen = {}
        Decoupled().loss(x, inner=lambda y, **settings: seen.update(x=y, **settings) or (None, {}), clip_center="pi_k")
        x, clip_center = seen["x"], seen["clip_center"]
    return surrogate(x, clip_center=clip_center, **kw)


@pytest.mark.parametrize("center", ["pi_k", "alpha", "decoupled"])
def test_per_token_terms_take_per_sequence_or_per_token_advantages(center):
    # verl_grpo.py passes A already broadcast over the response, (N, T); the losses pass (N,). Same terms.
    logp, alpha_logp, pi_k_logp, _, adv, _ = random_batch(1, n=8, t=6, spread=0.5)
    adv_tok = adv.unsqueeze(1).expand_as(logp)  # (N, T)
    keep = mis_keep_mask(alpha_logp, pi_k_logp, 2.0)  # MIS's keep: the tokens that stay in the loss mask
    kw = dict(clip_eps=0.2, clip_eps_high=0.28)
    # Every token in the loss (as the old surrogate saw a batch without a mask): the terms are equal everywhere.
    everyone = torch.ones_like(logp)
    per_seq = terms(li(logp, alpha_logp, pi_k_logp, None, adv, everyone), center, **kw)
    per_tok = terms(li(logp, alpha_logp, pi_k_logp, None, adv_tok, everyone), center, **kw)
    for a, b in zip(per_seq, per_tok, strict=True):
        assert a.shape == logp.shape and torch.equal(a, b)
    _, _, clip_low, clip_high = per_seq
    assert clip_low.any() and clip_high.any()  # clipped tokens on both sides: the masks are not trivially equal
    # MIS's kept tokens as the loss mask: the terms are equal on the mask, the ratio and the clip masks everywhere
    # (a per-token A is 0 off the mask, a per-sequence one is not, and aggregate() never reads the objective there).
    on = keep.to(logp.dtype)
    per_seq = terms(li(logp, alpha_logp, pi_k_logp, None, adv, on), center, **kw)
    per_tok = terms(li(logp, alpha_logp, pi_k_logp, None, adv_tok, on), center, **kw)
    assert not keep.all() and keep.any()
    assert torch.equal(per_seq.objective[keep], per_tok.objective[keep])
    for a, b in zip(per_seq[1:], per_tok[1:], strict=True):
        assert a.shape == logp.shape and torch.equal(a, b)
    assert not (per_seq.clip_low | per_seq.clip_high)[~keep].any()  # a dropped token is never counted as clipped
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


# Flags of units that act nowhere on random_batch: MIS and M2PO keep every token, OPSM every sequence, TIS caps no
# weight (C = inf).
NEUTRAL = {
    "mis": dict(is_mask=1e300),
    "m2po": dict(m2_threshold=1e300),
    "opsm": dict(opsm_delta=1e300),
    "mis-sequence": dict(is_mask=math.inf, is_level="sequence"),
}


@pytest.mark.parametrize("center", ["pi_k", "alpha", "decoupled"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean", "constant"])
def test_neutral_units_are_the_plain_loss_bit_for_bit(center, agg):
    # A unit that acts on no token (a band, threshold or cap beyond every ratio) must be the plain loss exactly, in
    # value, gradient and statistics: the units add operations only where they act. The plain recipe of the pi_k
    # and alpha centres is objective.policy_loss itself, and the decoupled centre's TIS with an infinite cap is the
    # uncapped Decoupled unit.
    logp, alpha_logp, pi_k_logp, ref_logp, adv, mask = random_batch(seed=11)
    alpha_logp[mask == 0] -= 1000.0  # rho' = inf on padding: no unit may turn it into nan
    flags = dict(clip_eps=0.2, clip_eps_high=0.28, clip_center=center, beta=0.1, agg=agg, max_new_tokens=7)
    total = aggregation_total(mask, agg, 7)

    def run(recipe):
        keep, kept_stats = recipe.step_keep(alpha_logp, pi_k_logp, mask)
        assert keep[mask > 0].all()  # (off the mask, where rho' = inf, a keep does not matter)
        x = logp.clone().requires_grad_(True)
        loss, stats = recipe.loss(li(x, alpha_logp, pi_k_logp, ref_logp, adv, mask * keep, total))
        loss.backward()
        return loss.detach(), x.grad, stats, kept_stats

    plain = variants.recipe(Config(**flags))
    assert plain.names == (["decoupled"] if center == "decoupled" else [])
    loss_a, grad_a, stats_a, _ = run(plain)
    assert torch.isfinite(grad_a).all() and stats_a["clip_low"] + stats_a["clip_high"] > 0  # the clip acts here
    if center != "decoupled":
        x = logp.clone().requires_grad_(True)
        settings = {k: v for k, v in flags.items() if k != "max_new_tokens"}
        loss, stats = policy_loss(li(x, alpha_logp, pi_k_logp, ref_logp, adv, mask, total), **settings)
        loss.backward()
        assert torch.equal(loss.detach(), loss_a) and torch.equal(x.grad, grad_a) and stats == stats_a
    neutral = dict(NEUTRAL) | ({"tis": dict(is_cap=math.inf)} if center == "decoupled" else {})
    for name, extra in neutral.items():
        recipe = variants.recipe(Config(**flags, **extra))
        assert name.split("-")[0] in recipe.names
        loss_b, grad_b, stats_b, kept_stats = run(recipe)
        assert torch.equal(loss_a, loss_b) and torch.equal(grad_a, grad_b), name
        assert {k: stats_b[k] for k in stats_a} == stats_a, name
        assert all(v == 0 for k, v in (stats_b | kept_stats).items() if k.endswith("_masked_frac")), name


@pytest.mark.parametrize("center", ["decoupled", "centre"])
def test_the_core_has_two_clip_centres(center):
    # The decoupled objective is the Decoupled unit's (variants/corrections.py), not a centre of policy_loss; TIS's
    # weight needs it (config.validate).
    logp, alpha_logp, pi_k_logp, _, adv, mask = random_batch(seed=12)
    with pytest.raises(ValueError, match=f"clip_center must be one of \\('pi_k', 'alpha'\\), got '{center}'"):
        policy_loss(li(logp, alpha_logp, pi_k_logp, None, adv, mask), clip_center=center)


@pytest.mark.parametrize("center", ["pi_k", "alpha"])
def test_a_tis_weight_needs_the_decoupled_centre(center):
    from config import ConfigError, resolve, validate

    with pytest.raises(ConfigError, match="--is-cap needs --loss grpo --clip-center decoupled"):
        validate(resolve(Config(clip_center=center, is_cap=2.0, offpolicy_steps=2, out="/tmp/unused")))
    validate(resolve(Config(clip_center="decoupled", is_cap=2.0, offpolicy_steps=2, out="/tmp/unused")))


def test_the_rho_weighted_kl_estimates_kl_to_the_reference_under_alphas_samples():
    """One KL (--kl-importance-weight, the kl-is unit): tokens drawn from a stale alpha, the per-token k3 and k1
    weighted by rho = pi_theta / alpha average to KL(pi_theta || pi_ref), computed exactly over the vocabulary;
    unweighted they average to E_alpha[k], another number. 400k samples: the standard error is about 1e-3."""
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
            recipe = variants.recipe(Config(beta=1.0, kl_estimator=estimator, kl_importance_weight=weighted))
            assert recipe.names == (["kl-is"] if weighted else [])
            _, st = recipe.loss(li(logp, alpha_logp, logp, ref_logp, torch.zeros(1), ones))
            means[weighted] = st["kl"]
        assert abs(means[True] - exact) < 0.01, (estimator, means, exact)
        assert abs(means[False] - exact) > 0.1, (estimator, means, exact)


def test_the_rho_weighted_kl_term_matches_a_loop():
    # The kl-is unit's loss, token by token: - (1/Z) sum_t [o_t - beta rho_t k3_t], value and gradient, with the
    # weight rho_t = pi_theta / alpha carrying its gradient.
    logp, alpha_logp, pi_k_logp, ref_logp, adv, mask = random_batch(seed=21)
    recipe = variants.recipe(Config(beta=0.3, kl_importance_weight=True, clip_eps=0.2, clip_eps_high=0.28))
    x = logp.clone().requires_grad_(True)
    loss, _ = recipe.loss(li(x, alpha_logp, pi_k_logp, ref_logp, adv, mask))
    loss.backward()
    a, pk, rf, ad, mk = (t.tolist() for t in (alpha_logp, pi_k_logp, ref_logp, adv, mask))

    def loop(lp):
        terms = []
        for i in range(len(lp)):
            for j in range(len(lp[i])):
                if mk[i][j]:
                    rho, rho_p = math.exp(lp[i][j] - a[i][j]), math.exp(pk[i][j] - a[i][j])
                    lo, hi = max(rho_p - 0.2, 0.0), rho_p + 0.28
                    d = rf[i][j] - lp[i][j]
                    terms.append(min(rho * ad[i], min(max(rho, lo), hi) * ad[i]) - 0.3 * rho * (math.exp(d) - d - 1))
        return -sum(terms) / len(terms)

    assert loss.item() == pytest.approx(loop(logp.tolist()), rel=1e-10, abs=1e-12)
    h = 1e-6
    for i in range(logp.shape[0]):
        for j in range(logp.shape[1]):
            up, dn = logp.tolist(), logp.tolist()
            up[i][j] += h
            dn[i][j] -= h
            assert x.grad[i, j].item() == pytest.approx((loop(up) - loop(dn)) / (2 * h), abs=1e-6), (i, j)
