"""[A]'s objective: the clipped off-policy surrogate with a KL penalty, and the aggregation every loss shares.

The default (config.py's flags as they stand): clip centred on pi_k with eps = 0.2, beta = 0 (no KL term), the
token mean over the loss's tokens, one inner step (mu = 1). At that step's only gradient pi_theta = pi_k, so
rho = rho' lies inside its interval [rho' - eps, rho' + eps], the clip does not act, and

    grad loss = - (1 / |T|) sum_{(i, t) in T} rho'_it A_i grad log pi_theta(y_it),   rho' = pi_k / alpha,

a rho'-weighted REINFORCE step over the tokens T of the groups with signal; on-policy (v = 1) rho' = 1 and it is
the group-baseline policy gradient. The clip acts from the second inner step on, or with --clip-center alpha
on a stale batch.

The log-probs of the sampled completion tokens, each (N, T), named as in docs/design.md, "Notation":
    logp        log pi_theta   the policy being trained (the only one with a gradient)
    pi_k_logp   log pi_k       pi_theta at the start of step k, before its first optimizer step
    alpha_logp  log alpha      the sampler: pi_theta of the step that drew the batch (v - 1 or s steps old at most)
    ref_logp    log pi_ref     the KL reference (None: no KL term)
and a `loss_mask` (N, T): 1 on the tokens that count, the completion tokens up to and including EOS of the
groups that carry signal. The surrogate also has the other engines' staleness corrections: AReaL's decoupled
objective (clip_center="decoupled"), and the weight (TIS) and kept tokens (MIS) that variants/corrections.py
computes as `policy_loss`'s `weight` and `keep`. [B]'s losses are in variants/reinforce.py, which reuses this
file's KL estimators and aggregation.

Deviations from [A]:
  1. [A] averages per sequence (seq-mean); the default here is token-mean, which has no length bias
     (Dr. GRPO and DAPO point it out). All three aggregations are available (`aggregate`).
  2. The lower clip bound of [A]'s interval is floored at 0: a ratio is never negative.
  3. [A] writes the penalty as KL(pi_theta || pi_ref) itself. The default estimates it per token on alpha's
     samples without a weight, as GRPO, TRL without use_bias_correction_kl, and verl do; kl_importance_weight
     weights it by rho, which makes it an estimate of [A]'s term (docs/design.md, "One KL").
"""

from typing import NamedTuple

import torch

CLIP_CENTERS = ("pi_k", "alpha", "decoupled")
KL_ESTIMATORS = ("k1", "k2", "k3")
AGGREGATIONS = ("token-mean", "seq-mean", "constant")


