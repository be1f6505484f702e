"""What a run reads and writes: the policy it starts from, and its output folder.

Output folder (--out):
    config.json     the resolved Config
    metrics.jsonl   one JSON object per step (README: "Metrics")
    final/          the trained policy and tokenizer, `save_pretrained` format
    summary.json    held-out accuracy before/after, steps, wall time
    curves.png      reward, held-out accuracy, KL, clip fractions, rho' and entropy over steps (with matplotlib)
    tensorboard/    the same scalars as TensorBoard event files (with --report-to tensorboard)
Everything is written to a temporary name first and renamed into place, so a crash never
leaves a half-written file that looks complete.
"""

import contextlib
import json
import os
import resource
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

from checkpoint import atomic_save_pretrained
from config import Config, ConfigError


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` via a temporary file and a rename."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def peak_memory_gb(device: torch.device) -> float:
    """Peak accelerator memory allocated (cuda) or peak resident memory of the process (cpu), since the start
    or the last `reset_peak_memory`."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    try:
        with open("/proc/self/status") as f:  # Linux: VmHWM, the resident high-water mark, in kB
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1e6
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # ru_maxrss is in KiB on Linux


def reset_peak_memory(device: torch.device) -> None:
    """Start peak_memory_gb afresh: CUDA's peak statistics, or Linux's resident high-water mark."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # "5" resets VmHWM to the current resident set (Linux >= 4.0)


def current_memory_gb(device: torch.device) -> float:
    """Memory in use now: allocated accelerator memory (cuda) or resident set size (cpu)."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 1e9
    with open("/proc/self/statm") as f:  # Linux: resident pages are the second field
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9


class RunWriter:
    """The run's output folder: config, per-step metrics, messages, final model, summary."""

    def __init__(self, cfg: Config):
        self.out = Path(cfg.out)
        self.out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.out / "config.json", json.dumps(asdict(cfg), indent=2) + "\n")
        # A fresh run starts a fresh log; a resumed one appends (after truncate_metrics).
        self._metrics = open(self.out / "metrics.jsonl", "a" if cfg.resume else "w")
        self._tb = None
        if cfg.report_to == "tensorboard":
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ConfigError("--report-to tensorboard: install the tensorboard package first") from None
            self._tb = SummaryWriter(str(self.out / "tensorboard"))

    def log(self, msg: str) -> None:
        from tqdm import tqdm

        tqdm.write(msg)

    def metrics(self, row: dict) -> None:
        self._metrics.write(json.dumps({k: round(v, 6) if isinstance(v, float) else v for k, v in row.items()}) + "\n")
        self._metrics.flush()
        if self._tb is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(f"grpo/{key}", value, row["step"])

    def truncate_metrics(self, step: int) -> None:
        """On resume: keep only the rows of steps before `step`, so no step is logged twice."""
        self._metrics.close()
        path = self.out / "metrics.jsonl"
        rows = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] < step]
        atomic_write_text(path, "".join(r + "\n" for r in rows))
        self._metrics = open(path, "a")

    def finish(self, model, tokenizer, summary: dict) -> None:
        self._metrics.close()
        if self._tb is not None:
            self._tb.close()
        atomic_save_pretrained(model, tokenizer, self.out / "final")
        atomic_write_text(self.out / "summary.json", json.dumps(summary, indent=2) + "\n")
        try:
            write_curves(self.out, summary)
        except ImportError:
            self.log("curves.png not drawn: matplotlib is not installed (pip install matplotlib)")


# One panel per quantity: (title, y label, metrics.jsonl keys drawn in it).
PANELS = [
    ("reward", "mean reward of the step's samples", ["reward"]),
    ("held-out accuracy", "greedy accuracy", ["eval_accuracy"]),
    ("KL to pi_ref", "mean k3 KL", ["kl"]),
    ("clip fractions", "fraction of valid tokens", ["clip_low", "clip_high"]),
    ("staleness", "rho' = pi_k / alpha", ["rho_prime_max", "rho_prime_p99", "rho_prime_mean"]),
    ("entropy", "nats per token", ["entropy"]),
]


def write_curves(out: Path, summary: dict) -> Path:
    """Draw metrics.jsonl as curves.png (needs matplotlib; ImportError otherwise), one panel per quantity."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5), constrained_layout=True)
    for ax, (title, ylabel, keys) in zip(axes.flat, PANELS):
        for key in keys:
            points = [(r["step"] + 1, r[key]) for r in rows if key in r]
            if key == "eval_accuracy":
                # Evaluations run after a step; the start and end values come from summary.json.
                start = [] if summary["eval_accuracy_start"] is None else [(0, summary["eval_accuracy_start"])]
                points = [*start, *points, (summary["steps"], summary["eval_accuracy_end"])]
                ax.plot(*zip(*points), marker="o", label=key)
            elif points:
                ax.plot(*zip(*points), linewidth=0.8, label=key)
        ax.set(title=title, xlabel="step", ylabel=ylabel)
        ax.grid(alpha=0.3)
        if len(keys) > 1 and ax.get_legend_handles_labels()[0]:  # no legend for a panel with no line (opmd: no clip)
            ax.legend(fontsize=8)
    start = "?" if summary["eval_accuracy_start"] is None else f"{summary['eval_accuracy_start']:.3f}"
    fig.suptitle(f"{out.name}: held-out accuracy {start} -> {summary['eval_accuracy_end']:.3f}")
    path = out / "curves.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
