"""step.reference_step, Algorithm 1 written plainly, against step.grpo_step, the engine the loop runs: from the same
policy, optimizer state, prompts and generator they make the same updates, step after step.

What differs between the two is numerics only: the reference scores with logprobs.token_logprobs (full logits),
the engine with chunked_logprobs (the head in chunks, a group's prompt run once), and at a refresh the engine takes
log alpha of the first batch from the update's own forward. So the weights agree to float32 rounding, not bit for
bit. The measure is the relative gap of the two runs' updates, |dtheta_engine - dtheta_ref| / |dtheta_engine| over
all weights after 8 steps of AdamW at lr 1e-3: at most 1e-3. Measured 1.2e-5 to 3.0e-5 on these configs with AVX
kernels, up to 1.6e-4 (two inner steps, where the clip acts) under ATEN_CPU_CAPABILITY=default: Adam divides each
gradient by its own scale, so a weight whose gradient is rounding noise moves by rounding-sized steps. A wrong
update, one Adam step too many, is a gap of 0.46 (the last test asserts > 1e-2)."""

import copy

import pytest
import torch

import step
import train
from config import Config, resolve
from engine.policy import load_policy
from problems.tasks import encode_prompts, load_task

pytestmark = pytest.mark.model

TOLERANCE = 1e-3  # the largest relative gap of the two updates: float32 rounding, accumulated over the steps


def draws(cfg, tokenizer):
    """train.run's `draw`: the next n steps' prompts, in stream order, each with its verifier."""
    stream = train.PromptStream(load_task(cfg.task)[0], cfg.seed)

    def draw(n: int) -> list:
        batches = [stream.next(cfg.prompts_per_step) for _ in range(n)]
        reward = train.reward_of(cfg.task)
        return [
            (*encode_prompts(tokenizer, b, "cpu"), train.verifier(tokenizer, b, cfg.group_size, reward))
            for b in batches
        ]

    return draw


def run_both(cfg, steps, break_reference=None):
    """The same run twice, `steps` steps each: the engine's grpo_step and the reference; their policies."""
    policy, tokenizer = load_policy(cfg, log=lambda *a: None)
    engine, reference = step.make_models(cfg, copy.deepcopy(policy)), step.make_models(cfg, copy.deepcopy(policy))
    gen_e, gen_r = (torch.Generator().manual_seed(cfg.seed) for _ in range(2))
    draw_e, draw_r = draws(cfg, tokenizer), draws(cfg, tokenizer)
    cycle_e = cycle_r = None
    for k in range(steps):
        _, cycle_e = step.grpo_step(cfg, engine, tokenizer, k, gen_e, cycle_e, draw_e)
        cycle_r = step.reference_step(
            cfg, reference.policy, reference.opt, reference.ref, tokenizer, k, gen_r, cycle_r, draw_r
        )
        if break_reference is not None:
            break_reference(reference, k)
    return engine.policy, reference.policy


def update_gap(engine, reference, start) -> tuple[float, float]:
    """|dtheta_engine - dtheta_reference| / |dtheta_engine| over all weights, and max |dtheta_engine|."""
    moved = lambda m: torch.cat([(p - q).flatten() for p, q in zip(m.parameters(), start.parameters())])  # noqa: E731
    d_e, d_r = moved(engine), moved(reference)
    return ((d_e - d_r).norm() / d_e.norm()).item(), d_e.abs().max().item()


@pytest.mark.parametrize(
    "flags",
    [
        dict(),  # the default config: on-policy (v = 1)
        dict(offpolicy_steps=4),  # the README's run: the sampler refreshed every 4 steps
        dict(offpolicy_steps=4, beta=0.04, inner_steps=2),  # a KL term, the clip acting at the second inner step
        dict(offpolicy_steps=2, beta=0.04, kl_importance_weight=True, clip_center="alpha"),
    ],
    ids=["default", "v4", "v4-kl-inner2", "v2-weighted-kl-ppo-clip"],
)
def test_the_reference_step_makes_the_engines_update(flags):
    cfg = resolve(Config(steps=8, lr=1e-3, out="/tmp/unused", **flags))
    engine, reference = run_both(cfg, cfg.steps)
    gap, moved = update_gap(engine, reference, load_policy(cfg, log=lambda *a: None)[0])
    assert moved > 1e-3  # it trained: 8 steps of lr 1e-3 moved the weights
    assert gap < TOLERANCE, gap


def test_the_comparison_sees_a_different_update():
    # The check can fail: one reference update taken twice is a gap far above the tolerance.
    cfg = resolve(Config(steps=4, lr=1e-3, out="/tmp/unused"))

    def twice(models, k):
        if k == 1:
            models.opt.step()  # Adam's step again, on the same gradient

    engine, reference = run_both(cfg, cfg.steps, break_reference=twice)
    gap, _ = update_gap(engine, reference, load_policy(cfg, log=lambda *a: None)[0])
    assert gap > 1e-2, gap
