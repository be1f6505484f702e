"""The policy a run trains: loading it (the built-in tiny one, a GGUF file, or any transformers causal LM),
fitting it into memory (bfloat16 weights, gradient checkpointing, LoRA), and the optimizer for bfloat16 weights.

    load_policy        the model and its tokenizer, from --model
    fit_policy         dropout off, then the memory levers: bfloat16 weights, gradient checkpointing, LoRA
    auto_micro_batch   the micro-batch that fits the memory the process may use (CUDA); the whole batch on the CPU
    auto_sample_rows   the rows a sampling call holds, sized the same way
    BF16AdamW          the optimizer for bfloat16 weights (stochastic rounding)
    Models, make_models  pi_theta, its optimizer and pi_ref, as a step reads them
    autocast           bfloat16 autocast on CUDA, a no-op in float32

docs/benchmarks.md measures what each lever saves.
"""

import copy
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from config import Config, ConfigError, looks_like_path


def gguf_file(model: str) -> Path | None:
    """The GGUF file `--model` names: the path itself, or the one `.gguf` in a folder without a config.json.

    None for anything else (tiny, a hub id, a transformers folder). A `.gguf` path that is no file, and a
    folder with several `.gguf` files and no config.json (ambiguous), are ConfigErrors.
    """
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf":
        # Checked here: a missing file would otherwise reach the hub loader as a malformed repo id.
        if not path.is_file():
            raise ConfigError(f"--model {model}: no such GGUF file")
        return path
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        names = ", ".join(f.name for f in found)
        raise ConfigError(f"--model {model}: the folder holds {len(found)} GGUF files ({names}); name one of them")
    return found[0] if found else None


def load_gguf(path) -> tuple[torch.nn.Module, object]:
    """A GGUF file as an ordinary float32 transformers model and its tokenizer (chat template included).

    transformers reads GGUF through the `gguf` package and dequantizes every tensor to float32, but the
    model it returns still carries a GGUF quantization marker that makes `save_pretrained` refuse. So the
    weights are copied into a plain model built from the same config, without the marker: it trains,
    saves and reloads like any `from_pretrained` model. A missing `gguf` package is a one-line ConfigError.
    """
    try:
        import gguf  # noqa: F401 (transformers imports it by name; checked here for a clear message)
    except ImportError:
        raise ConfigError(
            f"--model {path}: reading a GGUF file needs the gguf package (pip install gguf, or the [real] extra)"
        ) from None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path).expanduser()
    folder, name = str(path.parent), path.name
    try:
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except Exception as e:  # an unsupported architecture or a damaged file: both mean "cannot load"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"--model {path}: cannot be loaded as GGUF ({first[:200]})") from None
    config = quantized.config
    # The marker is what save_pretrained refuses; the weights themselves are already plain float32.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # strict: every tensor of the plain model must come from the file (tied heads share one tensor).
    model.load_state_dict(quantized.state_dict(), strict=True)
    model.generation_config = quantized.generation_config
    del quantized
    return model.eval(), tok


def check_tokenizer(model: str, tok) -> None:
    """A tokenizer that encodes text as no tokens (a model folder with weights and no tokenizer files: transformers
    builds an empty one from the config) is refused at load, before --overwrite touches anything: every prompt would
    be 0 tokens, and the run would fail inside its first evaluation."""
    try:
        ids = tok("12 + 34 = 46", add_special_tokens=False)["input_ids"]
    except Exception as e:  # a tokenizer that cannot encode at all
        ids, why = [], f" ({type(e).__name__})"
    else:
        why = ""
    if not ids:
        raise ConfigError(
            f"--model {model}: its tokenizer encodes text as no tokens{why} (no tokenizer files: tokenizer.json, "
            "vocab.json, tokenizer.model, ...); save the tokenizer into the folder (tokenizer.save_pretrained)"
        )


