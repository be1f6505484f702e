"""Reward functions as users bring them, called the way TRL's GRPOTrainer calls them.

`--reward SPEC` (repeatable) names each function:
    math                     the built-in verifier (reward.math_reward against the `--answer-field` column), the
                             default: numbers compared exactly, math-verify's symbolic mode under --task math
    math-symbolic            the same, symbolic for any task (LaTeX answers; the [math] extra)
    path/to/file.py:NAME     the function NAME of a Python file (imported once; relative paths from the working
                             directory, recorded absolute in config.json)
    module:NAME              the function NAME of an importable module (the working directory is on the path)
`--reward-weights W1 W2 ...` weighs them (default 1 each): the reward of a completion is sum_i w_i r_i, as TRL's
`reward_weights`, with a None counted as 0.

The call is TRL's (`GRPOTrainer._calculate_rewards`, TRL 1.16), so that one function serves both unchanged:

    fn(prompts=[...], completions=[...], completion_ids=[...], trainer_state=..., log_metric=..., log_extra=...,
       **columns) -> list[float | None]

one entry per completion, rows group-major (the G completions of a prompt are consecutive):
  prompts          each row's prompt as the data set holds it: text, or a list of {role, content} messages;
  completions      the decoded completions (special tokens skipped), text; for a conversational prompt TRL's
                   [{"role": "assistant", "content": text}];
  completion_ids   each completion's token ids, up to and including its EOS;
  columns          the row's other fields, each a list: the data set's columns (for the built-in tasks `answer`,
                   the gold); a column named like an argument above is left out, as TRL leaves out its own;
  trainer_state    `global_step` (the steps done when the rewards are computed), `max_steps`, `epoch`;
  log_metric       log_metric(name, value): a scalar averaged into the step's metrics.jsonl row (held out: eval_NAME);
  log_extra        log_extra(column, values): a value per completion, added to its completions.jsonl row.
Return None for "no opinion": it counts 0 in the sum and is reported (`reward_none_frac`). Accept **kwargs, as TRL
asks, so that arguments added later do not break the function. An async function is awaited. Anything else a
function does is an error naming its SPEC, one line (train.py exits 2): a file or module not found, no such
function, not callable, an exception inside it (its name, the number of rows, the exception's first line), a
result of the wrong length, a value that is not a number, NaN or an infinity.

Deviation from TRL: TRL 1.16 leaves a completion that every function scored None out of its group's baseline;
here, as in integrations/trl_grpo.py, it counts 0.
"""

import asyncio
import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from problems.math_verifier import symbolic_reward
from problems.tasks import gold_answer
from reward import math_reward

BUILTIN = ("math", "math-symbolic")
# Keyword arguments of the call; a data set's column of the same name is not passed (TRL drops its own likewise).
RESERVED = ("prompts", "completions", "completion_ids", "trainer_state", "log_metric", "log_extra")


class RewardError(ValueError):
    """A reward function that cannot be loaded or called, or returned what cannot be a reward: one line."""


class MathVerifier:
    """The built-in verifier as a TRL reward function: `score(completion, gold)` (reward.math_reward) of each
    completion against its row's `answer_field` column, read free-form (tasks.gold_answer: `#### 7`, `7`)."""

    def __init__(self, answer_field: str = "answer", symbolic: bool = False, score=None, name: str = "math"):
        self.answer_field, self.__name__ = answer_field, name
        self.score = score or (symbolic_reward if symbolic else math_reward)

    def __call__(self, prompts, completions, **columns) -> list[float]:
        if self.answer_field not in columns:
            raise KeyError(f"no {self.answer_field!r} column (--answer-field) to read the gold answer from")
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        return [self.score(t, gold_answer(g)) for t, g in zip(texts, columns[self.answer_field])]


math_verifier = MathVerifier()  # `rewards:math_verifier`, or TRL's reward_funcs=[rewards.math_verifier]


@dataclass
class Reward:
    spec: str  # as given to --reward (a file's path absolute)
    name: str  # the function's name, unique in the run (metrics `rewards/NAME`)
    fn: object


