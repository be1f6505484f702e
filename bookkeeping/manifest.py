"""What in the run folder is the run's: manifest.json, the list of every path the run wrote.

`--out` and `--overwrite` delete, and a resume replaces, only what a run wrote; anything else under --out, hidden or
not, at any depth (a file of one's own in checkpoints/, tensorboard/, wandb/ or final/), is the user's: a new run
refuses the folder naming it, and nothing is deleted (run_io.check_fresh).

manifest.json lists, relative to --out:
    files     each file the run wrote ("config.json", "checkpoints/step-00000002.pt", "final/model.safetensors"),
              with the sha256 of a checkpoint's file (written with it, checked by a resume: bookkeeping/resume.py)
    folders   a folder another program filled under a fresh name of its own (wandb's run folder): all of it
    links     the links a library made (wandb's latest-run) and where they point: a link is the run's only if listed
              so, pointing where it did; any other link in --out is the user's, named and kept, never followed
    dirs      the folders the run or its libraries made (ours when empty)
An entry is added before its file is written, so that a run stopped at any point (kill -9) leaves no file of its
own unlisted, our temporary names aside (`TEMPORARY`: `.tmp-offpolicy-grpo-<pid>-` and eight random characters, a
name no user picks). What TensorBoard and wandb write under names of their own is listed as it appears (at each
metrics row and when the run closes): anything else in their folders is the user's.

A folder is a run when it holds a manifest.json of ours, or, for a run written before manifests were kept, a
config.json of a run (`run_config`). Such an old run's files are those named exactly as a run names them (`LEGACY`):
the top-level files, checkpoints/step-NNNNNNNN.pt, the files save_pretrained writes in final/, TensorBoard's event
files in tensorboard/, and in wandb/ its links and the run folders of the run's own wandb id; a resume writes the
manifest from them. Any other folder is no run: every file in it is the user's.
"""

import contextlib
import errno
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from bookkeeping.checkpoint import TMP_PREFIX, temporary_prefix, umask_mode

MANIFEST = "manifest.json"
WRITTEN_BY = "offpolicy-grpo train.py"  # what tells our manifest.json from another program's file of that name
LOCK = ".lock"  # holds the writer's pid; locked (flock) while it runs
FOLDERS = ("checkpoints", "final", "tensorboard", "wandb")  # the folders a run makes in --out
TOP_FILES = ("config.json", "metrics.jsonl", "completions.jsonl", "summary.json", "curves.png", MANIFEST)
# Our temporary names, left behind only by a process that died while writing: every file and folder the run writes is
# written under TMP_PREFIX, its pid and eight random characters (mkstemp's), then renamed into place; a checkpoint's
# in checkpoints/ (.pt), final/'s a folder in --out (and the old final/ while it is swapped out).
TEMPORARY = re.compile(rf"^(?:checkpoints/)?{re.escape(TMP_PREFIX)}\d+-[a-z0-9_]{{8}}(?:\.pt)?$")
# Where --overwrite sets the old run aside until the new one has passed its first step (`set_aside`).
SET_ASIDE = ".offpolicy-grpo-set-aside"
SET_ASIDE_RECORD = "set-aside.json"
LIBRARY_FOLDERS = ("tensorboard", "wandb")  # folders another program fills under names of its own


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
    """--out/config.json when it is a run's (a JSON object with the run's fields, a regular file), else None."""
    path = out / "config.json"
    if path.is_symlink():
        return None
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return config if isinstance(config, dict) and {"offpolicy_steps", "group_size"} <= config.keys() else None


def our_lock(path: Path) -> bool:
    """A .lock file as a run leaves it: empty, or its writer's pid. Another program's .lock is not ours."""
    try:
        return path.is_file() and not path.is_symlink() and re.fullmatch(rb"\d*\n?", path.read_bytes()) is not None
    except OSError:
        return False


def damaged(path: Path, field: str, why: str):
    from config import ConfigError

    return ConfigError(
        f"--out {path.parent}: {path.name}: {field} {why}; the run's record of its files is damaged or not ours: "
        "nothing was changed; restore it, or move it and choose another --out"
    )


