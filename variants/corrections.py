"""Other engines' staleness corrections, beside [A]'s surrogate (objective.py): AReaL's decoupled objective,
truncated importance sampling (TIS), masked importance sampling (MIS), their sequence and geometric levels, and
the statistics of how far the sampler alpha is from pi_k.

Names as in objective.py: logp (log pi_theta), pi_k_logp, alpha_logp, ref_logp, each (N, T); rho = pi_theta / alpha,
rho' = pi_k / alpha, r = pi_theta / pi_k = rho / rho'. Every formula is in `corrected_policy_loss`'s docstring.

How the engines name these (their old policy is pi_k, vLLM's alpha, their PPO loss times the correction weight
the decoupled centre; tests/test_sequence_is.py pins or contrasts each):
    sequence, is_cap=C    TRL 1.16 vllm_importance_sampling_mode="sequence_truncate" (clip_max=C, clip_min=None);
                          verl 0.9 rollout_is="sequence", rollout_is_threshold=C
    sequence, is_mask=M   verl rollout_rs="seq_sum_k1", threshold M. TRL's "sequence_mask" (clip_max=M) is this
                          with is_cap=M, but one-sided unless clip_min=1/M, masked sequences kept in its normaliser
    geometric, is_mask=M  verl's Geo-RS, rollout_rs="seq_mean_k1" ("geometric" in verl 0.6), threshold M
    geometric, is_cap=C   neither engine

Deviation from AReaL: `is_cap` truncates the weight (TIS: w = min(rho', C)), where AReaL's `behav_imp_weight_cap`
zeroes the tokens above the cap. Dropping tokens is `is_mask`'s job, and it drops them from the normaliser too.
"""

from typing import NamedTuple

import torch

from objective import (
    CLIP_CENTERS,
    KL_ESTIMATORS,
    clip_interval,
    loss_stats,
    neutral_outside,
    penalised_loss,
    token_advantages,
)

CENTERS = (*CLIP_CENTERS, "decoupled")
IS_LEVELS = ("token", "sequence", "geometric")


class CorrectedSurrogate(NamedTuple):
    """`corrected_surrogate`'s result, all (N, T). The clip fractions never count a token MIS dropped."""

    objective: torch.Tensor  # o_t, with grad
    rho: torch.Tensor  # pi_theta / alpha, with grad
    clip_low: torch.Tensor  # bool: the clip removed the gradient below the interval
    clip_high: torch.Tensor  # bool: ... above it
    keep: torch.Tensor | None  # bool: the tokens MIS keeps (1/M <= rho^L <= M); None without is_mask


def check_is_mask(is_mask: float | None) -> None:
    if is_mask is not None and not is_mask >= 1.0:
        raise ValueError(f"is_mask must be >= 1 (MIS keeps the ratios in [1/is_mask, is_mask]), got {is_mask}")


def mis_band(rho_level: torch.Tensor, is_mask: float) -> torch.Tensor:
    """(N, T) or (N, 1) bool: True where 1/is_mask <= the ratio <= is_mask (what MIS keeps)."""
    return (rho_level >= 1.0 / is_mask) & (rho_level <= is_mask)


def level_ratio(log_rho_prime: torch.Tensor, loss_mask: torch.Tensor | None, is_level: str) -> torch.Tensor:
    """rho^L, the ratio TIS and MIS act on, from log rho' (N, T): rho'_t itself (N, T) at is_level="token";
    R = exp(sum_t log rho'_t) or G = exp(mean_t log rho'_t) (N, 1), float64, t over the mask's tokens, otherwise."""
    if is_level == "token":
        return torch.exp(log_rho_prime)  # (N, T)
    if is_level not in IS_LEVELS:
        raise ValueError(f"is_level must be one of {IS_LEVELS}, got {is_level!r}")
    if loss_mask is None:
        raise ValueError(f"is_level={is_level!r} needs loss_mask (the tokens a sequence's ratio runs over)")
    keep = loss_mask > 0  # (N, T)
    # A sum of log-ratios, not a product of ratios: no overflow on the way; where(): nothing outside the mask counts.
    log_seq = torch.where(keep, log_rho_prime.double(), 0.0).sum(dim=1, keepdim=True)  # (N, 1) log R
    if is_level == "geometric":
        log_seq = log_seq / keep.sum(dim=1, keepdim=True).clamp(min=1)  # (N, 1) log G
    return torch.exp(log_seq)  # (N, 1)


