"""The REINFORCE-family losses of [B] (Yao et al. 2025, "Group-relative REINFORCE is secretly an off-policy
algorithm"): REC and REC-IS (REINFORCE with a one-sided clip mask), and OPMD (REINFORCE pulled back towards
the sampler by a squared log-ratio).

Each is two steps, as objective.py's surrogate: a per-token function (`rec_per_token`, `opmd_per_token`) and
the loss that aggregates it (`rec_loss`, `opmd_loss`) on objective.LossInput with objective.py's `aggregate`
(token-mean, seq-mean or constant; micro-batches pass the whole step's `total`); the units `rec`, `rec-is` and
`opmd` put them in place of [A]'s surrogate (variants/registry.py). Shapes as in objective.py: log-probs (N, T),
a `loss_mask` (N, T), advantages (N,) per sequence or (N, T) per token.
"""

from typing import NamedTuple

import torch

from objective import LossInput, aggregate, masked_mean, neutral_outside, token_advantages
from variants.registry import Variant, register


class RecTerms(NamedTuple):
    """`rec_per_token`'s result, all (N, T)."""

    objective: torch.Tensor  # o_t, with grad through logp only
    rho: torch.Tensor  # rho_t, detached
    clip_low: torch.Tensor  # bool: tokens M_t drops below 1 - eps_low (A < 0)
    clip_high: torch.Tensor  # bool: tokens M_t drops above 1 + eps_high (A > 0)


class OpmdTerms(NamedTuple):
    """`opmd_per_token`'s result, both (N, T)."""

    per_token: torch.Tensor  # l_t, with grad
    log_rho: torch.Tensor  # log rho_t = logp_t - alpha_logp_t, with grad


def rec_per_token(
    logp: torch.Tensor,
    alpha_logp: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    importance_weight: bool = False,
) -> RecTerms:
    """The per-token objective of REC / REC-IS ([B]), before the aggregation (`rec_loss` is -agg of it).

        o_t = A * logp_t * M_t              (rec)
        o_t = A * sg(rho_t) * logp_t * M_t  (rec-is, importance_weight=True)

        M_t = 1[A > 0 and rho_t <= 1 + eps_high] + 1[A < 0 and rho_t >= 1 - eps_low]
        rho_t = exp(logp_t - alpha_logp_t), detached (sg = stop-gradient)

    Legend: pi_theta -> logp (N, T), with grad; alpha -> alpha_logp (N, T); A -> advantages, (N,) per
    sequence or (N, T) per token; eps_low -> clip_eps; eps_high -> clip_eps_high (None means clip_eps).

    Returns, all (N, T): objective (o_t, with grad through logp only), rho (rho_t, detached), and the bool
    masks clip_low / clip_high of the tokens M_t drops below 1 - eps_low (A < 0) / above 1 + eps_high (A > 0).
    """
    eps_low = clip_eps
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    adv = token_advantages(advantages, torch.ones_like(logp), logp.dtype)  # (N, 1) or (N, T)
    rho = torch.exp(logp.detach() - alpha_logp.detach())  # (N, T) detached rho
    keep_pos = (adv > 0) & (rho <= 1.0 + eps_high)  # (N, T)
    keep_neg = (adv < 0) & (rho >= 1.0 - eps_low)  # (N, T)
    m = (keep_pos | keep_neg).to(logp.dtype)  # (N, T) M_t
    weight = rho if importance_weight else torch.ones_like(rho)  # (N, T)
    objective = adv * weight * logp * m  # (N, T)
    clip_low = (adv < 0) & (rho < 1.0 - eps_low)  # (N, T)
    clip_high = (adv > 0) & (rho > 1.0 + eps_high)  # (N, T)
    return RecTerms(objective, rho, clip_low, clip_high)


def rec_loss(
    x: LossInput,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    importance_weight: bool = False,
    agg: str = "token-mean",
) -> tuple[torch.Tensor, dict]:
    """REC / REC-IS of [B] as a loss: - (1 / Z) sum_{t in L} o_t, with o_t and M_t as `rec_per_token` states them
    (x.pi_k_logp and x.ref_logp unused).

    The mask drops exactly the tokens that PPO's clip would silence: positive-advantage tokens already made much
    more likely than the sampler made them, and negative ones already made much less likely. Its gradient is
    A M_t grad logp_t: plain REINFORCE on the kept tokens.

    Returns (loss, stats) with stats clip_low / clip_high (the fraction of tokens masked on each side), rho_mean
    and tokens.
    """
    (alpha_logp,) = neutral_outside(x.loss_mask, x.logp, x.alpha_logp)
    objective, rho, clip_low, clip_high = rec_per_token(
        x.logp,
        alpha_logp,
        x.advantages,
        clip_eps=clip_eps,
        clip_eps_high=clip_eps_high,
        importance_weight=importance_weight,
    )
    mask = x.loss_mask.to(x.logp.dtype)  # (N, T)
    loss = -aggregate(objective, x.loss_mask, agg, x.total)
    with torch.no_grad():
        stats = {
            "clip_low": masked_mean(clip_low.to(mask.dtype), mask),
            "clip_high": masked_mean(clip_high.to(mask.dtype), mask),
            "rho_mean": masked_mean(rho, mask),
            "tokens": mask.sum().item(),
        }
    return loss, stats


