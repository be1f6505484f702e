"""Base rates of SmolLM2-135M-Instruct on a task, measured the way train.py trains and evaluates:
tasks.encode_prompts, rollout.generate and reward.math_reward on the tokenizer-decoded completion.

    OMP_NUM_THREADS=1 python -m studies.real_model_measure --task wordproblems --n 128 \
        --lengths 32 48 64 --temperatures 0.7 1.0 --group-size 8 --prompts 32

Greedy accuracy on the first --n held-out problems at each completion length; then, at each temperature
and length, G samples of each of the first --prompts held-out problems: the fraction credited, the
fraction of groups with signal (neither all 0 nor all 1), and the fraction truncated.
"""

import argparse
import json
import os
import re
import time
from pathlib import Path

import torch

from engine.policy import load_gguf
from problems.tasks import encode_prompts, load_task
from reward import math_reward
from rollout import generate

DEFAULT_GGUF = Path.home() / ".cache/offpolicy-grpo/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def credited(model, tok, problems, group_size, max_new_tokens, temperature, seed, batch=64):
    """(rewards (len(problems), G), truncated (len(problems), G), seconds, gold mentioned (fraction)).

    "Gold mentioned": the gold number appears in the completion as a word of its own, credited or not: an upper
    bound on what writing the computed number after `####` could earn.
    """
    gen = torch.Generator().manual_seed(seed)
    rewards, truncated, t0, mentioned = [], [], time.time(), 0
    per = max(1, batch // group_size)
    for s in range(0, len(problems), per):
        chunk = problems[s : s + per]
        ids, mask = encode_prompts(tok, chunk, "cpu")
        ro = generate(
            model,
            ids,
            mask,
            group_size=group_size,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            generator=gen,
        )
        out = torch.where(ro.completion_mask.bool(), ro.completion_ids, tok.pad_token_id)
        texts = tok.batch_decode(out, skip_special_tokens=True)
        golds = [p.gold for p in chunk for _ in range(group_size)]
        rewards += [math_reward(t, g) for t, g in zip(texts, golds)]
        truncated += ro.truncated.tolist()
        mentioned += sum(g in re.findall(r"-?\d+", t) for t, g in zip(texts, golds))
    r = torch.tensor(rewards).view(len(problems), group_size)
    tr = torch.tensor(truncated).view(len(problems), group_size)
    return r, tr, time.time() - t0, mentioned / r.numel()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(DEFAULT_GGUF))
    ap.add_argument("--task", default="wordproblems")
    ap.add_argument("--data-files")
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--lengths", type=int, nargs="+", default=[32, 48, 64])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0])
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--split", default="heldout", choices=["heldout", "train"])
    ap.add_argument("--show", type=int, default=0, help="print this many greedy completions")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 1)))
    model, tok = load_gguf(args.model)
    train, heldout = load_task(args.task, args.data_files, eval_size=max(args.n, args.prompts) + 1)
    probs = heldout if args.split == "heldout" else train
    for t in args.lengths:
        r, tr, sec, seen = credited(model, tok, probs[: args.n], 1, t, 0.0, 0, batch=128)
        print(
            json.dumps(
                dict(
                    kind="greedy",
                    split=args.split,
                    n=args.n,
                    max_new_tokens=t,
                    accuracy=round(r.mean().item(), 4),
                    gold_mentioned=round(seen, 3),
                    truncated=round(tr.float().mean().item(), 3),
                    seconds=round(sec, 1),
                )
            ),
            flush=True,
        )
    if args.show:
        ids, mask = encode_prompts(tok, probs[: args.show], "cpu")
        ro = generate(
            model,
            ids,
            mask,
            group_size=1,
            max_new_tokens=max(args.lengths),
            temperature=0.0,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        out = torch.where(ro.completion_mask.bool(), ro.completion_ids, tok.pad_token_id)
        for p, text in zip(probs, tok.batch_decode(out, skip_special_tokens=True)):
            print(f"--- gold {p.gold}: {text!r}")
    for temp in args.temperatures:
        for t in args.lengths:
            r, tr, sec, seen = credited(model, tok, probs[: args.prompts], args.group_size, t, temp, 0)
            signal = (r.amax(1) != r.amin(1)).float().mean().item()
            print(
                json.dumps(
                    dict(
                        kind="sampled",
                        split=args.split,
                        prompts=args.prompts,
                        group_size=args.group_size,
                        temperature=temp,
                        max_new_tokens=t,
                        pass_rate=round(r.mean().item(), 4),
                        groups_with_signal=round(signal, 3),
                        gold_mentioned=round(seen, 3),
                        truncated=round(tr.float().mean().item(), 3),
                        seconds=round(sec, 1),
                    )
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
