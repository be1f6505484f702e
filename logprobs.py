"""Per-token log-probs of given completions under a causal LM, from logits / temperature, truncated as the sampler.

    Truncation, sampling_logits  the distribution the sampler draws from: logits / tau, cut to top-k / top-p / min-p
                             and renormalised over the tokens kept; every log-prob of the objective uses it
    token_logprobs           the textbook: log_softmax(sampling_logits).gather(y), what a reader copies
    chunked_token_logprobs   the same values, computed without the (N, T, V) float32 logits: an optimisation
                             for real vocabularies, tested equal to the textbook (tests/test_rollout.py)

The batch layout is rollout.py's:
    input_ids, attention_mask  (N, P+T)  prompts left-padded, then completions right-padded
    completion_mask            (N, T)    1 on the completion tokens to score (up to and including EOS)
Position ids come from the attention mask (cumsum - 1), so a left-padded prompt sees the positions of the
unpadded one. This file imports only torch (and the standard library): it can be copied alone.
"""

import inspect
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Truncation:
    """The sampler's kept set at each position (vLLM's and transformers' rules, on logits / temperature):

        top-k  the k most likely tokens                                      (0: off)
        top-p  then the most likely tokens until their mass reaches p,       (1: off)
               renormalised over top-k's set: a token is kept while the mass before it is < p
        min-p  then the tokens with probability >= min_p x the top token's   (0: off)

    Each cut is a threshold on the logit, so tokens tied at the edge are kept together: the set is a function
    of the logits alone, the same in the sampler and the trainer whatever order a sort leaves ties in.
    """

    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    @property
    def cuts(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


def kept_tokens(z: torch.Tensor, truncation: Truncation) -> torch.Tensor:
    """(..., V) bool: the tokens `truncation` keeps of the distribution softmax(z), z = logits / tau."""
    keep = torch.ones_like(z, dtype=torch.bool)
    if 0 < truncation.top_k < z.shape[-1]:
        kth = z.topk(truncation.top_k, dim=-1).values[..., -1:]  # (..., 1) the k-th largest logit
        keep &= z >= kth
    if truncation.top_p < 1.0:
        p = torch.softmax(z.masked_fill(~keep, -math.inf), dim=-1)  # (..., V) renormalised over top-k's set
        p_sorted = p.sort(dim=-1, descending=True).values  # (..., V)
        before = p_sorted.cumsum(dim=-1) - p_sorted  # (..., V) the mass of the tokens ranked above
        n_kept = (before < truncation.top_p).sum(dim=-1, keepdim=True)  # (..., 1) >= 1: the top token has 0 before
        keep &= p >= p_sorted.gather(-1, n_kept - 1)  # the smallest kept probability is the threshold
    if truncation.min_p > 0.0:
        # p / p_max >= min_p  <=>  z >= z_max + log(min_p): the same on any renormalisation of the set
        keep &= z >= z.amax(dim=-1, keepdim=True) + math.log(truncation.min_p)
    return keep


def truncate(z: torch.Tensor, truncation: Truncation | None, targets: torch.Tensor | None = None) -> torch.Tensor:
    """z (..., V) with -inf outside the kept set, so that log_softmax renormalises over the tokens kept.

    `targets` (...,) are kept whatever the rule says: a scored token that alpha sampled can fall just outside
    pi_theta's own set (docs/design.md, "Truncated sampling"). Without truncation z is returned as it is."""
    if truncation is None or not truncation.cuts:
        return z
    keep = kept_tokens(z, truncation)  # (..., V)
    if targets is not None:
        keep.scatter_(-1, targets.unsqueeze(-1), True)
    return z.masked_fill(~keep, -math.inf)


def sampling_logits(
    logits: torch.Tensor, temperature: float, truncation: Truncation | None = None, targets: torch.Tensor | None = None
) -> torch.Tensor:
    """z = logits / tau (float32, or float64 for float64 logits), -inf outside the kept set: log_softmax(z) is
    log alpha(. | prefix) of the distribution the sampler draws from. temperature 0 (greedy) is tau = 1, untruncated:
    the top token is in every kept set."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))  # (..., V)
    if temperature <= 0:
        return z / 1.0
    return truncate(z / temperature, truncation, targets)


def entropy_of(logp_all: torch.Tensor) -> torch.Tensor:
    """-sum_y p(y) log p(y) over the last dim; a token outside the kept set (log p = -inf) adds 0, not 0 x -inf."""
    return -(logp_all.exp() * logp_all.clamp(min=torch.finfo(logp_all.dtype).min)).sum(dim=-1)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding: the first real token is at position 0."""
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)  # (N, L)


