"""[B]'s data shaping and the null control, each a unit of variants/registry.py around step 4's
advantage.group_advantages (outermost first):

    null         --reward-shuffle: each reward credited to a random sample of the step (a control: nothing to learn)
    red-drop     RED-Drop of [B]: surplus negatives dropped at random, per group (`red_drop`; --red drop)
    red-weight   RED-Weight of [B]: A <- A exp(A / tau_red) (--red weight --red-tau)
    asymre       AsymRE of [B]: the baseline mean(r) - shift, the advantage not divided by the std (--asymre-shift)

Shapes as in advantage.py: rewards, advantages and masks (N,), group-major.
"""

import torch

from variants.registry import Variant, register


@register("null")
class NullControl(Variant):
    """The null control: the step's rewards permuted at random before the group statistics, so that a reward no
    longer belongs to its completion. A run that still learns learns from something other than the reward."""

    @classmethod
    def from_config(cls, cfg):
        return cls() if cfg.reward_shuffle else None

    def advantages(self, rewards, gen, inner, **kw):
        return inner(rewards[torch.randperm(rewards.numel(), generator=gen, device=rewards.device)], **kw)


@register("red-drop")
class REDDrop(Variant):
    """RED-Drop of [B]: the group statistics over the samples `red_drop` keeps; the dropped ones are invalid."""

    def __init__(self, group_size: int):
        self.group_size = group_size

    @classmethod
    def from_config(cls, cfg):
        return cls(cfg.group_size) if cfg.red == "drop" else None

    def advantages(self, rewards, gen, inner, **kw):
        return inner(rewards, keep=red_drop(rewards, self.group_size, gen), **kw)


@register("red-weight")
class REDWeight(Variant):
    """RED-Weight of [B]: A <- A exp(A / tau_red), emphasising the best samples of each group."""

    def __init__(self, red_tau: float):
        self.red_tau = red_tau

    @classmethod
    def from_config(cls, cfg):
        return cls(cfg.red_tau) if cfg.red == "weight" else None

    def advantages(self, rewards, gen, inner, **kw):
        A, valid = inner(rewards, **kw)
        return A * torch.exp(A / self.red_tau), valid  # (N,) each


@register("asymre")
class AsymRE(Variant):
    """AsymRE of [B]: A_i = r_i - (mean_g - shift) on the valid samples, not divided by the group's std."""

    def __init__(self, shift: float):
        self.shift = shift

    @classmethod
    def from_config(cls, cfg):
        return cls(cfg.asymre_shift) if cfg.asymre_shift != 0.0 else None

    def advantages(self, rewards, gen, inner, **kw):
        A, valid = inner(rewards, **(kw | {"scale_std": False}))  # r - mean_g, 0 where invalid
        return torch.where(valid, A + self.shift, torch.zeros_like(A)), valid  # (N,) each


def red_drop(rewards: torch.Tensor, group_size: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """RED-Drop of [B]: a keep-mask that drops surplus negatives, at random, per group, (N,) bool.

    Within a group, a sample is "positive" if its reward is above the group mean and "negative" if below. When
    negatives outnumber positives, a random subset of negatives is dropped so that #negatives == #positives;
    samples at the mean are kept. `generator` draws which negatives leave."""
    r = rewards.float().view(-1, group_size)  # (B, G)
    mean = r.mean(dim=1, keepdim=True)  # (B, 1)
    keep = torch.ones_like(r, dtype=torch.bool)  # (B, G)
    for g in range(r.shape[0]):
        pos = (r[g] > mean[g]).nonzero().flatten()
        neg = (r[g] < mean[g]).nonzero().flatten()
        surplus = len(neg) - len(pos)
        if surplus > 0 and len(pos) > 0:
            order = torch.randperm(len(neg), generator=generator, device=rewards.device)
            keep[g, neg[order[:surplus]]] = False
    return keep.view(-1)
