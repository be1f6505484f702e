"""--task math (tasks.math_row, MATH-style JSONL), and held-out pass@1 over k samples (--eval-samples)."""

import json
import subprocess
import sys

import pytest
import torch

import train
from bookkeeping.evaluation import evaluate
from conftest import ROOT, TEST_WARMUP, shared_data
from problems.tasks import MATH_INSTRUCTION, Problem, TaskError, load_task, math_row, read_jsonl


def write(tmp_path, rows) -> str:
    p = tmp_path / "m.jsonl"
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(p)


def test_math500_reads_as_500_problems_with_their_answers_as_gold():
    path = shared_data("math500", "test.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    train_set, heldout = load_task("math", str(path), str(path), eval_size=500)
    assert len(heldout) == 500 and [p.gold for p in heldout] == [r["answer"] for r in rows]
    assert heldout[0].question == rows[0]["problem"] and heldout[0].instruction == MATH_INSTRUCTION
    assert heldout[0].gold == "\\left( 3, \\frac{\\pi}{2} \\right)"
    # Without --eval-files, the first eval_size rows are held out and the rest train.
    train_set, heldout = load_task("math", str(path), None, eval_size=100)
    assert (len(train_set), len(heldout)) == (400, 100) and heldout[0].question == rows[0]["problem"]


def test_without_answer_the_gold_is_the_solutions_last_boxed_with_nested_braces(tmp_path):
    path = write(
        tmp_path,
        [
            {"problem": "p1", "solution": "So $\\boxed{2}$ is wrong; it is $\\boxed{\\frac{\\sqrt{3}}{3}}$."},
            {"problem": "p2", "answer": " 7 ", "solution": "\\boxed{8}"},  # answer wins, stripped
        ],
    )
    assert [p.gold for p in read_jsonl(path, parse_row=math_row)] == ["\\frac{\\sqrt{3}}{3}", "7"]


@pytest.mark.parametrize(
    "row,expect",
    [
        ({"question": "q", "answer": "1"}, ":2: row needs a non-empty string field 'problem'"),
        ({"problem": "p"}, ":2: row needs a string field 'answer', or 'solution'"),
        ({"problem": "p", "solution": "no box here"}, ":2: no 'answer', and 'solution' has no final \\boxed{}"),
        ({"problem": "p", "answer": 3}, ":2: 'answer' must be a string"),
        ({"problem": "p", "answer": "  "}, ":2: the answer is empty"),
        ([1, 2], ":2: a row must be a JSON object"),
    ],
)
def test_a_bad_math_row_is_named_by_file_and_line(tmp_path, row, expect):
    path = write(tmp_path, [{"problem": "ok", "answer": "1"}, row])
    with pytest.raises(TaskError) as e:
        load_task("math", path, path, eval_size=1)
    assert str(e.value) == f"{path}{expect}" or (str(e.value).startswith(path) and expect in str(e.value))


def run_cli(*args, env_extra=None):
    env = {"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)


def test_task_math_without_math_verify_is_one_line_naming_the_extra(tmp_path):
    # math_verify made unimportable, as on a machine with only .[dev]
    code = "import sys; sys.modules['math_verify'] = None; import train; sys.exit(train.main(sys.argv[1:]))"
    data = shared_data("math500", "test.jsonl")
    r = run_cli("-c", code, "--task", "math", "--data-files", str(data), "--out", str(tmp_path / "o"))
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0] == "error: --task math scores answers with math-verify, an optional extra: pip install -e '.[math]'"
    assert not (tmp_path / "o").exists()
    r = run_cli("train.py", "--task", "math", "--out", str(tmp_path / "o"))  # and it needs its file
    assert r.returncode == 2 and "--task math reads a local JSONL" in r.stderr.strip().splitlines()[-1]


@pytest.mark.model
def test_pass1_over_k_greedy_samples_is_greedy_accuracy_and_sampled_is_a_mean_of_k(warm_cache):
    from engine import tiny

    model, tok = tiny.load_tiny(warm_cache, warmup_steps=TEST_WARMUP, log=lambda m: None)  # the warmed-up policy
    problems = [Problem(q, a) for q, a in (("12+34=", "46"), ("7*8=", "56"), ("99-9=", "90"), ("3+4=", "7"))]
    greedy = evaluate(model, tok, problems, 6, "cpu")
    # k greedy samples are k copies of the greedy completion: their mean accuracy is greedy accuracy.
    assert evaluate(model, tok, problems, 6, "cpu", samples=3, temperature=0.0) == greedy
    # Sampled: the mean over problems of the mean over k of the verifier, whatever the batching.
    rewards = []

    def counting(completion, gold):
        from reward import math_reward

        rewards.append(math_reward(completion, gold))
        return rewards[-1]

    gen = torch.Generator().manual_seed(0)
    k = 4
    acc = evaluate(model, tok, problems, 6, "cpu", counting, samples=k, temperature=1.0, generator=gen)
    assert len(rewards) == k * len(problems) and acc == pytest.approx(sum(rewards) / len(rewards))
    assert 0.0 < greedy <= 1.0


@pytest.mark.model
def test_eval_samples_reach_metrics_and_summary_and_leave_training_as_it_was(tmp_path, warm_cache):
    def run(out, *extra):
        args = ["--steps", 2, "--prompts-per-step", 2, "--group-size", 2, "--eval-size", 4, "--eval-every", 1]
        args += ["--warmup-steps", TEST_WARMUP, "--cache-dir", warm_cache, "--out", out, "--no-progress", *extra]
        assert train.main([str(a) for a in args]) == 0
        return [json.loads(line) for line in (tmp_path / out / "metrics.jsonl").read_text().splitlines()]

    plain = run(tmp_path / "plain")
    sampled = run(tmp_path / "k", "--eval-samples", 3, "--eval-temperature", 0.8, "--eval-top-p", 0.9)
    summary = json.loads((tmp_path / "k" / "summary.json").read_text())
    assert {"eval_pass1_start", "eval_pass1_end", "eval_accuracy_start", "eval_accuracy_end"} <= set(summary)
    assert "eval_pass1" in sampled[0] and "eval_pass1" not in plain[0] and "eval_accuracy" in plain[0]
    # The evaluation samples draw from a generator of their own: training is unchanged, step for step.
    for a, b in zip(plain, sampled):
        assert [a.get(k) for k in ("reward", "loss", "eval_accuracy")] == [
            b.get(k) for k in ("reward", "loss", "eval_accuracy")
        ]
    assert "eval_pass1_start" not in json.loads((tmp_path / "plain" / "summary.json").read_text())
