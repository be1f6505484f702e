"""The loop's log-probs: `logprobs.token_logprobs`'s values without the (N, T, V) float32 logits.

    chunked_token_logprobs   the LM head in row chunks over the scored tokens only (`SelectedLogProb`, a custom
                             autograd function), a group's G rows running their shared prompt once
                             (`completion_states`); tested equal to the textbook (tests/test_rollout.py) and, under
                             autocast, to autograd's gradients (tests/test_gpu_path.py)

An optimisation for real vocabularies (V = 150k: N x T x V float32 logits are tens of GB); a reader who wants the
algorithm reads logprobs.token_logprobs instead, and a copy of the algorithm can drop this file.
"""

import torch
import torch.nn.functional as F

from logprobs import Truncation, cache_kwarg, position_ids_from_mask, sampling_logits


def plain_z(temperature: float, truncation: Truncation | None) -> bool:
    """Whether sampling_logits' z is the logits themselves (tau = 1, nothing cut): the default run's case."""
    return temperature == 1 and not (truncation is not None and truncation.cuts)


def chunk_logp(logits, targets, temperature, truncation):
    """(log softmax(z)[y], log-sum-exp of z), each (c,) in float32 (float64 for float64 logits), of a chunk's
    logits (c, V), z = sampling_logits(logits, ...).

    Where z is the logits (`plain_z`), the log-sum-exp is read straight from the logits in their own dtype:
    torch.logsumexp's own steps (max, subtract, exp, sum, then log + max: the same floats as
    torch.logsumexp(logits.float())), with the upcast of bfloat16 logits inside the subtraction's kernel (a bfloat16
    tensor minus a float32 one is float32): no float32 copy of the logits, 4 passes over (c, V) where the cast and
    torch.logsumexp take 5 (logsumexp runs those 4 kernels under one name)."""
    acc = torch.promote_types(logits.dtype, torch.float32)
    if plain_z(temperature, truncation):
        top = logits.amax(dim=-1, keepdim=True)  # (c, 1) exact in any dtype
        lse = torch.sub(logits, top.to(acc)).exp_().sum(dim=-1).log_().add_(top.squeeze(1))  # (c,) in acc
        z_y = logits.gather(1, targets[:, None]).squeeze(1).to(acc)  # (c,)
    else:
        z = sampling_logits(logits, temperature, truncation, targets)  # (c, V) in acc
        lse = torch.logsumexp(z, dim=-1)  # (c,)
        z_y = z.gather(1, targets[:, None]).squeeze(1)  # (c,)
    return z_y - lse, lse


def chunk_grad(logits, targets, lse, coef, temperature, truncation):
    """d loss / d logits = (softmax(z) - onehot(y)) x coef for a chunk's logits (c, V), written in the logits' dtype
    (the matmuls' compute dtype), softmax(z) = exp(z - lse) from the forward's log-sum-exp `lse` (c,) and the same
    z (the same floats: the same kept set). coef (c, 1) is -(d loss / d logp) / tau.

    Computed in float32 (softmax - onehot cancels where p_y is near 1: not in bfloat16), in one buffer: subtract
    (where z is the logits: reading them in their own dtype, the upcast inside the kernel), exp and multiply, three
    passes over (c, V); the multiply writes the compute dtype directly (no second cast)."""
    if plain_z(temperature, truncation):
        p = torch.sub(logits, lse[:, None]).exp_()  # (c, V) softmax(z) in acc
    else:
        p = sampling_logits(logits, temperature, truncation, targets).sub_(lse[:, None]).exp_()  # (c, V)
    y = targets[:, None]  # (c, 1)
    p.scatter_add_(1, y, torch.full_like(y, -1, dtype=p.dtype))  # softmax - onehot
    if p.dtype == logits.dtype:
        return p.mul_(coef)  # (c, V)
    return torch.mul(p, coef, out=torch.empty(p.shape, dtype=logits.dtype, device=p.device))  # (c, V)


class _Chunk:
    """The head's per-chunk functions over (c, V): eager, or torch.compile'd by `compile_head` (--compile)."""

    logp, grad = staticmethod(chunk_logp), staticmethod(chunk_grad)


CHUNK = _Chunk()