@dataclass
class RewardState:
    """TRL's `trainer_state`, the fields reward functions read (transformers' TrainerState has the same names)."""

    global_step: int
    max_steps: int
    epoch: float = 0.0


@dataclass
class Scores:
    """One call of every reward function on a batch of N completions."""

    parts: torch.Tensor  # (F, N) float32, each function's rewards; NaN where it returned None
    total: torch.Tensor  # (N,) float32, the weighted sum, None counted 0
    metrics: dict = field(default_factory=dict)  # log_metric's values, averaged per name
    extras: dict = field(default_factory=dict)  # log_extra's columns, a value per completion

    def none_frac(self) -> float:
        return torch.isnan(self.parts).float().mean().item()

    def means(self, names: list[str]) -> dict:
        """Each function's mean reward over the completions it had an opinion on (None where it had none)."""
        out = {}
        for name, row in zip(names, self.parts):
            seen = row[~torch.isnan(row)]
            out[name] = seen.mean().item() if seen.numel() else None
        return out


def is_file_spec(where: str) -> bool:
    return where.endswith(".py") or "/" in where or os.sep in where


_modules = {}  # a file's path -> its module, imported once per process


def import_file(spec: str, path: Path):
    key = str(path.resolve())
    if key not in _modules:
        name = f"_reward_{path.stem}_{hashlib.sha1(key.encode()).hexdigest()[:8]}"
        loader_spec = importlib.util.spec_from_file_location(name, path)
        if loader_spec is None:
            raise RewardError(f"--reward {spec}: {path} cannot be imported as Python")
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[name] = module
        try:
            loader_spec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[name]
            raise RewardError(
                f"--reward {spec}: importing {path} failed: {type(e).__name__}: {first_line(e)}"
            ) from None
        _modules[key] = module
    return _modules[key]


def import_module(spec: str, name: str):
    if os.getcwd() not in sys.path:  # as `python -m` does: a module beside the user's files is importable
        sys.path.append(os.getcwd())
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is not None and (name == e.name or name.startswith(e.name + ".")):
            raise RewardError(
                f"--reward {spec}: no module named {e.name!r} (a file is given as path/to/file.py:function)"
            ) from None
        raise RewardError(f"--reward {spec}: importing {name} failed: {type(e).__name__}: {first_line(e)}") from None
    except Exception as e:
        raise RewardError(f"--reward {spec}: importing {name} failed: {type(e).__name__}: {first_line(e)}") from None


