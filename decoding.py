"""Decoders for `rollout.generate`: how the next-token logits of N rows are computed, step by step.

Two paths, one interface (`prefill` the B prompts once and fan them out to N = B*G rows, then `decode`
one token per row at a time; each returns the (N, V) next-token logits):
    DynamicDecoder   transformers' DynamicCache, one column longer each step. The CPU path and the reference.
    StaticDecoder    a static KV cache written in place; on CUDA the decode step is captured once as a CUDA
                     graph and replayed, so a step costs no Python per layer (gpt-fast's technique).
`choose_decoder` picks one for `generate` (`sampling_path(model)` says which it would pick, and the static
path is tried once per model before it is trusted); `sample_exponential_race` is the fast path's sampler.
tests/test_fastpath.py checks that the two paths agree.

Deviations from transformers' own generate:
  1. A group's G rows share their prompt: the prefill runs each of the B prompts once.
  2. The static path passes its own boolean sdpa mask (True = visible) as a dict, so it applies only to
     models with sdpa attention and full-attention layers; anything else samples on the plain path.
"""

import inspect
import warnings
import weakref

import torch
from transformers import DynamicCache, PreTrainedModel

from logprobs import cache_kwarg, position_ids_from_mask


def _last_logits_only(model) -> dict:
    """Ask for the last position's logits only: the prefill would otherwise build (N, P, V) ones."""
    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}


class DynamicDecoder:
    """The plain path and the reference: transformers' DynamicCache, one column longer each step."""

    def prefill(self, model, ids: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Run the B prompts (B, P) once, then give each of the N rows its prompt's cache; logits (N, V)."""
        pos = position_ids_from_mask(mask)  # (B, P)
        self.cache = {cache_kwarg(model): DynamicCache(), **_last_logits_only(model)}  # filled in place
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **self.cache)
        self.cache[cache_kwarg(model)].batch_select_indices(rows)  # (B, ...) -> (N, ...)
        self.attn, self.pos = mask[rows], pos[rows, -1:]  # (N, P), (N, 1)
        return out.logits[rows, -1, :]  # (N, V)

    def decode(self, model, token: torch.Tensor) -> torch.Tensor:
        self.attn = torch.cat([self.attn, torch.ones_like(token[:, None])], dim=1)  # (N, P+t+1)
        self.pos = self.pos + 1  # (N, 1)
        out = model(
            input_ids=token[:, None], attention_mask=self.attn, position_ids=self.pos, use_cache=True, **self.cache
        )
        return out.logits[:, -1, :]  # (N, V)


# --- the fast path (CUDA): a static KV cache, the decode step replayed as a CUDA graph ------------


def sampling_path(model, fast: bool | None = None) -> str:
    """How `generate(model, ..., fast=fast)` samples: "plain", "static-cache" or "static-cache+cuda-graph"."""
    # Our masks are sdpa's (True = visible), for full-attention layers.
    cfg = getattr(model, "config", None)
    ok = (
        isinstance(model, PreTrainedModel)
        and cfg._attn_implementation == "sdpa"
        and set(getattr(cfg, "layer_types", None) or ["?"]) == {"full_attention"}
    )
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


