"""Issue 44: what a run records of itself, and how a resume reads it back.

- a run records what it was trained on (bookkeeping/fingerprints.py: each reward's source, each local data file), and
  a resume after one changed is refused in one line that names the flag and the file;
- a resumed run's summary reads like the uninterrupted run's: the start's held-out metrics, every one, come with
  the checkpoint;
- resuming a finished run writes nothing twice (completions.jsonl's end evaluation);
- the resume cuts the logs back by the run's own step, never by a value a user wrote.

The runs are a few steps of the built-in tiny policy (tests/test_run_folder.py's helpers), in this process.
"""

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from bookkeeping import fingerprints as fp
from bookkeeping.checkpoint import save_checkpoint
from bookkeeping.run_io import RunWriter
from config import Config, ConfigError, resolve
from conftest import jsonl
from problems import user_rewards
from test_run_folder import one_line_error, snapshot, tiny

pytestmark = pytest.mark.model  # trains a model: CI runs these again under plain kernels

ROWS = [("12+34=", "46"), ("7*8=", "56"), ("99-9=", "90"), ("3+4=", "7"), ("50-25=", "25"), ("6*7=", "42")]
ROWS += [("11+11=", "22"), ("9*9=", "81"), ("40+2=", "42"), ("8-3=", "5"), ("5*5=", "25"), ("60+7=", "67")]

REWARD = """
def odd(completions, log_metric, log_extra, **kwargs):
    log_metric("odd_frac", sum(len(c) % 2 for c in completions) / len(completions))
    log_extra("chars", [len(c) for c in completions])
    return [None if len(c) % 2 else 1.0 for c in completions]
"""
MODULE = "def short(completions, **kw):\n    return [1.0 if len(c) < 4 else 0.0 for c in completions]\n"


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def own_task(tmp_path, monkeypatch, request):
    """A data file, a reward file and a reward module (a name of its own per test: modules are imported once per
    process) in tmp_path, the working directory; the flags that use them."""
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"prompt": q, "answer": a}) + "\n" for q, a in ROWS))
    (tmp_path / "mine.py").write_text(REWARD)
    module = f"fp_{request.node.name.replace('[', '_').replace(']', '_').replace('-', '_')}"
    (tmp_path / f"{module}.py").write_text(MODULE)
    monkeypatch.chdir(tmp_path)
    yield (
        {"data": tmp_path / "data.jsonl", "reward": tmp_path / "mine.py", "module": tmp_path / f"{module}.py"},
        [
            *("--dataset", "data.jsonl", "--reward", "math", "--reward", "mine.py:odd", "--reward", f"{module}:short"),
            *("--reward-weights", "1", "0.5", "0.25", "--max-new-tokens", "8"),
        ],
    )
    sys.modules.pop(module, None)
    user_rewards._modules.clear()


# --- fingerprints: what they are ------------------------------------------------------------------------------------


