"""Rollouts: G completions per prompt sampled from alpha, the stale policy, and the queue of batches drawn ahead.

`generate` samples with a KV cache, token by token, from softmax(logits / temperature), cut to the kept set of
--top-k / --top-p / --min-p and renormalised (logprobs.sampling_logits), with an explicit torch.Generator so that
runs are reproducible (`sample` is the loop, `next_token` its step). `generate_batches` samples the batches a step
draws ahead (a refresh's v, or a constant lag's next one) in as few calls as a row cap allows
(train.sample_ahead); a `Queue` holds them until their steps.

Layout of a batch (the convention every other file uses):
    prompt_ids      (N, P)    left-padded, so every prompt ends at column P-1
    completion_ids  (N, T)    right-padded; a completion ends at its first EOS, which is kept
    input_ids       (N, P+T)  = cat(prompt_ids, completion_ids)
    attention_mask  (N, P+T)  = cat(prompt_mask, completion_mask)
    completion_mask (N, T)    1 on completion tokens up to and including EOS
Position ids come from the attention mask (cumsum - 1), so a left-padded prompt sees the positions of the
unpadded one.

Deviations from common practice:
  1. The sampling loop is our own rather than `model.generate`, so that it takes a generator, returns the sampled
     tokens' log-probs and entropies, and treats EOS uniformly.
  2. A group's G rows share their prompt: it runs once per group, and its KV cache is fanned out to the G rows.
  3. `generate` runs the loop it is given: `sample`, the reference, by default; the loop passes decoding.py's
     static-KV-cache loop on CUDA (--sampling, train.sampling_loop), tested equal (tests/test_fastpath.py). Both take
     their tokens from `next_token`, so the math after the logits is written once; the static loop passes its own
     pick (the exponential race) and checks less often, each check being a host sync. This file
     imports torch and logprobs.py, and `sample` transformers' DynamicCache (the model's own KV cache) when it runs.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

# logprobs.py sits beside this file: a checkout imports it by name, a copy inside a package of its own relatively.
if __package__:
    from .logprobs import Truncation, cache_kwarg, entropy_of, last_logits_only, position_ids_from_mask, sampling_logits
else:
    from logprobs import Truncation, cache_kwarg, entropy_of, last_logits_only, position_ids_from_mask, sampling_logits


@dataclass
class Rollout:
    """What `generate` returns; every tensor is on the model's device."""

    prompt_ids: torch.Tensor  # (N, P) left-padded prompts, each repeated G times
    prompt_mask: torch.Tensor  # (N, P)
    completion_ids: torch.Tensor  # (N, T) sampled tokens, pad after EOS
    completion_mask: torch.Tensor  # (N, T) 1 up to and including EOS
    sampler_logp: torch.Tensor  # (N, T) log alpha(y_t) as the sampling loop computed it (0 where masked)
    entropy: torch.Tensor  # (N, T) entropy of alpha(. | prefix) at each sampled position
    truncated: torch.Tensor  # (N,) True if the completion hit max_new_tokens without EOS

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)  # (N, P+T)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask, self.completion_mask], dim=1)  # (N, P+T)


@dataclass
class Sampled:
    """One step's batch, drawn ahead from alpha = pi_theta as it stood at step `sampled_at` (train.sample_ahead)."""

    rollout: Rollout
    rewards: torch.Tensor  # (N,)
    # (N, T) log alpha: a forward of alpha when it sampled (--alpha-logp-from recompute) or the sampling loop's
    # record. None under recompute for a batch sampled at its own step: alpha is pi_k there, whose log-probs the
    # update's first forward gives (train.update).
    alpha_logp: torch.Tensor | None
    sampled_at: int  # the step whose weights (before its update) sampled this batch


