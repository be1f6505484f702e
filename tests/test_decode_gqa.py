"""A decode step's grouped-query heads read the K/V cache unrepeated, under every transformers version (issue 56).

transformers 5.17's sdpa attention, given a mask, repeats the H_kv key/value heads to the H query heads over the
whole cache (repeat_kv) every layer of every decode step; 5.2x folds the query heads instead.
engine.decoding.folded_gqa makes every version fold. Checked here at a grouped layout of Qwen2.5-0.5B's ratio (14
query heads, 2 KV heads), built from a config (no download):

- the bytes a decode step copies, counted by torch's dispatcher (`CopyCensus`): at most one layer's K cache a layer
  on the static cache (the repeat would be 14: 7 copies each of K and V); on the plain loop, whose DynamicCache
  concatenates K and V each step, at most three (the repeat would add 14);
- the tokens and log-probs: both loops, folded, against the plain loop on transformers' own attention.

CI runs this file under transformers 5.17.0 (the GPU image's) and the newest (.ci/run).
"""

import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine import decoding
from engine.decoding import StaticDecoder, static_loop
from problems.tasks import Problem, encode_prompts
from rollout import generate, sample

pytestmark = pytest.mark.model

aten = torch.ops.aten
# Ops that write memory a tensor already held, or a copy of it: what a repeat of K/V shows up as (expand is a
# view; reshape of an expanded tensor is a clone; repeat_interleave and cat write the copies).
COPIES = {
    aten.clone.default,
    aten._to_copy.default,
    aten.copy_.default,
    aten.cat.default,
    aten.stack.default,
    aten.index.Tensor,
    aten.index_select.default,
    aten.index_copy_.default,
    aten.index_put_.default,
    aten.repeat.default,
    aten.repeat_interleave.self_int,
    aten.repeat_interleave.Tensor,
    aten.expand_copy.default,
    aten._unsafe_index.Tensor,
}


def nbytes(x) -> int:
    return x.numel() * x.element_size() if isinstance(x, torch.Tensor) else 0


class CopyCensus(TorchDispatchMode):
    """Bytes written by copying ops (COPIES) while active: an out-of-place op's output, an in-place op's source
    (index_copy_ writes its source's column, not the whole cache). `ops` lists (op, bytes) of each."""

    def __init__(self):
        super().__init__()
        self.bytes, self.ops = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in COPIES:
            in_place = func._schema.name.endswith("_")
            written = (
                nbytes(args[-1])
                if in_place
                else sum(nbytes(o) for o in (out if isinstance(out, (list, tuple)) else [out]))
            )
            self.bytes += written
            self.ops.append((str(func), written))
        return out


HEADS, KV_HEADS, HEAD_DIM, LAYERS = 14, 2, 8, 2


def gqa_model(tok, seed=0):
    """A random-weight Qwen2 with Qwen2.5-0.5B's head grouping (14 query heads on 2 KV heads), sdpa attention."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=HEADS * HEAD_DIM,
        intermediate_size=4 * HEADS * HEAD_DIM,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg).eval()


PROMPTS = [Problem("12+3=", "15"), Problem("4*4=", "16"), Problem("123-45=", "78")]


@pytest.fixture(scope="module")
def gqa(tok):
    return gqa_model(tok)


def kwargs(tok, **kw):
    return dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **kw)


def static_step_census(model, tok, rows=4, length=256) -> tuple[float, list]:
    """One decode step of the static cache, eager: the bytes it copies in layers' worth of K cache a layer."""
    ids, mask = encode_prompts(tok, PROMPTS, "cpu")
    dec = StaticDecoder(model, rows, length, torch.device("cpu"), graphs=False)
    with torch.no_grad():
        logits = dec.prefill(model, ids, mask, torch.arange(rows) % ids.shape[0])
        dec.decode(model, logits.argmax(-1))  # a first step outside the census (nothing lazy in the count)
        with CopyCensus() as census:
            dec.decode(model, logits.argmax(-1))
    k_layer = nbytes(dec.keys[0])  # one layer's K cache, (N, H_kv, L, D)
    return census.bytes / (LAYERS * k_layer), census.ops


