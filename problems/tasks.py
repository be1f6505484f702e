"""Tasks: prompts and gold answers. A built-in synthetic arithmetic task, GSM8K, and word problems.

`arithmetic`: `a+b`, `a-b` with a, b in 0..99 and `a*b` with a, b in 0..12 (20,169 problems).
The question is the bare expression, e.g. `12+34=`; the answer is a bare number, e.g. `46`,
which `reward.math_reward` scores through its "a completion that is only a number is its own
answer" rule, so one verifier serves every task. The held-out split is fixed by a seed of its
own (`HELDOUT_SEED`), independent of the run's seed, and disjoint from the training split.

`gsm8k`: `datasets.load_dataset("openai/gsm8k", "main")` (train / test), or `--data-files`: a
local JSONL file with the same `question` / `answer` fields, checked row by row. The gold
answer is the text after `####` with thousands commas removed. With a local file, the held-out
problems are its first `eval_size` rows, or `--eval-files` when given.

`wordproblems`: one-step arithmetic in plain English with small numbers (`Mia has 7 shells. Mia finds 5
more shells. How many shells does Mia have now?`, gold `12`): addition, subtraction, multiplication and
exact division, each in four phrasings. Three phrasings of each operation make the training split and
the fourth the held-out one, so held-out questions are worded as no training question is; names,
objects and numbers are drawn with `WORDPROBLEM_SEED`, fixed for every run like `HELDOUT_SEED`. A
small real chat model (SmolLM2-135M-Instruct) gets some of these right where it gets bare `a-b=` wrong.
Their instruction is INSTRUCTION without its example (`WORD_INSTRUCTION`: that model copies the example).

`math`: MATH-style problems from a local JSONL (`--data-files`; MATH-500 and DeepScaleR files have this shape):
`problem` and `answer` fields, or, without `answer`, the last `\\boxed{}` of `solution`. The gold is a LaTeX
answer (`\\frac{\\sqrt{3}}{3}`, `(-\\infty, 2]`), scored by `math_verifier.symbolic_reward`; the
prompt asks for the final answer in `\\boxed{}` (MATH_INSTRUCTION). Held-out problems come from `--eval-files`,
else the file's first `eval_size` rows.

`--dataset NAME_OR_PATH` (`load_dataset_problems`): your own data, read with `datasets` as TRL reads it: a hub
name (`openai/gsm8k` with `--dataset-config main`, `HuggingFaceH4/MATH-500`; `--split`, `--eval-split`), a local
`.jsonl` / `.json` / `.csv` / `.parquet` file, or a folder written by `Dataset.save_to_disk`. `--prompt-field`
names the prompt column (TRL's `prompt` by default), text or TRL's conversational format (a list of `{role,
content}` messages); `--answer-field` names the gold (`answer` by default; needed only by the built-in verifier),
free-form: `#### 7` (GSM8K), `\\boxed{7}` or a plain `7`, `\\frac{1}{2}` (`gold_answer`). Every other column is
handed to the reward functions (rewards.py) as it is. Held-out rows: `--eval-split`, else `--eval-files`, else
the first `eval_size` rows. A bad file, row or field is a TaskError naming it and the flag that gave it; a name only a
path can have (`config.looks_like_path`) that is not there is a missing file, never a hub name. A local file is
cached by the sha256 of its bytes (`content_cache`), not by its time stamp as `datasets` does, and must be UTF-8.

Prompts (`render_prompt`) use the tokenizer's chat template when it has one: a user message holding the question
and an instruction asking for the final answer after `####` (in `\\boxed{}` for math; a data set of your own has
none unless `--instruction` gives one), after `--system-prompt` when given. Without a template (the built-in tiny
tokenizer has none) or with `--no-chat-template` (a base model), the prompt is raw text: the system prompt and a
blank line when given, then the question, then `--instruction` when given (the tasks' own instructions are for
chat models); the tiny policy sees the bare expression.
"""

import codecs
import dataclasses
import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from config import looks_like_path
from reward import extract_answer, parse_number

