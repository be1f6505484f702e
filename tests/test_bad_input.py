"""Issue 44, what a user brings: empty flags (an unset shell variable), missing local files and model folders,
negative numbers as flag values, errors that name the flag the user gave, data files that are not UTF-8, data files
rewritten under the same time stamp, the prompt the model was given, two runs started in the same second, and a
user's own `rewards.py` in the working directory.

Each error is one line naming the flag and the cause. Most checks stop before a model loads; the few runs are two
steps of the built-in tiny policy.
"""

import json
import os
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import datasets
import pytest

import config
import train
from config import Config, ConfigError, config_from_args, parse_args, resolve, validate
from conftest import ROOT, TEST_WARMUP
from engine import tiny
from engine.policy import load_policy
from problems.tasks import (
    Problem,
    Prompting,
    TaskError,
    content_cache,
    load_dataset_problems,
    load_task,
    prompt_record,
    read_dataset,
    render_prompt,
)

ENV = {"HF_HUB_OFFLINE": "1", "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
ENV["HOME"] = os.environ.get("HOME", "/tmp")
ROWS = [("12+34=", "46"), ("7*8=", "56"), ("99-9=", "90"), ("3+4=", "7"), ("50-25=", "25"), ("6*7=", "42")]


def tiny_run(cache, out, *extra, steps=2) -> list[str]:
    args = ["--steps", steps, "--prompts-per-step", 2, "--group-size", 2, "--eval-size", 4, "--eval-every", 0]
    args += ["--warmup-steps", TEST_WARMUP, "--cache-dir", cache, "--out", out, "--no-progress"]
    return [str(a) for a in [*args, *extra]]


def cli_error(capsys, *args) -> str:
    """train.main in this process on `args`: it must end with status 2 and one line on stderr; that line."""
    capsys.readouterr()
    status = train.main([str(a) for a in args])
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip() and not x.startswith("Loading weights")]
    assert status == 2 and len(lines) == 1 and "Traceback" not in err, err[-2000:]
    return lines[0]


def cfg_of(*argv) -> Config:
    return config_from_args(*parse_args([str(a) for a in argv]))


def jsonl_rows(rows) -> str:
    return "".join(json.dumps({"prompt": q, "answer": a}) + "\n" for q, a in rows)


def text_fields():
    """Every Config field that holds text (str, str | None, list[str]), and so every flag "" could reach."""
    return [f for f in fields(Config) if "str" in str(f.type)]


# --- 1. every text flag refuses "" (an unset shell variable) ----------------------------------------------------


def test_every_text_flag_refuses_the_empty_string_but_those_where_it_means_none(tmp_path):
    # Only these two say something with "": --system-prompt "" an empty system message, --instruction "" none.
    # A new text field refuses "" unless its arg() says empty_ok, and this set then changes with it.
    assert {f.name for f in text_fields() if f.metadata["empty_ok"]} == {"system_prompt", "instruction"}
    checked = 0
    for f in text_fields():
        if f.metadata["empty_ok"]:
            cfg = cfg_of(config.flag_name(f), "", "--out", tmp_path / "o")
            assert getattr(cfg, f.name) == ""
            validate(cfg)
            continue
        for value in ("", " ", "\t\n"):
            with pytest.raises(ConfigError) as e:
                cfg_of(config.flag_name(f), value)
            assert str(e.value).startswith(f"{config.flag_name(f)}: empty") and "\n" not in str(e.value)
            # A Config made in code is refused too, before resolve turns "" into the working directory.
            made = Config(**{f.name: [value] if f.metadata["many"] else value})
            with pytest.raises(ConfigError, match=f"^{config.flag_name(f)}: empty"):
                resolve(made)
            with pytest.raises(ConfigError, match=f"^{config.flag_name(f)}: empty"):
                validate(made)
        checked += 1
    # model, task, the data flags, reward, the choices, lora targets, cache dir, device, out, report-to, ...
    assert checked >= 20
    # One empty SPEC among good ones is still refused, and so is an empty --out with --resume.
    with pytest.raises(ConfigError, match="^--reward: empty"):
        cfg_of("--reward", "math", "--reward", "")
    with pytest.raises(ConfigError, match="^--out: empty"):
        cfg_of("--resume", "--out", "")


