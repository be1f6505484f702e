"""Where a sampled token's time goes and what the LM head's log-probs cost, at a run's shapes (bench --token-timings).

Milliseconds per decode step of all N = B x G rows (one token each), under the run's autocast, each the median of
several timed calls after an untimed one:

    chain            rollout.next_token on (N, V) logits in the forward's dtype, with the static path's pick (the
                     exponential race) and no finiteness check: the per-token math after the logits
    chain_textbook   the same step written by its definitions (tests/test_sampling_chain.py's textbook_step): z / tau,
                     log_softmax, softmax, the race as p / (-log U), the entropy over the kept set; the truncation
                     mask only where --top-k / --top-p / --min-p cut, as a user would write it (a mask that keeps
                     every token is a pass over (N, V) that ours skips: it would flatter ours)
    decode_step      the static decoder's decode step alone (engine/decoding.py): a CUDA graph's replay on a GPU, an
                     eager forward on the CPU
    static_call      a whole sample_static call (prefill, decode steps, chain) over its tokens
    plain_loop       a whole rollout.sample call, the reference loop, over its tokens
    generate         transformers' model.generate on the same prompts (min_new_tokens = max_new_tokens)

and the LM head's log-probs of M scored tokens, forward and backward, in milliseconds per 1,000 tokens:

    head             engine.chunked_logprobs.SelectedLogProb (the loop's), on the run's chunk of rows
    head_textbook    F.linear to the full (M, V) logits, log_softmax, gather, autograd's backward (the truncation mask
                     likewise only where it cuts)

Each call samples `tokens` new tokens (every row runs to the end: ignore_eos) from B prompts of --prompt-len.
"""

import math
import statistics

import torch
import torch.nn.functional as F

from bookkeeping.metrics import clock
from engine.chunked_logprobs import SelectedLogProb
from engine.decoding import sample_exponential_race, static_decoder, static_loop, transformers_model
from engine.policy import autocast
from logprobs import kept_tokens
from rollout import generate, next_token

KEYS = ("chain", "chain_textbook", "decode_step", "static_call", "plain_loop", "generate")


def median_ms(fn, repeats: int, device) -> float:
    """The median wall time of fn() in milliseconds, after one untimed call (allocator, kernels, a graph's capture)."""
    fn()
    times = []
    for _ in range(repeats):
        t = clock(device)
        fn()
        times.append(clock(device) - t)
    return 1e3 * statistics.median(times)


def textbook_chain(logits, cfg, generator):
    """The per-token step by its definitions: what `rollout.next_token` computes in fewer passes."""
    z = logits.float() / cfg.temperature
    if cfg.truncation is not None and cfg.truncation.cuts:
        z = z.masked_fill(~kept_tokens(z, cfg.truncation), -math.inf)
    logp_all = torch.log_softmax(z, dim=-1)
    p = torch.softmax(z, dim=-1)
    token = (p / -torch.rand(p.shape, generator=generator, device=p.device).log()).argmax(dim=-1)
    entropy = -torch.where(p > 0, p * logp_all, torch.zeros_like(p)).sum(-1)
    return token, logp_all.gather(1, token[:, None]), entropy


