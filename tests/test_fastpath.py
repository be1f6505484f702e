"""decoding.py's fast path (static KV cache, CUDA graph) against the plain loop, the reference.

On CPU the static-cache decode runs without graph capture (`fast=True`), so the cache, the masks,
the positions and the EOS bookkeeping are all checked here; the CUDA-graph tests skip without CUDA
(gpu_check.sh runs them on the GPU machine). The fast path samples by the exponential race rather
than multinomial, so sampled tokens differ between the paths for the same seed: sampling is
checked by the log-probs of the fast path's own tokens under a full forward pass, and the race
itself against softmax frequencies. Greedy decoding must give identical tokens.

Both paths, and `chunked_token_logprobs`, run a group's shared prompt once: checked against row-by-row
computation (values and gradients) and by counting the tokens that reach the embedding.
"""

import pytest
import torch

from engine import decoding
from engine.chunked_logprobs import chunked_token_logprobs
from engine.decoding import sample_exponential_race, sampling_path, static_loop
from logprobs import position_ids_from_mask, token_logprobs
from problems.tasks import Problem, encode_prompts
from rollout import generate

# Trains or decodes a model: CI runs these again under ATEN_CPU_CAPABILITY=default (plain kernels).
pytestmark = pytest.mark.model

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="CUDA-graph path: needs a GPU (gpu_check.sh runs it)")

# Prompts of different lengths, so the batch is left-padded and positions must skip the padding.
PROMPTS = [Problem("12+3=", "15"), Problem("4*4=", "16"), Problem("123-45=", "78")]


def kwargs(tok, **kw):
    return dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **kw)


def prompts(tok, device="cpu"):
    return encode_prompts(tok, PROMPTS, device)


def assert_same_rollout(a, b, atol=1e-5):
    """Identical tokens and masks; log-probs and entropies equal to float tolerance."""
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert torch.equal(a.completion_mask, b.completion_mask)
    assert torch.equal(a.truncated, b.truncated)
    assert torch.equal(a.prompt_ids, b.prompt_ids) and torch.equal(a.prompt_mask, b.prompt_mask)
    assert torch.allclose(a.sampler_logp, b.sampler_logp, atol=atol)
    assert torch.allclose(a.entropy, b.entropy, atol=atol)


def full_forward_entropy(model, ro, temperature):
    """Entropy of softmax(logits / tau) at every completion position, from one uncached forward."""
    ids, attn = ro.input_ids, ro.attention_mask
    t = ro.completion_ids.shape[1]
    logits = model(input_ids=ids, attention_mask=attn, position_ids=position_ids_from_mask(attn)).logits
    log_probs = torch.log_softmax(logits[:, -t - 1 : -1].float() / temperature, dim=-1)  # (N, T, V)
    return -(log_probs.exp() * log_probs).sum(-1) * ro.completion_mask  # (N, T)


def test_greedy_is_identical_on_both_paths(model, tok):
    ids, mask = prompts(tok)
    kw = kwargs(tok, group_size=2, max_new_tokens=12, temperature=0.0)
    plain = generate(model, ids, mask, **kw)
    fast = generate(model, ids, mask, loop=static_loop(True), **kw)
    assert_same_rollout(plain, fast)
    # ignore_eos too: every row runs to max_new_tokens and is truncated.
    plain = generate(model, ids, mask, ignore_eos=True, **kw)
    fast = generate(model, ids, mask, loop=static_loop(True), ignore_eos=True, **kw)
    assert_same_rollout(plain, fast)
    assert fast.completion_ids.shape[1] == 12 and fast.truncated.all()


# The hand-set ending model's greedy chain, token -> next token, on the tokenizer's symbols: it stops
# after a number of steps fixed by the prompt's last symbol, or never (the 7 -> 8 -> 9 -> 0 -> 7 cycle).
CHAIN = {
    "=": "1",
    "1": "<eos>",
    "2": "3",
    "3": "<eos>",
    "4": "5",
    "5": "6",
    "6": "<eos>",
    "7": "8",
    "8": "9",
    "9": "0",
    "0": "7",
    "+": "2",
    "-": "2",
    "*": "4",
    "<pad>": "<eos>",
    "<eos>": "<eos>",
    "<unk>": "<eos>",
}


