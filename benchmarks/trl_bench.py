"""TRL's GRPOTrainer timed on the same model and sizes as our step: what `python -m benchmarks.bench --vs-trl`
and `--trl-subclass` run (TRL is optional: `pip install -e ".[trl]"`).

`trl_step_times` runs stock GRPOTrainer with what can be matched matched: N = B*G completions per optimizer
step (per-device batch --micro-batch, gradient accumulation to N), num_generations G, max_completion_length T
and `min_new_tokens` T (so it too generates exactly T tokens), random 0/1 rewards, beta, temperature, learning
rate, clip eps, grad-norm clipping, one optimizer step per generation (num_iterations 1), no gradient
checkpointing (TRL's default is on), bf16 only with --dtype bfloat16 (TRL's default is on), no eval, no saving,
no logging service. What differs: TRL samples with `model.generate` (its sampler, its KV cache), its prompts are
the same words re-tokenised, its loss is "dapo" (token-level, like our token-mean), its optimizer is
transformers' default AdamW.

`subclass_step_times` runs stock GRPOTrainer, then this project's OffPolicyGRPOTrainer at v = 1 and v = 4
(integrations/trl_grpo.py), one after the other, each in a process of its own (so each peak memory is its own),
on one model: v = 4 against v = 1 against stock TRL, side by side.

In both, a step is the time between two step ends (the first from `on_train_begin`), so it includes
everything TRL does in a step; the first `warmup` steps are dropped.
"""

import multiprocessing
import random
import statistics
import tempfile

import torch
from transformers import PrinterCallback, TrainerCallback

from bookkeeping.metrics import clock
from bookkeeping.run_io import peak_memory_gb, peak_reserved_gb


class StepTimer(TrainerCallback):
    """The clock at the start of training and at every step's end: step k took ends[k + 1] - ends[k]."""

    def __init__(self, device):
        self.device, self.ends = device, []

    def on_train_begin(self, *args, **kwargs):
        self.ends.append(clock(self.device))

    def on_step_end(self, *args, **kwargs):
        self.ends.append(clock(self.device))

    def times(self, warmup: int) -> list[float]:
        return [b - a for a, b in zip(self.ends, self.ends[1:])][warmup:]


def random_rewards(seed: int):
    """A reward function of random 0/1 rewards from its own seeded stream (TRL calls it with completions)."""
    rng = random.Random(seed)
    return lambda completions, **kwargs: [float(rng.random() < 0.5) for _ in completions]


def _train(cls, config_cls, model_path, tok, texts, warmup, device, **kwargs) -> list[float]:
    """Train `cls` for len(texts) / prompts-per-step steps in a temporary output folder; the step times."""
    from datasets import Dataset

    timer = StepTimer(device)
    with tempfile.TemporaryDirectory(prefix="trl-bench-") as out:
        args = config_cls(
            output_dir=out,
            gradient_checkpointing=False,
            report_to="none",
            save_strategy="no",
            eval_strategy="no",
            logging_steps=10**9,
            disable_tqdm=True,
            shuffle_dataset=False,
            use_cpu=device.type == "cpu",
            **kwargs,
        )
        trainer = cls(
            model=model_path,
            reward_funcs=random_rewards(args.seed + 1),
            args=args,
            train_dataset=Dataset.from_dict({"prompt": texts}),
            processing_class=tok,
            callbacks=[timer],
        )
        trainer.remove_callback(PrinterCallback)  # its end-of-training metrics line would come after our table
        trainer.train()
    return timer.times(warmup)


def _common(cfg, micro_batch: int, steps: int) -> dict:
    """GRPOConfig fields that match our Config (the module docstring)."""
    return dict(
        per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=cfg.prompts_per_step * cfg.group_size // micro_batch,
        num_generations=cfg.group_size,
        max_completion_length=cfg.max_new_tokens,
        generation_kwargs={"min_new_tokens": cfg.max_new_tokens},
        temperature=cfg.temperature,
        beta=cfg.beta,
        epsilon=cfg.clip_eps,
        learning_rate=cfg.lr,
        max_grad_norm=cfg.max_grad_norm,
        num_iterations=1,
        max_steps=steps,
        bf16=cfg.dtype == "bfloat16",
        seed=cfg.seed,
        model_init_kwargs={"dtype": torch.float32},
    )


