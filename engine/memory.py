"""The memory plan of a run: every byte a step holds on the device, phase by phase, before the first step runs.

    memory_plan       Plan for a config and its policy: the resident bytes, the kept decoders, each phase's own
    Plan              .peak (the predicted peak, bytes), .fits, .lines() / .describe(): one line an item
    process_budget    the bytes this process may hold on a CUDA device, all of them (what is allocated included)

What a step (train.grpo_step) holds, by phase; each item is a formula of engine/policy.py's rules of thumb:

    resident, every phase
        the policy's weights; pi_ref's copy (beta > 0 without LoRA); the gradients and AdamW's two float32
        moments (allocated by the first update, then kept: counted from the start); the queue (--lag s: s + 1
        batches, --offpolicy-steps v: v, at most --steps) at engine.queue_fit.queue_batch_bytes each
    kept decoders, every phase (engine.decoding keeps up to MAX_DECODERS, the least recently used dropped)
        one per sampling shape: the first draw's calls of --sample-rows rows and the last, smaller call; under --lag
        the later steps' one batch; evaluation's calls (256 rows, and the remainder). Each holds its KV cache
        (policy.kv_bytes_per_row) and, on CUDA, its graph's private pool (`graph_pool_bytes`); the decoders of a
        model share one cast of its Linear weights under autocast
    sample     the largest call's sampling chain (policy.sample_bytes_per_row's 8 float32 (rows, V) tensors)
    no-grad    one no-grad pass (pi_ref's forward, log alpha's recompute, sampler_mismatch's, MIS / M2PO's
               prepass) over `nograd_rows` rows: one layer's activations at a time and the head's chunks, and
               autocast's cast of the policy's matrices
    update     autocast's cast of the matrices, the micro-batch's activations (policy.activation_bytes_per_token),
               the head's chunks and grad_w (policy.head_bytes)

The micro-batch and the sampling rows are the defaults as engine.policy sizes them at the run's first draw and
first update (or the flags'); the plan fits when each phase's peak leaves 15% of what the long-lived bytes
(resident and decoders) leave of the budget (policy.HEADROOM: the allocator's fragmentation), the rule the defaults
are sized by. tests/test_memory_plan.py shows --lag 4 and
--offpolicy-steps 4 fit a 40 GiB cap at the benchmark's shape, and that no-grad passes over all 512 rows would not.
"""

import inspect
from dataclasses import dataclass, field

import torch

from engine import policy as P

# engine.decoding's own constants, read here without importing it (it imports rollout and transformers' helpers).
MAX_DECODERS = 4
LENGTH_ROUNDING = 64  # decoding.static_decoder rounds a decoder's columns up to a multiple of this


def eval_batch_size() -> int:
    """bookkeeping.evaluation.evaluate's rows per generate call (its batch_size default)."""
    from bookkeeping.evaluation import evaluate

    return inspect.signature(evaluate).parameters["batch_size"].default


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def graph_pool_bytes(config, rows: int, dtype: torch.dtype) -> int:
    """A captured decode step's private pool (CUDA): what one step allocates at its peak, blocks freed within the
    capture being reused by it: the logits (rows, V), counted in float32, and one layer's intermediates, as
    `nograd_bytes_per_token` counts them, for rows tokens."""
    return rows * (4 * config.vocab_size + nograd_bytes_per_token(config, dtype))


def nograd_bytes_per_token(config, dtype: torch.dtype) -> int:
    """A no-grad forward's memory per token at its peak, one layer at a time (nothing kept for a backward): the
    float32 residual stream and the normed input (2 x 4 H), the normed input's cast (b H), the MLP's gate, up,
    silu(gate) and their product (4 b I), the layer's output (4 H): 12 H + b (H + 4 I)."""
    h = config.hidden_size
    i = getattr(config, "intermediate_size", None) or 4 * h
    return 12 * h + dtype_bytes(dtype) * (h + 4 * i)


def nograd_head_bytes(config) -> int:
    """The chunked head's forward without grad: a chunk's logits and its float32 exp, 2 x HEAD_CHUNK x V x 4."""
    return 2 * P.HEAD_CHUNK * config.vocab_size * 4


def nograd_pass_bytes(config, rows: int, length: int, dtype: torch.dtype) -> int:
    """One no-grad log-prob pass over `rows` rows of `length` tokens: the layers' peak and the head's chunks."""
    return rows * length * nograd_bytes_per_token(config, dtype) + nograd_head_bytes(config)


def linear_matrix_bytes(model, dtype: torch.dtype) -> int:
    """A cast of the float32 matrices (dim 2 parameters) into `dtype`: autocast's cache (with grad, and for no-grad
    passes of parameters that require grad) and the decoders' shared Linear weights."""
    b = dtype_bytes(dtype)
    return sum(p.numel() * b for p in model.parameters() if p.dim() == 2 and p.dtype == torch.float32)


def process_budget(device) -> int:
    """The bytes this process may hold on the CUDA device in all: what it may still allocate
    (policy.available_bytes, a per-process cap counted) and what it has allocated."""
    return P.available_bytes(device) + torch.cuda.memory_allocated(device)


