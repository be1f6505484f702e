"""The per-token sampling math (`rollout.next_token`, the exponential race) and the LM head's backward
(`engine.chunked_logprobs.SelectedLogProb`): the same values as the textbook written plainly here, in fewer passes
over the (rows, V) logits.

The textbook step: z = logits / tau in float32, -inf outside the kept set; log alpha = log_softmax(z); a pick from
alpha = softmax(z), by multinomial or by the exponential race argmax p / E, E = -log U; entropy -sum p log p over
the kept set. Under a fixed generator the picks use the same random numbers, so the tokens must be identical.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from engine.chunked_logprobs import SelectedLogProb, add_product, chunk_logp
from engine.decoding import sample_exponential_race
from logprobs import Truncation, kept_tokens, sampling_logits
from rollout import next_token, sample_multinomial

V = 500
TRUNCATIONS = [None, Truncation(top_k=7), Truncation(top_p=0.8), Truncation(min_p=0.05)]


def textbook_step(logits, alive, temperature, truncation, generator, pick):
    """(token, log alpha(token), entropy) for live rows, by the definitions, each on its own line."""
    z = logits.float() / temperature  # (N, V)
    if truncation is not None:
        z = z.masked_fill(~kept_tokens(z, truncation), -math.inf)
    logp_all = torch.log_softmax(z, dim=-1)
    p = torch.softmax(z, dim=-1)
    if pick == "multinomial":
        token = torch.multinomial(p, 1, generator=generator).squeeze(1)
    else:  # the exponential race: the token with the largest p / E, E ~ Exp(1)
        e = -torch.rand(p.shape, generator=generator).log()
        token = (p / e).argmax(dim=-1)
    p64, logp64 = p.double(), logp_all.double()
    entropy = -torch.where(p64 > 0, p64 * logp64, torch.zeros_like(p64)).sum(-1)
    token_logp = logp_all.gather(1, token[:, None]).squeeze(1)
    return torch.where(alive, token, 0), torch.where(alive, token_logp, 0.0), torch.where(alive, entropy, 0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("truncation", TRUNCATIONS)
@pytest.mark.parametrize("pick", ["multinomial", "race"])
@pytest.mark.parametrize("amp", [False, True])
def test_next_token_is_the_textbook_step(dtype, temperature, truncation, pick, amp):
    # bfloat16 logits are what the policy's forward gives under autocast; the sampling loops run the step inside the
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
            pick=sample_multinomial if pick == "multinomial" else sample_exponential_race,
        )
    token, logp, entropy = textbook_step(
        logits, alive, temperature, truncation, torch.Generator().manual_seed(11), pick
    )
    assert torch.equal(ours[0], token)
    # The log-probs come from the same log_softmax of the same floats: equal; the entropy sums in another order.
    assert torch.equal(ours[1], logp)
    assert (ours[2].double() - entropy).abs().max() < 1e-5


def test_the_race_picks_alpha_outside_the_kept_set_never():
    # A kept set of 3 tokens of 6: 30,000 picks of the race land only in it, at alpha's frequencies (within 5 sigma).
    z = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5, -3.0])
    alpha_logp = torch.log_softmax(z.masked_fill(~kept_tokens(z, Truncation(top_k=3)), -math.inf), -1)
    n = 30_000
    picks = sample_exponential_race(alpha_logp.exp().expand(n, -1).contiguous(), torch.Generator().manual_seed(2))
    freq = torch.bincount(picks, minlength=6).double() / n
    p = alpha_logp.exp().double()
    assert (freq[p == 0] == 0).all()
    assert ((freq - p).abs() <= 5 * (p * (1 - p) / n).sqrt() + 1e-9).all(), (freq, p)


# --- the LM head: values and gradients against the textbook -----------------------------------------------------------

HEAD_CASES = [(1.0, None), (0.7, None), (1.0, Truncation(top_k=7)), (0.7, Truncation(min_p=0.05))]


def head_problem(m=40, h=32, seed=0):
    """Hidden states (M, H), a head W (V, H) and bias (V,), scored tokens (M,) (half of them the argmax: a confident
    model, where softmax - onehot cancels), and the loss's weights (M,)."""
    g = torch.Generator().manual_seed(seed)
    hidden, weight, bias = (
        torch.randn(m, h, generator=g),
        torch.randn(V, h, generator=g) / 2,
        torch.randn(V, generator=g),
    )
    targets = torch.randint(0, V, (m,), generator=g)
    targets[::2] = F.linear(hidden, weight, bias).argmax(-1)[::2]
    return hidden, weight, bias, targets, torch.randn(m, generator=g)


def textbook_head(hidden, weight, bias, targets, temperature, truncation):
    """log softmax(z)[y], z = sampling_logits(h W^T + b): the whole (M, V) logits, autograd's own backward."""
    z = sampling_logits(F.linear(hidden, weight, bias), temperature, truncation, targets)
    return torch.log_softmax(z, dim=-1).gather(1, targets[:, None]).squeeze(1)


