"""Other engines' staleness corrections, as arguments of [A]'s surrogate: the surrogate is `objective.policy_loss`'s
(its docstring states every formula; AReaL's decoupled objective is its clip_center="decoupled"), and this file
computes what truncated importance sampling (TIS) and masked importance sampling (MIS) add to it, at the token,
sequence and geometric levels, the two staleness masks the asynchronous trainers ship (M2PO, `m2po_keep_mask`, and
DeepSeek-V3.2's OPSM, `opsm_keep_mask`), and the statistics of how far the sampler alpha is from pi_k:

    policy_loss(logp, alpha_logp, pi_k_logp, ref_logp, A, loss_mask, clip_center=c,
                **correction_args(alpha_logp, pi_k_logp, loss_mask, clip_center=c, is_cap=C, is_mask=M, is_level=L))
    policy_loss(..., keep=m2po_keep_mask(alpha_logp, pi_k_logp, loss_mask, tau),
                keep_objective=opsm_keep_mask(alpha_logp, logp, A, loss_mask, delta))

Names as in objective.py: logp (log pi_theta), pi_k_logp, alpha_logp, ref_logp, each (N, T); rho = pi_theta / alpha,
rho' = pi_k / alpha, r = pi_theta / pi_k = rho / rho'; rho^L is `level_ratio`'s.

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

import torch

from objective import CLIP_CENTERS

IS_LEVELS = ("token", "sequence", "geometric")


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
    """The tokens MIS keeps, (N, T) bool (all of them when is_mask is None): `correction_args`'s keep on
    loss_mask's tokens.

    It depends on alpha and pi_k only, so a step split into micro-batches computes it once for the whole step and
    passes `total=aggregation_total(loss_mask * keep, agg, max_new_tokens)` to each micro-batch (train.mask_prepass)."""
    if is_mask is None:
        return torch.ones_like(alpha_logp, dtype=torch.bool)  # (N, T)
    check_is_mask(is_mask)
    rho_level = level_ratio(pi_k_logp.detach() - alpha_logp.detach(), loss_mask, is_level)
    return mis_band(rho_level, is_mask).expand_as(alpha_logp)  # (N, T)


def check_m2_threshold(m2_threshold: float | None) -> None:
    if m2_threshold is not None and not m2_threshold > 0.0:
        raise ValueError(
            f"m2_threshold must be > 0 (M2PO keeps tokens while their mean M2 is below it), got {m2_threshold}"
        )


def check_opsm_delta(delta: float | None) -> None:
    if delta is not None and not delta >= 0.0:
        raise ValueError(f"opsm delta must be >= 0 (a bound on a sequence's mean KL(alpha || pi_theta)), got {delta}")


def m2po_keep_mask(
    alpha_logp: torch.Tensor, pi_k_logp: torch.Tensor, loss_mask: torch.Tensor, m2_threshold: float
) -> torch.Tensor:
    """The tokens M2PO keeps (Zheng et al. 2025, AReaL's m2_threshold), (N, T) bool, True outside loss_mask: a keep
    for `objective.policy_loss` with any clip centre (a dropped token leaves the sum and the normaliser).

        M2_t = (log alpha(y_t) - log pi_k(y_t))^2 = (log rho'_t)^2     over the step's loss tokens, n of them
        sort them descending, M2_(1) >= ... >= M2_(n); drop the first m, keep the rest, where
        m = the least j with mean(M2_(j+1), ..., M2_(n)) < tau,   or n - 1 when there is none (then M2_(n) >= tau)

    so the kept tokens' second moment is below tau, dropping as few tokens as that takes, the largest first. Ties at
    the cut leave in the tokens' order (row-major: the earlier leaves first): a stable sort, so the mask does not
    depend on the sort kernel (AReaL's unstable sort does). The suffix means are float64, a sum over every token of
    the step. It depends on alpha and pi_k only: one mask for the whole step and all its inner steps, computed before
    the first micro-batch (train.mask_prepass), where AReaL computes it per micro-batch of its engine.
    A non-finite M2 (log alpha = -inf) sorts first and leaves; on-policy (alpha = pi_k) every M2 is 0 and all stay.
    """
    check_m2_threshold(m2_threshold)
    valid = (loss_mask > 0).flatten()  # (N*T,)
    m2 = (alpha_logp.detach().double() - pi_k_logp.detach().double()).square().flatten()[valid]  # (n,)
    keep = torch.ones_like(valid)  # (N*T,) True outside the loss: the caller multiplies by loss_mask
    n = m2.numel()
    if n == 0:
        return keep.view_as(loss_mask)
    # nan_to_num: a NaN M2 (inf - inf) sorts as +inf, first, and leaves with the largest
    m2_sorted, order = torch.sort(m2.nan_to_num(nan=float("inf")), descending=True, stable=True)  # (n,) each
    # mean of M2_(j+1..n) for j = 0..n-1: the suffix sums, accumulated from the smallest so that an inf among the
    # largest reaches only the suffixes that hold it
    suffix_sum = m2_sorted.flip(0).cumsum(0).flip(0)  # (n,)
    suffix_mean = suffix_sum / torch.arange(n, 0, -1, dtype=suffix_sum.dtype, device=suffix_sum.device)  # (n,)
    below = suffix_mean < m2_threshold  # (n,)
    m = int(below.to(torch.int8).argmax()) if bool(below.any()) else n - 1  # how many of the largest leave
    kept_sorted = torch.arange(n, device=m2.device) >= m  # (n,)
    kept = torch.empty_like(kept_sorted)
    kept[order] = kept_sorted  # (n,) back in the tokens' order
    keep[valid] = kept
    return keep.view_as(loss_mask)  # (N, T)


def opsm_keep_mask(
    alpha_logp: torch.Tensor,
    logp: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    delta: float,
) -> torch.Tensor:
    """The sequences DeepSeek-V3.2's off-policy sequence masking (OPSM; TRL's off_policy_mask_threshold) keeps, (N, 1)
    bool ((N, T) for a per-token A): `objective.policy_loss`'s keep_objective, with any clip centre.

        sequence i leaves  iff  A_i < 0  and  D_i > delta,   D_i = (1/n_i) sum_t [log alpha(y_t) - log pi_theta(y_t)]

    D_i is the k1 estimate of KL(alpha || pi_theta) over sequence i's n_i loss tokens (D_i = 0 without one), pi_theta
    detached: a bad sample the policy has moved away from teaches little and destabilises. As TRL: a dropped
    sequence's surrogate is 0 but it stays in the normaliser, and its KL term stays (policy_loss's keep_objective);
    a NaN log-prob (a token that could not be scored) is no evidence (0). pi_theta is the current forward's, so the
    mask may change from one inner step to the next; a per-sequence mean, it does not depend on the micro-batches.
    """
    check_opsm_delta(delta)
    valid = loss_mask > 0  # (N, T)
    k1 = alpha_logp.detach().double() - logp.detach().double()  # (N, T) log alpha - log pi_theta
    k1 = torch.where(valid & ~k1.isnan(), k1, 0.0)  # where(): an inf on padding must not reach the sum
    d = k1.sum(dim=1, keepdim=True) / valid.sum(dim=1, keepdim=True).clamp(min=1)  # (N, 1) D_i
    A = advantages.detach()
    A = A.unsqueeze(1) if A.dim() == 1 else A  # (N, 1) or (N, T)
    return (A >= 0) | (d <= delta)  # (N, 1) or (N, T)


def correction_args(
    alpha_logp: torch.Tensor,
    pi_k_logp: torch.Tensor,
    loss_mask: torch.Tensor | None,
    *,
    clip_center: str,
    is_cap: float | None = None,
    is_mask: float | None = None,
    is_level: str = "token",
) -> dict:
    """objective.policy_loss's (and objective.surrogate's) `weight` and `keep` for TIS and MIS, {"weight": ...,
    "keep": ...}, each None when not used:

        weight = min(rho^L, C)                  is_cap = C (TIS): the w_t of clip_center="decoupled", none other
        keep   = 1/M <= rho^L <= M, (N, T) bool   is_mask = M (MIS), with every centre
        rho^L = rho'_t                                       is_level="token"
              = R_i = prod_s rho'_s = exp(sum_s log rho'_s)   "sequence"    on every token t of sequence i,
              = G_i = R_i^(1/n_i) = exp(mean_s log rho'_s)    "geometric"   s over its n_i tokens in loss_mask

    A sequence level caps by min(R, C) or min(G, C) and masks whole sequences; the clip of the "pi_k" centre stays
    around rho'_t. C and M are >= 1 (a cap below 1 would shrink on-policy tokens, rho' = 1, too). A token outside
    loss_mask counts as rho' = 1, as policy_loss's ratios do there; loss_mask None (token level only): every token
    counts. With is_mask and micro-batches, `total` counts only the kept tokens of the whole step (`mis_keep_mask`).
    """
    if clip_center not in CLIP_CENTERS:
        raise ValueError(f"clip_center must be one of {CLIP_CENTERS}, got {clip_center!r}")
    if is_cap is not None and clip_center != "decoupled":
        raise ValueError(f"is_cap (TIS) caps the weight w = rho' of clip_center='decoupled'; {clip_center!r} has none")
    if is_cap is not None and not is_cap >= 1.0:  # a cap below 1 would shrink on-policy tokens (rho' = 1) too
        raise ValueError(f"is_cap must be >= 1, got {is_cap}")
    check_is_mask(is_mask)
    if is_level != "token" and is_cap is None and is_mask is None:
        raise ValueError(f"is_level={is_level!r} is the level of is_cap (TIS) and is_mask (MIS); neither is set")
    if is_cap is None and is_mask is None:
        return {"weight": None, "keep": None}
    log_rho_prime = pi_k_logp.detach() - alpha_logp.detach()  # (N, T)
    if loss_mask is not None:  # rho' = 1 outside the mask: an overflow on padding reaches neither weight nor keep
        log_rho_prime = torch.where(loss_mask > 0, log_rho_prime, 0.0)  # (N, T)
    rho_level = level_ratio(log_rho_prime, loss_mask, is_level)  # (N, T) or (N, 1)
    weight = None if is_cap is None else rho_level.clamp(max=is_cap).to(log_rho_prime.dtype)  # (N, T) or (N, 1)
    keep = None if is_mask is None else mis_band(rho_level, is_mask).expand_as(log_rho_prime)  # (N, T)
    return {"weight": weight, "keep": keep}


def staleness_stats(
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
