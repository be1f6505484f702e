"""train.grpo_step, the step the loop runs, against Algorithm 1 written out plainly here (`textbook_step`): from
the same policy, optimizer state, prompts and generator they make the same updates, step after step.

The textbook step is the paper's pseudo-code in torch: logprobs.token_logprobs (full logits), one batch, float32, no
micro-batches, timers or fast paths, k % v == 0 for the refresh. What differs from the step is numerics only: the
step scores with engine/chunked_logprobs.py (the head in chunks, a group's prompt run once), and at a refresh takes
log alpha of the first batch from the update's own forward. So the weights agree to float32 rounding, not bit for
bit. The measure is the relative gap of the two runs' updates, |dtheta_step - dtheta_textbook| / |dtheta_step| over
all weights after 8 steps of AdamW at lr 1e-3: at most 1e-3. Measured 1.2e-5 to 3.0e-5 on these configs with AVX
kernels, up to 1.6e-4 (two inner steps, where the clip acts) under ATEN_CPU_CAPABILITY=default: Adam divides each
gradient by its own scale, so a weight whose gradient is rounding noise moves by rounding-sized steps. A wrong
update, one Adam step too many, is a gap of 0.46 (the last test asserts > 1e-2)."""

import copy

import pytest
import torch

import train
from advantage import group_advantages
from config import Config, resolve
from engine.policy import load_policy, make_models
from logprobs import token_logprobs
from objective import LossInput, policy_loss
from problems.prompts import PromptStream, completion_texts, reward_of
from problems.tasks import encode_prompts, load_task
from rollout import generate_batches

pytestmark = pytest.mark.model

TOLERANCE = 1e-3  # the largest relative gap of the two updates: float32 rounding, accumulated over the steps


def textbook_step(cfg: Config, policy, opt, ref, tokenizer, k: int, gen, period: list | None, draw) -> list:
    """Step k of Algorithm 1 on [A]'s loss, one batch at once, float32. `ref` is pi_ref (None when beta = 0);
    `draw(k, n)` gives steps k, ..., k + n - 1's (prompt_ids, prompt_mask, reward_fn); `period` is the previous
    call's result (None at first). Not here: --ref-refresh, --red, --reward-shuffle, --asymre-shift, --is-cap,
    --is-mask, the decoupled clip, [B]'s losses, --alpha-logp-from sampler."""
    v, G = cfg.offpolicy_steps, cfg.group_size

    def logp_of(model, ro):  # log pi(y_t) (N, T) of the completions
        ids, mask, completion_mask = ro.input_ids, ro.attention_mask, ro.completion_mask
        return token_logprobs(model, ids, mask, completion_mask, cfg.temperature, cfg.truncation)

    # 1-3. refresh: alpha <- pi_theta samples the batches of steps k, ..., k + v - 1 now, scores them, and records
    # log alpha
    if k % v == 0:
        draws = draw(k, min(v, cfg.steps - k))
        rollouts = generate_batches(
            policy,
            [(ids, mask) for ids, mask, _ in draws],
            group_size=G,
            max_rows=cfg.sample_rows or 10**9,  # the default on a CPU: the whole refresh period in one call
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            truncation=cfg.truncation,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            generator=gen,
        )
        with torch.no_grad():
            period = [(ro, reward_fn(ro), logp_of(policy, ro)) for ro, (_, _, reward_fn) in zip(rollouts, draws)]
    ro, rewards, alpha_logp = period[k % v]

    # 4. group-relative advantages; the groups whose rewards are all equal leave the loss
    advantages, valid = group_advantages(rewards, G, mask_zero_std=cfg.mask_zero_std)  # (N,) each
    loss_mask = ro.completion_mask * valid[:, None]  # (N, T)
    if loss_mask.sum() == 0:
        return period  # no group carries signal: no update

    # 5. log pi_ref, a constant
    with torch.no_grad():
        ref_logp = logp_of(ref, ro) if cfg.beta > 0 else None  # (N, T)

    # 6. mu optimizer steps on [A]'s clipped surrogate; pi_k is pi_theta before the first one
    pi_k_logp = None
    for i in range(cfg.inner_steps):
        logp = logp_of(policy, ro)  # (N, T) log pi_theta, with grad
        if i == 0:
            pi_k_logp = logp.detach()
        x = LossInput(logp, alpha_logp, pi_k_logp, ref_logp, advantages, loss_mask, total=None)
        settings = dict(clip_eps=cfg.clip_eps, clip_eps_high=cfg.clip_eps_high, clip_center=cfg.clip_center)
        if not cfg.kl_importance_weight:
            loss, _ = policy_loss(x, **settings, beta=cfg.beta, kl_estimator=cfg.kl_estimator, agg=cfg.agg)
        else:  # the KL term weighted by rho = pi_theta / alpha (token-mean): written out here, not the unit's code
            loss, _ = policy_loss(x, **settings, beta=0.0, agg=cfg.agg)
            log_ref_ratio = ref_logp - logp  # (N, T)
            k3 = torch.exp(log_ref_ratio) - log_ref_ratio - 1  # (N, T)
            rho = torch.exp(logp - alpha_logp)  # (N, T)
            loss = loss + cfg.beta * (rho * k3 * loss_mask).sum() / loss_mask.sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm)
        opt.step()
    return period


def draws(cfg, tokenizer):
    """The loop's `draw(k, n)`: the next n steps' prompts, in stream order, each with the task's verifier."""
    stream = PromptStream(load_task(cfg.task)[0], cfg.seed)
    reward = reward_of(cfg.task)

    def scorer(problems):
        golds = [p.gold for p in problems for _ in range(cfg.group_size)]  # rows are group-major
        return lambda ro: torch.tensor([reward(t, g) for t, g in zip(completion_texts(tokenizer, ro), golds)])

    def draw(k: int, n: int, now: int | None = None) -> list:  # `now`: the drawing step, which no verifier reads
        batches = [stream.next(cfg.prompts_per_step) for _ in range(n)]
        return [(*encode_prompts(tokenizer, b, "cpu"), scorer(b)) for b in batches]

    return draw


def run_both(cfg, steps, break_reference=None):
    """The same run twice, `steps` steps each: train.grpo_step and the textbook step; their policies."""
    policy, tokenizer = load_policy(cfg, log=lambda *a: None)
    engine, reference = make_models(cfg, copy.deepcopy(policy)), make_models(cfg, copy.deepcopy(policy))
    gen_e, gen_r = (torch.Generator().manual_seed(cfg.seed) for _ in range(2))
    draw_e, draw_r = draws(cfg, tokenizer), draws(cfg, tokenizer)
    period_e = period_r = None
    for k in range(steps):
        _, period_e = train.grpo_step(cfg, engine, tokenizer, k, gen_e, period_e, draw_e)
        period_r = textbook_step(
            cfg, reference.policy, reference.opt, reference.ref, tokenizer, k, gen_r, period_r, draw_r
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
def test_the_step_makes_the_textbook_update(flags):
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