def chunked_head(hidden, weight, bias, targets, temperature, truncation, chunk=16):
    return SelectedLogProb.apply(hidden, weight, bias, targets, temperature, chunk, truncation)


def value_and_grads(head, problem, temperature, truncation, autocast=False, dtype=torch.float32, **kw):
    """(logp (M,), d/d hidden, d/d weight, d/d bias) of sum(coef x logp), the forward under bf16 autocast or not,
    the backward outside it (as train.update calls loss.backward())."""
    hidden, weight, bias, targets, coef = problem
    leaves = [t.detach().to(dtype, copy=True).requires_grad_() for t in (hidden, weight, bias)]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logp = head(*leaves, targets, temperature, truncation, **kw)
    (logp * coef.to(logp.dtype)).sum().backward()
    return [logp.detach().double()] + [t.grad.double() for t in leaves]


@pytest.mark.parametrize("temperature, truncation", HEAD_CASES)
def test_the_heads_values_and_gradients_are_the_textbooks_in_float32(temperature, truncation):
    problem = head_problem()
    exact = value_and_grads(textbook_head, problem, temperature, truncation, dtype=torch.float64)
    textbook = value_and_grads(textbook_head, problem, temperature, truncation)
    ours = value_and_grads(chunked_head, problem, temperature, truncation)
    for name, t, o, e in zip(("logp", "hidden", "weight", "bias"), textbook, ours, exact):
        err_t, err_o = ((t - e).norm() / e.norm()).item(), ((o - e).norm() / e.norm()).item()
        assert err_o <= 2 * err_t + 1e-7, f"{name}: ours {err_o:.2e} vs the float32 textbook's {err_t:.2e}"


@pytest.mark.parametrize("temperature, truncation", HEAD_CASES)
def test_the_heads_values_and_gradients_under_bf16_autocast_are_as_good_as_the_textbooks(temperature, truncation):
    # Each path's own error against the float32 textbook (float64 here), not a fixed bound: bf16 rounds both.
    problem = head_problem()
    exact = value_and_grads(textbook_head, problem, temperature, truncation, dtype=torch.float64)
    textbook = value_and_grads(textbook_head, problem, temperature, truncation, autocast=True)
    ours = value_and_grads(chunked_head, problem, temperature, truncation, autocast=True)
    for name, t, o, e in zip(("logp", "hidden", "weight", "bias"), textbook, ours, exact):
        err_t, err_o = ((t - e).norm() / e.norm()).item(), ((o - e).norm() / e.norm()).item()
        assert err_t > 1e-4, f"{name}: bf16 must round visibly here, or the comparison shows nothing"
        assert err_o <= 1.5 * err_t, f"{name}: ours {err_o:.2e} vs the bf16 textbook's {err_t:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [V, 151_936])
def test_the_log_sum_exp_read_from_the_logits_is_torchs_on_their_float32_copy(dtype, vocab):
    logits = (torch.randn(4, vocab, generator=torch.Generator().manual_seed(1)) * 6).to(dtype)
    targets = torch.tensor([0, 1, vocab - 1, 7])
    logp, lse = chunk_logp(logits, targets, 1.0, None)
    z = logits.float()
    assert torch.equal(lse, torch.logsumexp(z, dim=-1))
    assert torch.equal(logp, z.gather(1, targets[:, None]).squeeze(1) - torch.logsumexp(z, dim=-1))


def test_grad_w_sums_its_chunks_in_float32():
    # 16 chunks of bf16 operands whose products cancel: rounding each chunk's g^T h to bf16 before the float32 sum
    # (as the head did) loses visibly against the float64 sum of the same numbers; add_product does not.
    gen = torch.Generator().manual_seed(4)
    gs = [torch.randn(V, 64, generator=gen).bfloat16() for _ in range(16)]  # g^T of each chunk (V, c)
    hs = [torch.randn(64, 32, generator=gen).bfloat16() for _ in range(16)]  # h of each chunk (c, H)
    exact = sum(g.double() @ h.double() for g, h in zip(gs, hs))  # (V, H)
    per_chunk_bf16 = sum((g @ h).float() for g, h in zip(gs, hs))
    ours = torch.zeros(V, 32)
    for g, h in zip(gs, hs):
        add_product(ours, g, h)
    rel = lambda x: ((x.double() - exact).norm() / exact.norm()).item()  # noqa: E731
    assert rel(per_chunk_bf16) > 1e-3 and rel(ours) < 1e-6, (rel(per_chunk_bf16), rel(ours))


def test_grad_w_under_autocast_does_not_depend_on_the_chunking():
    # One chunk or ten: the same float32 sum of the same bf16 products, to float32's rounding (per-chunk bf16
    # rounding moved it by ~1e-3).
    problem = head_problem()
    one = value_and_grads(chunked_head, problem, 1.0, None, autocast=True, chunk=40)[2]
    ten = value_and_grads(chunked_head, problem, 1.0, None, autocast=True, chunk=4)[2]
    assert ((one - ten).norm() / one.norm()).item() < 1e-5


# --- the passes over (rows, V) ---------------------------------------------------------------------------------------

