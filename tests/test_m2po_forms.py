"""M2PO's other published forms and DPPO's mask (issue 57), each a unit of variants/corrections.py, against plain
Python loops written from their definitions (float64, value and gradient), on hand-built cases where the forms
differ from each other and from AReaL's mask (corrections.m2po_keep_mask, tests/test_m2po_opsm.py), and in
train.train's loop.

What was read (not copied):
- m2po-clip: Infini-AI-Lab/M2PO, verl/trainer/ppo/core_algos.py, `kpo_clip_harmful_tokens`,
  `_get_trust_region_tokens_delta_sq`, `_solve_tau_from_sorted_delta2`, `compute_m2po_policy_loss`; called per
  micro-batch from verl/workers/actor/dp_actor.py with old_log_probs recorded at sampling (alpha) and
  miniclip_low / _high = config.get(..., None): unset in train-scripts/m2po-*.sh, so no floor in their runs.
- m2po-quadrant: ms-swift's `compute_m2po_mask` / `compute_m2po_token_loss` and Trinity-RFT's `M2POPolicyLossFn`
  (2026): the pushed quadrants ranked by (log pi_theta - log alpha)^2, the longest ascending prefix with mean <= the
  threshold kept, -rho A unclipped on the rest, normalised by every loss token.
- dppo: PrimeIntellect-ai/prime-rl, src/prime_rl/trainer/rl/loss.py `default_loss_fn` (the default since
  ff4b125e4, 2026-04-06), DefaultLossConfig dppo_mask_low = dppo_mask_high = 0.2.
"""

import math

import pytest
import torch

import train
import variants
from config import Config, ConfigError, resolve, validate
from conftest import TEST_WARMUP, jsonl
from objective import LossInput, policy_loss
from variants.corrections import (
    DPPO,
    M2POClip,
    M2POQuadrant,
    dppo_keep,
    m2po_clip_bounds,
    m2po_keep_mask,
    m2po_quadrant_keep,
)

SETTINGS = dict(clip_eps=0.2, clip_eps_high=0.28, clip_center="pi_k", beta=0.0, kl_estimator="k3", agg="token-mean")


# ---- the loops, from the definitions ---------------------------------------------------------------------------


def pushed(logp, alpha, adv, mask):
    """The loss tokens (i, j) whose ratio moved the way A_i pushes it, with their (log rho)^2."""
    out = []
    for i in range(len(mask)):
        for j in range(len(mask[i])):
            d = logp[i][j] - alpha[i][j]
            if mask[i][j] and ((adv[i] > 0 and d > 0) or (adv[i] < 0 and d < 0)):
                out.append(((i, j), d * d))
    return out


def clip_bounds_loop(logp, alpha, adv, mask, budget, floor):
    """The authors' procedure: no clip ([0, 1e5]) when the pushed tokens' mean (log rho)^2 is within the budget;
    else, their values ascending, the first k whose cap sum_t min(v_t, v_k) reaches n * budget, cap^2 = v_(k-1)
    less their slack 1e-12 (0 for k = 0), [e^-cap, e^cap]; the floor widens it to at least [0.7, 1.5]."""
    v = sorted(m2 for _, m2 in pushed(logp, alpha, adv, mask))
    n = len(v)
    if n == 0 or sum(v) / n <= budget:
        lo, hi = 0.0, 1e5
    else:
        k = next(k for k in range(n) if sum(min(x, v[k]) for x in v) >= n * budget)
        cap = math.sqrt(max(v[k - 1] - 1e-12, 0.0)) if k > 0 else 0.0
        lo, hi = math.exp(-cap), math.exp(cap)
    if floor:
        lo, hi = min(lo, 0.7), max(hi, 1.5)
    return lo, hi


def quadrant_keep_loop(logp, alpha, adv, mask, threshold):
    """Kept (lists of bools, True off the mask): the pushed tokens ascending by (log rho)^2 (ties: the earlier
    first), the longest prefix whose mean is <= threshold stays, the rest leave; the other tokens all stay."""
    ranked = sorted(pushed(logp, alpha, adv, mask), key=lambda e: e[1])  # stable
    kept = 0
    for m in range(1, len(ranked) + 1):
        if sum(v for _, v in ranked[:m]) / m <= threshold:
            kept = m
    keep = [[True] * len(row) for row in mask]
    for (i, j), _ in ranked[kept:]:
        keep[i][j] = False
    return keep


