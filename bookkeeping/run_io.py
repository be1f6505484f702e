"""The run's output folder (--out): the folder is the run.

A new run refuses a folder that holds a run (`--resume` continues it, `--overwrite` starts over) or anything that
is not a run's, at any depth, before it writes anything; one process at a time writes a run (`claim_run_folder`: a
lock in the folder, released by the operating system when the process ends however it ends). The old run's files
go only in `RunWriter.open`, once everything that can refuse the new run has passed. docs/failure-modes.md has the
rules. The files:
    manifest.json   every path the run wrote, checkpoints with their sha256 (bookkeeping/manifest.py): what
                    --overwrite deletes, and nothing else
    config.json     the resolved Config, and how the prompts were written (`record`: prompt_template, ...)
    metrics.jsonl   one JSON object per step (docs/metrics.md)
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
Every JSON the run writes goes through `to_json`: a NaN or an infinity is written null, never as the `NaN` or
`Infinity` tokens that are not JSON.
A fresh run that stops before its first step (a bad model, bad data, a reward function that raises) leaves no run
behind (`RunWriter.discard_if_unstarted`): the same command works again, without --overwrite; so does a start
killed before its first step (kill -9), whose folder holds no checkpoint and no metrics row (`unstarted`).
config.json also records what the run was trained on (bookkeeping/fingerprints.py), which a resume checks.
"""

import configparser
import contextlib
import fcntl
import json
import math
import os
import resource
import secrets
import string
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

