"""What in the run folder is the run's: manifest.json, the list of every path the run wrote.

`--out` and `--overwrite` delete, and a resume replaces, only what a run wrote; anything else under --out, hidden or
not, at any depth (a file of one's own in checkpoints/, tensorboard/, wandb/ or final/), is the user's: a new run
refuses the folder naming it, and nothing is deleted (run_io.check_fresh).

manifest.json lists, relative to --out:
    files     each file the run wrote ("config.json", "checkpoints/step-00000002.pt", "final/model.safetensors"),
              with the sha256 of a checkpoint's file (written with it, checked by a resume: bookkeeping/resume.py)
    folders   a folder another program filled under a fresh name of its own (wandb's run folder): all of it
An entry is added before its file is written, so that a run stopped at any point (kill -9) leaves no file of its
own unlisted, our temporary names aside (`TEMPORARY`: mkstemp's eight random characters after the file's name).

A folder is a run when it holds a manifest.json of ours, or, for a run written before manifests were kept, a
config.json of a run (`run_config`). Such an old run's files are those named exactly as a run names them (`LEGACY`):
the top-level files, checkpoints/step-NNNNNNNN.pt, the files save_pretrained writes in final/, TensorBoard's event
files in tensorboard/, and in wandb/ its links and the run folders of the run's own wandb id; a resume writes the
manifest from them. Any other folder is no run: every file in it is the user's.
"""

import contextlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from bookkeeping.checkpoint import umask_mode

MANIFEST = "manifest.json"
WRITTEN_BY = "offpolicy-grpo train.py"  # what tells our manifest.json from another program's file of that name
LOCK = ".lock"  # holds the writer's pid; locked (flock) while it runs
FOLDERS = ("checkpoints", "final", "tensorboard", "wandb")  # the folders a run makes in --out
TOP_FILES = ("config.json", "metrics.jsonl", "completions.jsonl", "summary.json", "curves.png", MANIFEST)
# Our temporary names, left behind only by a process that died while writing: atomic_write_text's and the manifest's
# (.NAME.xxxxxxxx), final/'s (.final.xxxxxxxx, .final.old) and a checkpoint's (checkpoints/.tmp-xxxxxxxx.pt).
_RANDOM = r"[a-z0-9_]{8}"
_TOP = "|".join(re.escape(n) for n in TOP_FILES)
TEMPORARY = re.compile(rf"^\.(?:{_TOP}|final)\.{_RANDOM}$|^\.final\.old$|^checkpoints/\.tmp-{_RANDOM}\.pt$")
# A run's files as a run from before manifests named them (save_pretrained's names for final/, with a LoRA adapter's).
_SAVED = (
    r"(?:config|generation_config|tokenizer|tokenizer_config|special_tokens_map|added_tokens|adapter_config"
    r"|model\.safetensors\.index|chat_template|preprocessor_config)\.json|vocab\.(?:json|txt)|merges\.txt"
    r"|tokenizer\.model|chat_template\.jinja|(?:adapter_)?model\.safetensors|model-\d{5}-of-\d{5}\.safetensors"
    r"|README\.md"
)
LEGACY = re.compile(
    rf"^(?:{'|'.join(re.escape(n) for n in TOP_FILES if n != MANIFEST)}|checkpoints/step-\d{{8}}\.pt|final/(?:{_SAVED})"
    r"|tensorboard/events\.out\.tfevents\.[^/]+|wandb/(?:latest-run|debug\.log|debug-internal\.log))$"
)