def load_reward(spec: str, *, answer_field: str = "answer", symbolic: bool = False, score=None) -> Reward:
    """The function a SPEC names (module docstring); `math` is MathVerifier (with `score`, symbolic when
    `symbolic`), `math-symbolic` MathVerifier(symbolic=True). A RewardError naming the SPEC otherwise."""
    if spec == "math":
        return Reward(spec, "math", MathVerifier(answer_field, symbolic, score))
    if spec == "math-symbolic":
        return Reward(spec, "math_symbolic", MathVerifier(answer_field, True, name="math_symbolic"))
    if ":" not in spec:
        raise RewardError(
            f"--reward {spec}: not a built-in reward ({', '.join(BUILTIN)}), nor path/to/file.py:function or "
            "module:function"
        )
    where, attr = spec.rsplit(":", 1)
    if not where or not attr:
        raise RewardError(f"--reward {spec}: give path/to/file.py:function or module:function")
    if is_file_spec(where):
        path = Path(where).expanduser()
        if not path.is_file():
            raise RewardError(f"--reward {spec}: no such file {path}" + (" (a folder)" if path.is_dir() else ""))
        module = import_file(spec, path)
    else:
        module = import_module(spec, where)
    fn = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            defined = sorted(
                n for n, v in vars(module).items() if callable(v) and not n.startswith("_") and not inspect.ismodule(v)
            )
            listed = f" (it defines: {', '.join(defined[:8])})" if defined else ""
            raise RewardError(f"--reward {spec}: {where} has no function {attr!r}{listed}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise RewardError(f"--reward {spec}: {attr} is a {type(fn).__name__}, not a function")
    return Reward(spec, getattr(fn, "__name__", attr.rsplit(".", 1)[-1]), fn)


class Rewards:
    """The run's reward functions and weights: `score` calls each on a batch and checks what it returns."""

    def __init__(self, rewards: list[Reward], weights: list[float] | None = None):
        if weights is not None and len(weights) != len(rewards):
            raise RewardError(f"--reward-weights: {len(weights)} weights for {len(rewards)} rewards; give one each")
        self.rewards, self.weights = rewards, list(weights) if weights is not None else [1.0] * len(rewards)
        seen = {}
        for r in rewards:  # unique names: a second `fn` is fn_2
            seen[r.name] = seen.get(r.name, 0) + 1
            if seen[r.name] > 1:
                r.name = f"{r.name}_{seen[r.name]}"
        self.names = [r.name for r in rewards]

    @property
    def needs_answer(self) -> bool:
        """Whether a built-in verifier reads the answer column (a function of one's own may ignore it)."""
        return any(isinstance(r.fn, MathVerifier) for r in self.rewards)

    def score(self, prompts: list, completions: list, completion_ids: list, columns: dict, state) -> Scores:
        """Every function on the N rows (module docstring); `columns`: name -> a list of N values."""
        n = len(completions)
        metrics, extras = {}, {}

        def log_metric(name: str, value: float) -> None:
            metrics.setdefault(name, []).append(float(value))

        def log_extra(column: str, values: list) -> None:
            extras.setdefault(column, []).extend(values)

        kwargs = {k: v for k, v in columns.items() if k not in RESERVED}
        kwargs.update(completion_ids=completion_ids, trainer_state=state, log_metric=log_metric, log_extra=log_extra)
        parts = torch.empty(len(self.rewards), n, dtype=torch.float32)
        for i, r in enumerate(self.rewards):
            try:
                out = r.fn(prompts=prompts, completions=completions, **kwargs)
                if inspect.isawaitable(out):  # an async function, as TRL allows
                    out = asyncio.run(awaited(out))
            except Exception as e:
                raise RewardError(
                    f"--reward {r.spec}: {r.name} raised on {n} rows: {type(e).__name__}: {first_line(e)}"
                ) from None
            parts[i] = torch.tensor(checked(r, out, n), dtype=torch.float32)
        w = torch.tensor(self.weights, dtype=torch.float32)[:, None]  # (F, 1)
        total = (parts * w).nansum(0)  # (N,) as TRL: None counts 0
        return Scores(parts, total, {k: sum(v) / len(v) for k, v in metrics.items()}, extras)


async def awaited(result):
    return await result


def checked(r: Reward, out, n: int) -> list[float]:
    """`out` as N floats (NaN for None); a RewardError naming the SPEC for anything that is not that."""
    where = f"--reward {r.spec}: {r.name}"
    if isinstance(out, torch.Tensor) or type(out).__module__ == "numpy":
        out = out.tolist() if getattr(out, "ndim", 1) == 1 else out
    if not isinstance(out, (list, tuple)):
        raise RewardError(f"{where} returned a {type(out).__name__}; it must return a list, one reward per completion")
    if len(out) != n:
        raise RewardError(f"{where} returned {len(out)} rewards for {n} completions; it must return one each")
    values = []
    for j, x in enumerate(out):
        if x is None:
            values.append(math.nan)
            continue
        if not isinstance(x, numbers.Real) and not (type(x).__module__ == "numpy" and hasattr(x, "__float__")):
            raise RewardError(f"{where} returned {x!r} ({type(x).__name__}) for completion {j}: not a number")
        x = float(x)
        if math.isnan(x):
            raise RewardError(f"{where} returned NaN for completion {j} (return None for no opinion)")
        if math.isinf(x):
            raise RewardError(f"{where} returned {x} for completion {j}: not finite")
        values.append(x)
    return values


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__


def load_rewards(
    specs: list[str], weights: list[float] | None = None, *, answer_field: str = "answer", symbolic=False, score=None
) -> Rewards:
    """The run's Rewards from --reward and --reward-weights (module docstring)."""
    kw = dict(answer_field=answer_field, symbolic=symbolic, score=score)
    return Rewards([load_reward(s, **kw) for s in specs], weights)