def load_policy(cfg: Config, log=print):
    """The policy to train and its tokenizer: the built-in tiny one, a GGUF file, or a transformers model.

    A model that cannot be loaded (offline, wrong path, no gguf package, ...) is a ConfigError naming it.
    """
    gguf_path = None if cfg.model == "tiny" else gguf_file(cfg.model)
    if cfg.model == "tiny":
        from engine.tiny import load_tiny

        if cfg.task != "arithmetic":
            raise ConfigError(f"--model tiny only knows --task arithmetic; name a real model for --task {cfg.task}")
        model, tok = load_tiny(cfg.cache_dir, cfg.warmup_steps, log=log)
    elif gguf_path is not None:
        model, tok = load_gguf(gguf_path)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        local = Path(cfg.model).expanduser()
        # A name only a path can have (./x, /x, ~/x, a/b/c) that is not there is a missing folder: transformers would
        # take it for a hub id and say "Repo id must be in the form 'repo_name'", or look it up on the hub.
        if not local.exists() and looks_like_path(cfg.model):
            raise ConfigError(f"--model {cfg.model}: no such folder")
        if local.is_file():
            raise ConfigError(f"--model {cfg.model}: is a file; give a model's folder, a hub id or a .gguf file")
        try:
            tok = AutoTokenizer.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code)
            model = AutoModelForCausalLM.from_pretrained(
                cfg.model, trust_remote_code=cfg.trust_remote_code, dtype=torch.float32
            )
        except Exception as e:  # transformers raises many types here; all mean "cannot load"
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(f"--model {cfg.model}: cannot be loaded ({first[:200]})") from None
    if cfg.model != "tiny":
        check_tokenizer(cfg.model, tok)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token  # safe: padding is masked explicitly, never inferred from ids
    if tok.eos_token_id is None:
        raise ConfigError(f"--model {cfg.model}: tokenizer has no EOS token")
    n_params = sum(p.numel() for p in model.parameters())
    log(f"policy: {cfg.model} ({n_params / 1e6:.2f}M parameters) on {cfg.device}, {cfg.dtype}")
    return model, tok


def fit_policy(cfg: Config, model):
    """The policy as the run trains it: dropout off, then the memory levers (docs/real-model.md, "Fitting the model").

    1. Every dropout probability is set to 0 (nn.Dropout and attention-dropout attributes), so that pi_theta,
       pi_k, alpha and pi_ref are one deterministic network in train mode too, which checkpointing needs.
    2. --param-dtype bfloat16: the weights, and so their gradients and every pass, in bfloat16.
    3. --gradient-checkpointing: transformers' own, non-reentrant; each decoder layer's forward runs again
       in the backward instead of keeping its activations.
    4. --lora-rank r: peft's LoRA (no dropout) on --lora-targets; only the adapter requires grad, and pi_ref
       is this model with the adapter disabled (train.ref_logprobs): no second copy.
    A model that cannot take a lever is a ConfigError naming the flag.
    """
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        for name, value in list(vars(m).items()):
            if "dropout" in name and isinstance(value, float):  # e.g. attention_dropout of transformers' attention
                setattr(m, name, 0.0)
    if cfg.param_dtype == "bfloat16":
        model.to(torch.bfloat16)
    if cfg.gradient_checkpointing:
        if not getattr(model, "supports_gradient_checkpointing", False):
            raise ConfigError(f"--gradient-checkpointing: {type(model).__name__} does not support it")
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x: the new name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.lora_rank:
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError:
            raise ConfigError("--lora-rank needs the peft package (pip install peft, or the [lora] extra)") from None
        targets = cfg.lora_targets if cfg.lora_targets == "all-linear" else cfg.lora_targets.split(",")
        lora = LoraConfig(
            r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, target_modules=targets, lora_dropout=0.0, task_type="CAUSAL_LM"
        )
        try:
            model = get_peft_model(model, lora)
        except ValueError as e:
            raise ConfigError(f"--lora-targets {cfg.lora_targets}: {str(e).splitlines()[0][:200]}") from None
    return model