HELDOUT_SEED = 1234  # fixes the arithmetic held-out split for every run
ARITHMETIC_HELDOUT = 1000  # problems reserved for evaluation
INSTRUCTION = "Solve the problem. Put the final answer on the last line after ####, e.g. '#### 42'."
# The usual instruction of R1-style math models (DeepSeek-R1, Qwen2.5-Math), which [A]'s Experiment 2 trains.
MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
TASKS = ("arithmetic", "gsm8k", "wordproblems", "math")


class TaskError(ValueError):
    """Bad task input (file, row, flag); train.py prints it as one line and exits."""


@dataclass(frozen=True)
class Prompting:
    """How prompts are written (`render_prompt`): --system-prompt, --instruction, --no-chat-template."""

    system: str | None = None  # a system message (raw text: a first paragraph); None: none (the template's own)
    instruction: str | None = None  # replaces the task's instruction; "{question}" in it stands for the question
    chat_template: bool = True  # False: raw text even where the tokenizer has a chat template (a base model)


@dataclass(frozen=True)
class Problem:
    question: str  # the prompt's text (of a conversation: its last user message)
    gold: str  # the gold answer as the built-in verifier reads it ("" when the data set has none)
    instruction: str = INSTRUCTION  # what a chat prompt asks for after the question (render_prompt)
    # A conversational prompt as the data set holds it (TRL's format: [{"role": ..., "content": ...}, ...]).
    messages: list | None = field(default=None, compare=False)
    # The row's other fields, as the reward functions get them (rewards.py); None: {"answer": gold}.
    columns: dict | None = field(default=None, compare=False)
    prompting: Prompting = field(default=Prompting(), compare=False)

    @property
    def prompt(self):
        """The prompt as the data set holds it, what a reward function gets as `prompts[i]` (TRL's convention)."""
        return self.messages if self.messages is not None else self.question

    @property
    def reward_columns(self) -> dict:
        return self.columns if self.columns is not None else {"answer": self.gold}


def arithmetic_problems() -> tuple[list[Problem], list[Problem]]:
    """All arithmetic problems, split into (train, held-out) by a fixed shuffle."""
    probs = [
        Problem(f"{a}{op}{b}=", str(f(a, b)))
        for op, f in (("+", int.__add__), ("-", int.__sub__))
        for a in range(100)
        for b in range(100)
    ]
    probs += [Problem(f"{a}*{b}=", str(a * b)) for a in range(13) for b in range(13)]
    random.Random(HELDOUT_SEED).shuffle(probs)
    return probs[ARITHMETIC_HELDOUT:], probs[:ARITHMETIC_HELDOUT]


# The word problems' phrasings: (operation, template); {a} and {b} are the operands in the order the
# operation takes them, {n} and {m} two different names, {x} a plural object. The last phrasing of each
# operation is held out (WORDPROBLEM_HELDOUT_TEMPLATES).
WORD_TEMPLATES = {
    "+": [
        "{n} has {a} {x}. {n} gets {b} more {x}. How many {x} does {n} have now?",
        "There are {a} {x} in a box and {b} {x} on the table. How many {x} are there altogether?",
        "{n} picked {a} {x} in the morning and {b} {x} in the afternoon. How many {x} did {n} pick in all?",
        "{n} owns {a} {x} and {m} owns {b} {x}. What is the total number of {x} the two of them own?",
    ],
    "-": [
        "{n} had {a} {x} and gave {b} of them away. How many {x} does {n} have left?",
        "There were {a} {x} on a shelf. Then {b} {x} were taken. How many {x} are still on the shelf?",
        "{n} has {a} {x}. {m} has {b} fewer {x} than {n}. How many {x} does {m} have?",
        "{n} bought {a} {x} and lost {b} of them on the way home. How many {x} does {n} still have?",
    ],
    "*": [
        "There are {a} bags with {b} {x} in each bag. How many {x} are there in total?",
        "{n} buys {a} packs of {x}. Each pack holds {b} {x}. How many {x} does {n} buy?",
        "A shelf has {a} rows of {x} with {b} {x} in every row. How many {x} are on the shelf?",
        "For {a} days in a row, {n} collects {b} {x} each day. How many {x} does {n} collect over those days?",
    ],
    "/": [
        "{n} shares {a} {x} equally among {b} friends. How many {x} does each friend get?",
        "{a} {x} are packed into boxes of {b}. How many boxes are filled?",
        "{n} has {a} {x} and puts them into {b} equal piles. How many {x} are in each pile?",
        "A teacher splits {a} {x} evenly between {b} groups. How many {x} does each group receive?",
    ],
}
WORD_NAMES = ("Tom", "Anna", "Sam", "Mia", "Leo", "Emma", "Ben", "Lily", "Max", "Zoe", "Omar", "Nina")
WORD_OBJECTS = ("apples", "pencils", "stickers", "marbles", "cookies", "books", "cards", "stamps", "shells", "balloons")
# INSTRUCTION without its example: SmolLM2-135M copies "#### 42" verbatim (then no sample is credited, so GRPO has
# no signal); without the example a few percent of its samples are.
WORD_INSTRUCTION = "Solve the problem. Put the final answer on the last line after ####."
WORDPROBLEM_SEED = 4321  # fixes names, objects and numbers of every word problem, for every run
WORDPROBLEM_TRAIN, WORDPROBLEM_HELDOUT = 20_000, 1000  # problems generated for each split