def token_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float,
    truncation: Truncation | None = None,
) -> torch.Tensor:
    """log pi(y_t | prompt, y_<t) of each completion token under `model`, from the sampler's distribution (logits /
    temperature, truncated as it is and renormalised: `sampling_logits`): (N, T) float32, 0 where completion_mask is
    0, differentiable when grad is on. temperature 0 (greedy) scores at tau = 1."""
    t = completion_mask.shape[1]
    pos = position_ids_from_mask(attention_mask)  # (N, P+T)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos).logits  # (N, P+T, V)
    y = input_ids[:, -t:]  # (N, T)
    # position P+j-1 predicts completion token j
    z = sampling_logits(logits[:, -t - 1 : -1], temperature, truncation, targets=y)  # (N, T, V)
    logp = torch.log_softmax(z, dim=-1).gather(-1, y.unsqueeze(-1)).squeeze(-1)  # (N, T)
    return torch.where(completion_mask.bool(), logp, 0.0)  # (N, T)


# --- the optimisation: the same log-probs without the (N, T, V) logits ---------------------------------------


def forward_parameters(model):
    """The parameters of the model's forward; under a PEFT wrapper (LoRA, whose forward takes **kwargs), those of
    the transformers model it wraps and passes them on to."""
    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    return inspect.signature(model.forward).parameters


def cache_kwarg(model) -> str:
    """transformers renamed `past_key_values` to `cache` in 5.2x (argument and output); accept both."""
    return "cache" if "cache" in forward_parameters(model) else "past_key_values"


def last_logits_only(model) -> dict:
    """Ask for the last position's logits only: a prompt's forward would otherwise build (N, P, V) of them."""
    return {"logits_to_keep": 1} if "logits_to_keep" in forward_parameters(model) else {}


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
        for s in range(0, hidden.shape[0], chunk):
            logits = F.linear(hidden[s : s + chunk], weight, bias)  # (c, V)
            compute = logits.dtype
            z = truncate(logits.to(acc) / temperature, truncation, targets[s : s + chunk])  # (c, V)
            lse[s : s + chunk] = torch.logsumexp(z, dim=-1)
            out[s : s + chunk] = z.gather(1, targets[s : s + chunk, None]).squeeze(1) - lse[s : s + chunk]
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
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s : s + chunk]  # (c, H)
            z = truncate(F.linear(h, weight, bias).to(acc) / tau, ctx.truncation, targets[s : s + chunk])  # (c, V)
            g = -torch.exp(z - lse[s : s + chunk, None])  # (c, V) -softmax
            g.scatter_add_(1, targets[s : s + chunk, None], torch.ones_like(g[:, :1]))  # onehot - softmax
            g = (g * (grad_out[s : s + chunk, None] / tau)).to(compute)  # (c, V) d loss / d logits
            if grad_h is not None:
                grad_h[s : s + chunk] = (g @ weight_c).to(hidden.dtype)  # (c, H)
            if grad_w is not None:
                grad_w += g.t() @ h.to(compute)  # (V, H), summed over chunks in `acc`
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
        logp = SelectedLogProb.apply(h, head.weight, head.bias, targets, tau, chunk, truncation)  # (M,)
    else:
        # Generic path (soft-capped or scaled heads): the model's own logits, only T+1 of them.
        logits = model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=pos, logits_to_keep=t + 1
        ).logits
        z = truncate(logits[:, :-1][sel].float() / tau, truncation, targets)  # (M, V)
        logp = z.gather(1, targets[:, None]).squeeze(1) - torch.logsumexp(z, dim=-1)  # (M,)
    out = torch.zeros(n, t, dtype=torch.float32, device=input_ids.device)  # (N, T)
    return out.masked_scatter(sel, logp)  # (N, T), differentiable w.r.t. logp