# --- The memory defaults: --micro-batch and --sample-rows on CUDA ---------------------------------------------------
#
#   F = min(driver free + the allocator's unused cache,  total x fraction - allocated)   what the process may allocate
#       fraction: torch.cuda.set_per_process_memory_fraction's (memory_fraction; 1 when none is set)
#   U = (1 - HEADROOM) x F - pending                                                     what a default may plan on
#       HEADROOM = 0.15: the allocator's fragmentation (its reserved peak runs above the allocated one) and the
#       error of the rules of thumb below; pending: what the first update still allocates (pending_bytes)
#   --micro-batch  the largest divisor of N with  rows x length x activation_bytes_per_token  <=  U - head_bytes
#       and rows x length <= MICRO_BATCH_TOKENS = 16,384: a micro-batch that size keeps a GPU's matmuls busy
#       (16k x H x I each), and more rows at once would only spend memory (at the benchmark's shape on an H200 these
#       rules would plan 128 rows, ~101 GB, where 32 rows plan ~38 GB)
#   --sample-rows  the most rows with  rows x sample_bytes_per_row  <=  SAMPLE_SHARE x U
#       SAMPLE_SHARE = 1/2: the static decoder keeps its KV cache through the update, whose micro-batch is sized
#       afterwards from what sampling left. A 24, 40 or 80 GB device each gets defaults that fit: tests/test_gpu_path.
HEADROOM = 0.15
SAMPLE_SHARE = 0.5
MICRO_BATCH_TOKENS = 16_384
HEAD_CHUNK = 1024  # rows of the LM head evaluated at once (engine.chunked_logprobs.chunked_token_logprobs' chunk)


def activation_bytes_per_token(config, checkpointing: bool, dtype: torch.dtype) -> int:
    """A decoder's activations kept for the backward, per token, with matmuls in `dtype` (the autocast dtype, or the
    weights' own without autocast) and a float32 residual stream. In each layer:

        b (10 H + 4 I) + 4 (4 H)   b = dtype's bytes. 10 H: autocast casts the normed input once for each of q, k,
                                   v (3 H) and of gate, up (2 H); q, its rotated half, its cast for the attention,
                                   the attention's output and o_proj's contiguous input (5 H). 4 I: gate, up,
                                   silu(gate), their product. 4 H float32: the residual stream before and after the
                                   attention, and each norm's normalised input. (k and v are GQA-small: left out.)
        layers x that              all of it; with gradient checkpointing: 4 H x layers (each layer's float32
                                   input) + one layer's, recomputed one layer at a time

    Counted op by op on transformers' Qwen2/Llama layers (Korthikanti et al. 2022 count the same way); without
    autocast the three and two casts are one shared tensor each, so this overcounts a float32 run. It sizes the
    default micro-batch."""
    h = config.hidden_size
    i = getattr(config, "intermediate_size", None) or 4 * h
    b = torch.empty((), dtype=dtype).element_size()
    per_layer = b * (10 * h + 4 * i) + 4 * 4 * h
    layers = config.num_hidden_layers
    return 4 * h * layers + per_layer if checkpointing else per_layer * layers


def head_bytes(config) -> int:
    """The LM head's log-probs at their peak, beside the activations: about 4 (chunk, V) float32 blocks alive (the
    logits, z, softmax, the gradient) and grad_w, (V, H) float32:  4 x HEAD_CHUNK x V x 4 + 4 V H."""
    return 4 * HEAD_CHUNK * config.vocab_size * 4 + 4 * config.vocab_size * config.hidden_size


