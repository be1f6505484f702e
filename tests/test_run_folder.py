"""The run folder: `--out` is the run, one writer at a time, resume continues the run it finds, divergence never
reaches a checkpoint, and everything a user can cause ends in one line (docs/failure-modes.md).

Each case runs the command line (`train.main`) on the built-in tiny policy for a few steps: in this process where it
can, in a subprocess where it needs one (a real second process, real signals, a finished run to copy).
"""

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import config
import train
from bookkeeping.failures import Diverged, check_finite_weights, stop_if_diverged
from conftest import ROOT, TEST_WARMUP, needs

pytestmark = pytest.mark.model  # trains a model: CI runs these again under plain kernels

ENV = {"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def cli(*args, cwd=ROOT, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=ENV,
    )


def tiny(cache, out, steps=2, *extra) -> list:
    """A few steps of the built-in task: 2 prompts x 2 completions, 4 held-out problems, no progress bar."""
    return [
        *("--steps", steps, "--prompts-per-step", 2, "--group-size", 2, "--eval-size", 4, "--eval-every", 0),
        *("--warmup-steps", TEST_WARMUP, "--cache-dir", cache, "--out", out, "--no-progress", *extra),
    ]


def error_lines(stderr: str) -> list[str]:
    """stderr without transformers' own progress bars (loading the weights), which are no error."""
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith("Loading weights")]


def one_line_error(r: subprocess.CompletedProcess, status: int, *words: str) -> str:
    """The process ended with `status` and one line on stderr (no traceback) holding every one of `words`."""
    lines = error_lines(r.stderr)
    assert r.returncode == status, r.stderr[-2000:]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert all(w in lines[0] for w in words), lines[0]
    return lines[0]