# torch runs logsumexp as four kernels over the tensor under one name (ReduceOps.cpp: amax, then sum(exp(x - max))):
# the count below counts them, and test_logsumexp_runs_four_kernels checks that torch still does.
KERNELS = {"logsumexp": ("amax", "sub", "exp_", "sum")}


class VocabPasses(TorchDispatchMode):
    """The kernels that read or write a whole (rows, V) tensor (either orientation, size-1 dims aside: a batched dot
    product's (rows, 1, V) too): views, allocations and the gathers and scatters of one element a row are not passes
    over it; an op torch runs as several kernels counts as those (KERNELS)."""

    def __init__(self, rows: int, vocab: int):
        super().__init__()
        self.shape, self.ops = sorted((rows, vocab)), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        whole = any(
            isinstance(t, torch.Tensor) and sorted(d for d in t.shape if d != 1) == self.shape
            for t in pytree.tree_leaves((args, kwargs, out))
        )
        if whole and not func.is_view and not name.startswith(("empty", "gather", "scatter")):
            self.ops.extend(f"{name}:{k}" for k in KERNELS[name]) if name in KERNELS else self.ops.append(name)
        return out


def test_logsumexp_runs_four_kernels():
    x = torch.randn(8, V)
    with torch.profiler.profile() as prof:
        torch.logsumexp(x, dim=-1)
    names = [e.name.removeprefix("aten::") for e in prof.events()]
    assert [n for n in names if n in {"amax", "sub", "exp", "exp_", "sum"}] == list(KERNELS["logsumexp"]), names


def sampling_step(logits, temperature=1.0, truncation=None):
    return next_token(
        logits,
        torch.ones(logits.shape[0], dtype=torch.bool),
        torch.zeros(logits.shape[0], dtype=torch.long),
        temperature=temperature,
        truncation=truncation,
        eos_token_id=torch.tensor([1]),
        pad_token_id=0,
        generator=torch.Generator().manual_seed(0),
        ignore_eos=False,
        pick=sample_exponential_race,
        check_finite=False,
    )


@pytest.mark.parametrize("dtype, passes", [(torch.float32, 7), (torch.bfloat16, 8)])
def test_the_static_paths_step_passes_over_the_vocabulary(dtype, passes):
    # The static path's step at the default temperature: (bf16 logits: the cast to float32), log_softmax, exp, the
    # race's uniforms, log, divide and argmin, and the entropy's dot product. As first written it took 12 (13 in bf16),
    # then 8 (9): the entropy took a multiply and a sum.
    logits = torch.randn(8, V).to(dtype)
    with VocabPasses(8, V) as seen:
        sampling_step(logits)
    assert len(seen.ops) == passes, seen.ops


def head_passes(autocast: bool, backward: bool) -> list[str]:
    """The kernels over (c, V) of one chunk's forward, or backward, at the default temperature."""
    m, h = 16, 32
    hidden = torch.randn(m, h, requires_grad=True)
    weight = torch.randn(V, h, requires_grad=True)
    with VocabPasses(m, V) as forward, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = SelectedLogProb.apply(hidden, weight, None, torch.randint(0, V, (m,)), 1.0, m, None)
    if not backward:
        return forward.ops
    with VocabPasses(m, V) as seen:
        out.sum().backward()
    return seen.ops


@pytest.mark.parametrize("autocast, passes", [(False, 5), (True, 5)])
def test_the_heads_forward_passes_over_the_vocabulary(autocast, passes):
    # The head's matmul, then the log-sum-exp read straight from the logits: max, subtract (upcasting bf16 inside
    # the kernel), exp, sum. It took 5 (6 under autocast: the float32 copy of the logits, then logsumexp's 4).
    assert len(ops := head_passes(autocast, backward=False)) == passes, ops


@pytest.mark.parametrize("autocast, passes", [(False, 6), (True, 7)])
def test_the_heads_backward_passes_over_the_vocabulary(autocast, passes):
    # One chunk's backward at the default temperature: the head's matmul, subtract the log-sum-exp (reading bf16
    # logits under autocast, no float32 copy), exp, multiply into the compute dtype, the two matmuls of the
    # gradients; under autocast on this CPU one more: torch has no bf16 x bf16 -> float32 matmul here, so grad_w's
    # operand g is upcast first (on CUDA, torch.mm's out_dtype: 6). As first written it took 8 (10 under autocast),
    # then 6 (7: the float32 copy of the logits, and grad_w rounded to bf16 each chunk).
    assert len(ops := head_passes(autocast, backward=True)) == passes, ops


def test_grad_ws_product_on_cuda_is_one_kernel():
    # The CUDA branch of add_product, on the meta device (torch's own shape rules for mm's out_dtype): one matmul over
    # the (V, c) operand, no upcast of it.
    a = torch.empty(V, 16, dtype=torch.bfloat16, device="meta")
    with VocabPasses(16, V) as seen:
        out = torch.mm(a, torch.empty(16, 32, dtype=torch.bfloat16, device="meta"), out_dtype=torch.float32)
    assert seen.ops == ["mm"] and out.dtype == torch.float32
