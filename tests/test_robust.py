"""Failure modes: exact resume after SIGKILL, one-line errors on bad input, non-finite steps."""

import errno
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

import train
from bookkeeping.checkpoint import atomic_save_pretrained, latest_checkpoint, load_checkpoint, save_checkpoint
from config import Config, resolve
from conftest import ROOT, TEST_WARMUP

# Trains or decodes a model: CI runs these again under ATEN_CPU_CAPABILITY=default (plain kernels).
pytestmark = pytest.mark.model

ENV = {"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def cli(*args, timeout=300):
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=ENV,
    )


def small_run(cache, out, steps=12):
    return [
        "--steps",
        str(steps),
        "--offpolicy-steps",
        "4",
        "--beta",
        "0.04",
        "--prompts-per-step",
        "4",
        "--group-size",
        "4",
        "--lr",
        "1e-4",
        "--eval-size",
        "20",
        "--eval-every",
        "5",
        "--save-every",
        "3",
        "--warmup-steps",
        str(TEST_WARMUP),
        "--cache-dir",
        cache,
        "--out",
        str(out),
        "--no-progress",
    ]


def test_sigkill_then_resume_gives_the_same_final_weights(warm_cache, tmp_path):
    ref_out, cut_out = tmp_path / "uninterrupted", tmp_path / "killed"
    r = cli(*small_run(warm_cache, ref_out, steps=24))
    assert r.returncode == 0, r.stderr[-2000:]

    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *small_run(warm_cache, cut_out, steps=24)],
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 240
    while latest_checkpoint(str(cut_out)) is None and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)  # right after the first checkpoint landed
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    assert not (cut_out / "final").exists()
    killed_at = int(latest_checkpoint(str(cut_out)).stem.split("-")[1])
    assert killed_at < 24 and killed_at % 4 != 0  # mid-period (v = 4, a checkpoint every 3 steps): a stale step

    r = cli("--resume", "--out", str(cut_out), "--no-progress")
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"at step {killed_at}" in r.stdout + r.stderr
    a = load_file(ref_out / "final" / "model.safetensors")
    b = load_file(cut_out / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    steps = [json.loads(line)["step"] for line in (cut_out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(24))  # every step logged exactly once
    ref_summary = json.loads((ref_out / "summary.json").read_text())
    cut_summary = json.loads((cut_out / "summary.json").read_text())
    assert cut_summary["eval_accuracy_end"] == ref_summary["eval_accuracy_end"]
    assert len(list((cut_out / "checkpoints").glob("step-*.pt"))) == 2  # --keep-checkpoints 2


def test_half_written_checkpoints_are_never_loaded(tmp_path):
    out = str(tmp_path)
    save_checkpoint(out, {"step": 3}, 3, keep=2)
    (tmp_path / "checkpoints" / ".tmp-abc.pt").write_bytes(b"\x00garbage")  # a crash mid-write
    (tmp_path / "checkpoints" / "step-00000009.pt.partial").write_bytes(b"")
    assert latest_checkpoint(out).name == "step-00000003.pt"
    for k in (6, 9, 12):
        save_checkpoint(out, {"step": k}, k, keep=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*.pt")) == [
        "step-00000009.pt",
        "step-00000012.pt",
    ]


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


GOOD = json.dumps({"question": "1+1?", "answer": "1+1=2\n#### 2"})


@pytest.mark.parametrize(
    "case,expect",
    [
        ("missing", "no such file"),
        ("empty", "has no rows"),
        ("notjson", ":2: not valid JSON"),
        ("nofield", ":2: row needs string fields 'question' and 'answer'"),
        ("nonumber", ":3: answer has no parseable final number"),
    ],
)
def test_bad_data_files_get_a_one_line_error(tmp_path, case, expect):
    files = {
        "missing": str(tmp_path / "nope.jsonl"),
        "empty": write(tmp_path, "e.jsonl", "\n"),
        "notjson": write(tmp_path, "j.jsonl", GOOD + "\n{not json\n"),
        "nofield": write(tmp_path, "f.jsonl", GOOD + '\n{"question": "q"}\n'),
        "nonumber": write(tmp_path, "n.jsonl", GOOD + "\n" + GOOD + '\n{"question": "q", "answer": "#### many"}\n'),
    }
    r = cli("--task", "gsm8k", "--data-files", files[case], "--model", "/nonexistent", "--out", str(tmp_path / "o"))
    assert_one_line_error(r, expect)
    assert files[case] in r.stderr or case == "missing"
    assert not (tmp_path / "o").exists()  # nothing written for a run that never started


@pytest.mark.parametrize(
    "args,expect",
    [
        (["--group-size", "1"], "--group-size must be >= 2"),
        (["--offpolicy-steps", "0"], "--offpolicy-steps must be >= 1"),
        (["--prompts-per-step", "0"], "--prompts-per-step must be >= 1"),
        (["--micro-batch", "5"], "--micro-batch 5 must divide the batch N"),
        (["--lr", "-1"], "--lr must be >= 0"),
        (["--beta", "-0.1"], "--beta must be >= 0"),
        (["--clip-eps", "-0.2"], "--clip-eps must be >= 0"),
        (["--temperature", "0"], "--temperature must be > 0"),
        (["--task", "chess"], "--task: unknown value 'chess'"),
        (["--clip-center", "middle"], "--clip-center: unknown value"),
        (["--is-cap", "2"], "--is-cap needs --loss grpo --clip-center decoupled"),
        (["--is-mask", "0.5"], "--is-mask needs --loss grpo and a value >= 1"),
        (["--kl-estimator", "k4"], "--kl-estimator: unknown value"),
        (
            ["--model", "/no/such/model", "--task", "gsm8k", "--data-files", "DATA"],
            "--model /no/such/model: no such folder",
        ),
        (
            ["--model", "no-such-org/no-such-model", "--task", "gsm8k", "--data-files", "DATA"],
            "--model no-such-org/no-such-model: cannot be loaded",
        ),
        (["--resume", "--out", "EMPTY"], "--resume:"),
        # The hub is unreachable here (HF_HUB_OFFLINE=1): one line that names the way out.
        (["--task", "gsm8k"], "pass a local JSONL with --data-files"),
        # A flag that cannot act in the run it was given to.
        (["--loss", "opmd", "--clip-center", "decoupled"], "--clip-center decoupled: cannot act here"),
        (["--loss", "opmd", "--clip-eps", "0.3"], "--clip-eps 0.3: cannot act here"),
        (["--loss", "rec", "--beta", "0.04"], "--beta 0.04: cannot act here"),
        (["--kl-estimator", "k1"], "--kl-estimator k1: cannot act here"),
        (["--tau-reg", "0.5"], "--tau-reg 0.5: cannot act here"),
        (["--red-tau", "2"], "--red-tau 2.0: cannot act here"),
    ],
)
def test_bad_flags_get_a_one_line_error(tmp_path, args, expect):
    data = write(tmp_path, "d.jsonl", "\n".join([GOOD] * 600))
    args = [data if a == "DATA" else str(tmp_path / "empty") if a == "EMPTY" else a for a in args]
    r = cli(*args, "--cache-dir", str(tmp_path / "cache"))
    assert_one_line_error(r, expect)
    assert not (tmp_path / "cache").exists()  # checked before any model was built or loaded


def assert_one_line_error(r, expect):
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and expect in lines[0], r.stderr


def test_prompts_longer_than_the_context_are_skipped_with_a_count():
    # The tiny model's context is 64 positions: with 8 new tokens, a prompt may use 56.
    from engine import tiny
    from problems.tasks import Problem, TaskError, fit_context

    tok = tiny.build_tokenizer()
    long_q = "1" * 80 + "+1="
    kept, dropped = fit_context(tok, [Problem(long_q, "2"), Problem("1+1=", "2")], 56, "training")
    assert dropped == 1 and kept == [Problem("1+1=", "2")]
    with pytest.raises(TaskError, match="every training prompt is longer"):
        fit_context(tok, [Problem(long_q, "2")], 56, "training")


def test_non_finite_gradients_skip_the_step_and_three_stop_the_run(model, tok, tmp_path, warm_cache):
    from test_train import make_batch

    batch = make_batch(model, tok)
    batch.advantages = batch.advantages * float("nan")
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    st, _ = train.update(resolve(Config(out=str(tmp_path))), model, opt, batch, None)
    assert st["nonfinite_updates"] == 1
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # no optimizer step

    r = cli(
        "--lr",
        "1e30",
        "--steps",
        "20",
        "--save-every",
        "1",
        "--warmup-steps",
        str(TEST_WARMUP),
        "--cache-dir",
        warm_cache,
        "--eval-size",
        "10",
        "--out",
        str(tmp_path / "o"),
        "--no-progress",
    )
    assert_one_line_error_tail(r, "not finite, 3 in a row", status=3)  # its own exit status
    rows = [json.loads(line) for line in (tmp_path / "o" / "metrics.jsonl").read_text().splitlines()]
    bad = [row["step"] for row in rows if row["nonfinite_updates"]]
    assert len(bad) == 3 and bad == list(range(bad[0], bad[0] + 3))
    last_ck = latest_checkpoint(str(tmp_path / "o"))
    assert last_ck is not None and int(last_ck.stem.split("-")[1]) == bad[0]  # written before the streak


def test_a_run_whose_every_update_was_not_finite_says_so_and_exits_3(tmp_path, warm_cache, monkeypatch, capsys):
    # Issue 51: 2 steps, both non-finite, are no streak of 3; the run used to end with status 0 and no word.
    real = train.update

    def nan_update(cfg, policy, opt, batch, ref_logp, **kw):
        batch.advantages = batch.advantages * float("nan")  # as the test above: the update is skipped
        return real(cfg, policy, opt, batch, ref_logp, **kw)

    monkeypatch.setattr(train, "update", nan_update)
    args = ["--steps", "2", "--prompts-per-step", "2", "--group-size", "4", "--eval-size", "4", "--no-progress"]
    args += ["--warmup-steps", str(TEST_WARMUP), "--cache-dir", warm_cache, "--out", str(tmp_path / "o")]
    assert train.main(args) == 3
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1] == (
        "error: steps 0-1: loss or gradient not finite at every step, no update applied; stopping (try a lower --lr)"
    ), lines[-3:]
    rows = [json.loads(line) for line in (tmp_path / "o" / "metrics.jsonl").read_text().splitlines()]
    assert [r["nonfinite_updates"] for r in rows] == [1, 1]  # each step was non-finite: the premise
    assert not (tmp_path / "o" / "final").exists() and not (tmp_path / "o" / "summary.json").exists()


def assert_one_line_error_tail(r, expect, status=2):
    assert r.returncode == status, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: ") and expect in r.stderr.strip().splitlines()[-1]


# --- issue 44: a write that fails (a full disk) keeps the newest good checkpoint and final/ -------------------------


class FullDisk:
    """os.statvfs of a disk with no block left (a write that failed there was a full disk)."""

    def __init__(self, real):
        self.real = real

    def __call__(self, path):
        st = self.real(path)
        return type("Full", (), {"f_bavail": 0, "f_frsize": st.f_frsize})()


def failing_save(exc):
    """torch.save that writes a first part of the file, then raises `exc`, as a disk that fills up mid-write."""

    def save(obj, f, *a, **kw):
        f.write(b"PK\x03\x04" + b"\x00" * 4096)
        raise exc

    return save


STREAM = RuntimeError("[enforce fail at inline_container.cc:672] PytorchStreamWriter failed writing file data/3")


@pytest.mark.parametrize(
    "exc, full, code",
    [
        (OSError(errno.ENOSPC, "No space left on device"), False, errno.ENOSPC),  # Python's write noticed
        (STREAM, True, errno.ENOSPC),  # torch's stream writer noticed, and the disk is full
        (STREAM, False, errno.EIO),  # a write that failed on a disk with room: not called a full disk
        (OSError(errno.EDQUOT, "Disk quota exceeded"), False, errno.EDQUOT),
    ],
)
def test_a_checkpoint_write_that_fails_is_an_oserror_naming_it_and_keeps_the_older_one(
    tmp_path, monkeypatch, exc, full, code
):
    out = str(tmp_path)
    good = save_checkpoint(out, {"step": 1, "w": torch.arange(3.0)}, 1, keep=2)
    monkeypatch.setattr(torch, "save", failing_save(exc))
    if full:
        monkeypatch.setattr(os, "statvfs", FullDisk(os.statvfs))
    with pytest.raises(OSError) as e:
        save_checkpoint(out, {"step": 2}, 2, keep=1)
    monkeypatch.undo()
    assert e.value.errno == code and e.value.filename == str(tmp_path / "checkpoints" / "step-00000002.pt")
    assert "writing the checkpoint failed" in str(e.value) and "\n" not in str(e.value)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000001.pt"]  # no temporary
    assert latest_checkpoint(out) == good and torch.equal(load_checkpoint(good)["w"], torch.arange(3.0))


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), TypeError("cannot pickle 'generator' object")])
def test_what_is_no_write_error_is_raised_as_it_is_and_leaves_no_temporary(tmp_path, monkeypatch, exc):
    save_checkpoint(str(tmp_path), {"step": 1}, 1, keep=2)
    monkeypatch.setattr(torch, "save", failing_save(exc))
    with pytest.raises(type(exc)):
        save_checkpoint(str(tmp_path), {"step": 2}, 2, keep=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000001.pt"]


class SafetensorError(Exception):
    """safetensors' own error type (by name: safetensors_rust.SafetensorError), which a full disk raises there."""


class Writes:
    def __init__(self, exc=None):
        self.exc = exc

    def save_pretrained(self, path):
        (path / "model.safetensors").write_bytes(b"\x00" * 1000)  # a first part, then the disk is full
        if self.exc is not None:
            raise self.exc


@pytest.mark.parametrize(
    "exc, code",
    [
        (OSError(errno.ENOSPC, "No space left on device"), errno.ENOSPC),
        (RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed"), errno.ENOSPC),
        (SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space'), 28),
    ],
)
def test_a_final_model_write_that_fails_keeps_the_previous_one(tmp_path, monkeypatch, exc, code):
    final = tmp_path / "final"
    atomic_save_pretrained(Writes(), Writes(), final)
    before = {p.name: p.read_bytes() for p in final.iterdir()}
    monkeypatch.setattr(os, "statvfs", FullDisk(os.statvfs))
    with pytest.raises(OSError) as e:
        atomic_save_pretrained(Writes(exc), Writes(), final)
    monkeypatch.undo()
    assert e.value.errno == code and e.value.filename == str(final) and "writing the final model failed" in str(e.value)
    assert {p.name: p.read_bytes() for p in final.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["final"]  # no temporary folder left beside it


# --- issue 51: a checkpoint is verified before it is trusted ----------------------------------------------------------


def test_a_checkpoint_records_the_sha256_of_its_bytes_and_rotates_only_its_own(tmp_path):
    import hashlib

    from bookkeeping.manifest import Manifest

    manifest = Manifest(tmp_path)
    paths = [save_checkpoint(str(tmp_path), {"step": k, "w": torch.arange(3.0) * k}, k, 2, manifest) for k in (1, 2)]
    for path in paths:  # hashed while written: the same digest as hashlib's over the file read back
        assert manifest.files[f"checkpoints/{path.name}"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert Manifest.load(tmp_path).files == manifest.files
    mine = tmp_path / "checkpoints" / "step-00000000.pt"  # the user's, named like one: not ours to delete
    torch.save({"step": 0}, mine)
    save_checkpoint(str(tmp_path), {"step": 3}, 3, 2, manifest)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step-00000000.pt",
        "step-00000002.pt",
        "step-00000003.pt",
    ]
    assert "checkpoints/step-00000001.pt" not in manifest.files


def flip_middle(path, n=4096):
    """XOR n bytes in the middle of a file: same size, still a zip torch may read."""
    data = bytearray(path.read_bytes())
    m = len(data) // 2
    data[m : m + n] = bytes(x ^ 0xFF for x in data[m : m + n])
    path.write_bytes(bytes(data))


def test_a_damaged_or_foreign_checkpoint_is_skipped_and_the_run_ends_as_the_uninterrupted_one(
    tmp_path, warm_cache, main
):
    from test_run_folder import snapshot, tiny

    full = tmp_path / "full"
    r = main(*tiny(warm_cache, full, 3, "--save-every", 1, "--keep-checkpoints", 3))
    assert r.returncode == 0, r.stderr[-2000:]
    run = tmp_path / "run"
    subprocess.run(["cp", "-r", str(full), str(run)], check=True)
    flip_middle(run / "checkpoints" / "step-00000003.pt")
    flip_middle(run / "checkpoints" / "step-00000002.pt")
    torch.save({"step": 99}, run / "checkpoints" / "step-00000099.pt")  # torch reads it; the run did not write it
    final = snapshot(run / "final")
    r = main("--resume", "--out", run)
    assert r.returncode == 0, r.stderr[-2000:]
    skipped = [line for line in (r.stdout + r.stderr).splitlines() if "--resume: skipped" in line]
    assert len(skipped) == 3 and "step-00000099.pt: this run did not write it" in skipped[0]
    assert all("damaged" in line for line in skipped[1:]) and "at step 1" in r.stdout + r.stderr
    # Steps 1 and 2 again from the intact checkpoint: final/ is the uninterrupted run's, byte for byte.
    assert snapshot(run / "final") == final
    # An old run (no manifest.json, so no sha256): a file torch reads but the run did not write is skipped too.
    (run / "manifest.json").unlink()
    r = main("--resume", "--out", run, "--steps", 3)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "step-00000099.pt: not a checkpoint this run wrote (no 'policy')" in r.stdout + r.stderr