def dppo_keep_loop(logp, alpha, adv, mask, lo, hi):
    """Kept: a loss token leaves iff A > 0 and pi_theta - alpha > hi, or A <= 0 and alpha - pi_theta > lo."""
    keep = [[True] * len(row) for row in mask]
    for i in range(len(mask)):
        for j in range(len(mask[i])):
            diff = math.exp(logp[i][j]) - math.exp(alpha[i][j])
            if mask[i][j] and ((adv[i] > 0 and diff > hi) or (adv[i] <= 0 and -diff > lo)):
                keep[i][j] = False
    return keep


def loss_loop(logp, alpha, adv, mask, lo, hi, keep):
    """(loss, d loss / d logp) of -(1/Z) sum_t keep_t min(rho A, clip(rho, lo, hi) A), Z = every loss token: the
    gradient rho A where the min() takes the unclipped branch or rho is inside [lo, hi], else 0."""
    z = sum(sum(row) for row in mask)
    total, grad = 0.0, [[0.0] * len(row) for row in mask]
    for i in range(len(mask)):
        for j in range(len(mask[i])):
            if not mask[i][j] or not keep[i][j]:
                continue
            rho, a = math.exp(logp[i][j] - alpha[i][j]), adv[i]
            total += min(rho * a, min(max(rho, lo), hi) * a)
            clipped = (a > 0 and rho > hi) or (a < 0 and rho < lo)
            grad[i][j] = 0.0 if clipped else -rho * a / z
    return -total / z, grad


def batch(seed, n=8, t=6, spread=0.6):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(n, t, generator=g, dtype=torch.float64) * 2
    alpha = logp + spread * (torch.rand(n, t, generator=g, dtype=torch.float64) - 0.5)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = (torch.rand(n, t, generator=g) > 0.25).long()
    mask[0] = 0  # a sequence without a loss token
    alpha[mask == 0] += 300.0  # padding far off: no form may see it
    return logp, alpha, adv, mask


def unit_loss(unit, logp, alpha, adv, mask):
    """The unit around objective.policy_loss (the run's settings, which it overrides): (loss, gradient, stats)."""
    lp = logp.clone().requires_grad_(True)
    x = LossInput(lp, alpha, logp.clone(), None, adv, mask, float(mask.sum()))
    loss, stats = unit.loss(x, inner=policy_loss, **SETTINGS)
    loss.backward()
    return loss.item(), lp.grad, stats


def lists(*ts):
    return [t.tolist() for t in ts]


