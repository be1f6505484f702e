"""Issue 44, reward functions as a careless or hostile user writes them (problems/user_rewards.py): what they log
never replaces the run's figures, anything they raise (SystemExit, KeyboardInterrupt, ...) is one line naming them,
their values and weighted totals are finite in float32, what TRL takes as a return value is taken, each gets its own
copy of the inputs, and `accuracy` is defined for any rewards and never exceeds 1.

Mostly `Rewards.score` called directly; two runs of the tiny policy through train.main check the same end to end.
Expectations are computed apart from the code under test: TRL's own reading of a return value, sums by hand.
"""

import asyncio
import json
import math
import sys
from collections import deque
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import config
from bookkeeping import evaluation
from bookkeeping.failures import Stopped
from bookkeeping.metrics import reward_metrics
from conftest import error_line, jsonl, tiny_run_args
from problems.user_rewards import Reward, RewardError, Rewards, RewardState, load_reward

N = 4
COMPLETIONS = ["1", "2", "1", "x"]
ANSWERS = ["1", "1", "1", "1"]


def score(*fns, weights=None, names=None, completions=COMPLETIONS, columns=None):
    """Rewards.score of functions (or Rewards entries) on 4 rows, with an `answer` column."""
    entries = [
        f if isinstance(f, Reward) else Reward(f"mine.py:{n}", n, f)
        for f, n in zip(fns, names or [f"f{i}" for i in range(len(fns))])
    ]
    funcs = Rewards(entries, weights)
    columns = {"answer": list(ANSWERS)} if columns is None else columns
    return funcs, funcs.score(["q"] * N, list(completions), [[5, 1]] * N, columns, RewardState(2, 9))


def refused(*fns, weights=None) -> str:
    with pytest.raises(RewardError) as e:
        score(*fns, weights=weights)
    msg = str(e.value)
    assert "\n" not in msg and "Traceback" not in msg, msg
    return msg


def builtin() -> Reward:
    return load_reward("math")


# --- 1. what a function logs lives under its own prefix ------------------------------------------------------------

# The run's own names, and a few more a user may well pick.
RUN_NAMES = ["accuracy", "step", "reward", "loss", "eval_accuracy", "wall_s", "rewards/f0", "reward_none_frac", "lr"]


@pytest.mark.parametrize("name", RUN_NAMES)
def test_log_metric_of_a_run_name_lands_under_logged(name):
    def fn(completions, log_metric, **kw):
        log_metric(name, 7.0)
        log_metric(name, 9.0)
        return [1.0, 0.0, 1.0, 0.0]

    funcs, scores = score(fn)
    out = reward_metrics(scores, funcs.names)
    assert out[f"logged/{name}"] == 8.0  # averaged over the step's calls
    # Nothing but the reward figures and the prefixed ones: the step row's own fields stay the row's.
    assert {k for k in out if not k.startswith("logged/")} == {"accuracy", "rewards/f0", "reward_none_frac"}
    assert out["accuracy"] == 0.5 and out["rewards/f0"] == 0.5
    row = {"step": 3, "reward": 0.5, "accuracy": 0.5, "loss": 0.1, "wall_s": 1.0, "lr": 1e-3}
    merged = {**row, **out}
    assert all(merged[k] == v for k, v in row.items())


def test_the_held_out_prefix_and_the_completion_rows_keep_the_run_keys():
    def fn(completions, log_metric, log_extra, **kw):
        for key in ("prompt", "completion", "reward", "rewards", "split", "step", "row", "group", "advantage"):
            log_extra(key, [f"mine-{key}"] * len(completions))
        log_metric("accuracy", 5.0)
        return [2.0, 0.0, 1.0, None]

    funcs, scores = score(fn)
    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens: "the prompt")
    ro = SimpleNamespace(prompt_ids=torch.ones(N, 3, dtype=torch.long), prompt_mask=torch.ones(N, 3))
    rows = evaluation.completion_rows(tokenizer, ro, COMPLETIONS, scores, funcs.names, range(N))
    for i, row in enumerate(rows):
        assert row["prompt"] == "the prompt" and row["completion"] == COMPLETIONS[i]
        assert row["reward"] == [2.0, 0.0, 1.0, 0.0][i] and row["rewards"] == {"f0": [2.0, 0.0, 1.0, None][i]}
        assert row["logged/prompt"] == "mine-prompt" and row["logged/advantage"] == "mine-advantage"
    # logged_rows' own keys come around the completion's: none of them can be a log_extra column's.
    assert not any(k.startswith("logged/") for k in ("split", "step", "row", "group", "advantage"))