@dataclass
class Plan:
    """A run's memory plan: items (phase, what, bytes), phase peaks, the predicted peak and the budget."""

    items: list[tuple[str, str, int]]
    budget: int | None  # the bytes the process may hold (None: unknown, a CPU)
    micro_batch: int
    sample_rows: int  # rows a sampling call holds at the first draw
    decoders: list[tuple[int, int]] = field(default_factory=list)  # (rows, columns) of each kept decoder

    def total(self, phase: str) -> int:
        return sum(b for ph, _, b in self.items if ph == phase)

    @property
    def phases(self) -> dict[str, int]:
        """Each phase's peak: the resident bytes, the kept decoders and the phase's own."""
        base = self.total("resident") + self.total("decoders")
        return {ph: base + self.total(ph) for ph in ("sample", "no-grad", "update")}

    @property
    def peak(self) -> int:
        return max(self.phases.values())

    @property
    def long_lived(self) -> int:
        """The bytes allocated once and kept (resident and decoders): no fragmentation among them."""
        return self.total("resident") + self.total("decoders")

    @property
    def plannable(self) -> int | None:
        """The most a phase may peak at: the long-lived bytes and 85% of the rest of the budget (policy.HEADROOM
        kept for the allocator's fragmentation of what comes and goes), the rule the defaults are sized by."""
        if self.budget is None:
            return None
        return self.long_lived + P.plannable_bytes(self.budget - self.long_lived)

    @property
    def fits(self) -> bool:
        return self.budget is None or self.peak <= self.plannable

    def lines(self) -> list[str]:
        gib = 2**30
        out = [f"{ph:<9} {what:<62} {b / gib:8.2f} GiB" for ph, what, b in self.items]
        out += [f"peak of {ph:<10} {b / gib:8.2f} GiB" for ph, b in self.phases.items()]
        verdict = (
            ""
            if self.budget is None
            else (
                f" of {self.plannable / gib:.1f} GiB plannable (budget {self.budget / gib:.1f} GiB, 15% of what is "
                "not long-lived kept free): " + ("fits" if self.fits else "DOES NOT FIT")
            )
        )
        out.append(
            f"predicted peak {self.peak / gib:.2f} GiB{verdict}; micro-batch {self.micro_batch}, "
            f"{self.sample_rows} rows a sampling call"
        )
        return out

    def describe(self) -> str:
        return "\n".join(self.lines())


