"""The policy objectives: GRPO's clipped off-policy surrogate with a KL penalty ([A]),
the staleness corrections of other engines (AReaL's decoupled objective, truncated and
masked sampler weights), and the REINFORCE-family losses of [B].

Every loss here takes per-token log-probs of the completions, shape (N, T), and a
`completion_mask` (N, T) that is 1 on the tokens that count: the completion tokens up to and
including EOS, of the completions whose group carries signal (the caller folds `valid` in).

Each loss is two steps: a per-token function gives the (N, T) objective and the masks its statistics need
(`surrogate_per_token`, `rec_per_token`, `opmd_per_token`), and the loss aggregates it (`policy_loss`,
`rec_loss`, `opmd_loss`). An engine with its own aggregation and KL term calls the per-token function alone
(verl_grpo.py does).

Aggregation (`agg`), the normaliser of the summed per-token objective:
    token-mean  sum over all valid tokens of the step / their count  (no length bias; default)
    seq-mean    mean over each sequence's tokens, then mean over sequences  (original GRPO)
    constant    sum / (N * max_new_tokens)  (Dr. GRPO, Liu et al. 2025)

Micro-batching must not change the math: when a step is split into micro-batches, pass
`total=aggregation_total(full_mask, agg, max_new_tokens)` computed on the whole step, so that
the micro-batch losses add up to the whole-step loss (and their gradients to its gradient).
With `is_mask` (MIS) the dropped tokens leave the normaliser too, so the whole-step mask is
`completion_mask * mis_keep_mask(behaviour_logp, current_logp, is_mask)`.

Deviations from the papers:
  1. [A] states the surrogate with a sequence-level mean (seq-mean); we default to token-mean,
     which removes the length bias that Dr. GRPO and DAPO point out. All three are available.
  2. The lower clip bound of the "current" centre is floored at 0 (`max(rho' - eps_low, 0)`):
     a ratio is never negative, so a negative bound would be vacuous anyway.
  3. `is_cap` truncates the sampler weight (TIS: w = min(rho', C)). AReaL's own
     `behav_imp_weight_cap` instead zeroes the tokens above the cap and keeps them in the
     normaliser; here dropping tokens is `is_mask`'s job, and it drops them from the normaliser too.
"""

import torch

AGGREGATIONS = ("token-mean", "seq-mean", "constant")
CLIP_CENTERS = ("current", "behaviour", "decoupled")
KL_ESTIMATORS = ("k1", "k2", "k3")


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
    """Sum `per_token` (N, T) over the masked tokens and divide by the aggregation's normaliser."""
    mask = completion_mask.to(per_token.dtype)  # (N, T)
    if total is None:
        total = aggregation_total(completion_mask, agg, max_new_tokens)
    if agg == "seq-mean":
        # Each sequence contributes its own token mean; masked-out sequences contribute 0.
        seq_len = mask.sum(dim=1).clamp(min=1)  # (N,)
        return ((per_token * mask).sum(dim=1) / seq_len).sum() / total
    return (per_token * mask).sum() / total


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean of x over mask == 1, as a float (0.0 when the mask is empty); for statistics only."""
    n = mask.sum()
    return (x * mask).sum().item() / n.item() if n.item() > 0 else 0.0


def _check_is_mask(is_mask: float | None) -> None:
    if is_mask is not None and not is_mask >= 1.0:
        raise ValueError(
            f"is_mask must be >= 1 (tokens with rho' outside [1/is_mask, is_mask] are dropped), got {is_mask}"
        )


def _mis_keep(rho_prime: torch.Tensor, is_mask: float) -> torch.Tensor:
    """(N, T) bool: True where 1/is_mask <= rho' <= is_mask (the tokens MIS keeps)."""
    return (rho_prime >= 1.0 / is_mask) & (rho_prime <= is_mask)


def mis_keep_mask(
    behaviour_logp: torch.Tensor, current_logp: torch.Tensor | None, is_mask: float | None
) -> torch.Tensor:
    """The tokens that masked importance sampling (MIS, IcePop) keeps: (N, T) bool.

        keep_t = 1[1/M <= rho'_t <= M],   rho'_t = pi_k(y_t) / alpha(y_t) = exp(current_logp - behaviour_logp)

    M -> is_mask (None keeps every token); current_logp=None means pi_k = alpha (rho' = 1, all kept).
    `policy_loss(..., is_mask=M)` drops the other tokens from the loss and from its normaliser. A
    caller that micro-batches a step computes the step's normaliser from the same tokens:

        keep = mis_keep_mask(behaviour_logp, current_logp, M)                 # (N, T) whole step
        total = aggregation_total(completion_mask * keep, agg, max_new_tokens)
    """
    if current_logp is None or is_mask is None:
        return torch.ones_like(behaviour_logp, dtype=torch.bool)  # (N, T)
    _check_is_mask(is_mask)
    rho_prime = torch.exp(current_logp.detach() - behaviour_logp.detach())  # (N, T)
    return _mis_keep(rho_prime, is_mask)  # (N, T)


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