def test_log_metric_and_log_extra_values_that_cannot_be_written_are_one_line():
    def metric(value):
        def fn(completions, log_metric, **kw):
            log_metric("m", value)
            return [0.0] * len(completions)

        return fn

    for value, words in [
        (math.nan, "not finite"),
        (math.inf, "not finite"),
        (10**400, "an int of 401 digits"),
        ("3", "not a number"),
        (None, "not a number"),
        ([1.0], "not a number"),
    ]:
        msg = refused(metric(value))
        assert msg.startswith("--reward mine.py:f0: f0 logged ") and words in msg and "'m' (log_metric)" in msg, msg
    _, scores = score(metric(np.float32(0.5)), metric(torch.tensor(2.0)), metric(True))
    assert scores.metrics == {"m": pytest.approx((0.5 + 2.0 + 1.0) / 3)}

    def extra(completions, log_extra, **kw):
        log_extra("x", [1.0, math.nan, 0.0, 0.0])
        return [0.0] * len(completions)

    msg = refused(extra)
    assert "log_extra column 'x' cannot be written as JSON" in msg, msg


def test_a_log_extra_column_of_the_wrong_length_or_logged_twice_is_one_line():
    # Issue 51: one value for 4 completions used to vanish from completions.jsonl without a word.
    def logging(*columns):
        def fn(completions, log_extra, **kw):
            for column, values in columns:
                log_extra(column, values)
            return [0.0] * len(completions)

        return fn

    for values in ([1], [1] * (N + 1), []):
        msg = refused(logging(("x", values)))
        assert msg == f"--reward mine.py:f0: f0's log_extra column 'x': {len(values)} values for {N} completions", msg
    msg = refused(logging(("x", [1] * N), ("x", [2] * N)))
    assert msg == "--reward mine.py:f0: f0's log_extra column 'x': logged twice", msg
    _, scores = score(logging(("x", list(range(N)))), logging(("y", ["a"] * N)))  # one value each: kept
    assert scores.extras == {"x": [0, 1, 2, 3], "y": ["a"] * N}


# --- 2. anything a function raises is one line naming it -----------------------------------------------------------


def raising(exc):
    def fn(completions, **kw):
        raise exc

    return fn


@pytest.mark.parametrize(
    "exc, words",
    [
        (SystemExit(0), "SystemExit(0)"),
        (SystemExit(5), "SystemExit(5)"),
        (SystemExit(), "SystemExit(None)"),
        (SystemExit("bye\nthen"), "SystemExit('bye"),
        (KeyboardInterrupt(), "KeyboardInterrupt"),
        (GeneratorExit(), "GeneratorExit"),
        (asyncio.CancelledError(), "CancelledError"),
        (MemoryError(), "MemoryError"),
        (RecursionError("too deep"), "RecursionError: too deep"),
    ],
)
def test_a_base_exception_at_the_call_is_a_reward_error(exc, words):
    msg = refused(raising(exc))
    assert msg.startswith(f"--reward mine.py:f0: f0 raised on {N} rows: {words}"), msg


def test_a_base_exception_in_a_generator_or_an_async_function_is_a_reward_error():
    def gen(completions, **kw):
        yield 1.0
        sys.exit(7)

    async def later(completions, **kw):
        raise KeyboardInterrupt

    assert "raised on 4 rows: SystemExit(7)" in refused(gen)
    assert "raised on 4 rows: KeyboardInterrupt" in refused(later)


