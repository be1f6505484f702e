"""Rollouts: sample G completions per prompt from the behaviour policy, and score tokens.

`generate` samples from the behaviour (stale) policy alpha with a KV cache, token by token,
from softmax(logits / temperature), with an explicit torch.Generator so that runs are
reproducible. `token_logprobs` computes log pi(y_t | prompt, y_<t) for given completions under
any model, from logits / temperature, i.e. under the distribution that was actually sampled.

Layout of a batch (the convention every other file uses):
    prompt_ids   (N, P)  left-padded, so every prompt ends at column P-1
    completion   (N, T)  right-padded; a completion ends at its first EOS, which is kept
    input_ids    (N, P+T) = cat(prompt_ids, completion_ids)
    attention_mask (N, P+T) = cat(prompt_mask, completion_mask)
    completion_mask (N, T)  1 on completion tokens up to and including EOS
Position ids are computed from the attention mask (cumsum - 1), so a left-padded prompt sees
the same positions as the unpadded one.

Deviations from common practice:
  1. Log-probs never build the (N, T, V) float32 logits: `_SelectedLogProb` runs the LM head in
     row chunks, keeps only each row's log-sum-exp, and recomputes the chunk in backward.
  2. The sampler is our own loop rather than `model.generate`, so that it takes a generator,
     returns the sampled tokens' log-probs and entropies, and treats EOS uniformly.
  3. On CUDA, `generate` takes a fast path (gpt-fast's technique, in decoding.py): a static KV cache
     written in place, and the decode step captured once in a CUDA graph and replayed, so a step costs
     no Python per layer; it samples by the exponential race (exact, and no cumulative sum over V).
     The plain loop stays the CPU path and the reference; tests/test_fastpath.py checks they agree.
  4. A group's G rows share their prompt: sampling and `token_logprobs` run it once per group.
"""

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from decoding import (
    _DECODERS,
    _NO_FAST,
    _cache_kwarg,
    _DynamicDecoder,
    _static_decoder,
    position_ids_from_mask,
    sample_exponential_race,
    sampling_path,
)


@dataclass
class Rollout:
    """What `generate` returns; every tensor is on the model's device."""

    prompt_ids: torch.Tensor  # (N, P) left-padded prompts, each repeated G times
    prompt_mask: torch.Tensor  # (N, P)
    completion_ids: torch.Tensor  # (N, T) sampled tokens, pad after EOS
    completion_mask: torch.Tensor  # (N, T) 1 up to and including EOS
    sampler_logp: torch.Tensor  # (N, T) log alpha(y_t) as seen while sampling (0 where masked)
    entropy: torch.Tensor  # (N, T) entropy of alpha(. | prefix) at each sampled position
    truncated: torch.Tensor  # (N,) True if the completion hit max_new_tokens without EOS

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)  # (N, P+T)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask, self.completion_mask], dim=1)  # (N, P+T)