def snapshot(folder: Path) -> dict:
    """Every file under `folder` with its bytes: what "touches nothing" compares."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished_run(warm_cache, tmp_path_factory) -> Path:
    """A finished 2-step run with a checkpoint after each step (copied, never changed, by the tests)."""
    out = tmp_path_factory.mktemp("runs") / "done"
    r = cli(*tiny(warm_cache, out, 2, "--save-every", 1))
    assert r.returncode == 0, r.stderr[-2000:]
    return out


def copy_run(src: Path, dst: Path) -> Path:
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
    return dst


def steps_logged(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


# --- --out is the run ---------------------------------------------------------------------------------------------


def test_a_copied_run_resumes_in_the_copy_and_leaves_the_original_alone(finished_run, tmp_path, warm_cache, main):
    original = copy_run(finished_run, tmp_path / "a")
    before = snapshot(original)
    copy = copy_run(original, tmp_path / "b")
    r = main("--resume", "--out", copy, "--steps", 4)  # --steps may differ: it extends the run
    assert r.returncode == 0, r.stderr[-2000:]
    assert steps_logged(copy) == [0, 1, 2, 3] and json.loads((copy / "config.json").read_text())["out"] == str(copy)
    assert snapshot(original) == before


def test_a_moved_run_resumes_where_it_is_and_its_old_folder_stays_gone(finished_run, tmp_path, main):
    old = copy_run(finished_run, tmp_path / "old")
    new = tmp_path / "new"
    old.rename(new)
    r = main("--resume", "--out", new, "--steps", 3)
    assert r.returncode == 0, r.stderr[-2000:]
    assert steps_logged(new) == [0, 1, 2] and not old.exists()


def test_paths_are_stored_absolute_and_a_missing_one_is_named_on_resume(tmp_path, monkeypatch, main):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.jsonl").write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    args, given = config.parse_args(["--task", "gsm8k", "--data-files", "train.jsonl", "--out", "run", "--model", "m"])
    cfg = train.config_from_args(args, given)
    assert cfg.data_files == str(tmp_path / "train.jsonl") and cfg.out == str(tmp_path / "run")
    assert Path(cfg.cache_dir).is_absolute() and cfg.model == "m"  # a hub id is no path
    # From another working directory the recorded path still names the file; once it is gone, the error does.
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(vars(cfg)))
    (tmp_path / "train.jsonl").unlink()
    monkeypatch.chdir(ROOT)
    r = main("--resume", "--out", run)
    one_line_error(r, 2, str(tmp_path / "train.jsonl"), "no such file")


def test_a_new_run_refuses_a_folder_that_holds_a_run_and_touches_nothing(finished_run, tmp_path, warm_cache, main):
    out = copy_run(finished_run, tmp_path / "run")
    before = snapshot(out)
    r = main(*tiny(warm_cache, out, 2, "--lr", "1e-4"))
    one_line_error(r, 2, "already holds a run", "--resume", "--overwrite")
    assert snapshot(out) == before


def test_overwrite_starts_the_run_over(finished_run, tmp_path, warm_cache, main):
    out = copy_run(finished_run, tmp_path / "run")
    r = main(*tiny(warm_cache, out, 1, "--overwrite"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert steps_logged(out) == [0] and not (out / "checkpoints").exists()  # the old run's checkpoints are gone


def test_a_folder_that_is_not_a_run_is_refused_even_with_overwrite(tmp_path, warm_cache, main):
    model = copy_run(ROOT / "tiny_policy", tmp_path / "model")
    before = snapshot(model)
    for extra in ([], ["--overwrite"]):
        r = main(*tiny(warm_cache, model, 1, *extra))
        one_line_error(r, 2, "not a run's", "config.json")
    assert snapshot(model) == before


# --- one writer per run -------------------------------------------------------------------------------------------


def wait_for(predicate, timeout=120):
    end = time.time() + timeout
    while time.time() < end:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def test_a_second_process_on_the_same_out_is_refused_naming_the_first(tmp_path, warm_cache, main):
    out = tmp_path / "run"
    first = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *map(str, tiny(warm_cache, out, 400))],
        cwd=ROOT,
        env=ENV,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert wait_for(lambda: (out / "metrics.jsonl").exists())
        r = main(*tiny(warm_cache, out, 2))
        line = one_line_error(r, 2, "in use by another run", f"pid {first.pid}")
        r = main("--resume", "--out", out)
        one_line_error(r, 2, "in use by another run")
        assert "pid" in line
    finally:
        first.kill()
        first.wait()


def test_a_lock_left_by_a_dead_process_does_not_block(tmp_path, warm_cache, main):
    out = tmp_path / "run"
    out.mkdir()
    (out / ".lock").write_text("999999\n")  # its writer is gone: the operating system released its lock
    r = main(*tiny(warm_cache, out, 1))
    assert r.returncode == 0, r.stderr[-2000:]


# --- resume continues the run it finds ----------------------------------------------------------------------------


def test_a_flag_that_differs_from_the_runs_is_refused_naming_both_values(finished_run, tmp_path, main):
    out = copy_run(finished_run, tmp_path / "run")
    before = snapshot(out)
    r = main("--resume", "--out", out, "--lr", "1e-3", "--offpolicy-steps", "2")
    one_line_error(r, 2, "--lr 0.001 (the run has 5e-05)", "--offpolicy-steps 2 (the run has 1)")
    # Given equal to the run's, a flag is no change.
    assert snapshot(out) == before
    r = main("--resume", "--out", out, "--lr", "5e-5", "--steps", "3")
    assert r.returncode == 0, r.stderr[-2000:]
    assert steps_logged(out) == [0, 1, 2]


def test_a_torn_last_metrics_line_is_dropped_with_a_notice(finished_run, tmp_path, main):
    out = copy_run(finished_run, tmp_path / "run")
    (out / "final").rename(tmp_path / "final")
    (out / "checkpoints" / "step-00000002.pt").unlink()  # back to step 1, as if killed while logging step 1
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "rew')  # the disk filled up mid-line
    r = main("--resume", "--out", out)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "dropped a torn last line" in r.stdout + r.stderr
    assert steps_logged(out) == [0, 1]


def test_an_unreadable_newest_checkpoint_falls_back_to_the_one_before(finished_run, tmp_path, main):
    out = copy_run(finished_run, tmp_path / "run")
    newest = out / "checkpoints" / "step-00000002.pt"
    whole = newest.read_bytes()
    newest.write_bytes(whole[:1000])  # truncated: a copy cut short; its sha256 is not the one recorded
    r = main("--resume", "--out", out)
    assert r.returncode == 0, r.stderr[-2000:]
    log = r.stdout + r.stderr
    assert (
        "skipped " + str(newest) + ": damaged" in log and "resumed from" in log and "step-00000001.pt at step 1" in log
    )
    # A run from before checkpoints were hashed (no manifest.json): an unreadable file is found by reading it.
    (out / "manifest.json").unlink()
    newest.write_bytes(whole[:1000])
    r = main("--resume", "--out", out)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "step-00000002.pt: it cannot be read" in r.stdout + r.stderr and "at step 1" in r.stdout + r.stderr
    (out / "checkpoints" / "step-00000001.pt").write_bytes(b"not a checkpoint")
    newest.write_bytes(b"")
    r = main("--resume", "--out", out)
    one_line_error(r, 2, "no intact checkpoint", "step-00000002.pt")


# --- divergence never reaches a checkpoint ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["--lr", "inf"],
        ["--lr", "nan"],
        ["--is-cap", "nan", "--clip-center", "decoupled"],
        ["--beta", "inf"],
        ["--clip-eps", "nan"],
        ["--weight-decay", "-1"],
        ["--lr", "-1e-5"],
        ["--seed", str(2**70)],
        ["--device", "foo"],
    ],
)
def test_float_and_range_flags_are_checked_before_anything_runs(tmp_path, args, main):
    r = main(*args, "--out", tmp_path / "run")
    one_line_error(r, 2, args[0])
    assert not (tmp_path / "run").exists()


def test_weights_that_are_not_finite_stop_the_run_before_they_are_saved(tok):
    from engine import tiny

    model = tiny.build_model(tok, seed=0)
    check_finite_weights(model, "here")  # finite: nothing happens
    with torch.no_grad():
        model.model.norm.weight[0] = float("inf")
    with pytest.raises(Diverged, match="here: the policy's weights are not finite"):
        check_finite_weights(model, "here")


def test_an_intermittently_non_finite_run_stops_and_saves_no_non_finite_weights(tmp_path, warm_cache, main):
    out = tmp_path / "run"
    r = main(*tiny(warm_cache, out, 20, "--lr", "1e30", "--save-every", "1", "--keep-checkpoints", "20"))
    one_line_error(r, 3, "not finite")
    assert not (out / "final").exists()
    for path in (out / "checkpoints").glob("step-*.pt"):
        state = torch.load(path, weights_only=True)["policy"]
        assert all(torch.isfinite(t).all() for t in state.values()), path


def test_the_divergence_rule_counts_a_window_as_well_as_a_streak():
    stop_if_diverged([1, 2], 2)  # two in a row: go on
    stop_if_diverged([1, 3, 5], 6)  # three of the last 20: go on
    with pytest.raises(Diverged, match="3 in a row"):
        stop_if_diverged([4, 5, 6], 6)
    with pytest.raises(Diverged, match="4 of the last 20"):
        stop_if_diverged([1, 2, 4, 6], 6)  # the --lr 1e30 pattern: never three in a row
    stop_if_diverged([1, 2, 4, 6], 30)  # long ago: forgotten


# --- everything a user can cause is one line ----------------------------------------------------------------------


def write(path: Path, text: str | bytes) -> Path:
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


@pytest.mark.parametrize(
    "case, words",
    [
        ("folder", ["is a folder"]),
        ("pipe", ["is a pipe"]),
        ("array", ["is a JSON array", "JSON Lines"]),
        ("utf8", ["data.jsonl:2", "not valid UTF-8", "0xff"]),
        ("empty_questions", ["data.jsonl:1", "question is empty"]),
    ],
)
def test_bad_data_files_are_named_for_what_they_are(tmp_path, case, words, main):
    data = tmp_path / "data.jsonl"
    row = '{"question": "1+1?", "answer": "#### 2"}\n'
    if case == "folder":
        data.mkdir()
    elif case == "pipe":
        os.mkfifo(data)
    elif case == "array":
        write(data, "[" + row.strip() + "]\n")
    elif case == "utf8":
        write(data, row.encode() + b'{"question": "caf\xff?", "answer": "#### 2"}\n')
    else:
        write(data, '{"question": " ", "answer": "#### 2"}\n' * 3)
    r = main("--task", "gsm8k", "--model", "x", "--data-files", data, "--out", tmp_path / "run")
    one_line_error(r, 2, *words)
    assert not (tmp_path / "run").exists()


def test_overlap_between_held_out_and_training_files_is_a_warning(tmp_path, main):
    rows = "".join(f'{{"question": "q{i}?", "answer": "#### {i}"}}\n' for i in range(6))
    data = write(tmp_path / "data.jsonl", rows)
    r = main("--task", "gsm8k", "--model", "tiny", "--data-files", data, "--eval-files", data, "--out", tmp_path / "r")
    assert "warning: 6 of the 6 held-out questions are also training questions" in r.stdout + r.stderr


def test_built_in_tasks_refuse_data_files(tmp_path, main):
    data = write(tmp_path / "data.jsonl", '{"question": "1+1?", "answer": "#### 2"}\n')
    r = main("--task", "arithmetic", "--data-files", data, "--out", tmp_path / "run")
    one_line_error(r, 2, "--data-files", "--task gsm8k")


def test_out_or_cache_dir_that_is_a_file_and_an_out_that_cannot_be_made(tmp_path, warm_cache, main):
    a_file = write(tmp_path / "a_file", "x")
    one_line_error(main(*tiny(warm_cache, a_file, 1)), 2, "--out", "is a file")
    one_line_error(main(*tiny(warm_cache, a_file / "run", 1)), 2, "--out", "cannot be written")
    r = main("--cache-dir", a_file, "--out", tmp_path / "run")
    one_line_error(r, 2, "--cache-dir", "is a file")


def test_a_full_disk_during_a_checkpoint_is_one_line(tmp_path, warm_cache, monkeypatch, capsys):
    def full(*a, **kw):
        raise OSError(28, "No space left on device", str(tmp_path / "run" / "checkpoints"))

    import bookkeeping.harness

    monkeypatch.setattr(bookkeeping.harness, "save_checkpoint", full)
    status = train.main([str(a) for a in tiny(warm_cache, tmp_path / "run", 2, "--save-every", "1")])
    err = error_lines(capsys.readouterr().err)
    assert status == 2 and len(err) == 1 and "No space left on device" in err[0], err
    assert "1 of 2 steps done" in err[0] and "no checkpoint" in err[0]


@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_and_sigterm_end_with_one_line_saying_how_to_resume(tmp_path, warm_cache, sig, status):
    out = tmp_path / "run"
    p = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *map(str, tiny(warm_cache, out, 400, "--save-every", "1"))],
        cwd=ROOT,
        env=ENV,
        stderr=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert wait_for(lambda: any((out / "checkpoints").glob("step-*.pt")) if (out / "checkpoints").exists() else False)
    p.send_signal(sig)
    _, err = p.communicate(timeout=120)
    lines = error_lines(err)
    assert p.returncode == status and len(lines) == 1, err[-2000:]
    assert f"python train.py --resume --out {out}" in lines[0] and " of 400 steps done" in lines[0]
    assert "newest checkpoint step-" in lines[0]


def test_help_is_grouped_shows_the_allowed_values_and_each_default_once():
    text = config.build_parser().format_help()
    for group in config.help_groups():  # the dataclass's sections, in order
        assert f"\n{group}:\n" in text
    assert "--clip-center {pi_k,alpha,decoupled}" in text and "--task {arithmetic,gsm8k,wordproblems,math}" in text
    assert text.count("(default: 400)") == 1 and "%(default)" not in text
    for action in config.build_parser()._actions:  # each default once: argparse adds none of its own
        assert (action.help or "").count("default") <= 1, action.help
    # About three lines a flag at most (59 flags): a help page, not a manual (docs/flags.md explains each group).
    assert len(text.splitlines()) < 3 * len(config.fields(config.Config)) and text.startswith("usage: python train.py")


def test_output_files_follow_the_users_umask(tmp_path, warm_cache, main):
    out = tmp_path / "run"
    old = os.umask(0o022)
    try:
        r = main(*tiny(warm_cache, out, 1, "--save-every", "1"))
    finally:
        os.umask(old)
    assert r.returncode == 0, r.stderr[-2000:]
    for path in (out / "config.json", out / "summary.json", out / "final" / "model.safetensors"):
        assert path.stat().st_mode & 0o777 == 0o644, path
    assert next((out / "checkpoints").glob("step-*.pt")).stat().st_mode & 0o777 == 0o644
    assert (out / "final").stat().st_mode & 0o777 == 0o755


def test_absolute_keeps_none_and_expands_the_home_folder():
    assert config.absolute(None) is None and config.absolute("~/x") == str(Path.home() / "x")


# --- issue 44: a full disk while saving, a start killed before step 1, what --overwrite names -----------------------


def test_a_full_disk_while_saving_a_checkpoint_keeps_the_newest_good_one_and_resume_continues(
    tmp_path, warm_cache, monkeypatch, main
):
    out = tmp_path / "run"
    real_save, calls = torch.save, []

    def save(obj, f, *a, **kw):  # the second checkpoint fills the disk halfway: torch's writer raises RuntimeError
        calls.append(1)
        if len(calls) == 2:
            f.write(b"PK\x03\x04" + b"\x00" * 8192)
            raise RuntimeError("[enforce fail at inline_container.cc:672] PytorchStreamWriter failed writing file")
        return real_save(obj, f, *a, **kw)

    class Full:  # and the disk has no room left when it does
        def __init__(self, path):
            self.f_bavail, self.f_frsize = 0, 4096

    monkeypatch.setattr(torch, "save", save)
    monkeypatch.setattr(os, "statvfs", Full)
    r = main(*tiny(warm_cache, out, 3, "--save-every", 1))
    monkeypatch.undo()
    line = one_line_error(r, 2, "[Errno 28]", "writing the checkpoint failed", "step-00000002.pt")
    assert "2 of 3 steps done, newest checkpoint step-00000001.pt" in line and "--resume --out" in line
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000001.pt"]  # no half-written file
    assert torch.load(out / "checkpoints" / "step-00000001.pt", weights_only=True)["step"] == 1
    r = main("--resume", "--out", out)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "at step 1" in r.stdout + r.stderr and steps_logged(out) == [0, 1, 2] and (out / "final").is_dir()


def test_a_full_disk_while_saving_the_final_model_keeps_the_checkpoints(tmp_path, warm_cache, monkeypatch, main):
    from transformers import PreTrainedModel

    def full(self, path, *a, **kw):
        (Path(path) / "model.safetensors").write_bytes(b"\x00" * 4096)
        raise OSError(errno.ENOSPC, "No space left on device")

    out = tmp_path / "run"
    monkeypatch.setattr(PreTrainedModel, "save_pretrained", full)
    r = main(*tiny(warm_cache, out, 2, "--save-every", 2))
    monkeypatch.undo()
    one_line_error(r, 2, "[Errno 28]", "writing the final model failed", str(out / "final"), "newest checkpoint")
    assert sorted(p.name for p in out.iterdir() if p.name.startswith((".final", "final"))) == []  # no temporary
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-00000002.pt"]
    r = main("--resume", "--out", out)  # the checkpoint is at the last step: the resume writes the end again
    assert r.returncode == 0, r.stderr[-2000:]
    assert (out / "final" / "model.safetensors").is_file() and steps_logged(out) == [0, 1]


def killed_start(out: Path, *args) -> None:
    """--out as a start killed (kill -9) after it claimed the folder and wrote config.json, before its first step:
    RunWriter's files and lock as they are then, and nothing cleaned up."""
    from bookkeeping.run_io import RunWriter

    args_, given = config.parse_args([str(a) for a in args])
    writer = RunWriter(config.config_from_args(args_, given))
    writer.record({"reward_names": ["math"]})
    for f in (writer._metrics, writer._completions, writer._lock):  # what the kernel closes when the process dies
        if f is not None:
            f.close()


