"""What a run reads and writes: the policy it starts from, and its output folder.

Output folder (--out):
    config.json     the resolved Config
    metrics.jsonl   one JSON object per step (README: "Metrics")
    final/          the trained policy and tokenizer, `save_pretrained` format
    summary.json    held-out accuracy before/after, steps, wall time
    curves.png      reward, held-out accuracy, KL, clip fractions, rho' and entropy over steps (with matplotlib)
    tensorboard/    the same scalars as TensorBoard event files (with --report-to tensorboard)
Everything is written to a temporary name first and renamed into place, so a crash never
leaves a half-written file that looks complete.
"""

import contextlib
import json
import os
import resource
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

from checkpoint import atomic_save_pretrained
from config import Config, ConfigError


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` via a temporary file and a rename."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def peak_memory_gb(device: torch.device) -> float:
    """Peak accelerator memory allocated (cuda) or peak resident memory of the process (cpu), since the start
    or the last `reset_peak_memory`."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    try:
        with open("/proc/self/status") as f:  # Linux: VmHWM, the resident high-water mark, in kB
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1e6
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # ru_maxrss is in KiB on Linux


def reset_peak_memory(device: torch.device) -> None:
    """Start peak_memory_gb afresh: CUDA's peak statistics, or Linux's resident high-water mark."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # "5" resets VmHWM to the current resident set (Linux >= 4.0)


def current_memory_gb(device: torch.device) -> float:
    """Memory in use now: allocated accelerator memory (cuda) or resident set size (cpu)."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 1e9
    with open("/proc/self/statm") as f:  # Linux: resident pages are the second field
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9


def gguf_file(model: str) -> Path | None:
    """The GGUF file `--model` names: the path itself, or the one `.gguf` in a folder without a config.json.

    None for anything else (tiny, a hub id, a transformers folder). A `.gguf` path that is no file, and a
    folder with several `.gguf` files and no config.json (ambiguous), are ConfigErrors.
    """
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf":
        # Checked here: a missing file would otherwise reach the hub loader as a malformed repo id.
        if not path.is_file():
            raise ConfigError(f"--model {model}: no such GGUF file")
        return path
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        names = ", ".join(f.name for f in found)
        raise ConfigError(f"--model {model}: the folder holds {len(found)} GGUF files ({names}); name one of them")
    return found[0] if found else None


def load_gguf(path) -> tuple[torch.nn.Module, object]:
    """A GGUF file as an ordinary float32 transformers model and its tokenizer (chat template included).

    transformers reads GGUF through the `gguf` package and dequantizes every tensor to float32, but the
    model it returns still carries a GGUF quantization marker that makes `save_pretrained` refuse. So the
    weights are copied into a plain model built from the same config, without the marker: it trains,
    saves and reloads like any `from_pretrained` model. A missing `gguf` package is a one-line ConfigError.
    """
    try:
        import gguf  # noqa: F401 (transformers imports it by name; checked here for a clear message)
    except ImportError:
        raise ConfigError(
            f"--model {path}: reading a GGUF file needs the gguf package (pip install gguf, or the [real] extra)"
        ) from None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path).expanduser()
    folder, name = str(path.parent), path.name
    try:
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except Exception as e:  # an unsupported architecture or a damaged file: both mean "cannot load"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"--model {path}: cannot be loaded as GGUF ({first[:200]})") from None
    config = quantized.config
    # The marker is what save_pretrained refuses; the weights themselves are already plain float32.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # strict: every tensor of the plain model must come from the file (tied heads share one tensor).
    model.load_state_dict(quantized.state_dict(), strict=True)
    model.generation_config = quantized.generation_config
    del quantized
    return model.eval(), tok


def load_policy(cfg: Config, log=print):
    """The policy to train and its tokenizer: the built-in tiny one, a GGUF file, or a transformers model.

    A model that cannot be loaded (offline, wrong path, no gguf package, ...) is a ConfigError naming it.
    """
    gguf_path = None if cfg.model == "tiny" else gguf_file(cfg.model)
    if cfg.model == "tiny":
        from tiny import load_tiny

        if cfg.task != "arithmetic":
            raise ConfigError(f"--model tiny only knows --task arithmetic; name a real model for --task {cfg.task}")
        model, tok = load_tiny(cfg.cache_dir, cfg.warmup_steps, log=log)
    elif gguf_path is not None:
        model, tok = load_gguf(gguf_path)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code)
            model = AutoModelForCausalLM.from_pretrained(
                cfg.model, trust_remote_code=cfg.trust_remote_code, dtype=torch.float32
            )
        except Exception as e:  # transformers raises many types here; all mean "cannot load"
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(f"--model {cfg.model}: cannot be loaded ({first[:200]})") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token  # safe: padding is masked explicitly, never inferred from ids
    if tok.eos_token_id is None:
        raise ConfigError(f"--model {cfg.model}: tokenizer has no EOS token")
    n_params = sum(p.numel() for p in model.parameters())
    log(f"policy: {cfg.model} ({n_params / 1e6:.2f}M parameters) on {cfg.device}, {cfg.dtype}")
    return model, tok


def fit_policy(cfg: Config, model):
    """The policy as the run trains it: dropout off, then the memory levers (README, "Fitting the model").

    1. Every dropout probability is set to 0 (nn.Dropout and attention-dropout attributes), so that pi_theta,
       pi_k, alpha and pi_ref are one deterministic network in train mode too, which checkpointing needs.
    2. --param-dtype bfloat16: the weights, and so their gradients and every pass, in bfloat16.
    3. --gradient-checkpointing: transformers' own, non-reentrant; each decoder layer's forward runs again
       in the backward instead of keeping its activations.
    4. --lora-rank r: peft's LoRA (no dropout) on --lora-targets; only the adapter requires grad, and pi_ref
       is this model with the adapter disabled (step.ref_logprobs): no second copy.
    A model that cannot take a lever is a ConfigError naming the flag.
    """
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        for name, value in list(vars(m).items()):
            if "dropout" in name and isinstance(value, float):  # e.g. attention_dropout of transformers' attention
                setattr(m, name, 0.0)
    if cfg.param_dtype == "bfloat16":
        model.to(torch.bfloat16)
    if cfg.gradient_checkpointing:
        if not getattr(model, "supports_gradient_checkpointing", False):
            raise ConfigError(f"--gradient-checkpointing: {type(model).__name__} does not support it")
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x: the new name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.lora_rank:
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError:
            raise ConfigError("--lora-rank needs the peft package (pip install peft, or the [lora] extra)") from None
        targets = cfg.lora_targets if cfg.lora_targets == "all-linear" else cfg.lora_targets.split(",")
        lora = LoraConfig(
            r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, target_modules=targets, lora_dropout=0.0, task_type="CAUSAL_LM"
        )
        try:
            model = get_peft_model(model, lora)
        except ValueError as e:
            raise ConfigError(f"--lora-targets {cfg.lora_targets}: {str(e).splitlines()[0][:200]}") from None
    return model


class RunWriter:
    """The run's output folder: config, per-step metrics, messages, final model, summary."""

    def __init__(self, cfg: Config):
        self.out = Path(cfg.out)
        self.out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.out / "config.json", json.dumps(asdict(cfg), indent=2) + "\n")
        # A fresh run starts a fresh log; a resumed one appends (after truncate_metrics).
        self._metrics = open(self.out / "metrics.jsonl", "a" if cfg.resume else "w")
        self._tb = None
        if cfg.report_to == "tensorboard":
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ConfigError("--report-to tensorboard: install the tensorboard package first") from None
            self._tb = SummaryWriter(str(self.out / "tensorboard"))

    def log(self, msg: str) -> None:
        from tqdm import tqdm

        tqdm.write(msg)

    def metrics(self, row: dict) -> None:
        self._metrics.write(json.dumps({k: round(v, 6) if isinstance(v, float) else v for k, v in row.items()}) + "\n")
        self._metrics.flush()
        if self._tb is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(f"grpo/{key}", value, row["step"])

    def truncate_metrics(self, step: int) -> None:
        """On resume: keep only the rows of steps before `step`, so no step is logged twice."""
        self._metrics.close()
        path = self.out / "metrics.jsonl"
        rows = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] < step]
        atomic_write_text(path, "".join(r + "\n" for r in rows))
        self._metrics = open(path, "a")

    def finish(self, model, tokenizer, summary: dict) -> None:
        self._metrics.close()
        if self._tb is not None:
            self._tb.close()
        atomic_save_pretrained(model, tokenizer, self.out / "final")
        atomic_write_text(self.out / "summary.json", json.dumps(summary, indent=2) + "\n")
        try:
            write_curves(self.out, summary)
        except ImportError:
            self.log("curves.png not drawn: matplotlib is not installed (pip install matplotlib)")


# One panel per quantity: (title, y label, metrics.jsonl keys drawn in it).
PANELS = [
    ("reward", "mean reward of the step's samples", ["reward"]),
    ("held-out accuracy", "greedy accuracy", ["eval_accuracy"]),
    ("KL to pi_ref", "mean k3 KL", ["kl"]),
    ("clip fractions", "fraction of valid tokens", ["clip_low", "clip_high"]),
    ("staleness", "rho' = pi_k / alpha", ["rho_prime_max", "rho_prime_p99", "rho_prime_mean"]),
    ("entropy", "nats per token", ["entropy"]),
]


def write_curves(out: Path, summary: dict) -> Path:
    """Draw metrics.jsonl as curves.png (needs matplotlib; ImportError otherwise), one panel per quantity."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5), constrained_layout=True)
    for ax, (title, ylabel, keys) in zip(axes.flat, PANELS):
        for key in keys:
            points = [(r["step"] + 1, r[key]) for r in rows if key in r]
            if key == "eval_accuracy":
                # Evaluations run after a step; the start and end values come from summary.json.
                start = [] if summary["eval_accuracy_start"] is None else [(0, summary["eval_accuracy_start"])]
                points = [*start, *points, (summary["steps"], summary["eval_accuracy_end"])]
                ax.plot(*zip(*points), marker="o", label=key)
            elif points:
                ax.plot(*zip(*points), linewidth=0.8, label=key)
        ax.set(title=title, xlabel="step", ylabel=ylabel)
        ax.grid(alpha=0.3)
        if len(keys) > 1 and ax.get_legend_handles_labels()[0]:  # no legend for a panel with no line (opmd: no clip)
            ax.legend(fontsize=8)
    start = "?" if summary["eval_accuracy_start"] is None else f"{summary['eval_accuracy_start']:.3f}"
    fig.suptitle(f"{out.name}: held-out accuracy {start} -> {summary['eval_accuracy_end']:.3f}")
    path = out / "curves.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