def test_an_empty_dataset_or_out_trains_on_nothing_and_writes_nothing(tmp_path, monkeypatch, capsys, warm_cache):
    # The working directory holds data files datasets would happily read as `--dataset ""`.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.jsonl").write_text(jsonl_rows(ROWS * 2))
    (tmp_path / "test.csv").write_text("prompt,answer\n1+1=,2\n")
    before = sorted(p.name for p in tmp_path.iterdir())
    for flag in ("--dataset", "--out", "--data-files", "--eval-files", "--model", "--reward", "--cache-dir"):
        args = tiny_run(warm_cache, tmp_path / "run", flag, "")
        line = cli_error(capsys, *args)
        assert line.startswith(f"error: {flag}: empty"), line
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no run, no runs/, no cache


# --- 2. a missing local data file is a missing file, never a hub name ------------------------------------------


@pytest.mark.parametrize(
    "name, what",
    [
        ("./nope.jsonl", "no such file"),
        ("data/missing.csv", "no such file"),
        ("missing.parquet", "no such file"),
        ("../gone/rows.json", "no such file"),
        ("~/no-such-file-44.jsonl", "no such file"),
        ("/abs/missing", "no such file or folder"),
        ("./saved-set", "no such file or folder"),
        ("a/b/c", "no such file or folder"),  # two slashes: no hub id has them
    ],
)
def test_a_missing_local_data_set_is_a_missing_file_and_never_reaches_the_hub(tmp_path, monkeypatch, name, what):
    monkeypatch.chdir(tmp_path)
    local = datasets.load_dataset

    def hub(path, *a, **kw):  # a local file's builder (json, csv, parquet) may load; nothing else
        if path not in ("json", "csv", "parquet"):
            raise AssertionError(f"sent to datasets.load_dataset: {path}")
        return local(path, *a, **kw)

    monkeypatch.setattr(datasets, "load_dataset", hub)
    with pytest.raises(TaskError) as e:
        load_dataset_problems(name)
    assert str(e.value) == f"--dataset {name}: {what}"
    # The same as held-out rows of a data set that is there.
    (tmp_path / "rows.jsonl").write_text(jsonl_rows(ROWS))
    with pytest.raises(TaskError) as e:
        load_dataset_problems(str(tmp_path / "rows.jsonl"), eval_files=name)
    assert str(e.value) == f"--eval-files {name}: {what}"


def test_a_hub_like_name_still_goes_to_the_hub(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    seen = []

    def hub(name, config=None, **kw):
        seen.append((name, config))
        raise ConnectionError("offline")

    monkeypatch.setattr(datasets, "load_dataset", hub)
    for name in ("openai/gsm8k", "gsm8k", "HuggingFaceH4/MATH-500"):
        with pytest.raises(TaskError, match=f"^--dataset {name}: cannot be loaded \\(offline\\)"):
            load_dataset_problems(name, config="main")
    assert [n for n, _ in seen] == ["openai/gsm8k", "gsm8k", "HuggingFaceH4/MATH-500"]


def test_missing_data_files_through_the_cli_are_one_line_naming_the_flag(tmp_path, monkeypatch, capsys, warm_cache):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    line = cli_error(capsys, *tiny_run(warm_cache, out, "--dataset", "./nope.jsonl"))
    assert line == "error: --dataset ./nope.jsonl: no such file"
    line = cli_error(capsys, *tiny_run(warm_cache, out, "--task", "gsm8k", "--data-files", "missing.jsonl"))
    assert line == f"error: --data-files {tmp_path / 'missing.jsonl'}: no such file"
    (tmp_path / "rows.jsonl").write_text(jsonl_rows(ROWS * 2))
    line = cli_error(capsys, *tiny_run(warm_cache, out, "--dataset", "rows.jsonl", "--eval-files", "held/out.csv"))
    assert line == f"error: --eval-files {tmp_path / 'held' / 'out.csv'}: no such file"
    assert not out.exists()


# --- 3. a missing model folder is a missing folder ------------------------------------------------------------


@pytest.mark.parametrize("name", ["./no-such-folder", "/abs/missing", "~/no-such-model-44", "models/a/b", "../m"])
def test_a_missing_model_folder_is_a_missing_folder(tmp_path, monkeypatch, name):
    import transformers

    monkeypatch.chdir(tmp_path)

    def hub(*a, **kw):
        raise AssertionError("sent to from_pretrained")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", hub)
    cfg = Config(model=name, out=str(tmp_path / "o"))  # resolve keeps a missing path as the user wrote it
    with pytest.raises(ConfigError) as e:
        load_policy(resolve(cfg), log=lambda m: None)
    assert str(e.value) == f"--model {name}: no such folder"


def test_a_model_that_is_a_file_or_a_missing_gguf_names_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "weights.safetensors").write_bytes(b"x")
    with pytest.raises(ConfigError, match="^--model .*weights.safetensors: is a file; give a model's folder"):
        load_policy(resolve(Config(model="weights.safetensors", out="o")), log=lambda m: None)
    with pytest.raises(ConfigError, match="^--model gone.gguf: no such GGUF file"):
        load_policy(resolve(Config(model="gone.gguf", out="o")), log=lambda m: None)


