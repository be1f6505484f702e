"""Issue 38, "your own problem": reward functions (--reward, --reward-weights, TRL's call), data sets (--dataset and
its columns), prompts (--system-prompt, --instruction, --no-chat-template), what the policy writes
(--log-completions), --report-to wandb, --lr-scheduler, a failed start that leaves no run, no `../shared` in what a
user reads, and docs/your-own-task.md's commands as they are.

The runs are a few steps of the built-in tiny policy (2 prompts x 2 completions), in this process where they can be.
Expectations are computed independently: the user's functions called again on what was logged, sums by hand,
transformers' own schedulers, TensorBoard's event files against wandb's offline run file.
"""

import importlib.util
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import config
import train
from conftest import ROOT, error_line, jsonl, needs, shared_data, tiny_run_args
from problems import tasks
from problems import user_rewards as rewards
from problems.math_verifier import symbolic_reward
from problems.prompts import score_rows
from problems.tasks import Problem, Prompting, TaskError, load_dataset_problems, render_prompt
from problems.user_rewards import MathVerifier, RewardError, Rewards, RewardState, load_reward

pytestmark = pytest.mark.model  # trains or decodes a model: CI runs these again under plain kernels

ENV = {"HF_HUB_OFFLINE": "1", "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
ENV["HOME"] = os.environ.get("HOME", "/tmp")
ARITH = [("12+34=", "46"), ("7*8=", "56"), ("99-9=", "90"), ("3+4=", "7"), ("50-25=", "25"), ("6*7=", "42")]
ARITH += [("11+11=", "22"), ("9*9=", "81"), ("40+2=", "42"), ("8-3=", "5"), ("5*5=", "25"), ("60+7=", "67")]

USER_REWARDS = """
CALLS = []


def exact(prompts, completions, answer, **kwargs):
    CALLS.append(("exact", len(completions), sorted(kwargs), kwargs["trainer_state"].global_step))
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]


def length(completions, digits, **kwargs):
    return [1.0 if len(c.strip()) == d else 0.0 for c, d in zip(completions, digits)]


def odd(completions, log_metric, log_extra, **kwargs):
    log_metric("odd_frac", sum(len(c) % 2 for c in completions) / len(completions))
    log_extra("chars", [len(c) for c in completions])
    return [None if len(c) % 2 else 1.0 for c in completions]
"""


def write_rows(path: Path, rows=ARITH, **extra) -> Path:
    with open(path, "w") as f:
        for q, a in rows:
            op = next(c for c in "+-*" if c in q[1:])
            f.write(json.dumps({"prompt": q, "answer": a, "digits": len(a), "op": op, **extra}) + "\n")
    return path


def user_module(path: Path):
    """The module train.py imported from `path` (rewards.py imports a file once per process)."""
    return rewards._modules[str(path.resolve())]


# --- --reward: loading, the call, the weighted sum, errors ----------------------------------------------------------


def test_specs_load_files_modules_and_the_built_in_verifier(tmp_path, monkeypatch):
    (tmp_path / "mine.py").write_text(USER_REWARDS)
    (tmp_path / "mymod.py").write_text("def f(completions, **kw):\n    return [0.5] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    by_file = load_reward("mine.py:exact")
    by_module = load_reward("mymod:f")
    assert by_file.name == "exact" and by_file.fn.__module__.startswith("_reward_mine")
    assert by_module.fn(completions=["a", "b"]) == [0.5, 0.5]
    assert isinstance(load_reward("math").fn, MathVerifier) and load_reward("math-symbolic").fn.score is symbolic_reward
    # Two functions of the same name stay apart in the metrics.
    both = Rewards([load_reward("mine.py:exact"), load_reward(f"{tmp_path}/mine.py:exact")])
    assert both.names == ["exact", "exact_2"]
    # config.json records a file SPEC with its path absolute; built-in names and modules as given.
    cfg = config.resolve(config.Config(reward=["mine.py:exact", "mymod:f", "math"], out=str(tmp_path / "o")))
    assert cfg.reward == [f"{tmp_path}/mine.py:exact", "mymod:f", "math"]
    assert config.resolve(config.Config(out="o")).reward == ["math"]  # the default


def test_the_step_reward_is_the_weighted_sum_and_none_counts_zero():
    a = rewards.Reward("a", "a", lambda completions, **kw: [1.0, 0.0, None, 2.0])
    b = rewards.Reward("b", "b", lambda completions, **kw: [None, None, None, -4.0])
    scores = Rewards([a, b], [2.0, -0.5]).score(["p"] * 4, ["c"] * 4, [[1]] * 4, {}, RewardState(0, 1))
    # By hand: 2*1 + 0, 2*0 + 0, 0 + 0 (both None), 2*2 - 0.5*(-4)
    assert scores.total.tolist() == [2.0, 0.0, 0.0, 6.0]
    assert scores.none_frac() == 4 / 8 and scores.means(["a", "b"]) == {"a": 1.0, "b": -4.0}
    assert math.isnan(scores.parts[1, 0].item()) and scores.parts[0, 3].item() == 2.0


def test_a_function_is_called_as_trl_calls_it(tmp_path):
    seen = {}

    def fn(prompts, completions, **kwargs):
        seen.update(kwargs, prompts=prompts, completions=completions)
        kwargs["log_metric"]("m", 3.0)
        kwargs["log_metric"]("m", 5.0)
        kwargs["log_extra"]("x", ["u", "v"])
        return [0.25, 0.75]

    async def later(completions, **kwargs):  # TRL awaits an async reward function; so does this loop
        return [1.0] * len(completions)

    funcs = Rewards([rewards.Reward("fn", "fn", fn), rewards.Reward("later", "later", later)])
    columns = {"answer": ["1", "1"], "level": [3, 3], "completions": ["not", "passed"]}
    scores = funcs.score(["q", "q"], ["a", "b"], [[5, 1], [6, 1]], columns, RewardState(7, 9))
    assert seen["prompts"] == ["q", "q"] and seen["completions"] == ["a", "b"]
    assert seen["completion_ids"] == [[5, 1], [6, 1]] and seen["answer"] == ["1", "1"] and seen["level"] == [3, 3]
    assert seen["trainer_state"].global_step == 7 and seen["trainer_state"].max_steps == 9
    assert scores.metrics == {"m": 4.0} and scores.extras == {"x": ["u", "v"]}
    assert scores.total.tolist() == [1.25, 1.75]


BAD = {
    "no_file": ("missing.py:f", "no such file"),
    "no_module": ("no_such_module_38:f", "no module named 'no_such_module_38'"),
    "no_function": ("bad.py:nothing", "has no function 'nothing'"),
    "not_callable": ("bad.py:CONSTANT", "CONSTANT is a int, not a function"),
    "import_fails": ("broken.py:f", "importing"),
    "raises": ("bad.py:raises", "raises raised on 4 rows: KeyError: 'answr'"),
    "length": ("bad.py:short", "returned 1 rewards for 4 completions"),
    "text": ("bad.py:text", "returned 'yes' (str) for completion 0: not a number"),
    "nan": ("bad.py:nan", "returned NaN for completion 2 (return None for no opinion)"),
    "inf": ("bad.py:inf", "returned inf for completion 0: not finite"),
    "not_list": ("bad.py:scalar", "returned a float; it must return a list"),
    "bare_name": ("exactly", "not a built-in reward"),
}
BAD_FILE = """
CONSTANT = 3
def raises(completions, **kw):
    return [kw["answr"]]
def short(completions, **kw):
    return [1.0]
def text(completions, **kw):
    return ["yes"] * len(completions)
def nan(completions, **kw):
    return [0.0, 0.0, float("nan"), 0.0]
def inf(completions, **kw):
    return [float("inf")] * len(completions)
def scalar(completions, **kw):
    return 1.0
"""


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_reward_is_one_line_naming_its_spec(tmp_path, monkeypatch, case):
    spec, words = BAD[case]
    (tmp_path / "bad.py").write_text(BAD_FILE)
    (tmp_path / "broken.py").write_text("import no_such_dependency_38\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RewardError) as e:
        funcs = Rewards([load_reward(spec)])
        funcs.score(["q"] * 4, ["1", "2", "3", "4"], [[1]] * 4, {"answer": ["1"] * 4}, RewardState(0, 1))
    msg = str(e.value)
    assert msg.startswith(f"--reward {spec}: ") and words in msg and "\n" not in msg, msg


def test_a_bad_reward_ends_the_cli_in_one_line_and_leaves_no_run(tmp_path, warm_cache, main, monkeypatch):
    (tmp_path / "bad.py").write_text(BAD_FILE)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    line = error_line(main(*tiny_run_args(warm_cache, out, "--reward", "bad.py:raises")))
    assert line.startswith(f"error: --reward {tmp_path}/bad.py:raises: raises raised on 4 rows: KeyError")
    assert not out.exists()  # the start evaluation called it: nothing of the run is left
    line = error_line(main(*tiny_run_args(warm_cache, out, "--reward", "bad.py:gone")))
    assert "has no function 'gone'" in line and not out.exists()  # refused before --out is claimed
    weights = error_line(main(*tiny_run_args(warm_cache, out, "--reward", "math", "--reward-weights", "1", "2")))
    assert "--reward-weights: 2 weights for 1 rewards" in weights


def test_a_run_with_rewards_of_ones_own_reports_each_and_their_weighted_sum(tmp_path, warm_cache, main):
    """Every completion logged (N = 4 a step): each row's reward is 1 x exact + 0.5 x length + 2 x odd (None 0),
    the user's functions called again on the logged text give the logged values, and the metrics are their means."""
    data = write_rows(tmp_path / "data.jsonl")
    (tmp_path / "mine.py").write_text(USER_REWARDS)
    out = tmp_path / "run"
    specs = [f"{tmp_path}/mine.py:{f}" for f in ("exact", "length", "odd")]
    flags = ["--dataset", data, *[x for s in specs for x in ("--reward", s)], "--reward-weights", "1", "0.5", "2"]
    r = main(*tiny_run_args(warm_cache, out, *flags, "--log-completions", "4"))
    assert r.returncode == 0, r.stderr[-2000:]
    # No built-in verifier among them: the accuracy counts weighted rewards > 0, the mean reward is beside it.
    log = r.stdout + r.stderr
    assert "held-out greedy accuracy (weighted reward > 0) before training" in log and "; mean reward " in log
    saved = json.loads((out / "config.json").read_text())
    assert saved["reward"] == specs and saved["reward_weights"] == [1, 0.5, 2]
    assert saved["reward_names"] == ["exact", "length", "odd"] and saved["prompt_template"] == "{question}"
    rows, metrics = jsonl(out / "completions.jsonl"), jsonl(out / "metrics.jsonl")
    mine = importlib.util.module_from_spec(importlib.util.spec_from_file_location("again", tmp_path / "mine.py"))
    mine.__spec__.loader.exec_module(mine)
    gold = dict(ARITH)
    for row in rows:
        c, q = row["completion"], row["prompt"]
        state = RewardState(0, 1)
        hooks = dict(trainer_state=state, log_metric=lambda *a: None, log_extra=lambda *a: None)
        expected = {
            "exact": mine.exact([q], [c], [gold[q]], **hooks)[0],
            "length": mine.length([c], [len(gold[q])])[0],
            "odd": mine.odd([c], **hooks)[0],
        }
        assert row["rewards"] == expected, row
        by_hand = expected["exact"] + 0.5 * expected["length"] + 2 * (expected["odd"] or 0.0)
        assert row["reward"] == pytest.approx(by_hand, abs=1e-6)
    train_rows = [r for r in rows if r["split"] == "train"]
    assert [r["step"] for r in train_rows] == [0] * 4 + [1] * 4 + [2] * 4 and all("advantage" in r for r in train_rows)
    assert all(r["logged/chars"] == len(r["completion"]) for r in train_rows)  # log_extra's column, prefixed
    for m in metrics:
        mine_rows = [r for r in train_rows if r["step"] == m["step"]]
        assert m["reward"] == pytest.approx(sum(r["reward"] for r in mine_rows) / 4, abs=1e-5)
        assert m["rewards/exact"] == pytest.approx(sum(r["rewards"]["exact"] for r in mine_rows) / 4, abs=1e-6)
        nones = sum(r["rewards"]["odd"] is None for r in mine_rows)
        assert m["reward_none_frac"] == pytest.approx(nones / 12, abs=1e-6)  # of 3 functions x 4 rows
        assert m["logged/odd_frac"] == pytest.approx(nones / 4, abs=1e-6)  # log_metric's scalar, prefixed
        assert m["accuracy"] == sum(r["reward"] > 0 for r in mine_rows) / 4  # no built-in verifier: reward > 0
    # Evaluation scores with the same functions and weights: 4 held-out rows before (step -1) and after (step 2).
    held = [r for r in rows if r["split"] == "eval"]
    assert [r["step"] for r in held] == [-1] * 4 + [2] * 4 and [r["prompt"] for r in held[:4]] == [
        q for q, _ in ARITH[:4]
    ]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_reward_start"] == pytest.approx(sum(r["reward"] for r in held[:4]) / 4, abs=1e-6)
    assert summary["eval_accuracy_start"] == sum(r["reward"] > 0 for r in held[:4]) / 4
    assert summary["eval_rewards/exact_end"] == pytest.approx(sum(r["rewards"]["exact"] for r in held[4:]) / 4)
    # What the functions were given: TRL's keywords, the data set's columns, the steps done.
    calls = user_module(tmp_path / "mine.py").CALLS
    keys = ["completion_ids", "digits", "log_extra", "log_metric", "op", "trainer_state"]
    assert all(k == keys for _, _, k, _ in calls)
    assert [(n, s) for _, n, _, s in calls] == [(4, 0), (4, 0), (4, 1), (4, 2), (4, 3)]  # eval, 3 steps, eval


# --- --dataset ------------------------------------------------------------------------------------------------------


def test_every_local_form_of_a_data_set_reads_the_same_rows(tmp_path):
    import datasets

    records = [{"question": q, "solution": f"so #### {a}", "level": i} for i, (q, a) in enumerate(ARITH)]
    ds = datasets.Dataset.from_list(records)
    forms = {
        "rows.jsonl": lambda p: ds.to_json(p),
        "rows.json": lambda p: Path(p).write_text(json.dumps(records)),
        "rows.csv": lambda p: ds.to_csv(p, index=False),
        "rows.parquet": lambda p: ds.to_parquet(p),
        "saved": lambda p: ds.save_to_disk(p),
        "saved_dict": lambda p: datasets.DatasetDict(train=ds, test=ds.select(range(2))).save_to_disk(p),
    }
    fields = dict(prompt_field="question", answer_field="solution", eval_size=4)
    seen = []
    for name, write in forms.items():
        write(str(tmp_path / name))
        train_set, heldout = load_dataset_problems(str(tmp_path / name), **fields)
        seen.append([(p.question, p.gold, p.columns["level"]) for p in heldout + train_set])
        assert heldout[0].columns["solution"] == "so #### 46"  # the raw column, as a reward function gets it
    assert all(s == seen[0] for s in seen) and seen[0][0] == ("12+34=", "46", 0)
    # A DatasetDict folder and a plain data folder (what load_dataset reads by name) have splits.
    train_set, heldout = load_dataset_problems(str(tmp_path / "saved_dict"), eval_split="test", **fields)
    assert len(train_set) == 12 and [p.question for p in heldout] == ["12+34=", "7*8="]
    folder = tmp_path / "hub_like"
    folder.mkdir()
    ds.to_json(str(folder / "train.jsonl"))
    ds.select(range(3)).to_json(str(folder / "test.jsonl"))
    train_set, heldout = load_dataset_problems(str(folder), split="train", eval_split="test", **fields)
    assert len(train_set) == 12 and len(heldout) == 3
    # --eval-files: another file of the same columns.
    train_set, heldout = load_dataset_problems(
        str(tmp_path / "rows.csv"), eval_files=str(tmp_path / "rows.json"), **fields
    )
    assert len(train_set) == 12 and len(heldout) == 4


def test_a_hub_name_that_cannot_be_loaded_is_one_line_naming_it():
    with pytest.raises(TaskError) as e:
        load_dataset_problems("openai/gsm8k-not-cached-38", config="main")
    assert str(e.value).startswith("--dataset openai/gsm8k-not-cached-38: cannot be loaded (") and "shared" not in str(
        e.value
    )


@pytest.mark.parametrize(
    "text, kw, words",
    [
        ('{"prompt": "1+1="}\n{"prompt": "2+2=", "answer": "4"}\n', {}, ["row 1", "field 'answer' is empty"]),
        ('{"q": "1+1=", "answer": "2"}\n', {}, ["no field 'prompt'", "its fields: q, answer", "--prompt-field"]),
        ('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "bad\n', {}, [":2: not valid JSON"]),
        ('{"prompt": "1+1=", "answer": "2"}\n{"prompt": " ", "answer": "2"}\n', {}, ["row 2", "'prompt' is empty"]),
        ('{"prompt": 5, "answer": "2"}\n', {}, ["row 1", "must be text, not int"]),
        ('{"prompt": [{"role": "bot", "content": "x"}], "answer": "2"}\n', {}, ["row 1", "list of messages"]),
        ('{"prompt": "1+1="}\n', {"answer_field": "gold"}, ["no field 'gold'", "--answer-field"]),
    ],
)
def test_bad_data_is_one_line_naming_file_row_and_field(tmp_path, text, kw, words):
    path = tmp_path / "data.jsonl"
    path.write_text(text)
    with pytest.raises(TaskError) as e:
        load_dataset_problems(str(path), eval_size=0, **kw)
    msg = str(e.value)
    assert str(path) in msg and all(w in msg for w in words) and "\n" not in msg, msg


def test_flags_of_a_data_set_need_one_and_a_file_has_no_splits(tmp_path):
    path = write_rows(tmp_path / "data.jsonl")
    for kw, words in [
        (dict(dataset=str(path), split="test"), "is one file"),
        (dict(dataset=str(path), eval_split="test"), "is one file"),
        (dict(dataset=str(path), task="gsm8k"), "--dataset replaces --task"),
        (dict(prompt_field="question"), "--prompt-field question: cannot act here"),
        (dict(eval_split="test"), "--eval-split test: cannot act here"),
        (dict(dataset="openai/gsm8k", eval_split="test", eval_files=str(path)), "give one"),
        (dict(report_to="mlflow"), "--report-to: unknown value 'mlflow'"),
        (dict(warmup_ratio=1.0), "--warmup-ratio must be in [0, 1)"),
        (dict(lr_scheduler="step"), "--lr-scheduler: unknown value 'step'"),
    ]:
        cfg = config.resolve(config.Config(**kw, out=str(tmp_path / "o")))
        with pytest.raises(config.ConfigError, match=re.escape(words)):
            config.validate(cfg)


def test_the_answer_is_optional_when_no_reward_reads_it_and_the_gold_is_free_form(tmp_path, warm_cache, main):
    data = tmp_path / "plain.jsonl"
    data.write_text("".join(json.dumps({"prompt": q}) + "\n" for q, _ in ARITH))
    (tmp_path / "mine.py").write_text(USER_REWARDS)
    out = tmp_path / "run"
    r = main(*tiny_run_args(warm_cache, out, "--dataset", data, "--reward", f"{tmp_path}/mine.py:odd", "--steps", "1"))
    assert r.returncode == 0, r.stderr[-2000:]
    # The built-in verifier needs the answer field.
    line = error_line(main(*tiny_run_args(warm_cache, tmp_path / "r2", "--dataset", data)))
    assert "no field 'answer'" in line and "--answer-field" in line and not (tmp_path / "r2").exists()
    # The built-in verifier reads a plain gold as well as GSM8K's, whatever the completion's form.
    verifier = MathVerifier()
    golds = ["7", "#### 7", "\\frac{1}{2}", "0.5", "The answer is \\boxed{1/2}.", "#### 1,234"]
    completions = ["#### 7", "7", "#### 1/2", "\\boxed{\\frac{1}{2}}", "#### 0.5", "1234"]
    assert verifier(["q"] * 6, completions, answer=golds) == [1.0] * 6
    assert verifier(["q"] * 2, ["#### 8", "#### 2/3"], answer=["7", "\\frac{1}{2}"]) == [0.0, 0.0]
    # The golds of the built-in tasks come back as they are.
    assert [tasks.gold_answer(p.gold) for p in tasks.arithmetic_problems()[1][:50]] == [
        p.gold for p in tasks.arithmetic_problems()[1][:50]
    ]


# --- prompts --------------------------------------------------------------------------------------------------------


def test_system_prompt_instruction_and_no_chat_template():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(shared_data("qwen2-tokenizer"))
    plain = Problem("What is 2+3?", "5", "", prompting=Prompting(system="Be brief.", instruction="Answer: {question}"))
    assert render_prompt(tok, plain) == tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Answer: What is 2+3?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    after = Problem("Q?", "5", prompting=Prompting(instruction="Think."))
    assert "<|im_start|>user\nQ?\nThink.<|im_end|>" in render_prompt(tok, after)
    raw = Problem("Q?", "5", prompting=Prompting(system="S", instruction="I", chat_template=False))
    assert render_prompt(tok, raw) == "S\n\nQ?\nI"
    assert (
        render_prompt(tok, Problem("Q?", "5", prompting=Prompting(chat_template=False))) == "Q?"
    )  # no task instruction
    # The defaults are the prompts as they were.
    assert render_prompt(tok, Problem("Q?", "5")) == tasks.format_prompt(tok, "Q?", tasks.INSTRUCTION)
    # A conversation (TRL's format) goes to the template as it is, the instruction on its last user message.
    talk = [{"role": "system", "content": "Own."}, {"role": "user", "content": "Hi"}]
    conv = Problem("Hi", "", "", messages=talk, prompting=Prompting(instruction="More."))
    assert render_prompt(tok, conv) == tok.apply_chat_template(
        [{"role": "system", "content": "Own."}, {"role": "user", "content": "Hi\nMore."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    with pytest.raises(TaskError, match="needs a chat template"):
        render_prompt(tok, Problem("Hi", "", messages=talk, prompting=Prompting(chat_template=False)))
    record = tasks.prompt_record(tok, after)
    assert record["prompt_format"] == "chat template" and "{question}\nThink." in record["prompt_template"]


def test_a_conversational_column_reaches_the_rewards_as_trl_gives_it(tmp_path):
    path = tmp_path / "chat.jsonl"
    rows = [{"prompt": [{"role": "user", "content": q}], "answer": a} for q, a in ARITH]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    train_set, heldout = load_dataset_problems(str(path), eval_size=2)
    p = heldout[0]
    assert p.messages == rows[0]["prompt"] and p.prompt == rows[0]["prompt"] and p.question == "12+34="
    # The loop hands a reward function the messages and [{"role": "assistant", ...}] completions
    # (problems.prompts.score_rows).
    seen = {}

    def fn(prompts, completions, answer, **kw):
        seen.update(prompts=prompts, completions=completions)
        return MathVerifier()(prompts, completions, answer=answer)

    class Ro:  # a rollout of one completion: "46<eos>"
        completion_ids = torch.tensor([[8, 10, 1]])
        completion_mask = torch.tensor([[1, 1, 1]])

    scores = score_rows(Rewards([rewards.Reward("fn", "fn", fn)]), [p], ["46"], Ro, RewardState(0, 1))
    assert seen["prompts"] == [rows[0]["prompt"]] and seen["completions"] == [[{"role": "assistant", "content": "46"}]]
    assert scores.total.tolist() == [1.0]
    with pytest.raises(TaskError, match="--no-chat-template needs text"):
        load_dataset_problems(str(path), eval_size=2, prompting=Prompting(chat_template=False))


def test_a_chat_model_run_on_a_conversational_column_with_a_system_prompt(tmp_path, main):
    """A random-weight Qwen2 on Qwen2's tokenizer (its chat template): the conversation as the template wrote it,
    after --system-prompt, is what the policy saw (completions.jsonl) and what config.json records."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(shared_data("qwen2-tokenizer"))
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model_dir = tmp_path / "qwen2-random"
    Qwen2ForCausalLM(cfg).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    data = tmp_path / "chat.jsonl"
    rows = [{"prompt": [{"role": "user", "content": f"What is {q[:-1]}?"}], "answer": a} for q, a in ARITH]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    args = ["--model", model_dir, "--dataset", data, "--system-prompt", "Be brief.", "--steps", 1, "--eval-size", 2]
    args += ["--prompts-per-step", 2, "--group-size", 2, "--max-new-tokens", 4, "--log-completions", 2]
    r = main(*args, "--out", out, "--no-progress")
    assert r.returncode == 0, r.stderr[-2000:]
    saved = json.loads((out / "config.json").read_text())
    expected = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 99-9?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert saved["prompt_format"] == "chat template" and saved["prompt_example"] == expected
    held = [r for r in jsonl(out / "completions.jsonl") if r["split"] == "eval"]
    assert held[0]["prompt"] == expected.replace("99-9", "12+34")


# --- what it writes: completions.jsonl, TensorBoard, wandb ----------------------------------------------------------


def wandb_history(run_dir: Path) -> list[dict]:
    """The history rows of an offline wandb run, read from its .wandb file (a LevelDB-style log of protobuf
    records: 7-byte file header, 32 KiB blocks, each record chunk with a 7-byte header: crc, length, type)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("offline-run-*/*.wandb")
    data, pos, block, buf, rows = path.read_bytes(), 7, 32768, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7 or data[pos + 6] == 0:  # the rest of a block is padding
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = pb.Record()
            record.ParseFromString(buf)
            buf = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item})
    return rows


def test_report_to_wandb_offline_logs_the_scalars_tensorboard_gets_and_the_completions(
    tmp_path, warm_cache, monkeypatch
):
    needs("wandb", "wandb")
    needs("tensorboard", "tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    args = tiny_run_args(warm_cache, out, "--report-to", "tensorboard,wandb", "--log-completions", "2")
    assert train.main(args) == 0
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    tb = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    history = wandb_history(out / "wandb")
    wb = {}
    for row in history:
        for key, value in row.items():
            if key.startswith("grpo/"):
                wb.setdefault(key, {})[row["_step"]] = value
    assert set(wb) == set(tb) and {"grpo/reward", "grpo/rewards/math", "grpo/lr", "grpo/reward_none_frac"} <= set(tb)
    for tag in tb:
        assert tb[tag].keys() == wb[tag].keys(), tag
        for step, value in tb[tag].items():
            assert wb[tag][step] == pytest.approx(value, rel=1e-6, abs=1e-7), (tag, step)
    assert any("completions/train" in k for row in history for k in row)  # the wandb.Table
    assert {"completions/train/text_summary", "completions/eval/text_summary"} <= set(events.Tags()["tensors"])
    assert json.loads((out / "config.json").read_text())["wandb_run_id"]


def test_completions_survive_kill_9_and_a_resume_logs_no_step_twice(tmp_path, warm_cache):
    out = tmp_path / "run"
    run = tiny_run_args(warm_cache, out, "--log-completions", "3", "--save-every", "2", steps=400)
    args = [sys.executable, str(ROOT / "train.py"), *run]
    p = subprocess.Popen(args, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    path = out / "completions.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (path.exists() and len(path.read_bytes().splitlines()) > 25):
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait()
    rows = jsonl(path)  # every line written is whole JSON
    assert len(rows) > 25 and {r["split"] for r in rows} == {"train", "eval"}
    r = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "--resume", "--out", str(out), "--steps", "40", "--no-progress"],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    rows = jsonl(path)
    train_rows = [(r["step"], r["row"]) for r in rows if r["split"] == "train"]
    assert len(train_rows) == len(set(train_rows)) == 40 * 3 and sorted(train_rows) == train_rows
    assert [r["step"] for r in rows if r["split"] == "eval"] == [-1] * 4 + [39] * 4


# --- --lr-scheduler, --warmup-ratio ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name, hf", [("constant", "constant_with_warmup"), ("linear", "linear"), ("cosine", "cosine")])
@pytest.mark.parametrize("ratio", [0.0, 0.25])
def test_the_schedule_is_transformers_own(name, hf, ratio):
    from transformers import get_scheduler

    steps = 13
    cfg = config.resolve(config.Config(lr=3e-4, steps=steps, lr_scheduler=name, warmup_ratio=ratio, out="o"))
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=3e-4)
    sched = get_scheduler(hf, opt, num_warmup_steps=math.ceil(ratio * steps), num_training_steps=steps)
    for k in range(steps):
        assert train.lr_at(cfg, k) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-12, abs=1e-18), (k, name)
        opt.step()
        sched.step()
    default = config.resolve(config.Config(out="o"))
    assert all(train.lr_at(default, k) == default.lr for k in range(default.steps))  # the run as it was


def test_a_scheduled_run_resumed_mid_period_is_the_uninterrupted_run(tmp_path, warm_cache, main):
    (tmp_path / "mine.py").write_text(USER_REWARDS)
    extra = ["--lr-scheduler", "cosine", "--warmup-ratio", "0.3", "--lr", "1e-3", "--offpolicy-steps", "2"]
    extra += ["--save-every", "1", "--keep-checkpoints", "5", "--log-completions", "2"]
    extra += ["--reward", "math", "--reward", f"{tmp_path}/mine.py:odd"]
    full = tmp_path / "full"
    assert main(*tiny_run_args(warm_cache, full, *extra, steps=4)).returncode == 0
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    for name in ("final", "summary.json"):
        shutil.rmtree(cut / name) if (cut / name).is_dir() else (cut / name).unlink()
    (cut / "checkpoints" / "step-00000004.pt").unlink()  # back to step 3: inside the refresh period of steps 2 and 3
    r = main("--resume", "--out", cut)
    assert r.returncode == 0, r.stderr[-2000:]
    from safetensors.torch import load_file

    wa, wb = load_file(full / "final" / "model.safetensors"), load_file(cut / "final" / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    drop = (
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
    rows = [[{k: v for k, v in m.items() if k not in drop} for m in jsonl(p / "metrics.jsonl")] for p in (full, cut)]
    assert rows[0] == rows[1] and "rewards/odd" in rows[1][3]  # step 3's rewards came with the checkpoint
    cfg = config.resolve(config.Config(steps=4, lr=1e-3, lr_scheduler="cosine", warmup_ratio=0.3, out="x"))
    assert [m["lr"] for m in rows[0]] == [pytest.approx(train.lr_at(cfg, k), rel=1e-5) for k in range(4)]
    # By hand: W = ceil(0.3 x 4) = 2 warm-up steps (0, 1/2), then cos over the 2 left (1, 1/2), times 1e-3.
    assert [m["lr"] for m in rows[0]] == [0.0, 5e-4, 1e-3, 5e-4]
    assert jsonl(full / "completions.jsonl") == jsonl(cut / "completions.jsonl")


# --- a failed start leaves no claimed --out ------------------------------------------------------------------------


def test_a_start_that_fails_leaves_no_run_and_the_same_command_then_works(tmp_path, warm_cache, main):
    out = tmp_path / "run"
    data = write_rows(tmp_path / "data.jsonl")
    # A bad model path: the folder is claimed, the model does not load, the folder goes again.
    line = error_line(main(*tiny_run_args(warm_cache, out, "--model", tmp_path / "no-model-here", "--dataset", data)))
    assert "no-model-here" in line and not out.exists()
    # Bad data: refused before --out is claimed.
    (tmp_path / "bad.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": ""}\n')
    bad = main(*tiny_run_args(warm_cache, out, "--dataset", tmp_path / "bad.jsonl"))
    assert "row 2" in error_line(bad) and not out.exists()
    # A reward that raises at the first evaluation; once fixed, the very same command runs, without --overwrite.
    (tmp_path / "flaky.py").write_text("def f(completions, **kw):\n    raise ValueError('not yet')\n")
    # With tensorboard where it is installed: its writer, opened by the start, is closed with the folder it wrote.
    board = ["--report-to", "tensorboard"] if importlib.util.find_spec("tensorboard") else []
    cmd = tiny_run_args(warm_cache, out, "--dataset", data, "--reward", f"{tmp_path}/flaky.py:f", *board)
    cmd += ["--system-prompt", "0", "--instruction", "{question}1", "--log-completions", "1"]
    assert "ValueError: not yet" in error_line(main(*cmd)) and not out.exists()
    (tmp_path / "flaky.py").write_text("def f(completions, **kw):\n    return [0.0] * len(completions)\n")
    rewards._modules.clear()  # a new process would import the fixed file
    r = main(*cmd)
    assert r.returncode == 0, r.stderr[-2000:]
    saved = json.loads((out / "config.json").read_text())
    # The shipped tokenizer drops characters it does not know (the newlines): the example is what the model saw.
    assert saved["prompt_template"] == "0\n\n{question}1" and saved["prompt_example"] == f"0{ARITH[4][0]}1"
    assert saved["prompt_example_lossy"] is True
    assert saved["prompt_format"] == "raw text (the tokenizer has no chat template)"
    # An --out that existed before stays, empty, after a failed start.
    kept = tmp_path / "kept"
    kept.mkdir()
    error_line(main(*tiny_run_args(warm_cache, kept, "--model", tmp_path / "no-model-here")))
    assert kept.is_dir() and list(kept.iterdir()) == []


# --- the TRL integration takes the same function ----------------------------------------------------------------


def test_the_same_function_is_a_reward_funcs_entry_of_the_trl_integration(tmp_path, warm_cache):
    needs("trl", "trl")
    from datasets import Dataset
    from trl_testing import G, save_policy

    from engine import tiny as tiny_policy
    from integrations.trl_grpo import OffPolicyGRPOConfig, OffPolicyGRPOTrainer

    (tmp_path / "mine.py").write_text(USER_REWARDS)
    exact, length = (load_reward(f"{tmp_path}/mine.py:{f}").fn for f in ("exact", "length"))
    policy_dir = save_policy(warm_cache, tmp_path / "policy")
    rows = [{"prompt": q, "answer": a, "digits": len(a), "op": "x"} for q, a in ARITH]
    args = OffPolicyGRPOConfig(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=8,
        num_generations=G,
        max_completion_length=8,
        max_steps=1,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        reward_weights=[1.0, 0.5],
    )
    trainer = OffPolicyGRPOTrainer(
        model=policy_dir,
        reward_funcs=[exact, length],
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tiny_policy.build_tokenizer(),
    )
    trainer.model.train()
    calls = user_module(tmp_path / "mine.py").CALLS
    calls.clear()
    batch = trainer._generate_and_score_completions([rows[i] for i in range(2) for _ in range(G)])
    texts = trainer.processing_class.batch_decode(batch["completion_ids"], skip_special_tokens=True)
    golds = [rows[i]["answer"] for i in range(2) for _ in range(G)]
    by_hand = torch.tensor(
        [[1.0 if t.strip() == a else 0.0, 1.0 if len(t.strip()) == len(a) else 0.0] for t, a in zip(texts, golds)]
    )
    assert torch.equal(trainer._rewards.cpu(), by_hand)  # TRL called the very function, on its own completions
    # The keywords TRL passed are those train.py passes (the test above): the same function moves unchanged.
    ((name, n, keys, _),) = calls
    assert name == "exact" and n == 2 * G
    assert keys == ["completion_ids", "digits", "log_extra", "log_metric", "op", "trainer_state"]


# --- the docs ------------------------------------------------------------------------------------------------------


def doc_blocks() -> tuple[list[str], list[str]]:
    """docs/your-own-task.md's bash blocks above its marker (run as they are), and those below it."""
    text = (ROOT / "docs" / "your-own-task.md").read_text()
    ran, rest = text.split("<!-- The commands above are run as they are")
    return re.findall(r"```bash\n(.*?)```", ran, flags=re.S), re.findall(r"```bash\n(.*?)```", rest, flags=re.S)


def test_the_your_own_task_page_runs_as_written(tmp_path):
    """The page's commands, in order, in a folder that looks like the checkout to them (its files linked)."""
    for path in [*ROOT.glob("*.py"), ROOT / "tiny_policy"]:
        (tmp_path / path.name).symlink_to(path)
    blocks, later = doc_blocks()
    assert len(blocks) >= 4 and any("python train.py --dataset problems.jsonl --reward" in b for b in blocks)
    # Under pipefail, `... | head` fails with 141 whenever the writer is still writing when head exits (a race:
    # it failed once in CI); the page takes the first lines with the command's own limit, e.g. `grep -m 2`.
    assert not any(re.search(r"\|\s*head\b", b) for b in blocks), "a doc block pipes into head"
    outputs = []
    for block in blocks:
        cmd = ["bash", "-euo", "pipefail", "-c", block]
        r = subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, (block, r.stderr[-2000:])
        outputs.append(r.stdout)
    text = (ROOT / "docs" / "your-own-task.md").read_text()
    # What the page shows is what the commands print: the data's first rows as they are; the logged completions
    # (a sampled model's, so the CPU's kernels may change their text) with the fields shown.
    first = outputs[0].splitlines()[:2]
    assert all(line in text for line in first), first
    shown = [json.loads(line) for line in re.findall(r'^(\{"split": "train".*)$', text, flags=re.M)]
    logged = [json.loads(line) for line in outputs[-1].splitlines()]
    assert len(shown) == len(logged) == 2 and [r.keys() for r in shown] == [r.keys() for r in logged]
    run = tmp_path / "runs" / "my-task"
    saved = json.loads((run / "config.json").read_text())
    assert saved["reward"] == [f"{tmp_path}/my_reward.py:exact", f"{tmp_path}/my_reward.py:length"]
    assert {"rewards/exact", "rewards/length", "reward_none_frac"} <= set(jsonl(run / "metrics.jsonl")[-1])
    summary = json.loads((run / "summary.json").read_text())
    figures = re.search(r"here ([\d.]+) and ([\d.]+) of a possible", text)
    assert summary["eval_reward_start"] == pytest.approx(float(figures.group(1)), abs=0.05)
    accuracy = re.search(r"is > 0: here ([\d.]+) before and after", text)  # no verifier: weighted reward > 0
    assert summary["eval_accuracy_start"] == pytest.approx(float(accuracy.group(1)), abs=0.05)
    exact = re.search(r"`eval_rewards/exact` \(([\d.]+), then", text)
    assert summary["eval_rewards/exact_start"] == pytest.approx(float(exact.group(1)), abs=0.05)
    # The commands for a real model are not run here, but every flag in them exists and passes the checks.
    commands = [
        line for b in later for line in b.replace("\\\n", " ").splitlines() if line.startswith("python train.py")
    ]
    assert len(commands) >= 2
    for line in commands:
        args, given = config.parse_args(shlex.split(line)[2:])
        cfg = config.config_from_args(args, given)
        if "math-symbolic" not in cfg.reward or importlib.util.find_spec("math_verify"):
            config.validate(cfg)


def test_no_user_facing_text_names_the_shared_folder():
    # No file of the repository points outside it (issue 51: two studies' docstrings and a default did); only the
    # tests look beside the checkout, for data they skip without (conftest.shared_data).
    texts = [*ROOT.glob("*.md"), *ROOT.glob("*.py"), *ROOT.glob("*.toml"), *ROOT.glob("*/*.py"), *ROOT.glob("*/*.md")]
    texts = [p for p in texts if p.parent.name not in ("tests", ".venv", "runs") and ".egg-info" not in str(p)]
    assert len(texts) > 50
    for path in texts:
        text = path.read_text()
        assert "../shared" not in text and "shared/data" not in text and "ROOT.parent" not in text, path
    assert "shared" not in config.build_parser().format_help()
    assert "openai/gsm8k" in (ROOT / "docs" / "experiments.md").read_text()
    assert "HuggingFaceH4/MATH-500" in (ROOT / "docs" / "experiments.md").read_text()
