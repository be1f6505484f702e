"""The fast sampling path of `rollout.generate` on CUDA: an optimisation beside `rollout.sample`, the reference.

    sample_static        rollout.sample's loop on a static KV cache, written in place; on CUDA the decode step
                         is captured once as a CUDA graph and replayed, so a step costs no Python per layer
                         (gpt-fast's technique). It samples by the exponential race (`sample_exponential_race`).
    use_static_decoder   whether `generate` takes it: on CUDA, for models it fits, once a probe step worked
    sampling_path        the name of the path `generate` would take ("plain", "static-cache", "+cuda-graph")

tests/test_fastpath.py checks that the two paths agree (greedy tokens identical, sampled log-probs against a full
forward). Deviation from transformers' own static cache: the path passes its own boolean sdpa mask (True =
visible) as a dict, so it applies only to models with sdpa attention and full-attention layers; anything else
samples on the plain path.
"""

import inspect
import warnings
import weakref

import torch
from transformers import PreTrainedModel

from logprobs import Truncation, cache_kwarg, entropy_of, last_logits_only, position_ids_from_mask, sampling_logits


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
        self.kw = {cache_kwarg(model): self, **last_logits_only(model)}
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


def use_static_decoder(model, n: int, length: int, fast: bool | None = None, log=warnings.warn) -> bool:
    """Whether `rollout.generate` samples N rows of up to `length` tokens with `sample_static`.

    fast=False: no. fast=True: yes, whatever happens (errors are the caller's). fast=None (auto): where
    `sampling_path` allows it (CUDA), once the static cache has taken one probe step on this model; should the
    probe fail with one of _PATH_ERRORS, the reason is logged and the model samples plainly from then on.
    """
    if sampling_path(model, fast) == "plain":
        return False
    if fast is None and model not in _TRIED:
        try:
            _try_static_path(model, next(model.parameters()).device)
        except _PATH_ERRORS as e:
            log(f"rollout: the static-cache path failed, this model samples plainly from now on ({e!r})")
            _NO_FAST.add(model)
            _DECODERS.pop(model, None)
            return False
        _TRIED.add(model)
    return True


@torch.no_grad()
def sample_static(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    rows: torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float,
    truncation: Truncation | None,
    eos_token_id: int,
    pad_token_id: int,
    generator: torch.Generator | None,
    ignore_eos: bool,
) -> dict:
    """rollout.sample's loop on the static cache: the same arguments and result, the same tokens when greedy. It
    samples by the exponential race (no cumulative sum over V) and checks for EOS and non-finite logits every 16
    steps rather than every step (each check is a host sync)."""
    n, device = rows.numel(), rows.device
    dec = static_decoder(model, n, prompt_ids.shape[1] + max_new_tokens, device)
    logits = dec.prefill(model, prompt_ids, prompt_mask, rows)  # (N, V)
    if not torch.isfinite(logits).all():
        raise FloatingPointError("generate: the sampler's logits are not finite")
    tokens, logps, entropies = [], [], []
    alive = torch.ones(n, dtype=torch.bool, device=device)  # (N,) no EOS yet
    lengths = torch.zeros(n, dtype=torch.long, device=device)  # (N,) tokens kept so far
    for t in range(max_new_tokens):
        if t > 0:
            logits = dec.decode(model, tokens[-1])  # (N, V)
        logits = logits.float()  # (N, V)
        logp_all = torch.log_softmax(sampling_logits(logits, temperature, truncation), dim=-1)  # (N, V) log alpha
        if temperature > 0:
            nxt = sample_exponential_race(logp_all.exp(), generator)  # (N,) a token outside the kept set has p = 0
        else:
            nxt = logits.argmax(dim=-1)  # (N,)
        entropy = entropy_of(logp_all)  # (N,)
        nxt = torch.where(alive, nxt, torch.full_like(nxt, pad_token_id))  # (N,) pad after EOS
        tokens.append(nxt)
        logps.append(torch.where(alive, logp_all.gather(1, nxt.unsqueeze(1)).squeeze(1), torch.zeros_like(entropy)))
        entropies.append(torch.where(alive, entropy, torch.zeros_like(entropy)))
        lengths += alive.long()
        if not ignore_eos:
            alive = alive & (nxt != eos_token_id)
            if t % 16 == 15 and not alive.any():
                break
    # The race picks a token even from NaN logits: a diverged policy shows in the log-probs instead.
    if not (torch.isfinite(torch.stack(logps)).all() and torch.isfinite(torch.stack(entropies)).all()):
        raise FloatingPointError("generate: the sampler's logits are not finite")
    return dict(tokens=tokens, logps=logps, entropies=entropies, lengths=lengths, alive=alive)