def test_a_real_ctrl_c_passes_through_untouched():
    stop = Stopped(2)
    with pytest.raises(Stopped) as e:
        score(raising(stop))
    assert e.value is stop and e.value.exit_status == 130


@pytest.mark.parametrize(
    "code, words",
    [
        ("import sys\nsys.exit(0)\n", "SystemExit(0)"),
        ("raise SystemExit(5)\n", "SystemExit(5)"),
        ("raise KeyboardInterrupt\n", "KeyboardInterrupt"),
        ("raise GeneratorExit('x')\n", "GeneratorExit: x"),
    ],
)
def test_a_base_exception_at_import_is_a_reward_error(tmp_path, monkeypatch, code, words):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "exits.py").write_text(code + "def f(completions, **kw):\n    return [0.0] * len(completions)\n")
    name = f"exits_mod_{abs(hash(code))}"
    (tmp_path / f"{name}.py").write_text((tmp_path / "exits.py").read_text())
    # A module beside the working directory is imported as its file (user_rewards.import_module): named by its path.
    for spec, what in [("exits.py:f", "exits.py"), (f"{name}:f", f"{name}.py")]:
        with pytest.raises(RewardError) as e:
            load_reward(spec)
        msg = str(e.value)
        assert msg.startswith(f"--reward {spec}: importing ") and f"{what} failed: {words}" in msg, msg
        assert "\n" not in msg
    assert name not in sys.modules  # nothing half-imported is left for the next try
    (tmp_path / "exits.py").write_text("def f(completions, **kw):\n    return [0.0] * len(completions)\n")
    assert load_reward("exits.py:f").fn(completions=["a"]) == [0.0]  # fixed, the file imports


def test_a_real_ctrl_c_at_import_passes_through(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "slow.py").write_text("from bookkeeping.failures import Stopped\nraise Stopped(15)\n")
    with pytest.raises(Stopped):
        load_reward("slow.py:f")


# --- 3. finite in float32 ------------------------------------------------------------------------------------------


def returning(*values):
    return lambda completions, **kw: list(values)


@pytest.mark.parametrize(
    "value, shown",
    [
        (1e39, "1e+39"),
        (-1e39, "-1e+39"),
        (3.5e38, "3.5e+38"),
        (np.float64(1e39), "1e+39"),
        (torch.tensor(-1e300, dtype=torch.float64), "-1e+300"),
        (10**400, "an int of 401 digits"),
        (-(10**400), "an int of 401 digits"),
        (10**5000, "an int of 5001 digits"),  # beyond CPython's 4,300-digit str() limit
        (Fraction(10**400, 3), "a Fraction too large for a float"),
    ],
    ids=lambda x: x if isinstance(x, str) else type(x).__name__,  # an int of 5,001 digits has no str()
)
def test_a_value_beyond_float32_is_one_line_naming_the_function_and_completion(value, shown):
    msg = refused(returning(0.0, 0.0, value, 0.0))
    assert msg.startswith(f"--reward mine.py:f0: f0 returned {shown} for completion 2: beyond float32's range"), msg


def test_the_edge_of_float32_is_accepted():
    big = float(torch.finfo(torch.float32).max)
    _, scores = score(returning(big, -big, 1e-50, 0.0))
    assert scores.total.tolist() == [big, -big, 0.0, 0.0] and torch.isfinite(scores.total).all()


def test_a_weighted_total_beyond_float32_names_the_weights_and_the_completion():
    msg = refused(returning(0.0, 1e30, 0.0, 0.0), weights=[1e10])
    assert msg.startswith("--reward-weights 1e+10: the weighted reward of completion 1, 1e+10 x 1e+30 (f0)"), msg
    # Each product finite, their sum not.
    msg = refused(returning(3e38, 0.0, 0.0, 0.0), returning(3e38, 0.0, 0.0, 0.0))
    assert "completion 0, 1 x 3e+38 (f0) + 1 x 3e+38 (f1), is beyond float32's range" in msg, msg
    # inf - inf is NaN, which nansum would have counted as a None: still caught.
    msg = refused(returning(None, 2e38, 0.0, 0.0), returning(None, -2e38, 0.0, 0.0), weights=[2.0, 2.0])
    assert "completion 1," in msg, msg
    # A weight that is not a float32 at all: refused before any call.
    with pytest.raises(RewardError, match=r"--reward-weights: 1e\+39 is beyond float32's range"):
        Rewards([Reward("a", "a", returning(0.0))], [1e39])