def add_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, summed in acc's dtype (float32) whatever a's and b's (bfloat16 under autocast).

    Under autocast each chunk's g^T h used to be rounded to bfloat16 before the float32 sum (16 roundings a
    micro-batch at chunk 1024). Here the product is never rounded to bfloat16: on CUDA, torch.mm's out_dtype (cuBLAS:
    bfloat16 operands, float32 sum and output); where this torch has no such kernel (the CPU), the operands upcast to
    float32 (exactly: a product of two bfloat16s is exact in float32) and one float32 matmul, the same sum. Operands
    already in acc's dtype (float32 runs) take the product and add as before: the default run's floats."""
    with torch.autocast(acc.device.type, enabled=False):
        if a.dtype == acc.dtype:
            acc += a @ b
        elif a.device.type == "cuda" and acc.dtype == torch.float32:
            acc += torch.mm(a, b, out_dtype=torch.float32)
        else:
            acc += a.to(acc.dtype) @ b.to(acc.dtype)


class SelectedLogProb(torch.autograd.Function):
    """log softmax(z)[y] for M rows, z = truncate((h W^T + b) / tau), in row chunks, without keeping (M, V) logits.

    Forward keeps only the per-row log-sum-exp; backward recomputes each chunk's z (the same kept set: the same
    floats) and its softmax, 0 outside the kept set:
        d logp / d (h W^T + b) = (onehot(y) - softmax(z)) / tau.
    Peak extra memory is one (chunk, V) float32 block instead of (M, V).

    Under autocast the head's matmul runs in the autocast dtype (bfloat16 on CUDA) while `loss.backward()` runs
    outside autocast. The backward therefore re-enters the forward's autocast state (what `torch.amp.custom_bwd`
    does, for whichever device the tensors are on: custom_bwd fixes one device type when it decorates): its z is
    then the forward's, so softmax(z) matches the saved log-sum-exp, and its three (chunk, V) matmuls run in the
    dtype the forward's ran in, as autograd's own backward of the plain path would.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk, truncation=None):
        acc = torch.promote_types(weight.dtype, torch.float32)  # float32, or float64 in tests
        out = torch.empty(hidden.shape[0], dtype=acc, device=hidden.device)  # (M,)
        lse = torch.empty_like(out)  # (M,)
        compute = weight.dtype  # the dtype F.linear computes in: the autocast dtype under autocast
        for i in range(0, hidden.shape[0], chunk):
            logits = F.linear(hidden[i : i + chunk], weight, bias)  # (c, V)
            compute = logits.dtype
            out[i : i + chunk], lse[i : i + chunk] = CHUNK.logp(logits, targets[i : i + chunk], temperature, truncation)
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.temperature, ctx.chunk, ctx.truncation, ctx.compute = temperature, chunk, truncation, compute
        device = hidden.device.type
        ctx.autocast = dict(
            device_type=device, dtype=torch.get_autocast_dtype(device), enabled=torch.is_autocast_enabled(device)
        )
        return out

    @staticmethod
    def backward(ctx, grad_out):
        with torch.autocast(**ctx.autocast):
            return SelectedLogProb._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        tau, chunk, compute, acc = ctx.temperature, ctx.chunk, ctx.compute, lse.dtype
        grad_h = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if ctx.needs_input_grad[1] else None
        grad_b = None
        if bias is not None and ctx.needs_input_grad[2]:
            grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device)
        weight_c = weight.to(compute)  # (V, H) cast once, not per chunk
        coef = -(grad_out / tau)[:, None]  # (M, 1): d loss / d logits = (softmax - onehot) x coef
        for i in range(0, hidden.shape[0], chunk):
            h, y = hidden[i : i + chunk], targets[i : i + chunk]  # (c, H), (c,)
            logits = F.linear(h, weight, bias)  # (c, V) the forward's logits again
            g = CHUNK.grad(logits, y, lse[i : i + chunk], coef[i : i + chunk], tau, ctx.truncation)  # (c, V)
            if grad_h is not None:
                grad_h[i : i + chunk] = (g @ weight_c).to(hidden.dtype)  # (c, H)
            if grad_w is not None:
                add_product(grad_w, g.t(), h.to(compute))  # (V, H) += g^T h, summed in `acc`, never rounded
            if grad_b is not None:
                grad_b += g.sum(dim=0, dtype=acc)  # (V,)
        grad_w = grad_w.to(weight.dtype) if grad_w is not None else None
        grad_b = grad_b.to(bias.dtype) if grad_b is not None else None
        return grad_h, grad_w, grad_b, None, None, None, None


def has_plain_head(model) -> bool:
    """True when logits are exactly lm_head(last_hidden_state): no soft-capping or scaling."""
    head, cfg = model.get_output_embeddings(), model.config
    odd = getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", None)
    return isinstance(head, torch.nn.Linear) and not odd and hasattr(model, "get_decoder")


