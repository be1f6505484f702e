"""The seconds a step should take on a GPU, from byte and FLOP counts (a roofline, not a measurement): issue 56.

    python -m benchmarks.estimate    # the benchmark shape, H100 and H200, transformers 5.17 and the newest

Each phase is max(FLOPs / matmul rate, bytes / memory bandwidth), summed over its kernels' groups:

    decode step (N rows)   bytes: the bf16 matrices once (every row reads the same weights), the KV cache at the mean
                           length (prompt + T/2), the logits (N, V) in bf16 and the sampling chain's 8 float32 passes
                           over (N, V) (tests/test_sampling_chain.py); under transformers 5.17 without engine.decoding's
                           fold, K and V repeated to every query head: 14 layers' worth of K cache a layer written
                           and read again (tests/test_decode_gqa.py's census: 14.04 against 0.04 folded).
                           FLOPs: 2 x parameters x N. A step of sampling is T decode steps.
    a no-grad forward      2 x parameters x tokens FLOPs (pi_ref's, log alpha's recompute)
    the update             6 x parameters x tokens, and the chunked head's matmul again in the backward (2 V H a token)

Rates: an H100 SXM at 400 TFLOP/s bf16 in matmuls (40% of its 989 dense peak) and 2.0 TB/s (60% of 3.35); an
H200 at the same matmul rate and 2.9 TB/s (60% of 4.8). The anchors measured on the H200 (docs/design.md): the whole
forward+backward over 512 sequences 2.0 s, HF generate 5.31 s, TRL 17.8 s a step.
"""

from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class Shape:
    """The benchmark's: Qwen2.5-0.5B (494.0M parameters, the embedding tied to the head), 64 x 8 rows, 128 + 256."""

    params: float = 494.03e6
    hidden: int = 896
    layers: int = 24
    kv_heads: int = 2
    heads: int = 14
    head_dim: int = 64
    vocab: int = 151_936
    rows: int = 512
    prompt: int = 128
    new: int = 256


@dataclass(frozen=True)
class Device:
    name: str
    flops: float  # matmul FLOP/s reached
    bandwidth: float  # bytes/s reached


H100 = Device("H100", 400e12, 2.0e12)
H200 = Device("H200", 400e12, 2.9e12)


def roof(flops: float, bytes_: float, dev: Device) -> float:
    return max(flops / dev.flops, bytes_ / dev.bandwidth)


def kv_bytes_per_token(s: Shape) -> float:
    """One token's K and V over all layers, bf16."""
    return 2 * s.layers * s.kv_heads * s.head_dim * 2


def decode_step_s(s: Shape, dev: Device, rows: int, repeat_kv: bool = False) -> float:
    mean_len = s.prompt + s.new / 2
    kv = rows * mean_len * kv_bytes_per_token(s)
    weights = 2 * s.params
    vocab = rows * s.vocab * (2 + 8 * 4)  # the bf16 logits and the chain's 8 float32 passes
    repeat = 0.0
    if repeat_kv:  # K and V repeated to every query head: written, then read by the attention
        repeat = 2 * (s.heads / s.kv_heads) * kv
    return roof(2 * s.params * rows, weights + kv + vocab + repeat, dev)


def sample_s(s: Shape, dev: Device, rows: int, repeat_kv: bool = False) -> float:
    return s.new * decode_step_s(s, dev, rows, repeat_kv)


def forward_s(s: Shape, dev: Device, rows: int) -> float:
    tokens = rows * (s.prompt + s.new)
    return roof(2 * s.params * tokens, 2 * s.params, dev)


def update_s(s: Shape, dev: Device, rows: int) -> float:
    tokens = rows * (s.prompt + s.new)
    return roof((6 * s.params + 2 * s.vocab * s.hidden) * tokens, 2 * s.params, dev)


def step_phases(s: Shape, dev: Device, repeat_kv: bool = False, v: int = 1, beta: bool = True) -> dict:
    """Seconds a step, phase by phase, at v = 1 or the mean over a refresh period of v steps (log alpha recomputed)."""
    sample = sample_s(s, dev, s.rows * v, repeat_kv) / v
    logprob = (forward_s(s, dev, s.rows) if beta else 0.0) + (v - 1) * forward_s(s, dev, s.rows) / v
    update = update_s(s, dev, s.rows)
    return dict(sample=sample, logprob=logprob, update=update, step=sample + logprob + update)


def main() -> None:
    s = Shape()
    print("| device | transformers | v | sample s | log-prob s (pi_ref, log alpha) | update s | step s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for dev in (H100, H200):
        for label, repeat in (("5.17, K/V repeated (before the fold)", True), ("5.17 folded, and the newest", False)):
            for v in (1, 4):
                p = step_phases(s, dev, repeat, v)
                print(
                    f"| {dev.name} | {label} | {v} | {p['sample']:.2f} | {p['logprob']:.2f} | {p['update']:.2f} | "
                    f"{p['step']:.2f} |"
                )


if __name__ == "__main__":
    main()