# ---- each form against its loop ----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("budget", [0.005, 0.02, 0.04])
@pytest.mark.parametrize("floor", [False, True])
def test_m2po_clip_is_the_loop(seed, budget, floor):
    logp, alpha, adv, mask = batch(seed)
    L, Al, Ad, M = lists(logp, alpha, adv, mask)
    lo, hi = clip_bounds_loop(L, Al, Ad, M, budget, floor)
    got = m2po_clip_bounds(logp, alpha, adv, mask, budget, floor)
    assert got[:2] == pytest.approx((lo, hi), rel=1e-12)
    value, grad, stats = unit_loss(M2POClip(budget, floor), logp, alpha, adv, mask)
    ref, ref_grad = loss_loop(L, Al, Ad, M, lo, hi, M)
    assert value == pytest.approx(ref, rel=1e-12, abs=1e-15)
    torch.testing.assert_close(grad, torch.tensor(ref_grad, dtype=torch.float64), rtol=1e-12, atol=1e-15)
    assert (stats["m2po_clip_lo"], stats["m2po_clip_hi"]) == pytest.approx((lo, hi), rel=1e-12)
    if budget == 0.005 and not floor:
        assert 1 < hi < 1e5  # the case is not trivial: the budget binds


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("threshold", [0.005, 0.02, 0.04])
def test_m2po_quadrant_is_the_loop(seed, threshold):
    logp, alpha, adv, mask = batch(seed)
    L, Al, Ad, M = lists(logp, alpha, adv, mask)
    keep = m2po_quadrant_keep(logp, alpha, adv, mask, threshold)
    ref_keep = quadrant_keep_loop(L, Al, Ad, M, threshold)
    assert keep.dtype == torch.bool and keep.tolist() == ref_keep
    value, grad, stats = unit_loss(M2POQuadrant(threshold), logp, alpha, adv, mask)
    ref, ref_grad = loss_loop(L, Al, Ad, M, 0.0, math.inf, ref_keep)
    assert value == pytest.approx(ref, rel=1e-12, abs=1e-15)
    torch.testing.assert_close(grad, torch.tensor(ref_grad, dtype=torch.float64), rtol=1e-12, atol=1e-15)
    dropped = sum(not k for row_k, row_m in zip(ref_keep, M) for k, m in zip(row_k, row_m) if m)
    assert stats["m2po_quadrant_masked_frac"] == pytest.approx(dropped / sum(map(sum, M)))
    if threshold == 0.005:
        assert 0 < dropped  # the case is not trivial


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("bounds", [(0.05, 0.05), (0.02, 0.1), (0.2, 0.2)])
def test_dppo_is_the_loop(seed, bounds):
    logp, alpha, adv, mask = batch(seed, spread=1.2)
    L, Al, Ad, M = lists(logp, alpha, adv, mask)
    keep = dppo_keep(logp, alpha, adv, mask, *bounds)
    ref_keep = dppo_keep_loop(L, Al, Ad, M, *bounds)
    assert keep.tolist() == ref_keep
    value, grad, stats = unit_loss(DPPO(*bounds), logp, alpha, adv, mask)
    ref, ref_grad = loss_loop(L, Al, Ad, M, 0.0, math.inf, ref_keep)
    assert value == pytest.approx(ref, rel=1e-12, abs=1e-15)
    torch.testing.assert_close(grad, torch.tensor(ref_grad, dtype=torch.float64), rtol=1e-12, atol=1e-15)
    if bounds == (0.05, 0.05):
        assert 0 < stats["dppo_masked_frac"] < 1


# ---- hand-built: where the forms part --------------------------------------------------------------------------

# One sequence with A > 0, one with A < 0; pi_theta = pi_k (the step's first pass), alpha the sampler. Per token
# (alpha -> pi_theta):
#   A > 0: a 0.10 -> 0.50  pushed, (log 5)^2 = 2.59, diff +0.40     b 0.001 -> 0.01  pushed, (log 10)^2 = 5.30, +0.009
#          c 0.60 -> 0.85  pushed, 0.121, diff +0.25                d 0.50 -> 0.52   pushed, 0.0015, +0.02
#   A < 0: e 0.20 -> 0.60  not pushed (the corrective push-down on a favoured wrong token), 1.21
#          f 0.50 -> 0.48  pushed, 0.0017, diff -0.02
P = [[0.50, 0.01, 0.85, 0.52], [0.60, 0.48, 0.30, 0.30]]
Q = [[0.10, 0.001, 0.60, 0.50], [0.20, 0.50, 0.30, 0.30]]
HAND_MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
HAND_ADV = torch.tensor([1.0, -1.0], dtype=torch.float64)


def hand():
    return torch.tensor(P, dtype=torch.float64).log(), torch.tensor(Q, dtype=torch.float64).log()


