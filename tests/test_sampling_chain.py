"""The per-token sampling math (`rollout.next_token`, the exponential race) and the LM head's backward
(`engine.chunked_logprobs.SelectedLogProb`): the same values as the textbook written plainly here, in fewer passes
over the (rows, V) logits.

The textbook step: z = logits / tau in float32, -inf outside the kept set; log alpha = log_softmax(z); a draw from
alpha = softmax(z), by multinomial or by the exponential race argmax p / E, E = -log U; entropy -sum p log p over
the kept set. Under a fixed generator the draws use the same random numbers, so the tokens must be identical.
"""

import math

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from engine.chunked_logprobs import SelectedLogProb
from engine.decoding import sample_exponential_race
from logprobs import Truncation, kept_tokens
from rollout import next_token, sample_multinomial

V = 500
TRUNCATIONS = [None, Truncation(top_k=7), Truncation(top_p=0.8), Truncation(min_p=0.05)]


def textbook_step(logits, alive, temperature, truncation, generator, draw):
    """(token, log alpha(token), entropy) for live rows, by the definitions, each on its own line."""
    z = logits.float() / temperature  # (N, V)
    if truncation is not None:
        z = z.masked_fill(~kept_tokens(z, truncation), -math.inf)
    logp_all = torch.log_softmax(z, dim=-1)
    p = torch.softmax(z, dim=-1)
    if draw == "multinomial":
        token = torch.multinomial(p, 1, generator=generator).squeeze(1)
    else:  # the exponential race: the token with the largest p / E, E ~ Exp(1)
        e = -torch.rand(p.shape, generator=generator).log()
        token = (p / e).argmax(dim=-1)
    p64, logp64 = p.double(), logp_all.double()
    entropy = -torch.where(p64 > 0, p64 * logp64, torch.zeros_like(p64)).sum(-1)
    logp = logp_all.gather(1, token[:, None]).squeeze(1)
    return torch.where(alive, token, 0), torch.where(alive, logp, 0.0), torch.where(alive, entropy, 0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("truncation", TRUNCATIONS)
@pytest.mark.parametrize("draw", ["multinomial", "race"])
@pytest.mark.parametrize("amp", [False, True])
def test_next_token_is_the_textbook_step(dtype, temperature, truncation, draw, amp):
    # bfloat16 logits are what the policy's forward gives under autocast; the samplers run the step inside the
    # run's autocast (train.sample_ahead), the textbook here outside it.
    logits = (torch.randn(64, V, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)
    alive = torch.ones(64, dtype=torch.bool)
    alive[::5] = False  # rows that have ended: pad, log-prob and entropy 0
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        ours = next_token(
            logits,
            alive,
            torch.zeros(64, dtype=torch.long),
            temperature=temperature,
            truncation=truncation,
            eos_token_id=torch.tensor([1]),
            pad_token_id=0,
            generator=torch.Generator().manual_seed(11),
            ignore_eos=False,
            draw=sample_multinomial if draw == "multinomial" else sample_exponential_race,
        )
    token, logp, entropy = textbook_step(
        logits, alive, temperature, truncation, torch.Generator().manual_seed(11), draw
    )
    assert torch.equal(ours[0], token)
    # The log-probs come from the same log_softmax of the same floats: equal; the entropy sums in another order.
    assert torch.equal(ours[1], logp)
    assert (ours[2].double() - entropy).abs().max() < 1e-5


def test_the_race_draws_alpha_outside_the_kept_set_never():
    # A kept set of 3 tokens of 6: 30,000 draws of the race land only in it, at alpha's frequencies (within 5 sigma).
    z = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5, -3.0])
    logp = torch.log_softmax(z.masked_fill(~kept_tokens(z, Truncation(top_k=3)), -math.inf), -1)
    n = 30_000
    draws = sample_exponential_race(logp.exp().expand(n, -1).contiguous(), torch.Generator().manual_seed(2))
    freq = torch.bincount(draws, minlength=6).double() / n
    p = logp.exp().double()
    assert (freq[p == 0] == 0).all()
    assert ((freq - p).abs() <= 5 * (p * (1 - p) / n).sqrt() + 1e-9).all(), (freq, p)


# --- the passes over (rows, V) ---------------------------------------------------------------------------------------


class VocabPasses(TorchDispatchMode):
    """The aten ops that read or write a whole (rows, V) tensor (either orientation): views, allocations and the
    gathers and scatters of one element a row are not passes over it."""

    def __init__(self, rows: int, vocab: int):
        super().__init__()
        self.shape, self.ops = {rows, vocab}, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        whole = any(
            isinstance(t, torch.Tensor) and t.dim() == 2 and set(t.shape) == self.shape and t.numel() > 2 * max(t.shape)
            for t in pytree.tree_leaves((args, kwargs, out))
        )
        if whole and not func.is_view and not name.startswith(("empty", "gather", "scatter")):
            self.ops.append(name)
        return out


@pytest.mark.parametrize("dtype, passes", [(torch.float32, 8), (torch.bfloat16, 9)])
def test_the_static_paths_step_passes_over_the_vocabulary(dtype, passes):
    # The static path's step at the default temperature: the cast of bf16 logits, log_softmax, exp, the race's draw,
    # log, divide and argmin, and the entropy's multiply and sum. The step as first written took 12 (13 in bf16).
    logits = torch.randn(8, V).to(dtype)
    with VocabPasses(8, V) as seen:
        next_token(
            logits,
            torch.ones(8, dtype=torch.bool),
            torch.zeros(8, dtype=torch.long),
            temperature=1.0,
            truncation=None,
            eos_token_id=torch.tensor([1]),
            pad_token_id=0,
            generator=torch.Generator().manual_seed(0),
            ignore_eos=False,
            draw=sample_exponential_race,
            check_finite=False,
        )
    assert len(seen.ops) <= passes, seen.ops


@pytest.mark.parametrize("autocast, passes", [(False, 6), (True, 7)])
def test_the_heads_backward_passes_over_the_vocabulary(autocast, passes):
    # One chunk's backward at the default temperature: the head's matmul, (bf16 under autocast: the cast to float32),
    # subtract the log-sum-exp, exp, multiply into the compute dtype, and the two matmuls of the gradients. As first
    # written it took 8 (10 under autocast).
    m, h = 16, 32
    hidden = torch.randn(m, h, requires_grad=True)
    weight = torch.randn(V, h, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = SelectedLogProb.apply(hidden, weight, None, torch.randint(0, V, (m,)), 1.0, m, None)
    with VocabPasses(m, V) as seen:
        out.sum().backward()
    assert len(seen.ops) <= passes, seen.ops