# --- 4. what TRL takes as a return value ---------------------------------------------------------------------------


def trl_reads(out) -> list[float]:
    """TRL 1.16's reading (GRPOTrainer._calculate_rewards): None -> NaN, then torch.tensor(..., float32)."""
    values = [r if r is not None else torch.nan for r in out]
    return torch.tensor(values, dtype=torch.float32).tolist()


class OnlyIter:
    def __iter__(self):
        return iter([0.5, None, 1, 2])


TAKEN = {
    "list": lambda: [0.5, None, 1, 2],
    "tuple": lambda: (0.5, None, 1, 2),
    "generator": lambda: (x for x in [0.5, None, 1, 2]),
    "range": lambda: range(4),
    "deque": lambda: deque([1.0, 0.0, None, 3]),
    "iterable": lambda: OnlyIter(),
    "0-d tensors": lambda: [torch.tensor(0.5), torch.tensor(1), torch.tensor(True), None],
    "1-d tensor": lambda: torch.tensor([0.5, 1.0, 2.0, 3.0]),
    "bf16 tensor": lambda: torch.tensor([0.5, 1.0, 2.0, 3.0], dtype=torch.bfloat16),
    "numpy array": lambda: np.array([0.5, 1.0, 2.0, 3.0]),
    "numpy ints": lambda: np.arange(4),
    "numpy bools": lambda: np.array([True, False, True, True]),
    "numpy scalars": lambda: [np.float32(0.5), np.int64(3), np.bool_(True), None],
    "bools": lambda: [True, False, True, None],
}


@pytest.mark.parametrize("kind", sorted(TAKEN))
def test_what_trl_takes_is_taken_as_trl_reads_it(kind):
    _, scores = score(lambda completions, **kw: TAKEN[kind]())
    expected = trl_reads(TAKEN[kind]())
    got = scores.parts[0].tolist()
    assert len(got) == N and all((math.isnan(a) and math.isnan(b)) or a == b for a, b in zip(got, expected))


def test_numbers_trl_cannot_stack_are_taken_too():
    # torch.tensor refuses a list of 0-d numpy arrays and Fractions; they are real numbers all the same.
    _, scores = score(lambda completions, **kw: [np.array(0.5), np.array(2), None, Fraction(3, 4)])
    assert scores.total.tolist() == [0.5, 2.0, 0.0, 0.75]


def test_a_pandas_series_is_taken():
    pd = pytest.importorskip("pandas")
    _, scores = score(lambda completions, **kw: pd.Series([0.5, 1.0, 2.0, 3.0]))
    assert scores.total.tolist() == [0.5, 1.0, 2.0, 3.0]
    _, scores = score(lambda completions, **kw: pd.Series([0.5, None, 2, 3], dtype=object))
    assert scores.none_frac() == 1 / 4 and scores.total.tolist() == [0.5, 0.0, 2.0, 3.0]
    # A float Series holds a None as NaN: refused, with what to do instead.
    msg = refused(lambda completions, **kw: pd.Series([0.5, None, 2.0, 3.0]))
    assert "returned NaN for completion 1" in msg and "dtype=object" in msg, msg