@pytest.fixture(scope="module")
def ending_model(tok):
    """A tiny Qwen2 whose greedy continuation is fixed by its weights: the next token is CHAIN[last token].

    The random-init layers stay (so the KV cache, masks and positions still shape every logit), but the
    embeddings are one-hot and the untied head maps one-hot(x) to CHAIN[x] with a logit margin of about 10,
    far above what the layers add (about 0.4): no kernel's rounding can change an argmax. Built, not trained.
    """
    from engine import tiny

    model = tiny.build_model(tok, seed=0)
    cfg = model.config
    cfg.tie_word_embeddings = False
    hand = type(model)(cfg)
    hand.load_state_dict(model.state_dict(), strict=False)
    vocab, hidden = len(tok), cfg.hidden_size
    with torch.no_grad():
        hand.get_input_embeddings().weight.copy_(torch.eye(vocab, hidden))  # (V, H) token x -> e_x
        head = torch.zeros(vocab, hidden)  # (V, H) row y collects the x with CHAIN[x] = y
        for x, y in CHAIN.items():
            head[tok.convert_tokens_to_ids(y), tok.convert_tokens_to_ids(x)] = 1.0
        hand.get_output_embeddings().weight.copy_(head)
    return hand.eval()


def chain_length(prompt: str, limit: int, ends=("<eos>",)) -> tuple[int, bool]:
    """Completion length (the end token included) that CHAIN gives after `prompt`, capped at `limit`; and
    truncated? `ends`: the tokens that end a row."""
    token = prompt[-1]
    for t in range(1, limit + 1):
        token = CHAIN[token]
        if token in ends:
            return t, False
    return limit, True


# Last symbols 1, =, 2, 4 end after 1, 2, 2, 3 tokens; 7 never ends. Lengths differ, so do the prompts'.
ENDING_PROMPTS = ["11", "12+3=", "4*2", "98-4", "31", "7=", "6*2", "8-4"]


@pytest.mark.parametrize("max_new_tokens", [2, 8])
def test_eos_bookkeeping_matches_the_plain_loop(ending_model, tok, max_new_tokens):
    # 2: rows needing 3 tokens are truncated, the others end; 8: every row ends (after 1 to 3 tokens), so
    # both paths stop early, at the same T. The lengths, masks and padding are what CHAIN dictates.
    ids, mask = encode_prompts(tok, [Problem(q, "0") for q in ENDING_PROMPTS], "cpu")
    kw = kwargs(tok, group_size=1, max_new_tokens=max_new_tokens, temperature=0.0)
    plain = generate(ending_model, ids, mask, **kw)
    fast = generate(ending_model, ids, mask, loop=static_loop(True), **kw)
    assert_same_rollout(plain, fast)
    expected = [chain_length(q, max_new_tokens) for q in ENDING_PROMPTS]
    for ro in (plain, fast):
        assert ro.completion_mask.sum(1).tolist() == [n for n, _ in expected]
        assert ro.truncated.tolist() == [trunc for _, trunc in expected]
        assert ro.completion_ids.shape[1] == max(n for n, _ in expected)
        for row, (n, trunc) in zip(ro.completion_ids.tolist(), expected):
            assert (row[n - 1] == tok.eos_token_id) != trunc and row[n:] == [tok.pad_token_id] * (len(row) - n)
    if max_new_tokens == 2:
        assert fast.truncated.any() and not fast.truncated.all()
    else:
        assert not fast.truncated.any() and fast.completion_ids.shape[1] == 3 < max_new_tokens