def test_a_missing_model_folder_through_the_cli_leaves_no_run(tmp_path, monkeypatch, capsys, warm_cache):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    line = cli_error(capsys, *tiny_run(warm_cache, out, "--model", "./no-such-folder"))
    assert line == "error: --model ./no-such-folder: no such folder" and not out.exists()


# --- 4. negative numbers as values ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, value",
    [("-1e-3", -1e-3), ("-.5", -0.5), ("-1E+2", -100.0), ("-0.25", -0.25), ("-3", -3.0), ("-1e-30", -1e-30)],
)
def test_every_negative_float_form_is_a_value_of_every_numeric_flag(text, value):
    several = [f for f in fields(Config) if f.metadata["many"] == "+"]
    assert several and all("float" in str(f.type) or "int" in str(f.type) for f in several)  # numbers only
    args, _ = parse_args(["--reward", "math", "--reward", "math", "--reward-weights", "1", text, "--steps", "3"])
    assert args.reward_weights == [1.0, value] and args.steps == 3
    args, _ = parse_args(["--reward", "math", "--reward", "math", "--reward-weights", text, text])
    assert args.reward_weights == [value, value]
    args, _ = parse_args(["--asymre-shift", text])  # a one-value flag: joined, as before
    assert args.asymre_shift == value
    # Text stays text: a negative number given to a text flag is not touched.
    args, _ = parse_args(["--instruction", text])
    assert args.instruction == text


@pytest.mark.parametrize("text", ["-inf", "inf", "-nan", "nan", "1e400", "-1E999"])
def test_a_non_finite_weight_is_refused_in_one_line(text):
    cfg = cfg_of("--reward", "math", "--reward", "math", "--reward-weights", "1", text)
    with pytest.raises(ConfigError, match="^--reward-weights .*: each must be a finite number$"):
        validate(cfg)


def test_a_negative_weight_passes_validation_and_a_bad_value_is_still_argparses(tmp_path):
    cfg = cfg_of("--reward", "math", "--reward", "math", "--reward-weights", "1", "-1e-3", "--out", tmp_path / "o")
    validate(cfg)
    assert cfg.reward_weights == [1.0, -0.001]
    with pytest.raises(SystemExit):
        parse_args(["--reward-weights", "1", "-x"])


# --- 5. an error names the flag the user gave -----------------------------------------------------------------


def split_folders(tmp_path) -> dict:
    """A folder of data files (load_dataset reads its train/test by name) and a save_to_disk DatasetDict."""
    files = tmp_path / "files"
    files.mkdir()
    (files / "train.jsonl").write_text(jsonl_rows(ROWS))
    (files / "test.jsonl").write_text(jsonl_rows(ROWS[:2]))
    saved = tmp_path / "saved"
    ds = datasets.Dataset.from_list([{"prompt": q, "answer": a} for q, a in ROWS])
    datasets.DatasetDict(train=ds, test=ds.select(range(2))).save_to_disk(str(saved))
    only_test = tmp_path / "only_test"
    datasets.DatasetDict(test=ds).save_to_disk(str(only_test))
    return {"files": str(files), "saved": str(saved), "only_test": str(only_test)}


