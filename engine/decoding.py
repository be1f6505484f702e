"""The fast sampling path of `rollout.generate` on CUDA: an optimisation beside `rollout.sample`, the reference.

    static_loop          what the loop passes as `generate(loop=...)` (train.sampling_loop): `sample_static` where it
                         applies, else rollout.sample; a failed graph capture samples again on rollout.sample
    sample_static        rollout.sample's loop on a static KV cache, around the same step (rollout.next_token);
                         on CUDA the decode step's forward is captured once as a CUDA graph and replayed, so it
                         costs no Python per layer (gpt-fast's technique). It picks by the exponential race
                         (`sample_exponential_race`) rather than multinomial.
    use_static_decoder   whether `static_loop` takes it: on CUDA, for models it fits, once a probe step worked
    sampling_path        the name of the path `static_loop(fast)` would take ("plain", "static-cache", "+cuda-graph")
    folded_gqa           a decode step's grouped query heads read the K/V cache unrepeated, under every transformers
                         version (5.17 repeats it under a mask): both loops of static_loop run inside it

tests/test_fastpath.py and tests/test_gpu_path.py check that the two paths agree (greedy tokens identical, sampled
log-probs against a full forward), on Qwen2, Llama and a PEFT-wrapped model, and under bf16 autocast. Deviation from
transformers' own static cache: the path passes its own 4-D boolean sdpa mask (True = visible), which transformers
uses as given, so it applies only to models with sdpa attention and full-attention layers; anything else samples
on the plain path.

Under autocast the decoders keep one copy of the Linear layers' weights in the autocast dtype, shared by every
shape's decoder of the model and recast once per `generate` call: a captured graph cannot use autocast's
weight-cast cache (it would freeze the casts of the weights as they were at capture), so without them every
replayed token would cast every weight again.
"""

import contextlib
import sys
import weakref

import torch
from torch.func import functional_call

from logprobs import cache_kwarg, forward_parameters, last_logits_only, position_ids_from_mask
from rollout import next_token, sample


def warn(msg: str) -> None:
    """One line on stderr: the sampling loop changed path, the run goes on."""
    print(f"warning: {msg}", file=sys.stderr, flush=True)