@dataclass
class Queue:
    """The batches drawn ahead, one a step: those of steps start, start + 1, ..., end - 1, each with the step
    whose weights sampled it. One queue, two schedules fill it (train.steps_to_draw): a refresh every v
    steps, or a constant lag s. Checkpoints hold it: its batches came from weights the current ones cannot
    reproduce."""

    start: int
    batches: list[Sampled]

    @property
    def end(self) -> int:
        return self.start + len(self.batches)

    def covers(self, step: int) -> bool:
        return self.start <= step < self.end

    def from_step(self, step: int) -> "Queue":
        """The queue without the batches of the steps before `step`: those are used, and leave memory."""
        return Queue(step, self.batches[step - self.start :])

    def state(self) -> dict:
        """Plain tensors, ints and dicts: what a checkpoint stores (torch.load(weights_only=True) reads it)."""
        batches = [vars(b) | {"rollout": vars(b.rollout)} for b in self.batches]
        return {"start": self.start, "batches": batches}

    @classmethod
    def from_state(cls, state: dict, device) -> "Queue":
        """A checkpoint's queue (one from before the lag held a refresh period's batches: all sampled at its start)."""
        batches = [
            Sampled(
                rollout=Rollout(**{k: v.to(device) for k, v in b["rollout"].items()}),
                rewards=b["rewards"].to(device),
                alpha_logp=None if b["alpha_logp"] is None else b["alpha_logp"].to(device),
                sampled_at=b.get("sampled_at", state["start"]),
            )
            for b in state["batches"]
        ]
        return cls(state["start"], batches)


@torch.no_grad()
def generate(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    *,
    group_size: int,
    max_new_tokens: int,
    temperature: float,
    eos_token_id: int | list[int],
    pad_token_id: int,
    truncation: Truncation | None = None,
    generator: torch.Generator | None = None,
    ignore_eos: bool = False,
    loop: Callable[..., dict] | None = None,
) -> Rollout:
    """Sample `group_size` completions for each of B left-padded prompts from `model` (alpha).

    Args:
        prompt_ids, prompt_mask: (B, P) left-padded prompts.
        temperature: > 0 samples from softmax(logits / temperature); 0 decodes greedily.
        eos_token_id: the id, or the ids, that end a completion (`end_ids`: a model may end on several).
        truncation: top-k / top-p / min-p (logprobs.Truncation); the log-probs are renormalised over the kept set.
        generator: the torch.Generator used for sampling (on the model's device).
        ignore_eos: keep sampling past EOS (benchmarks, so every row has the same length).
        loop: the sampling loop, called as `sample` is and returning what it returns (None: `sample`, the
            reference; decoding.static_loop: the static KV cache, a CUDA graph on a GPU).

    Returns:
        A Rollout with N = B * group_size rows, ordered group-major.
    """
    rows = torch.arange(prompt_ids.shape[0], device=prompt_ids.device).repeat_interleave(group_size)  # (N,) prompt
    kw = dict(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        truncation=truncation,
        eos_token_id=torch.as_tensor(eos_token_id, device=prompt_ids.device),  # (1,) or (E,): made once, not a token
        pad_token_id=pad_token_id,
        generator=generator,
        ignore_eos=ignore_eos,
    )
    steps = (loop or sample)(model, prompt_ids, prompt_mask.long(), rows, **kw)
    return to_rollout(prompt_ids[rows], prompt_mask[rows].long(), **steps)


def sample(
    model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, rows: torch.Tensor, *, max_new_tokens: int, **step
) -> dict:
    """The sampling loop with transformers' KV cache (the reference): the B prompts (B, P) run once, each of the
    N rows takes its prompt's cache (`rows`: row -> prompt), then one token per row at a time (`next_token`; `step`
    is its keywords: temperature, truncation, eos_token_id, pad_token_id, generator, ignore_eos). Returns
    `to_rollout`'s per-step lists (tokens, token_logps, entropies: (N,) a step), the rows' lengths and `alive` (N,)."""
    from transformers import DynamicCache  # here, not at the top: importing transformers costs seconds (--help)

    n = rows.numel()
    pos = position_ids_from_mask(prompt_mask)  # (B, P)
    cache = {cache_kwarg(model): DynamicCache(), **last_logits_only(model)}  # filled in place by each forward
    out = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=pos, use_cache=True, **cache)
    cache[cache_kwarg(model)].batch_select_indices(rows)  # (B, ...) -> (N, ...): a group shares its prompt's cache
    attn, pos = prompt_mask[rows], pos[rows, -1:]  # (N, P), (N, 1)
    logits = out.logits[rows, -1, :]  # (N, V) the next token's
    tokens, token_logps, entropies = [], [], []
    alive = torch.ones(n, dtype=torch.bool, device=rows.device)  # (N,) no EOS yet
    lengths = torch.zeros(n, dtype=torch.long, device=rows.device)  # (N,) tokens kept so far
    for t in range(max_new_tokens):
        if t > 0:
            attn = torch.cat([attn, torch.ones_like(tokens[-1][:, None])], dim=1)  # (N, P+t)
            pos = pos + 1  # (N, 1)
            out = model(input_ids=tokens[-1][:, None], attention_mask=attn, position_ids=pos, use_cache=True, **cache)
            logits = out.logits[:, -1, :]  # (N, V)
        nxt, token_logp, entropy, alive, lengths = next_token(logits, alive, lengths, **step)
        tokens.append(nxt)
        token_logps.append(token_logp)
        entropies.append(entropy)
        if not step["ignore_eos"] and not alive.any():
            break
    return dict(tokens=tokens, token_logps=token_logps, entropies=entropies, lengths=lengths, alive=alive)


