"""What a run was trained on: the sha256 of each reward's source and of each local data file, in config.json.

A run records them when it starts (`fingerprints`, written by run_io.RunWriter under "fingerprints"), and a
`--resume` computes them again and refuses a change (`check_unchanged`): a run continued on another reward
function or other data would read as one run while it is two, and its summary would compare the old start with
the new end. The contents count, not the size or the time stamp: a file rewritten with its old size and mtime is
a change.

    --reward path/to/file.py:fn   the file's bytes
    --reward module:fn            the module's file, found as problems/user_rewards.py imports it (the working
                                  directory on the path), without importing it
    --reward math, math-symbolic  none: they are the code's own
    --dataset, --data-files, --eval-files   a local file's bytes; a folder's files each, by relative path, but
                                  for the hidden ones the loader skips too (`problems.tasks.hidden`); a hub
                                  name has none (the hub's revision is not ours to pin). A run folder inside a
                                  data folder is refused (run_io.refuse_out_in_data), so none is a run's own file

Each fingerprint is {"flag", "value", "file", "sha256"}, `value` as the flag holds it in config.json. Only the
reward's own file counts, not the modules it imports.
"""

import hashlib
import importlib.util
import os
import sys
from pathlib import Path

from config import Config, ConfigError
from problems.tasks import hidden
from problems.user_rewards import BUILTIN, is_file_spec

DATA_FLAGS = (("--dataset", "dataset"), ("--data-files", "data_files"), ("--eval-files", "eval_files"))
CHUNK = 1 << 20


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def reward_file(spec: str) -> Path | None:
    """The source file of a --reward SPEC (the module docstring's table), or None (a built-in, none found)."""
    if spec in BUILTIN or ":" not in spec:
        return None
    where = spec.rsplit(":", 1)[0]
    if is_file_spec(where):
        path = Path(where).expanduser()
        return path if path.is_file() else None
    return module_file(where)


def module_file(name: str) -> Path | None:
    """The file of module `name` as problems/user_rewards.py's import_module finds it, without running it: NAME.py
    in the working directory first (a user's reward.py before the project's), else as `import name` finds it (the
    imported module's file when it is imported; the working directory appended to the path)."""
    local = Path.cwd() / (name.replace(".", os.sep) + ".py")
    if local.is_file():
        return local
    added = os.getcwd() not in sys.path
    if added:
        sys.path.append(os.getcwd())
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):  # a parent package that does not import; a module without a spec
        spec = None
    finally:
        if added:
            sys.path.remove(os.getcwd())
    if spec is None or not spec.has_location or not spec.origin:
        return None
    path = Path(spec.origin)
    return path if path.is_file() else None


def data_files(value: str) -> list[tuple[str, Path]]:
    """(name, path) of each file a data flag's `value` reads: the file itself (name ""), or every file under a
    folder (name: its path in the folder, sorted); none for a hub name."""
    path = Path(value).expanduser()
    if path.is_file():
        return [("", path)]
    if not path.is_dir():
        return []
    found = []
    for root, dirs, files in os.walk(path):
        dirs.sort()
        found += [(str((Path(root) / f).relative_to(path)), Path(root) / f) for f in files]
    # What the loader skips (datasets: names starting with '.' or '__', an editor's swap file) is no data.
    return sorted((name, file) for name, file in found if not hidden(file, path))


def fingerprints(cfg: Config) -> list[dict]:
    """The run's fingerprints (module docstring), in flag order."""
    out = []
    for spec in cfg.reward or []:
        path = reward_file(spec)
        if path is not None:
            out.append({"flag": "--reward", "value": spec, "file": str(path), "sha256": sha256(path)})
    for flag, name in DATA_FLAGS:
        value = getattr(cfg, name)
        for part, path in data_files(value) if value else []:
            entry = {"flag": flag, "value": value, "file": str(path), "sha256": sha256(path)}
            out.append({**entry, "part": part} if part else entry)
    return out


def key(entry: dict) -> tuple:
    """What identifies a fingerprint across a resume: the flag, its value and the file's place in a folder. A
    module reward is found again from the working directory, so its file may be another: its contents decide."""
    return entry.get("flag"), entry.get("value"), entry.get("part", "")


def check_unchanged(recorded, found: list[dict], config_json: Path, log) -> None:
    """A resume's fingerprints (`found`) against those config.json recorded: a ConfigError naming the flag and the
    first file that changed, is gone or is new. A run recorded before fingerprints existed (None) is not checked,
    with a notice (it records them from now on)."""
    if recorded is None:
        log(
            f"--resume: {config_json} records no fingerprints of the rewards and data (a run from before they were "
            "kept): not checked; recorded from now on"
        )
        return
    if not isinstance(recorded, list) or not all(isinstance(e, dict) for e in recorded):
        raise ConfigError(f'--resume: {config_json}: its "fingerprints" are not the run\'s (a list of files)')
    now = {key(e): e for e in found}
    then = {key(e): e for e in recorded}
    how = "restore it, or start a new run (another --out)"
    for k, old in then.items():
        what = f"{'reward' if old.get('flag') == '--reward' else 'data'} file {old.get('file')}"
        where = f"({old.get('flag')} {old.get('value')})"
        new = now.get(k)
        if new is None:
            raise ConfigError(f"--resume: the {what} {where} is gone since the run started; {how}")
        if new.get("sha256") != old.get("sha256"):
            moved = f" (now {new['file']})" if new["file"] != old.get("file") else ""
            raise ConfigError(f"--resume: the {what}{moved} {where} changed since the run started; {how}")
    for k, new in now.items():
        if k not in then:
            kind = "reward" if new["flag"] == "--reward" else "data"
            raise ConfigError(
                f"--resume: the {kind} file {new['file']} ({new['flag']} {new['value']}) was not there when the run "
                "started; remove it, or start a new run (another --out)"
            )