def test_a_start_killed_before_step_1_is_started_again_by_the_same_command(tmp_path, warm_cache, main):
    out = tmp_path / "run"
    cmd = tiny(warm_cache, out, 1, "--log-completions", 1)
    killed_start(out, *cmd)
    assert {"config.json", ".lock", "metrics.jsonl"} <= {p.name for p in out.iterdir()}
    before = snapshot(out)
    # --resume and a new run say the same: nothing to resume, the command without --resume starts it again.
    line = one_line_error(main("--resume", "--out", out), 2, "never finished a step", "without --resume")
    assert "no checkpoint" in line and snapshot(out) == before
    r = main(*cmd)
    assert r.returncode == 0, r.stderr[-2000:]
    assert steps_logged(out) == [0] and (out / "final").is_dir()


def test_a_killed_start_among_files_of_ones_own_is_refused_naming_them(tmp_path, warm_cache, main):
    out = tmp_path / "run"
    cmd = tiny(warm_cache, out, 1)
    killed_start(out, *cmd)
    (out / "notes.txt").write_text("mine")
    before = snapshot(out)
    line = one_line_error(main(*cmd), 2, "not a run's (notes.txt)")
    assert "config.json" not in line and snapshot(out) == before


def test_a_run_without_checkpoints_is_not_offered_to_resume(finished_run, tmp_path, warm_cache, main):
    out = copy_run(finished_run, tmp_path / "run")
    for ck in (out / "checkpoints").iterdir():  # a run without --save-every: steps logged, nothing to resume from
        ck.unlink()
    before = snapshot(out)
    line = one_line_error(main(*tiny(warm_cache, out, 2)), 2, "saved no checkpoint", "--overwrite starts it over")
    assert "--resume continues" not in line
    one_line_error(main("--resume", "--out", out), 2, "the run saved none", "--overwrite starts it over")
    assert snapshot(out) == before
    r = main(*tiny(warm_cache, out, 1, "--overwrite"))
    assert r.returncode == 0 and steps_logged(out) == [0], r.stderr[-2000:]


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_a_refused_folder_names_the_files_in_the_way_and_no_others(finished_run, tmp_path, warm_cache, main, overwrite):
    out = copy_run(finished_run, tmp_path / "run")
    write(out / "notes.txt", "mine")
    write(out / ".env", "SECRET=1")  # a hidden file of one's own is no temporary file of the run's
    before = snapshot(out)
    line = one_line_error(main(*tiny(warm_cache, out, 1, *overwrite)), 2, "not a run's (.env, notes.txt)")
    assert not any(name in line for name in ("config.json", "metrics.jsonl", "checkpoints", "summary.json", "final"))
    assert snapshot(out) == before
    # Six of one's own: five named, the rest counted.
    for i in range(4):
        write(out / f"mine{i}.txt", "x")
    line = one_line_error(main(*tiny(warm_cache, out, 1, *overwrite)), 2, "and 1 more")
    assert ".env, mine0.txt, mine1.txt, mine2.txt, mine3.txt and 1 more" in line