def transformers_model(model):
    """The transformers model under a PEFT wrapper (LoRA), or the model itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def static_cache_fits(model) -> bool:
    """A transformers model with sdpa attention whose layers all attend to the full prefix: our mask is sdpa's
    (True = visible) for full attention. Llama-family configs name no layer types; a sliding window they do name."""
    from transformers import PreTrainedModel  # here: importing transformers costs seconds (train.py --help)

    base = transformers_model(model)
    if not isinstance(base, PreTrainedModel) or base.config._attn_implementation != "sdpa":
        return False
    layer_types = getattr(base.config, "layer_types", None)
    if layer_types is not None:
        return set(layer_types) == {"full_attention"}
    return getattr(base.config, "sliding_window", None) is None


def sampling_path(model, fast: bool | None = None) -> str:
    """How `static_loop(fast)` samples on `model`: "plain", "static-cache" or "static-cache+cuda-graph"."""
    on_cuda = next(model.parameters()).device.type == "cuda"
    ok = static_cache_fits(model)
    if fast is False or (fast is None and not (ok and on_cuda and model not in _NO_FAST)):
        return "plain"
    if not ok:
        raise ValueError("static_loop(True) needs a transformers model with sdpa attention and full-attention layers")
    return "static-cache+cuda-graph" if on_cuda and model not in _NO_GRAPH else "static-cache"


# ---- grouped-query attention of one query token against the unrepeated cache -----------------------------------
#
# With a mask passed, transformers' sdpa_attention_forward before 5.2x (5.17, the GPU image's) repeats each of the
# H_kv key/value heads to its H / H_kv query heads (repeat_kv) over the whole cache, every layer, every decode step:
# at Qwen2.5-0.5B's 14 / 2 heads, 7 copies of K and of V a layer, written and read again, more traffic than the
# attention itself. Newer versions fold the query heads instead (their pack_gqa). Inside `folded_gqa()` every
# version does: a decode step's query (N, H, 1, D) is read as (N, H_kv, H / H_kv, D), the query heads of one KV
# head as that many query rows of one head, against the cache as it is, the mask (N, 1, 1, L) broadcast over them;
# the same sums as the repeated form (tests/test_decode_gqa.py: tokens and log-probs equal, and the bytes a decode
# step copies, counted by torch's dispatcher, under one layer's K cache a layer).
_FOLDING = [0]  # > 0 inside folded_gqa(): the wrapper folds; outside it calls transformers' own sdpa


def fold_gqa_heads(query, key, value, attention_mask, scaling):
    """softmax(q k^T scale + mask) v for one query token, q (N, H, 1, D), k and v (N, H_kv, L, D), without
    repeating k and v: the H / H_kv query heads of each KV head as its query rows. Returns (N, 1, H, D_v), the
    layout transformers' attention functions return."""
    n, h, _, d = query.shape
    q = query.reshape(n, key.shape[1], h // key.shape[1], d)  # (N, H_kv, H / H_kv, D)
    out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(n, h, 1, value.shape[-1]).transpose(1, 2)  # (N, H_kv, H/H_kv, D_v) -> (N, 1, H, D_v)


def foldable(module, query, key, attention_mask, dropout, kwargs) -> bool:
    """Whether `fold_gqa_heads` computes this call: one query token of grouped heads, a mask shared by the heads and
    the query (or none), nothing that transformers' sdpa would add (dropout, a position bias, soft-capping, sinks)."""
    groups = getattr(module, "num_key_value_groups", 1)
    mask_ok = attention_mask is None or (attention_mask.dim() == 4 and attention_mask.shape[1:3] == (1, 1))
    extras = any(kwargs.get(k) is not None for k in ("position_bias", "softcap", "s_aux", "sinks"))
    return (
        _FOLDING[0] > 0
        and groups > 1
        and query.shape[2] == 1
        and key.shape[1] * groups == query.shape[1]
        and not dropout
        and mask_ok
        and not extras
        and not torch.compiler.is_compiling()
    )


def _folding_sdpa(original):
    def sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
        if foldable(module, query, key, attention_mask, dropout, kwargs):
            return fold_gqa_heads(query, key, value, attention_mask, scaling), None
        return original(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )

    sdpa.folds_gqa = True
    return sdpa


@contextlib.contextmanager
def folded_gqa():
    """Within it, transformers' "sdpa" attention of one query token reads the unrepeated K/V cache
    (`fold_gqa_heads`) under every transformers version; other calls (prompts, training forwards) are its own.
    The wrapper is put in transformers' attention table once and passes every call through outside this block."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if not getattr(ALL_ATTENTION_FUNCTIONS["sdpa"], "folds_gqa", False):
        ALL_ATTENTION_FUNCTIONS["sdpa"] = _folding_sdpa(ALL_ATTENTION_FUNCTIONS["sdpa"])
    _FOLDING[0] += 1
    try:
        yield
    finally:
        _FOLDING[0] -= 1


def sample_exponential_race(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Row-wise index i with probability p_i: argmax_i p_i / E_i, E_i ~ Exp(1) (Gumbel-max, as in gpt-fast).
    E = -log U with U ~ U[0, 1) is never 0 (U = 0 gives E = inf: that token loses), so none wins by a zero divisor.

    Computed as argmin_i p_i / log U_i, the argmin of -(p_i / E_i) exactly (a float's negation is exact): the uniforms,
    log, divide and argmin, in U's own buffer, without the pass that negates log U."""
    u = torch.rand(probs.shape, generator=generator, device=probs.device, dtype=probs.dtype)  # (N, V) U_i
    return torch.div(probs, u.log_(), out=u).argmin(dim=-1)  # (N,)


class StaticDecoder:
    """A static KV cache, (N, H_kv, L, D) per layer, and the decode step's inputs, each a fixed tensor
    updated in place (a step writes cache column `write`): on CUDA the step is captured once as a graph.

    Under autocast the keys and values are stored in the autocast dtype (the keys leave the rotary embedding in
    float32, the values in bfloat16: the attention casts both anyway), and the forward runs on `weights`, the
    Linear layers' weights cast once per `generate` call (`cast_weights`) rather than on every replay."""

    def __init__(self, model, n: int, length: int, device, graphs: bool):
        self.n, self.length, self.keys, self.values, self.rows = n, length, {}, {}, None  # rows: set while prefilling
        self.write = torch.zeros(1, dtype=torch.long, device=device)  # (1,) cache column of the next token
        # (N, 1) each: the token fed next, its position.
        self.ids, self.pos = torch.zeros(2, n, 1, dtype=torch.long, device=device)
        self.mask = torch.zeros(n, 1, 1, length, dtype=torch.bool, device=device)  # (N, 1, 1, L) visible columns
        # With graphs (CUDA): the captured decode step and its output.
        self.graphs, self.graph, self.logits = graphs, None, None
        self.kw = {cache_kwarg(model): self, **last_logits_only(model)}
        # transformers < 5.2x would ask the cache for cache_position otherwise; only caches read it, ours does not.
        if "cache_position" in forward_parameters(model):
            self.kw["cache_position"] = self.write
        amp = device.type
        self.dtype = torch.get_autocast_dtype(amp) if torch.is_autocast_enabled(amp) else None  # the cache's dtype
        self.weights = shared_weights(model, self.dtype) if self.dtype is not None else {}

    def cast_weights(self, model) -> None:
        """The Linear weights as they are now (an optimizer step changed them in place), in the autocast dtype."""
        params = dict(model.named_parameters(remove_duplicate=False))
        for name, w in self.weights.items():
            w.copy_(params[name])

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):  # (N, H_kv, t, D) in, L columns out
        # Allocated by the prefill, before any graph capture.
        if layer_idx not in self.keys:
            shape = (self.n, key_states.shape[1], self.length, key_states.shape[3])
            dtype = self.dtype or value_states.dtype
            self.keys[layer_idx] = key_states.new_zeros(shape, dtype=dtype)
            self.values[layer_idx] = value_states.new_zeros(shape, dtype=dtype)
        k, v = self.keys[layer_idx], self.values[layer_idx]  # (N, H_kv, L, D)
        if self.rows is None:  # a decode step: one column
            k.index_copy_(2, self.write, key_states.to(k.dtype))
            v.index_copy_(2, self.write, value_states.to(v.dtype))
            return k, v
        # The prefill of the B prompts: each row's cache gets its prompt's; the prompts attend to themselves.
        k[:, :, : key_states.shape[2]], v[:, :, : key_states.shape[2]] = key_states[self.rows], value_states[self.rows]
        return key_states, value_states

    def _forward(self, model, ids=None, pos=None, mask=None) -> torch.Tensor:
        if ids is None:  # the decode step, on the static inputs
            ids, pos, mask = self.ids, self.pos, self.mask
        # A 4-D mask is used as given by every transformers model (no dict of masks per layer type needed).
        kwargs = dict(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **self.kw)
        # tie_weights=False: a head tied to the embedding takes the cast copy, the embedding keeps its own.
        with folded_gqa():  # a decode step's grouped heads read the cache unrepeated
            out = functional_call(model, self.weights, args=(), kwargs=kwargs, tie_weights=False, strict=False)
        return out.logits[:, -1, :]  # (N, V)

    def prefill(self, model, ids: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Run the B prompts (B, P) once into cache columns 0..P-1 of their rows (N,); returns logits (N, V)."""
        p = ids.shape[1]
        self.cast_weights(model)
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
        if not self.graphs:  # an eager forward (always on CPU)
            return self._forward(model)
        if self.graph is None:
            try:
                self._capture(model)
            except Exception as e:  # out of memory while capturing, an op that cannot be captured, ...
                raise GraphCaptureError(first_line(e)) from e
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


def graphs_on(device) -> bool:
    """Whether the decode step is captured as a graph on this device (a test makes the CPU pretend)."""
    return device.type == "cuda"


class GraphCaptureError(RuntimeError):
    """Capturing the decode step as a CUDA graph failed: `rollout.generate` samples that call on the plain loop."""


def first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"


def linear_weights(model, dtype) -> dict[str, torch.Tensor]:
    """Copies in `dtype` of the floating-point weights and biases of the model's Linear layers (LoRA's included),
    by their names in model.named_parameters: what autocast would cast for each matmul. Other weights (the
    embedding, the norms) run as they are under autocast too."""
    out = {}
    for prefix, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            for name, p in module.named_parameters(prefix=prefix, recurse=False):
                if p.is_floating_point() and p.dtype != dtype:
                    out[name] = p.detach().to(dtype)
    return out


# Model -> {autocast dtype: its Linear weights cast to it}, one set shared by all the model's decoders: at 7B one
# bfloat16 copy is ~15 GB, and each shape's decoder would otherwise hold its own.
_WEIGHTS = weakref.WeakKeyDictionary()


def shared_weights(model, dtype) -> dict[str, torch.Tensor]:
    """`linear_weights(model, dtype)`, made once per model and dtype and shared by its static decoders (each
    recasts them at its prefill: an optimizer step changed the originals in place)."""
    per_dtype = _WEIGHTS.setdefault(model, {})
    if dtype not in per_dtype:
        per_dtype[dtype] = linear_weights(model, dtype)
    return per_dtype[dtype]


# Model -> {shape key: StaticDecoder}, freed with the model: a weak key, whose entry goes when the model is freed, so
# a model made later at the same address (id) meets no decoder of the old one. Evaluation's shape sits beside
# training's, so neither evicts (and recaptures) the other; the least recently used goes beyond MAX_DECODERS.
_DECODERS = weakref.WeakKeyDictionary()
# Model -> the tensor_layout its decoders were made for (names, addresses, dtypes, shapes: no tensor, no model held).
_LAYOUTS = weakref.WeakKeyDictionary()
MAX_DECODERS = 4
# Models on which the static-cache path failed: with fast=None they sample plainly.
_NO_FAST = weakref.WeakSet()
# Models whose graph capture failed: with fast=True they decode on the static cache without graphs.
_NO_GRAPH = weakref.WeakSet()
# Models on which the static-cache path worked once.
_TRIED = weakref.WeakSet()


def tensor_layout(model) -> tuple:
    """Where each tensor a captured decode step reads lives: (name, address, dtype, shape, strides, device) of every
    parameter and buffer. A graph reads them by address, so it computes this model's step exactly while the layout
    is the one it was captured on: an address that memory reuse repeats under the same name, dtype, shape and
    strides holds the very tensor the graph reads. A tensor moved (`.to`, `load_state_dict(assign=True)`,
    `p.data = ...`) or a changed structure (LoRA's layers wrapped in) changes it."""
    tensors = (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False))
    return tuple((name, t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), str(t.device)) for name, t in tensors)


