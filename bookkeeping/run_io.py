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
Everything is written to a temporary name first (`.tmp-offpolicy-grpo-<pid>-xxxxxxxx`, a name no user picks) and
renamed into place, so a crash never leaves a half-written file that looks complete, and nothing is written through
a link: a link in a run's place is the user's, named and kept. The two .jsonl logs are appended a whole line per
write and flushed, so a process killed (even with kill -9) leaves every line it wrote complete but possibly the last.
Every JSON the run writes goes through `to_json`: a NaN or an infinity is written null, never as the `NaN` or
`Infinity` tokens that are not JSON.
A fresh run that stops before its first step (a bad model, bad data, a reward function that raises) leaves no run
behind (`RunWriter.discard_if_unstarted`): the same command works again, without --overwrite; so does a start
killed before its first step (kill -9), whose folder holds no checkpoint and no metrics row (`unstarted`).
--overwrite sets the old run aside (`.offpolicy-grpo-set-aside/`, renames within --out) and deletes it only once the
new run has written its first metrics row; a failure before then puts it back whole, and so does the next start
after a kill -9 in between (`recover_set_aside`).
config.json also records what the run was trained on (bookkeeping/fingerprints.py), which a resume checks.
"""

import configparser
import contextlib
import errno
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

from bookkeeping.checkpoint import atomic_save_pretrained, checkpoint_dir, checkpoints, temporary_prefix, umask_mode
from bookkeeping.fingerprints import check_unchanged, fingerprints
from bookkeeping.manifest import (
    FOLDERS,
    LIBRARY_FOLDERS,
    LOCK,
    SET_ASIDE,
    TOP_FILES,
    Manifest,
    drop_set_aside,
    our_lock,
    put_back,
    remove,
    run_config,
    set_aside,
    set_aside_record,
    sort_out,
    the_run,
    walk,
    write_replacing,
)
from config import Config, ConfigError


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` via a temporary file and a rename; the file gets the user's umask. A write that fails
    (a full disk) removes the temporary file and raises an OSError naming `path`; the old file stays. A link at
    `path` is the user's: an OSError naming it, the link and what it points to untouched."""
    write_replacing(path, text)


def open_log(path: Path, mode: str):
    """One of the run's logs opened for appending ("a", "ab") or started empty ("w", "wb"), never through a link (a
    link there is the user's: an OSError naming it)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_APPEND if "a" in mode else os.O_TRUNC)
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as e:
        if path.is_symlink():
            raise OSError(errno.EEXIST, "a link of the user's is in the run's place (kept, not followed)", str(path))
        raise OSError(e.errno, e.strerror, str(path)) from None
    return os.fdopen(fd, mode, buffering=0) if "b" in mode else os.fdopen(fd, mode)


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


FOREIGN_NAMED = 1000  # a folder that holds no run: the first of its paths are named, the walk stops there


def foreign_files(out: Path) -> list[str]:
    """The paths under `out`, at any depth, that its run did not write (bookkeeping/manifest.py): all of them in a
    folder that holds no run (the first FOREIGN_NAMED)."""
    run = the_run(out)
    return sort_out(out, run, limit=None if run is not None else FOREIGN_NAMED)[1]


def refuse_foreign(out: Path, foreign: list[str]) -> None:
    if foreign:
        more = " and more" if len(foreign) >= FOREIGN_NAMED else ""
        raise ConfigError(
            f"--out {out} holds files that are not a run's ({shown(foreign)}{more}): nothing was deleted; move them, "
            "or choose another --out"
        )


def in_the_runs_way(rel: str) -> bool:
    """A path the run writes or replaces whatever it resumes: its top-level files, the lock, its folders themselves
    (a link there would be written through), and everything in final/ (replaced whole at the end)."""
    return rel.rstrip("/") in (LOCK, *TOP_FILES, *FOLDERS) or rel.startswith("final/")


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
    """--resume needs a checkpoint, and nothing of the user's where the run writes (`in_the_runs_way`: final/, which
    the run's end replaces, a link or a file of one's own named as a run's file); without them, a ConfigError that
    says what to do (as check_fresh says for a new run on the same folder)."""
    refuse_foreign(out, [p for p in foreign_files(out) if in_the_runs_way(p)])
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


def check_lock_file(out: Path) -> None:
    """A .lock that is not a run's (a link, a folder, a file of one's own that holds more than a pid) is the user's,
    for a new run, --overwrite and --resume alike: refused, named, untouched (a lock is never taken through it)."""
    path = out / LOCK
    if (path.exists() or path.is_symlink()) and not our_lock(path):
        what = "a link" if path.is_symlink() else "not a run's lock (a run's holds a pid)"
        raise ConfigError(
            f"--out {out} holds a {LOCK} that is {what}: it is yours, and nothing was changed; move it, or choose "
            "another --out"
        )


def take_lock(out: Path):
    """The run folder's lock, taken (flock, released when the file is closed or the process ends); a ConfigError
    naming the holder's pid when another process has it. The file is opened without following a link and without
    truncating it: only a lock of ours (empty, or a pid: `check_lock_file`) is rewritten, once it is held."""
    check_lock_file(out)
    try:
        fd = os.open(out / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as e:
        raise ConfigError(f"--out {out} cannot be written ({e.strerror}: {out / LOCK})") from None
    lock = os.fdopen(fd, "r+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "unknown"
        lock.close()
        raise ConfigError(f"--out {out} is in use by another run (pid {holder}): wait for it, or choose another --out")
    return lock


def write_pid(lock) -> None:
    """The holder's pid in the lock (a lock of ours: `check_lock_file` passed, and no other process holds it)."""
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")
    lock.flush()