def sample_multinomial(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Row-wise index i with probability p_i, (N, V) -> (N,): the reference's draw."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def next_token(
    logits: torch.Tensor,
    alive: torch.Tensor,
    lengths: torch.Tensor,
    *,
    temperature: float,
    truncation: Truncation | None,
    eos_token_id: int | torch.Tensor,
    pad_token_id: int,
    generator: torch.Generator | None,
    ignore_eos: bool,
    pick: Callable[[torch.Tensor, torch.Generator | None], torch.Tensor] = sample_multinomial,
    check_finite: bool = True,
) -> tuple[torch.Tensor, ...]:
    """Every sampling loop's step, from the next-token logits (N, V): y_t ~ alpha(. | prefix), the softmax of
    sampling_logits (logits / temperature, cut to the kept set), picked by `pick(probs, generator)` (the
    argmax of the logits at temperature 0). `alive` and `lengths` (N,) are the rows' state before the step.

    Returns (token, token_logp, entropy, alive, lengths), each (N,): y_t (pad once a row has ended), log alpha(y_t) and
    the entropy of alpha (0 once a row has ended), then the state after the step: EOS (any of `eos_token_id`'s
    ids) is kept, and ends its row unless ignore_eos. check_finite=False leaves the check for non-finite logits
    to the caller (whose draw must then take them without failing: decoding.sample_static checks its log-probs
    once, after the loop)."""
    # A diverged policy (train.py counts it as a non-finite step), before multinomial fails on it.
    if check_finite and not torch.isfinite(logits).all():
        raise FloatingPointError("generate: the sampler's logits are not finite")
    # Float32 from here on: log alpha(y_t) is the IS ratio's denominator (--alpha-logp-from sampler).
    logp_all = torch.log_softmax(sampling_logits(logits, temperature, truncation), dim=-1)  # (N, V) log alpha
    probs = logp_all.exp()  # (N, V) alpha; a token outside the kept set has p = 0
    nxt = pick(probs, generator) if temperature > 0 else logits.argmax(dim=-1)  # (N,)
    # Nothing cut (temperature 0 scores the whole distribution): every log alpha is finite, the entropy one dot product.
    kept_all = temperature <= 0 or truncation is None or not truncation.cuts
    entropy = entropy_of(logp_all, probs, kept_all)  # (N,)
    nxt = torch.where(alive, nxt, torch.full_like(nxt, pad_token_id))  # (N,) pad after EOS
    token_logp = torch.where(alive, logp_all.gather(1, nxt.unsqueeze(1)).squeeze(1), torch.zeros_like(entropy))  # (N,)
    entropy = torch.where(alive, entropy, torch.zeros_like(entropy))  # (N,)
    lengths = lengths + alive.long()  # (N,)
    if not ignore_eos:
        alive = alive & ~torch.isin(nxt, eos_token_id)  # EOS itself was kept above
    return nxt, token_logp, entropy, alive, lengths


def end_ids(model, tokenizer) -> list[int]:
    """Every id that ends a completion: the tokenizer's EOS and each of the model's generation config, which may list
    several (Qwen2.5's chat models end on <|im_end|> and <|endoftext|>, Llama 3's on three)."""
    config = getattr(model, "generation_config", None)
    listed = getattr(config, "eos_token_id", None)
    listed = [] if listed is None else [listed] if isinstance(listed, int) else list(listed)
    return list(dict.fromkeys([tokenizer.eos_token_id, *listed]))


