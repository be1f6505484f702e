"""train.py: the update's gradient identities, alpha's refresh schedule, end-to-end runs."""

import dataclasses
import importlib.util
import json
import random
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import problems.prompts
import train
import variants
from advantage import group_advantages
from config import Config, build_parser, resolve
from conftest import ROOT, TEST_WARMUP, shared_data
from engine.chunked_logprobs import chunked_token_logprobs
from engine.policy import Models
from problems.prompts import PromptStream
from problems.tasks import Problem, encode_prompts, load_task
from rollout import generate

# Trains or decodes a model: CI runs these again under ATEN_CPU_CAPABILITY=default (plain kernels).
pytestmark = pytest.mark.model


class RecordingOptimizer:
    """Stands in for AdamW: records the gradient at each step instead of moving the weights."""

    def __init__(self, params):
        self.params, self.grads = list(params), []

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None

    def step(self):
        self.grads.append(torch.cat([p.grad.flatten() for p in self.params]).clone())


def make_batch(model, tok, seed=0, group=4, temperature=1.0):
    probs = [Problem(q, "0") for q in ("1+2=", "33-4=", "5*6=", "70+8=")]
    ids, mask = encode_prompts(tok, probs, "cpu")
    ro = generate(
        model,
        ids,
        mask,
        group_size=group,
        max_new_tokens=5,
        temperature=temperature,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        generator=torch.Generator().manual_seed(seed),
    )
    rewards = torch.tensor([float(i % 3 == 0) for i in range(ro.completion_ids.shape[0])])  # mixed groups
    rewards[:group] = 1.0  # one all-equal group: masked out
    adv, valid = group_advantages(rewards, group)
    return train.Batch(
        input_ids=ro.input_ids,
        attention_mask=ro.attention_mask,
        completion_mask=ro.completion_mask,
        loss_mask=ro.completion_mask * valid[:, None],
        advantages=adv,
        alpha_logp=None,  # a refresh step: alpha is pi_k
    )


def stale(batch: train.Batch, alpha_logp: torch.Tensor) -> train.Batch:
    """The batch as a stale step sees it: sampled by an alpha whose log-probs are `alpha_logp`, not pi_k."""
    return dataclasses.replace(batch, alpha_logp=alpha_logp)


def cfg_for(**kw):
    base = dict(max_grad_norm=1e9, temperature=1.0, group_size=4, prompts_per_step=4, out="/tmp/unused")
    return resolve(Config(**{**base, **kw}))


def test_on_policy_gradient_is_group_baseline_reinforce(model, tok):
    # v = 1, one inner step: rho = 1 where the gradient is taken, so no clipping can act and
    # grad = -(1/|tokens|) sum_i A_i sum_t grad log pi(y_t): REINFORCE with the group baseline.
    batch = make_batch(model, tok)
    opt = RecordingOptimizer(model.parameters())
    train.update(cfg_for(clip_eps=0.0), model, opt, batch, ref_logp=None)  # eps 0: clip as tight as it gets
    mask = batch.loss_mask
    logp = chunked_token_logprobs(model, batch.input_ids, batch.attention_mask, batch.completion_mask, 1.0)
    model.zero_grad()
    (-(batch.advantages[:, None] * logp * mask).sum() / mask.sum()).backward()
    reinforce = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert reinforce.abs().max() > 0
    assert torch.allclose(opt.grads[0], reinforce, atol=1e-6, rtol=1e-4)


def test_reward_shuffle_deals_the_same_rewards_to_random_samples():
    # The null control: the advantages are those of a permutation of the step's rewards, so the
    # reward rate is kept and the link between a completion and its reward is cut.
    rewards = torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1])  # 4 groups of 4
    plain_adv, _ = variants.recipe(cfg_for()).advantages(rewards, torch.Generator().manual_seed(0))
    adv, valid = variants.recipe(cfg_for(reward_shuffle=True)).advantages(rewards, torch.Generator().manual_seed(0))
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(0))  # the same draw, replayed
    ref_adv, ref_valid = group_advantages(rewards[perm], 4)
    assert not torch.equal(perm, torch.arange(16))
    torch.testing.assert_close(adv, ref_adv)
    assert torch.equal(valid, ref_valid)
    assert not torch.allclose(adv, plain_adv)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean", "constant"])
