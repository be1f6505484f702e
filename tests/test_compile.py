"""--compile (engine/compiled.py): the static path's sampling step and the LM head's chunk functions through
torch.compile, against the same functions eager, on the tiny Qwen2: the same tokens, and log-probs, entropies and
gradients within float32's rounding (a fused kernel sums in its own order).

The backend "aot_eager" (dynamo's tracing and AOTAutograd, eager kernels) runs in the suite: it checks the routing
and that dynamo takes both functions (the draw's generator call runs eagerly). Inductor, the flag's backend,
compiles each graph with the C++ compiler: about 8 s a graph on a 2-core CPU and a minute the first time on a
machine, more than the suite's budget; GRPO_TEST_INDUCTOR=1 runs the same test on it.
"""

import os
import shutil

import pytest
import torch

from engine import compiled
from engine.chunked_logprobs import chunked_token_logprobs
from engine.decoding import static_loop
from problems.tasks import Problem, encode_prompts
from rollout import generate

pytestmark = pytest.mark.model

INDUCTOR = pytest.param(
    "inductor",
    marks=pytest.mark.skipif(
        os.environ.get("GRPO_TEST_INDUCTOR") != "1" or shutil.which(os.environ.get("CXX", "g++")) is None,
        reason="inductor compiles each graph with the C++ compiler (~8 s a graph, ~60 s the first time on a 2-core "
        "CPU): over the suite's budget; GRPO_TEST_INDUCTOR=1 (and a C++ compiler) runs it",
    ),
)


@pytest.fixture
def eager_after():
    yield
    compiled.eager_hot_paths()


def sample_and_score(model, tok, temperature):
    """One static-path sampling call (3 prompts x 2, 8 tokens), then the chunked head's log-probs of its completions
    and their gradient w.r.t. the head: what --compile changes."""
    problems = [Problem("12+3=", "15"), Problem("4*4=", "16"), Problem("123-45=", "78")]
    ids, mask = encode_prompts(tok, problems, "cpu")
    special = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    ro = generate(
        model,
        ids,
        mask,
        group_size=2,
        max_new_tokens=8,
        temperature=temperature,
        ignore_eos=True,
        generator=torch.Generator().manual_seed(5),
        loop=static_loop(True),
        **special,
    )
    model.zero_grad()
    logp = chunked_token_logprobs(model, ro.input_ids, ro.attention_mask, ro.completion_mask, temperature, chunk=5)
    (logp * ro.completion_mask).sum().backward()
    head = model.get_output_embeddings().weight.grad.clone()
    return ro, logp.detach(), head


@pytest.mark.parametrize("backend", ["aot_eager", INDUCTOR])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_compiled_hot_paths_equal_the_eager_ones(model, tok, backend, temperature, eager_after):
    ro, logp, head = sample_and_score(model, tok, temperature)
    compiled.compile_hot_paths(backend)
    ro_c, logp_c, head_c = sample_and_score(model, tok, temperature)
    assert torch.equal(ro_c.completion_ids, ro.completion_ids)
    assert (ro_c.sampler_logp - ro.sampler_logp).abs().max() <= 1e-5
    assert (ro_c.entropy - ro.entropy).abs().max() <= 1e-5
    assert (logp_c - logp).abs().max() <= 1e-5
    assert ((head_c - head).norm() / head.norm()).item() <= 1e-5
    assert compiled.compile_seconds() is not None and compiled.compile_seconds() > 0


def test_eager_is_the_default_and_comes_back(eager_after):
    from engine import chunked_logprobs, decoding
    from rollout import next_token

    assert decoding.STEP.next_token is next_token and chunked_logprobs.CHUNK.logp is chunked_logprobs.chunk_logp
    compiled.compile_hot_paths("aot_eager")
    assert decoding.STEP.next_token is not next_token
    compiled.eager_hot_paths()
    assert decoding.STEP.next_token is next_token and chunked_logprobs.CHUNK.grad is chunked_logprobs.chunk_grad