def word_operands(op: str, rng: random.Random) -> tuple[int, int, int]:
    """(a, b, answer) with small numbers: sums and differences within 30, products and quotients of 2..10."""
    if op == "+":
        a, b = rng.randint(2, 20), rng.randint(2, 20)
        return a, b, a + b
    if op == "-":
        a = rng.randint(5, 30)
        b = rng.randint(1, a - 1)
        return a, b, a - b
    if op == "*":
        a, b = rng.randint(2, 10), rng.randint(2, 10)
        return a, b, a * b
    b, q = rng.randint(2, 10), rng.randint(2, 10)  # exact division: a = b * q
    return b * q, b, q


def word_problems(heldout: bool, count: int, seed: int) -> list[Problem]:
    """`count` different word problems from the training phrasings (the first three of each operation) or the
    held-out ones (the last), in a fixed order given by `seed`."""
    rng = random.Random(seed)
    templates = [(op, t) for op, ts in WORD_TEMPLATES.items() for t in (ts[-1:] if heldout else ts[:-1])]
    probs, seen = [], set()
    # Each phrasing has at least 810 different questions (81 operand pairs x 10 objects): repeats are redrawn.
    while len(probs) < count:
        op, template = rng.choice(templates)
        a, b, answer = word_operands(op, rng)
        n, m = rng.sample(WORD_NAMES, 2)
        question = template.format(a=a, b=b, n=n, m=m, x=rng.choice(WORD_OBJECTS))
        if question not in seen:
            seen.add(question)
            probs.append(Problem(question, str(answer), WORD_INSTRUCTION))
    return probs


def wordproblem_problems() -> tuple[list[Problem], list[Problem]]:
    """(train, held-out) word problems: disjoint phrasings, both fixed by WORDPROBLEM_SEED."""
    train = word_problems(heldout=False, count=WORDPROBLEM_TRAIN, seed=WORDPROBLEM_SEED)
    return train, word_problems(heldout=True, count=WORDPROBLEM_HELDOUT, seed=WORDPROBLEM_SEED + 1)


def gold_from_solution(answer: str) -> str | None:
    """GSM8K's gold: the text after the last `####`, commas removed; None if not a number."""
    if "####" not in answer:
        return None
    gold = answer.rsplit("####", 1)[1].strip().replace(",", "")
    return gold if parse_number(gold) is not None else None


def gsm8k_row(row: dict) -> Problem:
    """A GSM8K row: `question`, and `answer` ending in `#### 42`. A bad row raises TaskError (the reason only)."""
    if not isinstance(row.get("question"), str) or not isinstance(row.get("answer"), str):
        raise TaskError("row needs string fields 'question' and 'answer'")
    if not row["question"].strip():
        raise TaskError("the question is empty")
    gold = gold_from_solution(row["answer"])
    if gold is None:
        raise TaskError("answer has no parseable final number after '####'")
    return Problem(row["question"], gold)


