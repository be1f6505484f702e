"""Issue 55: the run folder under a hostile user, each case as a user would run it (links made with os.symlink, a
reward that raises, a weights-only model folder, damaged JSON, kill -9), each checking that the user's bytes and the
old run's bytes are unchanged where they must be, and that the command ends in one line with its exit status.

The cases run `train.main` in this process where they can (the `main` fixture), in a subprocess where they need one
(kill -9)."""

import json
import os
import shutil
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from bookkeeping.manifest import SET_ASIDE
from conftest import needs
from test_run_folder import ENV, cli, copy_run, error_lines, one_line_error, snapshot, tiny

pytestmark = pytest.mark.model  # trains a model: CI runs these again under plain kernels

LOCK = ".lock"


def without_lock(snap: dict) -> dict:
    """A snapshot less the lock, which holds the pid of the last process that claimed the folder."""
    return {k: v for k, v in snap.items() if k != LOCK}


@pytest.fixture(scope="module")
def done(warm_cache, tmp_path_factory) -> Path:
    """A finished 2-step run, a checkpoint after each step, its completions logged (copied by the tests)."""
    out = tmp_path_factory.mktemp("hostile") / "done"
    r = cli(*tiny(warm_cache, out, 2, "--save-every", 1, "--log-completions", 2))
    assert r.returncode == 0, r.stderr[-2000:]
    return out


@pytest.fixture
def run(done, tmp_path) -> Path:
    return copy_run(done, tmp_path / "run")


@pytest.fixture
def notes(tmp_path) -> Path:
    path = tmp_path / "my-notes.md"
    path.write_text("# my notes, outside the run\n")
    return path


# --- 1. no write through a link --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["curves.png", "summary.json", "config.json", "metrics.jsonl", LOCK])
def test_a_link_in_a_runs_file_place_is_kept_and_not_followed(run, notes, warm_cache, main, name):
    (run / name).unlink(missing_ok=True)
    os.symlink(notes, run / name)
    before, old = notes.read_bytes(), without_lock(snapshot(run))
    for flags in (["--resume", "--out", run, "--no-progress"], [*tiny(warm_cache, run, 2), "--overwrite"]):
        one_line_error(main(*flags), 2, name)
        assert notes.read_bytes() == before and os.readlink(run / name) == str(notes)
        assert without_lock(snapshot(run)) == old


def test_a_link_in_place_of_final_is_never_renamed(run, tmp_path, main):
    model = tmp_path / "my-model"
    shutil.copytree(run / "final", model)
    shutil.rmtree(run / "final")
    os.symlink(model, run / "final")
    before = snapshot(model)
    r = main("--resume", "--out", run, "--steps", 3, "--no-progress")
    one_line_error(r, 2, "final", "not a run's")
    assert (run / "final").is_symlink() and snapshot(model) == before
    assert not any(p.name.startswith(".final") for p in run.iterdir())


def test_a_users_own_lock_file_is_theirs_for_resume_and_overwrite_alike(run, warm_cache, main):
    (run / LOCK).write_text("my lock notes: do not run on Sundays\n")
    old = snapshot(run)
    for flags in (["--resume", "--out", run, "--no-progress"], [*tiny(warm_cache, run, 2), "--overwrite"]):
        one_line_error(main(*flags), 2, LOCK, "yours")
        assert snapshot(run) == old


# --- 2. an --overwrite that can be undone ----------------------------------------------------------------------------

RAISES = textwrap.dedent(
    """
    def broken(completions, **kwargs):
        raise RuntimeError("the grader is down")
    """
)


def test_overwrite_with_a_reward_that_raises_puts_the_old_run_back(run, warm_cache, tmp_path, main):
    (tmp_path / "broken.py").write_text(RAISES)
    old = without_lock(snapshot(run))
    r = main(*tiny(warm_cache, run, 2), "--overwrite", "--reward", f"{tmp_path / 'broken.py'}:broken")
    one_line_error(r, 2, "broken", "grader is down")
    assert without_lock(snapshot(run)) == old and not (run / SET_ASIDE).exists()


