"""Greedy completions of the first held-out word problems, before (the GGUF file) and after training (a run's final/),
decoded as the verifier reads them, with the verifier's verdict: the "before and after" of README.md.

    OMP_NUM_THREADS=1 python -m studies.real_model_completions GGUF RUN/final N MAX_NEW_TOKENS > completions.md
"""

import sys

import torch

from engine.policy import load_gguf
from problems.tasks import encode_prompts, load_task
from reward import math_reward
from rollout import generate


def completions(model, tok, problems, max_new_tokens: int) -> list[str]:
    """bookkeeping.evaluation.evaluate's decoding (greedy, the same `generate`), returning the texts, not the score."""
    ids, mask = encode_prompts(tok, problems, "cpu")
    special = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        r = generate(model.eval(), ids, mask, group_size=1, max_new_tokens=max_new_tokens, temperature=0.0, **special)
    out = torch.where(r.completion_mask.bool(), r.completion_ids, tok.pad_token_id)
    return tok.batch_decode(out, skip_special_tokens=True)


def main() -> None:
    from transformers import AutoModelForCausalLM

    gguf, final, n, max_new_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    base, tok = load_gguf(gguf)
    _, heldout = load_task("wordproblems", eval_size=n)
    before = completions(base, tok, heldout, max_new_tokens)
    after = completions(AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32), tok, heldout, max_new_tokens)
    cell = lambda s: s.strip().replace("\n", " ").replace("|", "\\|")  # noqa: E731
    print("| problem | gold | before | | after | |\n|---|---:|---|---|---|---|")
    for p, b, a in zip(heldout, before, after):
        marks = ["✓" if math_reward(t, p.gold) else "✗" for t in (b, a)]
        print(f"| {cell(p.question)} | {p.gold} | {cell(b)} | {marks[0]} | {cell(a)} | {marks[1]} |")


if __name__ == "__main__":
    main()