@torch.no_grad()
def generate(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    *,
    group_size: int,
    max_new_tokens: int,
    temperature: float,
    eos_token_id: int,
    pad_token_id: int,
    generator: torch.Generator | None = None,
    ignore_eos: bool = False,
    fast: bool | None = None,
) -> Rollout:
    """Sample `group_size` completions for each of B left-padded prompts.

    Args:
        model: a transformers causal LM (the behaviour policy alpha).
        prompt_ids, prompt_mask: (B, P) left-padded prompts.
        temperature: > 0 samples from softmax(logits / temperature); 0 decodes greedily.
        generator: the torch.Generator used for sampling (on the model's device).
        ignore_eos: keep sampling past EOS (benchmarks, so every row has the same length).
        fast: the static-cache path (module docstring, 3); None picks it on CUDA where it applies.

    Returns:
        A Rollout with N = B * group_size rows, ordered group-major.
    """
    device = prompt_ids.device
    rows = torch.arange(prompt_ids.shape[0], device=device).repeat_interleave(group_size)  # (N,) each row's prompt
    ids, mask = prompt_ids[rows], prompt_mask[rows].long()  # (N, P) each
    n, plain = ids.shape[0], sampling_path(model, fast) == "plain"
    if not plain and fast is None:  # auto: should the static cache not fit this model (say, another
        try:  # transformers version calls the cache differently), sample plainly from then on
            return generate(model, prompt_ids, prompt_mask, group_size=group_size, max_new_tokens=max_new_tokens,
                            temperature=temperature, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                            generator=generator, ignore_eos=ignore_eos, fast=True)
        except (RuntimeError, TypeError, ValueError, AttributeError, IndexError, KeyError) as e:  # not FloatingPointError
            warnings.warn(f"rollout: the static-cache path failed, this model samples plainly from now on ({e!r})")
            _NO_FAST.add(model)
            _DECODERS.pop(model, None)
            plain = True
    dec = _DynamicDecoder() if plain else _static_decoder(model, n, ids.shape[1] + max_new_tokens, device)
    last = dec.prefill(model, prompt_ids, prompt_mask.long(), rows)  # (N, V) next-token logits, prompts run once
    if not torch.isfinite(last).all():  # a diverged policy; train.py counts it as a non-finite step
        raise FloatingPointError("generate: the sampler's logits are not finite")
    tokens, logps, ents = [], [], []
    alive = torch.ones(n, dtype=torch.bool, device=device)  # (N,) no EOS yet
    lengths = torch.zeros(n, dtype=torch.long, device=device)  # (N,) tokens kept so far
    for t in range(max_new_tokens):
        if t > 0:
            last = dec.decode(model, tokens[-1])  # (N, V)
        logits = last.float()  # (N, V) only the last position is needed
        if plain and t > 0 and not torch.isfinite(logits).all():  # multinomial would fail on NaN with a
            raise FloatingPointError("generate: the sampler's logits are not finite")  # bare RuntimeError
        if temperature > 0:
            logp_all = torch.log_softmax(logits / temperature, dim=-1)  # (N, V)
            probs = logp_all.exp()  # (N, V)
            nxt = torch.multinomial(probs, 1, generator=generator).squeeze(1) if plain else \
                sample_exponential_race(probs, generator)  # (N,)
        else:
            logp_all = torch.log_softmax(logits, dim=-1)  # (N, V)
            nxt = logits.argmax(dim=-1)  # (N,)
        ent = -(logp_all.exp() * logp_all).sum(dim=-1)  # (N,)
        nxt = torch.where(alive, nxt, torch.full_like(nxt, pad_token_id))  # (N,) pad after EOS
        tokens.append(nxt)
        logps.append(torch.where(alive, logp_all.gather(1, nxt.unsqueeze(1)).squeeze(1), torch.zeros_like(ent)))
        ents.append(torch.where(alive, ent, torch.zeros_like(ent)))
        lengths += alive.long()
        if not ignore_eos:
            alive = alive & (nxt != eos_token_id)  # EOS itself was kept above
            if (plain or t % 16 == 15) and not alive.any():  # the fast path syncs with the host less often
                break

    t = int(lengths.max())  # the step at which the last row ended (the fast path may have gone on)
    logps, ents = torch.stack(logps, dim=1)[:, :t], torch.stack(ents, dim=1)[:, :t]  # (N, T) each
    if not plain and not (torch.isfinite(logps).all() and torch.isfinite(ents).all()):  # the race picks a token
        raise FloatingPointError("generate: the sampler's logits are not finite")  # even from NaN logits
    completion_mask = (torch.arange(t, device=device).unsqueeze(0) < lengths.unsqueeze(1)).long()  # (N, T)
    return Rollout(prompt_ids=ids, prompt_mask=mask, completion_ids=torch.stack(tokens, dim=1)[:, :t],
                   completion_mask=completion_mask, sampler_logp=logps,
                   entropy=ents, truncated=alive)