def _mismatch_stats(
    log_rho_prime: torch.Tensor, mask: torch.Tensor, is_cap: float | None, keep: torch.Tensor | None
) -> dict:
    """The statistics of `sampler_mismatch_stats` from log rho' (N, T), a 0/1 mask and MIS's keep mask."""
    # No valid token: no mismatch to report.
    no_tokens = dict.fromkeys(("mismatch_kl_k1", "mismatch_kl_k3", "is_capped_frac", "is_masked_frac"), 0.0)
    no_tokens.update(dict.fromkeys(("rho_prime_mean", "rho_prime_p50", "rho_prime_p99", "rho_prime_max"), 1.0))
    if log_rho_prime.numel() == 0:
        return no_tokens
    valid = mask > 0  # (N, T)
    kept = valid if keep is None else valid & keep  # (N, T)
    rho_prime = torch.exp(log_rho_prime)  # (N, T)
    # TIS caps only tokens still in the loss; a token MIS dropped counts as dropped, not capped.
    capped = kept & (rho_prime > is_cap) if is_cap is not None else torch.zeros_like(valid)  # (N, T)
    # Masked-out tokens become NaN, which nanquantile skips: no boolean indexing, so no device sync.
    rho_valid = rho_prime.masked_fill(~valid, float("nan")).flatten()  # (N*T,)
    if rho_valid.dtype != torch.float64:
        rho_valid = rho_valid.float()  # (N*T,) quantiles need float32 or float64
    q = torch.tensor([0.5, 0.99], dtype=rho_valid.dtype, device=rho_valid.device)  # (2,)
    quantiles = torch.nanquantile(rho_valid, q)  # (2,) linear interpolation between order statistics

    def vsum(x: torch.Tensor) -> torch.Tensor:
        # where(), not x * mask: a masked-out token's inf or nan must not leak into the sum.
        return torch.where(valid, x, torch.zeros_like(x)).sum()

    # One transfer to the host for all of them.
    n, k1, k3, rho_sum, p50, p99, rho_max, n_capped, n_masked = torch.stack(
        [
            valid.sum(),
            # k1 and k3 of KL(alpha || pi_k) from tokens drawn from alpha: log(alpha / pi_k) = -log rho',
            # and pi_k/alpha - 1 - log(pi_k/alpha) = rho' - 1 - log rho' (>= 0).
            vsum(-log_rho_prime),
            vsum(rho_prime - 1.0 - log_rho_prime),
            vsum(rho_prime),
            quantiles[0],
            quantiles[1],
            rho_prime.masked_fill(~valid, float("-inf")).max(),
            capped.sum(),
            (valid & ~kept).sum(),
        ]
    ).tolist()
    if n == 0:
        return no_tokens
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


def sampler_mismatch_stats(
    behaviour_logp: torch.Tensor,
    current_logp: torch.Tensor | None,
    completion_mask: torch.Tensor,
    *,
    is_cap: float | None = None,
    is_mask: float | None = None,
) -> dict:
    """How far the sampler alpha is from pi_k, as floats over the valid tokens (completion_mask == 1).

        mismatch_kl_k1   mean_t [ log alpha(y_t) - log pi_k(y_t) ]     KL(alpha || pi_k), k1; y_t ~ alpha
        mismatch_kl_k3   mean_t [ rho'_t - 1 - log rho'_t ]            the same KL, k3 (>= 0, lower variance)
        rho_prime_mean, rho_prime_p50, rho_prime_p99, rho_prime_max    of rho'_t = pi_k(y_t) / alpha(y_t)
        is_capped_frac   fraction of valid tokens that TIS caps (rho' > is_cap and kept by MIS); 0 without is_cap
        is_masked_frac   fraction of valid tokens that MIS drops (rho' outside [1/is_mask, is_mask]); 0 without is_mask

    They depend on alpha and pi_k only, not on pi_theta: the same at every inner step. `policy_loss`
    reports them for its own tokens; the quantiles of a step split into micro-batches are not the
    token-weighted means of the micro-batches' quantiles, so a caller that wants the step's exact
    p50 / p99 calls this once on the whole step (torch's quantiles take at most 2**24 = 16.7M tokens).
    """
    _check_is_mask(is_mask)
    if current_logp is None:
        log_rho_prime = torch.zeros_like(behaviour_logp)  # (N, T) pi_k = alpha
    else:
        log_rho_prime = current_logp.detach() - behaviour_logp.detach()  # (N, T)
    mask = completion_mask.to(log_rho_prime.dtype)  # (N, T)
    keep = None if is_mask is None else _mis_keep(torch.exp(log_rho_prime), is_mask)  # (N, T)
    return _mismatch_stats(log_rho_prime, mask, is_cap, keep)


