"""Held-out greedy accuracy (bookkeeping.evaluation.evaluate, as train.py reports it) of a GGUF model or of a
checkpoint's policy.

    OMP_NUM_THREADS=1 python -m studies.real_model_eval GGUF CHECKPOINT|- N MAX_NEW_TOKENS

CHECKPOINT: a train.py checkpoint (runs/<out>/checkpoints/step-*.pt) whose policy replaces the file's weights;
`-` evaluates the file itself. N: the first N held-out word problems.
"""

import sys
import time

import torch

from bookkeeping.checkpoint import load_checkpoint
from bookkeeping.evaluation import evaluate
from engine.policy import load_gguf
from problems.tasks import load_task


def main() -> None:
    torch.set_num_threads(1)
    gguf, ckpt, n, max_new_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    model, tok = load_gguf(gguf)
    if ckpt != "-":
        model.load_state_dict(load_checkpoint(ckpt)["policy"])
    _, heldout = load_task("wordproblems", eval_size=n)
    t = time.time()
    acc = evaluate(model, tok, heldout, max_new_tokens, "cpu")
    print(f"{ckpt}: held-out greedy accuracy {acc:.4f} on {len(heldout)} ({time.time() - t:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
