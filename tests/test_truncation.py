"""Truncated sampling (--top-k / --top-p / --min-p): the kept set against hand-computed cases, every log-prob
renormalised over it (sampler, textbook, chunked head), its gradient against finite differences, and rho' = 1 at
a refresh."""

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

import train
from bookkeeping.harness import Harness
from config import Config, resolve
from engine.chunked_logprobs import SelectedLogProb, chunked_token_logprobs
from engine.decoding import static_loop
from engine.policy import make_models
from logprobs import Truncation, kept_tokens, sampling_logits, token_logprobs
from problems.tasks import Problem, encode_prompts
from rollout import generate

# A vocabulary of five tokens with probabilities written out: p = (0.5, 0.25, 0.15, 0.1, 0) up to the
# last token, whose logit is far below the others (p ~ 1e-9, so it is dropped by every cut below).
P = torch.tensor([0.5, 0.25, 0.15, 0.1 - 1e-9, 1e-9], dtype=torch.float64)
Z = P.log()


@pytest.mark.parametrize(
    "truncation,kept",
    [
        (Truncation(), [1, 1, 1, 1, 1]),  # off
        (Truncation(top_k=2), [1, 1, 0, 0, 0]),
        # mass before each token, most likely first: 0, 0.5, 0.75, 0.9, 1.0; kept while < p
        (Truncation(top_p=0.7), [1, 1, 0, 0, 0]),
        (Truncation(top_p=0.75), [1, 1, 0, 0, 0]),  # 0.75 is not < 0.75
        (Truncation(top_p=0.76), [1, 1, 1, 0, 0]),
        (Truncation(top_p=0.5), [1, 0, 0, 0, 0]),
        (Truncation(top_p=0.01), [1, 0, 0, 0, 0]),  # the top token is always kept
        # p >= min_p x 0.5
        (Truncation(min_p=0.3), [1, 1, 1, 0, 0]),
        (Truncation(min_p=0.5), [1, 1, 0, 0, 0]),
        # top-k first, then top-p over the renormalised (0.5, 0.25, 0.15) / 0.9: mass before 0, 0.556, 0.833
        (Truncation(top_k=3, top_p=0.8), [1, 1, 0, 0, 0]),
        (Truncation(top_k=3, top_p=0.85), [1, 1, 1, 0, 0]),
        (Truncation(top_k=4, top_p=0.95, min_p=0.25), [1, 1, 1, 0, 0]),
    ],
)
def test_the_kept_set_and_its_renormalised_log_probs_by_hand(truncation, kept):
    keep = torch.tensor(kept, dtype=torch.bool)
    assert torch.equal(kept_tokens(Z, truncation), keep)
    # log alpha over the kept set: log(p / sum of the kept p), -inf outside it.
    by_hand = torch.where(keep, (P / P[keep].sum()).log(), -math.inf)
    assert torch.allclose(torch.log_softmax(sampling_logits(Z, 1.0, truncation), -1), by_hand, atol=1e-12)


def test_ties_at_the_edge_are_kept_together_and_the_temperature_comes_first():
    z = torch.tensor([2.0, 1.0, 1.0, 0.0])
    assert kept_tokens(z, Truncation(top_k=2)).tolist() == [True, True, True, False]  # two tied second tokens
    # At tau = 0.5 the distribution is sharper: p = (0.787, 0.107, 0.107, 0.014), so top-p 0.8 keeps all three
    # tied or leading tokens ((0.787 + 0.107) passes 0.8 within the tie); at tau = 1 top-p 0.5 keeps one.
    p_sharp = torch.softmax(z / 0.5, -1)
    assert p_sharp[0] < 0.8 and kept_tokens(z / 0.5, Truncation(top_p=0.8)).tolist() == [True, True, True, False]
    assert kept_tokens(z, Truncation(top_p=0.5)).tolist() == [True, False, False, False]
    # A scored token outside the set is kept (targets): its log-prob is finite, renormalised with it in the set.
    lp = torch.log_softmax(sampling_logits(z, 1.0, Truncation(top_k=1), targets=torch.tensor(3)), -1)
    assert torch.allclose(lp[3], z[3] - torch.logsumexp(z[[0, 3]], 0)) and lp[1] == -math.inf


def test_greedy_and_untruncated_logits_are_the_same_floats_as_before():
    logits = torch.randn(3, 7, 11)
    assert torch.equal(sampling_logits(logits, 0.7), logits.float() / 0.7)
    assert torch.equal(sampling_logits(logits, 0.7, Truncation()), logits.float() / 0.7)
    assert torch.equal(sampling_logits(logits, 0.0, Truncation(top_k=2)), logits.float())  # greedy: whole


def batch(tok, model, truncation, temperature=0.9, seed=0, fast=False):
    ids, mask = encode_prompts(tok, [Problem("12+34=", "46"), Problem("7*8=", "56")], "cpu")
    gen = torch.Generator().manual_seed(seed)
    return generate(
        model,
        ids,
        mask,
        group_size=4,
        max_new_tokens=6,
        temperature=temperature,
        truncation=truncation,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        generator=gen,
        loop=static_loop(fast),
    )


