"""The policy objective: GRPO's clipped off-policy surrogate with a KL penalty ([A]), the staleness
corrections of other engines (AReaL's decoupled objective, truncated and masked sampler weights), and
the aggregation every loss shares. The REINFORCE-family losses of [B] are in reinforce.py.

Every loss here takes per-token log-probs of the completions, shape (N, T), and a `completion_mask` (N, T) that
is 1 on the tokens that count: the completion tokens up to and including EOS, of the completions whose group
carries signal (the caller folds `valid` in). Each loss is two steps: a per-token function gives the (N, T)
objective and the masks its statistics need (`surrogate_per_token` here; `rec_per_token`, `opmd_per_token` in
reinforce.py), and the loss aggregates it (`policy_loss`; `rec_loss`, `opmd_loss`). An engine with its own
aggregation and KL term calls the per-token function alone (integrations/verl_grpo.py does).

Aggregation (`agg`), the normaliser of the summed per-token objective:
    token-mean  sum over all valid tokens of the step / their count  (no length bias; default)
    seq-mean    mean over each sequence's tokens, then mean over sequences  (original GRPO)
    constant    sum / (N * max_new_tokens)  (Dr. GRPO, Liu et al. 2025)

Micro-batching must not change the math: a step split into micro-batches passes each the whole step's
`total=aggregation_total(full_mask, agg, max_new_tokens)`, so the micro-batch losses (and gradients) add up
to the whole step's; with `is_mask` (MIS) full_mask is `completion_mask * mis_keep_mask(...)`.

Deviations from the papers:
  1. [A] states the surrogate with a sequence-level mean (seq-mean); we default to token-mean,
     which removes the length bias that Dr. GRPO and DAPO point out. All three are available.
  2. The lower clip bound of the "current" centre is floored at 0 (`max(rho' - eps_low, 0)`):
     a ratio is never negative, so a negative bound would be vacuous anyway.
  3. `is_cap` truncates the sampler weight (TIS: w = min(rho', C)); AReaL's `behav_imp_weight_cap` zeroes the
     tokens above the cap instead. Dropping tokens is `is_mask`'s job, and it drops them from the normaliser.

`is_level` sets the ratio rho^L that TIS and MIS act on (`policy_loss`): rho'_t, or per sequence the product R
or the geometric mean G of its rho'_t. In the engines (their old policy is pi_k, vLLM alpha, their PPO loss times
the correction weight the decoupled centre; tests/test_sequence_is.py pins or contrasts each):
    sequence, is_cap=C    TRL 1.16 vllm_importance_sampling_mode="sequence_truncate" (clip_max=C, clip_min=None);
                          verl 0.9 rollout_is="sequence", rollout_is_threshold=C
    sequence, is_mask=M   verl rollout_rs="seq_sum_k1", threshold M. TRL's "sequence_mask" (clip_max=M) is this
                          with is_cap=M, but one-sided unless clip_min=1/M, masked sequences kept in its normaliser
    geometric, is_mask=M  verl's Geo-RS, rollout_rs="seq_mean_k1" ("geometric" in verl 0.6), threshold M
    geometric, is_cap=C   neither engine
"""

from typing import NamedTuple

import torch

AGGREGATIONS = ("token-mean", "seq-mean", "constant")
CLIP_CENTERS = ("current", "behaviour", "decoupled")
KL_ESTIMATORS = ("k1", "k2", "k3")
IS_LEVELS = ("token", "sequence", "geometric")


def aggregation_total(completion_mask: torch.Tensor, agg: str, max_new_tokens: int | None = None) -> float:
    """The normaliser of `agg` over a whole step: the number the summed objective is divided by.

    token-mean: the count of valid tokens; seq-mean: the count of sequences with at least one
    valid token; constant: N * max_new_tokens. Clamped to >= 1 so an all-masked step gives 0.
    """
    if agg == "token-mean":
        total = completion_mask.sum().item()
    elif agg == "seq-mean":
        total = (completion_mask.sum(dim=1) > 0).sum().item()
    elif agg == "constant":
        if max_new_tokens is None:
            raise ValueError("agg='constant' needs max_new_tokens")
        total = completion_mask.shape[0] * max_new_tokens
    else:
        raise ValueError(f"agg must be one of {AGGREGATIONS}, got {agg!r}")
    return float(max(total, 1))