def mis_keep_mask(
    alpha_logp: torch.Tensor,
    pi_k_logp: torch.Tensor,
    is_mask: float | None,
    *,
    loss_mask: torch.Tensor | None = None,
    is_level: str = "token",
) -> torch.Tensor:
    """The tokens MIS keeps, (N, T) bool (all of them when is_mask is None): `corrected_policy_loss`'s keep_t.

    It depends on alpha and pi_k only, so a step split into micro-batches computes it once for the whole step and
    passes `total=aggregation_total(loss_mask * keep, agg, max_new_tokens)` to each micro-batch (step.update)."""
    if is_mask is None:
        return torch.ones_like(alpha_logp, dtype=torch.bool)  # (N, T)
    check_is_mask(is_mask)
    rho_level = level_ratio(pi_k_logp.detach() - alpha_logp.detach(), loss_mask, is_level)
    return mis_band(rho_level, is_mask).expand_as(alpha_logp)  # (N, T)


def corrected_surrogate(
    logp: torch.Tensor,
    alpha_logp: torch.Tensor,
    pi_k_logp: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    clip_center: str = "pi_k",
    is_cap: float | None = None,
    is_mask: float | None = None,
    is_level: str = "token",
    loss_mask: torch.Tensor | None = None,
) -> CorrectedSurrogate:
    """The per-token o_t of `corrected_policy_loss`, before the KL term and the aggregation (verl's plugin calls it
    alone). A sequence level needs loss_mask, the tokens its ratio runs over. The caller multiplies `keep` into the
    mask it aggregates with."""
    if clip_center not in CENTERS:
        raise ValueError(f"clip_center must be one of {CENTERS}, got {clip_center!r}")
    if is_cap is not None and clip_center != "decoupled":
        raise ValueError(f"is_cap (TIS) caps the weight w = rho' of clip_center='decoupled'; {clip_center!r} has none")
    if is_cap is not None and not is_cap >= 1.0:  # a cap below 1 would shrink on-policy tokens (rho' = 1) too
        raise ValueError(f"is_cap must be >= 1, got {is_cap}")
    check_is_mask(is_mask)
    if is_level != "token" and is_cap is None and is_mask is None:
        raise ValueError(f"is_level={is_level!r} is the level of is_cap (TIS) and is_mask (MIS); neither is set")
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    A = token_advantages(advantages, logp.dtype)  # (N, 1) or (N, T)
    alpha_logp, pi_k_logp = alpha_logp.detach(), pi_k_logp.detach()
    rho = torch.exp(logp - alpha_logp)  # (N, T) carries the gradient
    log_rho_prime = pi_k_logp - alpha_logp  # (N, T)
    rho_prime = torch.exp(log_rho_prime)  # (N, T)
    rho_level = rho_prime if is_level == "token" else level_ratio(log_rho_prime, loss_mask, is_level)
    keep = None if is_mask is None else mis_band(rho_level, is_mask).expand_as(rho)  # (N, T) bool

    if clip_center == "decoupled":
        clipped_ratio = torch.exp(logp - pi_k_logp)  # (N, T) r = pi_theta / pi_k, carries the gradient
        lo, hi = clip_interval(rho_prime, "alpha", clip_eps, eps_high)  # [1 - eps_low, 1 + eps_high], now around r
        weight = rho_prime if is_cap is None else rho_level.clamp(max=is_cap).to(rho_prime.dtype)  # w
        if keep is not None:
            # A dropped token's weight is 0, not rho': an overflowing rho' = inf would make inf * 0 = nan.
            weight = torch.where(keep, weight, torch.zeros_like(weight))  # (N, T)
    else:
        clipped_ratio, weight = rho, None
        lo, hi = clip_interval(rho_prime, clip_center, clip_eps, eps_high)  # (N, T) each

    objective = torch.min(clipped_ratio * A, torch.clamp(clipped_ratio, lo, hi) * A)  # (N, T)
    if weight is not None:
        objective = weight * objective  # (N, T) the decoupled objective
    clip_high = (clipped_ratio > hi) & (A > 0)  # (N, T)
    clip_low = (clipped_ratio < lo) & (A < 0)  # (N, T)
    if keep is not None:
        # A token MIS dropped has no gradient to clip.
        clip_high, clip_low = clip_high & keep, clip_low & keep  # (N, T)
    return CorrectedSurrogate(objective, rho, clip_low, clip_high, keep)


