"""Speed and memory of one GRPO step of this project's own loop, phase by phase.

    python -m benchmarks.bench --model tiny --prompts-per-step 8 --group-size 8 --max-new-tokens 16 --beta 0.04 \\
        --vs-trl --device cpu
    python -m benchmarks.bench --model qwen2.5-0.5b-random --prompts-per-step 64 --group-size 8 --prompt-len 128 \\
        --max-new-tokens 256 --beta 0.04 --device cuda --dtype bfloat16

The timed step is train.py's own, `train.grpo_step`; its phases are the ones it times itself:
    sample   at a refresh, rollout.generate_batches of the refresh period's v batches (the path is printed: plain or
             static-cache+cuda-graph); 0 at the other steps
    score    the reward function at a refresh (here: decode to text, synthetic rewards); advantages
    logprob  train.completion_logprobs without grad: log alpha of the period's batches at a refresh (--alpha-logp-from
             recompute), pi_ref when --beta > 0 (and its --ref-refresh copy)
    update   train.update: forward, backward and the AdamW step, micro-batched
With v > 1 the steps of a refresh period differ (the refresh does the sampling), so the figure to compare is the mean
over whole refresh periods: --warmup and --steps are rounded up to multiples of v, and each phase's mean is printed,
then, as the last line, one JSON object: step_s_mean (mean seconds per step), step_s (the median), phases
(means), tokens_per_s, peak_mem_gb and peak_reserved_gb (CUDA: torch.cuda.max_memory_allocated and
max_memory_reserved, the allocator's blocks in use and all it holds, which an out-of-memory error is decided
against; CPU: both the process's peak resident set, VmHWM, as `memory_measure` says). Several values of
--offpolicy-steps or --alpha-logp-from run one process each, one after the other, and end with a table.

`--memory-cap-gb G` caps the process at G GiB of the GPU (torch.cuda.set_per_process_memory_fraction(G GiB /
total), engine.policy.cap_memory) before the model loads, so that the default micro-batch and sample rows are sized
as on a G GiB device (engine.policy.available_bytes); on a CPU it is a no-op, and says so.

Where it departs from a training run, so that runs are comparable:
  1. Every completion runs to --max-new-tokens (no early EOS), so each step does the same work.
  2. Prompts are random token ids of length --prompt-len (words of the tokenizer, so that TRL gets
     the same prompts as text), and rewards are random 0/1 from a seeded generator, with one reward
     flipped in any group that came out all equal, so every group has signal and the update always
     runs; the verifier is not run (reward.py's cost is not the model's).
  3. CUDA is synchronised at phase boundaries, so a phase's time is the GPU's, not the launch queue's.
  4. `--model tiny` has random weights (no supervised warm-up: timing does not depend on them).

`--token-timings` then times a sampled token's parts (the chain after the logits, the static decoder's step, whole
sampling calls of both loops and model.generate) and the LM head's log-probs, each beside its textbook form, at the
same shapes: benchmarks/token_timings.py.

`--vs-trl` then runs TRL's GRPOTrainer (optional: `pip install trl`) on the same model and sizes, in the
same process; `--trl-subclass` instead times stock GRPOTrainer against integrations/trl_grpo.py's subclass
at v = 1 and v = 4. What is matched and what differs: benchmarks/trl_bench.py.
"""

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import random
import statistics
import sys
import tempfile

import torch

import rollout
import train
from benchmarks.compare import FITS, compare, fit_name
from benchmarks.token_timings import KEYS as TOKEN_KEYS
from benchmarks.token_timings import head_timings, token_timings
from benchmarks.trl_bench import subclass_step_times, trl_step_times
from bookkeeping.metrics import clock
from bookkeeping.run_io import current_memory_gb, peak_memory_gb, peak_reserved_gb, reset_peak_memory
from config import Config, ConfigError, add_flags, resolve, validate
from engine.decoding import sampling_path
from engine.policy import autocast, cap_memory, gguf_file, load_gguf, make_models, memory_fraction
from train import grpo_step