@pytest.mark.model
@pytest.mark.parametrize("fast", [False, True], ids=["plain", "static-cache"])
@pytest.mark.parametrize("truncation", [Truncation(top_p=0.8), Truncation(top_k=3), Truncation(top_k=5, min_p=0.05)])
def test_the_sampling_loop_picks_from_the_kept_set_and_records_its_renormalised_log_probs(model, tok, truncation, fast):
    """Both sampling loops: rollout.sample (the reference) and decoding.sample_static (on CPU without graph capture)."""
    ro = batch(tok, model, truncation, fast=fast)
    cm = ro.completion_mask.bool()
    textbook = token_logprobs(model, ro.input_ids, ro.attention_mask, ro.completion_mask, 0.9, truncation)
    # The sampler's log alpha is the forward's renormalised one (the KV-cached loop against one full pass) ...
    assert (ro.sampler_logp - textbook)[cm].abs().max() < 1e-5
    # ... and not the whole vocabulary's: that differs by the log of the kept mass (trl#6789's bias).
    whole = token_logprobs(model, ro.input_ids, ro.attention_mask, ro.completion_mask, 0.9)
    assert (ro.sampler_logp - whole)[cm].max() > 1e-3 and ((ro.sampler_logp - whole)[cm] >= -1e-6).all()
    # Every sampled token was in the kept set of its position.
    logits = model(input_ids=ro.input_ids, attention_mask=ro.attention_mask).logits[:, -cm.shape[1] - 1 : -1]
    keep = kept_tokens(logits.float() / 0.9, truncation)
    assert keep.gather(2, ro.completion_ids[:, :, None]).squeeze(2)[cm].all()


@pytest.mark.model
@pytest.mark.parametrize("truncation", [Truncation(top_p=0.8), Truncation(top_k=2, min_p=0.1)])
def test_the_chunked_head_equals_the_textbook_under_truncation_in_value_and_gradient(model, tok, truncation):
    ro = batch(tok, model, truncation)
    args = (ro.input_ids, ro.attention_mask, ro.completion_mask, 0.9, truncation)
    w = torch.randn(ro.completion_mask.shape, generator=torch.Generator().manual_seed(1))
    chunked = chunked_token_logprobs(model, *args, chunk=3)
    (chunked * w).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    textbook = token_logprobs(model, *args)
    (textbook * w).sum().backward()
    assert torch.allclose(chunked, textbook, atol=1e-5)
    assert all(torch.allclose(g, p.grad, atol=1e-5) for g, p in zip(grads, model.parameters()))


def test_the_gradient_through_the_renormalised_log_prob_matches_finite_differences():
    # float64, and logits far from every edge of the kept set, so a step of 1e-6 moves no token in or out.
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, 4, generator=g, dtype=torch.float64, requires_grad=True)
    weight = (3 * torch.randn(9, 4, generator=g, dtype=torch.float64)).requires_grad_()
    bias = torch.randn(9, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([0, 1, 2, 3, 4, 5])  # some of them outside the kept set: kept as scored tokens
    for truncation in (Truncation(top_p=0.7), Truncation(top_k=3), Truncation(top_k=6, min_p=0.2)):

        def f(h, w, b, truncation=truncation):
            return SelectedLogProb.apply(h, w, b, targets, 0.8, 4, truncation)

        assert torch.autograd.gradcheck(f, (hidden, weight, bias), eps=1e-6, atol=1e-7)
        # The same values as the textbook formula on the full logits.
        z = sampling_logits(hidden @ weight.T + bias, 0.8, truncation, targets=targets)
        assert torch.allclose(f(hidden, weight, bias), torch.log_softmax(z, -1).gather(1, targets[:, None])[:, 0])


@pytest.mark.model
@pytest.mark.parametrize("alpha_logp_from", ["recompute", "sampler"])
def test_rho_prime_is_one_at_a_refresh_with_top_p_on(model, tok, alpha_logp_from, tmp_path):
    """At a refresh alpha = pi_k. With log alpha from pi_k's own forward, rho' = 1 exactly; with the sampler's log
    alpha, rho' = 1 up to the sampling loop's numerics (sampler_mismatch ~ 0): the two are renormalised over one set."""
    cfg = resolve(
        Config(
            top_p=0.8,
            temperature=0.9,
            offpolicy_steps=2,
            alpha_logp_from=alpha_logp_from,
            prompts_per_step=2,
            group_size=4,
            out=str(tmp_path),
        )
    )
    models = make_models(cfg, model)
    problems = [Problem("12+34=", "46"), Problem("7*8=", "56")]
    mixed = lambda ro: torch.tensor([1.0, 0.0] * 4)  # noqa: E731  every group has signal: the update runs
    prompts = [(*encode_prompts(tok, problems, "cpu"), mixed) for _ in range(2)]
    res, _ = train.grpo_step(cfg, models, tok, 0, torch.Generator().manual_seed(0), None, lambda k, n, now: prompts[:n])
    assert res.drew_ahead
    if alpha_logp_from == "recompute":
        assert res.stats["rho_prime_max"] == 1.0 and res.stats["rho_prime_p99"] == 1.0
    else:
        # the loop's harness measures it (bookkeeping.harness.Harness.mismatch: the batch sampled at its own step
        # against pi_k's forward, the update's first)
        mismatch = Harness.mismatch(SimpleNamespace(cfg=cfg, logprobs=None), 0, res)["sampler_mismatch"]
        assert abs(res.stats["rho_prime_max"] - 1) < 1e-4 and mismatch < 1e-5
    untruncated = dataclasses.replace(cfg, top_p=1.0)
    assert untruncated.truncation.cuts is False and cfg.truncation == Truncation(top_p=0.8)