def test_sampled_masks_follow_the_eos_rules(ending_model, tok):
    # At temperature 1.5 the chain is followed with probability about 0.98 a token: rows ending in "="
    # mostly end after 2 tokens, rows ending in "7" cycle past 4 tokens; what is checked holds for every row.
    ids, mask = encode_prompts(tok, [Problem("12+3=", "15"), Problem("407", "0"), Problem("4*4=", "16")], "cpu")
    ro = generate(
        ending_model,
        ids,
        mask,
        loop=static_loop(True),
        generator=torch.Generator().manual_seed(0),
        **kwargs(tok, group_size=8, max_new_tokens=4, temperature=1.5),
    )
    assert ro.truncated.any() and not ro.truncated.all()
    for row, m, trunc in zip(ro.completion_ids, ro.completion_mask, ro.truncated):
        k = int(m.sum())  # the mask is a prefix: 1 up to and including EOS, then pad
        assert m[:k].all() and not m[k:].any() and (row[k:] == tok.pad_token_id).all()
        assert bool(trunc) == (tok.eos_token_id not in row[:k].tolist())
        if not trunc:
            assert row[k - 1] == tok.eos_token_id and tok.eos_token_id not in row[: k - 1].tolist()
    assert (ro.sampler_logp[ro.completion_mask == 0] == 0).all() and (ro.entropy[ro.completion_mask == 0] == 0).all()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_and_entropy_match_a_full_forward(model, tok, temperature):
    ids, mask = prompts(tok)
    kw = kwargs(tok, group_size=4, max_new_tokens=10, temperature=temperature)
    ro = generate(model, ids, mask, loop=static_loop(True), generator=torch.Generator().manual_seed(0), **kw)
    lp = chunked_token_logprobs(model, ro.input_ids, ro.attention_mask, ro.completion_mask, temperature)
    assert torch.allclose(ro.sampler_logp, lp, atol=1e-5)  # static-cache sampling == full forward
    assert torch.allclose(ro.entropy, full_forward_entropy(model, ro, temperature), atol=1e-5)
    # Same for the plain path's tokens, so both paths score their tokens under the same model.
    pl = generate(model, ids, mask, generator=torch.Generator().manual_seed(0), **kw)
    assert torch.allclose(
        pl.sampler_logp,
        chunked_token_logprobs(model, pl.input_ids, pl.attention_mask, pl.completion_mask, temperature),
        atol=1e-5,
    )
    # The generator alone decides the sample: same seed, same tokens; another seed, others.
    again = generate(model, ids, mask, loop=static_loop(True), generator=torch.Generator().manual_seed(0), **kw)
    other = generate(model, ids, mask, loop=static_loop(True), generator=torch.Generator().manual_seed(1), **kw)
    assert_same_rollout(ro, again, atol=0)
    assert not torch.equal(ro.completion_ids, other.completion_ids)


def test_reused_cache_sees_new_prompts_and_new_weights(tok):
    # The decoder (and on CUDA its graph) is kept per model and shape; a later call must see the
    # new prompts and the weights as they are now (an optimizer step changes them in place).
    from engine import tiny

    model = tiny.build_model(tok, seed=0).eval()
    kw = kwargs(tok, group_size=2, max_new_tokens=8, temperature=0.0, ignore_eos=True)
    ids, mask = prompts(tok)
    generate(model, ids, mask, loop=static_loop(True), **kw)
    ids2, mask2 = encode_prompts(tok, [Problem("9*9=", "81"), Problem("1+1=", "2"), Problem("77-70=", "7")], "cpu")
    assert_same_rollout(
        generate(model, ids2, mask2, **kw),
        generate(model, ids2, mask2, loop=static_loop(True), **kw),
    )
    with torch.no_grad():
        model.load_state_dict(tiny.build_model(tok, seed=5).state_dict())  # in place, like alpha <- pi_theta
    assert_same_rollout(
        generate(model, ids2, mask2, **kw),
        generate(model, ids2, mask2, loop=static_loop(True), **kw),
    )


def test_exponential_race_picks_from_the_softmax():
    # 40,000 independent picks from one distribution over 6 tokens: frequencies within 5 sigma.
    p = torch.softmax(torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5, -3.0]), -1)
    n = 40_000
    picks = sample_exponential_race(p.expand(n, -1).contiguous(), torch.Generator().manual_seed(0))
    freq = torch.bincount(picks, minlength=6).double() / n
    sigma = (p.double() * (1 - p.double()) / n).sqrt()
    assert ((freq - p.double()).abs() <= 5 * sigma + 1e-9).all(), (freq, p)