def plain_step_census(model, tok, steps=200) -> tuple[float, list]:
    """The plain loop's last decode step of `steps` (its DynamicCache then holds prompt + steps columns), folded as
    static_loop(False) runs it: the bytes copied in layers' worth of that K cache a layer."""
    ids, mask = encode_prompts(tok, PROMPTS, "cpu")
    calls = []

    @functools.wraps(model.forward)  # its signature too: cache_kwarg reads it
    def counted(*a, **kw):  # a census of every forward: the last one is read
        with CopyCensus() as census:
            out = forward(*a, **kw)
        calls.append(census)
        return out

    forward = model.forward
    model.forward = counted
    try:
        generate(
            model,
            ids,
            mask,
            group_size=2,
            max_new_tokens=steps,
            temperature=0.0,
            ignore_eos=True,
            loop=static_loop(False),
            **kwargs(tok),
        )
    finally:
        del model.forward
    n, p = 2 * ids.shape[0], ids.shape[1]
    k_layer = n * KV_HEADS * (p + steps - 1) * HEAD_DIM * 4  # float32
    return calls[-1].bytes / (LAYERS * k_layer), calls[-1].ops


def test_a_static_decode_step_copies_at_most_one_layers_k_cache_a_layer(gqa, tok):
    ratio, ops = static_step_census(gqa, tok)
    assert ratio <= 1.0, f"a decode step copied {ratio:.2f} layers' worth of K cache a layer (K/V repeated?): {ops}"


def test_the_census_sees_the_repeat_where_the_fold_is_off(gqa, tok, monkeypatch):
    # transformers' own attention (the fold off): 5.17 repeats K and V 7 times each under the static cache's mask,
    # 5.2x folds by itself. The census must tell them apart, or the test above would prove nothing.
    import transformers.integrations.sdpa_attention as sdpa

    monkeypatch.setattr(decoding, "foldable", lambda *a: False)
    ratio, _ = static_step_census(gqa, tok)
    if hasattr(sdpa, "pack_gqa"):  # this transformers folds a decode step's heads itself
        assert ratio <= 1.0
    else:
        assert ratio >= HEADS - 1, ratio


def test_a_plain_decode_step_copies_no_repeated_k_v(gqa, tok):
    ratio, ops = plain_step_census(gqa, tok)
    # The DynamicCache's cat of K and V is 2 (and a little for the new column); a repeat would add 14.
    assert ratio <= 3.0, f"a plain decode step copied {ratio:.2f} layers' worth of K cache a layer: {ops}"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_folded_decoding_gives_the_plain_loops_tokens_and_logprobs(gqa, tok, temperature):
    ids, mask = encode_prompts(tok, PROMPTS, "cpu")
    kw = kwargs(tok, group_size=2, max_new_tokens=24, temperature=temperature, ignore_eos=True)

    def run(loop):
        gen = torch.Generator().manual_seed(0)
        return generate(gqa, ids, mask, generator=gen, loop=loop, **kw)

    reference = run(sample)  # transformers' own attention: no fold outside folded_gqa()
    folded_plain = run(static_loop(False))  # the plain loop, folded
    assert torch.equal(reference.completion_ids, folded_plain.completion_ids)
    assert torch.allclose(reference.sampler_logp, folded_plain.sampler_logp, atol=1e-5)
    assert torch.allclose(reference.entropy, folded_plain.entropy, atol=1e-5)
    if temperature == 0.0:  # the static cache picks by the race: its sampled tokens differ, its greedy ones do not
        static = run(static_loop(True))
        assert torch.equal(reference.completion_ids, static.completion_ids)
        assert torch.allclose(reference.sampler_logp, static.sampler_logp, atol=1e-5)
        assert torch.allclose(reference.entropy, static.entropy, atol=1e-5)


def test_the_fold_is_the_repeated_attention_with_and_without_a_mask():
    g = torch.Generator().manual_seed(0)
    n, length, d = 3, 40, 16
    q = torch.randn(n, HEADS, 1, d, generator=g)
    k, v = torch.randn(2, n, KV_HEADS, length, d, generator=g)
    mask = torch.rand(n, 1, 1, length, generator=g) > 0.3
    mask[:, ..., -1] = True
    rep = HEADS // KV_HEADS
    for m in (mask, None):
        want = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=m
        ).transpose(1, 2)  # (N, 1, H, D)
        got = decoding.fold_gqa_heads(q, k, v, m, None)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