def _token_advantages(advantages: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A per sequence (N,) as (N, 1), broadcast over the tokens; a per-token A (N, T) as is."""
    adv = advantages.to(dtype)
    return adv.unsqueeze(1) if adv.dim() == 1 else adv  # (N, 1) or (N, T)


def surrogate_per_token(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    current_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    clip_center: str = "current",
    is_cap: float | None = None,
    is_mask: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The per-token clipped surrogate o_t of `policy_loss`, before the KL term and the aggregation.

        o_t = min(rho_t A, clip(rho_t, max(rho'_t - eps_low, 0), rho'_t + eps_high) A)   "current"   ([A] f_eps)
            = min(rho_t A, clip(rho_t, 1 - eps_low, 1 + eps_high) A)                     "behaviour" (PPO)
            = w_t * min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A)                   "decoupled" (AReaL)

        rho_t  = pi_theta(y_t) / alpha(y_t) = exp(logp - behaviour_logp)          (with grad)
        rho'_t = pi_k(y_t) / alpha(y_t)     = exp(current_logp - behaviour_logp)   (detached)
        r_t    = pi_theta(y_t) / pi_k(y_t)  = exp(logp - current_logp)             (with grad)
        w_t    = rho'_t, or min(rho'_t, C) (TIS); 0 on the tokens MIS drops; a constant for the gradient

    Legend (symbol -> argument): pi_theta -> logp (N, T), with grad; alpha -> behaviour_logp (N, T);
    pi_k -> current_logp (N, T), None means "equal to behaviour_logp" (rho' = 1); A -> advantages, (N,) per
    sequence or (N, T) per token; eps_low -> clip_eps; eps_high -> clip_eps_high (None means clip_eps);
    C -> is_cap (decoupled centre only, >= 1); M -> is_mask (>= 1). See `policy_loss` for the centres.

    Returns, all (N, T):
        objective: o_t, with grad. The caller multiplies `keep` into the mask it aggregates with.
        ratio: rho_t, with grad.
        clip_low, clip_high: bool, the tokens whose gradient the clip removed, below / above the interval
            (the ratio left it on the side the advantage pushes it towards); never a token MIS dropped.
        keep: bool, the tokens MIS keeps (1/M <= rho'_t <= M); None without is_mask.
    """
    if clip_center not in CLIP_CENTERS:
        raise ValueError(f"clip_center must be one of {CLIP_CENTERS}, got {clip_center!r}")
    if is_cap is not None and clip_center != "decoupled":
        raise ValueError(
            f"is_cap (TIS) caps the sampler weight w = rho' of clip_center='decoupled'; with "
            f"clip_center={clip_center!r} rho' sits inside the clipped ratio and there is no weight to cap"
        )
    if is_cap is not None and not is_cap >= 1.0:
        # A cap below 1 would shrink the weight of on-policy tokens (rho' = 1) as well.
        raise ValueError(f"is_cap must be >= 1, got {is_cap}")
    _check_is_mask(is_mask)
    eps_low = clip_eps
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    adv = _token_advantages(advantages, logp.dtype)  # (N, 1) or (N, T)
    behaviour_logp = behaviour_logp.detach()

    ratio = torch.exp(logp - behaviour_logp)  # (N, T) rho, carries the gradient
    if current_logp is None:
        # The sampler is pi_k.
        rho_prime = torch.ones_like(ratio)  # (N, T)
    else:
        rho_prime = torch.exp(current_logp.detach() - behaviour_logp)  # (N, T)
    # MIS: the tokens that stay in the loss and its normaliser.
    keep = None if is_mask is None else _mis_keep(rho_prime, is_mask)  # (N, T) bool

    # pg_ratio is the ratio inside min(): rho for "current" and "behaviour", r for "decoupled".
    pg_ratio, weight = ratio, None
    if clip_center == "current":
        lo = (rho_prime - eps_low).clamp(min=0.0)  # (N, T)
        hi = rho_prime + eps_high  # (N, T)
    elif clip_center == "behaviour":
        lo = torch.full_like(ratio, 1.0 - eps_low)  # (N, T)
        hi = torch.full_like(ratio, 1.0 + eps_high)  # (N, T)
    else:
        log_pi_k = behaviour_logp if current_logp is None else current_logp.detach()  # (N, T)
        pg_ratio = torch.exp(logp - log_pi_k)  # (N, T) r = pi_theta / pi_k, carries the gradient
        lo = torch.full_like(ratio, 1.0 - eps_low)  # (N, T)
        hi = torch.full_like(ratio, 1.0 + eps_high)  # (N, T)
        weight = rho_prime if is_cap is None else rho_prime.clamp(max=is_cap)  # (N, T) w, detached
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
    return objective, ratio, clip_low, clip_high, keep


def policy_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    current_logp: torch.Tensor | None,
    ref_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    clip_center: str = "current",
    beta: float = 0.0,
    agg: str = "token-mean",
    max_new_tokens: int | None = None,
    total: float | None = None,
    is_cap: float | None = None,
    is_mask: float | None = None,
    kl_estimator: str = "k3",
) -> tuple[torch.Tensor, dict]:
    """GRPO's clipped off-policy surrogate with a KL penalty, as a loss to minimise.

        loss = - agg_{t kept} [ o_t  -  beta * kl_t ]

        rho_t  = pi_theta(y_t) / alpha(y_t) = exp(logp - behaviour_logp)          (with grad)
        rho'_t = pi_k(y_t) / alpha(y_t)     = exp(current_logp - behaviour_logp)   (detached)
        r_t    = pi_theta(y_t) / pi_k(y_t)  = exp(logp - current_logp) = rho_t / rho'_t   (with grad)

        o_t = min(rho_t A, clip(rho_t, max(rho'_t - eps_low, 0), rho'_t + eps_high) A)   "current"   ([A] f_eps)
            = min(rho_t A, clip(rho_t, 1 - eps_low, 1 + eps_high) A)                     "behaviour" (PPO)
            = w_t * min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A)                   "decoupled" (AReaL)
        w_t = rho'_t, or min(rho'_t, C) with is_cap = C (TIS); a constant for the gradient
        kept: every valid token; with is_mask = M (MIS), only those with 1/M <= rho'_t <= M: the
              others leave the sum and the normaliser (their KL term too), for every centre
        kl_t = log pi_theta - log pi_ref  (k1)  |  1/2 (log pi_theta - log pi_ref)^2  (k2)
             | pi_ref/pi_theta - 1 - log(pi_ref/pi_theta)  (k3, default)        (see `kl_penalty`)

    o_t is `surrogate_per_token`'s; an engine with its own aggregation and KL term (verl_grpo.py) calls it alone.

    [A] (Mroueh et al. 2025, Algorithm 1) writes the surrogate as f_eps(rho, rho', A): the ratio
    is clipped around rho', the ratio of the policy at the start of the step, not around 1, so
    a stale sampler (v > 1) does not clip every token just for being stale. With the sampler
    refreshed this step, rho' = 1 and all three centres coincide (w = min(1, C) = 1 as C >= 1).

    AReaL (Fu et al. 2025) decouples the two jobs: r is clipped around 1 (the trust region around
    pi_k), and rho' corrects for the sampler as a separate weight. [A] is the same kind of
    objective: multiplying r and its interval by rho' > 0 gives, wherever rho'_t > eps_low,

        min(rho A, clip(rho, rho' - eps_low, rho' + eps_high) A)
            = rho' * min(r A, clip(r, 1 - eps_low/rho', 1 + eps_high/rho') A)

    so [A] is the uncapped decoupled objective whose trust region in r narrows as rho' grows.
    (For rho' <= eps_low both lower bounds are vacuous, as r >= 0, and the two still agree.)
    With one inner step the gradient is taken at r = 1, where neither clip acts: [A] and the
    uncapped decoupled form give the same rho'-weighted REINFORCE gradient.

    is_cap applies to the decoupled centre only: it truncates the weight w, and the "current" and
    "behaviour" centres have no separate weight (rho' sits inside rho), so is_cap with them raises.

    Legend (symbol -> argument):
        pi_theta -> logp (N, T), with grad;   alpha -> behaviour_logp (N, T);
        pi_k -> current_logp (N, T), None means "equal to behaviour_logp" (rho' = 1);
        pi_ref -> ref_logp (N, T), None means no KL term;   A -> advantages (N,);
        eps_low -> clip_eps;   eps_high -> clip_eps_high (None means clip_eps);   beta -> beta;
        C -> is_cap;   M -> is_mask.

    Args:
        completion_mask: (N, T), 1 on valid completion tokens (EOS included).
        agg, max_new_tokens, total: the aggregation; see the module docstring. With is_mask and
            micro-batches, `total` must count only the kept tokens of the whole step (`mis_keep_mask`).
        is_cap: C >= 1, decoupled centre only (TIS); None: no cap.
        is_mask: M >= 1, any centre (MIS); None: every valid token stays.
        kl_estimator: "k1", "k2" or "k3".

    Returns:
        loss: scalar tensor.
        stats: floats over the valid tokens (completion_mask, MIS-dropped ones included):
            clip_low / clip_high (fraction of tokens whose gradient the clip removed, below / above
            the interval; a dropped token is never counted), kl (mean of the chosen estimator; 0
            without a KL term), ratio_mean (of rho), `tokens` (their count), and the sampler
            mismatch of `sampler_mismatch_stats`: mismatch_kl_k1, mismatch_kl_k3, rho_prime_mean,
            rho_prime_p50, rho_prime_p99, rho_prime_max, is_capped_frac, is_masked_frac. All are
            token means except the quantiles and the max: p50 / p99 are this call's; a caller that
            averages micro-batches by token weight gets an approximation, exact with one micro-batch.
    """
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {kl_estimator!r}")
    objective, ratio, clip_low, clip_high, keep = surrogate_per_token(
        logp,
        behaviour_logp,
        current_logp,
        advantages,
        clip_eps=clip_eps,
        clip_eps_high=clip_eps_high,
        clip_center=clip_center,
        is_cap=is_cap,
        is_mask=is_mask,
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
            "clip_low": _masked_mean(clip_low.to(mask.dtype), mask),
            "clip_high": _masked_mean(clip_high.to(mask.dtype), mask),
            "kl": _masked_mean(kl, mask),
            "ratio_mean": _masked_mean(ratio, mask),
            **sampler_mismatch_stats(behaviour_logp, current_logp, completion_mask, is_cap=is_cap, is_mask=is_mask),
            "tokens": mask.sum().item(),
        }
    return loss, stats