PRESETS = {  # random-weight models with a real model's shape
    "qwen2.5-0.5b-random": dict(
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
    ),
}
PRESETS["qwen2.5-1.5b-random"] = dict(
    PRESETS["qwen2.5-0.5b-random"],
    hidden_size=1536,
    num_hidden_layers=28,
    num_attention_heads=12,
    intermediate_size=8960,
)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository: benchmarks/ is one level down
QWEN_TOKENIZER = os.path.join(ROOT, "..", "shared", "data", "qwen2-tokenizer")
PHASES = ["sample", "score", "logprob", "update"]
# What peak_mem_gb and peak_reserved_gb measure, by whether the device is CUDA (bookkeeping.run_io).
MEMORY_MEASURE = {
    True: "cuda: torch.cuda.max_memory_allocated, max_memory_reserved",
    False: "cpu: the process's peak resident set (VmHWM) for both",
}


# train.py's flags that the benchmark takes as they are (config.add_flags), and its smaller default sizes.
TRAIN_FLAGS = (
    "device",
    "dtype",
    "prompts_per_step",
    "group_size",
    "max_new_tokens",
    "temperature",
    "sample_rows",
    "lag",
    "sampling",
    "beta",
    "micro_batch",
    "gradient_checkpointing",
    "param_dtype",
    "lora_rank",
    "seed",
)
TRAIN_DEFAULTS = dict(prompts_per_step=8, group_size=8, max_new_tokens=16)


class DefaultsOnce(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default in its help, once: train.py's flags state theirs already."""

    def _get_help_string(self, action):
        return action.help if "(default" in (action.help or "") else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Time one GRPO step of this project's loop, phase by phase",
        formatter_class=DefaultsOnce,
    )
    # --- model and device ---------------------------------------------------------------------
    p.add_argument(
        "--model", default="tiny", help=f"tiny (random weights), {', '.join(PRESETS)}, a folder, GGUF or hub id"
    )
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument(
        "--memory-cap-gb",
        type=float,
        default=None,
        help="cap the process at this many GiB of the GPU (torch.cuda.set_per_process_memory_fraction), as on a "
        "smaller device; the memory defaults are sized from it (default: no cap; a no-op on a CPU)",
    )
    # --- the step: train.py's own flags, with smaller defaults -------------------------------------------------
    add_flags(p.add_argument_group("train.py's flags"), TRAIN_FLAGS, defaults=TRAIN_DEFAULTS)
    p.add_argument("--prompt-len", type=int, default=32, help="P, tokens per prompt (random ids)")
    p.add_argument("--offpolicy-steps", type=int, nargs="+", default=[1], help="v (1 = on-policy); several: compared")
    p.add_argument(
        "--alpha-logp-from",
        nargs="+",
        choices=["recompute", "sampler"],
        default=["recompute"],
        help="log alpha of the later batches (train.py's flag); several: compared at v > 1",
    )
    # --- fitting the model: --fit runs several of train.py's ways, one process each ------------------------------
    p.add_argument(
        "--fit",
        nargs="+",
        choices=list(FITS),
        default=None,
        help="several ways to fit the model, one process each, then a memory table: "
        + ", ".join(f"{k} = {' '.join(v) or 'full fine-tuning, float32'}" for k, v in FITS.items()),
    )
    # --- timing -------------------------------------------------------------------------------------
    p.add_argument("--steps", type=int, default=5, help="timed steps, rounded up to whole refresh periods")
    p.add_argument(
        "--warmup", type=int, default=1, help="untimed steps first (allocator, kernels, graph capture), whole periods"
    )
    p.add_argument("--vs-trl", action="store_true", help="also time TRL's GRPOTrainer on the same model and sizes")
    p.add_argument(
        "--vs-generate", action="store_true", help="also time transformers' model.generate on the same shapes"
    )
    p.add_argument(
        "--token-timings",
        action="store_true",
        help="also time a sampled token's parts (the chain after the logits, the decode step, whole sampling calls, "
        "model.generate) and the LM head's log-probs, each beside its textbook form (benchmarks/token_timings.py)",
    )
    p.add_argument(
        "--trl-subclass",
        action="store_true",
        help="only this: stock GRPOTrainer, then integrations/trl_grpo's subclass at v=1 and v=4, at these sizes",
    )
    return p