def math_row(row: dict) -> Problem:
    """A MATH-style row: `problem`, and `answer` (the gold as written) or else `solution`'s last `\\boxed{}`."""
    if not isinstance(row.get("problem"), str) or not row["problem"].strip():
        raise TaskError("row needs a non-empty string field 'problem'")
    answer, solution = row.get("answer"), row.get("solution")
    if answer is not None and not isinstance(answer, str):
        raise TaskError("'answer' must be a string")
    if answer is None:
        if not isinstance(solution, str):
            raise TaskError("row needs a string field 'answer', or 'solution' with a final \\boxed{} answer")
        answer = extract_answer(solution)
        if answer is None:
            raise TaskError("no 'answer', and 'solution' has no final \\boxed{} answer")
    if not answer.strip():
        raise TaskError("the answer is empty")
    return Problem(row["problem"], answer.strip(), MATH_INSTRUCTION)


def read_jsonl(path: str, flag: str = "--data-files", parse_row=gsm8k_row) -> list[Problem]:
    """Problems from a local JSONL file, a row each (`parse_row`: gsm8k_row or math_row); anything wrong with it is a
    TaskError naming the flag, the file and, for a bad row, its line."""
    p = Path(path)
    if p.is_dir():
        raise TaskError(f"{flag} {path}: is a folder, not a JSONL file")
    if not p.exists():
        raise TaskError(f"{flag} {path}: no such file")
    if not p.is_file():  # a pipe, e.g. <(zcat f.gz): read once, it could not be read again by --resume
        raise TaskError(f"{flag} {path}: is a pipe or a device, not a file; save it to a file (--resume rereads it)")
    try:
        data = p.read_bytes()
    except OSError as e:
        raise TaskError(f"{flag} {path}: cannot be read ({e.strerror})") from None
    if data.lstrip()[:1] == b"[":
        raise TaskError(f"{flag} {path}: is a JSON array; this needs JSON Lines, one object per line")
    rows = []
    for i, raw in enumerate(data.splitlines(), start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise TaskError(f"{path}:{i}: not valid UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1})") from None
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise TaskError(f"{path}:{i}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise TaskError(f"{path}:{i}: a row must be a JSON object")
        try:
            rows.append(parse_row(row))
        except TaskError as e:
            raise TaskError(f"{path}:{i}: {e}") from None
    if not rows:
        raise TaskError(f"{flag} {path}: file has no rows")
    return rows


def _hub_gsm8k(split: str) -> list[Problem]:
    import datasets  # only the hub path needs it

    try:
        ds = datasets.load_dataset("openai/gsm8k", "main", split=split)
    except Exception as e:  # offline, no cache, hub down: datasets raises many types, all mean "cannot load"
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise TaskError(
            f"--task gsm8k: the hub dataset openai/gsm8k cannot be loaded ({first}); "
            "pass a local JSONL with --data-files (its 'question'/'answer' rows, e.g. gsm8k/train.jsonl)"
        ) from None
    return [Problem(r["question"], g) for r in ds if (g := gold_from_solution(r["answer"])) is not None]


def gold_answer(answer) -> str:
    """A free-form gold as the built-in verifier reads it: the text after GSM8K's last `####`, the last
    `\\boxed{}`, else the answer itself, stripped (`7`, `\\frac{1}{2}`, `(3, \\pi)`). A number (a CSV's `7`) is its
    text. The golds of the built-in tasks have neither mark, so they come back as they are."""
    text = str(answer).strip()
    if "####" in text or "\\boxed" in text:
        return extract_answer(text) or ""
    return text


DATA_SUFFIXES = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
ROLES = ("system", "user", "assistant")


def first_line(e: BaseException) -> str:
    """The first line of an error's message; datasets' "An error occurred while generating the dataset" says nothing
    of why, so the cause it wraps (pyarrow's "CSV parse error: ...") is named after it."""
    text = str(e).strip()
    line = text.splitlines()[0][:200] if text else type(e).__name__
    cause = e.__cause__ or e.__context__
    if cause is not None and "error occurred while generating" in line.lower():
        return f"{line.rstrip('.')}: {first_line(cause)}"
    return line


def refuse_other_split(where: str, name: str, split: str, split_flag: str | None, what: str) -> None:
    """A data set with one split only ('train': a file, a saved Dataset without splits) has no other: a named split
    is refused rather than read as the whole set (trained on and evaluated on the same rows)."""
    if split != "train" and split_flag is not None:
        raise TaskError(f"{split_flag} {split}: {name} has no such split ({what}: its one split is 'train', all of it)")


def refuse_mixed_formats(path: Path, where: str) -> None:
    """A folder of data files of two formats (a.jsonl and b.csv): datasets would read those of one format only,
    silently; refused, naming them."""
    kinds = {}
    for f in sorted(p for p in path.rglob("*") if p.is_file() and not hidden(p, path)):
        builder = DATA_SUFFIXES.get(f.suffix.lower())
        if builder is not None:
            kinds.setdefault(builder, []).append(f.relative_to(path).as_posix())
    if len(kinds) > 1:
        named = "; ".join(f"{b}: {', '.join(files[:3])}" for b, files in sorted(kinds.items()))
        raise TaskError(
            f"{where}: holds data files of {len(kinds)} formats ({named}); datasets reads one format only: keep one "
            "format in the folder"
        )


def read_dataset(name: str, config: str | None, split: str, flag: str, split_flag: str | None = "--split"):
    """A `datasets.Dataset`: a local file by its suffix, a `save_to_disk` folder, or a hub name (any other folder is
    given to `load_dataset` too, as TRL's users load theirs). One TaskError naming the flag the user gave: `flag` for
    the data set (--dataset, --eval-files), `split_flag` for a split that is not there (--split, --eval-split; None:
    the 'train' split --eval-files reads), --dataset-config for a configuration."""
    import datasets  # only data sets of one's own need it

    path = Path(name).expanduser()
    where = f"{flag} {name}"
    if not path.exists() and looks_like_path(name, tuple(DATA_SUFFIXES)):  # not a hub name: never sent there
        raise TaskError(f"{where}: no such file" + ("" if path.suffix.lower() in DATA_SUFFIXES else " or folder"))
    if path.exists() and not path.is_dir() and not path.is_file():
        raise TaskError(f"{where}: is a pipe or a device, not a file; save it to a file (--resume rereads it)")
    try:
        if path.is_file():
            builder = DATA_SUFFIXES.get(path.suffix.lower())
            if builder is None:
                raise TaskError(f"{where}: unknown file type {path.suffix!r}; use {', '.join(DATA_SUFFIXES)}")
            if path.stat().st_size == 0:
                raise TaskError(f"{where}: file has no rows")
            refuse_other_split(where, name, split, split_flag, "a file")
            bars = datasets.is_progress_bar_enabled()
            datasets.disable_progress_bars()  # a local file's "Generating train split" bars are noise
            try:
                cache = content_cache(path, where)
                return datasets.load_dataset(builder, data_files=str(path), split="train", cache_dir=cache)
            finally:
                if bars:
                    datasets.enable_progress_bars()
        if path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file()):
            ds = datasets.load_from_disk(str(path))  # a folder written by save_to_disk: read as it is, no cache
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    splits = ", ".join(ds)
                    if split_flag is None:
                        raise TaskError(f"{where}: its splits are {splits}, none 'train'; give one split's folder")
                    raise TaskError(f"{split_flag} {split}: {name} has no such split (it has {splits})")
                ds = ds[split]
            else:
                refuse_other_split(where, name, split, split_flag, "a saved Dataset without splits")
            return ds
        if path.is_dir():
            refuse_mixed_formats(path, where)
        cache = content_cache(path, where) if path.is_dir() else None  # a folder of data files
        return datasets.load_dataset(name, config, split=split, cache_dir=cache)
    except TaskError:
        raise
    except Exception as e:  # datasets and pyarrow raise many types; a bad JSONL line is named below if it is one
        bad = bad_json_line(path) if path.is_file() and path.suffix.lower() in (".jsonl", ".json") else None
        if bad:
            raise TaskError(f"{path}:{bad}") from None
        why = first_line(e)
        # datasets says which of the names it was given is wrong only in its message: "BuilderConfig 'x' not
        # found", "Config name is missing", "Unknown split "x"". The error names the flag that gave that name.
        if "config" in why.lower() and config is None:
            raise TaskError(f"{where}: needs --dataset-config ({why})") from None
        if "config" in why.lower():
            raise TaskError(f"--dataset-config {config}: {name} cannot be loaded with it ({why})") from None
        if "split" in why.lower() and split_flag is not None:
            raise TaskError(f"{split_flag} {split}: {name} has no such split ({why})") from None
        raise TaskError(f"{where}: cannot be loaded ({why})") from None


def content_cache(path: Path, where: str) -> str:
    """The cache folder of a local data set, named by the sha256 of its bytes (of a folder: every file's name and
    bytes, hidden ones aside, as datasets leaves them): datasets keys its cache of a local file by the file's
    modification time only, so a file rewritten with its old time stamp would be served stale. Hashing reads the
    file once, much faster than converting it again: an unchanged file's second read still comes from the cache.

    On the way, a text file (.jsonl / .json / .csv) that is not UTF-8 is a TaskError naming its byte and line:
    datasets would take the bytes into its strings unchecked, and the first row holding them would fail later
    with a traceback."""
    import datasets

    digest = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file() and not hidden(p, path))
    for f in files:
        digest.update(f"{f.relative_to(path)}\0".encode())
        text = f.suffix.lower() in (".jsonl", ".json", ".csv")
        decoder, offset, lines = codecs.getincrementaldecoder("utf-8")(), 0, 0
        with open(f, "rb") as stream:
            while True:
                block = stream.read(1 << 20)
                digest.update(block)
                if text:
                    held = len(decoder.getstate()[0])  # a character split across two blocks: its first bytes
                    try:
                        decoder.decode(block, final=not block)
                    except UnicodeDecodeError as e:
                        at = offset - held + e.start  # the first bad byte, counted from the file's start
                        line = lines + block[: max(0, at - offset)].count(b"\n") + 1
                        named = where if f == path else f"{where}: {f.relative_to(path)}"
                        raise TaskError(f"{named}: not UTF-8 at byte {at} (line {line}); save it as UTF-8") from None
                    lines += block.count(b"\n")
                if not block:
                    break
                offset += len(block)
        digest.update(b"\0")
    return str(Path(datasets.config.HF_DATASETS_CACHE) / "by-content" / digest.hexdigest()[:32])