def aggregate(
    per_token: torch.Tensor, completion_mask: torch.Tensor, agg: str, max_new_tokens: int | None, total: float | None
) -> torch.Tensor:
    """Sum `per_token` (N, T) over the masked tokens and divide by the aggregation's normaliser.

    A token outside the mask contributes exactly 0, whatever its value: where(), not a product, so an inf or
    nan there (an overflowing ratio on a padding or dropped token) never reaches the loss or its gradient."""
    keep = completion_mask > 0  # (N, T)
    if total is None:
        total = aggregation_total(completion_mask, agg, max_new_tokens)
    kept = torch.where(keep, per_token, torch.zeros_like(per_token))  # (N, T)
    if agg == "seq-mean":
        # Each sequence contributes its own token mean; masked-out sequences contribute 0.
        seq_len = keep.sum(dim=1).clamp(min=1).to(per_token.dtype)  # (N,)
        return (kept.sum(dim=1) / seq_len).sum() / total
    return kept.sum() / total


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean of x over mask == 1, as a float (0.0 when the mask is empty); for statistics only."""
    n = mask.sum()
    return torch.where(mask > 0, x, torch.zeros_like(x)).sum().item() / n.item() if n.item() > 0 else 0.0


def neutral_outside(completion_mask: torch.Tensor, logp: torch.Tensor, *others: torch.Tensor | None) -> list:
    """`others` (log-probs of alpha, pi_k, pi_ref; None stays None), detached, with logp's own detached values
    on the tokens outside the mask: every ratio is 1 there, so nothing outside the mask can overflow.

    A masked-out token (padding, a group without signal) contributes nothing, but its values still flow through
    the per-token formulas: an overflowing rho' = inf there times a zero gradient would be nan (inf * 0), and the
    nan would reach every parameter's gradient. Each loss calls this first."""
    keep, anchor = completion_mask > 0, logp.detach()  # (N, T) each
    return [None if x is None else torch.where(keep, x.detach(), anchor) for x in others]


def _check_is_mask(is_mask: float | None) -> None:
    if is_mask is not None and not is_mask >= 1.0:
        raise ValueError(f"is_mask must be >= 1 (MIS keeps the ratios in [1/is_mask, is_mask]), got {is_mask}")


def _mis_keep(rho_prime: torch.Tensor, is_mask: float) -> torch.Tensor:
    """(N, T) or (N, 1) bool: True where 1/is_mask <= the ratio <= is_mask (what MIS keeps)."""
    return (rho_prime >= 1.0 / is_mask) & (rho_prime <= is_mask)


def _level_ratio(log_rho: torch.Tensor, completion_mask: torch.Tensor | None, is_level: str) -> torch.Tensor:
    """rho^L, the ratio TIS and MIS act on, from log rho' (N, T): rho'_t itself (N, T) at is_level="token";
    R = exp(sum_t log rho'_t) or G = exp(mean_t log rho'_t) (N, 1), float64, t over the valid tokens, otherwise."""
    if is_level == "token":
        return torch.exp(log_rho)  # (N, T)
    if is_level not in IS_LEVELS:
        raise ValueError(f"is_level must be one of {IS_LEVELS}, got {is_level!r}")
    if completion_mask is None:
        raise ValueError(f"is_level={is_level!r} needs completion_mask (the tokens a sequence's ratio runs over)")
    keep = completion_mask > 0  # (N, T)
    # A sum of log-ratios, not a product of ratios: no overflow on the way; where(): nothing outside the mask counts.
    log_seq = torch.where(keep, log_rho.double(), 0.0).sum(dim=1, keepdim=True)  # (N, 1) log R
    if is_level == "geometric":
        log_seq = log_seq / keep.sum(dim=1, keepdim=True).clamp(min=1)  # (N, 1) log G
    return torch.exp(log_seq)  # (N, 1)