def fake_tokenizer(vocab_size: int):
    """A word-level tokenizer with one word per id ("w5"): enough for timing when no real one is at hand."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", padding_side="left")


def load_model(name: str, device: torch.device, seed: int):
    """(model, tokenizer, description) for --model; presets and tiny are built with random weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    if name == "tiny":
        from engine import tiny

        tok = tiny.build_tokenizer()
        return tiny.build_model(tok, seed=seed).to(device), tok, "tiny (random weights)"
    if name in PRESETS:
        if os.path.isdir(QWEN_TOKENIZER):
            tok, tok_name = AutoTokenizer.from_pretrained(QWEN_TOKENIZER), "Qwen2 tokenizer"
        else:
            tok, tok_name = fake_tokenizer(PRESETS[name]["vocab_size"]), "word-level stand-in tokenizer"
        cfg = Qwen2Config(**PRESETS[name], eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        with torch.device(device):  # initialise on the device: 0.5B parameters are slow to fill on a CPU
            model = Qwen2ForCausalLM(cfg)
        return model, tok, f"{name} (random weights, {tok_name})"
    if (gguf := gguf_file(name)) is not None:  # a GGUF file (or a folder holding one), dequantized
        model, tok = load_gguf(gguf)
        return model.to(device), tok, f"{gguf.name} (GGUF, dequantized to float32)"
    tok = AutoTokenizer.from_pretrained(name)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token  # as policy.load_policy: padding is masked explicitly
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32).to(device)
    return model, tok, name


def prompt_words(tok) -> list[int]:
    """Ids that re-tokenise to themselves when decoded side by side: whole words of a BPE
    vocabulary ("Ġcat"), or every non-special token of a character- or word-level one."""
    special = set(tok.all_special_ids)
    pieces = tok.convert_ids_to_tokens(list(range(len(tok))))
    words = [
        i
        for i, s in enumerate(pieces)
        if s and s.startswith("Ġ") and s[1:].isascii() and s[1:].isalpha() and len(s) > 3 and i not in special
    ]
    return words if len(words) > 100 else [i for i, s in enumerate(pieces) if s is not None and i not in special]


def make_prompts(tok, words: list[int], n: int, length: int, rng: random.Random) -> tuple[torch.Tensor, list[str]]:
    """n random prompts of `length` tokens: the ids (n, P) and the same prompts as text."""
    ids = torch.tensor([[rng.choice(words) for _ in range(length)] for _ in range(n)])  # (n, P)
    return ids, tok.batch_decode(ids)


def synthetic_reward(tok, group_size: int, reward_gen: torch.Generator):
    """Random 0/1 rewards, with one flipped in any group that came out all equal (so every group has
    signal and the update always runs); the completions are decoded first, the text a verifier would read."""

    def reward_fn(ro) -> torch.Tensor:
        tok.batch_decode(ro.completion_ids, skip_special_tokens=True)
        rewards = torch.randint(
            0, 2, (ro.completion_ids.shape[0],), generator=reward_gen, device=reward_gen.device
        ).float()  # (N,)
        groups = rewards.view(-1, group_size)  # (B, G), a view: the flip below writes into rewards
        same = (groups == groups[:, :1]).all(dim=1)  # (B,) groups without signal would skip the update
        groups[same, 0] = 1.0 - groups[same, 0]
        return rewards.to(ro.completion_ids.device)

    return reward_fn