def policy_loss(
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
    weight: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
    keep_objective: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """[A]'s clipped off-policy surrogate with a KL penalty, as a loss to minimise (Algorithm 1, the update):

        loss = - agg_{t in K} [ s_t o_t - beta kl_t ]

        o_t = min(rho_t A, clip(rho_t, lo_t, hi_t) A)                    clip_center "pi_k" or "alpha"
            = w_t min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A)      clip_center="decoupled" (AReaL)
        rho_t = pi_theta(y_t) / alpha(y_t) (with grad),   rho'_t = pi_k(y_t) / alpha(y_t) (a constant)
        r_t = pi_theta(y_t) / pi_k(y_t) = rho_t / rho'_t (with grad)
        [lo_t, hi_t] = [max(rho'_t - eps_low, 0), rho'_t + eps_high]   clip_center="pi_k"   ([A]'s f_eps; max: dev. 2)
                     = [1 - eps_low, 1 + eps_high]                     clip_center="alpha"  (PPO)
        w_t = `weight` (a constant: TIS passes min(rho^L, C)), rho'_t when None; 0 on a token keep drops
        K = the tokens of loss_mask that `keep` keeps (MIS, M2PO), all of them when None: a dropped token leaves the
            sum and the normaliser, its KL term too, whatever the centre
        s_t = `keep_objective` (OPSM): 0 on a token it drops, whose surrogate term alone leaves: the token stays in
            the normaliser and keeps its KL term, as TRL's off-policy sequence mask does; 1 when None
        kl_t = `kl_penalty`, times rho_t with kl_importance_weight;   agg = `aggregate` over K

    [A] centres the clip on where rho stood at the start of the step, so that a stale sampler does not clip a
    token merely for being stale. AReaL (Fu et al. 2025) decouples the clip's two jobs: r is clipped around 1 (a
    trust region around pi_k), and rho' corrects for the sampler as a separate weight. Wherever rho' > eps_low,
    [A]'s o_t equals rho' min(r A, clip(r, 1 - eps_low/rho', 1 + eps_high/rho') A): the uncapped decoupled
    objective with a trust region in r that narrows as rho' grows (docs/design.md derives it). At a refresh
    rho' = 1, w = 1 (TIS caps at C >= 1), and the three centres coincide.

    A: advantages, (N,) or (N, T); clip_eps_high None is clip_eps; a micro-batch passes its whole step's `total`
    (with keep: the kept tokens' count, `corrections.mis_keep_mask`). weight: (N, T) or (N, 1), decoupled centre
    only; keep: bool (N, T); keep_objective: bool (N, 1) or (N, T). `corrections.correction_args` computes weight and
    keep for TIS and MIS (rho^L, C and M are defined there), `corrections.m2po_keep_mask` M2PO's keep,
    `corrections.opsm_keep_mask` OPSM's keep_objective. Returns the loss and `loss_stats` over loss_mask's tokens,
    those keep and keep_objective drop included; the clip fractions never count a dropped token.
    """
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {kl_estimator!r}")
    alpha_logp, pi_k_logp, ref_logp = neutral_outside(loss_mask, logp, alpha_logp, pi_k_logp, ref_logp)
    if weight is not None:  # 1 outside the mask, as the ratios there: an inf on padding must not make nan
        weight = torch.where(loss_mask > 0, weight.detach(), 1.0)  # (N, T)
    term_kept = keep  # the tokens whose surrogate term stays: surrogate zeroes the others' weight, skips their clip
    if keep_objective is not None:
        keep_objective = keep_objective.expand_as(logp)  # (N, T)
        term_kept = keep_objective if keep is None else keep & keep_objective  # (N, T)
    objective, rho, clip_low, clip_high = surrogate(
        logp,
        alpha_logp,
        pi_k_logp,
        advantages,
        clip_eps=clip_eps,
        clip_eps_high=clip_eps_high,
        clip_center=clip_center,
        weight=weight,
        keep=term_kept,
    )
    if keep_objective is not None:  # s_t o_t: where(), so that no value of a dropped o_t reaches the gradient
        objective = torch.where(keep_objective, objective, torch.zeros_like(objective))  # (N, T)
    kept_mask = loss_mask if keep is None else loss_mask * keep  # (N, T) MIS, M2PO: what stays in loss and normaliser
    kl_weight = rho if kl_importance_weight else None
    loss, kl = penalised_loss(
        objective, logp, ref_logp, kept_mask, beta, kl_estimator, agg, max_new_tokens, total, kl_weight
    )
    return loss, loss_stats(loss_mask, rho, clip_low, clip_high, kl)


class Surrogate(NamedTuple):
    """`surrogate`'s result, all (N, T). The clip fractions never count a token keep dropped."""

    objective: torch.Tensor  # o_t, with grad
    rho: torch.Tensor  # pi_theta / alpha, with grad
    clip_low: torch.Tensor  # bool: the clip removed the gradient below the interval (A < 0)
    clip_high: torch.Tensor  # bool: ... above it (A > 0)


def clip_interval(rho_prime: torch.Tensor, clip_center: str, eps_low: float, eps_high: float):
    """The interval [lo, hi], each (N, T), that the clipped ratio is clipped to: rho = pi_theta / alpha, or
    r = pi_theta / pi_k for clip_center="decoupled". See `policy_loss`."""
    if clip_center == "pi_k":
        return (rho_prime - eps_low).clamp(min=0.0), rho_prime + eps_high
    if clip_center in ("alpha", "decoupled"):
        return torch.full_like(rho_prime, 1.0 - eps_low), torch.full_like(rho_prime, 1.0 + eps_high)
    raise ValueError(f"clip_center must be one of {CLIP_CENTERS}, got {clip_center!r}")


def surrogate(
    logp: torch.Tensor,
    alpha_logp: torch.Tensor,
    pi_k_logp: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    clip_center: str = "pi_k",
    weight: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
) -> Surrogate:
    """The per-token clipped surrogate o_t of `policy_loss`, before the KL term and the aggregation (an engine
    with its own aggregation calls this alone: integrations/verl_grpo.py). With `keep`, a dropped token's
    decoupled weight is 0 and the clip fractions skip it; the caller leaves it out of the mask it aggregates with."""
    if clip_center not in CLIP_CENTERS:
        raise ValueError(f"clip_center must be one of {CLIP_CENTERS}, got {clip_center!r}")
    if weight is not None and clip_center != "decoupled":
        raise ValueError(f"weight is the w_t of clip_center='decoupled'; {clip_center!r} has none")
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    A = token_advantages(advantages, logp.dtype)  # (N, 1) or (N, T)
    alpha_logp = alpha_logp.detach()
    rho = torch.exp(logp - alpha_logp)  # (N, T) carries the gradient
    # (N, T) 1 at a refresh, where alpha = pi_k: exactly when log alpha is the trainer's own forward (the default,
    # --alpha-logp-from recompute), only approximately with --alpha-logp-from sampler (the sampler's numerics)
    rho_prime = torch.exp(pi_k_logp.detach() - alpha_logp)
    lo, hi = clip_interval(rho_prime, clip_center, clip_eps, eps_high)  # (N, T) each
    ratio, w = rho, None  # the clipped ratio and the decoupled weight
    if clip_center == "decoupled":
        ratio = torch.exp(logp - pi_k_logp.detach())  # (N, T) r = pi_theta / pi_k, carries the gradient
        w = rho_prime if weight is None else weight.detach().to(rho_prime.dtype)  # (N, T) or (N, 1) a constant
        if keep is not None:
            # A dropped token's weight is 0, not rho': an overflowing rho' = inf would make inf * 0 = nan.
            w = torch.where(keep, w, torch.zeros_like(w))  # (N, T)
    unclipped = ratio * A  # (N, T)
    clipped = torch.clamp(ratio, lo, hi) * A  # (N, T)
    objective = torch.min(unclipped, clipped)  # (N, T) [A]'s f_eps(rho, rho', A), or AReaL's before w
    if w is not None:
        objective = w * objective  # (N, T) the decoupled objective
    # The min() takes the clipped branch, whose gradient is 0, exactly when the ratio has left the interval on
    # the side the advantage pushes it towards.
    clip_high = (ratio > hi) & (A > 0)  # (N, T)
    clip_low = (ratio < lo) & (A < 0)  # (N, T)
    if keep is not None:  # a token MIS dropped has no gradient to clip
        clip_high, clip_low = clip_high & keep, clip_low & keep  # (N, T)
    return Surrogate(objective, rho, clip_low, clip_high)


def penalised_loss(
    objective, logp, ref_logp, kept_mask, beta, kl_estimator, agg, max_new_tokens, total, kl_weight=None
):
    """The end of every clipped policy loss: - agg_t [ o_t - beta rho_t kl_t ] over kept_mask's tokens (rho_t = 1
    unless kl_weight), and the KL term's rho_t kl_t (N, T) (zeros without a KL term). kept_mask (N, T): loss_mask
    times MIS's or M2PO's `keep` (loss_mask itself without one): the tokens the sum and its normaliser count.
    kl_weight: rho = pi_theta / alpha with its gradient (TRL's use_bias_correction_kl, DeepSeek-V3.2's unbiased KL),
    so that on alpha's samples rho kl estimates E_alpha[rho k] = E_pi_theta[k] = KL(pi_theta || pi_ref) for k1 and
    k3; None: no weight."""
    kl = torch.zeros_like(objective)  # (N, T)
    if ref_logp is not None and beta != 0.0:
        kl = kl_penalty(logp, ref_logp, kl_estimator)  # (N, T)
        if kl_weight is not None:
            kl = kl_weight * kl  # (N, T)
        objective = objective - beta * kl  # (N, T)
    return -aggregate(objective, kept_mask, agg, max_new_tokens, total), kl


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) at the sampled tokens, (N, T) (Schulman 2020).

        k1 = log pi_theta - log pi_ref                              (unbiased; can be negative)
        k2 = 1/2 (log pi_theta - log pi_ref)^2                      (biased; >= 0)
        k3 = pi_ref/pi_theta - 1 - log(pi_ref/pi_theta)             (unbiased; >= 0)

    "Unbiased" holds for tokens drawn from pi_theta. As a loss term the gradient flows through logp only, and then
    (per token, tokens from pi_theta) k1's expected gradient is 0, k2's is the gradient of KL(pi_theta || pi_ref),
    and k3's that of the reverse KL(pi_ref || pi_theta).
    """
    log_ref_ratio = ref_logp.detach() - logp  # (N, T) log(pi_ref / pi_theta); the reference is a constant
    if estimator == "k1":
        return -log_ref_ratio  # (N, T)
    if estimator == "k2":
        return 0.5 * log_ref_ratio**2  # (N, T)
    if estimator == "k3":
        return torch.exp(log_ref_ratio) - log_ref_ratio - 1.0  # (N, T)
    raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


def aggregation_total(loss_mask: torch.Tensor, agg: str, max_new_tokens: int | None = None) -> float:
    """The number `aggregate` divides the summed objective by, over a whole step (clamped to >= 1):

        token-mean   the count of tokens in the mask                   (no length bias; the default)
        seq-mean     the count of sequences with a token in the mask   (each sequence's own mean first; GRPO)
        constant     N * max_new_tokens                                (Dr. GRPO, Liu et al. 2025)

    Micro-batching must not change the math: each micro-batch passes its whole step's total to `aggregate`, so
    the micro-batch losses and gradients add up to the whole step's.
    """
    if agg == "token-mean":
        total = loss_mask.sum().item()
    elif agg == "seq-mean":
        total = (loss_mask.sum(dim=1) > 0).sum().item()
    elif agg == "constant":
        if max_new_tokens is None:
            raise ValueError("agg='constant' needs max_new_tokens")
        total = loss_mask.shape[0] * max_new_tokens
    else:
        raise ValueError(f"agg must be one of {AGGREGATIONS}, got {agg!r}")
    return float(max(total, 1))


def aggregate(
    per_token: torch.Tensor,
    loss_mask: torch.Tensor,
    agg: str,
    max_new_tokens: int | None,
    total: float | None,
) -> torch.Tensor:
    """The sum of `per_token` (N, T) over the mask's tokens, divided by `aggregation_total` (or `total`).

    A token outside the mask contributes exactly 0, whatever its value: where(), not a product, so an inf or nan
    there (an overflowing ratio on padding) never reaches the loss or its gradient."""
    in_mask = loss_mask > 0  # (N, T)
    if total is None:
        total = aggregation_total(loss_mask, agg, max_new_tokens)
    masked = torch.where(in_mask, per_token, torch.zeros_like(per_token))  # (N, T)
    if agg == "seq-mean":
        # Each sequence contributes its own token mean; sequences without a token contribute 0.
        seq_len = in_mask.sum(dim=1).clamp(min=1).to(per_token.dtype)  # (N,)
        return (masked.sum(dim=1) / seq_len).sum() / total
    return masked.sum() / total


def neutral_outside(loss_mask: torch.Tensor, logp: torch.Tensor, *others: torch.Tensor | None) -> list:
    """`others` (log-probs of alpha, pi_k, pi_ref; None stays None), detached, with logp's own detached values on
    the tokens outside the mask, so that every ratio is 1 there.

    A masked-out token (padding, a group without signal) contributes nothing, but its values still flow through
    the per-token formulas: an overflowing ratio = inf there times a zero gradient would be nan (inf * 0), and
    the nan would reach every parameter's gradient. Each loss calls this first."""
    in_mask, anchor = loss_mask > 0, logp.detach()  # (N, T) each
    return [None if x is None else torch.where(in_mask, x.detach(), anchor) for x in others]


def token_advantages(advantages: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A per sequence (N,) as (N, 1), broadcast over the tokens; a per-token A (N, T) as is."""
    A = advantages.to(dtype)
    return A.unsqueeze(1) if A.dim() == 1 else A  # (N, 1) or (N, T)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean of x over mask == 1, as a float (0.0 when the mask is empty); for statistics only."""
    n = mask.sum()
    return torch.where(mask > 0, x, torch.zeros_like(x)).sum().item() / n.item() if n.item() > 0 else 0.0


def loss_stats(loss_mask, rho, clip_low, clip_high, kl) -> dict:
    """A loss's statistics as floats over the mask's tokens (the clip fractions count tokens whose gradient the
    clip removed); `tokens` is the count, by which train.update averages its micro-batches."""
    mask = loss_mask.to(rho.dtype)  # (N, T)
    with torch.no_grad():
        return {
            "clip_low": masked_mean(clip_low.to(mask.dtype), mask),
            "clip_high": masked_mean(clip_high.to(mask.dtype), mask),
            "kl": masked_mean(kl, mask),
            "rho_mean": masked_mean(rho, mask),
            "tokens": mask.sum().item(),
        }