def rec_per_token(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    importance_weight: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The per-token objective of REC / REC-IS ([B]), before the aggregation (`rec_loss` is -agg of it).

        o_t = A * logp_t * M_t              (rec)
        o_t = A * sg(rho_t) * logp_t * M_t  (rec-is, importance_weight=True)

        M_t = 1[A > 0 and rho_t <= 1 + eps_high] + 1[A < 0 and rho_t >= 1 - eps_low]
        rho_t = exp(logp_t - behaviour_logp_t), detached (sg = stop-gradient)

    Legend: pi_theta -> logp (N, T), with grad; alpha -> behaviour_logp (N, T); A -> advantages, (N,) per
    sequence or (N, T) per token; eps_low -> clip_eps; eps_high -> clip_eps_high (None means clip_eps).

    Returns, all (N, T): objective (o_t, with grad through logp only), ratio (rho_t, detached), and the bool
    masks clip_low / clip_high of the tokens M_t drops below 1 - eps_low (A < 0) / above 1 + eps_high (A > 0).
    """
    eps_low = clip_eps
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    adv = _token_advantages(advantages, logp.dtype)  # (N, 1) or (N, T)
    ratio = torch.exp(logp.detach() - behaviour_logp.detach())  # (N, T) detached rho
    keep_pos = (adv > 0) & (ratio <= 1.0 + eps_high)  # (N, T)
    keep_neg = (adv < 0) & (ratio >= 1.0 - eps_low)  # (N, T)
    m = (keep_pos | keep_neg).to(logp.dtype)  # (N, T) M_t
    weight = ratio if importance_weight else torch.ones_like(ratio)  # (N, T)
    objective = adv * weight * logp * m  # (N, T)
    clip_low = (adv < 0) & (ratio < 1.0 - eps_low)  # (N, T)
    clip_high = (adv > 0) & (ratio > 1.0 + eps_high)  # (N, T)
    return objective, ratio, clip_low, clip_high


def rec_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    importance_weight: bool = False,
    agg: str = "token-mean",
    max_new_tokens: int | None = None,
    total: float | None = None,
) -> tuple[torch.Tensor, dict]:
    """REC of [B] (Yao et al. 2025): REINFORCE with a one-sided clip mask, no importance weight.

        loss = - agg_t [ A * logp_t * M_t ]            (rec)
        loss = - agg_t [ A * sg(rho_t) * logp_t * M_t ] (rec-is, importance_weight=True)

        M_t = 1[A > 0 and rho_t <= 1 + eps_high] + 1[A < 0 and rho_t >= 1 - eps_low]
        rho_t = exp(logp_t - behaviour_logp_t), detached (sg = stop-gradient)

    The mask drops exactly the tokens that PPO's clip would silence: positive-advantage tokens
    already made much more likely than the sampler made them, and negative ones already made
    much less likely. Its gradient is A * M_t * grad logp_t: plain REINFORCE on the kept tokens.
    The per-token term is `rec_per_token`'s.

    Returns (loss, stats) with stats clip_low / clip_high (fraction of tokens masked on each
    side), ratio_mean and tokens.
    """
    objective, ratio, clip_low, clip_high = rec_per_token(
        logp,
        behaviour_logp,
        advantages,
        clip_eps=clip_eps,
        clip_eps_high=clip_eps_high,
        importance_weight=importance_weight,
    )
    mask = completion_mask.to(logp.dtype)  # (N, T)
    loss = -aggregate(objective, completion_mask, agg, max_new_tokens, total)
    with torch.no_grad():
        stats = {
            "clip_low": _masked_mean(clip_low.to(mask.dtype), mask),
            "clip_high": _masked_mean(clip_high.to(mask.dtype), mask),
            "ratio_mean": _masked_mean(ratio, mask),
            "tokens": mask.sum().item(),
        }
    return loss, stats


def opmd_per_token(
    logp: torch.Tensor, behaviour_logp: torch.Tensor, advantages: torch.Tensor, *, tau_reg: float = 0.1
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token loss of OPMD ([B]), before the aggregation (`opmd_loss` is agg of it; a loss, not an o_t).

        l_t = - A * logp_t + (tau_reg / 2) * (logp_t - behaviour_logp_t)^2

    Legend: pi_theta -> logp (N, T), with grad; alpha -> behaviour_logp (N, T); A -> advantages, (N,) per
    sequence or (N, T) per token (group-mean advantages r - mean(r), as [B] derives it); tau_reg -> tau_reg.

    Returns, both (N, T): per_token (l_t, with grad) and log_ratio (log rho_t = logp_t - behaviour_logp_t, with grad).
    """
    adv = _token_advantages(advantages, logp.dtype)  # (N, 1) or (N, T)
    log_ratio = logp - behaviour_logp.detach()  # (N, T)
    per_token = -adv * logp + 0.5 * tau_reg * log_ratio**2  # (N, T)
    return per_token, log_ratio


def opmd_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    tau_reg: float = 0.1,
    agg: str = "token-mean",
    max_new_tokens: int | None = None,
    total: float | None = None,
) -> tuple[torch.Tensor, dict]:
    """OPMD of [B]: REINFORCE regularised towards the sampler by a squared log-ratio.

        loss = agg_t [ - A * logp_t + (tau_reg / 2) * (logp_t - behaviour_logp_t)^2 ]

    The caller passes group-mean advantages (r - mean(r), `scale_std=False`), as [B] derives it.
    The quadratic term is the online-mirror-descent proximal penalty: it pulls pi_theta back to
    the sampler alpha in proportion to how far it has moved, instead of clipping.
    The per-token term is `opmd_per_token`'s.

    Returns (loss, stats) with stats ratio_mean, sq_log_ratio (mean of the squared log-ratio) and tokens.
    """
    per_token, log_ratio = opmd_per_token(logp, behaviour_logp, advantages, tau_reg=tau_reg)
    mask = completion_mask.to(logp.dtype)  # (N, T)
    loss = aggregate(per_token, completion_mask, agg, max_new_tokens, total)
    with torch.no_grad():
        stats = {
            "ratio_mean": _masked_mean(torch.exp(log_ratio), mask),
            "sq_log_ratio": _masked_mean(log_ratio**2, mask),
            "tokens": mask.sum().item(),
        }
    return loss, stats