def test_each_error_names_the_flag_that_gave_the_name(tmp_path):
    f = split_folders(tmp_path)
    for name in (f["files"], f["saved"]):
        with pytest.raises(TaskError, match="^--eval-split validation: .* has no such split"):
            load_dataset_problems(name, eval_split="validation", eval_size=2)
        with pytest.raises(TaskError, match="^--split dev: .* has no such split"):
            load_dataset_problems(name, split="dev", eval_size=2)
    with pytest.raises(TaskError, match="^--dataset-config nope: .* cannot be loaded with it"):
        load_dataset_problems(f["files"], config="nope", eval_size=2)
    with pytest.raises(TaskError, match="^--eval-files .*only_test: its splits are test, none 'train'"):
        load_dataset_problems(f["files"], eval_files=f["only_test"], eval_size=2)
    # And the right ones still load.
    train_set, heldout = load_dataset_problems(f["saved"], eval_split="test", eval_size=2)
    assert (len(train_set), len(heldout)) == (6, 2)


def test_a_configuration_or_a_split_given_to_one_file_names_its_flag(tmp_path):
    (tmp_path / "rows.jsonl").write_text(jsonl_rows(ROWS))
    for kw, words in [
        (dict(dataset_config="main"), "--dataset-config main: cannot act here: "),
        (dict(split="test"), "--split test: cannot act here: "),
        (dict(eval_split="test"), "--eval-split test: cannot act here: "),
        (dict(split="a", eval_split="b"), "--split a and --eval-split b: cannot act here: "),
    ]:
        cfg = resolve(Config(dataset=str(tmp_path / "rows.jsonl"), **kw, out=str(tmp_path / "o")))
        with pytest.raises(ConfigError) as e:
            validate(cfg)
        assert str(e.value).startswith(words) and "rows.jsonl is one file" in str(e.value)


# --- 6. a data file that is not UTF-8 ---------------------------------------------------------------------------

LATIN1 = {
    "rows.jsonl": jsonl_rows(ROWS).encode()
    + json.dumps({"prompt": "café", "answer": "1"}, ensure_ascii=False).encode("latin-1"),
    "rows.csv": b"prompt,answer\n1+1=,2\n" + "crème,3\n".encode("latin-1"),
    "rows.json": b'[{"prompt": "1+1=", "answer": "2"},\n {"prompt": "na\xefve", "answer": "3"}]',
}


@pytest.mark.parametrize("name", sorted(LATIN1))
def test_a_file_that_is_not_utf8_is_one_line_with_its_byte_and_line(tmp_path, name):
    data = LATIN1[name]
    (tmp_path / name).write_bytes(data)
    at = next(i for i, b in enumerate(data) if b >= 0x80)  # the first non-ASCII byte: the latin-1 one
    line = data[:at].count(b"\n") + 1
    path = str(tmp_path / name)
    with pytest.raises(TaskError) as e:
        load_dataset_problems(path, eval_size=1)
    assert str(e.value) == f"--dataset {path}: not UTF-8 at byte {at} (line {line}); save it as UTF-8"
    (tmp_path / "good.jsonl").write_text(jsonl_rows(ROWS))
    with pytest.raises(TaskError, match=f"^--eval-files {path}: not UTF-8 at byte {at} "):
        load_dataset_problems(str(tmp_path / "good.jsonl"), eval_files=path, eval_size=1)


def test_utf8_is_checked_across_blocks_and_in_a_folder(tmp_path):
    # A character split across the 1 MiB read blocks is no error; a bad byte beyond the first block is found at its
    # place in the file, and so is a character cut short at its end.
    mib = 1 << 20
    good = b"x" * (mib - 1) + "é".encode() + b"\n" + b"y" * 100 + b"\n"  # é: the bytes mib - 1 and mib
    path = tmp_path / "big.jsonl"
    path.write_bytes(good)
    assert content_cache(path, "--dataset x")
    path.write_bytes(good[: mib + 10] + b"\xff" + good[mib + 11 :])
    with pytest.raises(TaskError) as e:
        content_cache(path, "--dataset x")
    assert str(e.value) == f"--dataset x: not UTF-8 at byte {mib + 10} (line 2); save it as UTF-8"
    path.write_bytes(good + "é".encode()[:1])
    with pytest.raises(TaskError, match=f"^--dataset x: not UTF-8 at byte {len(good)} \\(line 3\\)"):
        content_cache(path, "--dataset x")
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "train.csv").write_bytes(LATIN1["rows.csv"])
    at = LATIN1["rows.csv"].index("è".encode("latin-1"))
    with pytest.raises(TaskError, match=f"^--dataset \\S+folder: train.csv: not UTF-8 at byte {at} \\(line 3\\)"):
        load_dataset_problems(str(folder), eval_size=1)