@pytest.mark.parametrize(
    "out, words",
    [
        ("1234", "returned a str; it must return a list"),
        (b"1234", "returned a bytes; it must return a list"),
        ({"a": 1, "b": 1, "c": 1, "d": 1}, "returned a dict; it must return a list"),
        ({1.0, 2.0, 3.0, 4.0}, "returned a set; it must return a list"),
        (torch.tensor(1.0), "returned a Tensor; it must return a list"),
        (np.float64(1.0), "returned a float64; it must return a list"),
        (None, "returned a NoneType; it must return a list"),
        (np.zeros((4, 1)), "for completion 0: not a number"),
        ([1 + 2j] * 4, "returned (1+2j) (complex) for completion 0: not a number"),
        (["1"] * 4, "returned '1' (str) for completion 0: not a number"),
        ((x for x in iter(int, 1)), "returned more than 4 rewards for 4 completions"),  # a generator without end
        ((x for x in [1.0, 2.0, 3.0]), "returned 3 rewards for 4 completions"),
        (np.zeros(5), "returned 5 rewards for 4 completions"),
    ],
)
def test_what_is_not_a_list_of_rewards_is_still_refused(out, words):
    msg = refused(lambda completions, **kw: out)
    assert msg.startswith("--reward mine.py:f0: f0 ") and words in msg, msg


# --- 5. each function gets its own copy of the inputs --------------------------------------------------------------


def test_a_function_that_changes_its_inputs_changes_nothing_another_sees():
    def vandal(prompts, completions, completion_ids, answer, meta, trainer_state, **kw):
        prompts[0] = "changed"
        prompts.append("extra")
        completions.clear()
        completion_ids[0].append(999)
        answer[:] = ["9"] * len(answer)
        meta[0]["level"] = -1
        trainer_state.global_step = 10**6
        return [0.0] * N

    seen = []

    def witness(prompts, completions, completion_ids, answer, meta, trainer_state, **kw):
        seen.append((prompts, completions, completion_ids, answer, meta, trainer_state.global_step))
        return [0.0] * N

    prompts, completions = ["q"] * N, list(COMPLETIONS)
    ids, columns = [[5, 1] for _ in range(N)], {"answer": list(ANSWERS), "meta": [{"level": i} for i in range(N)]}
    before = json.dumps([prompts, completions, ids, columns])
    for order in ([vandal, witness, builtin()], [builtin(), vandal, witness]):
        entries = [f if isinstance(f, Reward) else Reward(f.__name__, f.__name__, f) for f in order]
        scores = Rewards(entries).score(prompts, completions, ids, columns, RewardState(2, 9))
        assert seen[-1] == (["q"] * N, COMPLETIONS, [[5, 1]] * N, ANSWERS, [{"level": i} for i in range(N)], 2)
        assert scores.parts[[e.name for e in entries].index("math")].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert json.dumps([prompts, completions, ids, columns]) == before  # the run's own data, untouched


# --- 6. accuracy: defined for any rewards, never above 1 -----------------------------------------------------------


def test_accuracy_is_the_verifiers_credit_whatever_the_weights():
    bonus = returning(0.0, 5.0, 0.0, 0.0)  # rewards the wrong answer "2"
    for weights in ([1.0, 1.0], [2.0, 0.5], [0.5, 3.0], [-1.0, 1.0]):
        funcs, scores = score(builtin(), bonus, weights=weights)
        assert scores.accuracy(funcs.names) == 0.5  # "1", "1" of "1", "2", "1", "x": the verifier's column
    funcs, scores = score(bonus, builtin(), weights=[1.0, 2.0])  # wherever it is among the rewards
    assert scores.accuracy(funcs.names) == 0.5 and reward_metrics(scores, funcs.names)["accuracy"] == 0.5
    # A lone verifier with a weight other than 1: the old rule (total == 1) gave 0.0.
    funcs, scores = score(builtin(), weights=[2.0])
    assert scores.total.tolist() == [2.0, 0.0, 2.0, 0.0] and scores.accuracy(funcs.names) == 0.5


