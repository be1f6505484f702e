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
  log_metric       log_metric(name, value): a finite number averaged into the step's metrics.jsonl row as
                   `logged/NAME` (held out: `eval_logged/NAME`), a prefix of its own so that no name a function
                   picks (`accuracy`, `step`) can replace one of the run's figures;
  log_extra        log_extra(column, values): a value per completion, added to its completions.jsonl row as
                   `logged/COLUMN` (never one of the row's own keys: prompt, completion, reward, step, ...);
                   values of another length, or a column logged twice in one call, are refused.
Each function gets its own copy of every input: one that changes the lists it is given changes nothing another
function, or the run, sees. It returns what TRL takes: any iterable of numbers or None, one per completion (a list,
a tuple, a generator, a 1-d tensor or numpy array, a list of 0-d tensors or numpy scalars, a pandas Series); a
string, a mapping or a set is not a list of rewards. Return None for "no opinion": it counts 0 in the sum and is
reported (`reward_none_frac`). Accept **kwargs, as TRL asks, so that arguments added later do not break the
function. An async function is awaited.

Anything else is an error naming its SPEC, one line (train.py exits 2): a file or module not found, no such
function, not callable; anything it raises, at import or when called, SystemExit and KeyboardInterrupt included (its
name, the number of rows, the exception's first line; a real Ctrl-C is bookkeeping.failures.Stopped and passes
through); a result of the wrong length; a value that is not a number, NaN, an infinity or beyond float32's range
(the dtype rewards are used in), an int too large for a float; a weighted total beyond float32's range (naming
--reward-weights); a log_metric value that is not a finite number, a log_extra value that JSON cannot hold.