def test_overwrite_with_a_weights_only_model_is_refused_at_load(run, tmp_path, main):
    from transformers import AutoModelForCausalLM

    model = tmp_path / "weights-only"
    AutoModelForCausalLM.from_pretrained(run / "final").save_pretrained(model)  # no tokenizer files
    old = without_lock(snapshot(run))
    r = main(*tiny("unused", run, 2), "--overwrite", "--model", model)
    one_line_error(r, 2, str(model), "tokenizer")
    assert without_lock(snapshot(run)) == old


def test_overwrite_that_fails_before_its_first_step_on_any_error_is_one_line_and_undone(
    run, warm_cache, main, monkeypatch
):
    from bookkeeping import run_io

    old = without_lock(snapshot(run))
    original = run_io.RunWriter.open

    def open_then_fail(self, *a, **kw):  # a model that loads but cannot run: whatever it raises, after the open
        original(self, *a, **kw)
        assert (self.out / SET_ASIDE).is_dir()  # set aside, not deleted
        raise IndexError("index out of range in self")

    monkeypatch.setattr(run_io.RunWriter, "open", open_then_fail)
    line = one_line_error(main(*tiny(warm_cache, run, 2), "--overwrite"), 2, "before its first step", "IndexError")
    assert "old run is back" in line and "steps done" not in line and without_lock(snapshot(run)) == old


def test_overwrite_deletes_the_old_run_once_the_new_one_has_passed_its_first_step(run, warm_cache, main):
    r = main(*tiny(warm_cache, run, 1), "--overwrite")
    assert r.returncode == 0, r.stderr[-2000:]
    assert not (run / SET_ASIDE).exists() and not (run / "checkpoints").exists()
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [0]


KILLS = textwrap.dedent(
    """
    import os, signal

    def killed(completions, answer, trainer_state, **kwargs):
        if os.path.exists({marker!r}) and trainer_state.global_step >= {at}:
            os.kill(os.getpid(), signal.SIGKILL)  # kill -9, at this step's refresh
        return [float(c.strip().endswith(a)) for c, a in zip(completions, answer)]
    """
)


def test_a_kill_9_between_set_aside_and_the_first_row_is_recovered_by_the_next_start(run, warm_cache, tmp_path):
    marker = tmp_path / "kill-now"
    marker.write_text("")
    (tmp_path / "killer.py").write_text(KILLS.format(marker=str(marker), at=0))
    old = without_lock(snapshot(run))
    r = cli(*tiny(warm_cache, run, 2), "--overwrite", "--reward", f"{tmp_path / 'killer.py'}:killed")
    assert r.returncode == -9, r.stderr[-2000:]
    assert (run / SET_ASIDE).is_dir()  # both: the old run set aside, the new start's files beside it
    # The next start puts the old run back and says so; a --resume read the stopped start's config.json, so it
    # stops there (exit 2) and the same command then continues the old run.
    r = cli("--resume", "--out", run, "--no-progress")
    assert r.returncode == 2 and "put back the old run" in r.stdout and "run it again" in r.stderr, r.stderr
    assert not (run / SET_ASIDE).exists() and without_lock(snapshot(run)) == old
    r = cli("--resume", "--out", run, "--steps", 3, "--no-progress")
    assert r.returncode == 0, r.stderr[-2000:]
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]


def test_hidden_backups_of_the_users_are_named_and_kept_by_overwrite(run, warm_cache, main):
    mine = {".config.json.20251206": "{}", ".metrics.jsonl.backup01": "x", ".final.20251206/notes.txt": "notes"}
    for name, text in mine.items():
        (run / name).parent.mkdir(exist_ok=True)
        (run / name).write_text(text)
    old = snapshot(run)
    line = one_line_error(main(*tiny(warm_cache, run, 2), "--overwrite"), 2, "not a run's")
    assert all(name in line for name in mine) and snapshot(run) == old


