"""The run's output folder (--out): the folder is the run.

A new run refuses a folder that holds a run (`--resume` continues it, `--overwrite` starts over) or anything that
is not a run, before it writes anything; one process at a time writes a run (`claim_run_folder`: a lock in the
folder, released by the operating system when the process ends however it ends). docs/failure-modes.md has the
rules. The files:
    config.json     the resolved Config, and how the prompts were written (`record`: prompt_template, ...)
    metrics.jsonl   one JSON object per step (README: "Metrics")
    completions.jsonl  with --log-completions N: N sampled completions a step and the held-out ones, a JSON
                    object each (prompt, completion, rewards, advantage), appended and flushed like metrics.jsonl
    final/          the trained policy and tokenizer, `save_pretrained` format
    summary.json    held-out accuracy before/after, steps, wall time
    curves.png      reward, held-out accuracy, KL, clip fractions, rho' and entropy over steps (with matplotlib)
    tensorboard/    the same scalars as TensorBoard event files (with --report-to tensorboard), completions as text
    wandb/          the same scalars as a Weights & Biases run (with --report-to wandb; WANDB_MODE=offline works)
Everything is written to a temporary name first and renamed into place, so a crash never
leaves a half-written file that looks complete; the two .jsonl logs are appended a whole line per write and
flushed, so a process killed (even with kill -9) leaves every line it wrote complete but possibly the last.
A fresh run that stops before its first step (a bad model, bad data, a reward function that raises) leaves no run
behind (`RunWriter.discard_if_unstarted`): the same command works again, without --overwrite.
"""

import contextlib
import fcntl
import json
import os
import resource
import secrets
import shutil
import string
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

from bookkeeping.checkpoint import atomic_save_pretrained, umask_mode
from config import Config, ConfigError