@torch.no_grad()
def token_timings(cfg, model, tok, prompt_ids: torch.Tensor, tokens: int = 32, repeats: int = 3) -> dict:
    """ms per decode step (the module docstring's rows) for B prompts (B, P), G = cfg.group_size rows each."""
    device = prompt_ids.device
    mask = torch.ones_like(prompt_ids)
    n = prompt_ids.shape[0] * cfg.group_size
    generator = torch.Generator(device=device).manual_seed(cfg.seed)
    kw = dict(
        group_size=cfg.group_size,
        max_new_tokens=tokens,
        temperature=cfg.temperature,
        truncation=cfg.truncation,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        generator=generator,
        ignore_eos=True,
    )
    was_training = model.training
    model.eval()
    out = {}
    with autocast(cfg, device):
        # (N, V) logits of the dtype the forward gives (bfloat16 under autocast): the chain's input.
        dtype = model.get_output_embeddings().weight.dtype
        if torch.is_autocast_enabled(device.type):
            dtype = torch.get_autocast_dtype(device.type)
        logits = torch.randn(n, model.config.vocab_size, device=device, generator=generator).mul_(3).to(dtype)
        alive, lengths = torch.ones(n, dtype=torch.bool, device=device), torch.zeros(n, dtype=torch.long, device=device)
        eos = torch.tensor([tok.eos_token_id], device=device)
        step = dict(temperature=cfg.temperature, truncation=cfg.truncation, eos_token_id=eos, pad_token_id=0)
        out["chain"] = median_ms(
            lambda: next_token(
                logits,
                alive,
                lengths,
                **step,
                generator=generator,
                ignore_eos=True,
                pick=sample_exponential_race,
                check_finite=False,
            ),
            10 * repeats,
            device,
        )
        out["chain_textbook"] = median_ms(lambda: textbook_chain(logits, cfg, generator), 10 * repeats, device)

        # The decoder the static path keeps for these shapes: prefill once, then time its decode steps alone.
        dec = static_decoder(model, n, prompt_ids.shape[1] + tokens, device)
        rows = torch.arange(prompt_ids.shape[0], device=device).repeat_interleave(cfg.group_size)
        dec.prefill(model, prompt_ids, mask, rows)
        last = torch.zeros(n, dtype=torch.long, device=device)
        steps = min(tokens, 8)  # its cache holds prompt + tokens columns: a decode step writes one

        def decode_steps():
            dec.prefill(model, prompt_ids, mask, rows)
            t = clock(device)
            for _ in range(steps):
                dec.decode(model, last)
            return clock(device) - t

        decode_steps()  # on CUDA: the graph's capture
        out["decode_step"] = 1e3 * statistics.median(decode_steps() for _ in range(repeats)) / steps

        fast = static_loop(True)
        out["static_call"] = median_ms(lambda: generate(model, prompt_ids, mask, loop=fast, **kw), repeats, device)
        out["plain_loop"] = median_ms(lambda: generate(model, prompt_ids, mask, **kw), repeats, device)
        out["generate"] = median_ms(
            lambda: transformers_model(model).generate(
                prompt_ids,
                attention_mask=mask,
                do_sample=True,
                temperature=cfg.temperature,
                top_k=0,
                num_return_sequences=cfg.group_size,
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                pad_token_id=tok.pad_token_id,
            ),
            repeats,
            device,
        )
    for key in ("static_call", "plain_loop", "generate"):
        out[key] /= tokens
    model.train(was_training)
    return out


def head_timings(cfg, model, rows: int, chunk: int = 1024, repeats: int = 3) -> dict:
    """ms per 1,000 scored tokens of the LM head's log-probs, forward and backward, the loop's against the textbook's,
    on `rows` random hidden states (the head's cost does not depend on their values)."""
    head = model.get_output_embeddings()
    device = head.weight.device
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    hidden = torch.randn(rows, head.weight.shape[1], device=device, generator=gen).requires_grad_(True)
    targets = torch.randint(0, head.weight.shape[0], (rows,), device=device, generator=gen)
    tau = cfg.temperature

    def ours():
        with autocast(cfg, device):
            logp = SelectedLogProb.apply(hidden, head.weight, head.bias, targets, tau, chunk, cfg.truncation)
        logp.sum().backward()

    def textbook():
        with autocast(cfg, device):
            z = F.linear(hidden, head.weight, head.bias).float() / tau
            if cfg.truncation is not None and cfg.truncation.cuts:
                keep = kept_tokens(z, cfg.truncation)
                keep[torch.arange(rows, device=device), targets] = True
                z = z.masked_fill(~keep, -math.inf)
            logp = torch.log_softmax(z, dim=-1).gather(1, targets[:, None])
        logp.sum().backward()

    out = {
        name: median_ms(fn, repeats, device) * 1000 / rows for name, fn in (("head", ours), ("head_textbook", textbook))
    }
    head.weight.grad = None
    if head.bias is not None:
        head.bias.grad = None
    return out
