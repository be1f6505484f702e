"""The run's output folder (--out): the folder is the run.

A new run refuses a folder that holds a run (`--resume` continues it, `--overwrite` starts over) or anything that
is not a run, before it writes anything; one process at a time writes a run (`claim_run_folder`: a lock in the
folder, released by the operating system when the process ends however it ends). docs/failure-modes.md has the
rules. The files:
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
import fcntl
import json
import os
import resource
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

from checkpoint import atomic_save_pretrained, umask_mode
from config import Config, ConfigError

LOCK = ".lock"  # holds the writer's pid; locked (flock) while it runs
RUN_FILES = ("config.json", "metrics.jsonl", "summary.json", "curves.png", "final", "checkpoints", "tensorboard")


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` via a temporary file and a rename; the file gets the user's umask."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, umask_mode(0o666))  # mkstemp makes it 0600
    os.replace(tmp, path)


def is_run(out: Path) -> bool:
    """True when the folder holds only what a run writes (and our temporary files), its config.json a run's."""
    names = [p.name for p in out.iterdir() if p.name != LOCK]
    if any(name not in RUN_FILES and not name.startswith(".") for name in names):
        return False
    try:
        config = json.loads((out / "config.json").read_text()) if (out / "config.json").exists() else {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(config, dict) and (not config or {"offpolicy_steps", "group_size"} <= config.keys())


def check_fresh(out: Path, overwrite: bool) -> None:
    """A new run's folder must be absent, empty, or (with --overwrite) hold a run; raise ConfigError otherwise."""
    if not out.is_dir():
        return
    names = sorted(p.name for p in out.iterdir() if p.name != LOCK)
    if not names:
        return
    if not is_run(out):
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        raise ConfigError(f"--out {out} holds files that are not a run's ({shown}): choose another folder")
    if not overwrite:
        raise ConfigError(f"--out {out} already holds a run: --resume continues it, --overwrite starts it over")


def take_lock(out: Path):
    """The run folder's lock, taken (flock, released when the file is closed or the process ends); a ConfigError
    naming the holder's pid when another process has it."""
    try:
        lock = open(out / LOCK, "a+")
    except OSError as e:
        raise ConfigError(f"--out {out} cannot be written ({e.strerror})") from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "unknown"
        lock.close()
        raise ConfigError(f"--out {out} is in use by another run (pid {holder}): wait for it, or choose another --out")
    return lock


def claim_run_folder(out: Path, resume: bool, overwrite: bool):
    """Create (or check) the run folder and take its lock; returns the lock's open file, which holds the lock until
    it is closed or the process ends. Every refusal is a one-line ConfigError, and nothing is written before it."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a folder")
    if (out / LOCK).is_file():  # first: a run being written is "in use", whatever else the folder holds
        take_lock(out).close()
    if not resume:
        check_fresh(out, overwrite)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--out {out} cannot be written ({e.strerror})") from None
    lock = take_lock(out)
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    if not resume:
        check_fresh(out, overwrite)  # again, now that no other process can write here
        for name in os.listdir(out):  # --overwrite: the old run's files, and nothing else
            path = out / name
            if name in RUN_FILES or (name.startswith(".") and name != LOCK):
                shutil.rmtree(path) if path.is_dir() else path.unlink()
    return lock


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
        self._lock = claim_run_folder(self.out, cfg.resume, cfg.overwrite)
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
        """On resume: keep only the rows of steps before `step`, so no step is logged twice. A torn last line (the
        process died while writing it) is dropped with a notice; a bad line before it is an error naming it."""
        self._metrics.close()
        path = self.out / "metrics.jsonl"
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
        rows = []
        for i, line in enumerate(lines, start=1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                if i < len(lines):
                    raise ConfigError(f"{path}:{i}: not valid JSON; the run's metrics are damaged") from None
                self.log(f"{path}:{i}: dropped a torn last line (the run was stopped while writing it)")
                continue
            if row["step"] < step:
                rows.append(line)
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
        self.close()

    def close(self) -> None:
        """Release the run folder (the process's end releases it too, however it ends); closing twice is harmless."""
        self._metrics.close()
        if self._tb is not None:
            self._tb.close()
        self._lock.close()


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