def claim_run_folder(out: Path, resume: bool, overwrite: bool, log=print):
    """Create (or check) the run folder and take its lock; returns the lock's open file, which holds the lock until
    it is closed or the process ends. Every refusal is a one-line ConfigError, and nothing but the lock is written
    (and --out made, when it did not exist), except that an old run an --overwrite had set aside, left by a process
    killed before it could put it back or delete it, is put back or deleted first (`recover_set_aside`)."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a folder")
    if out.resolve() == Path(out.resolve().anchor):
        raise ConfigError(f"--out {out} is the file system's root: a run needs a folder of its own")
    if out.is_dir():
        check_lock_file(out)  # first: a .lock of the user's is theirs for every kind of start
    lock = None
    if (out / LOCK).is_file():  # first: a run being written is "in use", whatever else the folder holds
        lock = take_lock(out)
    if set_aside_record(out) is not None:
        lock = lock or take_lock(out)
        write_pid(lock)
        if recover_set_aside(out, log) and resume:
            lock.close()
            raise ConfigError(
                f"--resume: {out} held an old run an --overwrite had set aside, now put back (its new start was "
                "stopped before its first step); this --resume read the stopped start's config.json: run it again "
                "to continue the old run"
            )
    if lock is not None:
        lock.close()
    if resume:
        check_resumable(out)  # before the model loads: restore() would only find this out after it
    else:
        check_fresh(out, overwrite)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--out {out} cannot be written ({e.strerror})") from None
    lock = take_lock(out)
    write_pid(lock)
    if not resume:
        check_fresh(out, overwrite)  # again, now that no other process can write here
    # An old run's files (--overwrite, a start that never finished a step) are set aside by RunWriter.open, once every
    # check that can refuse the new run has passed, and deleted once the new run has written its first metrics row.
    return lock


def recover_set_aside(out: Path, log=print) -> bool:
    """An old run set aside by an --overwrite whose process was killed (kill -9, a power cut) before it could put it
    back or delete it: if the new run never finished a step, its files go and the old run comes back whole (True);
    if it did, the old run is deleted, as the --overwrite asked (False). Either way one line says which was which."""
    record = set_aside_record(out)
    aside = out / SET_ASIDE
    current = the_run(out)
    if current is not None and not unstarted(out):
        drop_set_aside(out)
        log(
            f"--out {out}: deleted the old run an --overwrite had set aside in {aside} (the new run, pid "
            f"{record['pid']}, had finished a step before it was stopped)"
        )
        return False
    if current is not None:
        remove(out, [p for p in sort_out(out, current)[0] if p != LOCK], current)
    in_place = [p for p in record["paths"] if (out / p.rstrip("/")).exists() or (out / p.rstrip("/")).is_symlink()]
    if in_place:
        raise ConfigError(
            f"--out {out} holds an old run an --overwrite set aside in {aside} (its new start, pid {record['pid']}, "
            f"was stopped before its first step), and files in its place ({shown(in_place)}): nothing was changed; "
            "move them, and the next start puts the old run back"
        )
    put_back(out)
    log(
        f"--out {out}: put back the old run an --overwrite had set aside (its new start, pid {record['pid']}, was "
        "stopped before its first step)"
    )
    return True


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
        self._lock = claim_run_folder(self.out, cfg.resume, cfg.overwrite, log=self.log)
        self._made_lock = made_lock
        self._tb = self._wandb = self._completions = None
        self._metrics = None
        self._set_aside = False  # an old run (--overwrite) set aside by `open`, until the first metrics row
        self._library_before: dict[str, set] = {}  # what was in tensorboard/ and wandb/ before the libraries wrote
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
                self.check_records()  # metrics.jsonl, completions.jsonl, summary.json: before anything is written
            targets = cfg.report_to.split(",")
            if self.fresh:
                check_fresh(self.out, cfg.overwrite)  # again: the folder may have changed while the model loaded
                old = the_run(self.out)
                ours, theirs = sort_out(self.out, old)
                ours = [p for p in ours if p != LOCK]
                if ours:  # the old run goes aside, whole, until this one has passed its first step
                    try:
                        set_aside(self.out, ours, theirs)
                    except OSError as e:
                        raise ConfigError(
                            f"--overwrite: the old run in {self.out} cannot be set aside ({e.strerror}: {e.filename}):"
                            " nothing of it was changed; make its folder writable, or choose another --out"
                        ) from None
                    self._set_aside = True
                self.manifest = Manifest(self.out)
            self.opened = True
            self.manifest.save()  # an old run's, resumed, gets one now
            self._config, self._extra = asdict(cfg), {"fingerprints": found, **(record or {})}
            self.manifest.add_all(["config.json", "metrics.jsonl"] + ["completions.jsonl"] * bool(cfg.log_completions))
            self._write_config()
            # A fresh run starts fresh logs; a resumed one appends (after truncate_metrics).
            self._metrics = open_log(self.out / "metrics.jsonl", "a" if cfg.resume else "w")
            if cfg.log_completions:
                self._completions = open_log(self.out / "completions.jsonl", "ab" if cfg.resume else "wb")
            for folder in LIBRARY_FOLDERS:  # what is there now is not the library's (this run's is listed already)
                if folder in targets:
                    self._library_before[folder] = {rel for rel, _ in walk_folder(self.out, folder)}
            if "tensorboard" in targets:
                from torch.utils.tensorboard import SummaryWriter

                self._own_folder("tensorboard")
                self._tb = SummaryWriter(str(self.out / "tensorboard"))
            if "wandb" in targets:
                self._own_folder("wandb")
                self._wandb = start_wandb(cfg, self.out, previous.get("wandb_run_id"))
                self.record({"wandb_run_id": self._wandb.id})
            self.list_library_files()
        except BaseException:
            self.discard_if_unstarted()
            self.close()
            raise

    def check_records(self) -> None:
        """A resume reads the run's records before it writes anything: metrics.jsonl and completions.jsonl (each line
        a JSON object, a torn last one aside) and summary.json (a JSON object); one that is damaged is a ConfigError
        naming the file and the line, and config.json has not been rewritten."""
        for name in ("metrics.jsonl", "completions.jsonl"):
            path = self.out / name
            if path.is_file() and not path.is_symlink():
                self._rows_before(path, math.inf, per_row=1 if name == "metrics.jsonl" else 0, quiet=True)
        path = self.out / "summary.json"
        if path.is_file() and not path.is_symlink():
            try:
                summary = json.loads(path.read_text())
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ConfigError(
                    f"--resume: {path}: not JSON ({str(e)[:80]}); the run's summary.json is damaged: "
                    "restore it, or remove it (the run's end writes it again)"
                ) from None
            if not isinstance(summary, dict):
                raise ConfigError(
                    f"--resume: {path}: a JSON {type(summary).__name__}, not an object; the run's "
                    "summary.json is damaged: restore it, or remove it (the run's end writes it again)"
                )

    def _own_folder(self, folder: str) -> None:
        """tensorboard/ or wandb/, made by the run when it is not there (a link there is refused before the start)."""
        path = self.out / folder
        if path.is_symlink():
            raise OSError(errno.EEXIST, "a link of the user's is in the run's place (kept, not followed)", str(path))
        if not path.is_dir():
            path.mkdir()
            self.manifest.add_found([(folder, "dir")])

    def list_library_files(self) -> None:
        """List in the manifest what TensorBoard and wandb wrote under names of their own: every file, link and
        folder in their folders that was not there when the run opened them. Called at the start, at each metrics
        row and when the run closes; whatever else is in those folders is the user's."""
        found = []
        for folder, before in self._library_before.items():
            for rel, kind in walk_folder(self.out, folder):
                if rel not in before and not (kind == "file" and rel in self.manifest.files):
                    found.append((rel, kind))
        if found and self.manifest is not None:
            self.manifest.add_found(found)

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
        append(self._metrics, self.out / "metrics.jsonl", to_json(row, digits=6) + "\n")
        self.started = True
        if self._set_aside:  # the new run has passed its first step: the old run it replaces goes now
            drop_set_aside(self.out)
            self._set_aside = False
        if self._library_before:
            self.list_library_files()
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
        self._metrics = open_log(path, "a")
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
                self._completions = open_log(path, "ab")

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
        # final/ is replaced whole: a file of the user's put in it since the start (or a link in its place) stops the
        # run first, named.
        refuse_foreign(self.out, [p for p in sort_out(self.out, self.manifest)[1] if in_the_runs_way(p)])
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
        if self._library_before and self.manifest is not None:
            with contextlib.suppress(OSError):  # a full disk: the files stay unlisted, so the user's (named, kept)
                self.list_library_files()

    def __enter__(self) -> "RunWriter":
        return self

    def __exit__(self, kind, error, traceback) -> None:
        """However the run ends the folder is free again (`close`); a start that fails before its first step
        leaves --out as it found it (`discard_if_unstarted`: an old run set aside by --overwrite comes back whole),
        and its error is one line, exit 2 (`unstarted_error`)."""
        unstarted_start = error is not None and self.fresh and not self.started
        try:
            if error is not None:
                self.discard_if_unstarted()
        finally:
            self.close()
        if unstarted_start:
            replaced = unstarted_error(error, self.out, self._put_back)
            if replaced is not None:
                raise replaced from None

    _put_back = False  # whether discard_if_unstarted put an old run back

    def discard_if_unstarted(self) -> None:
        """A fresh run that has not finished a step yet (nothing to resume) leaves no run behind: the files it wrote
        go (its manifest's, never anything else), an old run it set aside (--overwrite) comes back whole, and --out
        goes if this run made it; the same command then works again. Before `open` it wrote nothing but the lock: an
        old run it was to replace is still in place."""
        if not self.fresh or self.started:
            return
        self._close_logs(exit_code=1)
        if self.opened:
            remove(self.out, [p for p in sort_out(self.out, self.manifest)[0] if p != LOCK], self.manifest)
        if self._set_aside:
            put_back(self.out)
            self._set_aside, self._put_back = False, True
            self.log(f"--overwrite: the new run stopped before its first step; the old run is back in {self.out}")
        elif self.opened or self._made_lock:
            with contextlib.suppress(OSError):
                (self.out / LOCK).unlink()  # still locked by us: another process that opened it cannot take it
        if self.created:
            with contextlib.suppress(OSError):
                self.out.rmdir()  # only if empty

    def close(self) -> None:
        """Release the run folder (the process's end releases it too, however it ends); closing twice is harmless."""
        self._close_logs()
        self._lock.close()