# --- issue 51: nothing of the user's is ever deleted; every check before the old run goes -------------------------


def users_files(folder: Path, *names: str) -> None:
    for name in names:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        write(folder / name, f"the user's {name}")


@pytest.mark.parametrize(
    "run, overwrite, files",
    [
        (False, [], ["tensorboard/old_experiment/events.out.tfevents.1", "wandb/run-notes.txt"]),
        (False, [], ["checkpoints/checkpoint-500/pytorch_model.bin"]),
        (True, ["--overwrite"], ["checkpoints/best-so-far.pt", "checkpoints/README.txt", ".config.json.orig"]),
        (True, ["--overwrite"], ["final/model.bin", "wandb/notes/.keep"]),
        (False, ["--overwrite"], ["final/model.bin"]),
    ],
)
def test_files_of_ones_own_at_any_depth_are_named_and_left_in_place(
    finished_run, tmp_path, warm_cache, main, run, overwrite, files
):
    out = copy_run(finished_run, tmp_path / "run") if run else tmp_path / "run"
    users_files(out, *files)
    before = snapshot(out)
    line = one_line_error(main(*tiny(warm_cache, out, 1, *overwrite)), 2, "not a run's", "nothing was deleted")
    assert all(name in line for name in files) and snapshot(out) == before
    if run and "final/model.bin" in files:  # the end of a resumed run replaces final/: refused before, too
        one_line_error(main("--resume", "--out", out, "--steps", 3), 2, "final/model.bin", "nothing was deleted")
        assert snapshot(out) == before
    if not run:  # a folder that never was a run is not called one, and --resume does not send the user back
        line = one_line_error(main("--resume", "--out", out), 2, "holds no run to continue")
        assert "without --resume" in line and snapshot(out) == before


