"""The policy objectives: GRPO's clipped off-policy surrogate with a KL penalty ([A]),
and the REINFORCE-family losses of [B].

Every loss here takes per-token log-probs of the completions, shape (N, T), and a
`completion_mask` (N, T) that is 1 on the tokens that count: the completion tokens up to and
including EOS, of the completions whose group carries signal (the caller folds `valid` in).

Aggregation (`agg`), the normaliser of the summed per-token objective:
    token-mean  sum over all valid tokens of the step / their count  (no length bias; default)
    seq-mean    mean over each sequence's tokens, then mean over sequences  (original GRPO)
    constant    sum / (N * max_new_tokens)  (Dr. GRPO, Liu et al. 2025)

Micro-batching must not change the math: when a step is split into micro-batches, pass
`total=aggregation_total(full_mask, agg, max_new_tokens)` computed on the whole step, so that
the micro-batch losses add up to the whole-step loss (and their gradients to its gradient).

Deviations from the papers:
  1. [A] states the surrogate with a sequence-level mean (seq-mean); we default to token-mean,
     which removes the length bias that Dr. GRPO and DAPO point out. All three are available.
  2. The lower clip bound of the "current" centre is floored at 0 (`max(rho' - eps_low, 0)`):
     a ratio is never negative, so a negative bound would be vacuous anyway.
"""

import torch