def mis_keep_mask(
    behaviour_logp: torch.Tensor, current_logp: torch.Tensor | None, is_mask: float | None, *,
    completion_mask: torch.Tensor | None = None, is_level: str = "token",
) -> torch.Tensor:  # fmt: skip
    """The tokens that masked importance sampling (MIS, IcePop) keeps: (N, T) bool.

        keep_t = 1[1/M <= rho^L <= M],   rho'_t = pi_k(y_t) / alpha(y_t) = exp(current_logp - behaviour_logp)

    rho^L: rho'_t, or the sequence's R or G (`policy_loss`) over completion_mask's tokens; M -> is_mask (None: all
    kept); current_logp=None means pi_k = alpha (rho' = 1). `policy_loss(..., is_mask=M)` drops the others from the
    loss and its normaliser; micro-batches pass `total=aggregation_total(completion_mask * keep, agg, max_new_tokens)`.
    """
    if current_logp is None or is_mask is None:
        return torch.ones_like(behaviour_logp, dtype=torch.bool)  # (N, T)
    _check_is_mask(is_mask)
    rho_level = _level_ratio(current_logp.detach() - behaviour_logp.detach(), completion_mask, is_level)
    return _mis_keep(rho_level, is_mask).expand_as(behaviour_logp)  # (N, T)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) at the sampled tokens, (N, T) (Schulman 2020).

        k1 = log pi_theta - log pi_ref                              (unbiased; can be negative)
        k2 = 1/2 (log pi_theta - log pi_ref)^2                      (biased; >= 0)
        k3 = pi_ref/pi_theta - 1 - log(pi_ref/pi_theta)             (unbiased; >= 0)

    "Unbiased" holds for tokens drawn from pi_theta. As a loss term the gradient flows through
    logp only, and then (per token, tokens from pi_theta) k1's expected gradient is 0, k2's is the
    gradient of KL(pi_theta || pi_ref), and k3's that of the reverse KL(pi_ref || pi_theta).
    """
    # log(pi_ref / pi_theta); the reference is a constant.
    log_ref_ratio = ref_logp.detach() - logp  # (N, T)
    if estimator == "k1":
        return -log_ref_ratio  # (N, T)
    if estimator == "k2":
        return 0.5 * log_ref_ratio**2  # (N, T)
    if estimator == "k3":
        return torch.exp(log_ref_ratio) - log_ref_ratio - 1.0  # (N, T)
    raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


def sampler_mismatch_stats(
    behaviour_logp: torch.Tensor, current_logp: torch.Tensor | None, completion_mask: torch.Tensor, *,
    is_cap: float | None = None, is_mask: float | None = None, is_level: str = "token",
) -> dict:  # fmt: skip
    """How far the sampler alpha is from pi_k, as floats over the valid tokens (completion_mask == 1).

        mismatch_kl_k1   mean_t [ log alpha(y_t) - log pi_k(y_t) ]     KL(alpha || pi_k), k1; y_t ~ alpha
        mismatch_kl_k3   mean_t [ rho'_t - 1 - log rho'_t ]            the same KL, k3 (>= 0, lower variance)
        rho_prime_mean, rho_prime_p50, rho_prime_p99, rho_prime_max    of rho'_t = pi_k(y_t) / alpha(y_t)
        is_capped_frac   fraction of valid tokens that TIS caps (rho^L > is_cap and kept by MIS); 0 without is_cap
        is_masked_frac   fraction of valid tokens that MIS drops (rho^L outside [1/is_mask, is_mask]); 0 without is_mask

    They depend on alpha and pi_k only, not on pi_theta, so a step computes them once, on the whole step:
    quantiles of micro-batches do not combine (torch's quantiles take at most 2**24 = 16.7M tokens).
    current_logp=None means pi_k = alpha. rho^L is `policy_loss`'s (is_level): a sequence's tokens count together.
    """
    _check_is_mask(is_mask)
    base = behaviour_logp.detach()
    log_rho = torch.zeros_like(base) if current_logp is None else current_logp.detach() - base  # (N, T)
    valid = completion_mask > 0  # (N, T)
    rho = torch.exp(log_rho)  # (N, T)
    rho_level = rho if is_level == "token" else _level_ratio(log_rho, completion_mask, is_level)  # (N, T) or (N, 1)
    kept = valid if is_mask is None else valid & _mis_keep(rho_level, is_mask)  # (N, T)
    # TIS caps only tokens still in the loss; a token MIS dropped counts as dropped, not capped.
    capped = kept & (rho_level > is_cap) if is_cap is not None else torch.zeros_like(valid)  # (N, T)
    # Masked-out tokens become NaN, which nanquantile skips: no boolean indexing, so no device sync.
    rho_valid = rho.masked_fill(~valid, float("nan")).flatten()  # (N*T,)
    rho_valid = rho_valid if rho_valid.dtype == torch.float64 else rho_valid.float()  # quantiles need fp32/64
    q = torch.tensor([0.5, 0.99], dtype=rho_valid.dtype, device=rho_valid.device)  # (2,)
    p50_p99 = torch.nanquantile(rho_valid, q) if rho_valid.numel() else torch.ones_like(q)  # (2,) linear interp.
    vsum = lambda x: torch.where(valid, x, torch.zeros_like(x)).sum()  # where(): an inf outside must not leak
    # k1 and k3 of KL(alpha || pi_k) from tokens drawn from alpha: log(alpha / pi_k) = -log rho', and
    # pi_k/alpha - 1 - log(pi_k/alpha) = rho' - 1 - log rho' (>= 0). One transfer to the host for all of them.
    rho_max = rho.masked_fill(~valid, float("-inf")).amax() if rho.numel() else torch.ones(())
    n, k1, k3, rho_sum, p50, p99, rho_max, n_capped, n_masked = torch.stack(
        [valid.sum(), vsum(-log_rho), vsum(rho - 1.0 - log_rho), vsum(rho), *p50_p99, rho_max.to(rho.dtype),
         capped.sum(), (valid & ~kept).sum()]
    ).tolist()  # fmt: skip
    if n == 0:  # no valid token: no mismatch to report
        n, k1, k3, rho_sum, p50, p99, rho_max = 1, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0
    return {
        "mismatch_kl_k1": k1 / n,
        "mismatch_kl_k3": k3 / n,
        "rho_prime_mean": rho_sum / n,
        "rho_prime_p50": p50,
        "rho_prime_p99": p99,
        "rho_prime_max": rho_max,
        "is_capped_frac": n_capped / n,
        "is_masked_frac": n_masked / n,
    }


def token_advantages(advantages: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A per sequence (N,) as (N, 1), broadcast over the tokens; a per-token A (N, T) as is."""
    adv = advantages.to(dtype)
    return adv.unsqueeze(1) if adv.dim() == 1 else adv  # (N, 1) or (N, T)


class SurrogateTerms(NamedTuple):
    """`surrogate_per_token`'s result, all (N, T). clip_low / clip_high: the ratio left the interval on the side the
    advantage pushes it towards, so the min() took the flat branch; never a token MIS dropped."""

    objective: torch.Tensor  # o_t, with grad
    ratio: torch.Tensor  # rho_t = pi_theta / alpha, with grad
    clip_low: torch.Tensor  # bool: the clip removed the gradient below the interval
    clip_high: torch.Tensor  # bool: ... above it
    keep: torch.Tensor | None  # bool: the tokens MIS keeps (1/M <= rho^L <= M); None without is_mask


def surrogate_per_token(
    logp: torch.Tensor, behaviour_logp: torch.Tensor, current_logp: torch.Tensor | None, advantages: torch.Tensor, *,
    clip_eps: float = 0.2, clip_eps_high: float | None = None, clip_center: str = "current",
    is_cap: float | None = None, is_mask: float | None = None, is_level: str = "token",
    completion_mask: torch.Tensor | None = None,
) -> "SurrogateTerms":  # fmt: skip
    """The per-token clipped surrogate o_t of `policy_loss`, before the KL term and the aggregation: the
    formula of every centre, the ratios rho, rho', r, the weight w and the legend are in `policy_loss`'s
    docstring (the one place they are written). is_cap: C >= 1, decoupled centre only; is_mask: M >= 1;
    is_level: the ratio both act on; a sequence level needs completion_mask (N, T), its ratio's tokens.
    Returns `SurrogateTerms`; the caller multiplies `keep` into the mask it aggregates with.
    """
    if clip_center not in CLIP_CENTERS:
        raise ValueError(f"clip_center must be one of {CLIP_CENTERS}, got {clip_center!r}")
    if is_cap is not None and clip_center != "decoupled":
        raise ValueError(f"is_cap (TIS) caps the weight w = rho' of clip_center='decoupled'; {clip_center!r} has none")
    if is_cap is not None and not is_cap >= 1.0:  # a cap below 1 would shrink on-policy tokens (rho' = 1) too
        raise ValueError(f"is_cap must be >= 1, got {is_cap}")
    _check_is_mask(is_mask)
    if is_level != "token" and is_cap is None and is_mask is None:
        raise ValueError(f"is_level={is_level!r} is the level of is_cap (TIS) and is_mask (MIS); neither is set")
    eps_low = clip_eps
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    adv = token_advantages(advantages, logp.dtype)  # (N, 1) or (N, T)
    behaviour_logp = behaviour_logp.detach()

    ratio = torch.exp(logp - behaviour_logp)  # (N, T) rho, carries the gradient
    # log rho' and rho' (N, T); current_logp=None: the sampler is pi_k.
    log_rho = torch.zeros_like(ratio) if current_logp is None else current_logp.detach() - behaviour_logp
    rho_prime = torch.exp(log_rho)  # (N, T)
    # rho^L, the ratio of TIS and MIS: rho' itself, or one per sequence (N, 1). MIS keeps what stays in the loss.
    rho_level = rho_prime if is_level == "token" else _level_ratio(log_rho, completion_mask, is_level)
    keep = None if is_mask is None else _mis_keep(rho_level, is_mask).expand_as(ratio)  # (N, T) bool

    # pg_ratio is the ratio inside min(): rho for "current" and "behaviour", r for "decoupled".
    pg_ratio, weight = ratio, None
    lo, hi = torch.full_like(ratio, 1.0 - eps_low), torch.full_like(ratio, 1.0 + eps_high)  # (N, T) around 1
    if clip_center == "current":
        lo, hi = (rho_prime - eps_low).clamp(min=0.0), rho_prime + eps_high  # (N, T) around rho'
    elif clip_center == "decoupled":
        log_pi_k = behaviour_logp if current_logp is None else current_logp.detach()  # (N, T)
        pg_ratio = torch.exp(logp - log_pi_k)  # (N, T) r = pi_theta / pi_k, carries the gradient
        weight = rho_prime if is_cap is None else rho_level.clamp(max=is_cap).to(rho_prime.dtype)  # (N, T) or (N, 1) w
        if keep is not None:
            # A dropped token's weight is 0, not rho': an overflowing rho' = inf would make inf * 0 = nan.
            weight = torch.where(keep, weight, torch.zeros_like(weight))  # (N, T)

    unclipped = pg_ratio * adv  # (N, T)
    clipped = torch.clamp(pg_ratio, lo, hi) * adv  # (N, T)
    objective = torch.min(unclipped, clipped)  # (N, T) [A]'s f_eps(rho, rho', A), or AReaL's min()
    if weight is not None:
        objective = weight * objective  # (N, T) the decoupled objective

    # The min() picks the clipped branch, whose gradient is 0, exactly when the ratio has
    # left the interval on the side the advantage pushes it towards.
    clip_high = (pg_ratio > hi) & (adv > 0)  # (N, T)
    clip_low = (pg_ratio < lo) & (adv < 0)  # (N, T)
    if keep is not None:
        # A token MIS dropped has no gradient to clip.
        clip_high, clip_low = clip_high & keep, clip_low & keep  # (N, T)
    return SurrogateTerms(objective, ratio, clip_low, clip_high, keep)


def policy_loss(
    logp: torch.Tensor, behaviour_logp: torch.Tensor, current_logp: torch.Tensor | None, ref_logp: torch.Tensor | None,
    advantages: torch.Tensor, completion_mask: torch.Tensor, *,
    clip_eps: float = 0.2, clip_eps_high: float | None = None, clip_center: str = "current",
    beta: float = 0.0, kl_estimator: str = "k3",
    agg: str = "token-mean", max_new_tokens: int | None = None, total: float | None = None,
    is_cap: float | None = None, is_mask: float | None = None, is_level: str = "token",
) -> tuple[torch.Tensor, dict]:  # fmt: skip
    """GRPO's clipped off-policy surrogate with a KL penalty, as a loss to minimise.

        loss = - agg_{t kept} [ o_t  -  beta * kl_t ]

        rho_t  = pi_theta(y_t) / alpha(y_t) = exp(logp - behaviour_logp)          (with grad)
        rho'_t = pi_k(y_t) / alpha(y_t)     = exp(current_logp - behaviour_logp)   (detached)
        r_t    = pi_theta(y_t) / pi_k(y_t)  = exp(logp - current_logp) = rho_t / rho'_t   (with grad)

        o_t = min(rho_t A, clip(rho_t, max(rho'_t - eps_low, 0), rho'_t + eps_high) A)   "current"   ([A] f_eps)
            = min(rho_t A, clip(rho_t, 1 - eps_low, 1 + eps_high) A)                     "behaviour" (PPO)
            = w_t * min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A)                   "decoupled" (AReaL)
        w_t = rho'_t, or min(rho^L, C) with is_cap = C (TIS); a constant for the gradient
        kept: every valid token; with is_mask = M (MIS), only those with 1/M <= rho^L <= M: the
              others leave the sum and the normaliser (their KL term too), for every centre
        rho^L = rho'_t                                     is_level="token" (default)
              = R_i = prod_s rho'_s = exp(sum_s log rho'_s)   "sequence"   on every token t of sequence i; s runs
              = G_i = R_i^(1/n_i) = exp(mean_s log rho'_s)    "geometric"  over its n_i valid tokens (module doc)
        kl_t = log pi_theta - log pi_ref  (k1)  |  1/2 (log pi_theta - log pi_ref)^2  (k2)
             | pi_ref/pi_theta - 1 - log(pi_ref/pi_theta)  (k3, default)        (see `kl_penalty`)

    [A] (Mroueh et al. 2025, Algorithm 1) writes the surrogate as f_eps(rho, rho', A): the ratio
    is clipped around rho', the ratio of the policy at the start of the step, not around 1, so
    a stale sampler (v > 1) does not clip every token just for being stale. With the sampler
    refreshed this step, rho' = 1 and all three centres coincide (w = min(1, C) = 1 as C >= 1).

    AReaL (Fu et al. 2025) decouples the two jobs: r is clipped around 1 (the trust region around pi_k),
    and rho' corrects for the sampler as a separate weight. Wherever rho' > eps_low, [A]'s o_t equals
    rho' * min(r A, clip(r, 1 - eps_low/rho', 1 + eps_high/rho') A): the uncapped decoupled objective whose
    trust region in r narrows as rho' grows (docs/design.md derives it). With one inner step the gradient is
    taken at r = 1, where neither clip acts: both give the same rho'-weighted REINFORCE gradient.

    is_cap applies to the decoupled centre only: it truncates the weight w, and the "current" and
    "behaviour" centres have no separate weight (rho' sits inside rho), so is_cap with them raises. A sequence
    level replaces w by min(R, C) or min(G, C) (sequence TIS) and masks whole sequences (sequence MIS); without
    is_cap, w stays rho'_t on the tokens MIS keeps. The clip of the "current" centre stays around rho'_t.

    Legend (symbol -> argument):
        pi_theta -> logp (N, T), with grad;   alpha -> behaviour_logp (N, T);
        pi_k -> current_logp (N, T), None means "equal to behaviour_logp" (rho' = 1);
        pi_ref -> ref_logp (N, T), None means no KL term;   A -> advantages (N,);
        eps_low -> clip_eps;   eps_high -> clip_eps_high (None means clip_eps);   beta -> beta;
        C -> is_cap;   M -> is_mask;   L -> is_level.

    Args:
        completion_mask: (N, T), 1 on valid completion tokens (EOS included).
        agg, max_new_tokens, total: the aggregation; see the module docstring. With is_mask and
            micro-batches, `total` must count only the kept tokens of the whole step (`mis_keep_mask`).
        is_cap, is_mask: C >= 1, decoupled centre only (TIS); M >= 1, any centre (MIS); None: off.
        is_level: "token", "sequence" or "geometric", the ratio rho^L of is_cap and is_mask (needs one of them).

    Returns:
        loss: scalar tensor; o_t is `surrogate_per_token`'s.
        stats: floats over the valid tokens (completion_mask, MIS-dropped ones included): clip_low / clip_high
            (fraction of tokens whose gradient the clip removed, below / above the interval; a dropped token is
            never counted), kl (mean of the chosen estimator; 0 without a KL term), ratio_mean (of rho), `tokens`
            (their count). How far alpha is from pi_k (rho' quantiles, TIS / MIS fractions) does not depend on
            pi_theta: `sampler_mismatch_stats`, called once on the whole step (step.update), not per micro-batch.
    """
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {kl_estimator!r}")
    behaviour_logp, current_logp, ref_logp = neutral_outside(
        completion_mask, logp, behaviour_logp, current_logp, ref_logp
    )
    kw = dict(clip_eps=clip_eps, clip_eps_high=clip_eps_high, clip_center=clip_center, is_cap=is_cap, is_mask=is_mask)
    objective, ratio, clip_low, clip_high, keep = surrogate_per_token(
        logp, behaviour_logp, current_logp, advantages, **kw, is_level=is_level, completion_mask=completion_mask
    )
    mask = completion_mask.to(logp.dtype)  # (N, T)
    # MIS: the tokens that stay in the loss and its normaliser.
    loss_mask = completion_mask if keep is None else completion_mask * keep  # (N, T)

    if ref_logp is not None and beta != 0.0:
        kl = kl_penalty(logp, ref_logp, kl_estimator)  # (N, T) estimate of KL(pi_theta || pi_ref)
        objective = objective - beta * kl  # (N, T)
    else:
        kl = torch.zeros_like(ratio)  # (N, T)

    loss = -aggregate(objective, loss_mask, agg, max_new_tokens, total)

    with torch.no_grad():
        stats = {
            "clip_low": masked_mean(clip_low.to(mask.dtype), mask),
            "clip_high": masked_mean(clip_high.to(mask.dtype), mask),
            "kl": masked_mean(kl, mask),
            "ratio_mean": masked_mean(ratio, mask),
            "tokens": mask.sum().item(),
        }
    return loss, stats