def test_the_forms_part_on_a_hand_built_batch():
    logp, alpha = hand()
    m = HAND_MASK
    # AReaL's mask (pi_k = pi_theta here): ranks every token by M2; the two largest leave (b, a), then e ...
    areal = m2po_keep_mask(alpha, logp, m, 0.04)
    assert areal.tolist() == [[False, False, False, True], [False, True, True, True]]
    # the final paper's: only the pushed tokens are ranked; e (A < 0, pushed up) is never a candidate
    quad = m2po_quadrant_keep(logp, alpha, HAND_ADV, m, 0.04)
    assert quad.tolist() == [[False, False, False, True], [True, True, True, True]]
    # ... and with a looser threshold c stays, where AReaL's still drops it with e
    assert m2po_quadrant_keep(logp, alpha, HAND_ADV, m, 0.07).tolist() == [
        [False, False, True, True],
        [True, True, True, True],
    ]
    # DPPO: a probability difference: b (x10 in ratio, +0.009) stays, a and c (+0.40, +0.25) leave, e stays
    assert dppo_keep(logp, alpha, HAND_ADV, m, 0.2, 0.2).tolist() == [
        [False, True, False, True],
        [True, True, True, True],
    ]
    # the authors' released form masks nothing: M2 of the pushed {a, b, c, d, f} = 1.60 > 0.04 gives a clip
    v = sorted(
        [math.log(5) ** 2, math.log(10) ** 2, math.log(0.85 / 0.6) ** 2, math.log(1.04) ** 2, math.log(0.96) ** 2]
    )
    k = next(k for k in range(5) if sum(min(x, v[k]) for x in v) >= 5 * 0.04)
    lo, hi, m2, n = m2po_clip_bounds(logp, alpha, HAND_ADV, m, 0.04)
    assert n == 5 and m2 == pytest.approx(sum(v) / 5) and k == 2
    assert (lo, hi) == pytest.approx((math.exp(-math.sqrt(v[1])), math.exp(math.sqrt(v[1]))), rel=1e-9)
    # cap = |log 0.96| less the slack, about [0.96, 1.04]: a, b, c (A > 0, rho above it) lose their gradient, d
    # (inside) keeps it, f (A < 0, rho = 0.96) sets the cap and falls just below, clipped; e (A < 0 and rho = 3: the
    # clip's open side) keeps its push-down
    _, grad, _ = unit_loss(M2POClip(0.04), logp, alpha, HAND_ADV, m)
    assert (grad != 0).tolist() == [[False, False, False, True], [True, False, False, False]]
    # with the floor the interval is [0.7, 1.5]: c (rho 1.42) is back inside
    _, grad, _ = unit_loss(M2POClip(0.04, floor=True), logp, alpha, HAND_ADV, m)
    assert (grad != 0).tolist() == [[False, False, True, True], [True, True, False, False]]


def test_m2po_clip_edges():
    logp, alpha = hand()
    # within the budget: no clip, [0, 1e5] (the authors' constants)
    assert m2po_clip_bounds(logp, alpha, HAND_ADV, HAND_MASK, 10.0)[:2] == (0.0, 1e5)
    # every pushed value above the budget: cap = 0, [1, 1]; the floor makes it [0.7, 1.5]
    lp, al = torch.tensor([[0.0, -1.0]], dtype=torch.float64), torch.tensor([[-1.0, 0.0]], dtype=torch.float64)
    adv, mask = torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 2, dtype=torch.long)
    assert m2po_clip_bounds(lp, al, adv, mask, 0.5)[:2] == (1.0, 1.0)
    assert m2po_clip_bounds(lp, al, adv, mask, 0.5, floor=True)[:2] == (0.7, 1.5)
    # no pushed token: no clip
    assert m2po_clip_bounds(lp, al, -adv, torch.tensor([[1, 0]]), 0.01)[:2] == (0.0, 1e5)
    # an infinite log-ratio on a pushed token sorts last: the cap is the largest finite breakpoint below the budget
    lp3 = torch.tensor([[0.0, 0.0, 0.0]], dtype=torch.float64)
    al3 = torch.tensor([[-float("inf"), -0.1, -0.2]], dtype=torch.float64)
    lo, hi, _, n = m2po_clip_bounds(lp3, al3, adv, torch.ones(1, 3, dtype=torch.long), 0.04)
    assert n == 3 and hi == pytest.approx(math.exp(0.2), rel=1e-9)
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="must be > 0"):
            M2POClip(bad)
        with pytest.raises(ValueError, match="must be > 0"):
            M2POQuadrant(bad)
    with pytest.raises(ValueError, match="must be >= 0"):
        DPPO(-0.1)


def test_ties_in_the_quadrant_mask_leave_in_token_order():
    # four pushed tokens of (log rho)^2 = 0.01, 0.09, 0.09, 0.09: prefix means 0.01, 0.05, ...: at threshold 0.05 the
    # first 0.09 (token 1) stays, tokens 2 and 3 leave
    d = [0.1, 0.3, -0.3, 0.3]
    lp = torch.tensor([[abs(x) for x in d]], dtype=torch.float64)
    al = torch.zeros_like(lp)
    keep = m2po_quadrant_keep(lp, al, torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 4), 0.05)
    assert keep.tolist() == [[True, True, False, False]]


