"""The queue of batches drawn ahead, in bytes: what it holds at most, and a refusal of one that cannot fit.

queue_batch_bytes   the most bytes one batch in the queue (rollout.Sampled) holds
check_queue_fits    --lag s or --offpolicy-steps v whose queue would take more than half the free memory: refused
"""

import contextlib
import os

import torch

from config import Config, ConfigError
from engine.policy import available_bytes
from problems.tasks import render_prompt


def queue_batch_bytes(cfg: Config, prompt_len: int) -> int:
    """The most bytes one batch in the queue holds (rollout.Sampled), N = B x G rows, P = prompt_len (the longest
    prompt), T = --max-new-tokens: prompt_ids and prompt_mask (N, P) and completion_ids and completion_mask (N, T),
    int64 each; sampler_logp and entropy (N, T) float32 each; truncated (N,) bool; rewards (N,) float32; under
    --alpha-logp-from recompute, log alpha (N, T) float32 (under sampler it is sampler_logp itself):

        N x (16 P + 24 T + 5) bytes, + 4 N T with recompute.
    """
    n, t = cfg.prompts_per_step * cfg.group_size, cfg.max_new_tokens
    return n * (16 * prompt_len + 24 * t + 5) + (4 * n * t if cfg.alpha_logp_from == "recompute" else 0)


def check_queue_fits(cfg: Config, tokenizer, train_set, device: torch.device) -> None:
    """Refuse a queue that cannot fit: s + 1 batches (--lag s) or v (--offpolicy-steps v), at most --steps, each at most
    `queue_batch_bytes`, must take no more than half the memory free on the device now (the rest is sampling's and
    the update's). CUDA: what the driver and the allocator leave (engine.policy.available_bytes); a CPU: Linux's
    MemAvailable (os.sysconf's available pages elsewhere)."""
    held = min(cfg.lag + 1 if cfg.lag is not None else cfg.offpolicy_steps, cfg.steps)  # none past the last step
    if held == 1:
        return  # on-policy: the step's own batch, as any run holds
    per_batch = queue_batch_bytes(cfg, longest_prompt(tokenizer, train_set))
    free = available_bytes(device) if device.type == "cuda" else host_available_bytes()
    if held * per_batch > free / 2:
        flag = f"--lag {cfg.lag}" if cfg.lag is not None else f"--offpolicy-steps {cfg.offpolicy_steps}"
        raise ConfigError(
            f"{flag}: the queue of {held} batches drawn ahead needs {held * per_batch / 1e9:.3g} GB ({held} x "
            f"{per_batch / 1e6:.3g} MB), more than half the {free / 1e9:.3g} GB free on {device}; lower it, or "
            f"--prompts-per-step, --group-size, --max-new-tokens"
        )


def host_available_bytes() -> int:
    """The CPU memory a process can take now: Linux's MemAvailable, else the free pages os.sysconf reports."""
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def longest_prompt(tokenizer, problems) -> int:
    """The most tokens a rendered prompt of `problems` takes (P of a batch at most)."""
    texts = [render_prompt(tokenizer, p) for p in problems]
    return max(len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"])