def hidden(file: Path, folder: Path) -> bool:
    """A file datasets skips in a folder: one under a name starting with '.' or '__'."""
    return any(part.startswith((".", "__")) for part in file.relative_to(folder).parts)


def bad_json_line(path: Path) -> str | None:
    """'LINE: reason' for the first line of a JSON Lines file that is not one JSON object (None if all are)."""
    data = path.read_bytes()
    if data.lstrip()[:1] == b"[":
        return None  # a JSON array: datasets reads those whole
    for i, raw in enumerate(data.splitlines(), start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            return f"{i}: not valid UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1})"
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            return f"{i}: not valid JSON ({e.msg})"
        if not isinstance(row, dict):
            return f"{i}: a row must be a JSON object"
    return None


def dataset_problems(
    ds, where: str, prompt_field: str, answer_field: str, answer_required: bool, prompting: Prompting
) -> list[Problem]:
    """Problems from a `datasets.Dataset`'s rows; a missing or bad field is a TaskError naming `where`, the row
    (1-based) and the field."""
    fields = list(ds.column_names)
    if prompt_field not in fields:
        raise TaskError(
            f"{where}: no field {prompt_field!r} (its fields: {', '.join(fields)}); name it with --prompt-field"
        )
    if answer_required and answer_field not in fields:
        raise TaskError(
            f"{where}: no field {answer_field!r} (its fields: {', '.join(fields)}), which the built-in verifier "
            "(--reward math) reads; name it with --answer-field, or give rewards of your own"
        )
    try:
        rows = ds.to_list()
    except UnicodeDecodeError as e:  # text that is not UTF-8 in a data set not read from a local text file
        raise TaskError(f"{where}: holds text that is not UTF-8 ({e.reason} at byte {e.start} of a value)") from None
    problems = []
    for i, row in enumerate(rows, start=1):
        prompt, messages = row[prompt_field], None
        if isinstance(prompt, list):  # TRL's conversational format
            ok = prompt and all(
                isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str) for m in prompt
            )
            if not ok or not any(m["role"] == "user" for m in prompt):
                raise TaskError(
                    f"{where}: row {i}: field {prompt_field!r} must be text or a list of messages "
                    "{'role': system/user/assistant, 'content': text} with a user message"
                )
            if not prompting.chat_template:
                raise TaskError(
                    f"{where}: row {i}: field {prompt_field!r} is a conversation; --no-chat-template needs text"
                )
            messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
            prompt = next(m["content"] for m in reversed(messages) if m["role"] == "user")
        elif not isinstance(prompt, str):
            raise TaskError(f"{where}: row {i}: field {prompt_field!r} must be text, not {type(prompt).__name__}")
        if not prompt.strip():
            raise TaskError(f"{where}: row {i}: field {prompt_field!r} is empty")
        gold = ""
        if answer_field in row and row[answer_field] is not None:
            answer = row[answer_field]
            if not isinstance(answer, (str, int, float)) or isinstance(answer, bool):
                raise TaskError(f"{where}: row {i}: field {answer_field!r} must be text or a number")
            gold = gold_answer(answer)
        if answer_required and not gold:
            raise TaskError(f"{where}: row {i}: field {answer_field!r} is empty")
        columns = {k: v for k, v in row.items() if k != prompt_field}
        problems.append(Problem(prompt, gold, "", messages=messages, columns=columns, prompting=prompting))
    if not problems:
        raise TaskError(f"{where}: has no rows")
    return problems