class StaticDecoder:
    """A static KV cache, (N, H_kv, L, D) per layer, and the decode step's inputs, each a fixed tensor
    updated in place (a step writes cache column `write`): on CUDA the step is captured once as a graph."""

    def __init__(self, model, n: int, length: int, device):
        self.n, self.length, self.keys, self.values, self.rows = n, length, {}, {}, None  # rows: set while prefilling
        self.write = torch.zeros(1, dtype=torch.long, device=device)  # (1,) cache column of the next token
        # (N, 1) each: the token fed next, its position.
        self.ids, self.pos = torch.zeros(2, n, 1, dtype=torch.long, device=device)
        self.mask = torch.zeros(n, 1, 1, length, dtype=torch.bool, device=device)  # (N, 1, 1, L) visible columns
        # On CUDA: the captured decode step and its output.
        self.graph, self.logits = None, None
        self.kw = {cache_kwarg(model): self, **_last_logits_only(model)}
        # transformers < 5.2x would ask the cache for cache_position otherwise; only caches read it, ours does not.
        if "cache_position" in inspect.signature(model.forward).parameters:
            self.kw["cache_position"] = self.write

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):  # (N, H_kv, t, D) in, L columns out
        # Allocated by the prefill, before any graph capture.
        if layer_idx not in self.keys:
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
        # transformers uses a dict of masks as given.
        mask = {"full_attention": mask}
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **self.kw)
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
        # The last prompt row sees every real prompt column.
        self.mask[:, 0, 0, :p] = visible[rows, -1]
        pos = position_ids_from_mask(mask)  # (B, P)
        self.pos.copy_(pos[rows, -1:])
        # Each decode step first moves it one column on.
        self.write.fill_(p - 1)
        # While set, update() fills the prefill columns.
        self.rows = rows
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
        # Recomputes self.logits from the static inputs.
        self.graph.replay()
        return self.logits

    def _capture(self, model) -> None:
        """Warm up on a side stream, then capture one decode step (torch.cuda.graph's recipe). No
        autocast weight-cast cache: it would freeze the weights' bf16 copies into the graph."""
        amp = dict(
            dtype=torch.get_autocast_dtype("cuda"), enabled=torch.is_autocast_enabled("cuda"), cache_enabled=False
        )
        with torch.autocast("cuda", **amp):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                # Recomputes this very step: its cache write is idempotent.
                for _ in range(2):
                    self._forward(model)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.logits = self._forward(model)  # (N, V), in the graph's memory pool
        self.graph = graph


# Model -> (shape key, StaticDecoder), freed with the model.
_DECODERS = weakref.WeakKeyDictionary()
# Models on which the static-cache path failed: they sample plainly.
_NO_FAST = weakref.WeakSet()
# Models on which the static-cache path worked once.
_TRIED = weakref.WeakSet()


def static_decoder(model, n: int, length: int, device) -> StaticDecoder:
    """The model's static decoder for N rows and >= `length` columns, kept: its graph is captured once."""
    # Rounded up: prompts of nearby lengths share one graph.
    length = -(-length // 64) * 64
    key = (
        n,
        length,
        str(device),
        model.training,
        torch.is_autocast_enabled(device.type),
        model.get_input_embeddings().weight.data_ptr(),
    )
    # One per model: another shape (evaluation) captures anew.
    if _DECODERS.get(model, (None,))[0] != key:
        _DECODERS[model] = (key, StaticDecoder(model, n, length, device))
    return _DECODERS[model][1]


# Errors of a static cache that this transformers version calls differently (an unexpected keyword, a
# missing attribute, a mask of the wrong form). Not RuntimeError (CUDA, memory) nor FloatingPointError
# (a diverged policy): those are the caller's to see.
_PATH_ERRORS = (TypeError, ValueError, AttributeError, IndexError, KeyError)


@torch.no_grad()
def _try_static_path(model, device) -> None:
    """One prefill and one eager decode step of a 1-row static cache: raises if the model won't take it."""
    dec = StaticDecoder(model, 1, 64, device)
    one = torch.ones(1, 1, dtype=torch.long, device=device)  # (1, 1) a one-token prompt
    dec.prefill(model, one, one, torch.zeros(1, dtype=torch.long, device=device))
    dec.ids.copy_(one)
    dec.write.add_(1)
    dec._forward(model)


def choose_decoder(model, n: int, length: int, device, fast: bool | None = None, log=warnings.warn):
    """The decoder `generate` runs for N rows of up to `length` tokens, and its path's name.

    fast=False: the plain DynamicDecoder. fast=True: the static cache, whatever happens (errors are the
    caller's). fast=None (auto): the static cache where `sampling_path` allows it (CUDA), once it has
    taken one probe step on this model; should the probe fail with one of _PATH_ERRORS, the reason is
    logged and the model samples plainly from then on.
    """
    path = sampling_path(model, fast)
    if path == "plain":
        return DynamicDecoder(), path
    if fast is None and model not in _TRIED:
        try:
            _try_static_path(model, device)
        except _PATH_ERRORS as e:
            log(f"rollout: the static-cache path failed, this model samples plainly from now on ({e!r})")
            _NO_FAST.add(model)
            _DECODERS.pop(model, None)
            return DynamicDecoder(), "plain"
        _TRIED.add(model)
    return static_decoder(model, n, length, device), path