def test_sampling_path_names(model, tok):
    from types import SimpleNamespace

    assert sampling_path(model) == ("static-cache+cuda-graph" if next(model.parameters()).is_cuda else "plain")
    assert sampling_path(model, fast=True) == "static-cache"  # the model is on CPU here
    assert sampling_path(model, fast=False) == "plain"
    lm = torch.nn.Linear(2, 2)  # not a transformers model: plain, and loop=static_loop(True) is an error
    lm.config = SimpleNamespace(_attn_implementation="sdpa")
    assert sampling_path(lm) == "plain"
    with pytest.raises(ValueError):
        sampling_path(lm, fast=True)


def test_one_token_prompts(model, tok):
    # P = 1: the prefill is then one column wide, like a decode step, and must still be a prefill.
    ids, mask = torch.tensor([[5], [7]]), torch.ones(2, 1, dtype=torch.long)
    kw = kwargs(tok, group_size=2, max_new_tokens=6, temperature=0.0, ignore_eos=True)
    assert_same_rollout(
        generate(model, ids, mask, **kw),
        generate(model, ids, mask, loop=static_loop(True), **kw),
    )


def test_shared_prompt_logprobs_and_gradients_equal_row_by_row(model, tok):
    # chunked_token_logprobs runs a group's prompt once; row by row nothing can be shared: an independent reference.
    ids, mask = prompts(tok)
    ro = generate(
        model,
        ids,
        mask,
        loop=static_loop(False),
        generator=torch.Generator().manual_seed(0),
        **kwargs(tok, group_size=4, max_new_tokens=6, temperature=1.0),
    )
    w = torch.randn(ro.completion_mask.shape, generator=torch.Generator().manual_seed(1))  # (N, T)
    batched = chunked_token_logprobs(model, ro.input_ids, ro.attention_mask, ro.completion_mask, 0.8)
    (batched * w).sum().backward()
    shared_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    for i in range(ro.input_ids.shape[0]):
        one = chunked_token_logprobs(
            model, ro.input_ids[i : i + 1], ro.attention_mask[i : i + 1], ro.completion_mask[i : i + 1], 0.8
        )
        assert torch.allclose(one, batched[i : i + 1], atol=1e-5)
        (one * w[i : i + 1]).sum().backward()
    for g, p in zip(shared_grads, model.parameters()):
        assert torch.allclose(g, p.grad, atol=1e-5, rtol=1e-4)


def test_prompts_run_once_per_group(model, tok):
    # Count the tokens that reach the embedding: B*P for the prompts, not N*P.
    seen = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, args, out: seen.append(args[0].numel()))
    ids, mask = prompts(tok)
    b, p, g, t = ids.shape[0], ids.shape[1], 4, 5
    kw = kwargs(tok, group_size=g, max_new_tokens=t, temperature=1.0, ignore_eos=True)
    for fast in (False, True):
        seen.clear()
        ro = generate(model, ids, mask, loop=static_loop(fast), generator=torch.Generator().manual_seed(0), **kw)
        assert seen == [b * p] + [b * g] * (t - 1)  # the prefill once per prompt, then one token per row
    seen.clear()
    chunked_token_logprobs(model, ro.input_ids, ro.attention_mask, ro.completion_mask, 1.0)
    assert seen == [b * p, b * g * t]
    hook.remove()


def test_auto_falls_back_to_plain_when_the_static_cache_fails(model, tok, monkeypatch, capsys):
    # loop=static_loop(None) on a model the static cache turns out not to fit (a transformers version whose
    # attention calls the cache differently, say): one warning, the plain result, plain from then on.
    monkeypatch.setattr(decoding, "sampling_path", lambda m, fast=None: "plain" if fast is False else "static-cache")

    def broken(self, *a, **kw):
        raise TypeError("update() got an unexpected keyword argument")

    monkeypatch.setattr(decoding.StaticDecoder, "prefill", broken)
    ids, mask = prompts(tok)
    kw = kwargs(tok, group_size=2, max_new_tokens=5, temperature=0.0)
    ro = generate(model, ids, mask, loop=static_loop(None), **kw)
    warned = capsys.readouterr().err.splitlines()
    assert len(warned) == 1 and "static-cache path failed" in warned[0]  # one line
    assert_same_rollout(ro, generate(model, ids, mask, **kw))
    assert model in decoding._NO_FAST  # sampling_path(model) stays "plain" on CUDA too
    with pytest.raises(TypeError):  # asked for explicitly, the failure is the caller's to see
        generate(model, ids, mask, loop=static_loop(True), **kw)