def test_the_two_config_json_messages_say_what_to_do(finished_run, tmp_path, warm_cache, main):
    out = copy_run(finished_run, tmp_path / "run")
    (out / "config.json").unlink()  # a run that lost its config.json: it cannot be resumed
    before = snapshot(out)
    line = one_line_error(main(*tiny(warm_cache, out, 1)), 2, "config.json is missing or damaged", "--overwrite")
    assert "--resume continues" not in line
    one_line_error(main("--resume", "--out", out), 2, "config.json is missing", "restore it", "--overwrite")
    assert snapshot(out) == before
    r = main(*tiny(warm_cache, out, 1, "--overwrite"))  # what both said: it works
    assert r.returncode == 0 and steps_logged(out) == [0], r.stderr[-2000:]


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--model", "Qwen/Qwen2.5-0.5B-Instrct"], "cannot be loaded"),
        (["--max-new-tokens", "100000"], "leaves no room for a prompt"),
        (["--dataset", "chat.jsonl", "--max-new-tokens", "8"], "needs a chat template"),
    ],
)
def test_overwrite_deletes_the_old_run_only_after_every_check_passed(
    finished_run, tmp_path, warm_cache, main, monkeypatch, extra, words
):
    monkeypatch.chdir(tmp_path)
    chat = [{"prompt": [{"role": "user", "content": f"{a}+1="}], "answer": str(a + 1)} for a in range(20)]
    write(tmp_path / "chat.jsonl", "".join(json.dumps(row) + "\n" for row in chat))
    out = copy_run(finished_run, tmp_path / "run")
    before = snapshot(out)
    r = main(*tiny(warm_cache, out, 1, "--overwrite", *extra))
    assert r.returncode == 2 and words in r.stderr, r.stderr[-2000:]
    lock = ".lock"  # holds the pid of the last process that claimed the folder: this one's
    assert {k: v for k, v in snapshot(out).items() if k != lock} == {k: v for k, v in before.items() if k != lock}


def test_a_manifest_lists_every_file_the_run_wrote_and_overwrite_deletes_those(
    finished_run, tmp_path, warm_cache, main
):
    from bookkeeping.manifest import Manifest, sort_out

    needs("tensorboard", "tensorboard")  # the new run writes TensorBoard's events too
    out = copy_run(finished_run, tmp_path / "run")
    manifest = Manifest.load(out)
    on_disk = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()} - {".lock", "manifest.json"}
    assert set(manifest.files) == on_disk  # every file the run wrote, none other
    ours, theirs = sort_out(out, manifest)
    assert set(ours) == on_disk | {".lock", "manifest.json"} and theirs == []
    r = main(*tiny(warm_cache, out, 1, "--overwrite", "--report-to", "tensorboard"))
    assert r.returncode == 0, r.stderr[-2000:]
    manifest = Manifest.load(out)
    on_disk = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()} - {".lock", "manifest.json"}
    assert set(manifest.files) == on_disk and any(f.startswith("tensorboard/events.out.tfevents.") for f in on_disk)
    assert not (out / "checkpoints").exists()  # the old run's, deleted by name