AGGREGATIONS = ("token-mean", "seq-mean", "constant")


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
) -> tuple[torch.Tensor, dict]:
    """GRPO's clipped off-policy surrogate with a k3 KL penalty, as a loss to minimise.

        loss = - agg_t [ min(rho_t * A, clip(rho_t, lo_t, hi_t) * A)  -  beta * kl_t ]

        rho_t  = pi_theta(y_t) / alpha(y_t)       = exp(logp - behaviour_logp)    (with grad)
        rho'_t = pi_k(y_t) / alpha(y_t)           = exp(current_logp - behaviour_logp)  (detached)
        [lo_t, hi_t] = [max(rho'_t - eps_low, 0), rho'_t + eps_high]   clip_center="current" ([A] f_eps)
                     = [1 - eps_low, 1 + eps_high]                      clip_center="behaviour" (PPO)
        kl_t   = exp(ref_logp - logp) - (ref_logp - logp) - 1           (k3, Schulman 2020; >= 0)

    [A] (Mroueh et al. 2025, Algorithm 1) writes the surrogate as f_eps(rho, rho', A): the ratio
    is clipped around rho', the ratio of the policy at the start of the step, not around 1, so
    a stale sampler (v > 1) does not clip every token just for being stale. With the sampler
    refreshed this step, rho' = 1 and both centres coincide.

    Legend (symbol -> argument):
        pi_theta -> logp (N, T), with grad;   alpha -> behaviour_logp (N, T);
        pi_k -> current_logp (N, T), None means "equal to behaviour_logp" (rho' = 1);
        pi_ref -> ref_logp (N, T), None means no KL term;   A -> advantages (N,);
        eps_low -> clip_eps;   eps_high -> clip_eps_high (None means clip_eps);   beta -> beta.

    Args:
        completion_mask: (N, T), 1 on valid completion tokens (EOS included).
        agg, max_new_tokens, total: the aggregation; see the module docstring.

    Returns:
        loss: scalar tensor.
        stats: floats over the valid tokens: clip_low / clip_high (fraction of tokens whose
            gradient the clip removed, below / above the interval), kl, ratio_mean,
            rho_prime_mean, rho_prime_max, plus `tokens` (their count).
    """
    eps_low = clip_eps
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    mask = completion_mask.to(logp.dtype)  # (N, T)
    adv = advantages.to(logp.dtype).unsqueeze(1)  # (N, 1)
    behaviour_logp = behaviour_logp.detach()

    ratio = torch.exp(logp - behaviour_logp)  # (N, T) rho, carries the gradient
    if current_logp is None:
        rho_prime = torch.ones_like(ratio)  # (N, T) the sampler is pi_k
    else:
        rho_prime = torch.exp(current_logp.detach() - behaviour_logp)  # (N, T)
    if clip_center == "current":
        lo = (rho_prime - eps_low).clamp(min=0.0)  # (N, T)
        hi = rho_prime + eps_high  # (N, T)
    elif clip_center == "behaviour":
        lo = torch.full_like(ratio, 1.0 - eps_low)  # (N, T)
        hi = torch.full_like(ratio, 1.0 + eps_high)  # (N, T)
    else:
        raise ValueError(f"clip_center must be 'current' or 'behaviour', got {clip_center!r}")

    unclipped = ratio * adv  # (N, T)
    clipped = torch.clamp(ratio, lo, hi) * adv  # (N, T)
    surrogate = torch.min(unclipped, clipped)  # (N, T) [A]'s f_eps(rho, rho', A)
    objective = surrogate  # (N, T)

    if ref_logp is not None and beta != 0.0:
        log_ref_ratio = ref_logp.detach() - logp  # (N, T) log(pi_ref / pi_theta)
        kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1.0  # (N, T) k3 estimator of KL(pi_theta || pi_ref)
        objective = objective - beta * kl  # (N, T)
    else:
        kl = torch.zeros_like(ratio)  # (N, T)

    loss = -aggregate(objective, completion_mask, agg, max_new_tokens, total)

    with torch.no_grad():
        # The min() picks the clipped branch, whose gradient is 0, exactly when the ratio has
        # left the interval on the side the advantage pushes it towards.
        clip_high = ((ratio > hi) & (adv > 0)).to(mask.dtype)  # (N, T)
        clip_low = ((ratio < lo) & (adv < 0)).to(mask.dtype)  # (N, T)
        stats = {
            "clip_low": _masked_mean(clip_low, mask),
            "clip_high": _masked_mean(clip_high, mask),
            "kl": _masked_mean(kl, mask),
            "ratio_mean": _masked_mean(ratio, mask),
            "rho_prime_mean": _masked_mean(rho_prime, mask),
            "rho_prime_max": rho_prime[mask > 0].max().item() if mask.sum() > 0 else 1.0,
            "tokens": mask.sum().item(),
        }
    return loss, stats


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

    Returns (loss, stats) with stats clip_low / clip_high (fraction of tokens masked on each
    side), ratio_mean and tokens.
    """
    eps_low = clip_eps
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    mask = completion_mask.to(logp.dtype)  # (N, T)
    adv = advantages.to(logp.dtype).unsqueeze(1)  # (N, 1)
    ratio = torch.exp(logp.detach() - behaviour_logp.detach())  # (N, T) detached rho
    keep_pos = (adv > 0) & (ratio <= 1.0 + eps_high)  # (N, T)
    keep_neg = (adv < 0) & (ratio >= 1.0 - eps_low)  # (N, T)
    m = (keep_pos | keep_neg).to(logp.dtype)  # (N, T) M_t
    weight = ratio if importance_weight else torch.ones_like(ratio)  # (N, T)
    objective = adv * weight * logp * m  # (N, T)
    loss = -aggregate(objective, completion_mask, agg, max_new_tokens, total)
    with torch.no_grad():
        stats = {
            "clip_low": _masked_mean(((adv < 0) & (ratio < 1.0 - eps_low)).to(mask.dtype), mask),
            "clip_high": _masked_mean(((adv > 0) & (ratio > 1.0 + eps_high)).to(mask.dtype), mask),
            "ratio_mean": _masked_mean(ratio, mask),
            "tokens": mask.sum().item(),
        }
    return loss, stats


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

    Returns (loss, stats) with stats ratio_mean, sq_log_ratio (mean of the squared log-ratio) and tokens.
    """
    mask = completion_mask.to(logp.dtype)  # (N, T)
    adv = advantages.to(logp.dtype).unsqueeze(1)  # (N, 1)
    log_ratio = logp - behaviour_logp.detach()  # (N, T)
    per_token = -adv * logp + 0.5 * tau_reg * log_ratio**2  # (N, T)
    loss = aggregate(per_token, completion_mask, agg, max_new_tokens, total)
    with torch.no_grad():
        stats = {
            "ratio_mean": _masked_mean(torch.exp(log_ratio), mask),
            "sq_log_ratio": _masked_mean(log_ratio**2, mask),
            "tokens": mask.sum().item(),
        }
    return loss, stats