def test_flags_are_checked_and_build_their_units():
    for kw, unit in [
        (dict(m2po_clip_threshold=0.04), "m2po-clip"),
        (dict(m2po_clip_threshold=0.04, m2po_clip_floor=True), "m2po-clip"),
        (dict(m2po_quadrant_threshold=0.04), "m2po-quadrant"),
        (dict(dppo_delta=0.2), "dppo"),
    ]:
        cfg = resolve(Config(offpolicy_steps=2, **kw))  # stale batches: where each can act
        validate(cfg)
        assert variants.recipe(cfg).names == [unit]
        with pytest.raises(ConfigError, match="cannot act on-policy with one inner step"):
            validate(resolve(Config(**kw)))  # on-policy, one inner step: pi_theta = alpha, nothing to act on
        validate(resolve(Config(inner_steps=2, **kw)))  # on-policy, a second inner step: pi_theta moves
    assert variants.recipe(Config(m2po_clip_threshold=0.04, m2po_clip_floor=True)).variants[0].floor
    for kw, match in [
        (dict(m2po_clip_threshold=0.0), "budget > 0"),
        (dict(m2po_quadrant_threshold=-1.0), "threshold > 0"),
        (dict(dppo_delta=-0.1), "delta >= 0"),
        (dict(dppo_delta=0.2, loss="rec"), "needs --loss grpo"),
        (dict(dppo_delta=0.2, m2_threshold=0.04), "one M2PO form or DPPO at a time"),
        (dict(m2po_clip_threshold=0.04, m2po_quadrant_threshold=0.04), "one M2PO form or DPPO at a time"),
        (dict(m2po_clip_floor=True), "floors the clip of --m2po-clip-threshold"),
        (dict(dppo_delta=0.2, clip_eps=0.3), "--dppo-delta sets its own trust region"),
        (dict(m2po_quadrant_threshold=0.04, clip_center="alpha"), "sets its own trust region"),
    ]:
        with pytest.raises(ConfigError, match=match):
            validate(resolve(Config(offpolicy_steps=2, **kw)))


def test_a_correction_that_cannot_act_on_policy_is_refused():
    # alpha = pi_k at every on-policy step (rho' = 1): TIS, MIS and AReaL's M2PO rule can never act there
    for kw in (dict(clip_center="decoupled", is_cap=2.0), dict(is_mask=2.0), dict(m2_threshold=0.04)):
        for schedule in (dict(), dict(lag=0), dict(inner_steps=4)):
            with pytest.raises(ConfigError, match="cannot act on-policy"):
                validate(resolve(Config(**kw, **schedule)))
        validate(resolve(Config(offpolicy_steps=2, **kw)))
        validate(resolve(Config(lag=1, **kw)))
    with pytest.raises(ConfigError, match="cannot act on-policy with one inner step"):
        validate(resolve(Config(opsm_delta=0.5)))
    validate(resolve(Config(opsm_delta=0.5, inner_steps=2)))


# ---- the loop runs each --------------------------------------------------------------------------------------


@pytest.mark.model
@pytest.mark.parametrize(
    "flags, stat",
    [
        (dict(m2po_clip_threshold=1e-6), "m2po_clip_hi"),
        (dict(m2po_quadrant_threshold=1e-6), "m2po_quadrant_masked_frac"),
        (dict(dppo_delta=0.0), "dppo_masked_frac"),
    ],
)
def test_train_runs_each_form_on_stale_batches(warm_cache, tmp_path, flags, stat):
    """v = 2 (every other step's batch one update stale), lr high enough that the policy moves: each unit is
    called on every update, and on a stale step its trust region acts (bounds set, or tokens masked)."""
    cfg = Config(
        steps=4,
        prompts_per_step=4,
        group_size=4,
        offpolicy_steps=2,
        lr=1e-3,
        eval_size=4,
        eval_every=0,
        eval_start=False,
        progress=False,
        warmup_steps=TEST_WARMUP,
        cache_dir=warm_cache,
        out=str(tmp_path / "run"),
        **flags,
    )
    train.train(resolve(cfg))
    rows = [r for r in jsonl(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert rows and all(stat in r and math.isfinite(r["loss"]) for r in rows)
    stale = [r for r in rows if r["step"] % 2 == 1]
    if stat == "m2po_clip_hi":
        assert any(1.0 <= r[stat] < 1e5 for r in stale)  # a clip the budget set
    else:
        assert any(r[stat] > 0 for r in stale)  # some token lost its term
