"""Per-token log-probs of given completions under a causal LM, from logits / temperature, truncated as the sampler.

    Truncation, sampling_logits  the distribution the sampler draws from: logits / tau, cut to top-k / top-p / min-p
                             and renormalised over the tokens kept; every log-prob of the objective uses it
    token_logprobs           the textbook: log_softmax(sampling_logits).gather(y), what a reader copies
    cache_kwarg, last_logits_only   what a model's forward is called with, across transformers versions

The loop computes the same values without the (N, T, V) float32 logits: chunked_logprobs.py, an optimisation for
real vocabularies, tested equal to `token_logprobs` (tests/test_rollout.py).

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
        return z
    # z / 1 is z: no pass over the vocabulary for the default temperature.
    return truncate(z if temperature == 1 else z / temperature, truncation, targets)


def entropy_of(logp_all: torch.Tensor, probs: torch.Tensor | None = None, kept_all: bool = False) -> torch.Tensor:
    """-sum_y p(y) log p(y) over the last dim, p = exp(logp_all) (`probs`, where the caller has it already).

    kept_all (nothing cut: every log p is finite): one dot product a row, a batched matmul in logp_all's dtype
    (autocast off: not in bfloat16), one pass over (rows, V). Otherwise a token outside the kept set has p = 0 and
    log p = -inf: 0 x -inf is NaN, which nansum counts as the 0 it is (a multiply and a sum: two passes)."""
    probs = logp_all.exp() if probs is None else probs
    if kept_all:
        with torch.autocast(logp_all.device.type, enabled=False):
            return -(probs.unsqueeze(-2) @ logp_all.unsqueeze(-1))[..., 0, 0]
    return -(probs * logp_all).nansum(dim=-1)


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
    token_logp = torch.log_softmax(z, dim=-1).gather(-1, y.unsqueeze(-1)).squeeze(-1)  # (N, T)
    return torch.where(completion_mask.bool(), token_logp, 0.0)  # (N, T)


# --- calling a model's forward across transformers versions ----------------------------------------------


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
