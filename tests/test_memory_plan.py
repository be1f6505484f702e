"""engine/memory.py's plan at the benchmark's shape (issue 56): every byte a step holds, counted before it runs.

The benchmark's shape (docs/benchmarks.md): Qwen2.5-0.5B's config, built on the meta device (no download, no
memory), bf16 autocast over float32 weights, beta 0.04 (pi_ref's copy), 64 prompts x 8 completions of 128 + 256
tokens. The budget is a 40 GiB cap (bench's --memory-cap-gb 40) on a bigger device; the decoders count their CUDA
graph pools as on a GPU.
"""

import pytest
import torch

from config import Config
from engine import memory
from engine import policy as P

GIB = 2**30
QWEN_05B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    tie_word_embeddings=True,
)


@pytest.fixture(scope="module")
def qwen():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device("meta"):
        return Qwen2ForCausalLM(Qwen2Config(**QWEN_05B))


def bench_cfg(**kw) -> Config:
    shape = dict(prompts_per_step=64, group_size=8, max_new_tokens=256, beta=0.04, dtype="bfloat16", steps=40)
    return Config(model="qwen2.5-0.5b-random", device="cuda", out="/tmp/unused", **(shape | kw))


def plan(qwen, **kw):
    nograd_rows = kw.pop("nograd_rows", None)
    return memory.memory_plan(bench_cfg(**kw), qwen, 128, budget=40 * GIB, graphs=True, nograd_rows=nograd_rows)


@pytest.mark.parametrize("schedule", [dict(lag=4), dict(offpolicy_steps=4), dict(offpolicy_steps=1)])
def test_lag_4_and_v_4_fit_a_40_gib_cap_by_the_plan(qwen, schedule):
    p = plan(qwen, **schedule)
    print(p.describe())
    assert p.fits, p.describe()
    assert p.peak <= p.long_lived + 0.85 * (40 * GIB - p.long_lived) < 40 * GIB
    # Every item the issue names is in it.
    whats = " | ".join(what for _, what, _ in p.items)
    for item in (
        "pi_ref's copy",
        "gradients and AdamW",
        "the queue",
        "KV cache",
        "graph's pool",
        "no-grad pass",
        "micro-batch",
        "sampling chain",
        "shared cast",
    ):
        assert item in whats, item
    held = 5 if "lag" in schedule else schedule["offpolicy_steps"]
    assert f"the queue: {held} batch(es)" in whats


def test_the_plan_counts_the_last_smaller_sampling_call_and_evaluations_decoders(qwen):
    # v = 4's refresh samples 2048 rows; at 40 GiB a call holds at most 1368 (sample_rows_fitting), so the default
    # makes two equal calls of 1024 (policy.balanced_rows): one decoder. Evaluation's 500 greedy rows are a call of
    # 256 and one of 244: two more.
    p = plan(qwen, offpolicy_steps=4)
    assert p.sample_rows == 1024
    assert sorted(r for r, _ in p.decoders) == [244, 256, 1024]
    # --sample-rows 1368: the last call, 680 rows, has a decoder (and graph pool) of its own, counted.
    p = plan(qwen, offpolicy_steps=4, sample_rows=1368)
    assert sorted(r for r, _ in p.decoders) == [244, 256, 680, 1368]
    # --lag 4: the first step draws 5 batches (2560 rows: 2 calls of 1280), each later step one (512 rows).
    p = plan(qwen, lag=4)
    assert sorted(r for r, _ in p.decoders) == [244, 256, 512, 1280]


def test_no_grad_passes_over_all_rows_cost_nine_gib_more_than_at_the_micro_batch(qwen):
    # pi_ref's forward, log alpha's recompute and sampler_mismatch's over all 512 rows at once hold ~9.1 GiB more than
    # over the update's micro-batch of 16 rows (the issue's ~9-10 GB); at the micro-batch they stay under the update.
    whole = plan(qwen, lag=4, nograd_rows=512)
    micro = plan(qwen, lag=4)
    assert whole.phases["no-grad"] - micro.phases["no-grad"] > 9 * GIB
    assert micro.phases["no-grad"] < micro.phases["update"]


def test_the_plan_uses_the_defaults_sizing(qwen, monkeypatch):
    # The micro-batch and the sampling rows are engine.policy's, at the same memory: 16 rows and 512 rows a call
    # at v = 1 (docs/benchmarks.md's table); the plan's micro-batch sees the decoders' graph pools too.
    p = plan(qwen, offpolicy_steps=1)
    assert p.sample_rows == 512
    assert p.micro_batch == P.micro_batch_fitting(
        qwen.config,
        512,
        384,
        False,
        40 * GIB
        - sum(b for ph, _, b in p.items if ph in ("resident", "decoders"))
        + sum(b for _, w, b in p.items if w.startswith("gradients")),
        torch.bfloat16,
        P.pending_bytes(qwen, torch.bfloat16),
    )


def test_the_plans_lines_name_the_peak(qwen):
    text = plan(qwen, lag=4).describe()
    assert "predicted peak" in text and "fits" in text and "GiB" in text