Deviations from TRL: TRL 1.16 leaves a completion that every function scored None out of its group's baseline;
here, as in integrations/trl_grpo.py, it counts 0. TRL takes NaN as None and a set's values in its own order; here
both are refused (a NaN is most often a 0/0).
"""

import asyncio
import contextlib
import copy
import hashlib
import importlib
import importlib.util
import inspect
import itertools
import json
import math
import numbers
import os
import sys
from collections.abc import Mapping, Set
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bookkeeping.failures import Stopped
from problems.math_verifier import symbolic_reward
from problems.tasks import gold_answer
from reward import math_reward

BUILTIN = ("math", "math-symbolic")
# The built-in verifiers' names in the metrics (rewards/NAME): reserved for them, so that `accuracy` can find its
# verifier by name (Scores.accuracy); a function of one's own so named is NAME_2.
VERIFIER_NAMES = ("math", "math_symbolic")
LOGGED = "logged/"  # the prefix of what a function logs (log_metric, log_extra): apart from the run's own names
FLOAT32_MAX = torch.finfo(torch.float32).max  # rewards and their weighted total are float32 in the step
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

    def credited(self, names: list[str]) -> torch.Tensor:
        """(N,) bool, the completions counted correct: with a built-in verifier among the functions (the first in
        `names`, which are reserved for it), those it credits, whatever the weights; without one, those whose
        weighted reward is > 0."""
        verifier = next((i for i, name in enumerate(names) if name in VERIFIER_NAMES), None)
        return self.total > 0 if verifier is None else self.parts[verifier] > 0  # NaN (None) > 0 is False

    def accuracy(self, names: list[str]) -> float:
        """The share of completions credited (`credited`): `accuracy` in metrics.jsonl, in [0, 1] for any rewards."""
        return self.credited(names).float().mean().item()


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
            with siblings_first(path.parent):
                loader_spec.loader.exec_module(module)
        except Stopped:  # a real Ctrl-C or SIGTERM: the run stops as it always does
            del sys.modules[name]
            raise
        except BaseException as e:  # the user's code: SystemExit and KeyboardInterrupt end the run here in one line
            del sys.modules[name]
            raise RewardError(f"--reward {spec}: importing {path} failed: {described(e)}") from None
        _modules[key] = module
    return _modules[key]


@contextlib.contextmanager
def siblings_first(folder: Path):
    """While a reward file runs its imports, `import config` (or any name) finds the file's own sibling, not the
    project's module of that name that sys.modules already holds. Afterwards the project's modules are back under
    their names (the user's module keeps its sibling as a global), and the folder stays searchable, last."""
    folder = folder.resolve()

    def shadowed(module) -> bool:  # a module this folder also holds under the same name, other than the file itself
        file = getattr(module, "__file__", None)
        return file is not None and Path(file).resolve().parent not in (folder, folder / module.__name__)

    top = {n for n in list(sys.modules) if "." not in n}
    clashing = {n for n in top if (folder / f"{n}.py").is_file() or (folder / n / "__init__.py").is_file()}
    saved = {
        n: m
        for n, m in list(sys.modules.items())
        if n.split(".")[0] in clashing and shadowed(sys.modules[n.split(".")[0]])
    }
    for n in saved:
        del sys.modules[n]
    sys.path.insert(0, str(folder))
    try:
        yield
    finally:
        sys.path.remove(str(folder))
        if str(folder) not in sys.path:
            sys.path.append(str(folder))
        sys.modules.update(saved)


def import_module(spec: str, name: str):
    # The working directory first, as `python -m` puts it: a user's reward.py or config.py must not lose to the
    # project's module of that name, already imported (sys.modules would answer before any path is searched).
    local = Path.cwd() / (name.replace(".", os.sep) + ".py")
    if local.is_file():
        return import_file(spec, local)
    if os.getcwd() not in sys.path:  # a package beside the user's files is importable
        sys.path.append(os.getcwd())
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is not None and (name == e.name or name.startswith(e.name + ".")):
            raise RewardError(
                f"--reward {spec}: no module named {e.name!r} (a file is given as path/to/file.py:function)"
            ) from None
        raise RewardError(f"--reward {spec}: importing {name} failed: {described(e)}") from None
    except Stopped:
        raise
    except BaseException as e:  # as import_file: whatever the module's code raises, SystemExit included
        raise RewardError(f"--reward {spec}: importing {name} failed: {described(e)}") from None


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
        for w in self.weights:  # finite in float64 (config.py) is not enough: the weights are float32 in the step
            if not math.isfinite(w) or not math.isfinite(float(torch.tensor(w, dtype=torch.float32))):
                raise RewardError(
                    f"--reward-weights: {w} is beyond float32's range (±{FLOAT32_MAX:.3g}), the dtype "
                    "rewards are weighed in"
                )
        # Unique names (metrics rewards/NAME): a second `fn` is fn_2. The built-in verifiers are named first, and
        # their names are reserved (VERIFIER_NAMES), so that Scores.accuracy finds the verifier by its name.
        used = set()

        def unique(name: str) -> str:
            candidate, k = name, 1
            while candidate in used:
                k += 1
                candidate = f"{name}_{k}"
            used.add(candidate)
            return candidate

        builtin = [isinstance(r.fn, MathVerifier) for r in rewards]
        for r in [r for r, b in zip(rewards, builtin) if b]:
            r.name = unique(r.name)
        used.update(VERIFIER_NAMES)
        for r in [r for r, b in zip(rewards, builtin) if not b]:
            r.name = unique(r.name)
        self.names = [r.name for r in rewards]

    @property
    def needs_answer(self) -> bool:
        """Whether a built-in verifier reads the answer column (a function of one's own may ignore it)."""
        return any(isinstance(r.fn, MathVerifier) for r in self.rewards)

    def score(self, prompts: list, completions: list, completion_ids: list, columns: dict, state) -> Scores:
        """Every function on the N rows (module docstring); `columns`: name -> a list of N values."""
        n = len(completions)
        metrics, extras = {}, {}
        inputs = {k: v for k, v in columns.items() if k not in RESERVED}
        inputs.update(prompts=prompts, completions=completions, completion_ids=completion_ids, trainer_state=state)
        parts = torch.empty(len(self.rewards), n, dtype=torch.float32)
        for i, r in enumerate(self.rewards):
            logged, extra = [], []

            def log_metric(name: str, value: float, logged=logged) -> None:
                logged.append((name, value))  # checked once the function returns: it cannot catch our error

            def log_extra(column: str, values, extra=extra) -> None:
                extra.append((column, list(values)))

            # Its own copy of everything: a function that changes its lists changes nothing the next one, or the
            # run, sees.
            out = called(r, copy.deepcopy(inputs), log_metric, log_extra, n)
            parts[i] = in_float32(r, checked(r, out, n))
            for name, value in logged:
                metrics.setdefault(str(name), []).append(metric_value(r, name, value))
            for column, values in extra:
                if len(values) != n or str(column) in extras:  # a value per completion, once: else whose row is it?
                    why = "logged twice" if str(column) in extras else f"{len(values)} values for {n} completions"
                    raise RewardError(f"--reward {r.spec}: {r.name}'s log_extra column {column!r}: {why}")
                try:  # completions.jsonl is JSON (default=str), with no NaN or Infinity tokens
                    json.dumps(values, allow_nan=False, default=str)
                except (ValueError, TypeError, RecursionError) as e:
                    raise RewardError(
                        f"--reward {r.spec}: {r.name}'s log_extra column {column!r} cannot be written as JSON: "
                        f"{first_line(e)}"
                    ) from None
                extras.setdefault(str(column), []).extend(values)
        w = torch.tensor(self.weights, dtype=torch.float32)[:, None]  # (F, 1)
        total = (parts * w).nansum(0)  # (N,) as TRL: None counts 0
        self.check_total(parts, total)
        return Scores(parts, total, {k: mean(v) for k, v in metrics.items()}, extras)

    def check_total(self, parts: torch.Tensor, total: torch.Tensor) -> None:
        """Each completion's weighted total is finite in float32 (a product or a sum may overflow it)."""
        bad = (~torch.isfinite(total)).nonzero()
        if len(bad):
            j = bad[0].item()
            terms = " + ".join(
                f"{w:g} x {x:g} ({name})"
                for w, x, name in zip(self.weights, parts[:, j].tolist(), self.names)
                if not math.isnan(x)
            )
            raise RewardError(
                f"--reward-weights {' '.join(f'{w:g}' for w in self.weights)}: the weighted reward of completion {j}, "
                f"{terms}, is beyond float32's range (±{FLOAT32_MAX:.3g}), the dtype rewards are used in"
            )


async def awaited(result):
    return await result


def called(r: Reward, inputs: dict, log_metric, log_extra, n: int):
    """r's result on the batch, awaited and read (a generator runs here): whatever the user's code raises, any
    BaseException but a real Ctrl-C or SIGTERM (Stopped), is a RewardError naming the SPEC."""
    try:
        out = r.fn(**inputs, log_metric=log_metric, log_extra=log_extra)
        if inspect.isawaitable(out):  # an async function, as TRL allows
            out = asyncio.run(awaited(out))
        return materialised(out, n)
    except Stopped:
        raise
    except BaseException as e:
        raise RewardError(f"--reward {r.spec}: {r.name} raised on {n} rows: {described(e)}") from None


def materialised(out, n: int):
    """What TRL reads from `out` (it iterates it): a list, at most n + 1 long (a generator need not end); a 1-d
    tensor, numpy array or pandas Series via tolist(). What is not a list of rewards is returned as it is, for
    `checked` to refuse."""
    if isinstance(out, (str, bytes, bytearray, Mapping, Set)):  # iterable, but not one reward per completion
        return out
    if getattr(out, "ndim", None) == 1 and hasattr(out, "tolist"):
        return FromArray(out.tolist())
    if getattr(out, "ndim", None) == 0:  # a 0-d tensor or array is one number: not iterable
        return out
    if hasattr(out, "__len__") and hasattr(out, "__iter__"):
        return list(out)
    try:
        it = iter(out)
    except TypeError:
        return out
    return Unsized(itertools.islice(it, n + 1))


class Unsized(list):
    """An iterator's first n + 1 values: more than n is "more than n" rewards."""


class FromArray(list):
    """The values of a 1-d tensor, array or Series: one that holds floats holds a None as NaN."""


def checked(r: Reward, out, n: int) -> list[float]:
    """`out` as N floats (NaN for None); a RewardError naming the SPEC for anything that is not that."""
    where = f"--reward {r.spec}: {r.name}"
    if not isinstance(out, list):
        raise RewardError(f"{where} returned a {type(out).__name__}; it must return a list, one reward per completion")
    if len(out) != n:
        many = f"more than {n}" if isinstance(out, Unsized) and len(out) > n else len(out)
        raise RewardError(f"{where} returned {many} rewards for {n} completions; it must return one each")
    values = []
    for j, x in enumerate(out):
        if x is None:
            values.append(math.nan)
            continue
        value = real(x)
        if value is None:
            raise RewardError(f"{where} returned {short(x)} ({type(x).__name__}) for completion {j}: not a number")
        try:
            value = float(value)
        except OverflowError:
            raise RewardError(
                f"{where} returned {too_large(value)} for completion {j}: beyond float32's range "
                f"(±{FLOAT32_MAX:.3g}), the dtype rewards are used in"
            ) from None
        if math.isnan(value):
            hint = (
                "; a float array holds None as NaN: use dtype=object, or a list" if isinstance(out, FromArray) else ""
            )
            raise RewardError(f"{where} returned NaN for completion {j} (return None for no opinion{hint})")
        if math.isinf(value):
            raise RewardError(f"{where} returned {value} for completion {j}: not finite")
        values.append(value)
    return values


def in_float32(r: Reward, values: list[float]) -> torch.Tensor:
    """The values as float32, the dtype rewards are used in: one beyond its range (1e39) is an error."""
    t = torch.tensor(values, dtype=torch.float32)
    bad = torch.isinf(t).nonzero()
    if len(bad):
        j = bad[0].item()
        raise RewardError(
            f"--reward {r.spec}: {r.name} returned {values[j]:g} for completion {j}: beyond float32's range "
            f"(±{FLOAT32_MAX:.3g}), the dtype rewards are used in"
        )
    return t


def real(x):
    """x if it is a real number (bool included, as TRL's torch.tensor reads it): Python's, numpy's (a scalar or a
    0-d array) or a 0-d tensor's value; None otherwise."""
    if getattr(x, "ndim", None) == 0 and hasattr(x, "item"):
        x = x.item()
    return x if isinstance(x, numbers.Real) else None


def metric_value(r: Reward, name, value) -> float:
    """A log_metric value as a finite float (metrics.jsonl is JSON, with no NaN or Infinity)."""
    x = real(value)
    try:
        x = None if x is None else float(x)
    except OverflowError:
        x = math.inf
    if x is None or not math.isfinite(x):
        what = "not a number" if x is None else "not finite"
        raise RewardError(f"--reward {r.spec}: {r.name} logged {short(value)} as {name!r} (log_metric): {what}")
    return x


def mean(values: list[float]) -> float:
    """The mean of finite floats, never beyond them (a plain sum of two 1e308 would be inf)."""
    return sum(v / len(values) for v in values)


def short(x) -> str:
    """repr(x), cut to one short line (an int of 5,000 digits has no repr at all)."""
    if isinstance(x, int) and not isinstance(x, bool) and abs(x) > 10**30:
        return too_large(x)
    text = repr(x).splitlines() or [""]
    return text[0][:80] + ("..." if len(text) > 1 or len(text[0]) > 80 else "")


def too_large(x) -> str:
    if isinstance(x, int):
        return f"an int of {int(math.log10(abs(x))) + 1} digits"
    return f"a {type(x).__name__} too large for a float"


def described(e: BaseException) -> str:
    """The exception in a few words: SystemExit(5), KeyboardInterrupt, or its type and first line."""
    if isinstance(e, SystemExit):
        return f"SystemExit({short(e.code)})"
    return f"{type(e).__name__}: {first_line(e)}" if str(e).strip() else type(e).__name__


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__


def load_rewards(
    specs: list[str], weights: list[float] | None = None, *, answer_field: str = "answer", symbolic=False, score=None
) -> Rewards:
    """The run's Rewards from --reward and --reward-weights (module docstring)."""
    kw = dict(answer_field=answer_field, symbolic=symbolic, score=score)
    return Rewards([load_reward(s, **kw) for s in specs], weights)