def test_overwrite_with_a_folder_it_cannot_rename_is_one_line_and_changes_nothing(run, warm_cache, main):
    if os.geteuid() == 0:
        pytest.skip("root writes into a read-only folder: the case needs an ordinary user")
    os.chmod(run / "final", 0o555)
    try:
        old = without_lock(snapshot(run))
        line = one_line_error(main(*tiny(warm_cache, run, 2), "--overwrite"), 2, "cannot be set aside")
        assert "steps done" not in line and without_lock(snapshot(run)) == old
    finally:
        os.chmod(run / "final", 0o755)


# --- 3. TensorBoard's and wandb's folders ----------------------------------------------------------------------------


def test_a_file_of_ones_own_in_tensorboards_folder_is_named_and_kept(warm_cache, tmp_path, main):
    needs("tensorboard", "tensorboard")
    out = tmp_path / "tb"
    assert main(*tiny(warm_cache, out, 1), "--report-to", "tensorboard").returncode == 0
    (out / "tensorboard" / "my_analysis.md").write_text("mine")
    old = without_lock(snapshot(out))
    one_line_error(main(*tiny(warm_cache, out, 1), "--overwrite"), 2, "tensorboard/my_analysis.md")
    assert without_lock(snapshot(out)) == old


def test_a_file_of_ones_own_inside_wandbs_run_folder_is_named_and_kept(warm_cache, tmp_path, main, monkeypatch):
    needs("wandb", "wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "wb"
    assert main(*tiny(warm_cache, out, 1), "--report-to", "wandb").returncode == 0
    run_folder = next(p for p in (out / "wandb").iterdir() if p.is_dir() and not p.is_symlink())
    (run_folder / "files" / "my_analysis.md").write_text("mine")
    old = without_lock(snapshot(out))
    one_line_error(main(*tiny(warm_cache, out, 1), "--overwrite"), 2, "my_analysis.md")
    assert without_lock(snapshot(out)) == old


# --- 4. damaged or foreign records -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, text, words",
    [
        ("manifest.json", "{not json", ["manifest.json", "not JSON"]),
        ("manifest.json", '{"written_by": "offpolicy-grpo train.py", "files": [1]}', ["manifest.json", "'files'"]),
        ("summary.json", "[1, 2]", ["summary.json", "not an object"]),
        ("metrics.jsonl", '{"step": 0}\n[1]\n{"step": 1}\n', ["metrics.jsonl:2", "not a JSON object"]),
        ("completions.jsonl", '{"step": 0}\nnot json\n{"step": 1}\n', ["completions.jsonl:2", "not valid JSON"]),
    ],
)
def test_a_damaged_record_is_one_line_and_nothing_is_written(run, main, name, text, words):
    (run / name).write_text(text)
    old = without_lock(snapshot(run))
    one_line_error(main("--resume", "--out", run, "--steps", 8, "--no-progress"), 2, *words)
    assert without_lock(snapshot(run)) == old  # config.json not rewritten with "steps": 8


def test_config_record_names_the_file_and_the_field(tmp_path):
    from config import ConfigError, config_record

    path = tmp_path / "config.json"
    with pytest.raises(ConfigError, match=r"config.json is not a run's config \(a JSON list"):
        config_record([1, 2], path)
    with pytest.raises(ConfigError, match=r"config.json: field 'group_size' is \"eight\", not a int"):
        config_record({"group_size": "eight", "offpolicy_steps": 1}, path)
    assert config_record({"group_size": 8, "lr": 1, "model": "tiny", "eval_split": None}, path) == {
        "group_size": 8,
        "lr": 1.0,
        "model": "tiny",
        "eval_split": None,
    }


@pytest.mark.parametrize("text, words", [("[1, 2]", ["config.json", "not an object"]), (None, ["'group_size'"])])
def test_a_damaged_config_json_is_one_line(run, main, text, words):
    if text is None:
        text = (run / "config.json").read_text().replace('"group_size": 2', '"group_size": "eight"')
    (run / "config.json").write_text(text)
    old = without_lock(snapshot(run))
    one_line_error(main("--resume", "--out", run, "--no-progress"), 2, *words)
    assert without_lock(snapshot(run)) == old