def checkpointed(model) -> bool:
    """True when transformers' gradient checkpointing is on (its attribute's name depends on the version)."""
    name = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") else None
    return bool(getattr(model, name or "is_gradient_checkpointing", False))


def completion_states(decoder, input_ids, attention_mask, pos, t: int) -> torch.Tensor:
    """The hidden states (N, T, H) that predict the T completion tokens. Adjacent rows with one prompt (a group)
    run it once, its KV cache indexed per row (differentiably): one plain pass's values and gradients, for less."""
    p = input_ids.shape[1] - t
    same = ((input_ids[1:, :p] == input_ids[:-1, :p]) & (attention_mask[1:, :p] == attention_mask[:-1, :p])).all(1)
    first = torch.cat([same.new_ones(1), ~same])  # (N,) the row starts a new prompt
    # Nothing shared, or gradient checkpointing (its layers keep no KV cache): one pass; state i predicts token i+1.
    if p == 0 or bool(first.all()) or (decoder.training and torch.is_grad_enabled() and checkpointed(decoder)):
        out = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos, use_cache=False)
        hidden = out.last_hidden_state  # (N, P+T, H)
        return hidden[:, p - 1 : p - 1 + t]  # (N, T, H): completion token j sits at P+j
    # The prompts' pass makes its own KV cache (the model's default, a DynamicCache), returned with the output.
    out = decoder(
        input_ids=input_ids[first, :p],
        attention_mask=attention_mask[first, :p],
        position_ids=pos[first, :p],
        use_cache=True,
    )
    last = out.last_hidden_state[:, -1:]  # (U, 1, H) U distinct prompts
    rows = first.long().cumsum(0) - 1  # (N,) each row's prompt
    cache = out[cache_kwarg(decoder)]
    cache.batch_select_indices(rows)  # (U, ...) -> (N, ...)
    rest = decoder(
        input_ids=input_ids[:, p:],
        attention_mask=attention_mask,
        position_ids=pos[:, p:],
        use_cache=True,
        **{cache_kwarg(decoder): cache},
    ).last_hidden_state  # (N, T, H)
    return torch.cat([last[rows], rest[:, :-1]], dim=1)  # (N, T, H)


def chunked_token_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float,
    truncation: Truncation | None = None,
    chunk: int = 1024,
) -> torch.Tensor:
    """`token_logprobs`, without building the (N, T, V) float32 logits: the LM head runs in row chunks over the
    scored tokens only (`SelectedLogProb`), and a group's G rows run their shared prompt once (`completion_states`).

    Args:
        input_ids, attention_mask: (N, P+T), prompts left-padded then completions right-padded.
        completion_mask: (N, T), 1 on the completion tokens to score; T is inferred from it.
        temperature: the sampling temperature (1.0 for the plain distribution).
        truncation: the sampler's top-k / top-p / min-p, renormalised over the kept set (None: the whole vocabulary).
        chunk: rows of the LM head evaluated at once.

    Returns:
        (N, T) float32 log-probs, 0 where completion_mask is 0. Differentiable when grad is on.
    """
    (n, length), t = input_ids.shape, completion_mask.shape[1]
    tau = temperature if temperature > 0 else 1.0
    truncation = truncation if temperature > 0 else None  # greedy scores the whole distribution (sampling_logits)
    pos = position_ids_from_mask(attention_mask)  # (N, P+T)
    sel = completion_mask.bool()  # (N, T)
    targets = input_ids[:, length - t :][sel]  # (M,) the scored tokens
    if has_plain_head(model):
        h = completion_states(model.get_decoder(), input_ids, attention_mask, pos, t)[sel]  # (M, H) scored rows only
        head = model.get_output_embeddings()
        token_logp = SelectedLogProb.apply(h, head.weight, head.bias, targets, tau, chunk, truncation)  # (M,)
    else:
        # Generic path (soft-capped or scaled heads): the model's own logits, only T+1 of them.
        logits = model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=pos, logits_to_keep=t + 1
        ).logits
        z = sampling_logits(logits[:, :-1][sel], tau, truncation, targets)  # (M, V) the sampler's z, one formula
        token_logp = z.gather(1, targets[:, None]).squeeze(1) - torch.logsumexp(z, dim=-1)  # (M,)
    out = torch.zeros(n, t, dtype=torch.float32, device=input_ids.device)  # (N, T)
    return out.masked_scatter(sel, token_logp)  # (N, T), differentiable w.r.t. token_logp