def static_decoder(model, n: int, length: int, device) -> StaticDecoder:
    """The model's static decoder for N rows and >= `length` columns, kept: its graph is captured once. Kept per
    model (a weak key) and for one `tensor_layout` of it: when that changes, the model's decoders and their shared
    weight casts are dropped (they would read memory that is no longer the model's) and made afresh."""
    # Rounded up: prompts of nearby lengths share one graph.
    length = -(-length // 64) * 64
    amp = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
    key = (n, length, str(device), model.training, amp)
    layout = tensor_layout(model)
    if _LAYOUTS.get(model) != layout:
        _DECODERS.pop(model, None)
        _WEIGHTS.pop(model, None)
        _LAYOUTS[model] = layout
    decoders = _DECODERS.setdefault(model, {})
    if key not in decoders:
        if len(decoders) >= MAX_DECODERS:
            decoders.pop(next(iter(decoders)))
        graphs = graphs_on(device) and model not in _NO_GRAPH
        decoders[key] = StaticDecoder(model, n, length, device, graphs)
    decoders[key] = decoders.pop(key)  # the most recently used last
    return decoders[key]


# Errors of a static cache that this transformers version calls differently (an unexpected keyword, a
# missing attribute, a mask of the wrong form). Not RuntimeError (CUDA, memory) nor FloatingPointError
# (a diverged policy): those are the caller's to see.
_PATH_ERRORS = (TypeError, ValueError, AttributeError, IndexError, KeyError)


@torch.no_grad()
def _try_static_path(model, device) -> None:
    """One prefill and one eager decode step of a 1-row static cache: raises if the model won't take it."""
    dec = StaticDecoder(model, 1, 64, device, graphs=False)
    one = torch.ones(1, 1, dtype=torch.long, device=device)  # (1, 1) a one-token prompt
    dec.prefill(model, one, one, torch.zeros(1, dtype=torch.long, device=device))
    dec.ids.copy_(one)
    dec.write.add_(1)
    dec._forward(model)


def use_static_decoder(model, n: int, length: int, fast: bool | None = None, log=warn) -> bool:
    """Whether `static_loop` samples N rows of up to `length` tokens with `sample_static`.

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
            _WEIGHTS.pop(model, None)
            return False
        _TRIED.add(model)
    return True


def capture_failed(model, error: GraphCaptureError, log=warn) -> None:
    """After a failed capture: the model never captures again (auto: the plain loop; fast=True: the static cache
    without graphs), its decoders and their memory are freed, and one line says so."""
    _NO_FAST.add(model)
    _NO_GRAPH.add(model)
    _DECODERS.pop(model, None)
    _WEIGHTS.pop(model, None)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    log(f"rollout: capturing the decode step as a CUDA graph failed ({error}); sampling on the plain loop")


def static_loop(fast: bool | None = None):
    """A sampling loop for `rollout.generate(loop=...)`: `sample_static` where `use_static_decoder(fast)` allows
    (fast=None: auto, on CUDA; True: always; False: never), else rollout.sample. Should the graph capture fail, the
    call samples again on rollout.sample from the same generator state, and the run goes on (`capture_failed`)."""

    def loop(model, prompt_ids, prompt_mask, rows, **kw) -> dict:
        if use_static_decoder(model, rows.numel(), prompt_ids.shape[1] + kw["max_new_tokens"], fast):
            generator = kw["generator"]
            state = generator.get_state() if generator is not None else None
            try:
                return sample_static(model, prompt_ids, prompt_mask, rows, **kw)
            except GraphCaptureError as e:
                capture_failed(model, e)
                if state is not None:
                    generator.set_state(state)
        with folded_gqa():  # the plain loop's decode steps read the cache unrepeated too
            return sample(model, prompt_ids, prompt_mask, rows, **kw)

    return loop


class _Step:
    """The sampling step `sample_static` calls: rollout.next_token, or its torch.compile'd form (--compile:
    engine/compiled.py)."""

    next_token = staticmethod(next_token)


STEP = _Step()


@torch.no_grad()
def sample_static(
    model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, rows: torch.Tensor, *, max_new_tokens: int, **step
) -> dict:
    """rollout.sample's loop on the static cache: the same arguments and result, the same tokens when greedy. Its
    step is rollout.next_token with the exponential race for a pick (no cumulative sum over V); the loop checks for
    EOS every 16 steps rather than every step, and for non-finite values once, at the end (each check is a host
    sync)."""
    n, device = rows.numel(), rows.device
    dec = static_decoder(model, n, prompt_ids.shape[1] + max_new_tokens, device)
    logits = dec.prefill(model, prompt_ids, prompt_mask, rows)  # (N, V)
    if not torch.isfinite(logits).all():
        raise FloatingPointError("generate: the sampler's logits are not finite")
    tokens, token_logps, entropies = [], [], []
    alive = torch.ones(n, dtype=torch.bool, device=device)  # (N,) no EOS yet
    lengths = torch.zeros(n, dtype=torch.long, device=device)  # (N,) tokens kept so far
    for t in range(max_new_tokens):
        if t > 0:
            logits = dec.decode(model, tokens[-1])  # (N, V)
        # Eager, after the replay (the graph holds the forward alone); check_finite=False: no host sync a step.
        nxt, token_logp, entropy, alive, lengths = STEP.next_token(
            logits, alive, lengths, pick=sample_exponential_race, check_finite=False, **step
        )
        tokens.append(nxt)
        token_logps.append(token_logp)
        entropies.append(entropy)
        if not step["ignore_eos"] and t % 16 == 15 and not alive.any():
            break
    # The race picks a token even from NaN logits: a diverged policy shows in the log-probs instead.
    if not (torch.isfinite(torch.stack(token_logps)).all() and torch.isfinite(torch.stack(entropies)).all()):
        raise FloatingPointError("generate: the sampler's logits are not finite")
    return dict(tokens=tokens, token_logps=token_logps, entropies=entropies, lengths=lengths, alive=alive)