class Manifest:
    """manifest.json of the run in `out`: `files` (relative path -> the sha256 recorded for it, or None), `folders`
    (relative paths owned whole: an old run's wandb folders), `links` (relative path -> where the link points) and
    `dirs` (folders the run made). `add`, `add_folder`, `add_found` and `drop` write it at once, atomically."""

    def __init__(self, out: Path, files: dict | None = None, folders=(), links: dict | None = None, dirs=()):
        self.out, self.files, self.folders = Path(out), dict(files or {}), set(folders)
        self.links, self.dirs = dict(links or {}), set(dirs)

    @classmethod
    def load(cls, out: Path) -> "Manifest | None":
        """The manifest in `out`; None when there is none, or when the file is another program's (a JSON object
        without our `written_by`: then it is the user's). One of ours that is damaged (not JSON, a field of the
        wrong type), or a manifest.json that is a link, is a ConfigError naming the file and the field."""
        path = Path(out) / MANIFEST
        if not path.exists() and not path.is_symlink():
            return None
        if path.is_symlink() or not path.is_file():
            raise damaged(path, "it", "is a link or not a file")
        try:
            data = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise damaged(path, "it", f"is not JSON ({str(e).splitlines()[0][:80]})") from None
        except OSError as e:
            raise damaged(path, "it", f"cannot be read ({e.strerror})") from None
        if not (isinstance(data, dict) and data.get("written_by") == WRITTEN_BY):
            return None
        files, folders = data.get("files", {}), data.get("folders", [])
        links, dirs = data.get("links", {}), data.get("dirs", [])
        if not isinstance(files, dict) or not all(v is None or isinstance(v, str) for v in files.values()):
            raise damaged(path, "field 'files'", "is not an object of paths to sha256 strings or null")
        if not isinstance(links, dict) or not all(isinstance(v, str) for v in links.values()):
            raise damaged(path, "field 'links'", "is not an object of paths to strings")
        for name, value in (("folders", folders), ("dirs", dirs)):
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise damaged(path, f"field {name!r}", "is not a list of paths")
        return cls(out, files, folders, links, dirs)

    @classmethod
    def legacy(cls, out: Path) -> "Manifest":
        """The manifest of a run written before manifests were kept: its files named as a run names them (LEGACY),
        and wandb's run folders of the run's own id (config.json's wandb_run_id)."""
        manifest = cls(out)
        wandb_id = (run_config(Path(out)) or {}).get("wandb_run_id")
        wandb_run = re.compile(rf"^wandb/(?:offline-)?run-\d{{8}}_\d{{6}}-{re.escape(str(wandb_id))}$")
        for rel, is_dir in walk(Path(out)):
            path = Path(out) / rel
            if is_dir and wandb_id and wandb_run.match(rel):
                manifest.folders.add(rel)
            elif path.is_symlink():
                if rel == "wandb/latest-run":  # wandb's own link
                    manifest.links[rel] = os.readlink(path)
            elif not is_dir and LEGACY.match(rel):
                manifest.files[rel] = None
        return manifest

    def owns(self, rel: str) -> bool:
        """Whether `rel` is the run's: listed, or in a folder it owns whole; a link only as listed (`links`)."""
        path = self.out / rel
        if path.is_symlink():
            try:
                return self.links.get(rel) == os.readlink(path)
            except OSError:
                return False
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

    def add_found(self, found: list[tuple[str, str]]) -> None:
        """List what a library wrote: (relative path, "file" / "dir" / a link's target), in one write."""
        changed = False
        for rel, kind in found:
            if kind == "dir":
                changed |= rel not in self.dirs
                self.dirs.add(rel)
            elif kind == "file":
                changed |= rel not in self.files
                self.files.setdefault(rel, None)
            else:
                changed |= self.links.get(rel) != kind
                self.links[rel] = kind
        if changed:
            self.save()

    def drop(self, rel: str) -> None:
        """Unlist `rel`, once its file is deleted."""
        if self.files.pop(rel, "absent") != "absent":
            self.save()

    def save(self) -> None:
        """Write manifest.json: a temporary file renamed into place, with the user's umask. A write that fails (a
        full disk) raises an OSError naming manifest.json."""
        data = {"written_by": WRITTEN_BY, "files": dict(sorted(self.files.items())), "folders": sorted(self.folders)}
        if self.links:
            data["links"] = dict(sorted(self.links.items()))
        if self.dirs:
            data["dirs"] = sorted(self.dirs)
        write_replacing(self.out / MANIFEST, json.dumps(data, indent=1) + "\n")