def test_micro_batched_gradient_equals_whole_batch(model, tok, agg):
    batch = make_batch(model, tok, seed=1)
    with torch.no_grad():  # a stale step with KL: alpha and reference log-probs differ from pi_k
        noise = 0.3 * torch.randn(batch.completion_mask.shape, generator=torch.Generator().manual_seed(0))
        lp = chunked_token_logprobs(model, batch.input_ids, batch.attention_mask, batch.completion_mask, 1.0)
        alpha_logp, ref = lp + noise, lp - noise
    grads = []
    for mb in (None, 4, 2):
        opt = RecordingOptimizer(model.parameters())
        train.update(cfg_for(micro_batch=mb, agg=agg, beta=0.1), model, opt, stale(batch, alpha_logp), ref)
        grads.append(opt.grads[0])
    assert grads[0].abs().max() > 0
    assert torch.allclose(grads[1], grads[0], atol=1e-6, rtol=1e-4)
    assert torch.allclose(grads[2], grads[0], atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean", "constant"])
@pytest.mark.parametrize("center, is_cap", [("pi_k", None), ("decoupled", 1.2)])
def test_mis_on_a_stale_step_micro_batched_equals_policy_loss_on_the_whole_batch(model, tok, agg, center, is_cap):
    # MIS's normaliser depends on log pi_k, which update() records during its first epoch: the gradient
    # of every micro-batching must still be objective.policy_loss's on the whole batch.
    from objective import LossInput, aggregation_total
    from variants.corrections import mis_keep_mask

    batch = make_batch(model, tok, seed=3)
    noise = 0.4 * torch.randn(batch.completion_mask.shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        lp = chunked_token_logprobs(model, batch.input_ids, batch.attention_mask, batch.completion_mask, 1.0)
    alpha_logp = lp + noise  # (N, T) a stale sampler: rho' = exp(-noise)
    keep = mis_keep_mask(alpha_logp, lp, 1.3)
    assert (batch.loss_mask.bool() & ~keep).any() and (batch.loss_mask.bool() & keep).any()  # MIS drops some
    model.zero_grad()
    logp = chunked_token_logprobs(model, batch.input_ids, batch.attention_mask, batch.completion_mask, 1.0)
    total = aggregation_total(batch.loss_mask * keep, agg, 5)
    A, loss_mask = batch.advantages, batch.loss_mask
    whole = cfg_for(agg=agg, clip_center=center, is_cap=is_cap, is_mask=1.3, max_new_tokens=5)
    x = LossInput(logp, alpha_logp, lp, None, A, loss_mask * keep, total)  # MIS's drops leave the loss and Z
    variants.recipe(whole).loss(x)[0].backward()  # the whole batch at once
    expected = torch.cat([p.grad.flatten() for p in model.parameters()]).clone()
    for mb in (None, 4, 2):
        opt = RecordingOptimizer(model.parameters())
        cfg = cfg_for(micro_batch=mb, agg=agg, clip_center=center, is_cap=is_cap, is_mask=1.3, max_new_tokens=5)
        stats, _ = train.update(cfg, model, opt, stale(batch, alpha_logp), None)
        assert torch.allclose(opt.grads[0], expected, atol=1e-6, rtol=1e-4), mb
        assert stats["is_masked_frac"] > 0 and (stats.get("is_capped_frac", 0) > 0) == (is_cap is not None)


def test_pi_k_is_recorded_from_the_first_inner_epoch(model, tok):
    batch = make_batch(model, tok, seed=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    expected = chunked_token_logprobs(model, batch.input_ids, batch.attention_mask, batch.completion_mask, 1.0).detach()
    _, pi_k_logp = train.update(cfg_for(inner_steps=3, micro_batch=4), model, opt, batch, None)
    assert torch.allclose(pi_k_logp, expected, atol=1e-6)  # recorded before the weights moved
    after = chunked_token_logprobs(model, batch.input_ids, batch.attention_mask, batch.completion_mask, 1.0)
    assert not torch.allclose(after, expected, atol=1e-3)  # and the weights did move


def small_cfg(warm_cache, tmp_path, **kw):
    base = dict(
        steps=7,
        prompts_per_step=4,
        group_size=4,
        lr=1e-3,
        eval_size=8,
        eval_every=0,
        progress=False,
        warmup_steps=TEST_WARMUP,
        cache_dir=warm_cache,
        out=str(tmp_path),
    )
    return resolve(Config(**{**base, **kw}))


@pytest.mark.parametrize("v,alpha_logp_from", [(1, "recompute"), (3, "recompute"), (3, "sampler")])
def test_a_refresh_samples_its_whole_period_from_the_live_policy(
    warm_cache, tmp_path, monkeypatch, tok, v, alpha_logp_from
):
    """Every v steps the live policy (no copy of it exists) samples the next v steps' batches in one call, of
    the prompts those steps would have drawn; a later batch's log alpha is that policy's (recompute) or the
    sampler's own (sampler), and the update of step k + j sees exactly that batch."""
    calls, updates, holder = [], [], {}
    real_generate, real_update, real_load = train.generate_batches, train.update, train.load_policy
    flat = lambda m: torch.cat([p.detach().flatten() for p in m.parameters()]).clone()  # noqa: E731

    def generate_spy(model, prompts, **kw):
        out = real_generate(model, prompts, **kw)
        calls.append((model is holder["policy"], flat(model), [p for p, _ in prompts], out))
        return out

    def update_spy(cfg, policy, opt, batch, ref_logp, **kw):
        updates.append((batch.input_ids.clone(), batch.alpha_logp))
        return real_update(cfg, policy, opt, batch, ref_logp, **kw)

    def load_spy(*a, **kw):
        holder["policy"], t = real_load(*a, **kw)
        return holder["policy"], t

    monkeypatch.setattr(train, "generate_batches", generate_spy)
    monkeypatch.setattr(train, "update", update_spy)
    coin = random.Random(0)
    monkeypatch.setattr(
        problems.prompts, "math_reward", lambda c, g: float(coin.random() < 0.5)
    )  # every step has signal
    monkeypatch.setattr(train, "load_policy", load_spy)
    train.train(small_cfg(warm_cache, tmp_path, offpolicy_steps=v, alpha_logp_from=alpha_logp_from))
    assert len(calls) == -(-7 // v) and len(updates) == 7  # one sampling call per refresh, an update per step
    assert all(live for live, *_ in calls) and Models.__dataclass_fields__.keys() == {"policy", "opt", "ref"}
    assert all(len(prompts) == min(v, 7 - v * c) for c, (_, _, prompts, _) in enumerate(calls))
    if v > 1:
        assert not torch.equal(calls[1][1], calls[0][1])  # the second period's alpha is the moved policy
    # The prompts, period by period, are those a v = 1 run draws step by step (the stream's order).
    stream = PromptStream(load_task("arithmetic")[0], 0)
    drawn = [encode_prompts(tok, stream.next(4), "cpu")[0] for _ in range(7)]
    sampled = [p for *_, prompts, _ in calls for p in prompts]
    assert len(sampled) == 7 and all(torch.equal(a, b) for a, b in zip(sampled, drawn))
    for k, (ids, alpha_logp) in enumerate(updates):
        ro = calls[k // v][3][k % v]
        assert torch.equal(ids, ro.input_ids)  # step k trains on its own batch of the period
        if k % v == 0 and alpha_logp_from == "recompute":
            assert alpha_logp is None  # alpha = pi_k: the update's first epoch gives it
        elif alpha_logp_from == "sampler":
            assert torch.equal(alpha_logp, ro.sampler_logp)
        else:
            with torch.no_grad():  # the policy at the refresh: the weights that sampled this period
                policy = train.load_policy(small_cfg(warm_cache, tmp_path))[0]
                torch.nn.utils.vector_to_parameters(calls[k // v][1], policy.parameters())
                expected = chunked_token_logprobs(
                    policy.eval(), ro.input_ids, ro.attention_mask, ro.completion_mask, 1.0
                )
            assert torch.equal(alpha_logp, expected)


def run_cli(*args, timeout=600):
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},  # a shared machine: see ENV
    )


def test_end_to_end_builtin_task_accuracy_rises(warm_cache, tmp_path):
    out = tmp_path / "run"
    r = run_cli(
        "--steps",
        "150",
        "--offpolicy-steps",
        "2",
        "--warmup-steps",
        str(TEST_WARMUP),
        "--cache-dir",
        warm_cache,
        "--eval-every",
        "0",
        "--eval-size",
        "300",
        "--out",
        str(out),
        "--no-progress",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_accuracy_end"] >= summary["eval_accuracy_start"] + 0.05, summary
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 150 and {"reward", "kl", "clip_low", "rho_prime_max", "tokens_per_s"} <= rows[-1].keys()
    assert max(r["rho_prime_max"] for r in rows[1::2]) > 1.0  # stale steps see rho' != 1


def test_real_model_path_offline(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok_dir, data = shared_data("qwen2-tokenizer"), shared_data("gsm8k", "train.jsonl")
    tok = AutoTokenizer.from_pretrained(tok_dir)
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model_dir = tmp_path / "qwen2-random"
    Qwen2ForCausalLM(cfg).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    out = tmp_path / "run"
    r = run_cli(
        "--model",
        str(model_dir),
        "--task",
        "gsm8k",
        "--data-files",
        str(data),
        "--steps",
        "2",
        "--prompts-per-step",
        "2",
        "--group-size",
        "2",
        "--max-new-tokens",
        "8",
        "--eval-size",
        "4",
        "--beta",
        "0.04",
        "--out",
        str(out),
        "--no-progress",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    assert "<|im_start|>user" in tok.decode(encode_prompts(tok, [Problem("q", "1")], "cpu")[0][0])  # chat template
    reloaded = AutoModelForCausalLM.from_pretrained(out / "final")
    assert reloaded.config.num_hidden_layers == 2


def test_help_and_the_flags_page_list_every_config_field_and_no_other():
    # `python train.py --help` is the reference; docs/flags.md groups the same flags for reading. A Config field
    # missing from either, or a flag there that no longer exists, is a defect.
    import re
    from dataclasses import fields

    help_text = build_parser().format_help()
    documented = set(re.findall(r"^\| `(--[\w-]+)` \|", (ROOT / "docs" / "flags.md").read_text(), flags=re.M))
    flags = {f"--{'no-' if f.default is True else ''}{f.name.replace('_', '-')}" for f in fields(Config)}
    assert documented == flags
    for flag in flags:
        assert re.search(rf"{flag}\b", help_text), flag


def test_a_step_without_signal_still_measures_the_sampling_loop(warm_cache, tmp_path, monkeypatch):
    # Equal rewards everywhere: no update, but the row still says whether the sampler saw the trained model.
    monkeypatch.setattr(problems.prompts, "math_reward", lambda text, gold: 0.0)
    cfg = resolve(
        Config(
            steps=2,
            offpolicy_steps=2,
            prompts_per_step=2,
            group_size=2,
            eval_size=4,
            eval_every=0,
            warmup_steps=TEST_WARMUP,
            cache_dir=warm_cache,
            out=str(tmp_path),
            progress=False,
        )
    )
    train.train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_no_signal"] for r in rows] == [1, 1]
    assert all(0 <= r["sampler_mismatch"] < 1e-5 for r in rows), rows  # refresh: a forward; stale: the recomputed


def test_no_eval_start_skips_only_the_first_evaluation(warm_cache, tmp_path):
    """--no-eval-start: summary.json records a null start, and the run is the same run: the same final
    weights, metrics and end accuracy (greedy evaluation draws no random numbers)."""
    runs = {}
    for flag in (True, False):
        out = tmp_path / str(flag)
        summary = train.train(small_cfg(warm_cache, out, steps=4, offpolicy_steps=2, eval_start=flag))
        weights = load_file(out / "final" / "model.safetensors")
        metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        drop = ("wall_s", "tokens_per_s", "peak_mem_gb", "peak_reserved_gb", "mem_gb")
        runs[flag] = (
            summary,
            weights,
            [{k: v for k, v in m.items() if k not in drop and not k.startswith("t_")} for m in metrics],
        )
    (on, w_on, m_on), (off, w_off, m_off) = runs[True], runs[False]
    assert isinstance(on["eval_accuracy_start"], float) and off["eval_accuracy_start"] is None
    assert json.loads((tmp_path / "False" / "summary.json").read_text())["eval_accuracy_start"] is None
    assert on["eval_accuracy_end"] == off["eval_accuracy_end"] and m_on == m_off
    assert w_on.keys() == w_off.keys() and all(torch.equal(w_on[k], w_off[k]) for k in w_on)
    assert (tmp_path / "False" / "curves.png").is_file() or importlib.util.find_spec("matplotlib") is None