def test_a_data_files_jsonl_that_is_not_utf8_names_file_and_line(tmp_path, capsys, warm_cache):
    good = json.dumps({"question": "1+1?", "answer": "#### 2"})
    path = tmp_path / "gsm.jsonl"
    path.write_bytes((good + "\n").encode() + '{"question": "\xe9", "answer": "#### 2"}\n'.encode("latin-1"))
    with pytest.raises(TaskError, match=f"^{path}:2: not valid UTF-8 \\(byte 0xe9 at column 15\\)"):
        load_task("gsm8k", str(path), eval_size=1)
    line = cli_error(capsys, *tiny_run(warm_cache, tmp_path / "run", "--task", "gsm8k", "--data-files", path))
    assert f"{path}:2: not valid UTF-8" in line and not (tmp_path / "run").exists()


def test_a_non_utf8_file_through_the_cli_is_one_line(tmp_path, capsys, warm_cache):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(LATIN1["rows.jsonl"])
    line = cli_error(capsys, *tiny_run(warm_cache, tmp_path / "run", "--dataset", path, "--eval-size", 2))
    assert line.startswith(f"error: --dataset {path}: not UTF-8 at byte ")


# --- 7. a local file is read by its contents ---------------------------------------------------------------------


def rewrite_keeping_time(path: Path, data: bytes) -> None:
    st = path.stat()
    assert len(data) == st.st_size
    path.write_bytes(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.parametrize("name", ["rows.jsonl", "rows.csv", "folder"])
def test_a_file_rewritten_with_its_old_size_and_time_is_read_anew(tmp_path, name):
    first, second = [("11+11=", "22"), ("5*5=", "25")], [("12+12=", "24"), ("6*6=", "36")]

    def data(rows) -> bytes:
        if name == "rows.csv":
            return ("prompt,answer\n" + "".join(f"{q},{a}\n" for q, a in rows)).encode()
        return jsonl_rows(rows).encode()

    path = tmp_path / name
    target = path / "train.jsonl" if name == "folder" else path
    target.parent.mkdir(exist_ok=True)
    target.write_bytes(data(first))

    def read() -> list:
        return [(r["prompt"], str(r["answer"])) for r in read_dataset(str(path), None, "train", "--dataset")]

    assert read() == first
    cache = content_cache(path, "--dataset")
    assert read() == first and content_cache(path, "--dataset") == cache  # unchanged: the same cache, reused
    rewrite_keeping_time(target, data(second))
    assert read() == second and content_cache(path, "--dataset") != cache


# --- 8. the prompt example is what the model was given -----------------------------------------------------------


def tok_of(cache):
    """The tokenizer of the shipped tiny policy, as a run loads it."""
    return tiny.load_tiny(cache, TEST_WARMUP, log=lambda m: None)[1]


def test_the_prompt_example_is_the_decoded_tokens_and_says_when_they_differ(warm_cache):
    # The shipped tiny policy's tokenizer (what a run loads) drops every character it does not know.
    shipped = tok_of(warm_cache)
    for how in (Prompting(system="Be brief"), Prompting(instruction="{question} é"), Prompting(system="0\n")):
        record = prompt_record(shipped, Problem("12+34=", "46", prompting=how))
        assert record["prompt_example"] == ("012+34=" if how.system == "0\n" else "12+34=")
        assert record["prompt_example_lossy"] is True
    # The tokenizer tiny.py builds turns each run of unknown characters into one <unk>.
    tok = tiny.build_tokenizer()
    plain = Problem("12+34=", "46")
    record = prompt_record(tok, plain)
    assert record["prompt_example"] == "12+34=" and record["prompt_example_lossy"] is False
    # Letters, a newline and an accent the character tokenizer does not know: each run of them is one <unk>.
    for how, seen in [
        (Prompting(system="Be brief"), "<unk><unk><unk><unk><unk><unk><unk><unk><unk>12+34="),
        (Prompting(instruction="{question} é"), "12+34=<unk><unk>"),
        (Prompting(system="0", instruction="{question}1"), "0<unk>12+34=1"),
    ]:
        p = Problem("12+34=", "46", prompting=how)
        record = prompt_record(tok, p)
        assert record["prompt_example"] == seen and record["prompt_example_lossy"] is True
        assert render_prompt(tok, p) != seen  # what was asked for, which the model never saw


# --- 9. two runs started in the same second ----------------------------------------------------------------------


def test_two_configs_resolved_in_the_same_second_get_different_folders(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(config.time, "strftime", lambda fmt, *a: "runs/20250101-000000")
    outs = [resolve(Config()).out for _ in range(3)]
    assert len(set(outs)) == 3 and all(Path(o).name.startswith(f"20250101-000000-{os.getpid()}") for o in outs)
    # A folder already there (a run of a process that had this id before) is not handed out either.
    Path(f"runs/20250101-000000-{os.getpid()}-9").mkdir(parents=True)
    Path(f"runs/20250101-000000-{os.getpid()}-4").mkdir(parents=True)
    nxt = resolve(Config()).out
    assert Path(nxt).name == f"20250101-000000-{os.getpid()}-5" and not Path(nxt).exists()


def test_two_processes_started_in_the_same_second_get_different_folders(tmp_path):
    code = (
        "import sys, time; sys.path.insert(0, sys.argv[1]); import config; "
        "config.time.strftime = lambda fmt, *a: 'runs/20250101-000000'; "
        "print(config.resolve(config.Config(device='cpu')).out)"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(ROOT)], cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs) and len(set(outs)) == 2, outs
    assert all(Path(o).parent == tmp_path / "runs" for o in outs)


# --- a user's own rewards.py ---------------------------------------------------------------------------------------


def test_a_users_rewards_py_in_the_working_directory_is_the_one_called(tmp_path, warm_cache):
    """`--reward rewards:fn` imports the user's rewards.py beside them (the project's reward functions live in
    problems/user_rewards.py, and no module of the project is named rewards). The same two steps record the prompt
    the tiny policy was given: the system prompt's letters dropped."""
    (tmp_path / "rewards.py").write_text(
        "import os\n\n\ndef fn(completions, **kwargs):\n"
        "    with open(os.path.join(os.path.dirname(__file__), 'called.txt'), 'a') as f:\n"
        "        f.write(f'{len(completions)}\\n')\n"
        "    return [float(len(c) % 2) for c in completions]\n"
    )
    args = tiny_run(warm_cache, tmp_path / "run", "--reward", "rewards:fn", "--system-prompt", "Hi")
    r = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args], cwd=tmp_path, env=ENV, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr[-2000:]
    calls = (tmp_path / "called.txt").read_text().split()
    assert len(calls) >= 2 and "4" in calls  # each training step's 2 x 2 completions, and the evaluations
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["reward"] == ["rewards:fn"] and saved["reward_names"] == ["fn"]
    # The shipped tiny tokenizer drops the letters it does not know: the model was given the bare question.
    assert saved["prompt_template"] == "Hi\n\n{question}" and saved["prompt_example_lossy"] is True
    assert re.fullmatch(r"\d+[-+*]\d+=", saved["prompt_example"]), saved["prompt_example"]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in rows] == [0, 1] and all("rewards/fn" in m for m in rows)


