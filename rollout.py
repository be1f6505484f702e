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
  3. On CUDA, `generate` takes a fast path (gpt-fast's technique): a static KV cache written in
     place, and the decode step captured once in a CUDA graph and replayed, so a step costs no
     Python per layer; it samples by the exponential race (exact, and no cumulative sum over V).
     The plain loop stays the CPU path and the reference; tests/test_fastpath.py checks they agree.
  4. A group's G rows share their prompt: sampling and `token_logprobs` run it once per group.
"""

import inspect
import warnings
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel


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


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding: the first real token is at position 0."""
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)  # (N, L)


def _cache_kwarg(model) -> str:
    """transformers renamed `past_key_values` to `cache` in 5.2x; accept both."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _last_logits_only(model) -> dict:
    """Ask for the last position's logits only: the prefill would otherwise build (N, P, V) ones."""
    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}


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
    completion_mask = (torch.arange(t, device=device).unsqueeze(0) < lengths.unsqueeze(1)).long()  # (N, T)
    return Rollout(prompt_ids=ids, prompt_mask=mask, completion_ids=torch.stack(tokens, dim=1)[:, :t],
                   completion_mask=completion_mask, sampler_logp=torch.stack(logps, dim=1)[:, :t],
                   entropy=torch.stack(ents, dim=1)[:, :t], truncated=alive)


class _DynamicDecoder:
    """The plain path and the reference: transformers' DynamicCache, one column longer each step."""

    def prefill(self, model, ids: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Run the B prompts (B, P) once, then give each of the N rows its prompt's cache; logits (N, V)."""
        pos = position_ids_from_mask(mask)  # (B, P)
        self.cache = {_cache_kwarg(model): DynamicCache(), **_last_logits_only(model)}  # filled in place
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **self.cache)
        self.cache[_cache_kwarg(model)].batch_select_indices(rows)  # (B, ...) -> (N, ...)
        self.attn, self.pos = mask[rows], pos[rows, -1:]  # (N, P), (N, 1)
        return out.logits[rows, -1, :]  # (N, V)

    def decode(self, model, token: torch.Tensor) -> torch.Tensor:
        self.attn = torch.cat([self.attn, torch.ones_like(token[:, None])], dim=1)  # (N, P+t+1)
        self.pos = self.pos + 1  # (N, 1)
        out = model(input_ids=token[:, None], attention_mask=self.attn, position_ids=self.pos, use_cache=True, **self.cache)
        return out.logits[:, -1, :]  # (N, V)


# --- the fast path (CUDA): a static KV cache, the decode step replayed as a CUDA graph ------------


def sampling_path(model, fast: bool | None = None) -> str:
    """How `generate(model, ..., fast=fast)` samples: "plain", "static-cache" or "static-cache+cuda-graph"."""
    cfg = getattr(model, "config", None)  # our masks are sdpa's (True = visible), for full-attention layers
    ok = isinstance(model, PreTrainedModel) and cfg._attn_implementation == "sdpa" and \
        set(getattr(cfg, "layer_types", None) or ["?"]) == {"full_attention"}
    on_cuda = next(model.parameters()).device.type == "cuda"
    if fast is False or (fast is None and not (ok and on_cuda and model not in _NO_FAST)):
        return "plain"
    if not ok:
        raise ValueError("generate(fast=True) needs a transformers model with sdpa attention and full-attention layers")
    return "static-cache+cuda-graph" if on_cuda else "static-cache"