# --- 5. data, the model, --out / ------------------------------------------------------------------------------------


def test_a_split_a_saved_dataset_without_splits_does_not_have_is_refused(tmp_path):
    import datasets

    from problems.tasks import TaskError, read_dataset

    folder = tmp_path / "saved"
    datasets.Dataset.from_list([{"prompt": "1+1?", "answer": "2"}] * 3).save_to_disk(str(folder))
    with pytest.raises(TaskError, match="--split test: .* has no such split"):
        read_dataset(str(folder), None, "test", "--dataset")
    with pytest.raises(TaskError, match="--eval-split test"):
        read_dataset(str(folder), None, "test", "--dataset", "--eval-split")
    assert len(read_dataset(str(folder), None, "train", "--dataset")) == 3


def test_a_data_folder_of_two_formats_is_refused(tmp_path):
    from problems.tasks import TaskError, read_dataset

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.jsonl").write_text('{"prompt": "1+1?", "answer": "2"}\n')
    (tmp_path / "data" / "b.csv").write_text("prompt,answer\n2+2?,4\n")
    with pytest.raises(TaskError, match=r"2 formats \(csv: b.csv; json: a.jsonl\)"):
        read_dataset(str(tmp_path / "data"), None, "train", "--dataset")


def test_a_csv_with_an_unterminated_quote_names_the_cause(tmp_path):
    from problems.tasks import TaskError, read_dataset

    path = tmp_path / "bad.csv"
    path.write_text('prompt,answer\n"1+1?,2\n3+3?,6\n')
    with pytest.raises(TaskError) as e:
        read_dataset(str(path), None, "train", "--dataset")
    assert "bad.csv" in str(e.value) and str(e.value).count(":") >= 3, str(e.value)


@pytest.mark.parametrize("damage", ["truncated", "lfs-pointer"])
def test_a_damaged_tiny_policy_is_one_line_naming_the_file(tmp_path, main, damage):
    from engine.tiny import SHIPPED, cache_path, read_saved

    cached = cache_path(str(tmp_path / "cache"), 7)  # a cached warm-up of 7 steps (not the shipped 1000)
    shutil.copytree(SHIPPED, cached)
    weights = cached / "model.safetensors"
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:1000])
    else:
        weights.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 4000000\n")
    args = tiny(str(tmp_path / "cache"), tmp_path / "run", 1)
    args[args.index("--warmup-steps") + 1] = 7
    line = one_line_error(main(*args), 2, str(cached))
    assert ("git lfs pull" if damage == "lfs-pointer" else "delete the folder") in line
    assert not (tmp_path / "run").exists()
    with pytest.raises(Exception, match="git lfs pull" if damage == "lfs-pointer" else "cannot be read"):
        read_saved(cached, "restore it")  # the shipped folder's message, the same way


def test_out_at_the_root_is_refused_in_one_line(warm_cache, main):
    one_line_error(main(*tiny(warm_cache, "/", 1)), 2, "--out /", "root")


# --- 6. wording ------------------------------------------------------------------------------------------------------


def test_the_continue_with_command_is_shell_quoted(tmp_path):
    import shlex

    from bookkeeping.failures import where_the_run_stands

    out = tmp_path / "with space"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "step-00000001.pt").write_bytes(b"")
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    line = where_the_run_stands(str(out), 2)
    assert line.endswith(f"--resume --out {shlex.quote(str(out))}") and shlex.split(line.split(": ", 1)[1])[-1] == str(
        out
    )