# --- a flag value argparse cannot read ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, words",
    [
        (["--steps", ""], "argument --steps: invalid int value: ''"),
        (["--reward-weights", ""], "argument --reward-weights: invalid float value: ''"),
        (["--lr", "fast"], "argument --lr: invalid float value: 'fast'"),
        (["--reward-weights", "1", "-x"], "unrecognized arguments: -x"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ],
)
def test_a_value_argparse_cannot_read_is_one_line_too(capsys, args, words):
    with pytest.raises(SystemExit) as e:
        train.main(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.splitlines() == [f"error: {words} (python train.py --help lists the flags)"]


@pytest.mark.parametrize("name", ["reward", "config", "train", "objective"])
def test_a_users_module_named_like_the_projects_own_is_the_one_loaded(tmp_path, monkeypatch, name):
    # The project's own module of that name is already imported; the user's file in the working directory wins.
    from problems.user_rewards import load_reward

    (tmp_path / f"{name}.py").write_text("def fn(completions, **kw):\n    return [7.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    r = load_reward(f"{name}:fn")
    assert r.fn(completions=["a", "b"]) == [7.0, 7.0]


# --- issue 51: the smaller items, each one line before anything is written ------------------------------------------


@pytest.mark.parametrize(
    "args, words",
    [
        (["--seed", "4294967296"], "--seed must be in [0, 2**32)"),  # numpy's seeds: it used to fail inside numpy
        (["--seed", "-1"], "--seed must be in [0, 2**32)"),
        (["--kl-importance-weight"], "--kl-importance-weight True: cannot act here: it weights the KL term"),
        (["--warmup-steps", "5", "--model", "some-org/some-model"], "--warmup-steps 5: cannot act here"),
    ],
)
def test_a_seed_numpy_cannot_take_and_flags_that_cannot_act_are_one_line(tmp_path, capsys, args, words):
    line = cli_error(capsys, *args, "--out", tmp_path / "run", "--cache-dir", tmp_path / "cache")
    assert line.startswith(f"error: {words}"), line
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()


def test_the_largest_seed_passes_validation():
    validate(cfg_of("--seed", 2**32 - 1))
    np = pytest.importorskip("numpy")
    np.random.seed(2**32 - 1)  # the bound is numpy's own: one more is what it refuses
    with pytest.raises(ValueError):
        np.random.seed(2**32)


@pytest.mark.parametrize("device", ["mps", "cuda:99"])
def test_a_device_this_torch_cannot_use_is_one_line(tmp_path, capsys, device):
    import torch

    if device == "mps" and torch.backends.mps.is_available():
        pytest.skip("this machine has MPS")
    line = cli_error(capsys, "--device", device, "--out", tmp_path / "run")
    assert line.startswith(f"error: --device {device}: "), line
    assert not (tmp_path / "run").exists()


def test_an_out_that_cannot_be_statted_is_one_line(tmp_path, capsys, monkeypatch):
    # A name longer than the file system allows: stat itself fails (ENAMETOOLONG), where the run used to print two
    # tracebacks (the second from the error handler's look at the folder).
    long = tmp_path / ("a" * 300)
    line = cli_error(capsys, "--out", long)
    assert line.startswith(f"error: --out {long}: cannot be used: File name too long"), line
    # A folder without search permission (root passes every permission check, so stat is made to answer as it would).
    closed = tmp_path / "closed"
    real = os.stat

    def stat(path, *a, **kw):
        if str(path).startswith(str(closed) + os.sep):
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, *a, **kw)

    monkeypatch.setattr(os, "stat", stat)
    line = cli_error(capsys, "--out", closed / "run")
    assert line == f"error: --out {closed / 'run'}: cannot be used: Permission denied", line


def test_a_reward_files_own_siblings_are_the_ones_it_imports(tmp_path):
    """A reward file's `import config` gets its own config.py beside it, not the project's (already imported);
    afterwards the project's modules are the project's again."""
    from problems.user_rewards import load_reward

    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "config.py").write_text("BONUS = 0.5\n")
    (folder / "helpers.py").write_text("def credited(c):\n    return len(c) > 1\n")
    (folder / "scoring.py").write_text(
        "import config\nfrom helpers import credited\n\n\n"
        "def fn(completions, **kw):\n    return [config.BONUS if credited(c) else 0.0 for c in completions]\n"
    )
    r = load_reward(f"{folder / 'scoring.py'}:fn")
    assert r.fn(completions=["ab", "a"]) == [0.5, 0.0]
    assert sys.modules["config"] is config and config.Config is Config  # the project's, for the rest of the run