def kv_bytes_per_row(config, length: int, dtype: torch.dtype) -> int:
    """One row's KV cache of `length` tokens in `dtype` (the autocast dtype under autocast, the weights' otherwise:
    float32 in a float32 run):  2 (K and V) x layers x kv_heads x head_dim x length x dtype's bytes."""
    layers, heads = config.num_hidden_layers, config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * layers * kv_heads * head_dim * length * torch.empty((), dtype=dtype).element_size()


def sample_bytes_per_row(config, length: int, dtype: torch.dtype) -> int:
    """A sampled row's memory: its KV cache (kv_bytes_per_row) and its share of the sampling chain's float32 (N, V)
    tensors (the logits, log-probs, probabilities and the draw's: about 8 alive at once):  KV + 8 x V x 4."""
    return kv_bytes_per_row(config, length, dtype) + 8 * config.vocab_size * 4


def plannable_bytes(available: int, pending: int = 0) -> int:
    """U = (1 - HEADROOM) x F - pending: what a default may plan on, of the F bytes the process may allocate."""
    return max(0, int((1 - HEADROOM) * available) - pending)


def micro_batch_fitting(
    config, n: int, length: int, checkpointing: bool, available: int, dtype: torch.dtype, pending: int = 0
) -> int:
    """The largest divisor of N (at least 1) whose rows of `length` tokens keep their activations within what a
    default may plan on of `available` bytes, less the head's chunks:  rows x length x
    activation_bytes_per_token  <=  plannable_bytes(available, pending) - head_bytes, and rows x length <=
    MICRO_BATCH_TOKENS."""
    per_row = length * activation_bytes_per_token(config, checkpointing, dtype)
    fits = (plannable_bytes(available, pending) - head_bytes(config)) // per_row
    return largest_divisor_within(n, min(fits, MICRO_BATCH_TOKENS // length))


def sample_rows_fitting(config, length: int, available: int, dtype: torch.dtype, pending: int = 0) -> int:
    """The most rows (at least 1) whose sampling state fits SAMPLE_SHARE of what a default may plan on:
    rows x sample_bytes_per_row  <=  SAMPLE_SHARE x plannable_bytes(available, pending)."""
    per_row = sample_bytes_per_row(config, length, dtype)
    return max(1, int(SAMPLE_SHARE * plannable_bytes(available, pending)) // per_row)


def balanced_rows(rows: int, fit: int) -> int:
    """The rows a call holds when `rows` are sampled in as few calls as `fit` rows a call allow, the calls made
    equal: ceil(rows / ceil(rows / fit)). Equal calls share one static decoder (engine.decoding keeps one per
    shape, each with its KV cache and graph pool); a last, smaller call would keep a second (engine/memory.py)."""
    fit = max(1, min(rows, fit))
    calls = -(-rows // fit)
    return -(-rows // calls)


def largest_divisor_within(n: int, limit: int) -> int:
    """The largest divisor of n that is <= limit, and at least 1."""
    return max((d for d in range(1, n + 1) if n % d == 0 and d <= limit), default=1)


def memory_available(free: int, total: int, reserved: int, allocated: int, fraction: float = 1.0) -> int:
    """F: the bytes the process may still allocate. The driver's free memory and what PyTorch's caching allocator
    holds unused (the driver alone counts that cache as taken: after a first step it would see less and size
    another way); and under a per-process fraction, what the allocator may still reserve, total x fraction, less
    what is allocated (the cap binds the allocator's reserved bytes, and its unused cache is reusable)."""
    return max(0, min(free + reserved - allocated, int(total * fraction) - allocated))


# Fractions set through cap_memory, by device index: read back where torch cannot (get_per_process_memory_fraction
# is not in every torch).
_FRACTIONS: dict[int, float] = {}


def cap_memory(device, gib: float) -> float:
    """Cap this process at `gib` GiB of the CUDA device (torch.cuda.set_per_process_memory_fraction(gib / total)),
    remembered for memory_fraction; returns the fraction (1 when the device holds less than the cap)."""
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    fraction = min(1.0, gib * 2**30 / total)
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    _FRACTIONS[index] = fraction
    return fraction


def memory_fraction(device) -> float:
    """The per-process memory fraction of the CUDA device: torch's own where it reads it back, else the one
    cap_memory set, else 1 (a fraction set straight through torch is unseen there)."""
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    return float(getter(index)) if getter is not None else _FRACTIONS.get(index, 1.0)


def available_bytes(device) -> int:
    """`memory_available` for the CUDA device as the driver and the caching allocator read now."""
    free, total = torch.cuda.mem_get_info(device)
    reserved, allocated = torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device)
    return memory_available(free, total, reserved, allocated, memory_fraction(device))


def compute_dtype(model, amp: torch.dtype | None) -> torch.dtype:
    """The dtype the forward's matmuls run in: the autocast dtype (--dtype bfloat16), else the weights' own."""
    return amp or next(model.parameters()).dtype


def pending_bytes(model, amp: torch.dtype | None) -> int:
    """What the first update allocates beyond what is allocated now: while no trainable parameter has a gradient
    yet, each one's gradient (its own bytes) and AdamW's two float32 moments (8 bytes); under autocast, the copies
    of the float32 matrices its forward caches (the autocast dtype's bytes each). Later the gradients and moments
    are allocated and the driver counts them."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    state = 0
    if trainable and all(p.grad is None for p in trainable):
        state = sum(p.numel() * (p.element_size() + 8) for p in trainable)
    casts = 0
    if amp is not None:
        b = torch.empty((), dtype=amp).element_size()
        casts = sum(p.numel() * b for p in model.parameters() if p.dtype == torch.float32 and p.dim() == 2)
    return state + casts


# Model -> {shape: the choice made the first time}: every step of the same shapes splits the same way.
_MICRO_BATCHES = weakref.WeakKeyDictionary()
_SAMPLE_ROWS = weakref.WeakKeyDictionary()


def auto_micro_batch(model, n: int, length: int, checkpointing: bool, amp: torch.dtype | None = None) -> int:
    """The default --micro-batch: on CUDA `micro_batch_fitting` the memory the process may use the first time these
    shapes are seen (amp: the autocast dtype, None without), remembered; elsewhere N (on a CPU memory is the
    host's, and the whole batch is what the shipped runs were made with)."""
    device = next(model.parameters()).device
    config = getattr(model, "config", None)
    if device.type != "cuda" or not hasattr(config, "num_hidden_layers"):
        return n
    chosen = _MICRO_BATCHES.setdefault(model, {})
    key = (n, length, checkpointing, amp)
    if key not in chosen:
        dtype, pending = compute_dtype(model, amp), pending_bytes(model, amp)
        chosen[key] = micro_batch_fitting(config, n, length, checkpointing, available_bytes(device), dtype, pending)
    return chosen[key]


def auto_sample_rows(model, rows: int, length: int, amp: torch.dtype | None = None) -> int:
    """The default --sample-rows for a draw of `rows` completions of up to `length` tokens (prompt and completion):
    on CUDA as many as `sample_rows_fitting` the memory the process may use (amp: the autocast dtype, which the KV
    cache is kept in), at most `rows`, the calls made equal (`balanced_rows`), remembered per shape as the
    micro-batch is; elsewhere `rows`, the draw in one call ([A]'s point: a stale sampler batches the work of v steps
    at once)."""
    device = next(model.parameters()).device
    config = getattr(model, "config", None)
    if device.type != "cuda" or not hasattr(config, "num_hidden_layers"):
        return rows
    chosen = _SAMPLE_ROWS.setdefault(model, {})
    key = (rows, length, amp)
    if key not in chosen:
        dtype, pending = compute_dtype(model, amp), pending_bytes(model, amp)
        chosen[key] = balanced_rows(rows, sample_rows_fitting(config, length, available_bytes(device), dtype, pending))
    return chosen[key]


class BF16AdamW(torch.optim.Optimizer):
    """AdamW for bfloat16 weights (--param-dtype bfloat16): float32 moments, the update computed in float32 as
    torch's AdamW computes it, then rounded stochastically into the bfloat16 weight, so that E[w_new] is the
    float32 result. Plain AdamW on bfloat16 weights rounds to nearest, which loses every update smaller than half
    a weight's bfloat16 spacing (2^-9 of its size: at lr 2e-5 most of them). Costs 12 bytes a parameter (weight
    2, gradient 2, moments 8) against float32's 16. Float32 parameters (a LoRA adapter) take the same update,
    unrounded. Step s of parameter i draws its rounding noise from a generator seeded by (seed, s, i): a resumed
    run rounds as the uninterrupted one would."""

    def __init__(self, params, lr: float, weight_decay: float = 0.0, betas=(0.9, 0.999), eps=1e-8, seed: int = 0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.seed = seed

    @torch.no_grad()
    def step(self):
        params = (p for group in self.param_groups for p in group["params"])
        index = {id(p): i for i, p in enumerate(params)}  # the parameter's place: its own rounding stream
        for group in self.param_groups:
            (b1, b2), lr = group["betas"], group["lr"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p, dtype=torch.float32))
                    st["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                st["step"] += 1
                s, g, w = int(st["step"]), p.grad.float(), p.float()  # float32 copies
                w.mul_(1 - lr * group["weight_decay"])
                st["exp_avg"].lerp_(g, 1 - b1)
                st["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
                denom = (st["exp_avg_sq"].sqrt() / (1 - b2**s) ** 0.5).add_(group["eps"])
                w.addcdiv_(st["exp_avg"], denom, value=-lr / (1 - b1**s))
                if p.dtype == torch.bfloat16:
                    seed = (self.seed * 1_000_003 + s) * 65_537 + index[id(p)]
                    gen = torch.Generator(device=p.device).manual_seed(seed)
                    noise = torch.randint(0, 1 << 16, w.shape, generator=gen, device=p.device, dtype=torch.int32)
                    w = ((w.view(torch.int32) + noise) & -65536).view(torch.float32)  # low 16 bits: exact in bf16
                p.copy_(w)

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's, which casts the moments to the parameter's dtype; here they stay float32."""
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        for i, st in state_dict["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                self.state[params[i]][key] = st[key].to(params[i].device, torch.float32, copy=True)


@dataclass
class Models:
    """What a step reads and changes: the trained policy, its optimizer, and pi_ref. alpha is no model: it is the
    policy of the step that drew the batch (the last refresh, or step k - s under --lag s; train.py's docstring)."""

    policy: torch.nn.Module  # pi_theta
    opt: torch.optim.Optimizer
    ref: torch.nn.Module | None  # pi_ref, a frozen copy; None without KL (beta = 0) and under LoRA (adapter off)


def make_models(cfg: Config, policy: torch.nn.Module) -> Models:
    """The policy fitted to memory (`fit_policy`), AdamW over its trainable weights (BF16AdamW for bfloat16 ones),
    and pi_ref when beta > 0: a copy without gradients in eval mode, none under LoRA (the adapter off)."""
    policy = fit_policy(cfg, policy)
    params = [p for p in policy.parameters() if p.requires_grad]  # LoRA: the adapter only
    if cfg.param_dtype == "bfloat16":
        opt = BF16AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, seed=cfg.seed)
    else:
        opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    ref = copy.deepcopy(policy).requires_grad_(False).eval() if cfg.beta > 0 and not cfg.lora_rank else None
    return Models(policy, opt, ref)


def autocast(cfg: Config, device):
    """bfloat16 autocast on CUDA (float32 master weights); a no-op with --dtype float32."""
    device = torch.device(device)
    return torch.autocast(
        device.type, dtype=cfg.autocast_dtype or torch.float32, enabled=cfg.autocast_dtype is not None
    )
