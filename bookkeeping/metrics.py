"""What a step reports: its line of metrics.jsonl (docs/metrics.md), the progress bar, and the phase timers.

metrics_row     the step's line: rewards, lengths, entropy, the update's statistics, timings, memory
reward_metrics  the reward functions' own figures (accuracy, rewards/NAME, reward_none_frac, logged/NAME)
show            the key figures in the progress bar
Timer, clock    seconds per phase of a step, with CUDA's queued work counted where it ran
"""

import contextlib
import time

import torch

from bookkeeping.run_io import current_memory_gb, peak_memory_gb, peak_reserved_gb
from problems.user_rewards import LOGGED, Scores


def metrics_row(step: int, res, group_size: int, wall_s: float, step_s: float, device) -> dict:
    """The step's line of metrics.jsonl (docs/metrics.md); res: a train.StepResult."""
    # Means over the step's N samples or its completion tokens; the clip and rho' figures are the update's.
    ro, rewards = res.rollout, res.rewards
    groups = rewards.view(-1, group_size)  # (B, G)
    cm = ro.completion_mask.float()  # (N, T)
    n_tok = cm.sum().item()
    t = res.times
    return {
        "step": step,
        "wall_s": wall_s,
        "reward": rewards.mean().item(),
        # Without the step's Scores, the rule for rewards with no built-in verifier: the share of weighted rewards
        # > 0 (for the default run, `math` at weight 1, the share rewarded 1). reward_metrics, given the Scores,
        # replaces it with Scores.accuracy, the one definition (docs/metrics.md).
        "accuracy": (rewards > 0).float().mean().item(),
        "zero_std_frac": (groups.amax(1) == groups.amin(1)).float().mean().item(),
        "completion_len": cm.sum(1).mean().item(),
        "truncated_frac": ro.truncated.float().mean().item(),
        "entropy": (ro.entropy * cm).sum().item() / max(n_tok, 1),
        **res.stats,  # loss, clip fractions, rho', KL, sampler_mismatch: as the step computed them
        "t_sample": t["sample"],  # a refresh period's sampling is billed to its refresh step
        "t_score": t["score"],
        "t_logprob": t["logprob"],
        "t_update": t["update"],
        "tokens_per_s": n_tok / step_s,
        "peak_mem_gb": peak_memory_gb(device),
        "peak_reserved_gb": peak_reserved_gb(device),  # CUDA: what an out-of-memory is decided against
        "mem_gb": current_memory_gb(device),
    }


def reward_metrics(scores: Scores | None, names: list[str]) -> dict:
    """The step's accuracy (Scores.accuracy: the built-in verifier's share credited, else the share of weighted
    rewards > 0), rewards/NAME (each function's mean over the completions it scored), reward_none_frac and what the
    functions logged (log_metric) as logged/NAME: a prefix of their own, so no name a function picks can replace
    one of the row's figures."""
    if scores is None:
        return {}
    out = {"accuracy": scores.accuracy(names)}
    out.update({f"rewards/{k}": v for k, v in scores.means(names).items()})
    out["reward_none_frac"] = scores.none_frac()
    out.update({f"{LOGGED}{k}": v for k, v in scores.metrics.items()})
    return out


def show(bar, row: dict) -> None:
    """The key metrics in the progress bar's postfix, and the masked fractions of the masks the run has on."""
    masked = {f"{m}_masked": f"{row[f'{m}_masked_frac']:.3f}" for m in ("m2po", "opsm") if f"{m}_masked_frac" in row}
    bar.set_postfix(
        reward=f"{row['reward']:.2f}",
        acc=f"{row['accuracy']:.2f}",
        kl=f"{row.get('kl', 0):.3f}",
        clip=f"{row.get('clip_low', 0) + row.get('clip_high', 0):.3f}",
        rho_prime_max=f"{row.get('rho_prime_max', 1):.2f}",  # rho' = pi_k / alpha, not rho
        **masked,
        tok_s=f"{row['tokens_per_s']:.0f}",
    )


def clock(device) -> float:
    """time.time() once the device's queued work is done: CUDA runs asynchronously, so the phase timers would
    otherwise bill one phase's kernels to the next phase that waits for them."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.time()


class Timer:
    """Seconds per phase of a step, kept out of the maths: `with timer("sample"): ...` adds the block's time
    (`clock`) to seconds["sample"]."""

    def __init__(self, device):
        self.device = device
        self.seconds = dict.fromkeys(("sample", "score", "logprob", "update"), 0.0)

    @contextlib.contextmanager
    def __call__(self, phase: str):
        t = clock(self.device)
        try:
            yield
        finally:
            self.seconds[phase] += clock(self.device) - t


class StepStats:
    """The update's statistics: each micro-batch's figures (objective.loss_stats) averaged over the tokens of every
    micro-batch and inner step; the loss (the micro-batches' losses add up to the step's) and the gradient norm
    averaged over the inner steps; how many inner steps a non-finite gradient skipped."""

    def __init__(self):
        self.sums, self.tokens, self.loss, self.grad_norms, self.skipped = {}, 0.0, 0.0, [], 0

    def add(self, loss: torch.Tensor, stats: dict) -> None:
        w = stats.pop("tokens")
        self.tokens += w
        for key, value in stats.items():
            self.sums[key] = self.sums.get(key, 0.0) + value * w
        self.loss += loss.item()

    def optimizer_step(self, grad_norm: torch.Tensor) -> None:
        self.grad_norms.append(grad_norm.item())
        self.skipped += 0 if torch.isfinite(grad_norm) else 1

    def result(self, staleness: dict) -> dict:
        """The averages, then `staleness` (the whole step's rho' figures), the loss, grad_norm, nonfinite_updates."""
        out = {k: v / max(self.tokens, 1.0) for k, v in self.sums.items()}
        out.update(staleness)
        n = len(self.grad_norms)
        out.update(loss=self.loss / n, grad_norm=sum(self.grad_norms) / n, nonfinite_updates=self.skipped)
        return out
