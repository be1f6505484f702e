"""run_io.py: the run's pictures and its TensorBoard scalars are the metrics it logged."""

import json

import pytest

from bookkeeping import run_io
from config import Config, ConfigError, resolve
from conftest import needs


def rows(n=12):
    return [
        {
            "step": k,
            "reward": 0.1 * (k % 5),
            "kl": 0.01 * k,
            "clip_low": 0.0,
            "clip_high": 0.02,
            "entropy": 0.5,
            "rho_prime_max": 1.0 + 0.1 * k,
            "rho_prime_mean": 1.0,
            **({"eval_accuracy": 0.4} if k == 5 else {}),
        }
        for k in range(n)
    ]


def test_curves_png_has_one_panel_per_quantity(tmp_path):
    needs("matplotlib", "plot")
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows()))
    seen = []
    import matplotlib.figure

    real = matplotlib.figure.Figure.savefig
    spy = lambda fig, *a, **kw: seen.append([ax.get_title() for ax in fig.axes]) or real(fig, *a, **kw)  # noqa: E731
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(matplotlib.figure.Figure, "savefig", spy)
        path = run_io.write_curves(tmp_path, {"eval_accuracy_start": 0.3, "eval_accuracy_end": 0.5, "steps": 12})
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert seen == [[title for title, _, _ in run_io.PANELS]]