def corrected_policy_loss(
    logp: torch.Tensor,
    alpha_logp: torch.Tensor,
    pi_k_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    clip_center: str = "pi_k",
    beta: float = 0.0,
    kl_estimator: str = "k3",
    kl_importance_weight: bool = False,
    agg: str = "token-mean",
    max_new_tokens: int | None = None,
    total: float | None = None,
    is_cap: float | None = None,
    is_mask: float | None = None,
    is_level: str = "token",
) -> tuple[torch.Tensor, dict]:
    """The policy loss with another engine's staleness correction: `objective.policy_loss`, with these changes.

        loss = - agg_{t kept} [ o_t - beta kl_t ]

        o_t = w_t * min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A)    clip_center="decoupled" (AReaL)
              (clip_center "pi_k" or "alpha": [A]'s or PPO's o_t, as objective.policy_loss states them)
        r_t = pi_theta(y_t) / pi_k(y_t) = rho_t / rho'_t                  with grad
        w_t = rho'_t, or min(rho^L, C) with is_cap = C (TIS)              a constant for the gradient
        kept: every token of loss_mask; with is_mask = M (MIS), only those with 1/M <= rho^L <= M: the others
              leave the sum and the normaliser (their KL term too), for every centre
        rho^L = rho'_t                                       is_level="token"
              = R_i = prod_s rho'_s = exp(sum_s log rho'_s)   "sequence"    on every token t of sequence i,
              = G_i = R_i^(1/n_i) = exp(mean_s log rho'_s)    "geometric"   s over its n_i tokens in loss_mask

    AReaL (Fu et al. 2025) decouples the two jobs of [A]'s clip: r is clipped around 1 (a trust region around
    pi_k), and rho' corrects for the sampler as a separate weight. Wherever rho' > eps_low, [A]'s o_t equals
    rho' min(r A, clip(r, 1 - eps_low/rho', 1 + eps_high/rho') A): the uncapped decoupled objective with a trust
    region in r that narrows as rho' grows (docs/design.md derives it). At a refresh rho' = 1, w = min(1, C) = 1,
    and all three centres coincide.

    is_cap needs the decoupled centre (the others have no separate weight: rho' sits inside rho). is_mask works with
    every centre. A sequence level caps by min(R, C) or min(G, C) and masks whole sequences; the clip of the
    "pi_k" centre stays around rho'_t.

    Legend as objective.policy_loss's, and C -> is_cap (>= 1), M -> is_mask (>= 1), L -> is_level. With is_mask
    and micro-batches, `total` counts only the kept tokens of the whole step (`mis_keep_mask`).

    Returns the loss and objective.loss_stats over loss_mask's tokens (MIS-dropped ones included).
    """
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {kl_estimator!r}")
    alpha_logp, pi_k_logp, ref_logp = neutral_outside(loss_mask, logp, alpha_logp, pi_k_logp, ref_logp)
    objective, rho, clip_low, clip_high, keep = corrected_surrogate(
        logp,
        alpha_logp,
        pi_k_logp,
        advantages,
        clip_eps=clip_eps,
        clip_eps_high=clip_eps_high,
        clip_center=clip_center,
        is_cap=is_cap,
        is_mask=is_mask,
        is_level=is_level,
        loss_mask=loss_mask,
    )
    kept = loss_mask if keep is None else loss_mask * keep  # (N, T) MIS: what stays in the loss and its normaliser
    kl_weight = rho if kl_importance_weight else None
    loss, kl = penalised_loss(
        objective, logp, ref_logp, kept, beta, kl_estimator, agg, max_new_tokens, total, kl_weight
    )
    return loss, loss_stats(loss_mask, rho, clip_low, clip_high, kl)