def test_fingerprints_are_the_sha256_of_each_reward_source_and_data_file(tmp_path, monkeypatch):
    (tmp_path / "r.py").write_text(REWARD)
    (tmp_path / "fp_unimported.py").write_text(MODULE)
    folder = tmp_path / "saved"
    (folder / "train").mkdir(parents=True)
    (folder / "dataset_dict.json").write_text('{"splits": ["train"]}')
    (folder / "train" / "data-00000-of-00001.arrow").write_bytes(b"\x00arrow")
    (folder / "train" / "state.json").write_text("{}")
    (tmp_path / "held.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    monkeypatch.chdir(tmp_path)
    cfg = resolve(Config(out="o", dataset="saved", eval_files="held.jsonl", reward=["math", "r.py:odd"]))
    cfg.reward += ["math-symbolic", "fp_unimported:short", "no_such_module_here:f"]
    found = fp.fingerprints(cfg)
    assert "fp_unimported" not in sys.modules  # found without importing it
    files = ["dataset_dict.json", "train/data-00000-of-00001.arrow", "train/state.json"]  # sorted by relative path
    assert [(e["flag"], e["file"], e["sha256"]) for e in found] == [
        ("--reward", str(tmp_path / "r.py"), sha(tmp_path / "r.py")),
        ("--reward", str(tmp_path / "fp_unimported.py"), sha(tmp_path / "fp_unimported.py")),
        *[("--dataset", str(folder / f), sha(folder / f)) for f in files],
        ("--eval-files", str(tmp_path / "held.jsonl"), sha(tmp_path / "held.jsonl")),
    ]
    assert [e.get("part") for e in found if e["flag"] == "--dataset"] == files
    # A hub name and the built-in rewards have none.
    assert fp.fingerprints(resolve(Config(out="o", dataset="openai/gsm8k", reward=["math", "math-symbolic"]))) == []


def test_a_change_of_contents_is_found_whatever_the_size_and_time_stamp(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    cfg = resolve(Config(out="o", dataset=str(data)))
    before = fp.fingerprints(cfg)
    st = data.stat()
    data.write_text('{"prompt": "1+1=", "answer": "3"}\n')  # one byte: the same size
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))  # and the same time stamp
    assert data.stat().st_size == st.st_size and data.stat().st_mtime_ns == st.st_mtime_ns
    with pytest.raises(ConfigError) as e:
        fp.check_unchanged(before, fp.fingerprints(cfg), tmp_path / "config.json", print)
    assert str(e.value) == (
        f"--resume: the data file {data} (--dataset {data}) changed since the run started; restore it, or start a "
        "new run (another --out)"
    )


