"""Other engines' staleness corrections, each a unit of variants/registry.py around [A]'s surrogate
(objective.policy_loss), with the functions they compute:

    kl-is       the KL term weighted by rho = pi_theta / alpha (TRL's use_bias_correction_kl; --kl-importance-weight)
    opsm        DeepSeek-V3.2's off-policy sequence mask (`opsm_keep_mask`; --opsm-delta)
    decoupled   AReaL's decoupled objective: PPO's clip on r = pi_theta / pi_k, weighted by rho' (--clip-center
                decoupled)
    tis         the decoupled objective with its weight truncated, min(rho^L, C) (`correction_args`; --is-cap)
    mis         masked importance sampling: the tokens or sequences with rho^L outside [1/M, M] leave (--is-mask)
    m2po        M2PO's second-moment mask (`m2po_keep_mask`; --m2-threshold)

Names as in objective.py: logp (log pi_theta), pi_k_logp, alpha_logp, ref_logp, each (N, T); rho = pi_theta / alpha,
rho' = pi_k / alpha, r = pi_theta / pi_k = rho / rho'; rho^L is `level_ratio`'s.

How the engines name these (their old policy is pi_k, vLLM's alpha, their PPO loss times the correction weight
the decoupled objective; tests/test_sequence_is.py pins or contrasts each):
    sequence, is_cap=C    TRL 1.16 vllm_importance_sampling_mode="sequence_truncate" (clip_max=C, clip_min=None);
                          verl 0.9 rollout_is="sequence", rollout_is_threshold=C
    sequence, is_mask=M   verl rollout_rs="seq_sum_k1", threshold M. TRL's "sequence_mask" (clip_max=M) is this
                          with is_cap=M, but one-sided unless clip_min=1/M, masked sequences kept in its normaliser
    geometric, is_mask=M  verl's Geo-RS, rollout_rs="seq_mean_k1" ("geometric" in verl 0.6), threshold M
    geometric, is_cap=C   neither engine

Deviation from AReaL: `is_cap` truncates the weight (TIS: w = min(rho', C)), where AReaL's `behav_imp_weight_cap`
zeroes the tokens above the cap. Dropping tokens is `is_mask`'s job, and it drops them from the normaliser too.
"""

from dataclasses import replace

import torch

from objective import LossInput, aggregate, kl_penalty, masked_mean, neutral_outside
from variants.registry import Variant, register

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
    is_cap: float | None = None,
    is_mask: float | None = None,
    is_level: str = "token",
) -> dict:
    """TIS's weight and MIS's kept tokens, {"weight": ..., "keep": ...}, each None when not used:

        weight = min(rho^L, C)                  is_cap = C (TIS): the w_t of the decoupled objective (`TIS`)
        keep   = 1/M <= rho^L <= M, (N, T) bool   is_mask = M (MIS), with every centre
        rho^L = rho'_t                                       is_level="token"
              = R_i = prod_s rho'_s = exp(sum_s log rho'_s)   "sequence"    on every token t of sequence i,
              = G_i = R_i^(1/n_i) = exp(mean_s log rho'_s)    "geometric"   s over its n_i tokens in loss_mask

    A sequence level caps by min(R, C) or min(G, C) and masks whole sequences; the clip of the "pi_k" centre stays
    around rho'_t. C and M are >= 1 (a cap below 1 would shrink on-policy tokens, rho' = 1, too). A token outside
    loss_mask counts as rho' = 1, as policy_loss's ratios do there; loss_mask None (token level only): every token
    counts. With is_mask and micro-batches, `total` counts only the kept tokens of the whole step (`mis_keep_mask`).
    """
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


# ---- the units (variants/registry.py), outermost first: kl-is and opsm read the sampler's alpha, which the
# decoupled objective then replaces by pi_k ----------------------------------------------------------------------


@register("kl-is")
class KLImportanceWeight(Variant):
    """The KL term weighted by rho_t = pi_theta / alpha, with its gradient: on alpha's samples rho_t kl_t estimates
    E_alpha[rho k] = E_pi_theta[k] = KL(pi_theta || pi_ref) for k1 and k3 ([A]'s own term; TRL's
    use_bias_correction_kl, DeepSeek-V3.2's unbiased KL):

        loss = inner(x, beta = 0) + beta (1 / Z) sum_{t in L} rho_t kl_t
    """

    def __init__(self, beta: float, kl_estimator: str):
        self.beta, self.kl_estimator = beta, kl_estimator

    @classmethod
    def from_config(cls, cfg):
        return cls(cfg.beta, cfg.kl_estimator) if cfg.kl_importance_weight else None

    def loss(self, x: LossInput, inner, **settings):
        loss, stats = inner(x, **(settings | {"beta": 0.0}))
        if x.ref_logp is None or self.beta == 0.0:
            return loss, stats
        alpha_logp, ref_logp = neutral_outside(x.loss_mask, x.logp, x.alpha_logp, x.ref_logp)
        kl = torch.exp(x.logp - alpha_logp) * kl_penalty(x.logp, ref_logp, self.kl_estimator)  # (N, T) rho_t kl_t
        loss = loss + self.beta * aggregate(kl, x.loss_mask, settings["agg"], x.total)
        return loss, stats | {"kl": masked_mean(kl.detach(), x.loss_mask.to(kl.dtype))}


