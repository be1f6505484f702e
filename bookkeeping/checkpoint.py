"""Checkpoints for exact resume: everything the next step depends on, written atomically.

A checkpoint holds the policy (its trainable weights: under LoRA the adapter alone), the queue of batches
drawn ahead (the unfinished refresh period's, with their rewards and log alpha, drawn from a policy the current
weights cannot reproduce), the reference pi_ref (when beta > 0), the optimizer, the step, every random state
(Python, numpy, torch, the sampling generator) and the data-order position.
Resuming from it and running to the end gives bit-for-bit the weights of the uninterrupted run on the
same machine (tests/test_robust.py shows it, killing a run inside a refresh period).

Files: `<out>/checkpoints/step-00000050.pt`. Each is written to a temporary name in the same
folder and renamed into place, so a crash mid-write leaves no file with the final name; only
names matching `step-*.pt` are ever loaded. Loading uses `torch.load(weights_only=True)`:
no pickled code is ever executed.

A write that fails (a full disk above all) removes its temporary file and raises one OSError naming the file
(`write_error`), whichever layer noticed: torch.save's stream writer raises RuntimeError, safetensors an error of
its own. The older checkpoints, and the previous final/, stay as they were; train.main prints the OSError as one
line and exits 2.
"""

import contextlib
import errno
import hashlib
import os
import random
import re
import shutil
import tempfile
from pathlib import Path

import torch

NAME = re.compile(r"^step-(\d{8})\.pt$")
# Every temporary name the run makes starts so (then its pid, then mkstemp's eight random characters): a name no user
# picks, so that a hidden file of the user's (.config.json.20251206) is never taken for one (bookkeeping/manifest.py).
TMP_PREFIX = ".tmp-offpolicy-grpo-"


def temporary_prefix() -> str:
    """The prefix of this process's temporary names (mkstemp and mkdtemp add eight random characters)."""
    return f"{TMP_PREFIX}{os.getpid()}-"


def umask_mode(mode: int) -> int:
    """`mode` under the process's umask: what open() would give a new file; mkstemp and mkdtemp give 0600 / 0700."""
    mask = os.umask(0)
    os.umask(mask)
    return mode & ~mask


def checkpoint_dir(out: str) -> Path:
    return Path(out) / "checkpoints"


def checkpoints(out: str) -> list[Path]:
    """The complete checkpoints in `out`, oldest first."""
    d = checkpoint_dir(out)
    return sorted(p for p in d.glob("step-*.pt") if NAME.match(p.name)) if d.is_dir() else []


def latest_checkpoint(out: str) -> Path | None:
    """The newest complete checkpoint in `out`, or None."""
    found = checkpoints(out)
    return found[-1] if found else None


def save_checkpoint(out: str, state: dict, step: int, keep: int, manifest=None) -> Path:
    """Atomically write `state` as the checkpoint after `step` steps; keep the newest `keep`.

    With the run's `manifest` (bookkeeping/manifest.py), the file is listed with the sha256 of its bytes, hashed as
    they are written, before it is renamed into place (a resume checks it: a file damaged since is never trusted);
    only checkpoints it lists are deleted as old ones (a file of the user's named like one is not ours to delete)."""
    d = checkpoint_dir(out)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"step-{step:08d}.pt"
    fd, tmp = tempfile.mkstemp(dir=d, prefix=temporary_prefix(), suffix=".pt")
    try:
        with os.fdopen(fd, "wb") as f:
            hashed = Hashing(f)
            torch.save(state, hashed)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name says "complete"
        os.chmod(tmp, umask_mode(0o666))
        if manifest is not None:
            manifest.add(f"checkpoints/{path.name}", hashed.sha256.hexdigest())
        os.replace(tmp, path)
    except BaseException as e:
        failed = write_error(e, path, "the checkpoint")  # before the unlink: a full disk is still full here
        Path(tmp).unlink(missing_ok=True)
        if failed is None:
            raise
        raise failed from None
    ours = [p for p in checkpoints(out) if manifest is None or manifest.owns(f"checkpoints/{p.name}")]
    for old in ours[:-keep]:
        old.unlink(missing_ok=True)
        if manifest is not None:
            manifest.drop(f"checkpoints/{old.name}")
    return path