def test_accuracy_without_a_verifier_is_the_share_of_weighted_rewards_above_zero():
    funcs, scores = score(returning(-1.0, 0.0, 2.0, None), returning(None, None, None, 3.0), weights=[1.5, 1.0])
    assert scores.total.tolist() == [-1.5, 0.0, 3.0, 3.0] and scores.accuracy(funcs.names) == 0.5
    funcs, scores = score(returning(9.0, 9.0, 9.0, 9.0), weights=[100.0])
    assert scores.accuracy(funcs.names) == 1.0  # never above 1, however large the rewards


def test_a_function_of_ones_own_named_math_is_not_taken_for_the_verifier():
    def mine(completions, **kw):  # given the name `math` below, as `def math(...)` in a user's file would be
        return [1.0] * len(completions)

    funcs, scores = score(mine, names=["math"])
    assert funcs.names == ["math_2"] and scores.accuracy(funcs.names) == 1.0
    funcs, scores = score(mine, builtin(), names=["math", "math"])
    assert funcs.names == ["math_2", "math"] and scores.accuracy(funcs.names) == 0.5
    funcs, _ = score(mine, mine, builtin(), names=["math_2", "math_2", "math"])
    assert len(set(funcs.names)) == 3 and funcs.names[2] == "math"


def test_the_default_run_reports_accuracy_as_before():
    funcs, scores = score(builtin())
    total = scores.total
    assert scores.accuracy(funcs.names) == (total == 1.0).float().mean().item() == 0.5
    assert reward_metrics(scores, funcs.names)["accuracy"] == (total == 1.0).float().mean().item()
    cfg = config.resolve(config.Config(out="o"))
    assert not evaluation.own_rewards(cfg)
    assert evaluation.eval_line(cfg, {"eval_accuracy": 0.25}, 4) == (
        "held-out greedy accuracy before training: 0.250 (4 problems)"
    )
    end = evaluation.eval_line(cfg, {"eval_accuracy": 0.5}, 4, start={"eval_accuracy": 0.25})
    assert end == "held-out greedy accuracy after training:  0.500 (start 0.250, +0.250)"


def test_the_log_line_says_what_accuracy_counts_and_gives_the_mean_reward_beside_it():
    weighted = config.resolve(config.Config(out="o", reward=["math"], reward_weights=[2.0]))
    assert evaluation.own_rewards(weighted) and evaluation.measure(weighted) == "accuracy"
    mine = config.resolve(config.Config(out="o", reward=["mine.py:f"]))
    assert evaluation.measure(mine) == "accuracy (weighted reward > 0)"
    line = evaluation.eval_line(mine, {"eval_accuracy": 0.5, "eval_reward": 1.25}, 4, start={"eval_accuracy": 0.25})
    assert line == (
        "held-out greedy accuracy (weighted reward > 0) after training:  0.500 (start 0.250, +0.250); "
        "mean reward 1.250 (start not evaluated)"
    )


# --- end to end: train.main on the tiny policy ---------------------------------------------------------------------

ARITH = [("12+34=", "46"), ("7*8=", "56"), ("99-9=", "90"), ("3+4=", "7"), ("50-25=", "25"), ("6*7=", "42")]
ARITH += [("11+11=", "22"), ("9*9=", "81"), ("40+2=", "42"), ("8-3=", "5"), ("5*5=", "25"), ("60+7=", "67")]

HOSTILE = """
import sys


def greedy_logger(prompts, completions, completion_ids, answer, log_metric, log_extra, trainer_state, **kw):
    for name in ("accuracy", "step", "reward", "loss", "eval_accuracy", "wall_s"):
        log_metric(name, 1000.0 + trainer_state.global_step)
    log_extra("prompt", ["not the prompt"] * len(completions))
    log_extra("step", [-99] * len(completions))
    prompts.clear()  # and it changes what it was given: the verifier after it must not see it
    answer[:] = ["nonsense"] * len(answer)
    return (3.0 if len(c) % 2 else None for c in completions)  # a generator, as TRL takes


def exits_at_step_1(completions, trainer_state, **kw):
    if trainer_state.global_step == 1:
        sys.exit(5)
    return [0.0] * len(completions)
"""