@register("opsm")
class OPSM(Variant):
    """DeepSeek-V3.2's off-policy sequence mask (`opsm_keep_mask`): a sequence with A < 0 whose mean
    log alpha - log pi_theta exceeds delta keeps no surrogate term. Its advantage becomes 0, so its o_t is 0 while
    it stays in Z and keeps its KL term, as TRL's off_policy_mask_threshold does."""

    def __init__(self, delta: float):
        check_opsm_delta(delta)
        self.delta = delta

    @classmethod
    def from_config(cls, cfg):
        return None if cfg.opsm_delta is None else cls(cfg.opsm_delta)

    def loss(self, x: LossInput, inner, **settings):
        keep = opsm_keep_mask(x.alpha_logp, x.logp, x.advantages, x.loss_mask, self.delta)  # (N, 1) or (N, T)
        A = x.advantages if x.advantages.dim() == 2 else x.advantages.unsqueeze(1)  # (N, 1) or (N, T)
        loss, stats = inner(replace(x, advantages=torch.where(keep, A, torch.zeros_like(A))), **settings)
        dropped = (~keep).expand_as(x.loss_mask).double()  # (N, T)
        return loss, stats | {"opsm_masked_frac": masked_mean(dropped, x.loss_mask)}


@register("decoupled")
class Decoupled(Variant):
    """AReaL's decoupled objective (Fu et al. 2025): the clip's two jobs apart, PPO's clip on r = pi_theta / pi_k
    (a trust region around pi_k) and the sampler's correction as a separate weight w_t = rho'_t:

        o_t = w_t min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A) = min(r_t (w_t A), clip(r_t, ...) (w_t A))

    (w >= 0), which is objective.policy_loss's o_t on the input with alpha <- pi_k (so rho = r and rho' = 1: the
    interval is [1 - eps_low, 1 + eps_high]) and A <- w A. Wherever rho' > eps_low, [A]'s o_t equals
    rho' min(r A, clip(r, 1 - eps_low/rho', 1 + eps_high/rho') A): the uncapped decoupled objective with a trust
    region in r that narrows as rho' grows (docs/design.md derives it)."""

    @classmethod
    def from_config(cls, cfg):
        return cls() if cfg.clip_center == "decoupled" and cfg.is_cap is None else None

    def weight(self, x: LossInput) -> torch.Tensor:
        """w_t (N, T): rho'_t, 1 outside the mask (an inf there must not meet a zero gradient)."""
        log_rho_prime = torch.where(x.loss_mask > 0, x.pi_k_logp.detach() - x.alpha_logp.detach(), 0.0)
        return torch.exp(log_rho_prime)  # (N, T)

    def loss(self, x: LossInput, inner, **settings):
        w = self.weight(x).to(x.logp.dtype)  # (N, T) or (N, 1)
        A = x.advantages if x.advantages.dim() == 2 else x.advantages.unsqueeze(1)  # (N, 1) or (N, T)
        x = replace(x, alpha_logp=x.pi_k_logp, advantages=w * A)
        return inner(x, **(settings | {"clip_center": "alpha"}))


@register("tis")
class TIS(Decoupled):
    """Truncated importance sampling: the decoupled objective with w = min(rho^L, C) (`correction_args`)."""

    def __init__(self, is_cap: float, is_level: str):
        if not is_cap >= 1.0:  # a cap below 1 would shrink on-policy tokens (rho' = 1) too
            raise ValueError(f"is_cap must be >= 1, got {is_cap}")
        self.is_cap, self.is_level = is_cap, is_level

    @classmethod
    def from_config(cls, cfg):
        return None if cfg.is_cap is None else cls(cfg.is_cap, cfg.is_level)

    def weight(self, x: LossInput) -> torch.Tensor:
        w = correction_args(x.alpha_logp, x.pi_k_logp, x.loss_mask, is_cap=self.is_cap, is_level=self.is_level)
        return torch.where(x.loss_mask > 0, w["weight"], 1.0)  # (N, T)

    def step_stats(self, alpha_logp, pi_k_logp, loss_mask) -> dict:
        """is_capped_frac: the share of the loss's tokens whose weight the cap truncates (rho^L > C)."""
        log_rho_prime = torch.where(loss_mask > 0, pi_k_logp - alpha_logp, 0.0)  # (N, T)
        capped = (level_ratio(log_rho_prime, loss_mask, self.is_level) > self.is_cap).expand_as(loss_mask)
        return {"is_capped_frac": masked_mean(capped.double(), loss_mask)}


@register("mis")
class MIS(Variant):
    """Masked importance sampling: the tokens (or whole sequences) with rho^L outside [1/M, M] leave the loss and
    its normaliser for the whole step (`mis_keep_mask`)."""

    def __init__(self, is_mask: float, is_level: str):
        check_is_mask(is_mask)
        self.is_mask, self.is_level = is_mask, is_level

    @classmethod
    def from_config(cls, cfg):
        return None if cfg.is_mask is None else cls(cfg.is_mask, cfg.is_level)

    def step_keep(self, alpha_logp, pi_k_logp, loss_mask):
        keep = mis_keep_mask(alpha_logp, pi_k_logp, self.is_mask, loss_mask=loss_mask, is_level=self.is_level)
        return keep, {"is_masked_frac": masked_mean((~keep).double(), loss_mask)}


@register("m2po")
class M2PO(Variant):
    """M2PO (Zheng et al. 2025, AReaL's m2_threshold): the fewest tokens, the largest (log rho')^2 first, leave the
    whole step so that the kept tokens' mean (log rho')^2 is below tau (`m2po_keep_mask`)."""

    def __init__(self, m2_threshold: float):
        check_m2_threshold(m2_threshold)
        self.m2_threshold = m2_threshold

    @classmethod
    def from_config(cls, cfg):
        return None if cfg.m2_threshold is None else cls(cfg.m2_threshold)

    def step_keep(self, alpha_logp, pi_k_logp, loss_mask):
        keep = m2po_keep_mask(alpha_logp, pi_k_logp, loss_mask, self.m2_threshold)  # (N, T)
        return keep, {"m2po_masked_frac": masked_mean((~keep).double(), loss_mask)}