LOCK = ".lock"  # holds the writer's pid; locked (flock) while it runs
RUN_FILES = (
    "config.json",
    "metrics.jsonl",
    "completions.jsonl",
    "summary.json",
    "curves.png",
    "final",
    "checkpoints",
    "tensorboard",
    "wandb",
)


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
    """The run's output folder: config, per-step metrics, completions, messages, final model, summary; and the
    scalars again to TensorBoard and Weights & Biases (--report-to)."""

    def __init__(self, cfg: Config):
        self.out = Path(cfg.out)
        self.fresh, self.created, self.started = not cfg.resume, not self.out.exists(), False
        self._lock = claim_run_folder(self.out, cfg.resume, cfg.overwrite)
        self._tb = self._wandb = self._completions = None
        self._metrics = None
        try:
            self._open(cfg)
        except BaseException:
            self.discard_if_unstarted()
            self.close()
            raise

    def _open(self, cfg: Config) -> None:
        previous = read_json(self.out / "config.json") if cfg.resume else {}
        self._config, self._extra = asdict(cfg), {}
        atomic_write_text(self.out / "config.json", json.dumps(self._config, indent=2) + "\n")
        # A fresh run starts fresh logs; a resumed one appends (after truncate_metrics).
        self._metrics = open(self.out / "metrics.jsonl", "a" if cfg.resume else "w")
        if cfg.log_completions:
            self._completions = open(self.out / "completions.jsonl", "ab" if cfg.resume else "wb", buffering=0)
        targets = cfg.report_to.split(",")
        if "tensorboard" in targets:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ConfigError("--report-to tensorboard: install the tensorboard package first") from None
            self._tb = SummaryWriter(str(self.out / "tensorboard"))
        if "wandb" in targets:
            self._wandb = start_wandb(cfg, self.out, previous.get("wandb_run_id"))
            self.record({"wandb_run_id": self._wandb.id})

    def record(self, extra: dict) -> None:
        """Add entries to config.json beside the Config's fields (the prompts' template, the reward names, ...)."""
        self._extra.update(extra)
        atomic_write_text(self.out / "config.json", json.dumps({**self._config, **self._extra}, indent=2) + "\n")

    def log(self, msg: str) -> None:
        from tqdm import tqdm

        tqdm.write(msg)

    def metrics(self, row: dict) -> None:
        self.started = True
        self._metrics.write(json.dumps({k: round(v, 6) if isinstance(v, float) else v for k, v in row.items()}) + "\n")
        self._metrics.flush()
        scalars = {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float)) and v is not None}
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(f"grpo/{key}", value, row["step"])
        if self._wandb is not None:
            self._wandb.log({f"grpo/{k}": v for k, v in scalars.items()}, step=row["step"])

    def completions(self, rows: list[dict]) -> None:
        """Append rows to completions.jsonl in one write (whole lines); with TensorBoard also as a text table per
        split and step, with wandb as a table."""
        if not rows or self._completions is None:
            return
        data = "".join(json.dumps(rounded(r), default=str) + "\n" for r in rows).encode()
        while data:  # a write to a regular file writes it all; the loop only guards against a short write
            data = data[self._completions.write(data) :]
        step, split = max(rows[0]["step"], 0), rows[0]["split"]
        if self._tb is not None:
            self._tb.add_text(f"completions/{split}", markdown_table(rows), step)
        if self._wandb is not None:
            import wandb

            columns = list(dict.fromkeys(k for r in rows for k in r))
            data = [
                [json.dumps(r.get(c), default=str) if isinstance(r.get(c), dict) else r.get(c) for c in columns]
                for r in rows
            ]
            self._wandb.log({f"completions/{split}": wandb.Table(columns=columns, data=data)}, step=step)

    def truncate_metrics(self, step: int) -> None:
        """On resume: keep only the rows of steps before `step` (metrics.jsonl and completions.jsonl), so no step is
        logged twice. A torn last line (the process died while writing it) is dropped with a notice; a bad line
        before it is an error naming it."""
        self._metrics.close()
        path = self.out / "metrics.jsonl"
        atomic_write_text(path, "".join(r + "\n" for r in self._rows_before(path, step)))
        self._metrics = open(path, "a")
        path = self.out / "completions.jsonl"
        if self._completions is not None and path.stat().st_size:
            self._completions.close()
            atomic_write_text(path, "".join(r + "\n" for r in self._rows_before(path, step)))
            self._completions = open(path, "ab", buffering=0)

    def _rows_before(self, path: Path, step: int) -> list[str]:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
        rows = []
        for i, line in enumerate(lines, start=1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                if i < len(lines):
                    raise ConfigError(f"{path}:{i}: not valid JSON; the run's {path.name} is damaged") from None
                self.log(f"{path}:{i}: dropped a torn last line (the run was stopped while writing it)")
                continue
            if row["step"] < step:
                rows.append(line)
        return rows

    def finish(self, model, tokenizer, summary: dict) -> None:
        self._close_logs()
        atomic_save_pretrained(model, tokenizer, self.out / "final")
        atomic_write_text(self.out / "summary.json", json.dumps(summary, indent=2) + "\n")
        try:
            write_curves(self.out, summary)
        except ImportError:
            self.log("curves.png not drawn: matplotlib is not installed (pip install matplotlib)")
        self.close()

    def _close_logs(self, exit_code: int = 0) -> None:
        for f in (self._metrics, self._completions):
            if f is not None:
                f.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish(exit_code=exit_code)
            self._wandb = None

    def discard_if_unstarted(self) -> None:
        """A fresh run that has not finished a step yet (nothing to resume) leaves no run behind: its files go,
        and so does --out if this run made it; the same command then works again without --overwrite."""
        if not self.fresh or self.started:
            return
        self._close_logs(exit_code=1)
        for name in RUN_FILES:
            path = self.out / name
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            elif path.exists():
                path.unlink()
        with contextlib.suppress(OSError):
            (self.out / LOCK).unlink()  # still locked by us: another process that opened it cannot take it
        if self.created:
            with contextlib.suppress(OSError):
                self.out.rmdir()  # only if empty

    def close(self) -> None:
        """Release the run folder (the process's end releases it too, however it ends); closing twice is harmless."""
        self._close_logs()
        self._lock.close()


def rounded(value):
    """Floats to 6 decimals (metrics.jsonl's rounding), inside dicts too: a float32 reward 0.975 reads 0.975."""
    if isinstance(value, float):
        return round(value, 6)
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    return value


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def start_wandb(cfg: Config, out: Path, run_id: str | None):
    """A Weights & Biases run for --report-to wandb: project $WANDB_PROJECT (default offpolicy-grpo), named after
    --out, its files in --out/wandb; a resumed run continues the same wandb run (its id is in config.json)."""
    try:
        import wandb
    except ImportError:
        raise ConfigError("--report-to wandb: install the wandb package first (pip install -e '.[wandb]')") from None
    (out / "wandb").mkdir(exist_ok=True)
    return wandb.init(
        project=os.environ.get("WANDB_PROJECT", "offpolicy-grpo"),
        name=out.name,
        id=run_id or "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8)),
        resume="allow",
        dir=str(out),
        config=asdict(cfg),
        settings=wandb.Settings(console="off"),
    )


def markdown_table(rows: list[dict]) -> str:
    """Rows as a Markdown table (TensorBoard's text panel renders it), each cell on one line."""
    columns = list(dict.fromkeys(k for r in rows for k in r))
    cell = lambda v: json.dumps(v, default=str) if isinstance(v, (dict, list)) else str(v)  # noqa: E731
    clean = lambda v: cell(v).replace("|", "\\|").replace("\n", "<br>")  # noqa: E731
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(clean(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


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