def write_data(path: Path) -> Path:
    path.write_text("".join(json.dumps({"prompt": q, "answer": a}) + "\n" for q, a in ARITH))
    return path


@pytest.mark.model
def test_a_run_whose_reward_logs_the_run_names_keeps_its_own_figures(tmp_path, warm_cache, main):
    (tmp_path / "hostile.py").write_text(HOSTILE)
    out = tmp_path / "run"
    flags = ["--dataset", write_data(tmp_path / "data.jsonl"), "--log-completions", "4"]
    flags += ["--reward", f"{tmp_path}/hostile.py:greedy_logger", "--reward", "math", "--reward-weights", "0.5", "2"]
    r = main(*tiny_run_args(warm_cache, out, *flags))
    assert r.returncode == 0, r.stderr[-2000:]
    metrics, rows = jsonl(out / "metrics.jsonl"), jsonl(out / "completions.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2]
    for m in metrics:
        mine = [x for x in rows if x["split"] == "train" and x["step"] == m["step"]]
        assert len(mine) == 4 and [x["row"] for x in mine] == [0, 1, 2, 3]
        # By hand from the logged rows: the verifier's credit (whatever the weights), the weighted mean reward.
        assert m["accuracy"] == sum(x["rewards"]["math"] == 1.0 for x in mine) / 4
        assert m["reward"] == pytest.approx(sum(x["reward"] for x in mine) / 4, abs=1e-5)
        assert m["logged/accuracy"] == m["logged/step"] == 1000.0 + m["step"] and m.get("loss", 0) < 1000
        for x in mine:  # the verifier read the gold, not what the function before it wrote over it
            gold = dict(ARITH)[x["prompt"]]
            assert x["rewards"]["math"] == (1.0 if x["completion"].strip() == gold else 0.0)
            assert x["logged/prompt"] == "not the prompt" and x["logged/step"] == -99
            assert x["reward"] == pytest.approx(2 * x["rewards"]["math"] + 0.5 * (x["rewards"]["greedy_logger"] or 0))
    summary = json.loads((out / "summary.json").read_text())
    held = [x for x in rows if x["split"] == "eval"]
    for when, part in (("start", held[:4]), ("end", held[4:])):
        assert summary[f"eval_accuracy_{when}"] == sum(x["rewards"]["math"] == 1.0 for x in part) / 4 <= 1
        assert summary[f"eval_reward_{when}"] == pytest.approx(sum(x["reward"] for x in part) / 4, abs=1e-6)
        assert summary[f"eval_logged/eval_accuracy_{when}"] >= 1000
    assert "held-out greedy accuracy before training" in r.stdout + r.stderr
    json.loads((out / "summary.json").read_text(), parse_constant=lambda c: pytest.fail(f"{c} in summary.json"))


@pytest.mark.model
def test_a_reward_that_exits_ends_the_run_in_one_line(tmp_path, warm_cache, main, monkeypatch):
    (tmp_path / "hostile.py").write_text(HOSTILE)
    (tmp_path / "at_import.py").write_text("import sys\nsys.exit(0)\n")
    monkeypatch.chdir(tmp_path)
    # At import: before anything of the run is written.
    out = tmp_path / "early"
    line = error_line(main(*tiny_run_args(warm_cache, out, "--reward", "at_import.py:f")))
    assert line == f"error: --reward {tmp_path}/at_import.py:f: importing {tmp_path}/at_import.py failed: SystemExit(0)"
    assert not out.exists()
    # At step 1, after a step was done: exit 2 (not 5), one line naming the function; step 0's row intact.
    out = tmp_path / "late"
    r = main(*tiny_run_args(warm_cache, out, "--reward", "hostile.py:exits_at_step_1", "--reward", "math"))
    line = error_line(r)
    assert line.startswith(f"error: --reward {tmp_path}/hostile.py:exits_at_step_1: exits_at_step_1 raised on 4 rows")
    assert "SystemExit(5)" in line
    assert [m["step"] for m in jsonl(out / "metrics.jsonl")] == [0] and not (out / "summary.json").exists()