def sampler_mismatch_stats(
    alpha_logp: torch.Tensor,
    pi_k_logp: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    is_cap: float | None = None,
    is_mask: float | None = None,
    is_level: str = "token",
) -> dict:
    """How far the sampler alpha is from pi_k, as floats over loss_mask's tokens:

        mismatch_kl_k1   mean_t [ log alpha(y_t) - log pi_k(y_t) ]     KL(alpha || pi_k), k1; y_t ~ alpha
        mismatch_kl_k3   mean_t [ rho'_t - 1 - log rho'_t ]            the same KL, k3 (>= 0, lower variance)
        rho_prime_mean, rho_prime_p50, rho_prime_p99, rho_prime_max    of rho'_t = pi_k(y_t) / alpha(y_t)
        is_capped_frac   the fraction of tokens TIS caps (rho^L > is_cap and kept by MIS); 0 without is_cap
        is_masked_frac   the fraction of tokens MIS drops (rho^L outside [1/is_mask, is_mask]); 0 without is_mask

    They depend on alpha and pi_k only, not on pi_theta, so a step computes them once, on the whole step: quantiles
    of micro-batches do not combine (torch's quantiles take at most 2**24 = 16.7M tokens).
    """
    check_is_mask(is_mask)
    log_rho_prime = pi_k_logp.detach() - alpha_logp.detach()  # (N, T)
    valid = loss_mask > 0  # (N, T)
    rho_prime = torch.exp(log_rho_prime)  # (N, T)
    rho_level = rho_prime if is_level == "token" else level_ratio(log_rho_prime, loss_mask, is_level)
    kept = valid if is_mask is None else valid & mis_band(rho_level, is_mask)  # (N, T)
    # TIS caps only tokens still in the loss; a token MIS dropped counts as dropped, not capped.
    capped = kept & (rho_level > is_cap) if is_cap is not None else torch.zeros_like(valid)  # (N, T)
    # Masked-out tokens become NaN, which nanquantile skips: no boolean indexing, so no device sync.
    rho_valid = rho_prime.masked_fill(~valid, float("nan")).flatten()  # (N*T,)
    rho_valid = rho_valid if rho_valid.dtype == torch.float64 else rho_valid.float()  # quantiles need fp32/64
    q = torch.tensor([0.5, 0.99], dtype=rho_valid.dtype, device=rho_valid.device)  # (2,)
    p50_p99 = torch.nanquantile(rho_valid, q) if rho_valid.numel() else torch.ones_like(q)  # (2,) linear interp.
    rho_max = rho_prime.masked_fill(~valid, float("-inf")).amax() if rho_prime.numel() else torch.ones(())

    def valid_sum(x):
        return torch.where(valid, x, torch.zeros_like(x)).sum()  # where(): an inf outside must not leak in

    # k1 and k3 of KL(alpha || pi_k) from tokens drawn from alpha: log(alpha / pi_k) = -log rho', and
    # pi_k/alpha - 1 - log(pi_k/alpha) = rho' - 1 - log rho' (>= 0).
    sums = {
        "tokens": valid.sum(),
        "kl_k1": valid_sum(-log_rho_prime),
        "kl_k3": valid_sum(rho_prime - 1.0 - log_rho_prime),
        "rho_prime": valid_sum(rho_prime),
        "p50": p50_p99[0],
        "p99": p50_p99[1],
        "max": rho_max.to(rho_prime.dtype),
        "capped": capped.sum(),
        "masked": (valid & ~kept).sum(),
    }
    # One transfer to the host for all of them.
    s = dict(zip(sums, torch.stack([x.to(rho_prime.dtype) for x in sums.values()]).tolist()))
    n = s["tokens"]
    if n == 0:  # no token in the loss: no mismatch to report (rho' = 1, no KL)
        s.update(kl_k1=0.0, kl_k3=0.0, rho_prime=1.0, p50=1.0, p99=1.0, max=1.0)
        n = 1
    return {
        "mismatch_kl_k1": s["kl_k1"] / n,
        "mismatch_kl_k3": s["kl_k3"] / n,
        "rho_prime_mean": s["rho_prime"] / n,
        "rho_prime_p50": s["p50"],
        "rho_prime_p99": s["p99"],
        "rho_prime_max": s["max"],
        "is_capped_frac": s["capped"] / n,
        "is_masked_frac": s["masked"] / n,
    }