def bench_ours(cfg: Config, args, model, tok, words) -> dict:
    """Train.py's own step, `train.grpo_step`, over whole refresh periods: --warmup and --steps are rounded up to
    multiples of v, so `step_s_mean` (the figure to compare across v) holds every refresh's sampling once."""
    device = torch.device(cfg.device)
    v = cfg.offpolicy_steps
    warmup, steps = -(-args.warmup // v) * v, -(-args.steps // v) * v
    # A refresh never samples past the last step; under --lag s the run is s steps longer, so that each timed step
    # draws its batch of step k + s as a step mid-run does (the warm-up's first step draws s + 1).
    cfg = dataclasses.replace(cfg, steps=warmup + steps + (cfg.lag or 0))
    models = make_models(cfg, model)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    reward_fn = synthetic_reward(tok, cfg.group_size, torch.Generator().manual_seed(cfg.seed + 1))
    rng = random.Random(cfg.seed)

    def draw(k: int, n: int, now: int | None = None) -> list:  # train.grpo_step's draw; no reward reads `now`
        prompts = [make_prompts(tok, words, cfg.prompts_per_step, args.prompt_len, rng)[0].to(device) for _ in range(n)]
        return [(p, torch.ones_like(p), reward_fn) for p in prompts]  # (B, P) each, no padding

    rows, queue, peaks, reserved_peaks, update_gb = [], None, [], [], []

    def measured_update(*a, **kw):  # train.update, and the memory it adds at its peak: what checkpointing shrinks
        peaks.append(peak_memory_gb(device))  # the peaks so far survive the reset below
        reserved_peaks.append(peak_reserved_gb(device))
        before = current_memory_gb(device)
        reset_peak_memory(device)
        out = plain_update(*a, **kw)
        update_gb.append(peak_memory_gb(device) - before)
        return out

    calls = []  # the generate calls of the timed steps: a refresh period's batches sampled in as few as memory allows

    def counted_generate(*a, **kw):
        calls.append(1)
        return plain_generate(*a, **kw)

    plain_update, train.update = train.update, measured_update
    plain_generate, rollout.generate = rollout.generate, counted_generate
    try:
        for k in range(warmup + steps):
            if k == warmup:
                reset_peak_memory(device)
                peaks.clear()
                reserved_peaks.clear()
                calls.clear()
            t = clock(device)
            res, queue = grpo_step(cfg, models, tok, k, gen, queue, draw, ignore_eos=True)
            if k >= warmup:
                row = dict(res.times, step=clock(device) - t, tokens=int(res.rollout.completion_mask.sum()))
                rows.append(row | {k: res.stats.get(k) for k in ("sampler_mismatch", "micro_batch")})
    finally:
        train.update = plain_update
        rollout.generate = plain_generate
    # The sampling loop's log alpha against a full forward (train.sampler_mismatch), over the steps that measure it.
    mismatch = [r["sampler_mismatch"] for r in rows if r["sampler_mismatch"] is not None]
    med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    mean = lambda key: statistics.fmean(r[key] for r in rows)  # noqa: E731
    return {
        "step_s": med("step"),
        "step_s_mean": mean("step"),
        "phases": {p: mean(p) for p in PHASES},
        "tokens_per_s": mean("tokens") / mean("step"),
        "peak_mem_gb": max([peak_memory_gb(device), *peaks]),
        "peak_reserved_gb": max([peak_reserved_gb(device), *reserved_peaks]),
        "update_mem_gb": max(update_gb[-steps:]) if update_gb else 0.0,
        # A refresh samples its period's batches: the tokens of the timed steps over their sampling seconds.
        "sample_tokens_per_s": sum(r["tokens"] for r in rows) / max(sum(r["sample"] for r in rows), 1e-9),
        "sampler_mismatch": statistics.fmean(mismatch) if mismatch else None,
        "sampling_path": sampling_path(models.policy, cfg.fast),
        # the micro-batch the timed steps' updates used (--micro-batch, or policy.auto_micro_batch's choice)
        "micro_batch": max((r["micro_batch"] for r in rows if r["micro_batch"] is not None), default=None),
        "sample_calls_per_refresh": len(calls) / (steps // v),
        "timed_steps": steps,
        "warmup_steps": warmup,
    }


@torch.no_grad()
def generate_tokens_per_s(cfg: Config, args, model, tok, words) -> float:
    """transformers' own `model.generate` on the same shapes, the baseline of our sampler: B prompts of --prompt-len
    tokens, G sampled completions each, every one --max-new-tokens long (min_new_tokens: no early EOS), under the
    run's autocast. One untimed call, then the tokens per second of one timed call."""
    device = torch.device(cfg.device)
    ids = make_prompts(tok, words, cfg.prompts_per_step, args.prompt_len, random.Random(cfg.seed))[0].to(device)
    kw = dict(
        attention_mask=torch.ones_like(ids),
        do_sample=True,
        temperature=cfg.temperature,
        top_k=0,
        num_return_sequences=cfg.group_size,
        max_new_tokens=cfg.max_new_tokens,
        min_new_tokens=cfg.max_new_tokens,
        pad_token_id=tok.pad_token_id,
    )
    was_training = model.training
    model.eval()
    with autocast(cfg, device):
        model.generate(ids, **kw)
        t = clock(device)
        out = model.generate(ids, **kw)
        seconds = clock(device) - t
    model.train(was_training)
    return (out.shape[1] - ids.shape[1]) * out.shape[0] / seconds


@contextlib.contextmanager
def saved(model, tok):
    """The model and tokenizer saved into a temporary folder (removed afterwards): TRL loads models by path."""
    with tempfile.TemporaryDirectory(prefix="bench-model-") as path:
        model.save_pretrained(path)
        tok.save_pretrained(path)
        yield path


def trl_prompts(cfg: Config, args, tok, words: list[int]) -> list[str]:
    """The text prompts TRL trains on: --prompts-per-step random word prompts per step, for --warmup + --steps steps."""
    n = cfg.prompts_per_step * (args.warmup + args.steps)
    return make_prompts(tok, words, n, args.prompt_len, random.Random(cfg.seed))[1]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if len(args.offpolicy_steps) > 1 or len(args.alpha_logp_from) > 1 or args.fit:
        return compare(args, sys.argv[1:] if argv is None else argv, root=ROOT, phases=PHASES)
    args.offpolicy_steps, args.alpha_logp_from = args.offpolicy_steps[0], args.alpha_logp_from[0]
    if args.threads:
        torch.set_num_threads(args.threads)
    shared = {name: getattr(args, name) for name in TRAIN_FLAGS}
    cfg = resolve(
        Config(
            model=args.model,
            offpolicy_steps=args.offpolicy_steps,
            alpha_logp_from=args.alpha_logp_from,
            out=tempfile.gettempdir(),
            **shared,
        )
    )
    validate(cfg)
    if args.steps < 1 or args.warmup < 0 or args.prompt_len < 1:
        raise SystemExit("error: --steps must be >= 1, --warmup >= 0, --prompt-len >= 1")
    device = torch.device(cfg.device)
    if args.memory_cap_gb is not None:
        if args.memory_cap_gb <= 0:
            raise SystemExit(f"error: --memory-cap-gb {args.memory_cap_gb:g} must be > 0")
        if device.type == "cuda":
            fraction = cap_memory(device, args.memory_cap_gb)
            print(f"memory cap: {args.memory_cap_gb:g} GiB of the GPU, per-process memory fraction {fraction:.4f}")
        else:
            print(f"memory cap: --memory-cap-gb {args.memory_cap_gb:g} is a no-op on the CPU (the cap is CUDA's)")
    use_trl = args.vs_trl or args.trl_subclass
    try:
        import trl  # noqa: F401
    except ImportError:
        if use_trl:
            what = "--trl-subclass has nothing to time" if args.trl_subclass else "timing our loop only"
            print(f"TRL is not installed (pip install trl, or the project's [trl] extra): {what}", flush=True)
            if args.trl_subclass:
                return 2
        use_trl = False

    try:
        model, tok, described = load_model(args.model, device, cfg.seed)
    except ConfigError as e:  # no gguf package, an unreadable file: one line
        print(f"error: {e}", file=sys.stderr)
        return 2
    words = prompt_words(tok)
    n = cfg.prompts_per_step * cfg.group_size
    if args.trl_subclass:
        with saved(model, tok) as model_dir:
            del model
            res = subclass_step_times(cfg, model_dir, tok, trl_prompts(cfg, args, tok, words), args.warmup, args.steps)
        print(json.dumps(res), flush=True)
        return 0

    generate_tps = generate_tokens_per_s(cfg, args, model, tok, words) if args.vs_generate else None
    ours = bench_ours(cfg, args, model, tok, words)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"bench: {described}, {n_params / 1e6:.1f}M parameters, {cfg.device}, {cfg.dtype}"
        f", sampling path {ours['sampling_path']}"
    )
    print(
        f"B={cfg.prompts_per_step} G={cfg.group_size} N={n}, "
        f"prompt {args.prompt_len} + {cfg.max_new_tokens} new tokens, "
        f"beta {cfg.beta}, v={cfg.offpolicy_steps} (log alpha: {cfg.alpha_logp_from}), "
        f"micro-batch {ours['micro_batch']}{'' if cfg.micro_batch else ' (auto)'}, "
        f"{ours['sample_calls_per_refresh']:g} sampling call(s) a refresh; "
        f"means over {ours['timed_steps']} steps after {ours['warmup_steps']} warm-up"
    )
    print(f"{'phase':<10}{'mean s':>10}{'share':>8}")
    for p in PHASES:
        print(f"{p:<10}{ours['phases'][p]:>10.4f}{ours['phases'][p] / ours['step_s_mean']:>8.1%}")
    print(f"{'step':<10}{ours['step_s_mean']:>10.4f}   (median {ours['step_s']:.4f})")
    peak = f"peak memory {ours['peak_mem_gb']:.2f} GB allocated, {ours['peak_reserved_gb']:.2f} GB reserved"
    if device.type != "cuda":
        peak = f"peak resident set {ours['peak_mem_gb']:.2f} GB (a CPU: no allocator cache, reserved is the same)"
    print(f"tokens/s {ours['tokens_per_s']:.0f}, {peak}, the update's own {ours['update_mem_gb']:.2f} GB")
    mismatch = "-" if ours["sampler_mismatch"] is None else f"{ours['sampler_mismatch']:.2e}"
    baseline = "" if generate_tps is None else f"; model.generate on the same shapes {generate_tps:.0f} tokens/s"
    print(f"sampling {ours['sample_tokens_per_s']:.0f} tokens/s{baseline}; sampler_mismatch {mismatch}")

    if args.token_timings:
        prompts = make_prompts(tok, words, cfg.prompts_per_step, args.prompt_len, random.Random(cfg.seed))[0]
        tokens = min(cfg.max_new_tokens, 32)
        ms = token_timings(cfg, model, tok, prompts.to(device), tokens=tokens)
        ms |= head_timings(cfg, model, rows=min(n * cfg.max_new_tokens, 4096))
        print(f"ms per decode step of {n} rows ({tokens} new tokens a call; the chain on ({n}, V) logits):")
        print("  " + "  ".join(f"{k} {ms[k]:.3f}" for k in TOKEN_KEYS))
        print(
            f"ms per 1,000 scored tokens of the LM head, forward and backward: chunked {ms['head']:.2f}, "
            f"textbook {ms['head_textbook']:.2f}"
        )
    keys = ("step_s", "phases", "tokens_per_s", "peak_mem_gb", "peak_reserved_gb", "update_mem_gb", "sampling_path")
    keys += ("step_s_mean",)
    keys += ("timed_steps", "sample_tokens_per_s", "sampler_mismatch", "sample_calls_per_refresh")
    result = {k: ours[k] for k in keys}
    if generate_tps is not None:
        result["generate_tokens_per_s"] = generate_tps
    if args.token_timings:
        result["token_ms"] = ms
    result.update(
        model=args.model,
        device=cfg.device,
        dtype=cfg.dtype,
        prompts=cfg.prompts_per_step,
        group=cfg.group_size,
        prompt_len=args.prompt_len,
        max_new_tokens=cfg.max_new_tokens,
        beta=cfg.beta,
        offpolicy_steps=cfg.offpolicy_steps,
        alpha_logp_from=cfg.alpha_logp_from,
        micro_batch=ours["micro_batch"],
        steps=args.steps,
        fit=fit_name(cfg),
        memory_measure=MEMORY_MEASURE[device.type == "cuda"],
        memory_cap_gb=args.memory_cap_gb if device.type == "cuda" else None,
        memory_fraction=memory_fraction(device) if device.type == "cuda" else None,
    )
    if use_trl:
        print(json.dumps(result), flush=True)  # ours, in case TRL does not finish; the full line follows
        with saved(model, tok) as model_dir:  # TRL loads the model by path: the very weights we started from
            del model
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            reset_peak_memory(device)  # CPU: TRL's own high-water mark, from what is resident once ours is freed
            theirs = trl_step_times(cfg, model_dir, tok, trl_prompts(cfg, args, tok, words), args.warmup, args.steps)
            theirs["peak_mem_gb"] = theirs["peak_mem_gb"] or peak_memory_gb(device)
            theirs["peak_reserved_gb"] = theirs["peak_reserved_gb"] or peak_reserved_gb(device)
        ratio = ours["step_s"] / theirs["step_s"]
        mem = f", peak memory {theirs['peak_mem_gb']:.2f} GB allocated, {theirs['peak_reserved_gb']:.2f} GB reserved"
        print(
            f"TRL {theirs['version']} GRPOTrainer: step {theirs['step_s']:.4f} s (median of {theirs['steps']} after "
            f"{args.warmup} warm-up; prompts re-tokenised to {theirs['prompt_len']:.1f} tokens){mem}"
        )
        print(f"ours / TRL = {ratio:.3f}")
        result.update(
            trl_step_s=theirs["step_s"],
            ratio_vs_trl=ratio,
            trl_version=theirs["version"],
            trl_peak_mem_gb=theirs["peak_mem_gb"],
            trl_peak_reserved_gb=theirs["peak_reserved_gb"],
        )
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