def test_a_diverged_policy_is_not_taken_for_a_path_failure(tok, monkeypatch):
    # Non-finite logits raise FloatingPointError (train.py counts the step as non-finite) on either
    # path; auto mode must pass it on, not switch the model to the plain path for good.
    from engine import tiny

    model = tiny.build_model(tok, seed=0).eval()
    with torch.no_grad():
        model.model.norm.weight.fill_(float("nan"))
    monkeypatch.setattr(decoding, "sampling_path", lambda m, fast=None: "plain" if fast is False else "static-cache")
    ids, mask = prompts(tok)
    with pytest.raises(FloatingPointError):
        generate(
            model,
            ids,
            mask,
            loop=static_loop(None),
            **kwargs(tok, group_size=2, max_new_tokens=3, temperature=1.0),
        )
    assert model not in decoding._NO_FAST


@pytest.mark.parametrize("fast", [False, True])
def test_logits_that_turn_non_finite_mid_decode_raise_floating_point_error(tok, fast):
    # The prefill is fine and the third decode step's logits are NaN: the plain path would otherwise
    # hit multinomial's bare RuntimeError, and the race would quietly pick a token from NaN.
    from engine import tiny

    model = tiny.build_model(tok, seed=0).eval()
    calls = []

    def nan_from_the_third_call(module, args, out):
        calls.append(1)
        return out * float("nan") if len(calls) >= 3 else out

    model.lm_head.register_forward_hook(nan_from_the_third_call)
    ids, mask = prompts(tok)
    kw = kwargs(tok, group_size=2, max_new_tokens=6, temperature=1.0)
    with pytest.raises(FloatingPointError, match="not finite"):
        generate(model, ids, mask, loop=static_loop(fast), ignore_eos=True, **kw)
    assert len(calls) >= 3  # it did get past the prefill


# --- CUDA: the captured graph ---------------------------------------------------------------------


@needs_cuda
def test_cuda_graph_greedy_matches_plain_and_sees_weight_updates(tok):
    from engine import tiny

    model = tiny.build_model(tok, seed=0).cuda().eval()
    assert sampling_path(model) == "static-cache+cuda-graph"
    ids, mask = prompts(tok, "cuda")
    kw = kwargs(tok, group_size=4, max_new_tokens=16, temperature=0.0)
    assert_same_rollout(
        generate(model, ids, mask, **kw), generate(model, ids, mask, loop=static_loop(None), **kw), atol=1e-4
    )
    assert sampling_path(model) == "static-cache+cuda-graph"  # the capture worked (no fallback)
    # An optimizer step changes the weights in place: the replayed graph must use the new ones.
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    assert_same_rollout(
        generate(model, ids, mask, **kw), generate(model, ids, mask, loop=static_loop(None), **kw), atol=1e-4
    )


@needs_cuda
def test_cuda_graph_sampling_logprobs_match_a_full_forward(tok):
    from engine import tiny

    model = tiny.build_model(tok, seed=1).cuda().eval()
    ids, mask = prompts(tok, "cuda")
    kw = kwargs(tok, group_size=8, max_new_tokens=16, temperature=0.9)
    gen = lambda s: torch.Generator(device="cuda").manual_seed(s)
    ro = generate(model, ids, mask, loop=static_loop(None), generator=gen(0), **kw)
    lp = chunked_token_logprobs(model, ro.input_ids, ro.attention_mask, ro.completion_mask, 0.9)
    assert torch.allclose(ro.sampler_logp, lp, atol=1e-4)
    assert torch.allclose(ro.entropy, full_forward_entropy(model, ro, 0.9), atol=1e-4)
    assert_same_rollout(
        ro, generate(model, ids, mask, loop=static_loop(None), generator=gen(0), **kw), atol=0
    )  # graph replay reproduces