def unstarted_error(error: BaseException, out: Path, put_back_: bool) -> ConfigError | None:
    """The one line of a new run that failed before its first step, where the error would not be one already (a
    model that loads but cannot run raises whatever it meets; a disk error would be followed by where an old run
    stands): a ConfigError (exit 2) saying what failed and what became of --out. None: the error is one line as it
    is (a ConfigError, a reward's error, a diverged run, out of memory, Ctrl-C)."""
    from bookkeeping.failures import Diverged

    if not isinstance(error, Exception) or isinstance(error, (ConfigError, Diverged, torch.OutOfMemoryError)):
        return None
    if type(error).__name__ in ("TaskError", "RewardError"):
        return None
    text = str(error).strip()
    reason = text.splitlines()[0][:200] if text else type(error).__name__
    if not isinstance(error, OSError):
        reason = f"{type(error).__name__}: {reason}"
    where = f"the old run is back in {out}, as it was" if put_back_ else f"nothing of it is left in {out}"
    return ConfigError(f"the new run failed before its first step ({reason}); {where}")


def walk_folder(out: Path, folder: str):
    """(relative path, "file" / "dir" / a link's target) of everything under out/folder."""
    if (out / folder).is_symlink() or not (out / folder).is_dir():
        return
    for rel, is_dir in walk(out / folder):
        path = out / folder / rel
        kind = os.readlink(path) if path.is_symlink() else "dir" if is_dir else "file"
        yield f"{folder}/{rel}", kind


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
    ("clip fractions", "fraction of the loss's tokens", ["clip_low", "clip_high"]),
    ("staleness", "rho' = pi_k / alpha", ["rho_prime_max", "rho_prime_p99", "rho_prime_mean"]),
    ("entropy", "nats per token", ["entropy"]),
]


def write_curves(out: Path, summary: dict) -> Path:
    """Draw metrics.jsonl as curves.png (needs matplotlib; ImportError otherwise), one panel per quantity."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = []
    for line in (out / "metrics.jsonl").read_text(errors="replace").splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            row = json.loads(line)
            if isinstance(row, dict) and isinstance(row.get("step"), int):
                rows.append(row)
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5), constrained_layout=True)
    for ax, (title, ylabel, keys) in zip(axes.flat, PANELS):
        for key in keys:
            points = [(r["step"] + 1, r[key]) for r in rows if number(r.get(key))]  # null: not finite
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
    fd, tmp = tempfile.mkstemp(dir=out, prefix=temporary_prefix(), suffix=".png")  # then renamed: never through a link
    try:
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, dpi=100, format="png")
        os.chmod(tmp, umask_mode(0o666))
        plt.close(fig)
        if path.is_symlink():
            raise OSError(errno.EEXIST, "a link of the user's is in the run's place (kept, not followed)", str(path))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