def opmd_per_token(
    logp: torch.Tensor, alpha_logp: torch.Tensor, advantages: torch.Tensor, *, tau_reg: float = 0.1
) -> OpmdTerms:
    """The per-token loss of OPMD ([B]), before the aggregation (`opmd_loss` is agg of it; a loss, not an o_t).

        l_t = - A * logp_t + (tau_reg / 2) * (logp_t - alpha_logp_t)^2

    Legend: pi_theta -> logp (N, T), with grad; alpha -> alpha_logp (N, T); A -> advantages, (N,) per
    sequence or (N, T) per token (group-mean advantages r - mean(r), as [B] derives it); tau_reg -> tau_reg.

    Returns, both (N, T): per_token (l_t, with grad) and log_rho (log rho_t = logp_t - alpha_logp_t, with grad).
    """
    adv = token_advantages(advantages, torch.ones_like(logp), logp.dtype)  # (N, 1) or (N, T)
    log_rho = logp - alpha_logp.detach()  # (N, T)
    per_token = -adv * logp + 0.5 * tau_reg * log_rho**2  # (N, T)
    return OpmdTerms(per_token, log_rho)


def opmd_loss(x: LossInput, *, tau_reg: float = 0.1, agg: str = "token-mean") -> tuple[torch.Tensor, dict]:
    """OPMD of [B] as a loss: (1 / Z) sum_{t in L} l_t, with l_t as `opmd_per_token` states it.

    The caller passes group-mean advantages (r - mean(r), `scale_std=False`), as [B] derives it. The quadratic term
    is the online-mirror-descent proximal penalty: it pulls pi_theta back to the sampler alpha in proportion to how
    far it has moved, instead of clipping.

    Returns (loss, stats) with stats rho_mean, sq_log_ratio (the mean of the squared log-ratio) and tokens.
    """
    (alpha_logp,) = neutral_outside(x.loss_mask, x.logp, x.alpha_logp)
    per_token, log_rho = opmd_per_token(x.logp, alpha_logp, x.advantages, tau_reg=tau_reg)
    mask = x.loss_mask.to(x.logp.dtype)  # (N, T)
    loss = aggregate(per_token, x.loss_mask, agg, x.total)
    with torch.no_grad():
        stats = {
            "rho_mean": masked_mean(torch.exp(log_rho), mask),
            "sq_log_ratio": masked_mean(log_rho**2, mask),
            "tokens": mask.sum().item(),
        }
    return loss, stats


# ---- the units (variants/registry.py): a loss of their own, in place of [A]'s surrogate (--loss) ----------------


@register("rec")
class REC(Variant):
    """--loss rec: [B]'s REC in place of [A]'s surrogate (`rec_loss`), on GRPO's advantages."""

    importance_weight = False

    def __init__(self, clip_eps: float, clip_eps_high: float | None):
        self.clip_eps, self.clip_eps_high = clip_eps, clip_eps_high

    @classmethod
    def from_config(cls, cfg):
        return cls(cfg.clip_eps, cfg.clip_eps_high) if cfg.loss == cls.name else None

    def loss(self, x: LossInput, inner, **settings):
        eps = dict(clip_eps=self.clip_eps, clip_eps_high=self.clip_eps_high)
        return rec_loss(x, importance_weight=self.importance_weight, agg=settings["agg"], **eps)


@register("rec-is")
class RECIS(REC):
    """--loss rec-is: REC with the detached importance weight rho_t."""

    importance_weight = True


@register("opmd")
class OPMD(Variant):
    """--loss opmd: [B]'s OPMD in place of [A]'s surrogate (`opmd_loss`), on group-mean advantages r - mean(r)."""

    def __init__(self, tau_reg: float):
        self.tau_reg = tau_reg

    @classmethod
    def from_config(cls, cfg):
        return cls(cfg.tau_reg) if cfg.loss == "opmd" else None

    def advantages(self, rewards, gen, inner, **kw):
        return inner(rewards, **(kw | {"scale_std": False}))

    def loss(self, x: LossInput, inner, **settings):
        return opmd_loss(x, tau_reg=self.tau_reg, agg=settings["agg"])