def write_replacing(path: Path, text: str) -> None:
    """Write `text` to `path` by a temporary file in its folder (TMP_PREFIX) renamed into place, with the user's
    umask; never through a link: a link at `path` is the user's, and is an OSError (EEXIST) naming it. A write that
    fails (a full disk) removes the temporary file and raises an OSError naming `path`; the old file stays."""
    refuse_link(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=temporary_prefix())
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from None
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, umask_mode(0o666))  # mkstemp makes it 0600
        refuse_link(path)
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError) and e.filename != str(path):  # a write to an open file names no file
            raise OSError(e.errno, e.strerror, str(path)) from None
        raise


def refuse_link(path: Path) -> None:
    """A link where the run writes is the user's: never written through, never replaced."""
    if path.is_symlink() or any(p.is_symlink() for p in _between(path)):
        link = path if path.is_symlink() else next(p for p in _between(path) if p.is_symlink())
        raise OSError(
            errno.EEXIST, "a link of the user's is in the run's place (kept; the run writes no file there)", str(link)
        )


def _between(path: Path):
    """The folders between --out and `path` that the run makes (checkpoints/, final/, ...): none may be a link."""
    parent = path.parent
    if parent.name in FOLDERS:
        yield parent


def walk(out: Path):
    """(relative path, is a folder) of everything under `out`, a folder before what it holds; a link is no folder
    (wandb's latest-run), and it is not followed. A folder that cannot be read is listed, not entered."""
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


def sort_out(out: Path, manifest: Manifest | None, limit: int | None = None) -> tuple[list[str], list[str]]:
    """(the run's paths, the user's paths) under `out`, relative to it, folders as "name/". The run's: what
    `manifest` lists (None: no run, so nothing) and its folders, our temporary names, a .lock of ours, and the
    run's folders (FOLDERS, `dirs`) when empty. A folder of the user's is named by what it holds, or itself when
    empty. A link is the user's unless the manifest lists it, as it points now. `limit`: stop after that many of
    the user's paths (a folder that holds no run: only the first are named)."""
    ours, theirs, whole = [], [], []
    loaded = manifest is not None and (out / MANIFEST).is_file() and not (out / MANIFEST).is_symlink()
    for rel, is_dir in walk(out):
        if limit is not None and len(theirs) >= limit:
            break
        if any(rel.startswith(w + "/") for w in whole):
            continue
        path = out / rel
        if is_dir:
            if manifest is not None and (rel in manifest.folders or ("/" not in rel and TEMPORARY.match(rel))):
                whole.append(rel)
                ours.append(rel + "/")
            elif rel == SET_ASIDE and set_aside_record(out) is not None:
                whole.append(rel)  # an old run set aside: put back or dropped by claim_run_folder, never sorted
            elif is_empty(path):
                mine = manifest is not None and (rel in FOLDERS or rel in manifest.dirs)
                (ours if mine else theirs).append(rel + "/")
            continue
        if path.is_symlink():
            (ours if manifest is not None and manifest.owns(rel) else theirs).append(rel)
            continue
        mine = rel == LOCK and our_lock(path)
        if manifest is not None and not mine:
            mine = manifest.owns(rel) or TEMPORARY.match(rel) is not None or (rel == MANIFEST and loaded)
            mine = mine and not (rel == "config.json" and run_config(out) is None)  # another program's config.json
        (ours if mine else theirs).append(rel)
    return ours, theirs


def is_empty(folder: Path) -> bool:
    try:
        with os.scandir(folder) as entries:
            return not any(entries)
    except OSError:  # a folder that cannot be read is not known to be empty
        return False