def load_dataset_problems(
    name: str,
    *,
    config: str | None = None,
    split: str = "train",
    eval_split: str | None = None,
    eval_files: str | None = None,
    eval_size: int = 500,
    prompt_field: str = "prompt",
    answer_field: str = "answer",
    answer_required: bool = True,
    prompting: Prompting = Prompting(),
) -> tuple[list[Problem], list[Problem]]:
    """(train, held-out) problems of `--dataset` (module docstring); held-out: the rows of `eval_split`, else of
    `eval_files`, else the first `eval_size` rows (then the training set is the rest); at most `eval_size`."""
    fields = dict(prompt_field=prompt_field, answer_field=answer_field, answer_required=answer_required)
    local = Path(name).expanduser().is_file()
    where = str(Path(name).expanduser()) if local else f"{name} ({split})"
    train = dataset_problems(read_dataset(name, config, split, "--dataset"), where, **fields, prompting=prompting)
    if eval_split is not None:
        ds = read_dataset(name, config, eval_split, "--dataset", "--eval-split")
        heldout = dataset_problems(ds, f"{name} ({eval_split})", **fields, prompting=prompting)
    elif eval_files is not None:
        ds = read_dataset(eval_files, None, "train", "--eval-files", None)
        heldout = dataset_problems(ds, str(Path(eval_files).expanduser()), **fields, prompting=prompting)
    else:
        if len(train) <= eval_size:
            raise TaskError(
                f"--dataset {name}: {len(train)} rows; the held-out rows are its first --eval-size={eval_size}, "
                "so it needs more (or give --eval-size, --eval-split or --eval-files)"
            )
        train, heldout = train[eval_size:], train[:eval_size]
    return train, heldout[:eval_size]


