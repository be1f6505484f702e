"""Other engines' staleness corrections, each a unit of variants/registry.py around [A]'s surrogate
(objective.policy_loss), with the functions they compute:

    kl-is       the KL term weighted by rho = pi_theta / alpha (TRL's use_bias_correction_kl; --kl-importance-weight)
    opsm        DeepSeek-V3.2's off-policy sequence mask (`opsm_keep_mask`; --opsm-delta)
    decoupled   AReaL's decoupled objective: PPO's clip on r = pi_theta / pi_k, weighted by rho' (--clip-center
                decoupled)
    tis         the decoupled objective with its weight truncated, min(rho^L, C) (`correction_args`; --is-cap)
    mis         masked importance sampling: the tokens or sequences with rho^L outside [1/M, M] leave (--is-mask)
    m2po        M2PO's second-moment mask (`m2po_keep_mask`; --m2-threshold)
    m2po-clip   M2PO as its authors' released code runs it: an adaptive clip around alpha (`m2po_clip_bounds`;
                --m2po-clip-threshold, --m2po-clip-floor)
    m2po-quadrant  the M2PO paper's final mask on PPO's two active quadrants (`m2po_quadrant_keep`;
                --m2po-quadrant-threshold)
    dppo        DPPO's probability-difference mask, prime-rl's default (`dppo_keep`; --dppo-delta)

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

import math
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
        m = the least j with mean(M2_(j+1), ..., M2_(n)) < m2_threshold,  or n - 1 if none

    so the kept tokens' second moment is below the M2 threshold, dropping as few tokens as that takes, the largest
    first. Ties at the cut leave in the tokens' order (row-major: the earlier leaves first): a stable sort, so the mask
    does not depend on the sort kernel (AReaL's unstable sort does). The suffix means are float64, a sum over every
    token of the step. It depends on alpha and pi_k only: one mask for the whole step and all its inner steps, computed
    before the first micro-batch (train.mask_prepass), where AReaL computes it per micro-batch of its engine.
    A non-finite M2 (log alpha = -inf) sorts first and leaves; on-policy (alpha = pi_k) every M2 is 0 and all stay.
    """
    check_m2_threshold(m2_threshold)
    counted = (loss_mask > 0).flatten()  # (N*T,)
    m2 = (alpha_logp.detach().double() - pi_k_logp.detach().double()).square().flatten()[counted]  # (n,)
    keep = torch.ones_like(counted)  # (N*T,) True outside the loss: the caller multiplies by loss_mask
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
    keep[counted] = kept
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
    counted = loss_mask > 0  # (N, T)
    k1 = alpha_logp.detach().double() - logp.detach().double()  # (N, T) log alpha - log pi_theta
    k1 = torch.where(counted & ~k1.isnan(), k1, 0.0)  # where(): an inf on padding must not reach the sum
    d = k1.sum(dim=1, keepdim=True) / counted.sum(dim=1, keepdim=True).clamp(min=1)  # (N, 1) D_i
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
    whole step so that the kept tokens' mean (log rho')^2 is below the M2 threshold (`m2po_keep_mask`)."""

    def __init__(self, m2_threshold: float):
        check_m2_threshold(m2_threshold)
        self.m2_threshold = m2_threshold

    @classmethod
    def from_config(cls, cfg):
        return None if cfg.m2_threshold is None else cls(cfg.m2_threshold)

    def step_keep(self, alpha_logp, pi_k_logp, loss_mask):
        keep = m2po_keep_mask(alpha_logp, pi_k_logp, loss_mask, self.m2_threshold)  # (N, T)
        return keep, {"m2po_masked_frac": masked_mean((~keep).double(), loss_mask)}


# ---- M2PO as its authors' released code runs it, the paper's final mask, and DPPO's mask (issue 57) ---------------
# Each reads the current pi_theta (detached) against the sampler alpha, at the loss call (train.update's micro-batch),
# and replaces [A]'s clip by its own trust region: the settings' clip_center / clip_eps / clip_eps_high do not act.

M2PO_CLIP_FLOOR = (0.7, 1.5)  # compute_m2po_policy_loss's default miniclip_low / _high = 0.3 / 0.5, as ratio bounds
M2PO_NO_CLIP = (0.0, 1e5)  # kpo_clip_harmful_tokens' bounds when the budget holds: (0, 100000)
NO_CLIP = dict(clip_center="alpha", clip_eps=1.0, clip_eps_high=float("inf"))  # [lo, hi] = [0, inf): rho itself


def check_m2po_budget(budget: float | None, what: str = "m2po budget") -> None:
    if budget is not None and not budget > 0.0:
        raise ValueError(f"{what} must be > 0 (a bound on a mean (log pi_theta - log alpha)^2), got {budget}")


def check_dppo_delta(delta: float | None) -> None:
    if delta is not None and not delta >= 0.0:
        raise ValueError(
            f"dppo delta must be >= 0 (a bound on pi_theta - alpha, a probability difference), got {delta}"
        )


def pushed_quadrants(logp, alpha_logp, advantages, loss_mask):
    """(d, active), each (N, T): d = log pi_theta - log alpha (float64, detached; 0 off the mask) and the loss tokens
    whose ratio moved the way A pushes it, A > 0 with d > 0 or A < 0 with d < 0 (PPO's clip acts only there)."""
    counted = loss_mask > 0  # (N, T)
    d = torch.where(counted, logp.detach().double() - alpha_logp.detach().double(), 0.0)  # (N, T)
    A = advantages.detach().double()
    A = A.unsqueeze(1) if A.dim() == 1 else A  # (N, 1) or (N, T)
    return d, counted & (((A > 0) & (d > 0)) | ((A < 0) & (d < 0)))  # (N, T) each


def m2po_clip_bounds(logp, alpha_logp, advantages, loss_mask, budget: float, floor: bool = False):
    """The ratio interval [lo, hi] the M2PO authors' released code clips rho = pi_theta / alpha to, floats, and M2
    over the pushed quadrants (Infini-AI-Lab/M2PO, verl/trainer/ppo/core_algos.py: `kpo_clip_harmful_tokens`,
    `_solve_tau_from_sorted_delta2`, `compute_m2po_policy_loss`; verl/workers/actor/dp_actor.py calls it per
    micro-batch with log_prob the current forward and old_log_probs recorded when the batch was sampled: alpha):

        H = the loss tokens with A > 0 and rho > 1 or A < 0 and rho < 1 (`pushed_quadrants`), n = |H|,
        v_t = (log rho_t)^2 on H, M2 = mean_H v;   M2 <= budget (or n = 0): [lo, hi] = [0, 1e5] (no clip)
        else, v_(1) <= ... <= v_(n) ascending, c_j = sum_t min(v_t, v_(j)) (the M2 sum with every v capped at v_(j)),
        k = the least j with c_j >= n * budget;   cap^2 = v_(k-1) - 1e-12 (0 when k = 1);   [lo, hi] = [e^-cap, e^cap]

    cap is the largest breakpoint at which capping |log rho| leaves M2 of H below the budget (the authors do not
    interpolate between breakpoints). floor=True: lo = min(lo, 0.7), hi = max(hi, 1.5), compute_m2po_policy_loss's
    own defaults (miniclip 0.3 / 0.5); its only caller, dp_actor, passes config.get("miniclip_low", None), which the
    released launchers (train-scripts/m2po-*.sh) never set, so the runs the paper reports had no floor. Their 1e-12
    slack on cap^2 is kept (the token that sets the cap falls just outside, clipped, not on the bound), those in their
    comparisons are left out. Returns (lo, hi, M2, n)."""
    check_m2po_budget(budget)
    d, active = pushed_quadrants(logp, alpha_logp, advantages, loss_mask)
    v = d[active].square()  # (n,)
    n = v.numel()
    m2 = v.mean().item() if n else 0.0
    if n == 0 or not m2 > budget:  # a NaN M2 (it cannot be sorted) clips nothing, as the authors' `<=` test fails
        lo, hi = M2PO_NO_CLIP
    else:
        asc = torch.sort(v).values  # (n,) ascending
        j = torch.arange(n, device=asc.device, dtype=asc.dtype)
        capped = asc.cumsum(0) + torch.where(j < n - 1, (n - 1 - j) * asc, 0.0)  # (n,) c_j (no 0 * inf at the top)
        k = int((capped >= n * budget).to(torch.int8).argmax())  # exists: c_(n) = n * M2 > n * budget
        cap = math.sqrt(max(asc[k - 1].item() - 1e-12, 0.0)) if k > 0 else 0.0  # their slack: v_(k-1) is clipped
        lo, hi = math.exp(-cap), math.exp(cap)
    if floor:
        lo, hi = min(lo, M2PO_CLIP_FLOOR[0]), max(hi, M2PO_CLIP_FLOOR[1])
    return lo, hi, m2, n


def m2po_quadrant_keep(logp, alpha_logp, advantages, loss_mask, threshold: float) -> torch.Tensor:
    """The tokens the M2PO paper's final form keeps, (N, T) bool, True off the mask (ms-swift's `compute_m2po_mask`,
    Trinity-RFT's `M2POPolicyLossFn`, 2026: the paper's Algorithm 1 restricted to the pushed quadrants):

        H = the loss tokens with A > 0 and rho > 1 or A < 0 and rho < 1, rho = pi_theta / alpha (`pushed_quadrants`)
        v_t = (log rho_t)^2 on H, ascending v_(1) <= ... <= v_(n) (stable: ties in the tokens' order)
        keep the longest prefix whose mean is <= threshold: the first K with mean(v_(1..K)) <= threshold (K may be 0)

    The largest v of H leave until the rest's mean is at most the threshold (all of H may leave); a token outside H
    never does. Unlike `m2po_keep_mask` (AReaL): only H is ranked and counted, by pi_theta rather than pi_k, `<=` the
    threshold, and no token is kept when none fits; a dropped token stays in the normaliser (the unit)."""
    check_m2po_budget(threshold, "m2po quadrant threshold")
    d, active = pushed_quadrants(logp, alpha_logp, advantages, loss_mask)
    keep = torch.ones_like(active).flatten()  # (N*T,)
    where = active.flatten().nonzero().squeeze(1)  # (n,) the flat indices of H, row-major
    if where.numel() == 0:
        return keep.view_as(active)
    asc, order = torch.sort(d.flatten()[where].square(), stable=True)  # (n,) each
    prefix_mean = asc.cumsum(0) / torch.arange(1, asc.numel() + 1, device=asc.device, dtype=asc.dtype)  # (n,)
    kept = int((prefix_mean <= threshold).sum())  # the prefix means rise: the ones <= threshold are a prefix
    keep[where[order[kept:]]] = False
    return keep.view_as(active)  # (N, T)


def dppo_keep(logp, alpha_logp, advantages, loss_mask, delta_low: float, delta_high: float) -> torch.Tensor:
    """The tokens DPPO's binary mask keeps, (N, T) bool, True off the mask (prime-rl's default loss since April 2026,
    src/prime_rl/trainer/rl/loss.py `default_loss_fn`, DefaultLossConfig.dppo_mask_low / _high = 0.2 / 0.2; the
    DPPO-Binary TV loss of arXiv 2602.04879):

        a token leaves  iff  A > 0 and pi_theta - alpha > delta_high,   or  A <= 0 and alpha - pi_theta > delta_low

    a bound on the probability difference (not the ratio), on the side A pushes the token towards; A = 0 takes the
    low side as prime-rl's torch.where does (such a token adds nothing either way). pi_theta is the current forward,
    detached; alpha the sampler's."""
    check_dppo_delta(delta_low)
    check_dppo_delta(delta_high)
    diff = torch.exp(logp.detach().double()) - torch.exp(alpha_logp.detach().double())  # (N, T)
    A = advantages.detach()
    A = A.unsqueeze(1) if A.dim() == 1 else A  # (N, 1) or (N, T)
    leaves = torch.where(A > 0, diff > delta_high, diff < -delta_low)  # (N, T)
    return ~(leaves & (loss_mask > 0))  # (N, T)


def zero_advantages(x: LossInput, keep: torch.Tensor) -> LossInput:
    """x with A <- 0 on the tokens keep drops (A becomes (N, T)): their term is 0, they stay in Z."""
    A = x.advantages if x.advantages.dim() == 2 else x.advantages.unsqueeze(1)  # (N, 1) or (N, T)
    return replace(x, advantages=torch.where(keep, A, torch.zeros_like(A)).expand_as(x.loss_mask))


@register("m2po-clip")
class M2POClip(Variant):
    """M2PO as its authors' released code runs it (`m2po_clip_bounds`): no token is masked; the loss call's M2 over
    the tokens that moved the way A pushes becomes PPO's clip around the sampler,

        o_t = min(rho_t A, clip(rho_t, lo, hi) A),   rho = pi_theta / alpha,   [lo, hi] from the call's tokens

    (objective.policy_loss with clip_center="alpha", eps_low = 1 - lo, eps_high = hi - 1). One interval per loss
    call, as the authors' per-micro-batch call: at train.update's default micro-batch (the whole batch on a CPU) once
    a step; its bounds are logged as m2po_clip_lo / m2po_clip_hi."""

    def __init__(self, budget: float, floor: bool = False):
        check_m2po_budget(budget)
        self.budget, self.floor = budget, floor

    @classmethod
    def from_config(cls, cfg):
        return None if cfg.m2po_clip_threshold is None else cls(cfg.m2po_clip_threshold, cfg.m2po_clip_floor)

    def loss(self, x: LossInput, inner, **settings):
        lo, hi, m2, n = m2po_clip_bounds(x.logp, x.alpha_logp, x.advantages, x.loss_mask, self.budget, self.floor)
        own = dict(clip_center="alpha", clip_eps=1.0 - lo, clip_eps_high=hi - 1.0)
        loss, stats = inner(x, **(settings | own))
        return loss, stats | {"m2po_clip_lo": lo, "m2po_clip_hi": hi}


@register("m2po-quadrant")
class M2POQuadrant(Variant):
    """The M2PO paper's final form (`m2po_quadrant_keep`): the fewest pushed-quadrant tokens, the largest
    (log pi_theta - log alpha)^2 first, lose their term so that the rest of the quadrants have M2 <= threshold, and the
    surrogate is the unclipped ratio, the token count kept:

        loss = -(1 / Z) sum_{t in L} M_t rho_t A_t,   M = m2po_quadrant_keep,   Z counts L whatever M drops

    (objective.policy_loss with the clip off, [lo, hi] = [0, inf), and A <- 0 where M = 0). M is taken once over
    the loss call's tokens: train.update's micro-batch (ms-swift's granularity; the whole step at the default)."""

    def __init__(self, threshold: float):
        check_m2po_budget(threshold, "m2po quadrant threshold")
        self.threshold = threshold

    @classmethod
    def from_config(cls, cfg):
        return None if cfg.m2po_quadrant_threshold is None else cls(cfg.m2po_quadrant_threshold)

    def loss(self, x: LossInput, inner, **settings):
        keep = m2po_quadrant_keep(x.logp, x.alpha_logp, x.advantages, x.loss_mask, self.threshold)  # (N, T)
        loss, stats = inner(zero_advantages(x, keep), **(settings | NO_CLIP))
        return loss, stats | {"m2po_quadrant_masked_frac": masked_mean((~keep).double(), x.loss_mask)}


@register("dppo")
class DPPO(Variant):
    """DPPO's binary probability-difference mask (`dppo_keep`) on the unclipped ratio, the token count kept, as
    prime-rl's default loss computes its policy-gradient term:

        loss = -(1 / Z) sum_{t in L} M_t rho_t A_t,   M = dppo_keep,   rho = pi_theta / alpha

    (objective.policy_loss with the clip off and A <- 0 where M = 0). prime-rl adds kl_tau (log rho)^2 (1e-3, its
    Kimi-K2.5 KL term) to the loss: not part of DPPO's mask, and not here."""

    def __init__(self, delta_low: float, delta_high: float | None = None):
        delta_high = delta_low if delta_high is None else delta_high
        check_dppo_delta(delta_low)
        check_dppo_delta(delta_high)
        self.delta_low, self.delta_high = delta_low, delta_high

    @classmethod
    def from_config(cls, cfg):
        return None if cfg.dppo_delta is None else cls(cfg.dppo_delta)

    def loss(self, x: LossInput, inner, **settings):
        keep = dppo_keep(x.logp, x.alpha_logp, x.advantages, x.loss_mask, self.delta_low, self.delta_high)  # (N, T)
        loss, stats = inner(zero_advantages(x, keep), **(settings | NO_CLIP))
        return loss, stats | {"dppo_masked_frac": masked_mean((~keep).double(), x.loss_mask)}
