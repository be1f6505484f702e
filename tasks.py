"""Tasks: prompts and gold answers. A built-in synthetic arithmetic task, and GSM8K.

`arithmetic`: `a+b`, `a-b` with a, b in 0..99 and `a*b` with a, b in 0..12 (20,169 problems).
The question is the bare expression, e.g. `12+34=`; the answer is a bare number, e.g. `46`,
which `reward.math_reward` scores through its "a completion that is only a number is its own
answer" rule, so one verifier serves every task. The held-out split is fixed by a seed of its
own (`HELDOUT_SEED`), independent of the run's seed, and disjoint from the training split.

`gsm8k`: `datasets.load_dataset("openai/gsm8k", "main")` (train / test), or `--data-files`: a
local JSONL file with the same `question` / `answer` fields, checked row by row. The gold
answer is the text after `####` with thousands commas removed. With a local file, the held-out
problems are its first `eval_size` rows, or `--eval-files` when given.

Prompts use the tokenizer's chat template when it has one and ask for the final answer after
`####`; the built-in tiny tokenizer has no template and sees the bare expression.
"""

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from reward import parse_number

HELDOUT_SEED = 1234  # fixes the arithmetic held-out split for every run
ARITHMETIC_HELDOUT = 1000  # problems reserved for evaluation
INSTRUCTION = "Solve the problem. Put the final answer on the last line after ####, e.g. '#### 42'."
TASKS = ("arithmetic", "gsm8k")


class TaskError(ValueError):
    """Bad task input (file, row, flag); train.py prints it as one line and exits."""


@dataclass(frozen=True)
class Problem:
    question: str
    gold: str


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


def gold_from_solution(answer: str) -> str | None:
    """GSM8K's gold: the text after the last `####`, commas removed; None if not a number."""
    if "####" not in answer:
        return None
    gold = answer.rsplit("####", 1)[1].strip().replace(",", "")
    return gold if parse_number(gold) is not None else None


def read_jsonl(path: str) -> list[Problem]:
    """GSM8K-style rows from a local JSONL file; a bad row is a TaskError naming file and line."""
    p = Path(path)
    if not p.is_file():
        raise TaskError(f"--data-files: {path}: no such file")
    rows = []
    with p.open(encoding="utf-8", errors="replace") as f:
        for i, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise TaskError(f"{path}:{i}: not valid JSON ({e.msg})") from None
            if (
                not isinstance(row, dict)
                or not isinstance(row.get("question"), str)
                or not isinstance(row.get("answer"), str)
            ):
                raise TaskError(f"{path}:{i}: row needs string fields 'question' and 'answer'")
            gold = gold_from_solution(row["answer"])
            if gold is None:
                raise TaskError(f"{path}:{i}: answer has no parseable final number after '####'")
            rows.append(Problem(row["question"], gold))
    if not rows:
        raise TaskError(f"--data-files: {path}: file has no rows")
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
    elif task == "gsm8k":
        if data_files:
            train = read_jsonl(data_files)
            if eval_files:
                heldout = read_jsonl(eval_files)
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


def format_prompt(tokenizer, question: str) -> str:
    """The prompt text: the chat template with an instruction when the tokenizer has one."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": f"{question}\n{INSTRUCTION}"}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return question


def encode_prompts(tokenizer, problems: list[Problem], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompt ids and mask, (B, P), on `device`."""
    texts = [format_prompt(tokenizer, p.question) for p in problems]
    old_side = tokenizer.padding_side
    tokenizer.padding_side = "left"  # every prompt ends at the same column
    batch = tokenizer(texts, padding=True, return_tensors="pt", add_special_tokens=False)
    tokenizer.padding_side = old_side
    return batch["input_ids"].to(device), batch["attention_mask"].to(device)


def fit_context(tokenizer, problems: list[Problem], max_prompt_tokens: int, what: str) -> tuple[list[Problem], int]:
    """Drop problems whose prompt exceeds `max_prompt_tokens`; (kept, number dropped).

    An error if none is left: a run that cannot sample anything must not start.
    """
    texts = [format_prompt(tokenizer, p.question) for p in problems]
    lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    kept = [p for p, n in zip(problems, lengths) if n <= max_prompt_tokens]
    if not kept:
        raise TaskError(
            f"every {what} prompt is longer than the model's context allows ({max_prompt_tokens} tokens "
            f"once --max-new-tokens is reserved)"
        )
    return kept, len(problems) - len(kept)
