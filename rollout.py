"""Rollouts: sample G completions per prompt from the behaviour policy, and score tokens.

`generate` samples from the behaviour (stale) policy alpha with a KV cache, token by token,
from softmax(logits / temperature), with an explicit torch.Generator so that runs are
reproducible; `generate_batches` samples several steps' batches in as few calls as a row cap allows
(a refresh cycle's, step.py). `logprobs.token_logprobs` computes log pi(y_t | prompt, y_<t) for given
completions under any model, from logits / temperature, i.e. under the distribution that was sampled.

Layout of a batch (the convention every other file uses):
    prompt_ids   (N, P)  left-padded, so every prompt ends at column P-1
    completion   (N, T)  right-padded; a completion ends at its first EOS, which is kept
    input_ids    (N, P+T) = cat(prompt_ids, completion_ids)
    attention_mask (N, P+T) = cat(prompt_mask, completion_mask)
    completion_mask (N, T)  1 on completion tokens up to and including EOS
Position ids are computed from the attention mask (cumsum - 1), so a left-padded prompt sees
the same positions as the unpadded one.

Deviations from common practice:
  1. Log-probs never build the (N, T, V) float32 logits: `logprobs.SelectedLogProb` runs the LM head in
     row chunks, keeps only each row's log-sum-exp, and recomputes the chunk in backward.
  2. The sampler is our own loop rather than `model.generate`, so that it takes a generator,
     returns the sampled tokens' log-probs and entropies, and treats EOS uniformly.
  3. On CUDA, `generate` takes a fast path (gpt-fast's technique, in decoding.py): a static KV cache
     written in place, and the decode step captured once in a CUDA graph and replayed, so a step costs
     no Python per layer; it samples by the exponential race (exact, and no cumulative sum over V).
     The plain loop stays the CPU path and the reference; tests/test_fastpath.py checks they agree.
  4. A group's G rows share their prompt: sampling and `token_logprobs` run it once per group.
"""

from dataclasses import dataclass

import torch

from decoding import choose_decoder, sample_exponential_race


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


@dataclass
class Sampled:
    """One step's batch, drawn from alpha at its cycle's refresh (step.sample_cycle)."""

    rollout: Rollout
    rewards: torch.Tensor  # (N,)
    alpha_logp: torch.Tensor | None  # (N, T) log alpha; None: alpha = pi_k (the refresh step, --alpha-logp recompute)


@dataclass
class Cycle:
    """The batches of one refresh cycle: steps start, start + 1, ..., sampled at once from alpha = pi_theta of
    step `start` (step.py's module docstring). `times` holds the refresh's sampling, scoring and log-alpha seconds."""

    start: int
    batches: list[Sampled]
    times: dict

    def covers(self, step: int) -> bool:
        return self.start <= step < self.start + len(self.batches)

    def state(self) -> dict:
        """Plain tensors, ints and dicts: what a checkpoint stores (torch.load(weights_only=True) reads it)."""
        batches = [{"rollout": vars(b.rollout), "rewards": b.rewards, "alpha_logp": b.alpha_logp} for b in self.batches]
        return {"start": self.start, "batches": batches}

    @classmethod
    def from_state(cls, state: dict, device) -> "Cycle":
        to = lambda x: None if x is None else x.to(device)  # noqa: E731
        batches = [
            Sampled(Rollout(**{k: to(v) for k, v in b["rollout"].items()}), to(b["rewards"]), to(b["alpha_logp"]))
            for b in state["batches"]
        ]
        return cls(state["start"], batches, times={})


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
    n = ids.shape[0]
    dec, path = choose_decoder(model, n, ids.shape[1] + max_new_tokens, device, fast)
    plain = path == "plain"
    last = dec.prefill(model, prompt_ids, prompt_mask.long(), rows)  # (N, V) next-token logits, prompts run once
    # A diverged policy; train.py counts it as a non-finite step.
    if not torch.isfinite(last).all():
        raise FloatingPointError("generate: the sampler's logits are not finite")
    tokens, logps, ents = [], [], []
    alive = torch.ones(n, dtype=torch.bool, device=device)  # (N,) no EOS yet
    lengths = torch.zeros(n, dtype=torch.long, device=device)  # (N,) tokens kept so far
    for t in range(max_new_tokens):
        if t > 0:
            last = dec.decode(model, tokens[-1])  # (N, V)
        logits = last.float()  # (N, V) only the last position is needed
        if plain and t > 0 and not torch.isfinite(logits).all():  # multinomial would fail on NaN with a
            raise FloatingPointError("generate: the sampler's logits are not finite")  # bare RuntimeError
        if temperature > 0:
            logp_all = torch.log_softmax(logits / temperature, dim=-1)  # (N, V)
            probs = logp_all.exp()  # (N, V)
            nxt = (
                torch.multinomial(probs, 1, generator=generator).squeeze(1)
                if plain
                else sample_exponential_race(probs, generator)
            )  # (N,)
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
            # The fast path syncs with the host less often.
            if (plain or t % 16 == 15) and not alive.any():
                break

    # The step at which the last row ended (the fast path may have gone on)
    t = int(lengths.max())
    logps, ents = torch.stack(logps, dim=1)[:, :t], torch.stack(ents, dim=1)[:, :t]  # (N, T) each
    if not plain and not (torch.isfinite(logps).all() and torch.isfinite(ents).all()):  # the race picks a token
        raise FloatingPointError("generate: the sampler's logits are not finite")  # even from NaN logits
    completion_mask = (torch.arange(t, device=device).unsqueeze(0) < lengths.unsqueeze(1)).long()  # (N, T)
    return Rollout(
        prompt_ids=ids,
        prompt_mask=mask,
        completion_ids=torch.stack(tokens, dim=1)[:, :t],
        completion_mask=completion_mask,
        sampler_logp=logps,
        entropy=ents,
        truncated=alive,
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
    as `max_rows` rows per call allow (a call holds whole prompts, at least one): the stale policy's v
    batches of a refresh cycle, drawn at once. Rows keep their order: batch j's rows follow batch j - 1's."""
    width = max(ids.shape[1] for ids, _ in prompts)
    left = lambda x, v: torch.nn.functional.pad(x, (width - x.shape[1], 0), value=v)  # noqa: E731
    ids = torch.cat([left(i, pad_token_id) for i, _ in prompts])  # (sum B_j, P) left-padded
    mask = torch.cat([left(m, 0) for _, m in prompts])  # (sum B_j, P)
    per_call = max(1, max_rows // group_size)  # prompts per call
    parts = [
        generate(model, ids[s : s + per_call], mask[s : s + per_call], group_size=group_size,
                 pad_token_id=pad_token_id, **kw)
        for s in range(0, ids.shape[0], per_call)
    ]  # fmt: skip
    whole = cat_rollouts(parts, pad_token_id)
    out, start = [], 0
    for i, _ in prompts:
        n = i.shape[0] * group_size
        out.append(rollout_rows(whole, slice(start, start + n)))
        start += n
    return out
