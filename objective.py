"""[A]'s objective: the clipped off-policy surrogate with a KL penalty, and the aggregation every loss shares.

The default (config.py's flags as they stand): clip centred on pi_k with eps = 0.2, beta = 0 (no KL term), the
token mean over the loss's tokens, one inner step (mu = 1). At that step's only gradient pi_theta = pi_k, so
rho = rho' lies inside its interval [rho' - eps, rho' + eps], the clip does not act, and

    grad loss = - (1 / Z) sum_{(i, t) in L} rho'_it A_i grad log pi_theta(y_it),   rho' = pi_k / alpha,

a rho'-weighted REINFORCE step over the loss's tokens L of the groups with signal (Z = |L| at token-mean);
on-policy (v = 1) rho' = 1 and it is the group-baseline policy gradient. The clip acts from the second inner step
on, or with clip_center="alpha" on a stale batch.

What a loss reads is one `LossInput`: the log-probs of the sampled completion tokens, each (N, T), named as in
docs/design.md, "Notation",
    logp        log pi_theta   the policy being trained (the only one with a gradient)
    pi_k_logp   log pi_k       pi_theta at the start of step k, before its first optimizer step
    alpha_logp  log alpha      the sampler: pi_theta of the step that drew the batch (v - 1 or s steps old at most)
    ref_logp    log pi_ref     the KL reference (None: no KL term)
with the advantages A, the `loss_mask` (N, T) (1 on the tokens that count: the completion tokens up to and
including EOS of the groups that carry signal) and `total`, the whole step's normaliser Z. Other engines'
corrections and [B]'s losses are variants/'s units: each changes this input, or the tokens a step keeps, or
brings a loss of its own; none is a parameter here.

Deviations from [A]:
  1. [A] averages per sequence (seq-mean); the default here is token-mean, which has no length bias
     (Dr. GRPO and DAPO point it out). All three aggregations are available (`aggregate`).
  2. The lower clip bound of [A]'s interval is floored at 0: a ratio is never negative.
  3. [A] writes the penalty as KL(pi_theta || pi_ref) itself. It is estimated per token on alpha's samples
     without a weight, as GRPO, TRL without use_bias_correction_kl, and verl do; variants/corrections.py's
     `kl-is` weights it by rho, which makes it an estimate of [A]'s term (docs/design.md, "One KL").
"""

from dataclasses import dataclass
from typing import NamedTuple

import torch

CLIP_CENTERS = ("pi_k", "alpha")
KL_ESTIMATORS = ("k1", "k2", "k3")
AGGREGATIONS = ("token-mean", "seq-mean", "constant")


@dataclass(frozen=True)
class LossInput:
    """One batch (or micro-batch) of step k as a loss reads it. Log-probs of the sampled tokens, each (N, T)."""

    logp: torch.Tensor  # log pi_theta, with grad
    alpha_logp: torch.Tensor  # log alpha, the sampler's
    pi_k_logp: torch.Tensor  # log pi_k, pi_theta before step k's first optimizer step
    ref_logp: torch.Tensor | None  # log pi_ref; None: no KL term
    advantages: torch.Tensor  # A, (N,) a sequence's or (N, T) a token's
    loss_mask: torch.Tensor  # (N, T) 1 on the tokens the loss counts
    total: float | None = None  # Z, the whole step's normaliser (`aggregation_total`); None: this batch's own


def policy_loss(
    x: LossInput,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    clip_center: str = "pi_k",
    beta: float = 0.0,
    kl_estimator: str = "k3",
    agg: str = "token-mean",
) -> tuple[torch.Tensor, dict]:
    """[A]'s clipped off-policy surrogate with a KL penalty, as a loss to minimise (Algorithm 1, the update):

        loss = - (1 / Z) sum_{t in L} [ min(rho_t A, clip(rho_t, lo_t, hi_t) A) - beta kl_t ]

        rho_t  = pi_theta(y_t) / alpha(y_t)   (with grad)          rho'_t = pi_k(y_t) / alpha(y_t)   (a constant)
        [lo_t, hi_t] = [max(rho'_t - eps_low, 0), rho'_t + eps_high]   clip_center="pi_k"   ([A]'s f_eps; dev. 2)
                     = [1 - eps_low, 1 + eps_high]                     clip_center="alpha"  (PPO, GRPO)
        kl_t = `kl_penalty`(pi_theta, pi_ref)                            (0 when ref_logp is None or beta = 0)
        L = x.loss_mask's tokens,   Z = x.total,   seq-mean: each sequence's own mean first (`aggregate`)

    [A] centres the clip on where rho stood at the start of the step, so that a stale sampler does not clip a
    token merely for being stale. At a refresh rho' = 1 and the two centres coincide. clip_eps_high None is
    clip_eps. Returns the loss and `loss_stats` over L.
    """
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {kl_estimator!r}")
    o = surrogate(x, clip_eps=clip_eps, clip_eps_high=clip_eps_high, clip_center=clip_center)
    per_token, kl = o.objective, torch.zeros_like(o.objective)  # (N, T) each
    if x.ref_logp is not None and beta != 0.0:
        (ref_logp,) = neutral_outside(x.loss_mask, x.logp, x.ref_logp)
        kl = kl_penalty(x.logp, ref_logp, kl_estimator)  # (N, T)
        per_token = per_token - beta * kl  # (N, T)
    loss = -aggregate(per_token, x.loss_mask, agg, x.total)
    return loss, loss_stats(x.loss_mask, o.rho, o.clip_low, o.clip_high, kl)


