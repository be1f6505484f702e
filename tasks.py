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

Prompts use the tokenizer's chat template when it has one and ask for the final answer after
`####` (in `\\boxed{}` for math); the built-in tiny tokenizer has no template and sees the bare expression.
"""

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch

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
class Problem:
    question: str
    gold: str
    instruction: str = INSTRUCTION  # what a chat prompt asks for after the question (format_prompt)


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
WORDPROBLEM_TRAIN, WORDPROBLEM_HELDOUT = 20_000, 1000  # problems drawn for each split


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
            "pass a local JSONL with --data-files (e.g. ../shared/data/gsm8k/train.jsonl)"
        ) from None
    return [Problem(r["question"], g) for r in ds if (g := gold_from_solution(r["answer"])) is not None]


def load_task(
    task: str, data_files: str | None = None, eval_files: str | None = None, eval_size: int = 500
) -> tuple[list[Problem], list[Problem]]:
    """(train, held-out) problems for `task`; held-out is at most `eval_size` problems."""
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
    return train, heldout[:eval_size]


def format_prompt(tokenizer, question: str, instruction: str = INSTRUCTION) -> str:
    """The prompt text: the chat template with an instruction when the tokenizer has one."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": f"{question}\n{instruction}"}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return question


def encode_prompts(tokenizer, problems: list[Problem], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompt ids and mask, (B, P), on `device`."""
    texts = [format_prompt(tokenizer, p.question, p.instruction) for p in problems]
    old_side = tokenizer.padding_side
    tokenizer.padding_side = "left"  # every prompt ends at the same column
    batch = tokenizer(texts, padding=True, return_tensors="pt", add_special_tokens=False)
    tokenizer.padding_side = old_side
    return batch["input_ids"].to(device), batch["attention_mask"].to(device)


def fit_context(tokenizer, problems: list[Problem], max_prompt_tokens: int, what: str) -> tuple[list[Problem], int]:
    """Drop problems whose prompt exceeds `max_prompt_tokens`; (kept, number dropped).

    An error if none is left: a run that cannot sample anything must not start.
    """
    texts = [format_prompt(tokenizer, p.question, p.instruction) for p in problems]
    lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    kept = [p for p, n in zip(problems, lengths) if n <= max_prompt_tokens]
    if not kept:
        raise TaskError(
            f"every {what} prompt is longer than the model's context allows ({max_prompt_tokens} tokens "
            f"once --max-new-tokens is reserved)"
        )
    return kept, len(problems) - len(kept)