def load_task(
    task: str,
    data_files: str | None = None,
    eval_files: str | None = None,
    eval_size: int = 500,
    prompting: Prompting = Prompting(),
) -> tuple[list[Problem], list[Problem]]:
    """(train, held-out) problems for `task`; held-out is at most `eval_size` problems, each written as
    `prompting` says."""
    if task == "arithmetic":
        train, heldout = arithmetic_problems()
    elif task == "wordproblems":
        train, heldout = wordproblem_problems()
    elif task in ("gsm8k", "math"):
        parse_row = math_row if task == "math" else gsm8k_row
        if task == "math" and not data_files:
            raise TaskError("--task math reads a local JSONL of 'problem'/'answer' rows: give it with --data-files")
        if data_files:
            train = read_jsonl(data_files, parse_row=parse_row)
            if eval_files:
                heldout = read_jsonl(eval_files, "--eval-files", parse_row)
            else:
                if len(train) <= eval_size:
                    raise TaskError(
                        f"--data-files: {data_files} has {len(train)} rows; need more than --eval-size={eval_size}"
                    )
                train, heldout = train[eval_size:], train[:eval_size]
        else:
            train, heldout = _hub_gsm8k("train"), _hub_gsm8k("test")
    else:
        raise TaskError(f"--task: unknown task {task!r}; choose from {', '.join(TASKS)}")
    if prompting != Prompting():
        train, heldout = ([dataclasses.replace(p, prompting=prompting) for p in ps] for ps in (train, heldout))
    return train, heldout[:eval_size]