@needs_cuda
def test_cuda_graph_under_bf16_autocast(tok):
    # train.py may run the sampling loop under bf16 autocast; the graph must capture without the cast cache.
    from engine import tiny

    model = tiny.build_model(tok, seed=2).cuda().eval()
    ids, mask = prompts(tok, "cuda")
    kw = kwargs(
        tok, group_size=4, max_new_tokens=12, temperature=1.0, generator=torch.Generator(device="cuda").manual_seed(0)
    )
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ro = generate(model, ids, mask, loop=static_loop(None), **kw)
        lp = chunked_token_logprobs(model, ro.input_ids, ro.attention_mask, ro.completion_mask, 1.0)
    assert sampling_path(model) == "static-cache+cuda-graph"
    assert torch.isfinite(ro.sampler_logp).all()
    # bf16 rounding only: the graph's log alpha as close to the float32 textbook's as the bf16 training forward's
    # is (benchmarks/gpu_checks.py's rule; its floor from the logits' bf16 step).
    from benchmarks.gpu_checks import bf16_bound, bf16_step

    on = ro.completion_mask.bool()
    exact = token_logprobs(model, ro.input_ids, ro.attention_mask, ro.completion_mask, 1.0)  # float32
    rms = lambda x: x[on].pow(2).mean().sqrt().item()  # noqa: E731
    with torch.no_grad():
        pos = position_ids_from_mask(ro.attention_mask)
        logits = model(input_ids=ro.input_ids, attention_mask=ro.attention_mask, position_ids=pos).logits
    step = bf16_step(logits[:, -on.shape[1] - 1 : -1].abs().amax(-1)[on]).pow(2).mean().sqrt().item()
    assert rms(ro.sampler_logp - exact) <= bf16_bound(rms(lp - exact), step, "value")


def test_every_end_id_of_the_generation_config_ends_a_row_on_both_paths(ending_model, tok):
    # A model whose generation config lists two end ids (as Qwen2.5's and Llama 3's do): "3" ends a row as EOS
    # does, so prompts ending in "2" (2 -> 3) now end after 2 tokens with "3" kept; the others as before.
    import copy

    from rollout import end_ids

    model = copy.deepcopy(ending_model)
    three = tok.convert_tokens_to_ids("3")
    model.generation_config.eos_token_id = [tok.eos_token_id, three]
    assert end_ids(model, tok) == [tok.eos_token_id, three]
    assert end_ids(ending_model, tok) == [tok.eos_token_id]  # the tiny config names the tokenizer's EOS alone
    ids, mask = encode_prompts(tok, [Problem(q, "0") for q in ENDING_PROMPTS], "cpu")
    kw = dict(pad_token_id=tok.pad_token_id, group_size=1, max_new_tokens=8, temperature=0.0)
    expected = [chain_length(q, 8, ends=("<eos>", "3")) for q in ENDING_PROMPTS]
    assert expected != [chain_length(q, 8) for q in ENDING_PROMPTS]  # the second end id changes some rows
    for loop in (None, static_loop(True)):
        ro = generate(model, ids, mask, eos_token_id=end_ids(model, tok), loop=loop, **kw)
        assert ro.completion_mask.sum(1).tolist() == [n for n, _ in expected]
        assert ro.truncated.tolist() == [trunc for _, trunc in expected]
        for row, (n, trunc) in zip(ro.completion_ids.tolist(), expected):
            assert trunc or row[n - 1] in (tok.eos_token_id, three)
            assert row[n:] == [tok.pad_token_id] * (len(row) - n)


def test_held_out_evaluation_ends_rows_on_every_end_id(ending_model, tok):
    # The same two end ids in bookkeeping.evaluation.evaluate: "12+3=" goes = -> 1 -> EOS, "6*2" goes 2 -> 3 and ends.
    import copy

    from bookkeeping.evaluation import evaluate

    model = copy.deepcopy(ending_model)
    model.generation_config.eos_token_id = [tok.eos_token_id, tok.convert_tokens_to_ids("3")]
    seen = []
    evaluate(
        model, tok, [Problem("6*2", "0"), Problem("98-4", "0")], 8, "cpu", lambda text, gold: seen.append(text) or 0.0
    )
    assert seen == ["3", "56"]  # 2 -> 3 (an end, kept); 4 -> 5 -> 6 -> EOS (dropped from the text)