class Surrogate(NamedTuple):
    """`surrogate`'s result, all (N, T)."""

    objective: torch.Tensor  # o_t = min(rho_t A, clip(rho_t, lo_t, hi_t) A), with grad
    rho: torch.Tensor  # pi_theta / alpha, with grad
    clip_low: torch.Tensor  # bool: the clip removed the gradient below the interval (A < 0)
    clip_high: torch.Tensor  # bool: ... above it (A > 0)


def surrogate(
    x: LossInput, *, clip_eps: float = 0.2, clip_eps_high: float | None = None, clip_center: str = "pi_k"
) -> Surrogate:
    """The per-token clipped surrogate o_t of `policy_loss`, before the KL term and the aggregation (an engine
    with its own aggregation calls this alone: integrations/verl_grpo.py)."""
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    alpha_logp, pi_k_logp = neutral_outside(x.loss_mask, x.logp, x.alpha_logp, x.pi_k_logp)
    A = token_advantages(x.advantages, x.loss_mask, x.logp.dtype)  # (N, 1) or (N, T)
    rho = torch.exp(x.logp - alpha_logp)  # (N, T) carries the gradient
    # (N, T) 1 at a refresh, where alpha = pi_k: exactly when log alpha is the trainer's own forward (the default,
    # --alpha-logp-from recompute), only approximately with --alpha-logp-from sampler (the sampling loop's numerics)
    rho_prime = torch.exp(pi_k_logp - alpha_logp)
    lo, hi = clip_interval(rho_prime, clip_center, clip_eps, eps_high)  # (N, T) each
    unclipped = rho * A  # (N, T)
    clipped = torch.clamp(rho, lo, hi) * A  # (N, T)
    objective = torch.min(unclipped, clipped)  # (N, T) [A]'s f_eps(rho, rho', A)
    # The min() takes the clipped branch, whose gradient is 0, exactly when rho has left the interval on the side
    # the advantage pushes it towards.
    clip_high = (rho > hi) & (A > 0)  # (N, T)
    clip_low = (rho < lo) & (A < 0)  # (N, T)
    return Surrogate(objective, rho, clip_low, clip_high)


def clip_interval(rho_prime: torch.Tensor, clip_center: str, eps_low: float, eps_high: float):
    """The interval [lo, hi], each (N, T), that rho = pi_theta / alpha is clipped to. See `policy_loss`."""
    if clip_center == "pi_k":
        return (rho_prime - eps_low).clamp(min=0.0), rho_prime + eps_high
    if clip_center == "alpha":
        return torch.full_like(rho_prime, 1.0 - eps_low), torch.full_like(rho_prime, 1.0 + eps_high)
    raise ValueError(f"clip_center must be one of {CLIP_CENTERS}, got {clip_center!r}")


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


def aggregate(per_token: torch.Tensor, loss_mask: torch.Tensor, agg: str, total: float | None) -> torch.Tensor:
    """The sum of `per_token` (N, T) over the mask's tokens, divided by Z = `total` (`aggregation_total` of the
    whole step; None: of this batch, which "constant" cannot count: it needs the run's max_new_tokens).

    A token outside the mask contributes exactly 0, whatever its value: where(), not a product, so an inf or nan
    there (an overflowing ratio on padding) never reaches the loss or its gradient."""
    in_mask = loss_mask > 0  # (N, T)
    if total is None:
        total = aggregation_total(loss_mask, agg)
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


def token_advantages(advantages: torch.Tensor, loss_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A per sequence (N,) as (N, 1), broadcast over the tokens; a per-token A (N, T) as is, 0 outside the mask (a
    variant's weight there may be inf: its product with a ratio of 1 must not reach the gradient as nan)."""
    A = advantages.to(dtype)
    if A.dim() == 1:
        return A.unsqueeze(1)  # (N, 1)
    return torch.where(loss_mask > 0, A, torch.zeros_like(A))  # (N, T)


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