def test_a_data_folder_that_lost_or_gained_a_file_is_refused(tmp_path):
    folder = tmp_path / "shards"
    folder.mkdir()
    for i in range(2):
        (folder / f"part-{i}.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    cfg = resolve(Config(out="o", dataset=str(folder)))
    before = fp.fingerprints(cfg)
    fp.check_unchanged(before, fp.fingerprints(cfg), tmp_path / "config.json", print)  # unchanged: no error
    (folder / "part-2.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError, match=r"data file .*part-2.jsonl \(--dataset .*shards\) was not there"):
        fp.check_unchanged(before, fp.fingerprints(cfg), tmp_path / "config.json", print)
    (folder / "part-2.jsonl").unlink()
    (folder / "part-0.jsonl").unlink()
    with pytest.raises(ConfigError, match=r"data file .*part-0.jsonl \(--dataset .*shards\) is gone since"):
        fp.check_unchanged(before, fp.fingerprints(cfg), tmp_path / "config.json", print)
    with pytest.raises(ConfigError, match="fingerprints"):  # config.json's own entry, edited into something else
        fp.check_unchanged({"a": 1}, before, tmp_path / "config.json", print)


# --- fingerprints: a resume --------------------------------------------------------------------------------------


def one_step_run(cache, out, flags, main) -> Path:
    r = main(*tiny(cache, out, 1, "--save-every", 1, *flags))
    assert r.returncode == 0, r.stderr[-2000:]
    return out


def change_keeping_size_and_time(path: Path, old: bytes, new: bytes) -> None:
    st = path.stat()
    text = path.read_bytes()
    assert len(old) == len(new) and old in text
    path.write_bytes(text.replace(old, new, 1))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.parametrize("what", ["reward", "module", "data"])
def test_a_resume_after_a_reward_or_the_data_changed_is_refused_naming_it(tmp_path, warm_cache, own_task, main, what):
    files, flags = own_task
    out = one_step_run(warm_cache, tmp_path / "run", flags, main)
    recorded = json.loads((out / "config.json").read_text())["fingerprints"]
    assert [(e["flag"], e["file"]) for e in recorded] == [
        ("--reward", str(files["reward"])),
        ("--reward", str(files["module"])),
        ("--dataset", str(files["data"])),
    ]
    assert [e["sha256"] for e in recorded] == [sha(files[k]) for k in ("reward", "module", "data")]
    if what == "reward":  # the function's body
        change_keeping_size_and_time(files["reward"], b"return [None", b"return [0.00")
    elif what == "module":
        change_keeping_size_and_time(files["module"], b"< 4", b"< 5")
    else:  # one byte of the data, its size and time stamp as they were
        change_keeping_size_and_time(files["data"], b'"46"', b'"47"')
    before = snapshot(out)
    r = main("--resume", "--out", out, "--steps", 2)
    flag = {"reward": "--reward", "module": "--reward", "data": "--dataset"}[what]
    kind = "data" if what == "data" else "reward"
    line = one_line_error(r, 2, f"--resume: the {kind} file {files[what]} ({flag} ", "changed since the run started")
    assert line.endswith("restore it, or start a new run (another --out)")
    assert snapshot(out) == before  # refused before anything was written


def test_an_unchanged_resume_is_the_uninterrupted_run_bit_for_bit_and_its_summary_too(
    tmp_path, warm_cache, own_task, main
):
    _, flags = own_task
    extra = [*flags, "--offpolicy-steps", 2, "--eval-samples", 2, "--log-completions", 2, "--keep-checkpoints", 5]
    full = tmp_path / "full"
    r = main(*tiny(warm_cache, full, 3, "--save-every", 1, *extra))
    assert r.returncode == 0, r.stderr[-2000:]
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    for name in ("final", "summary.json", "curves.png", "checkpoints/step-00000003.pt"):
        path = cut / name
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    r = main("--resume", "--out", cut)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "records no fingerprints" not in r.stdout + r.stderr
    wa, wb = load_file(full / "final" / "model.safetensors"), load_file(cut / "final" / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    timing = (
        "wall_s",
        "tokens_per_s",
        "peak_mem_gb",
        "peak_reserved_gb",
        "mem_gb",
        "t_sample",
        "t_score",
        "t_logprob",
        "t_update",
    )
    rows = [[{k: v for k, v in m.items() if k not in timing} for m in jsonl(p / "metrics.jsonl")] for p in (full, cut)]
    assert rows[0] == rows[1] and [m["step"] for m in rows[1]] == [0, 1, 2]
    assert jsonl(full / "completions.jsonl") == jsonl(cut / "completions.jsonl")
    # The summary reads like one run's: every *_start field the uninterrupted run's, the user rewards' ones among them.
    sa, sb = (json.loads((p / "summary.json").read_text()) for p in (full, cut))
    starts = sorted(k for k in sa if k.endswith("_start"))
    assert {"eval_accuracy_start", "eval_pass1_start", "eval_rewards/odd_start", "eval_reward_none_frac_start"} <= set(
        starts
    )
    assert all(sa[k] is not None for k in starts)
    assert {k: v for k, v in sa.items() if k not in ("wall_s", "out")} == {
        k: v for k, v in sb.items() if k not in ("wall_s", "out")
    }


def test_a_run_from_before_fingerprints_and_whole_starts_resumes_as_before(tmp_path, warm_cache, own_task, main):
    _, flags = own_task
    out = tmp_path / "run"
    r = main(*tiny(warm_cache, out, 2, "--save-every", 1, "--keep-checkpoints", 5, *flags))
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    for name in ("final", "summary.json", "checkpoints/step-00000002.pt"):
        shutil.rmtree(out / name) if (out / name).is_dir() else (out / name).unlink()
    saved = json.loads((out / "config.json").read_text())
    del saved["fingerprints"]
    (out / "config.json").write_text(json.dumps(saved))
    ck_path = out / "checkpoints" / "step-00000001.pt"
    ck = torch.load(ck_path, weights_only=True)
    del ck["eval_start"]  # a checkpoint as they were: the start's accuracy and pass@1 alone
    torch.save(ck, ck_path)
    (out / "manifest.json").unlink()  # nor was there a manifest (nor checkpoints' sha256) then
    r = main("--resume", "--out", out)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "records no fingerprints of the rewards and data" in r.stdout + r.stderr
    resumed = json.loads((out / "summary.json").read_text())
    assert resumed["eval_accuracy_start"] == summary["eval_accuracy_start"]
    assert resumed["eval_rewards/odd_start"] is None  # not kept then: unknown, as before
    assert json.loads((out / "config.json").read_text())["fingerprints"]  # recorded from now on


# --- a finished run's resume writes nothing twice ---------------------------------------------------------------


def test_resuming_a_finished_run_writes_nothing_twice(tmp_path, warm_cache, main):
    out = tmp_path / "run"
    r = main(*tiny(warm_cache, out, 2, "--save-every", 2, "--log-completions", 2))
    assert r.returncode == 0, r.stderr[-2000:]
    files = {name: (out / name).read_text() for name in ("metrics.jsonl", "completions.jsonl")}
    summary = json.loads((out / "summary.json").read_text())
    r = main("--resume", "--out", out)  # the checkpoint is at the last step: only the end evaluation runs again
    assert r.returncode == 0, r.stderr[-2000:]
    rows = jsonl(out / "completions.jsonl")
    keys = [(r["split"], r["step"], r.get("row", r["prompt"])) for r in rows]
    assert len(keys) == len(set(keys)) and {k[:2] for k in keys} == {
        ("eval", -1),
        ("train", 0),
        ("train", 1),
        ("eval", 1),
    }
    assert {name: (out / name).read_text() for name in files} == files
    resumed = json.loads((out / "summary.json").read_text())
    assert {k: v for k, v in resumed.items() if k != "wall_s"} == {k: v for k, v in summary.items() if k != "wall_s"}
    # Extended past its end: the old end's evaluation goes, the new end's comes; every train step once.
    r = main("--resume", "--out", out, "--steps", 3)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = jsonl(out / "completions.jsonl")
    assert [r["step"] for r in rows if r["split"] == "eval"] == [-1] * 4 + [2] * 4
    assert [(r["step"], r["row"]) for r in rows if r["split"] == "train"] == sorted(
        {(r["step"], r["row"]) for r in rows if r["split"] == "train"}
    )
    assert {r["step"] for r in rows if r["split"] == "train"} == {0, 1, 2}


def test_a_resume_keeps_the_loops_evaluation_before_the_checkpoint(tmp_path, warm_cache, main):
    full = tmp_path / "full"
    args = ("--save-every", 1, "--eval-every", 1, "--log-completions", 1, "--keep-checkpoints", 3)
    r = main(*tiny(warm_cache, full, 2, *args))
    assert r.returncode == 0, r.stderr[-2000:]
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    for name in ("final", "summary.json", "checkpoints/step-00000002.pt"):
        shutil.rmtree(cut / name) if (cut / name).is_dir() else (cut / name).unlink()
    r = main("--resume", "--out", cut)  # from step 1: the loop evaluated after step 0, before the checkpoint
    assert r.returncode == 0, r.stderr[-2000:]
    assert [r["step"] for r in jsonl(cut / "completions.jsonl") if r["split"] == "eval"] == [-1] * 4 + [0] * 4 + [1] * 4
    assert jsonl(full / "completions.jsonl") == jsonl(cut / "completions.jsonl")


# --- the resume cuts the logs by the run's own step ---------------------------------------------------------------


def resumable(out: Path, step: int) -> RunWriter:
    """A RunWriter resuming `out`, whose newest checkpoint is after `step` steps."""
    out.mkdir(exist_ok=True)
    (out / "config.json").write_text(json.dumps({"offpolicy_steps": 1, "group_size": 2}))
    save_checkpoint(str(out), {"step": step}, step, keep=2)
    return RunWriter(resolve(Config(out=str(out), resume=True, log_completions=1)))


def test_the_resume_cuts_the_logs_by_the_runs_step_never_a_value_a_user_wrote(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    # A file from before a reward's metrics had a prefix: a function logged "step" and overwrote the run's.
    odd = [0.5, "2", None, True, [3], {"k": 1}, 100.0]
    metrics = [{"step": 0, "reward": 0.1}] + [{"step": s, "reward": 0.2} for s in odd] + [{"reward": 0.3}]
    (out / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    completions = [{"split": "eval", "step": -1}, {"split": "train", "step": 0, "row": 0}]
    completions += [{"split": "train", "step": "x", "row": 1}, {"split": "train", "step": 4, "row": 0}]
    completions += [{"split": "train", "step": 4.0, "row": 1}, {"split": "train", "step": 5, "row": 0}]
    (out / "completions.jsonl").write_text("".join(json.dumps(c) + "\n" for c in completions))
    writer = resumable(out, 5)
    writer.truncate_metrics(5)
    writer.close()
    kept = jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in kept] == [0, 1, 2, 3, 4]  # each row's place in the run: steps 0-4 of 9 rows
    assert [m["reward"] for m in kept] == [0.1, 0.2, 0.2, 0.2, 0.2]
    assert [(c["step"], c.get("row")) for c in jsonl(out / "completions.jsonl")] == [
        (-1, None),
        (0, 0),
        (0, 1),
        (4, 0),
        (4, 1),
    ]


def test_a_bad_line_before_the_last_is_named_and_a_torn_last_one_dropped(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 0}\n[1, 2]\n{"step": 2}\n')
    before = (out / "metrics.jsonl").read_bytes()
    with pytest.raises(ConfigError, match=r"metrics.jsonl:2: not a JSON object; the run's metrics.jsonl is damaged"):
        resumable(out, 2)  # read at the open, before anything is written (issue 55): nothing was truncated
    assert (out / "metrics.jsonl").read_bytes() == before
    (out / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n{"step": 2, "rew')
    writer = resumable(out, 2)
    writer.truncate_metrics(2)
    writer.close()
    assert [m["step"] for m in jsonl(out / "metrics.jsonl")] == [0, 1]


# --- what a checkpoint keeps: the whole start, and JSON parts without NaN ---------------------------------------------


class Covers:
    """A queue that covers every step, its state empty (run_state's view of rollout.Queue)."""

    def covers(self, step):
        return True

    def state(self):
        return {}


def test_a_checkpoint_keeps_the_whole_start_and_its_json_holds_no_nan(tmp_path):
    from types import SimpleNamespace

    from bookkeeping.resume import run_state
    from problems.user_rewards import Scores

    policy = torch.nn.Linear(2, 1)
    models = SimpleNamespace(policy=policy, opt=torch.optim.SGD(policy.parameters(), lr=0.1), ref=None)
    start = {"eval_accuracy": 0.25, "eval_reward": 0.5, "eval_rewards/odd": None, "eval_logged/odd_frac": 0.75}
    extras = {"chars": [1, float("nan")], "x": [{"y": float("inf")}, -float("inf")]}
    scored = {1: Scores(torch.zeros(1, 2), torch.zeros(2), {}, extras)}
    state = run_state(models, torch.Generator(), SimpleNamespace(position=3), Covers(), 1, start, 1.0, scored)
    path = save_checkpoint(str(tmp_path), state, 1, keep=1)
    ck = torch.load(path, weights_only=True)
    assert ck["eval_start"] == start and ck["eval_start"] is not start  # every figure, a copy
    text = ck["scores"][1]["extras"]
    kept = json.loads(text, parse_constant=lambda token: pytest.fail(f"{token} in a checkpoint's JSON"))
    assert kept == {"chars": [1, None], "x": [{"y": None}, None]}


def test_a_module_reward_named_like_the_projects_own_is_the_users_file(tmp_path, monkeypatch):
    # problems/user_rewards.py loads a reward.py in the working directory before the project's reward module (already
    # imported): its fingerprint is that file's.
    (tmp_path / "reward.py").write_text(MODULE)
    monkeypatch.chdir(tmp_path)
    (entry,) = fp.fingerprints(resolve(Config(out="o", reward=["reward:short"])))
    assert entry["file"] == str(tmp_path / "reward.py") and entry["sha256"] == sha(tmp_path / "reward.py")
    monkeypatch.chdir(tmp_path.parent)  # from elsewhere: the project's reward.py, as `import reward` finds it
    (entry,) = fp.fingerprints(resolve(Config(out="o", reward=["reward:short"])))
    assert entry["file"] == sys.modules["reward"].__file__


# --- issue 51: resume means continue; a run can always resume ---------------------------------------------------------


def test_a_resume_with_fewer_steps_than_taken_is_refused_and_writes_nothing(tmp_path, warm_cache, main):
    out = tmp_path / "run"
    r = main(*tiny(warm_cache, out, 3, "--save-every", 2, "--log-completions", 1))
    assert r.returncode == 0, r.stderr[-2000:]
    before = snapshot(out)
    # Taken: 3 steps, though the newest checkpoint is after 2 (metrics.jsonl's rows count: a run killed, or ended,
    # after them).
    for steps in (1, 2):
        line = one_line_error(main("--resume", "--out", out, "--steps", steps), 2, f"--resume --steps {steps}")
        assert "the run has taken 3 steps" in line and "--steps 3 or more" in line
    lock = ".lock"  # the pid of the last process that claimed the folder
    assert {k: v for k, v in snapshot(out).items() if k != lock} == {k: v for k, v in before.items() if k != lock}
    # Continued past its end, each step and evaluation is logged once, and summary.json, config.json and
    # metrics.jsonl agree.
    r = main("--resume", "--out", out, "--steps", 4)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = jsonl(out / "metrics.jsonl")
    steps = json.loads((out / "summary.json").read_text())["steps"]
    assert [m["step"] for m in rows] == [0, 1, 2, 3] and steps == 4 == json.loads((out / "config.json").read_text())[
        "steps"
    ]
    evals = [c["step"] for c in jsonl(out / "completions.jsonl") if c["split"] == "eval"]
    assert evals == [-1] * 4 + [3] * 4


def test_the_data_fingerprint_skips_what_the_loader_skips(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps({"prompt": q, "answer": a}) + "\n" for q, a in ROWS))
    cfg = resolve(Config(out=str(tmp_path / "run"), dataset=str(data)))
    before = fp.fingerprints(cfg)
    assert [e["part"] for e in before] == ["train.jsonl"] and before[0]["sha256"] == sha(data / "train.jsonl")
    (data / ".train.jsonl.swp").write_text("an editor's swap file")  # datasets skips these: so does the fingerprint
    (data / "__pycache__").mkdir()
    (data / "__pycache__" / "x.pyc").write_bytes(b"\0")
    assert fp.fingerprints(cfg) == before
    (data / "more.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')  # what the loader reads still counts
    assert [e["part"] for e in fp.fingerprints(cfg)] == ["more.jsonl", "train.jsonl"]


def test_an_out_inside_the_data_folder_is_refused_before_anything_is_written(tmp_path, warm_cache, main):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps({"prompt": q, "answer": a}) + "\n" for q, a in ROWS))
    before = snapshot(data)
    for out in (data / "run", data):
        r = main(*tiny(warm_cache, out, 1, "--dataset", data, "--max-new-tokens", 8))
        lines = [line for line in r.stderr.splitlines() if line.strip() and not line.startswith("Generating")]
        assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
        assert f"--out {out} is inside --dataset {data}" in lines[0] and "outside" in lines[0]
        assert snapshot(data) == before and not (data / "run").exists()
