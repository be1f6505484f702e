"""logprobs.py and rollout.py: the textbook log-probs against the model's own loss, the chunked ones against the
textbook; sampling and EOS handling."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from engine import chunked_logprobs
from engine.chunked_logprobs import chunked_token_logprobs
from logprobs import position_ids_from_mask, token_logprobs
from problems.tasks import Problem, encode_prompts
from rollout import cat_rollouts, generate, generate_batches, rollout_rows

# Trains or decodes a model: CI runs these again under ATEN_CPU_CAPABILITY=default (plain kernels).
pytestmark = pytest.mark.model


def batch_of(tok, prompts, completions):
    """(input_ids, attention_mask, completion_mask) for left-padded prompts + right-padded completions."""
    ids, pmask = encode_prompts(tok, [Problem(p, "0") for p in prompts], "cpu")
    comp = [tok(c, add_special_tokens=False).input_ids + [tok.eos_token_id] for c in completions]
    t = max(map(len, comp))
    cids = torch.tensor([c + [tok.pad_token_id] * (t - len(c)) for c in comp])  # (N, T)
    cmask = torch.tensor([[1] * len(c) + [0] * (t - len(c)) for c in comp])  # (N, T)
    return torch.cat([ids, cids], 1), torch.cat([pmask, cmask], 1), cmask


def test_token_logprobs_equal_the_models_own_loss(model, tok):
    # Unpadded, one sequence at a time: the model's labels= loss is the mean NLL of the scored tokens.
    for prompt, comp in (("12+34=", "46"), ("7*8=", "56"), ("99-100=", "-1")):
        ids, attn, cmask = batch_of(tok, [prompt], [comp])
        labels = ids.clone()
        labels[:, : ids.shape[1] - cmask.shape[1]] = -100
        own = model(input_ids=ids, labels=labels).loss
        for logprobs_of in (token_logprobs, chunked_token_logprobs):
            ours = logprobs_of(model, ids, attn, cmask, temperature=1.0)
            assert torch.allclose(-ours[cmask.bool()].mean(), own, atol=1e-5), logprobs_of.__name__


@pytest.mark.parametrize("logprobs_of", [token_logprobs, chunked_token_logprobs])
def test_token_logprobs_padding_invariant_and_temperature(model, tok, logprobs_of):
    prompts, comps = ["1+1=", "12*12=", "99-9="], ["2", "144", "90"]
    ids, attn, cmask = batch_of(tok, prompts, comps)
    batched = logprobs_of(model, ids, attn, cmask, temperature=0.7)
    for i in range(3):
        a, b, c = batch_of(tok, [prompts[i]], [comps[i]])
        single = logprobs_of(model, a, b, c, temperature=0.7)
        k = c.shape[1]
        assert torch.allclose(batched[i, :k][c[0].bool()], single[0][c[0].bool()], atol=1e-5)
        assert (batched[i][~cmask[i].bool()] == 0).all()
    # Against a direct computation from the full logits / tau.
    logits = model(input_ids=ids, attention_mask=attn, position_ids=position_ids_from_mask(attn)).logits
    t = cmask.shape[1]
    ref = F.log_softmax(logits[:, -t - 1 : -1] / 0.7, -1).gather(2, ids[:, -t:, None]).squeeze(2) * cmask
    assert torch.allclose(batched, ref, atol=1e-5)


def test_chunked_logprobs_equal_the_textbook_in_value_and_gradient(model, tok):
    # Groups of rows share a prompt (the chunked path runs it once and fans its KV cache out), the LM head runs
    # in several chunks, and the temperature is not 1: the optimisation against the textbook line it replaces.
    ids, attn, cmask = batch_of(tok, ["1+1=", "1+1=", "12*12=", "12*12=", "50-7="], ["2", "3", "144", "14", "43"])
    w = torch.randn(cmask.shape, generator=torch.Generator().manual_seed(0))
    chunked = chunked_token_logprobs(model, ids, attn, cmask, 0.9, chunk=2)
    (chunked * w).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    textbook = token_logprobs(model, ids, attn, cmask, 0.9)
    (textbook * w).sum().backward()
    assert torch.allclose(chunked, textbook, atol=1e-5) and (textbook[cmask == 0] == 0).all()
    assert all(torch.allclose(g, p.grad, atol=1e-5) for g, p in zip(grads, model.parameters()))
    assert max(g.abs().max() for g in grads) > 0


def test_generic_head_path_agrees(model, tok, monkeypatch):
    ids, attn, cmask = batch_of(tok, ["3+4=", "10-20="], ["7", "-10"])
    textbook = token_logprobs(model, ids, attn, cmask, 1.0)
    monkeypatch.setattr(chunked_logprobs, "has_plain_head", lambda m: False)
    assert torch.allclose(chunked_token_logprobs(model, ids, attn, cmask, 1.0), textbook, atol=1e-5)


class ScriptedLM(torch.nn.Module):
    """A fake causal LM whose next token is scripted per row: row i says EOS after i tokens."""

    def __init__(self, vocab=8, eos=1):
        super().__init__()
        self.vocab, self.eos, self.dummy = vocab, eos, torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None, past_key_values=None):
        n = input_ids.shape[0]
        produced = attention_mask.shape[1] - self.prompt_len  # tokens generated so far
        logits = torch.full((n, input_ids.shape[1], self.vocab), -1e9)
        for i in range(n):
            nxt = self.eos if produced >= i else 5
            logits[i, -1, nxt] = 0.0
        return SimpleNamespace(logits=logits)


def test_eos_is_kept_and_tokens_after_it_are_masked():
    lm = ScriptedLM()
    prompt = torch.full((3, 2), 4)
    lm.prompt_len = 2
    ro = generate(
        lm,
        prompt,
        torch.ones_like(prompt),
        group_size=1,
        max_new_tokens=6,
        temperature=1.0,
        eos_token_id=1,
        pad_token_id=0,
        generator=torch.Generator().manual_seed(0),
    )
    # Row i: i tokens "5", then EOS (kept, in the mask), then padding (masked).
    assert ro.completion_ids.tolist()[2][:3] == [5, 5, 1]
    assert ro.completion_mask.tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert ro.completion_ids.shape[1] == 3  # stops once every row has ended
    assert ro.truncated.tolist() == [False, False, False]
    # In the loss, the EOS token carries gradient and the masked positions none.
    from objective import LossInput, policy_loss

    logp = torch.zeros(3, 3, requires_grad=True)
    A = torch.tensor([1.0, -1.0, 0.5])
    policy_loss(LossInput(logp, logp.detach(), logp.detach(), None, A, ro.completion_mask))[0].backward()
    assert (logp.grad[ro.completion_mask.bool()] != 0).all() and (logp.grad[~ro.completion_mask.bool()] == 0).all()
    short = generate(
        lm,
        prompt,
        torch.ones_like(prompt),
        group_size=1,
        max_new_tokens=1,
        temperature=1.0,
        eos_token_id=1,
        pad_token_id=0,
    )
    assert short.truncated.tolist() == [False, True, True]


def test_the_sampling_loops_log_alpha_matches_a_forward_pass_and_seed_reproduces(model, tok):
    ids, mask = encode_prompts(tok, [Problem("12+3=", "15"), Problem("4*4=", "16")], "cpu")
    kw = dict(
        group_size=3, max_new_tokens=5, temperature=1.3, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    a = generate(model, ids, mask, generator=torch.Generator().manual_seed(1), **kw)
    b = generate(model, ids, mask, generator=torch.Generator().manual_seed(1), **kw)
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert a.completion_ids.shape[0] == 6 and torch.equal(a.prompt_ids[0], a.prompt_ids[2])  # group-major
    lp = chunked_token_logprobs(model, a.input_ids, a.attention_mask, a.completion_mask, 1.3)
    assert torch.allclose(lp, a.sampler_logp, atol=1e-5)  # KV-cached sampling == full forward


def test_greedy_is_argmax_of_the_full_forward(model, tok):
    ids, mask = encode_prompts(tok, [Problem("1+2=", "3"), Problem("77-7=", "70")], "cpu")
    ro = generate(
        model,
        ids,
        mask,
        group_size=1,
        max_new_tokens=4,
        temperature=0.0,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    seq, attn = ids, mask
    for _ in range(ro.completion_ids.shape[1]):  # naive decoding without a cache
        logits = model(input_ids=seq, attention_mask=attn, position_ids=position_ids_from_mask(attn)).logits
        seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], 1)
        attn = torch.cat([attn, torch.ones_like(attn[:, :1])], 1)
    got = seq[:, ids.shape[1] :]
    assert torch.equal(
        torch.where(ro.completion_mask.bool(), ro.completion_ids, -1), torch.where(ro.completion_mask.bool(), got, -1)
    )


@pytest.mark.parametrize("bias", [False, True])
def test_selected_logprob_function_gradcheck(bias):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(5, 4, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(7, 4, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(7, dtype=torch.float64, generator=g, requires_grad=True) if bias else None
    y = torch.tensor([0, 3, 6, 2, 2])
    f = lambda h, w, b: chunked_logprobs.SelectedLogProb.apply(h, w, b, y, 0.8, 2).double()
    assert torch.autograd.gradcheck(f, (h, w, b))


def test_generate_batches_splits_one_sampling_into_the_batches_each_step_would_have_sampled(model, tok):
    # Three steps' batches of different prompt widths, sampled in calls of at most 8 rows (2 prompts x G 4):
    # each step's rollout holds its own rows, trimmed of the padding no row of it needs, and its tokens and
    # sampler log-probs are those of the one sampling, row for row.
    steps = [["1+2=", "33-4="], ["5*6=", "7+80="], ["12+34=", "9-9="]]
    prompts = [encode_prompts(tok, [Problem(q, "0") for q in qs], "cpu") for qs in steps]
    kw = dict(group_size=4, max_new_tokens=6, temperature=1.0, eos_token_id=tok.eos_token_id)
    out = generate_batches(
        model, prompts, max_rows=8, pad_token_id=tok.pad_token_id, generator=torch.Generator().manual_seed(0), **kw
    )
    # The same calls by hand: one generate per 2 prompts, in order, with one generator.
    gen = torch.Generator().manual_seed(0)
    width = max(ids.shape[1] for ids, _ in prompts)
    for (ids, mask), ro in zip(prompts, out):
        ids = torch.nn.functional.pad(ids, (width - ids.shape[1], 0), value=tok.pad_token_id)
        mask = torch.nn.functional.pad(mask, (width - mask.shape[1], 0), value=0)
        ref = generate(model, ids, mask, pad_token_id=tok.pad_token_id, generator=gen, **kw)
        keep = ref.prompt_mask.any(0)  # (P,) the prompt columns in use
        assert torch.equal(ro.prompt_ids, ref.prompt_ids[:, keep]) and torch.equal(
            ro.prompt_mask, ref.prompt_mask[:, keep]
        )
        t = ro.completion_ids.shape[1]
        assert t == int(ref.completion_mask.sum(1).max())  # no all-padding completion column
        assert torch.equal(ro.completion_ids, ref.completion_ids[:, :t]) and torch.equal(ro.truncated, ref.truncated)
        assert torch.equal(ro.sampler_logp, ref.sampler_logp[:, :t])
        # The trimmed batch is what the update reads: its log-probs equal the sampler's (one network).
        lp = chunked_token_logprobs(model, ro.input_ids, ro.attention_mask, ro.completion_mask, 1.0)
        assert torch.allclose(lp, ro.sampler_logp, atol=1e-5)


def test_cat_then_rows_gives_back_each_part_exactly(model, tok):
    kw = dict(group_size=2, max_new_tokens=5, temperature=1.0, eos_token_id=tok.eos_token_id, pad_token_id=0)
    parts = [
        generate(
            model,
            *encode_prompts(tok, [Problem(q, "0") for q in qs], "cpu"),
            generator=torch.Generator().manual_seed(s),
            **kw,
        )
        for s, qs in enumerate([["1+2="], ["12*12=", "5-5="]])
    ]
    whole = cat_rollouts(parts, pad_token_id=0)
    for part, rows in zip(parts, (slice(0, 2), slice(2, 6))):
        back = rollout_rows(whole, rows)
        assert all(torch.equal(getattr(back, f), getattr(part, f)) for f in vars(part))