from bookkeeping.checkpoint import atomic_save_pretrained, checkpoint_dir, checkpoints, umask_mode
from bookkeeping.fingerprints import check_unchanged, fingerprints
from bookkeeping.manifest import LOCK, Manifest, remove, run_config, sort_out, the_run
from config import Config, ConfigError


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` via a temporary file and a rename; the file gets the user's umask. A write that fails
    (a full disk) removes the temporary file and raises an OSError naming `path`; the old file stays."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, umask_mode(0o666))  # mkstemp makes it 0600
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError) and not e.filename:  # a write to an open file names no file
            raise OSError(e.errno, e.strerror, str(path)) from None
        raise


def json_safe(value, digits: int | None = None):
    """`value` with every float that is not finite as None, inside dicts, lists and tuples too (JSON has no NaN
    nor infinity: Python would write the tokens NaN and Infinity, which JSON readers refuse); floats rounded to
    `digits` decimals when given."""
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        return value if digits is None else round(value, digits)
    if isinstance(value, dict):
        return {k: json_safe(v, digits) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v, digits) for v in value]
    return value


def to_json(value, *, digits: int | None = None, **kw) -> str:
    """The one way the run writes JSON (config.json, metrics.jsonl, completions.jsonl, summary.json, a
    checkpoint's JSON parts): `json_safe`, then allow_nan=False, so that a NaN that still slips through is an
    error where it is made rather than a file that is not JSON."""
    return json.dumps(json_safe(value, digits), allow_nan=False, **kw)


def shown(paths: list[str]) -> str:
    """Up to five paths, then how many more."""
    return ", ".join(paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")


def foreign_files(out: Path) -> list[str]:
    """The paths under `out`, at any depth, that its run did not write (bookkeeping/manifest.py): all of them in a
    folder that holds no run."""
    return sort_out(out, the_run(out))[1]


def refuse_foreign(out: Path, foreign: list[str]) -> None:
    if foreign:
        raise ConfigError(
            f"--out {out} holds files that are not a run's ({shown(foreign)}): nothing was deleted; move them, or "
            "choose another --out"
        )


DATA_FOLDERS = (("--dataset", "dataset"), ("--eval-files", "eval_files"), ("--data-files", "data_files"))


def refuse_out_in_data(cfg: Config) -> None:
    """--out inside a data folder is refused: the folder's loader (datasets) would read the run's own files
    (metrics.jsonl, completions.jsonl) as data, and a resume would find the data changed by the run itself."""
    out = Path(cfg.out).expanduser().resolve()
    for flag, name in DATA_FOLDERS:
        value = getattr(cfg, name, None)
        folder = Path(value).expanduser().resolve() if value else None
        if folder is not None and folder.is_dir() and (out == folder or folder in out.parents):
            raise ConfigError(
                f"--out {cfg.out} is inside {flag} {value}: its loader would read the run's files as data; "
                "choose an --out outside that folder"
            )


def has_metrics_row(out: Path) -> bool:
    """Whether metrics.jsonl holds one complete row: a step finished."""
    try:
        with open(out / "metrics.jsonl", errors="replace") as f:
            for line in f:
                with contextlib.suppress(json.JSONDecodeError):
                    if isinstance(json.loads(line), dict):
                        return True
    except OSError:
        pass
    return False


def unstarted(out: Path) -> bool:
    """A run folder whose run never finished a step: no checkpoint, no metrics row, no final model (a start killed
    before its first step, by kill -9 or a power cut, which `discard_if_unstarted` could not clean up). Nothing in
    it can be resumed, so a new run takes it over (its own files only: `claim_run_folder`)."""
    return not (checkpoints(str(out)) or has_metrics_row(out) or (out / "final").exists())


def check_fresh(out: Path, overwrite: bool) -> None:
    """A new run's folder must be absent, empty, hold a run that never finished a step, or (with --overwrite) hold
    a run and nothing else; raise ConfigError otherwise, naming the files in the way (at any depth) and what to do."""
    if not out.is_dir():
        return
    refuse_foreign(out, foreign_files(out))
    if overwrite or unstarted(out):
        return
    if run_config(out) is None:
        raise ConfigError(
            f"--out {out} holds a run whose config.json is missing or damaged, so --resume cannot continue it: "
            "--overwrite starts a new run there (deleting that run's files only), or choose another --out"
        )
    if not checkpoints(str(out)):
        raise ConfigError(
            f"--out {out} already holds a run, which saved no checkpoint to resume from (--save-every writes them): "
            "--overwrite starts it over"
        )
    raise ConfigError(f"--out {out} already holds a run: --resume continues it, --overwrite starts it over")


def check_resumable(out: Path) -> None:
    """--resume needs a checkpoint, and nothing of the user's in final/ (which the run's end replaces); without
    them, a ConfigError that says what to do (as check_fresh says for a new run on the same folder)."""
    refuse_foreign(out, [p for p in foreign_files(out) if p.startswith("final/")])
    if checkpoints(str(out)):
        return
    if unstarted(out):
        raise ConfigError(
            f"--resume: {out} holds a run that never finished a step (no checkpoint, no metrics row): nothing to "
            "resume; its command without --resume starts it again in the same folder"
        )
    raise ConfigError(
        f"--resume: no checkpoint in {checkpoint_dir(str(out))}: the run saved none (--save-every writes them); "
        "--overwrite starts it over"
    )


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
    it is closed or the process ends. Every refusal is a one-line ConfigError, and nothing but the lock is written
    (and --out made, when it did not exist)."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a folder")
    if (out / LOCK).is_file():  # first: a run being written is "in use", whatever else the folder holds
        take_lock(out).close()
    if resume:
        check_resumable(out)  # before the model loads: restore() would only find this out after it
    else:
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
    # An old run's files (--overwrite, a start that never finished a step) are deleted by RunWriter.open, once every
    # check that can refuse the new run has passed.
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


def peak_reserved_gb(device: torch.device) -> float:
    """Peak memory the caching allocator reserved (cuda: torch.cuda.max_memory_reserved, what an out-of-memory error
    is decided against, allocated blocks and cached ones), or the process's peak resident set (cpu, the same figure
    as peak_memory_gb: the host's allocator keeps no cache to tell apart), since the start or the last
    `reset_peak_memory`."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 1e9
    return peak_memory_gb(device)


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

    def __init__(self, cfg: Config, open_now: bool = True):
        """Claim --out (checks and the lock; nothing else written), then, unless `open_now` is False, `open` it."""
        self.cfg, self.out = cfg, Path(cfg.out)
        self.fresh, self.created, self.started, self.opened = not cfg.resume, not self.out.exists(), False, False
        refuse_out_in_data(cfg)
        check_report_to(cfg)  # its packages and wandb's key: before the model loads, and before an old run goes
        made_lock = not (self.out / LOCK).exists()
        self._lock = claim_run_folder(self.out, cfg.resume, cfg.overwrite)
        self._made_lock = made_lock
        self._tb = self._wandb = self._completions = None
        self._metrics = None
        # The run's manifest: for a resume the run's own (an old run's built from its files' names), which the
        # checkpoints' sha256 come from; a new run's is made by `open`.
        self.manifest = the_run(self.out) if cfg.resume else None
        if cfg.resume and self.manifest is None:
            self.close()
            config = self.out / "config.json"
            raise ConfigError(f"--resume: {config} is not a run's: {self.out} holds no run to continue")
        if open_now:
            self.open()

    def open(self, record: dict | None = None) -> None:
        """Start writing the run, once everything that can refuse it has run (the flags, --report-to, the model, the
        tokenizer, the data and their fit: train.train calls this after them): the last check (fingerprints on a
        resume), then a new run deletes the old run's files in --out (--overwrite, a
        start that never finished a step; never anything else) and writes its manifest, config.json (with `record`'s
        entries) and logs. A failure here leaves no run behind (`discard_if_unstarted`)."""
        cfg = self.cfg
        try:
            previous = read_json(self.out / "config.json") if cfg.resume else {}
            # What the run is trained on: recorded at the start, and a resume refuses a change (before any write).
            found = fingerprints(cfg)
            if cfg.resume:
                check_unchanged(previous.get("fingerprints"), found, self.out / "config.json", self.log)
            targets = cfg.report_to.split(",")
            if self.fresh:
                check_fresh(self.out, cfg.overwrite)  # again: the folder may have changed while the model loaded
                remove(self.out, [p for p in sort_out(self.out, the_run(self.out))[0] if p != LOCK])
                self.manifest = Manifest(self.out)
            self.manifest.save()  # an old run's, resumed, gets one now
            self.opened = True
            self._config, self._extra = asdict(cfg), {"fingerprints": found, **(record or {})}
            self.manifest.add_all(["config.json", "metrics.jsonl"] + ["completions.jsonl"] * bool(cfg.log_completions))
            self._write_config()
            # A fresh run starts fresh logs; a resumed one appends (after truncate_metrics).
            self._metrics = open(self.out / "metrics.jsonl", "a" if cfg.resume else "w")
            if cfg.log_completions:
                self._completions = open(self.out / "completions.jsonl", "ab" if cfg.resume else "wb", buffering=0)
            if "tensorboard" in targets:
                from torch.utils.tensorboard import SummaryWriter

                with self._owning("tensorboard"):  # its event file's name is TensorBoard's: listed once made
                    self._tb = SummaryWriter(str(self.out / "tensorboard"))
            if "wandb" in targets:
                with self._owning("wandb"):  # wandb's run folder, whole, and its links
                    self._wandb = start_wandb(cfg, self.out, previous.get("wandb_run_id"))
                self.record({"wandb_run_id": self._wandb.id})
        except BaseException:
            self.discard_if_unstarted()
            self.close()
            raise

    @contextlib.contextmanager
    def _owning(self, folder: str):
        """List in the manifest what another program makes in `folder` under names of its own: the files, and the
        folders (whole), that were not there before."""
        before = set(os.listdir(self.out / folder)) if (self.out / folder).is_dir() else set()
        try:
            yield
        finally:
            for name in sorted(set(os.listdir(self.out / folder)) - before if (self.out / folder).is_dir() else ()):
                path = self.out / folder / name
                if path.is_dir() and not path.is_symlink():
                    self.manifest.add_folder(f"{folder}/{name}")
                else:
                    self.manifest.add(f"{folder}/{name}")

    def end_passed(self) -> None:
        """A resume that runs further steps: summary.json describes an end the run now goes past, so it goes
        (the run's end writes the new one); final/ stays until then."""
        (self.out / "summary.json").unlink(missing_ok=True)
        self.manifest.drop("summary.json")

    def record(self, extra: dict) -> None:
        """Add entries to config.json beside the Config's fields (the prompts' template, the reward names, ...)."""
        self._extra.update(extra)
        self._write_config()

    def _write_config(self) -> None:
        atomic_write_text(self.out / "config.json", to_json({**self._config, **self._extra}, indent=2) + "\n")

    def log(self, msg: str) -> None:
        from tqdm import tqdm

        tqdm.write(msg)

    def metrics(self, row: dict) -> None:
        self.started = True
        append(self._metrics, self.out / "metrics.jsonl", to_json(row, digits=6) + "\n")
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
        data = "".join(to_json(r, digits=6, default=str) + "\n" for r in rows).encode()
        append(self._completions, self.out / "completions.jsonl", data)
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
        """On resume from the checkpoint after `step` steps: keep only what the run logged before it, so that
        nothing is logged twice. metrics.jsonl keeps the rows of steps before `step`; completions.jsonl the rows
        of those steps too, less the end evaluation's of a run that had ended there (step - 1, where the loop did
        not evaluate: the resume evaluates the end again). A torn last line (the process died while writing it) is
        dropped with a notice; a bad line before it is an error naming it."""
        self._metrics.close()
        path = self.out / "metrics.jsonl"
        kept = self._rows_before(path, step, per_row=1)
        atomic_write_text(path, "".join(to_json(row) + "\n" for row in kept))
        self._metrics = open(path, "a")
        path = self.out / "completions.jsonl"
        if path.is_file() and path.stat().st_size:
            if self._completions is not None:
                self._completions.close()
            evaluated = {row["step"] for row in kept if "eval_accuracy" in row}  # where the loop evaluated
            rows = [
                row
                for row in self._rows_before(path, step, per_row=0)
                if not (row.get("split") == "eval" and row["step"] == step - 1 and step - 1 not in evaluated)
            ]
            atomic_write_text(path, "".join(to_json(row, default=str) + "\n" for row in rows))
            if self._completions is not None:
                self._completions = open(path, "ab", buffering=0)

    def steps_logged(self) -> int:
        """The steps metrics.jsonl holds a row of (the last row's step, plus one); 0 without the file."""
        path = self.out / "metrics.jsonl"
        rows = self._rows_before(path, math.inf, per_row=1, quiet=True) if path.is_file() else []
        return rows[-1]["step"] + 1 if rows else 0

    def _rows_before(self, path: Path, step: float, per_row: int, quiet: bool = False) -> list[dict]:
        """The rows of `path` logged before step `step`. The run logs in step order, one metrics row a step
        (`per_row` 1) or several completions (0), so the step of a row whose "step" is not an int (a file
        written before a reward's metrics had a prefix of their own, where a function could log "step") is the
        step after (1) or of (0) the row before it; each row is returned with that step."""
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
        rows, last = [], -1  # the start's evaluation rows of completions.jsonl are step -1
        for i, line in enumerate(lines, start=1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                if i < len(lines):
                    raise ConfigError(f"{path}:{i}: not valid JSON; the run's {path.name} is damaged") from None
                if not quiet:
                    self.log(f"{path}:{i}: dropped a torn last line (the run was stopped while writing it)")
                continue
            if not isinstance(row, dict):
                raise ConfigError(f"{path}:{i}: not a JSON object; the run's {path.name} is damaged")
            k = row.get("step")
            last = k if isinstance(k, int) and not isinstance(k, bool) else last + per_row
            if last < step:
                rows.append({**row, "step": last})
        return rows

    def finish(self, model, tokenizer, summary: dict) -> None:
        self._close_logs()
        # final/ is replaced whole: a file of the user's put in it since the start stops the run first, named.
        refuse_foreign(self.out, [p for p in sort_out(self.out, self.manifest)[1] if p.startswith("final/")])
        atomic_save_pretrained(model, tokenizer, self.out / "final", lambda names: self.manifest.add_all(names))
        self.manifest.add_all(["summary.json", "curves.png"])
        atomic_write_text(self.out / "summary.json", to_json(summary, indent=2) + "\n")
        try:
            write_curves(self.out, summary)
        except ImportError:
            self.log("curves.png not drawn: matplotlib is not installed (pip install matplotlib)")
        self.close()

    def _close_logs(self, exit_code: int = 0) -> None:
        for f in (self._metrics, self._completions):
            if f is not None:
                # Every line was flushed as it was written (`append`); what is left unflushed is the line whose write
                # failed (a full disk), already raised with its file's name: closing must not raise it again.
                with contextlib.suppress(OSError):
                    f.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish(exit_code=exit_code)
            self._wandb = None

    def __enter__(self) -> "RunWriter":
        return self

    def __exit__(self, kind, error, traceback) -> None:
        """However the run ends the folder is free again (`close`); a start that fails before its first step
        leaves --out unclaimed (`discard_if_unstarted`)."""
        try:
            if error is not None:
                self.discard_if_unstarted()
        finally:
            self.close()

    def discard_if_unstarted(self) -> None:
        """A fresh run that has not finished a step yet (nothing to resume) leaves no run behind: the files it wrote
        go (its manifest's, never anything else), and so does --out if this run made it; the same command then works
        again without --overwrite. Before `open` it wrote nothing but the lock: an old run it was to replace stays."""
        if not self.fresh or self.started:
            return
        self._close_logs(exit_code=1)
        if self.opened:
            remove(self.out, [p for p in sort_out(self.out, self.manifest)[0] if p != LOCK])
        if self.opened or self._made_lock:
            with contextlib.suppress(OSError):
                (self.out / LOCK).unlink()  # still locked by us: another process that opened it cannot take it
        if self.created:
            with contextlib.suppress(OSError):
                self.out.rmdir()  # only if empty

    def close(self) -> None:
        """Release the run folder (the process's end releases it too, however it ends); closing twice is harmless."""
        self._close_logs()
        self._lock.close()


def append(f, path: Path, data) -> None:
    """Append `data` (str or bytes) to the open log `f` in whole and flush it; an OSError names `path` (a write to
    an open file names none, and a full disk must say which file it could not write)."""
    try:
        while data:  # a write to a regular file writes it all; the loop only guards against a short write
            data = data[f.write(data) :]
        f.flush()
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from None


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def start_wandb(cfg: Config, out: Path, run_id: str | None):
    """A Weights & Biases run for --report-to wandb: project $WANDB_PROJECT (default offpolicy-grpo), named after
    --out, its files in --out/wandb; a resumed run continues the same wandb run (its id is in config.json).

    Online, wandb needs an API key: without one it would prompt for it (or, with no terminal, raise from deep
    inside), so a run with no key and no offline mode stops here, before step 1, in one line that says how to go
    on; so does any other failure of wandb.init (a bad key, no network)."""
    wandb = check_wandb()
    offline = wandb_offline()
    (out / "wandb").mkdir(exist_ok=True)
    try:
        return wandb.init(
            project=os.environ.get("WANDB_PROJECT", "offpolicy-grpo"),
            name=out.name,
            id=run_id or "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8)),
            resume="allow",
            dir=str(out),
            config=asdict(cfg),
            settings=wandb.Settings(console="off"),
            # The mode read here, given explicitly: wandb keeps settings from an earlier call in the process (the
            # key check's login), which could otherwise override WANDB_MODE.
            mode=("disabled" if os.environ.get("WANDB_MODE", "").lower() == "disabled" else "offline")
            if offline
            else None,
        )
    except Exception as e:  # wandb's UsageError, CommError, AuthenticationError, ...: one line, exit 2
        text = str(e).strip()
        reason = text.splitlines()[0][:200] if text else type(e).__name__
        raise ConfigError(
            f"--report-to wandb: wandb.init failed ({type(e).__name__}: {reason}); WANDB_MODE=offline logs without "
            "the server"
        ) from None


def check_report_to(cfg: Config) -> None:
    """--report-to's packages importable, and wandb's key or offline mode found: else a one-line ConfigError."""
    targets = cfg.report_to.split(",")
    if "tensorboard" in targets:
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401
        except ImportError:
            raise ConfigError("--report-to tensorboard: install the tensorboard package first") from None
    if "wandb" in targets:
        check_wandb()


def check_wandb():
    """wandb, imported, with an API key or an offline mode: else a ConfigError that says how to go on."""
    try:
        import wandb
    except ImportError:
        raise ConfigError("--report-to wandb: install the wandb package first (pip install -e '.[wandb]')") from None
    if not wandb_offline() and not wandb_has_key(wandb):
        raise ConfigError(
            "--report-to wandb: no W&B API key: set WANDB_API_KEY, run `wandb login`, or log offline with "
            "WANDB_MODE=offline (wandb sync uploads the run later)"
        )
    return wandb


WANDB_OFFLINE = ("offline", "dryrun", "disabled")


def wandb_offline() -> bool:
    """Whether wandb runs without its server: WANDB_MODE (or WANDB_DISABLED), else the mode of wandb's settings
    file ($WANDB_CONFIG_DIR/settings, ~/.config/wandb/settings: `wandb offline` writes it)."""
    if os.environ.get("WANDB_DISABLED", "").lower() in ("true", "1", "yes"):
        return True
    mode = os.environ.get("WANDB_MODE")
    if mode is None:
        folder = os.environ.get("WANDB_CONFIG_DIR") or Path.home() / ".config" / "wandb"
        settings = configparser.ConfigParser()
        with contextlib.suppress(configparser.Error, OSError, UnicodeDecodeError):
            settings.read(Path(folder) / "settings")
        mode = settings.get("default", "mode", fallback="")
    return mode.strip().lower() in WANDB_OFFLINE


def wandb_has_key(wandb) -> bool:
    """Whether wandb finds an API key (WANDB_API_KEY, its settings, ~/.netrc), asked without a prompt and without
    the network; a key it finds malformed is a ConfigError naming it."""
    try:
        return bool(wandb.login(prompt=False, verify=False))
    except TypeError:  # an older wandb (no `prompt`): its own look-up, which does not prompt either
        return bool(os.environ.get("WANDB_API_KEY") or getattr(wandb.api, "api_key", None))
    except Exception as e:  # AuthenticationError: a key of the wrong form
        text = str(e).strip()
        reason = text.splitlines()[0][:200] if text else type(e).__name__
        raise ConfigError(f"--report-to wandb: {reason}; set a valid WANDB_API_KEY, or WANDB_MODE=offline") from None


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
            points = [(r["step"] + 1, r[key]) for r in rows if r.get(key) is not None]  # null: not finite
            if key == "eval_accuracy":
                # Evaluations run after a step; the start and end values come from summary.json.
                start = [] if summary["eval_accuracy_start"] is None else [(0, summary["eval_accuracy_start"])]
                end = [] if summary["eval_accuracy_end"] is None else [(summary["steps"], summary["eval_accuracy_end"])]
                points = [*start, *points, *end]
                ax.plot(*zip(*points), marker="o", label=key)
            elif points:
                ax.plot(*zip(*points), linewidth=0.8, label=key)
        ax.set(title=title, xlabel="step", ylabel=ylabel)
        ax.grid(alpha=0.3)
        if len(keys) > 1 and ax.get_legend_handles_labels()[0]:  # no legend for a panel with no line (opmd: no clip)
            ax.legend(fontsize=8)
    start, end = (
        f"{summary[k]:.3f}" if summary[k] is not None else "?" for k in ("eval_accuracy_start", "eval_accuracy_end")
    )
    fig.suptitle(f"{out.name}: held-out accuracy {start} -> {end}")
    path = out / "curves.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
