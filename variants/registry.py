"""What a variant is, the registry of them by name, and the `Recipe` a run builds from its flags once.

A variant is a named change to [A]'s step, one class with three hooks, one for each stage it may change:

    advantages(rewards, gen, inner, **kw) -> (A, valid)    stage 4: the advantages ([B]'s data shaping, the null
                                                           control); `inner` is the rest of the chain, ending in
                                                           advantage.group_advantages
    step_keep(alpha_logp, pi_k_logp, loss_mask) -> (keep, stats)
                                                           before the update: the tokens the whole step keeps,
                                                           (N, T) bool (MIS, M2PO); they leave the loss and Z
    loss(x, inner, **settings) -> (loss, stats)            stage 6: a micro-batch's loss; `inner` is the rest of the
                                                           chain, ending in objective.policy_loss. A variant changes
                                                           the LossInput it passes on (decoupled, TIS, OPSM), or
                                                           brings a loss of its own (REC, OPMD; kl-is adds a term)

and `step_stats(alpha_logp, pi_k_logp, loss_mask)`, its figures of the whole step. The base class passes every
stage through unchanged: a variant overrides the hooks of the stages it changes, and `from_config` says whether a
run's flags ask for it. [A]'s core never branches on a variant; a new one is a class and a `register` line.
"""

from collections.abc import Callable
from functools import partial

import torch

from advantage import group_advantages
from objective import LossInput, policy_loss

REGISTRY: dict[str, type["Variant"]] = {}  # name -> unit, in the order their chains run (the first outermost)


def register(name: str) -> Callable[[type["Variant"]], type["Variant"]]:
    """A class decorator: the unit, under `name`, in REGISTRY."""

    def add(cls: type[Variant]) -> type[Variant]:
        if name in REGISTRY:
            raise ValueError(f"a variant named {name!r} is registered already")
        cls.name = name
        REGISTRY[name] = cls
        return cls

    return add


class Variant:
    """A named change to one or more stages of [A]'s step (module docstring). Every hook passes through."""

    name = ""

    @classmethod
    def from_config(cls, cfg) -> "Variant | None":
        """The unit with its settings from the run's flags, or None when the flags do not ask for it."""
        return None

    def advantages(self, rewards: torch.Tensor, gen: torch.Generator, inner, **kw):
        return inner(rewards, **kw)

    def step_keep(self, alpha_logp: torch.Tensor, pi_k_logp: torch.Tensor, loss_mask: torch.Tensor):
        return None

    def loss(self, x: LossInput, inner, **settings) -> tuple[torch.Tensor, dict]:
        return inner(x, **settings)

    def step_stats(self, alpha_logp: torch.Tensor, pi_k_logp: torch.Tensor, loss_mask: torch.Tensor) -> dict:
        return {}


def overrides(v: Variant, hook: str) -> bool:
    return getattr(type(v), hook) is not getattr(Variant, hook)


class Recipe:
    """The run's variants, in REGISTRY's order, and [A]'s own settings: the step calls its stages through this."""

    def __init__(self, variants: list[Variant], *, group_size: int, mask_zero_std: bool, settings: dict):
        self.variants, self.group_size, self.mask_zero_std = variants, group_size, mask_zero_std
        self.settings = settings  # objective.policy_loss's: clip_eps, clip_eps_high, clip_center, beta, ...
        self.keeps_tokens = any(overrides(v, "step_keep") for v in variants)  # needs all of pi_k before the update

    @property
    def names(self) -> list[str]:
        return [v.name for v in self.variants]

    def advantages(self, rewards: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage 4: (A, valid), each (N,): group_advantages, through each variant's `advantages`."""

        def core(r, **kw):
            return group_advantages(r, self.group_size, mask_zero_std=self.mask_zero_std, **kw)

        return chain(self.variants, "advantages", core, gen=gen)(rewards)

    def step_keep(self, alpha_logp, pi_k_logp, loss_mask) -> tuple[torch.Tensor, dict]:
        """The tokens every variant's `step_keep` keeps, (N, T) bool, and their figures."""
        keep, stats = torch.ones_like(loss_mask, dtype=torch.bool), {}
        for v in self.variants:
            kept = v.step_keep(alpha_logp, pi_k_logp, loss_mask)
            if kept is not None:
                keep, stats = keep & kept[0], stats | kept[1]  # (N, T)
        return keep, stats

    def loss(self, x: LossInput) -> tuple[torch.Tensor, dict]:
        """Stage 6, one micro-batch: objective.policy_loss, through each variant's `loss`."""
        return chain(self.variants, "loss", policy_loss)(x, **self.settings)

    def step_stats(self, alpha_logp, pi_k_logp, loss_mask) -> dict:
        """Every variant's `step_stats`, over the tokens the step's loss counts: loss_mask less those `step_keep`
        drops (a token MIS drops is dropped, not also capped by TIS)."""
        stats, measuring = {}, [v for v in self.variants if overrides(v, "step_stats")]
        if measuring and self.keeps_tokens:
            loss_mask = loss_mask * self.step_keep(alpha_logp, pi_k_logp, loss_mask)[0]  # (N, T)
        for v in measuring:
            stats |= v.step_stats(alpha_logp, pi_k_logp, loss_mask)
        return stats


def chain(variants: list[Variant], hook: str, core: Callable, **bound) -> Callable:
    """`core` wrapped by each variant's `hook`, the first variant outermost: the hook gets the stage's input,
    `inner` (what it wraps) and `bound` (the generator of the advantages' stage)."""
    fn = core
    for v in reversed([v for v in variants if overrides(v, hook)]):
        fn = partial(getattr(v, hook), inner=fn, **bound)
    return fn


def recipe(cfg) -> Recipe:
    """The run's Recipe: every registered unit its flags ask for, and [A]'s settings from the flags."""
    variants = [v for cls in REGISTRY.values() if (v := cls.from_config(cfg)) is not None]
    settings = dict(
        clip_eps=cfg.clip_eps,
        clip_eps_high=cfg.clip_eps_high,
        clip_center=cfg.clip_center,
        beta=cfg.beta,
        kl_estimator=cfg.kl_estimator,
        agg=cfg.agg,
    )
    return Recipe(variants, group_size=cfg.group_size, mask_zero_std=cfg.mask_zero_std, settings=settings)