class Hashing:
    """A file opened for writing that also hashes what is written to it (torch.save writes a stream: no re-read)."""

    def __init__(self, f):
        self.f, self.sha256 = f, hashlib.sha256()

    def write(self, data) -> int:
        self.sha256.update(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def file_sha256(path: Path) -> str:
    """The sha256 of a file's bytes, read a MiB at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def load_checkpoint(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def policy_state(policy) -> dict:
    """The weights a checkpoint keeps: every tensor, or under LoRA the adapter's alone (the base is frozen)."""
    if hasattr(policy, "peft_config"):
        from peft import get_peft_model_state_dict

        return get_peft_model_state_dict(policy)
    return policy.state_dict()


def load_policy_state(policy, state: dict) -> None:
    """policy_state's inverse; a LoRA checkpoint must hold every adapter weight of the policy."""
    if hasattr(policy, "peft_config"):
        from peft import set_peft_model_state_dict

        unexpected = set_peft_model_state_dict(policy, state).unexpected_keys
        missing = [k for k in policy_state(policy) if k not in state]
        if missing or unexpected:
            raise KeyError(f"the checkpoint does not match the LoRA adapter: missing {missing[:3]}")
        return
    policy.load_state_dict(state)


def rng_state(gen: torch.Generator) -> dict:
    """Every random state the run seeds (transformers.set_seed: Python's, numpy's, torch's CPU and CUDA) and the
    sampling generator: a reward function may draw from any of them, and a resumed run must draw what the
    uninterrupted one drew. numpy's state is kept as plain numbers (torch.load(weights_only=True) reads no arrays)."""
    version, internal, gauss = random.getstate()
    state = {"python": [version, list(internal), gauss], "torch": torch.get_rng_state(), "sampler": gen.get_state()}
    with contextlib.suppress(ImportError):
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [kind, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached)]
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict, gen: torch.Generator) -> None:
    """rng_state's inverse; a checkpoint from before numpy's state was kept leaves numpy's as it is."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    gen.set_state(state["sampler"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), float(cached)))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def atomic_save_pretrained(model, tokenizer, path: Path, listed=None) -> None:
    """save_pretrained into a temporary folder, then swap it into `path`. A write that fails removes the temporary
    folder and raises one OSError naming `path` (`write_error`); a previous `path` stays as it was. `listed`, given,
    gets the files' paths relative to path's parent ("final/model.safetensors") before the swap (the manifest)."""
    try:
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=temporary_prefix()))
    except OSError as e:
        raise write_error(e, path, "the final model") from None
    try:
        os.chmod(tmp, umask_mode(0o777))
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        for file in tmp.rglob("*"):  # some writers (safetensors) make their files 0600
            os.chmod(file, umask_mode(0o777 if file.is_dir() else 0o666))
        if listed is not None:
            listed(sorted(f"{path.name}/{f.relative_to(tmp).as_posix()}" for f in tmp.rglob("*") if f.is_file()))
        swap_into_place(tmp, path)
    except BaseException as e:
        failed = write_error(e, path, "the final model")
        shutil.rmtree(tmp, ignore_errors=True)
        if failed is None:
            raise
        raise failed from None


def swap_into_place(tmp: Path, path: Path) -> None:
    """Rename the folder `tmp` to `path`; a previous `path` goes, or comes back if the rename fails."""
    if path.is_symlink():  # the user's link: never renamed, never followed (the run refuses it before it starts)
        raise OSError(
            errno.EEXIST, "a link of the user's is in the run's place (kept; nothing written there)", str(path)
        )
    if not path.exists():
        os.replace(tmp, path)
        return
    old = Path(tempfile.mkdtemp(dir=path.parent, prefix=temporary_prefix()))
    os.replace(path, old)  # onto the empty folder just made: a name of our own, no user's
    try:
        os.replace(tmp, path)
    except BaseException:
        os.replace(old, path)
        raise
    shutil.rmtree(old, ignore_errors=True)


FULL_BELOW = 1 << 20  # bytes free: a write that failed with less than this left was a full disk


def write_error(e: BaseException, path: Path, what: str) -> OSError | None:
    """The OSError that names `path` for an error raised while writing it, or None when `e` is no write error (a
    bug, Ctrl-C: raised as it is). A full disk reaches us as an OSError (Python's write), a RuntimeError
    ("PytorchStreamWriter failed writing file ...": torch.save) or safetensors' SafetensorError; the errno is the
    OSError's where there is one in the chain, else ENOSPC when the disk is full now, else EIO."""
    if not isinstance(e, (OSError, RuntimeError)) and type(e).__name__ != "SafetensorError":
        return None
    cause, seen = e, set()
    while cause is not None and not isinstance(cause, OSError) and id(cause) not in seen:
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    detail = ""
    if isinstance(cause, OSError) and cause.errno:
        code = cause.errno
    else:
        code = errno.ENOSPC if disk_full(path.parent) else errno.EIO
        text = str(e).strip()
        detail = f" ({text.splitlines()[0][:160] if text else type(e).__name__})"
    return OSError(code, f"writing {what} failed: {os.strerror(code)}{detail}", str(path))


def disk_full(folder: Path) -> bool:
    try:
        st = os.statvfs(folder)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < FULL_BELOW