def test_a_collapsed_policy_does_not_end_successfully(tmp_path):
    from bookkeeping.failures import COLLAPSE_ROWS, Diverged, stop_if_collapsed

    rows = [{"step": k, "reward": 0.4 if k < 3 else 0.0, "zero_std_frac": 0.5 if k < 3 else 1.0} for k in range(10)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(Diverged, match="collapsed: held-out accuracy from 0.318 to 0"):
        stop_if_collapsed(tmp_path, {"eval_accuracy": 0.318}, {"eval_accuracy": 0.0})
    stop_if_collapsed(tmp_path, {"eval_accuracy": 0.318}, {"eval_accuracy": 0.002})  # not 0: no collapse
    never = [{"step": k, "reward": 0.0, "zero_std_frac": 1.0} for k in range(10)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in never))
    stop_if_collapsed(tmp_path, {"eval_accuracy": 0.0}, {"eval_accuracy": 0.0})  # never learned: not a collapse
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[: COLLAPSE_ROWS - 1]))
    stop_if_collapsed(tmp_path, {"eval_accuracy": 0.318}, {"eval_accuracy": 0.0})  # too short to tell


def test_a_full_disk_at_the_manifests_first_write_names_it(tmp_path, monkeypatch):
    import errno
    import tempfile

    from bookkeeping.manifest import Manifest

    def full(*a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tempfile, "mkstemp", full)
    with pytest.raises(OSError) as e:
        Manifest(tmp_path).save()
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(tmp_path / "manifest.json")


# --- 7. exact resume of a reward that draws from numpy ---------------------------------------------------------------

NOISY = textwrap.dedent(
    """
    import os, signal
    import numpy as np

    def noisy(completions, answer, trainer_state, **kwargs):
        if os.path.exists({marker!r}) and trainer_state.global_step >= 4:
            os.kill(os.getpid(), signal.SIGKILL)  # kill -9 at step 4's refresh
        right = [float(c.strip().endswith(a)) for c, a in zip(completions, answer)]
        return [r + float(np.random.uniform(0, 0.5)) for r in right]
    """
)


def test_a_reward_drawing_from_numpy_resumes_after_kill_9_to_the_same_weights(warm_cache, tmp_path):
    marker = tmp_path / "kill-now"
    (tmp_path / "noisy.py").write_text(NOISY.format(marker=str(marker)))
    flags = ("--offpolicy-steps", 2, "--save-every", 2, "--reward", f"{tmp_path / 'noisy.py'}:noisy")
    r = cli(*tiny(warm_cache, tmp_path / "clean", 6), *flags)
    assert r.returncode == 0, r.stderr[-2000:]
    marker.write_text("")
    r = cli(*tiny(warm_cache, tmp_path / "run", 6), *flags)
    assert r.returncode == -9 and (tmp_path / "run" / "checkpoints" / "step-00000004.pt").is_file(), r.stderr[-2000:]
    marker.unlink()
    r = cli("--resume", "--out", tmp_path / "run", "--no-progress")
    assert r.returncode == 0, r.stderr[-2000:]
    a = load_file(tmp_path / "clean" / "final" / "model.safetensors")
    b = load_file(tmp_path / "run" / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert rewards(tmp_path / "clean") == rewards(tmp_path / "run")


def rewards(out: Path) -> list:
    """The rewards of each metrics row (timings and memory differ between two runs; the rewards must not)."""
    return [json.loads(line)["reward"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_every_subprocess_a_test_starts_sets_omp_num_threads():
    # Without it a subprocess takes every core (4.5 s a step under contention against 0.16 s with it set).
    assert ENV["OMP_NUM_THREADS"] == "1"
    tests = Path(__file__).parent
    light = {"test_real_staleness.py"}  # its Python subprocess prints its pid and ends: no torch, no threads
    for path in sorted(tests.glob("*.py")):
        text = path.read_text()
        if ("subprocess.run(" in text or "subprocess.Popen(" in text) and "sys.executable" in text:
            assert path.name in light or "OMP_NUM_THREADS" in text, f"{path.name}: a subprocess without it"


def test_error_lines_helper_is_shared():  # the helpers this file borrows exist where it imports them
    assert callable(error_lines)