def remove(out: Path, paths: list[str], manifest: Manifest | None = None) -> None:
    """Delete the run's `paths` (sort_out's first list), then the run's folders left empty; nothing else."""
    for rel in paths:
        path = out / rel.rstrip("/")
        if rel.endswith("/") and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        elif path.is_symlink() or path.exists():
            path.unlink()
    remove_empty_folders(out, manifest)


def remove_empty_folders(out: Path, manifest: Manifest | None = None) -> None:
    """The run's folders (FOLDERS, the manifest's `dirs`) that hold nothing now, deepest first."""
    made = set(manifest.dirs if manifest is not None else ())
    for name in FOLDERS:  # deepest first: a folder still holding something stays
        if (out / name).is_symlink():
            continue
        for root, _, _ in sorted(os.walk(out / name), key=lambda w: -len(w[0])):
            rel = Path(root).relative_to(out).as_posix()
            if rel in FOLDERS or rel in made:
                with contextlib.suppress(OSError):
                    Path(root).rmdir()


# ---- an --overwrite that can be undone: the old run set aside until the new one has passed its first step ----------


def set_aside_record(out: Path) -> dict | None:
    """The record of an old run set aside in `out` (SET_ASIDE/set-aside.json, ours), or None."""
    folder = out / SET_ASIDE
    if folder.is_symlink() or not folder.is_dir():
        return None
    try:
        data = json.loads((folder / SET_ASIDE_RECORD).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    paths = data.get("paths") if isinstance(data, dict) else None
    if (
        data.get("written_by") != WRITTEN_BY
        or not isinstance(paths, list)
        or not all(isinstance(p, str) for p in paths)
    ):
        return None
    return data


def set_aside(out: Path, ours: list[str], theirs: list[str]) -> None:
    """Move the old run's paths (`ours`, sort_out's first list, the lock aside) into out/SET_ASIDE, under the same
    relative paths, by renames within --out's file system: nothing is copied, nothing deleted. A top-level folder
    that holds nothing of the user's (`theirs`) moves whole. The record (which paths, by which process) is written
    first, so that a process killed in between leaves a folder the next start puts back (`claim_run_folder`). A
    rename that fails puts back what was moved and raises an OSError naming the path."""
    whole = {
        rel.split("/")[0]
        for rel in ours
        if "/" in rel.rstrip("/")
        and not (out / rel.split("/")[0]).is_symlink()
        and not any(t.startswith(rel.split("/")[0] + "/") for t in theirs)
    }
    moves = [f"{t}/" for t in sorted(whole)] + [p for p in ours if p.split("/")[0] not in whole]
    folder = out / SET_ASIDE
    folder.mkdir()
    record = {"written_by": WRITTEN_BY, "pid": os.getpid(), "paths": moves}
    (folder / SET_ASIDE_RECORD).write_text(json.dumps(record, indent=1) + "\n")
    moved = []
    try:
        for rel in moves:
            src, dst = out / rel.rstrip("/"), folder / rel.rstrip("/")
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.rename(src, dst)
            moved.append(rel)
    except OSError as e:
        put_back(out, moved)
        raise OSError(e.errno, e.strerror, str(e.filename or out)) from None
    remove_empty_folders(out, the_run_in(folder))


def the_run_in(folder: Path) -> Manifest | None:
    with contextlib.suppress(Exception):
        return the_run(folder)
    return None


def put_back(out: Path, paths: list[str] | None = None) -> None:
    """Move the set-aside run's paths (`paths`, else all its record lists) back into --out, then remove SET_ASIDE."""
    folder = out / SET_ASIDE
    if paths is None:
        paths = (set_aside_record(out) or {}).get("paths", [])
    for rel in reversed(paths):
        src, dst = folder / rel.rstrip("/"), out / rel.rstrip("/")
        if src.exists() or src.is_symlink():
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.rename(src, dst)
    drop_set_aside(out)


def drop_set_aside(out: Path) -> None:
    shutil.rmtree(out / SET_ASIDE, ignore_errors=True)