def test_tensorboard_logs_every_numeric_metric(tmp_path):
    needs("tensorboard", "tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = run_io.RunWriter(resolve(Config(out=str(tmp_path), report_to="tensorboard")))
    for r in rows(3):
        writer.metrics(r)
    writer._tb.close()
    events = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    assert sorted(events.Tags()["scalars"]) == sorted(f"grpo/{k}" for k in rows(3)[0] if k != "step")
    assert [e.value for e in events.Scalars("grpo/kl")] == pytest.approx([0.0, 0.01, 0.02])
    assert [e.step for e in events.Scalars("grpo/kl")] == [0, 1, 2]


def test_report_to_tensorboard_without_the_package_is_a_one_line_error(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_tensorboard(name, *a, **kw):
        if name.startswith("torch.utils.tensorboard"):
            raise ImportError("no tensorboard")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    with pytest.raises(ConfigError, match="--report-to tensorboard"):
        run_io.RunWriter(resolve(Config(out=str(tmp_path), report_to="tensorboard")))


# --- issue 44: no NaN or Infinity token in any file the run writes ------------------------------------------------

NAN, INF = float("nan"), float("inf")


def strict_json(text: str):
    """json.loads that refuses NaN, Infinity and -Infinity, as every JSON reader but Python's does."""
    return json.loads(text, parse_constant=lambda token: pytest.fail(f"{token} in a file the run wrote"))


class Saves:
    """A model or tokenizer whose save_pretrained writes one file (RunWriter.finish without a model)."""

    def save_pretrained(self, path):
        (path / f"{type(self).__name__}.bin").write_bytes(b"x")


def test_no_file_the_run_writes_holds_nan_or_infinity(tmp_path):
    out = tmp_path / "run"
    writer = run_io.RunWriter(resolve(Config(out=str(out), log_completions=2)))
    nested = {"a": [NAN, 1.5, {"b": -INF}], "c": (INF, 2), "d": {"e": {"f": NAN}}}
    writer.record({"odd": nested, "fine": 0.25})
    writer.metrics({"step": 0, "reward": NAN, "kl": INF, "loss": -INF, "entropy": 0.1234567, **nested})
    writer.completions([{"split": "train", "step": 0, "row": 0, "reward": NAN, "rewards": {"f": INF}, "x": [-INF]}])
    summary = {"eval_accuracy_start": NAN, "eval_accuracy_end": 0.5, "steps": 1, "eval_rewards/f_end": INF, **nested}
    writer.finish(Saves(), Saves(), summary)
    written = {p.name: p.read_text() for p in out.iterdir() if p.suffix in (".json", ".jsonl")}
    assert set(written) == {"config.json", "metrics.jsonl", "completions.jsonl", "summary.json", "manifest.json"}
    for name, text in written.items():
        assert "NaN" not in text and "Infinity" not in text, name
        for line in text.splitlines() if name.endswith(".jsonl") else [text]:
            strict_json(line)
    # Each non-finite value is null where it was, dicts, lists and tuples alike; finite ones are kept (rounded to 6
    # decimals in the logs only).
    expect = {"a": [None, 1.5, {"b": None}], "c": [None, 2], "d": {"e": {"f": None}}}
    assert strict_json(written["config.json"])["odd"] == expect and strict_json(written["config.json"])["fine"] == 0.25
    row = strict_json(written["metrics.jsonl"])
    assert row["reward"] is row["kl"] is row["loss"] is None and row["entropy"] == 0.123457
    assert {k: row[k] for k in expect} == expect
    line = strict_json(written["completions.jsonl"])
    assert line["reward"] is None and line["rewards"] == {"f": None} and line["x"] == [None]
    saved = strict_json(written["summary.json"])
    assert (
        saved["eval_accuracy_start"] is None
        and saved["eval_rewards/f_end"] is None
        and saved["eval_accuracy_end"] == 0.5
    )
    assert {k: saved[k] for k in expect} == expect


def test_a_nan_that_slips_past_the_mapping_is_an_error_not_a_file():
    # default= turns an unknown object into a float here: json_safe never saw it, allow_nan=False refuses it.
    with pytest.raises(ValueError, match="not JSON compliant"):
        run_io.to_json({"x": object()}, default=lambda o: NAN)
    assert run_io.to_json([NAN, {"y": (INF, -INF)}, 1e308 * 10]) == '[null, {"y": [null, null]}, null]'
    assert run_io.to_json(True) == "true" and run_io.to_json({"n": 10**30}) == '{"n": 1000000000000000000000000000000}'


# --- issue 44: --report-to wandb with no API key and no offline mode ----------------------------------------------


@pytest.fixture
def no_wandb_key(tmp_path, monkeypatch):
    """An environment where wandb finds no API key and no offline mode, and cannot prompt: no key, no netrc, no
    settings file; wandb.init fails the test if called (it would prompt or go to the network)."""
    wandb = needs("wandb", "wandb")
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DISABLED", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("NETRC", str(tmp_path / "home" / ".netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    monkeypatch.setattr(wandb, "init", lambda *a, **kw: pytest.fail("wandb.init called without a key"))
    return wandb


def test_report_to_wandb_without_a_key_or_offline_mode_is_one_line_before_anything(tmp_path, no_wandb_key):
    out = tmp_path / "run"
    with pytest.raises(ConfigError) as e:
        run_io.RunWriter(resolve(Config(out=str(out), report_to="tensorboard,wandb")))
    line = str(e.value)
    assert "\n" not in line and line.startswith("--report-to wandb: no W&B API key")
    assert all(fix in line for fix in ("WANDB_API_KEY", "`wandb login`", "WANDB_MODE=offline"))
    assert not out.exists()  # a start that failed leaves no run


def test_report_to_wandb_through_the_cli_is_exit_2_and_one_line(tmp_path, no_wandb_key, capsys, warm_cache):
    import train

    out = tmp_path / "run"
    args = ["--steps", "1", "--eval-size", "4", "--cache-dir", warm_cache, "--out", str(out), "--no-progress"]
    assert train.main([*args, "--report-to", "wandb"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "--report-to wandb" in err[0] and "WANDB_MODE=offline" in err[0], err
    assert not out.exists()


def test_offline_modes_need_no_key_and_a_malformed_key_is_named(tmp_path, no_wandb_key, monkeypatch):
    assert not run_io.wandb_offline()
    for mode in ("offline", "dryrun", "disabled", "OFFLINE"):
        monkeypatch.setenv("WANDB_MODE", mode)
        assert run_io.wandb_offline(), mode
    monkeypatch.setenv("WANDB_MODE", "online")
    assert not run_io.wandb_offline()
    monkeypatch.delenv("WANDB_MODE")
    (tmp_path / "wandb-config").mkdir()
    (tmp_path / "wandb-config" / "settings").write_text("[default]\nmode = offline\n")  # what `wandb offline` writes
    assert run_io.wandb_offline()
    (tmp_path / "wandb-config" / "settings").write_text("not an ini file\x00")
    assert not run_io.wandb_offline()
    monkeypatch.setenv("WANDB_API_KEY", "abc")  # too short to be a key: wandb says so, without the network
    with pytest.raises(ConfigError, match="--report-to wandb: .*WANDB_API_KEY"):
        run_io.RunWriter(resolve(Config(out=str(tmp_path / "run"), report_to="wandb")))


# --- issue 44: a full disk while writing config.json, summary.json or a log line names the file --------------------


def test_a_full_disk_while_writing_a_file_names_it_and_keeps_the_old_one(tmp_path, monkeypatch):
    import errno
    import os
    import tempfile

    path = tmp_path / "config.json"
    path.write_text('{"old": 1}\n')
    real = tempfile.mkstemp

    def on_a_full_disk(dir, prefix):  # the temporary file is real, its writes go to /dev/full
        fd, name = real(dir=dir, prefix=prefix)
        os.dup2(os.open("/dev/full", os.O_WRONLY), fd)
        return fd, name

    monkeypatch.setattr(tempfile, "mkstemp", on_a_full_disk)
    with pytest.raises(OSError) as e:
        run_io.atomic_write_text(path, "x" * 100_000)
    monkeypatch.undo()
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(path)
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"] and path.read_text() == '{"old": 1}\n'

    writer = run_io.RunWriter(resolve(Config(out=str(tmp_path / "run"))))
    writer._metrics.close()
    writer._metrics = open("/dev/full", "w")
    with pytest.raises(OSError) as e:
        writer.metrics({"step": 0, "reward": 0.5})
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(tmp_path / "run" / "metrics.jsonl")
    writer.close()


# --- issue 51: what in --out is the run's (bookkeeping/manifest.py) --------------------------------------------------


def test_what_is_the_runs_the_manifest_the_names_of_an_old_run_and_nothing_else(tmp_path):
    from bookkeeping.manifest import Manifest, remove, sort_out, the_run

    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "final").mkdir()
    (out / "wandb" / "offline-run-20260101_000000-abcd1234" / "files").mkdir(parents=True)
    (out / "wandb" / "run-20260101_000000-other999").mkdir()
    run = {
        "config.json": json.dumps({"offpolicy_steps": 1, "group_size": 2, "wandb_run_id": "abcd1234"}),
        "metrics.jsonl": "",
        ".lock": "123\n",
        ".tmp-offpolicy-grpo-4242-a1b2c3d4": "",  # our temporary file, left by a process that died writing one
        "checkpoints/step-00000002.pt": "",
        "checkpoints/.tmp-offpolicy-grpo-4242-zz99__aa.pt": "",
        "final/model.safetensors": "",
        "final/tokenizer.json": "",
        "tensorboard/events.out.tfevents.1.host.2.0": "",
        "wandb/offline-run-20260101_000000-abcd1234/files/output.log": "",
        "wandb/debug.log": "",
    }
    users = {
        ".config.json.orig": "",  # hidden files of the user's, named like our temporary ones used to be
        ".config.json.20251206": "",
        ".metrics.jsonl.backup01": "",
        ".final.20251206/notes.txt": "",
        "checkpoints/step-2.pt": "",
        "checkpoints/best-so-far.pt": "",
        "final/model.bin": "",
        "tensorboard/old/events.out.tfevents.9": "",
        "wandb/run-20260101_000000-other999/x": "",  # another run's wandb folder
        "notes.txt": "",
    }
    for name, text in {**run, **users}.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    (out / "empty-of-mine").mkdir()
    # An old run (no manifest.json): its files by the exact names a run writes, the rest the user's.
    ours, theirs = sort_out(out, the_run(out))
    assert set(theirs) == set(users) | {"empty-of-mine/"}
    assert set(ours) == (set(run) - {"wandb/offline-run-20260101_000000-abcd1234/files/output.log"}) | {
        "wandb/offline-run-20260101_000000-abcd1234/"
    }
    remove(out, ours)
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()) == sorted(users)
    # A folder with no run: nothing is the run's, not even files named like a run's; another program's .lock neither.
    (out / "metrics.jsonl").write_text("")
    (out / ".lock").write_text("held by my own tool")
    assert sort_out(out, the_run(out))[0] == [] and {".lock", "metrics.jsonl"} <= set(sort_out(out, None)[1])
    # A manifest: what it lists, and only that (a name it does not list is the user's, whatever it looks like).
    manifest = Manifest(out, {"metrics.jsonl": None})
    manifest.save()
    (out / ".lock").write_text("42\n")
    ours, theirs = sort_out(out, Manifest.load(out))
    assert set(ours) == {"metrics.jsonl", "manifest.json", ".lock"} and "checkpoints/step-2.pt" in theirs
    (out / "manifest.json").write_text('{"files": {"notes.txt": null}}')  # another program's manifest.json: no run
    assert Manifest.load(out) is None and the_run(out) is None