def sample_exponential_race(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Row-wise index i with probability p_i: argmax_i p_i / E_i, E_i ~ Exp(1) (Gumbel-max, as in gpt-fast).
    E = -log U with U ~ U[0, 1) is never 0 (U = 0 gives E = inf: that token loses), so none wins by a zero divisor."""
    exp = -torch.rand(probs.shape, generator=generator, device=probs.device, dtype=probs.dtype).log()  # (N, V) E_i
    return (probs / exp).argmax(dim=-1)  # (N,)


class _StaticDecoder:
    """A static KV cache, (N, H_kv, L, D) per layer, and the decode step's inputs, each a fixed tensor
    updated in place (a step writes cache column `write`): on CUDA the step is captured once as a graph."""

    def __init__(self, model, n: int, length: int, device):
        self.n, self.length, self.keys, self.values, self.rows = n, length, {}, {}, None  # rows: set while prefilling
        self.write = torch.zeros(1, dtype=torch.long, device=device)  # (1,) cache column of the next token
        self.ids, self.pos = torch.zeros(2, n, 1, dtype=torch.long, device=device)  # (N, 1) the token fed next, its position
        self.mask = torch.zeros(n, 1, 1, length, dtype=torch.bool, device=device)  # (N, 1, 1, L) visible columns
        self.graph, self.logits = None, None  # on CUDA: the captured decode step and its output
        self.kw = {_cache_kwarg(model): self, **_last_logits_only(model)}
        if "cache_position" in inspect.signature(model.forward).parameters:  # transformers < 5.2x would ask the
            self.kw["cache_position"] = self.write  # cache for it otherwise; only caches read it, and ours does not

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):  # (N, H_kv, t, D) in, L columns out
        if layer_idx not in self.keys:  # allocated by the prefill, before any graph capture
            shape = (self.n, key_states.shape[1], self.length, key_states.shape[3])
            self.keys[layer_idx], self.values[layer_idx] = key_states.new_zeros(shape), value_states.new_zeros(shape)
        k, v = self.keys[layer_idx], self.values[layer_idx]  # (N, H_kv, L, D)
        if self.rows is None:  # a decode step: one column
            k.index_copy_(2, self.write, key_states)
            v.index_copy_(2, self.write, value_states)
            return k, v
        # The prefill of the B prompts: each row's cache gets its prompt's; the prompts attend to themselves.
        k[:, :, : key_states.shape[2]], v[:, :, : key_states.shape[2]] = key_states[self.rows], value_states[self.rows]
        return key_states, value_states

    def _forward(self, model, ids=None, pos=None, mask=None) -> torch.Tensor:
        if ids is None:  # the decode step, on the static inputs
            ids, pos, mask = self.ids, self.pos, self.mask
        out = model(input_ids=ids, attention_mask={"full_attention": mask}, position_ids=pos, use_cache=True,
                    **self.kw)  # transformers uses a dict of masks as given
        return out.logits[:, -1, :]  # (N, V)

    def prefill(self, model, ids: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Run the B prompts (B, P) once into cache columns 0..P-1 of their rows (N,); returns logits (N, V)."""
        p = ids.shape[1]
        for buf in (*self.keys.values(), *self.values.values()):  # reused: nothing stale behind the mask
            buf.zero_()
        causal = torch.ones(p, p, dtype=torch.bool, device=ids.device).tril()  # (P, P)
        # Padding queries see themselves: a query that sees nothing would give NaN keys/values.
        visible = (causal & mask.bool()[:, None, :]) | torch.eye(p, dtype=torch.bool, device=ids.device)  # (B, P, P)
        self.mask.zero_()
        self.mask[:, 0, 0, :p] = visible[rows, -1]  # the last prompt row sees every real prompt column
        pos = position_ids_from_mask(mask)  # (B, P)
        self.pos.copy_(pos[rows, -1:])
        self.write.fill_(p - 1)  # each decode step first moves it one column on
        self.rows = rows  # while set, update() fills the prefill columns
        logits = self._forward(model, ids, pos, visible[:, None])  # (B, V)
        self.rows = None
        return logits[rows]  # (N, V)

    def decode(self, model, token: torch.Tensor) -> torch.Tensor:
        """Feed the tokens (N,) just sampled at the next column; returns the next logits (N, V)."""
        self.ids.copy_(token[:, None])
        self.pos.add_(1)
        self.write.add_(1)
        self.mask.index_fill_(3, self.write, True)  # the new column becomes visible
        if not self.write.is_cuda:  # on CPU: an eager forward
            return self._forward(model)
        if self.graph is None:
            self._capture(model)
        self.graph.replay()  # recomputes self.logits from the static inputs
        return self.logits

    def _capture(self, model) -> None:
        """Warm up on a side stream, then capture one decode step (torch.cuda.graph's recipe). No
        autocast weight-cast cache: it would freeze the weights' bf16 copies into the graph."""
        amp = dict(dtype=torch.get_autocast_dtype("cuda"), enabled=torch.is_autocast_enabled("cuda"), cache_enabled=False)
        with torch.autocast("cuda", **amp):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # recomputes this very step: its cache write is idempotent
                    self._forward(model)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.logits = self._forward(model)  # (N, V), in the graph's memory pool
        self.graph = graph


_DECODERS = weakref.WeakKeyDictionary()  # model -> (shape key, _StaticDecoder), freed with the model
_NO_FAST = weakref.WeakSet()  # models on which the static-cache path failed: they sample plainly


def _static_decoder(model, n: int, length: int, device) -> _StaticDecoder:
    """The model's static decoder for N rows and >= `length` columns, kept: its graph is captured once."""
    length = -(-length // 64) * 64  # rounded up: prompts of nearby lengths share one graph
    key = (n, length, str(device), model.training, torch.is_autocast_enabled(device.type),
           model.get_input_embeddings().weight.data_ptr())
    if _DECODERS.get(model, (None,))[0] != key:  # one per model: another shape (evaluation) captures anew
        _DECODERS[model] = (key, _StaticDecoder(model, n, length, device))
    return _DECODERS[model][1]


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
