"""--compile: torch.compile of the two hot paths over the (rows, V) logits, opt-in.

    compile_hot_paths   the static path's sampling step (decoding.STEP: rollout.next_token, called by
                        decoding.sample_static once a token) and the LM head's chunk functions (chunked_logprobs.CHUNK:
                        the log-sum-exp of the forward, the gradient of the backward); their matmuls stay eager
    compile_seconds     the seconds torch.compile has spent compiling in this process (train.py logs it)

Eager, each op of the chain is a pass over (rows, V) (docs/benchmarks.md, "Passes over the vocabulary"); compiled,
the elementwise ops and reductions between two matmuls fuse into a few kernels. The compiled functions compute
the same formulas, not the same floats: a fused kernel sums in its own order, so values may move by float32's
rounding (tests/test_compile.py bounds it on the CPU). The draw's random numbers are torch.rand's with the run's
generator either way (dynamo runs that call eagerly), so the tokens are the same where no two p / E tie within a
rounding. Off by default: it becomes the default only if a GPU measures it faster (docs/benchmarks.md).
The plain sampling loop (rollout.sample, the reference) is never compiled.
"""

import torch

from engine import chunked_logprobs, decoding
from rollout import next_token


def compile_hot_paths(backend: str = "inductor") -> None:
    """Route the sampling step and the head's chunk functions through torch.compile (dynamic shapes: the rows of a
    chunk or a sampling call vary, one graph serves them). `backend`: torch.compile's; tests use "aot_eager"."""
    kw = dict(dynamic=True, backend=backend)
    chunked_logprobs.CHUNK.logp = torch.compile(chunked_logprobs.chunk_logp, **kw)
    chunked_logprobs.CHUNK.grad = torch.compile(chunked_logprobs.chunk_grad, **kw)
    decoding.STEP.next_token = torch.compile(next_token, **kw)


def eager_hot_paths() -> None:
    """Undo compile_hot_paths: the eager functions again."""
    chunked_logprobs.CHUNK.logp = chunked_logprobs.chunk_logp
    chunked_logprobs.CHUNK.grad = chunked_logprobs.chunk_grad
    decoding.STEP.next_token = next_token


def compile_seconds() -> float | None:
    """Seconds spent compiling so far in this process, by TorchDynamo's own account of each compile (a private
    table of torch's: None where this torch version keeps it elsewhere)."""
    try:
        from torch._dynamo.utils import compilation_time_metrics

        return float(sum(compilation_time_metrics.get("_compile.compile_inner", [])))
    except (ImportError, AttributeError, TypeError):
        return None


def compile_line() -> str:
    """The line train.py logs at the end of a --compile run."""
    secs = compile_seconds()
    spent = "an unknown time (this torch keeps no account)" if secs is None else f"{secs:.1f} s"
    return f"torch.compile: {spent} compiling the sampling step and the LM head's chunk functions"