def run_config(out: Path) -> dict | None:
    """--out/config.json when it is a run's (a JSON object with the run's fields), else None."""
    try:
        config = json.loads((out / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return config if isinstance(config, dict) and {"offpolicy_steps", "group_size"} <= config.keys() else None


def our_lock(path: Path) -> bool:
    """A .lock file as a run leaves it: empty, or its writer's pid. Another program's .lock is not ours."""
    try:
        return path.is_file() and not path.is_symlink() and re.fullmatch(rb"\d*\n?", path.read_bytes()) is not None
    except OSError:
        return False


class Manifest:
    """manifest.json of the run in `out`: `files` (relative path -> the sha256 recorded for it, or None) and
    `folders` (relative paths owned whole). `add`, `add_folder` and `drop` write it at once, atomically."""

    def __init__(self, out: Path, files: dict | None = None, folders=()):
        self.out, self.files, self.folders = Path(out), dict(files or {}), set(folders)

    @classmethod
    def load(cls, out: Path) -> "Manifest | None":
        """The manifest in `out`; None when there is none, or the file is not ours (then it is the user's)."""
        try:
            data = json.loads((Path(out) / MANIFEST).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return None
        if not (isinstance(data, dict) and data.get("written_by") == WRITTEN_BY):
            return None
        files = data.get("files") if isinstance(data.get("files"), dict) else {}
        folders = data.get("folders") if isinstance(data.get("folders"), list) else []
        return cls(out, {str(k): v if isinstance(v, str) else None for k, v in files.items()}, map(str, folders))

    @classmethod
    def legacy(cls, out: Path) -> "Manifest":
        """The manifest of a run written before manifests were kept: its files named as a run names them (LEGACY),
        and wandb's run folders of the run's own id (config.json's wandb_run_id)."""
        manifest = cls(out)
        wandb_id = (run_config(Path(out)) or {}).get("wandb_run_id")
        wandb_run = re.compile(rf"^wandb/(?:offline-)?run-\d{{8}}_\d{{6}}-{re.escape(str(wandb_id))}$")
        for rel, is_dir in walk(Path(out)):
            if is_dir and wandb_id and wandb_run.match(rel):
                manifest.folders.add(rel)
            elif not is_dir and LEGACY.match(rel):
                manifest.files[rel] = None
        return manifest

    def owns(self, rel: str) -> bool:
        return rel in self.files or any(rel == f or rel.startswith(f + "/") for f in self.folders)

    def add(self, rel: str, sha256: str | None = None) -> None:
        """List `rel` (before its file is written), with its sha256 where one is known."""
        if self.files.get(rel, "absent") != sha256:
            self.files[rel] = sha256
            self.save()

    def add_all(self, rels) -> None:
        """List every path of `rels` (no sha256), in one write."""
        new = [rel for rel in rels if rel not in self.files]
        if new:
            self.files.update(dict.fromkeys(new))
            self.save()

    def add_folder(self, rel: str) -> None:
        if rel not in self.folders:
            self.folders.add(rel)
            self.save()

    def drop(self, rel: str) -> None:
        """Unlist `rel`, once its file is deleted."""
        if self.files.pop(rel, "absent") != "absent":
            self.save()

    def save(self) -> None:
        """Write manifest.json: a temporary file renamed into place, with the user's umask."""
        data = {"written_by": WRITTEN_BY, "files": dict(sorted(self.files.items())), "folders": sorted(self.folders)}
        fd, tmp = tempfile.mkstemp(dir=self.out, prefix=f".{MANIFEST}.")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(data, indent=1) + "\n")
            os.chmod(tmp, umask_mode(0o666))
            os.replace(tmp, self.out / MANIFEST)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def walk(out: Path):
    """(relative path, is a folder) of everything under `out`, a folder before what it holds; a link is no folder
    (wandb's latest-run), and it is not followed."""
    for root, dirs, files in os.walk(out):
        dirs.sort()
        base = Path(root).relative_to(out)
        for name in sorted(dirs + files):
            yield (base / name).as_posix(), name in dirs and not (Path(root) / name).is_symlink()


def the_run(out: Path) -> Manifest | None:
    """The manifest of the run in `out`: its manifest.json, or an old run's (`Manifest.legacy`); None: no run."""
    manifest = Manifest.load(out)
    if manifest is None and run_config(out) is not None:
        manifest = Manifest.legacy(out)
    return manifest


def sort_out(out: Path, manifest: Manifest | None) -> tuple[list[str], list[str]]:
    """(the run's paths, the user's paths) under `out`, relative to it, folders as "name/". The run's: what
    `manifest` lists (None: no run, so nothing) and its folders, our temporary names, a .lock of ours, and the
    run's folders (FOLDERS) when empty. A folder of the user's is named by what it holds, or itself when empty."""
    ours, theirs, whole = [], [], []
    for rel, is_dir in walk(out):
        if any(rel.startswith(w + "/") for w in whole):
            continue
        if is_dir:
            if manifest is not None and (rel in manifest.folders or ("/" not in rel and TEMPORARY.match(rel))):
                whole.append(rel)
                ours.append(rel + "/")
            elif not any(os.scandir(out / rel)):
                (ours if manifest is not None and rel in FOLDERS else theirs).append(rel + "/")
            continue
        mine = rel == LOCK and our_lock(out / rel)
        if manifest is not None and not mine:
            mine = manifest.owns(rel) or TEMPORARY.match(rel) is not None or rel == MANIFEST
            mine = mine and not (rel == "config.json" and run_config(out) is None)  # another program's config.json
        (ours if mine else theirs).append(rel)
    return ours, theirs


def remove(out: Path, paths: list[str]) -> None:
    """Delete the run's `paths` (sort_out's first list), then the run's folders left empty; nothing else."""
    for rel in paths:
        path = out / rel.rstrip("/")
        if rel.endswith("/"):
            shutil.rmtree(path, ignore_errors=True)
        elif path.is_symlink() or path.exists():
            path.unlink()
    for name in FOLDERS:  # deepest first: a folder still holding something stays
        for root, _, _ in sorted(os.walk(out / name), key=lambda w: -len(w[0])):
            with contextlib.suppress(OSError):
                Path(root).rmdir()