class _SelectedLogProb(torch.autograd.Function):
    """log softmax(h W^T + b)[y] / tau for M rows, in row chunks, without keeping (M, V) logits.

    Forward keeps only the per-row log-sum-exp; backward recomputes each chunk's softmax:
        d logp / d z = (onehot(y) - softmax(z)) / tau,   z = (h W^T + b) / tau.
    Peak extra memory is one (chunk, V) float32 block instead of (M, V).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk):
        acc = torch.promote_types(weight.dtype, torch.float32)  # float32, or float64 in tests
        out = torch.empty(hidden.shape[0], dtype=acc, device=hidden.device)  # (M,)
        lse = torch.empty_like(out)  # (M,)
        for s in range(0, hidden.shape[0], chunk):
            z = F.linear(hidden[s : s + chunk], weight, bias).to(acc) / temperature  # (c, V)
            lse[s : s + chunk] = torch.logsumexp(z, dim=-1)
            out[s : s + chunk] = z.gather(1, targets[s : s + chunk, None]).squeeze(1) - lse[s : s + chunk]
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        tau, chunk = ctx.temperature, ctx.chunk
        grad_h = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        acc = lse.dtype
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if ctx.needs_input_grad[1] else None
        grad_b = None
        if bias is not None and ctx.needs_input_grad[2]:
            grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device)
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s : s + chunk]  # (c, H)
            z = F.linear(h, weight, bias).to(acc) / tau  # (c, V)
            g = -torch.exp(z - lse[s : s + chunk, None])  # (c, V) -softmax
            g.scatter_add_(1, targets[s : s + chunk, None], torch.ones_like(g[:, :1]))  # onehot - softmax
            g = g * (grad_out[s : s + chunk, None] / tau)  # (c, V) d loss / d logits
            if grad_h is not None:
                grad_h[s : s + chunk] = (g.to(weight.dtype) @ weight).to(hidden.dtype)  # (c, H)
            if grad_w is not None:
                grad_w += g.t() @ h.to(acc)  # (V, H)
            if grad_b is not None:
                grad_b += g.sum(dim=0)  # (V,)
        grad_w = grad_w.to(weight.dtype) if grad_w is not None else None
        grad_b = grad_b.to(bias.dtype) if grad_b is not None else None
        return grad_h, grad_w, grad_b, None, None, None


def _has_plain_head(model) -> bool:
    """True when logits are exactly lm_head(last_hidden_state): no soft-capping or scaling."""
    head, cfg = model.get_output_embeddings(), model.config
    odd = getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", None)
    return isinstance(head, torch.nn.Linear) and not odd and hasattr(model, "get_decoder")


def _completion_states(decoder, input_ids, attention_mask, pos, t: int) -> torch.Tensor:
    """The hidden states (N, T, H) that predict the T completion tokens. Adjacent rows with one prompt (a group)
    run it once, its KV cache indexed per row (differentiably): one plain pass's values and gradients, for less."""
    p = input_ids.shape[1] - t
    same = ((input_ids[1:, :p] == input_ids[:-1, :p]) & (attention_mask[1:, :p] == attention_mask[:-1, :p])).all(1)
    first = torch.cat([same.new_ones(1), ~same])  # (N,) the row starts a new prompt
    if p == 0 or bool(first.all()):  # nothing shared: one pass; the state at position i predicts token i+1
        hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos).last_hidden_state
        return hidden[:, p - 1 : p - 1 + t]  # (N, T, H): completion token j sits at P+j
    cache = {_cache_kwarg(decoder): DynamicCache()}
    last = decoder(input_ids=input_ids[first, :p], attention_mask=attention_mask[first, :p], position_ids=pos[first, :p],
                   use_cache=True, **cache).last_hidden_state[:, -1:]  # (U, 1, H) U distinct prompts
    rows = first.long().cumsum(0) - 1  # (N,) each row's prompt
    cache[_cache_kwarg(decoder)].batch_select_indices(rows)  # (U, ...) -> (N, ...)
    rest = decoder(input_ids=input_ids[:, p:], attention_mask=attention_mask, position_ids=pos[:, p:], use_cache=True,
                   **cache).last_hidden_state  # (N, T, H)
    return torch.cat([last[rows], rest[:, :-1]], dim=1)  # (N, T, H)


def token_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float,
    chunk: int = 1024,
) -> torch.Tensor:
    """Per-token log-probs of the completions under `model`, from logits / temperature.

    Args:
        input_ids, attention_mask: (N, P+T), prompts left-padded then completions right-padded.
        completion_mask: (N, T), 1 on the completion tokens to score; T is inferred from it.
        temperature: the sampling temperature (1.0 for the plain distribution).
        chunk: rows of the LM head evaluated at once.

    Returns:
        (N, T) float32 log-probs, 0 where completion_mask is 0. Differentiable when grad is on.
    """
    (n, length), t = input_ids.shape, completion_mask.shape[1]
    tau = temperature if temperature > 0 else 1.0
    pos = position_ids_from_mask(attention_mask)  # (N, P+T)
    sel = completion_mask.bool()  # (N, T)
    targets = input_ids[:, length - t :][sel]  # (M,) the scored tokens
    if _has_plain_head(model):
        h = _completion_states(model.get_decoder(), input_ids, attention_mask, pos, t)[sel]  # (M, H) scored rows only
        head = model.get_output_embeddings()
        logp = _SelectedLogProb.apply(h, head.weight, head.bias, targets, tau, chunk)  # (M,)
    else:
        # Generic path (soft-capped or scaled heads): the model's own logits, only T+1 of them.
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos, logits_to_keep=t + 1).logits
        z = logits[:, :-1][sel].float() / tau  # (M, V)
        logp = z.gather(1, targets[:, None]).squeeze(1) - torch.logsumexp(z, dim=-1)  # (M,)
    out = torch.zeros(n, t, dtype=torch.float32, device=input_ids.device)  # (N, T)
    return out.masked_scatter(sel, logp)  # (N, T), differentiable w.r.t. logp