def format_prompt(tokenizer, question: str, instruction: str = INSTRUCTION) -> str:
    """The prompt text: the chat template with an instruction when the tokenizer has one, else the question."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": f"{question}\n{instruction}"}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return question


def user_text(question: str, instruction: str) -> str:
    """The user's message: the question, then the instruction on a line of its own; an instruction holding
    `{question}` is the whole message, the question in its place."""
    if "{question}" in instruction:
        return instruction.replace("{question}", question)
    return f"{question}\n{instruction}" if instruction else question


def uses_chat_template(tokenizer, p: Problem) -> bool:
    return p.prompting.chat_template and bool(getattr(tokenizer, "chat_template", None))


def render_prompt(tokenizer, p: Problem) -> str:
    """The text the policy is prompted with (module docstring, "Prompts"): with the default Prompting exactly
    `format_prompt(tokenizer, p.question, p.instruction)`."""
    how = p.prompting
    chat = uses_chat_template(tokenizer, p)
    instruction = how.instruction if how.instruction is not None else (p.instruction if chat else "")
    if not chat:
        if p.messages is not None:
            why = "--no-chat-template is set" if not how.chat_template else "the tokenizer has no chat template"
            raise TaskError(f"a conversational prompt (a list of messages) needs a chat template, and {why}")
        return (f"{how.system}\n\n" if how.system else "") + user_text(p.question, instruction)
    messages = [dict(m) for m in p.messages] if p.messages is not None else [{"role": "user", "content": p.question}]
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    messages[last_user]["content"] = user_text(messages[last_user]["content"], instruction)
    if how.system is not None:  # it replaces the conversation's own system message, if it has one
        messages = [{"role": "system", "content": how.system}] + [m for m in messages if m["role"] != "system"]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def prompt_record(tokenizer, p: Problem) -> dict:
    """What config.json records of the prompts (`prompt_format`, `prompt_template`, `prompt_example`): how the
    first training prompt was written, and the template with `{question}` where each question goes.

    `prompt_example` is the text the model was given: the token ids encode_prompts makes of it, decoded (special
    tokens kept). A tokenizer may not give back what it was given (the built-in one turns every character it does
    not know into <unk>); `prompt_example_lossy` says whether the two differ."""
    chat = uses_chat_template(tokenizer, p)
    fmt = (
        "chat template"
        if chat
        else (
            "raw text (--no-chat-template)"
            if getattr(tokenizer, "chat_template", None)
            else "raw text (the tokenizer has no chat template)"
        )
    )
    template = None
    if p.messages is None:
        template = render_prompt(tokenizer, dataclasses.replace(p, question="{question}"))
    ids, mask = encode_prompts(tokenizer, [p], "cpu")
    seen = tokenizer.decode(ids[0][mask[0].bool()], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    return {
        "prompt_format": fmt,
        "prompt_template": template,
        "prompt_example": seen,
        "prompt_example_lossy": seen != render_prompt(tokenizer, p),
    }


def encode_prompts(tokenizer, problems: list[Problem], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompt ids and mask, (B, P), on `device`."""
    texts = [render_prompt(tokenizer, p) for p in problems]
    old_side = tokenizer.padding_side
    tokenizer.padding_side = "left"  # every prompt ends at the same column
    batch = tokenizer(texts, padding=True, return_tensors="pt", add_special_tokens=False)
    tokenizer.padding_side = old_side
    return batch["input_ids"].to(device), batch["attention_mask"].to(device)


def fit_context(tokenizer, problems: list[Problem], max_prompt_tokens: int, what: str) -> tuple[list[Problem], int]:
    """Drop problems whose prompt exceeds `max_prompt_tokens`; (kept, number dropped).

    An error if none is left: a run that cannot sample anything must not start.
    """
    texts = [render_prompt(tokenizer, p) for p in problems]
    lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    kept = [p for p, n in zip(problems, lengths) if n <= max_prompt_tokens]
    if not kept:
        raise TaskError(
            f"every {what} prompt is longer than the model's context allows ({max_prompt_tokens} tokens "
            f"once --max-new-tokens is reserved)"
        )
    return kept, len(problems) - len(kept)