def trl_step_times(cfg, model_path: str, tok, texts: list[str], warmup: int, steps: int) -> dict:
    """Stock GRPOTrainer on `texts` (cfg.prompts_per_step per step): median step, TRL's version, peak memory
    (allocated and reserved, CUDA only: on a CPU the caller reads the resident set)."""
    import trl
    from trl import GRPOConfig, GRPOTrainer

    device = torch.device(cfg.device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    n = cfg.prompts_per_step * cfg.group_size
    kw = _common(cfg, cfg.micro_batch or n, warmup + steps)
    times = _train(GRPOTrainer, GRPOConfig, model_path, tok, texts, warmup, device, **kw)
    lens = [len(x) for x in tok(texts[: cfg.prompts_per_step]).input_ids]
    return {
        "step_s": statistics.median(times),
        "steps": len(times),
        "version": trl.__version__,
        "prompt_len": statistics.fmean(lens),
        "peak_mem_gb": peak_memory_gb(device) if device.type == "cuda" else None,
        "peak_reserved_gb": peak_reserved_gb(device) if device.type == "cuda" else None,
    }


def _subclass_run(queue, name: str, threads: int, cfg, model_path: str, tok, texts, warmup: int, steps: int):
    """One run of `subclass_step_times` in a process of its own: its step times and its peak memory."""
    from trl import GRPOConfig, GRPOTrainer

    from integrations.trl_grpo import OffPolicyGRPOConfig, OffPolicyGRPOTrainer

    torch.set_num_threads(threads)
    device = torch.device(cfg.device)
    n = cfg.prompts_per_step * cfg.group_size
    kw = _common(cfg, cfg.micro_batch or n, warmup + steps)
    if name == "TRL GRPOTrainer":
        times = _train(GRPOTrainer, GRPOConfig, model_path, tok, texts, warmup, device, **kw)
    else:
        v = kw["offpolicy_steps"] = int(name.split("=")[1])
        # one generation takes v steps' prompts: whole refresh periods of them (prompts repeat; timing does not care)
        period = cfg.prompts_per_step * v
        texts = (texts * period)[: -(-len(texts) // period) * period]
        times = _train(OffPolicyGRPOTrainer, OffPolicyGRPOConfig, model_path, tok, texts, warmup, device, **kw)
    queue.put((times, peak_memory_gb(device), peak_reserved_gb(device)))


def subclass_step_times(cfg, model_path: str, tok, texts: list[str], warmup: int, steps: int) -> dict:
    """Stock GRPOTrainer, then OffPolicyGRPOTrainer at v = 1 and v = 4, on the same model, prompts and sizes.

    Each run is a process of its own (spawned), so that its peak memory (CUDA: allocated and reserved; CPU:
    resident, which includes Python, torch and the model's load, for both) is its own. v = 4 generates one batch
    for 4 optimizer steps on TRL's schedule (steps_per_generation = 4 * GA) and keeps no copy of the weights: its
    peak differs from v = 1's only by generating 4 steps' rows at once. Name -> median and mean seconds per step,
    steps, peak memory (GB, allocated and reserved); the mean includes the generation steps of v = 4 (choose
    `steps` a multiple of 4 to cover whole refresh periods)."""
    ctx = multiprocessing.get_context("spawn")
    results = {}
    for name in ("TRL GRPOTrainer", "ours v=1", "ours v=4"):
        queue = ctx.Queue()
        args = (queue, name, torch.get_num_threads(), cfg, model_path, tok, texts, warmup, steps)
        proc = ctx.Process(target=_subclass_run, args=args)
        proc.start()
        proc.join()
        if proc.exitcode != 0:
            raise RuntimeError(f"{name}: its process exited with status {proc.exitcode}")
        times, peak, reserved = queue.get(timeout=60)
        results[name] = {
            "median_s": statistics.median(times),
            "mean_s": statistics.fmean(times),
            "steps": len(times),
            "peak_mem_gb": peak,
            "peak_reserved_gb": reserved,
        }
        print(
            f"{name:<16} step median {results[name]['median_s']:.3f} s, mean {results[name]['mean_s']:.3f} s, "
            f"peak memory {peak:.3f} GB allocated, {reserved:.3f} GB reserved ({len(times)} steps after {warmup} "
            "warm-up)",
            flush=True,
        )
    v1, v4 = results["ours v=1"]["peak_mem_gb"], results["ours v=4"]["peak_mem_gb"]
    print(f"peak memory, v=4 against v=1: {100 * (v4 / v1 - 1):+.1f}%", flush=True)
    return results