def to_rollout(prompt_ids, prompt_mask, *, tokens, token_logps, entropies, lengths, alive) -> Rollout:
    """A Rollout from a sampling loop's per-step lists, cut at the step the last row ended (a loop may go on)."""
    t = int(lengths.max())
    completion_mask = (torch.arange(t, device=lengths.device).unsqueeze(0) < lengths.unsqueeze(1)).long()  # (N, T)
    return Rollout(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=torch.stack(tokens, dim=1)[:, :t],  # (N, T)
        completion_mask=completion_mask,
        sampler_logp=torch.stack(token_logps, dim=1)[:, :t],  # (N, T)
        entropy=torch.stack(entropies, dim=1)[:, :t],  # (N, T)
        truncated=alive,  # (N,) no EOS by max_new_tokens
    )


def cat_rollouts(parts: list[Rollout], pad_token_id: int) -> Rollout:
    """Rollouts of separate `generate` calls as one, rows in order: prompts left-padded and completions
    right-padded to the widest (padding is masked, so no row's tokens or log-probs change)."""
    if len(parts) == 1:
        return parts[0]
    p = max(r.prompt_ids.shape[1] for r in parts)
    t = max(r.completion_ids.shape[1] for r in parts)

    def pad(x, width, value, left):
        gap = width - x.shape[1]
        return torch.nn.functional.pad(x, (gap, 0) if left else (0, gap), value=value)

    return Rollout(
        prompt_ids=torch.cat([pad(r.prompt_ids, p, pad_token_id, True) for r in parts]),  # (N, P)
        prompt_mask=torch.cat([pad(r.prompt_mask, p, 0, True) for r in parts]),  # (N, P)
        completion_ids=torch.cat([pad(r.completion_ids, t, pad_token_id, False) for r in parts]),  # (N, T)
        completion_mask=torch.cat([pad(r.completion_mask, t, 0, False) for r in parts]),  # (N, T)
        sampler_logp=torch.cat([pad(r.sampler_logp, t, 0.0, False) for r in parts]),  # (N, T)
        entropy=torch.cat([pad(r.entropy, t, 0.0, False) for r in parts]),  # (N, T)
        truncated=torch.cat([r.truncated for r in parts]),  # (N,)
    )


def rollout_rows(ro: Rollout, rows: slice) -> Rollout:
    """The rows `rows` of a rollout, without the columns that are padding in every one of them (prompt
    columns on the left, completion columns on the right): exactly what sampling those rows alone gives."""
    pm, cm = ro.prompt_mask[rows], ro.completion_mask[rows]  # (n, P), (n, T)
    first = int((pm.sum(0) > 0).long().argmax()) if pm.any() else pm.shape[1]  # first prompt column in use
    t = int(cm.sum(1).max()) if cm.numel() else 0  # the longest completion
    return Rollout(
        prompt_ids=ro.prompt_ids[rows, first:],
        prompt_mask=pm[:, first:],
        completion_ids=ro.completion_ids[rows, :t],
        completion_mask=cm[:, :t],
        sampler_logp=ro.sampler_logp[rows, :t],
        entropy=ro.entropy[rows, :t],
        truncated=ro.truncated[rows],
    )


def generate_batches(
    model, prompts: list[tuple[torch.Tensor, torch.Tensor]], *, group_size: int, max_rows: int, pad_token_id: int, **kw
) -> list[Rollout]:
    """One Rollout per batch of `prompts` ((B_j, P_j) ids and mask each), sampled in as few `generate` calls
    as `max_rows` rows per call allow (a call holds whole prompts, at least one): the batches a step draws
    ahead from the stale policy, at once. Rows keep their order: batch j's rows follow batch j - 1's."""
    width = max(ids.shape[1] for ids, _ in prompts)
    left = lambda x, v: torch.nn.functional.pad(x, (width - x.shape[1], 0), value=v)  # noqa: E731
    ids = torch.cat([left(i, pad_token_id) for i, _ in prompts])  # (sum B_j, P) left-padded
    mask = torch.cat([left(m, 0) for _, m in prompts])  # (sum B_j, P)
    per_call = max(1, max_rows // group_size)  # prompts per call
    parts = [
        generate(
            model, ids[i : i + per_call], mask[i : i + per_call], group_size=group_size, pad_token_id=pad_token_id, **kw
        )
        for i in range(0, ids.shape[0], per_call)
    ]
    whole = cat_rollouts(parts, pad_token_id)
    out, start = [], 0
    for i, _ in prompts:
        n = i.shape[0] * group_size
        out.append(rollout_rows(whole, slice(start, start + n)))
        start += n
    return out