def sampling_shapes(group: int, longest: int, rows_per_call: int, drawn_rows: int) -> list[tuple[int, int]]:
    """(rows, columns) of the decoders that sampling `drawn_rows` rows in groups of `group` makes at `rows_per_call`
    rows a call (whole prompts a call, rollout.generate_batches): the full calls' and the last, smaller one's."""
    per_call = max(1, rows_per_call // group) * group
    cols = -(-longest // LENGTH_ROUNDING) * LENGTH_ROUNDING
    shapes = [(min(per_call, drawn_rows), cols)]
    if drawn_rows > per_call and drawn_rows % per_call:
        shapes.append((drawn_rows % per_call, cols))
    return shapes


def memory_plan(
    cfg,
    model,
    prompt_len: int,
    *,
    budget: int | None = None,
    nograd_rows: int | None = None,
    eval_prompt_len: int | None = None,
    graphs: bool | None = None,
) -> Plan:
    """The memory plan of `cfg`'s run of `model` (the policy as the run trains it: after engine.policy.make_models,
    so that LoRA's trainable parameters are the adapter's), prompts of at most `prompt_len` tokens.

    budget: the bytes the process may hold in all (None: `process_budget` on CUDA, unknown on a CPU).
    nograd_rows: the rows a no-grad pass holds at once (None: the update's micro-batch, as train.py runs them).
    eval_prompt_len: the held-out prompts' longest (None: prompt_len). graphs: whether decoders keep CUDA graph
    pools (None: on CUDA)."""
    device = next(model.parameters()).device
    config = model.config
    if budget is None and device.type == "cuda":
        budget = process_budget(device)
    graphs = device.type == "cuda" if graphs is None else graphs
    amp = cfg.autocast_dtype
    dtype = P.compute_dtype(model, amp)  # the matmuls' (and, under autocast, the KV cache's) dtype
    n, t = cfg.prompts_per_step * cfg.group_size, cfg.max_new_tokens
    length = prompt_len + t  # a row's prompt and completion
    items = []

    # Resident: the weights, pi_ref's copy, the training state, the queue.
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    trainable = [p for p in model.parameters() if p.requires_grad]
    state = sum(p.numel() * (p.element_size() + 8) for p in trainable)
    items.append(("resident", "the policy's weights", weights))
    if cfg.beta > 0 and not cfg.lora_rank:
        items.append(("resident", "pi_ref's copy of the weights", weights))
    items.append(("resident", f"gradients and AdamW's moments ({sum(p.numel() for p in trainable) / 1e6:.1f}M)", state))
    held = min(cfg.lag + 1 if cfg.lag is not None else cfg.offpolicy_steps, cfg.steps)
    from engine.queue_fit import queue_batch_bytes  # here: queue_fit imports engine.policy, as this file does

    per_batch = queue_batch_bytes(cfg, prompt_len)
    items.append(("resident", f"the queue: {held} batch(es) x {per_batch / 1e6:.1f} MB", held * per_batch))
    casts = linear_matrix_bytes(model, amp) if amp is not None else 0

    # The first draw's sampling calls, sized as auto_sample_rows sizes them then (a refresh, or --lag's s + 1): the
    # weights and pi_ref allocated, the training state and autocast's casts pending.
    resident0 = weights * (2 if cfg.beta > 0 and not cfg.lora_rank else 1)
    pending = state + casts
    first_rows = held * n if cfg.lag is not None else cfg.offpolicy_steps * n  # rows the first step draws
    first_rows = min(first_rows, cfg.steps * n)
    free = None if budget is None else budget - resident0
    if cfg.sample_rows:
        rows_per_call = cfg.sample_rows
    elif free is None:
        rows_per_call = first_rows  # a CPU: the first draw in one call
    else:
        rows_per_call = P.balanced_rows(first_rows, P.sample_rows_fitting(config, length, free, dtype, pending))
    shapes = sampling_shapes(cfg.group_size, length, rows_per_call, first_rows)
    if cfg.lag is not None and cfg.steps > held:  # later steps draw one batch each: a shape of its own
        later = cfg.sample_rows or n
        if not cfg.sample_rows and budget is not None:
            spent = (
                resident0 + state + held * per_batch + sum(r * P.kv_bytes_per_row(config, c, dtype) for r, c in shapes)
            )
            later = P.balanced_rows(n, P.sample_rows_fitting(config, length, budget - spent, dtype, casts))
        shapes += [shape for shape in sampling_shapes(cfg.group_size, length, later, n) if shape not in shapes]
    # Evaluation's calls (greedy, and --eval-samples k's), on the same decoders' cache of shapes.
    per_eval = eval_batch_size()
    eval_len = (eval_prompt_len or prompt_len) + t
    for k in (1, cfg.eval_samples) if cfg.eval_samples else (1,):
        rows = cfg.eval_size * k
        call = max(1, per_eval // k) * k
        eval_shapes = sampling_shapes(k, eval_len, call, rows)
        shapes += [shape for shape in eval_shapes if shape not in shapes]
    # At most MAX_DECODERS are kept: the largest ones, to be safe.
    kept = sorted(shapes, key=lambda shape: shape[0] * shape[1], reverse=True)[:MAX_DECODERS]
    for rows, cols in kept:
        items.append(
            (
                "decoders",
                f"decoder of {rows} rows x {cols} columns: KV cache",
                rows * P.kv_bytes_per_row(config, cols, dtype),
            )
        )
        if graphs:
            items.append(
                ("decoders", f"decoder of {rows} rows: its CUDA graph's pool", graph_pool_bytes(config, rows, dtype))
            )
    if amp is not None:
        items.append(("decoders", "the decoders' shared cast of the Linear weights", casts))

    # Sampling: the largest call's chain.
    biggest = max(r for r, _ in shapes)
    items.append(
        (
            "sample",
            f"the sampling chain of a {biggest}-row call: 8 x (rows, V) float32",
            biggest * 8 * config.vocab_size * 4,
        )
    )

    # The update's micro-batch, as auto_micro_batch sizes it at the first update: everything above allocated.
    allocated = sum(b for ph, _, b in items if ph in ("resident", "decoders")) - state
    if cfg.micro_batch:
        mb = cfg.micro_batch
    elif budget is None:
        mb = n
    else:
        mb = P.micro_batch_fitting(config, n, length, cfg.gradient_checkpointing, budget - allocated, dtype, pending)
    rows = nograd_rows or mb
    if amp is not None:
        items.append(("no-grad", "autocast's cast of the policy's matrices", casts))
    items.append(
        (
            "no-grad",
            f"a no-grad pass over {rows} rows x {length} tokens",
            nograd_pass_bytes(config, rows, length, dtype),
        )
    )
    if amp is not None:
        items.append(("update", "autocast's cast of the policy's matrices", casts))
    act = P.activation_bytes_per_token(config, cfg.gradient_checkpointing, dtype)
    items.append(("update", f"activations of a micro-batch of {mb} rows x {length} tokens", mb * length * act))
    items.append(("update", "the LM head's chunks and grad_w", P.head_bytes(config)))
    return Plan(items, budget, mb, rows_per_call, kept)


def plan_line(cfg, model, tokenizer, train_set, heldout) -> str:
    """The run's start: the plan's last line (the predicted peak, and on CUDA whether it fits), for its log."""
    from engine.queue_fit import longest_prompt  # here, as in memory_plan

    plan = memory_plan(
        cfg, model, longest_prompt(tokenizer, train_set), eval_prompt_len=longest_prompt(tokenizer, heldout)
    )
    return f"memory plan: {plan.lines()[-1]}"
