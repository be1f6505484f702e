"""The built-in offline policy: a ~1M-parameter transformers model that knows some arithmetic.

No weights can be downloaded here, so the default run builds its own policy:
  1. a character-level tokenizer (the `tokenizers` library, wrapped as a transformers
     `PreTrainedTokenizerFast`), 17 symbols: `<pad>`, `<eos>`, `<unk>`, digits and `+-*=`;
  2. a small Qwen2 causal LM from a config (4 layers, hidden 128, ~1.0M parameters) with
     random weights;
  3. a supervised warm-up on the arithmetic training split (answer tokens and EOS only), which
     takes it to roughly 25-40% held-out greedy accuracy: good enough that GRPO has groups with
     mixed rewards to learn from, bad enough that there is much left to learn.

The warm-up's result is shipped in `tiny_policy/` (4 MB, `save_pretrained` format) and the default run
loads it from there. Why ship it: 1000 supervised steps at a constant learning rate are chaotic in the
float rounding, and torch picks AVX2, AVX-512 or plain kernels per machine, so the same recipe left the
policy anywhere from 32% to 85% held-out accuracy on different CPUs. With the weights shipped every
machine starts from the same policy. `python -m engine.tiny --rebuild` runs the warm-up again and rewrites
`tiny_policy/`; any other `--warmup-steps` warms up from scratch on this machine and caches the result
under `--cache-dir`, keyed by what determines it. Either way it is an ordinary transformers model:
everything downstream (rollout, log-probs, training, `from_pretrained` of the final checkpoint) is the
real path.
"""

import argparse
import random
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from bookkeeping.checkpoint import atomic_save_pretrained
from config import ConfigError
from problems.tasks import Problem, arithmetic_problems

SPECIALS = ["<pad>", "<eos>", "<unk>"]
CHARS = "0123456789+-*="
VERSION = 2  # bump when the model, tokenizer or warm-up recipe changes: invalidates caches
SHIPPED = Path(__file__).resolve().parents[1] / "tiny_policy"  # the warm-up's result: `python -m engine.tiny --rebuild`
SHIPPED_WARMUP = 1000  # the warm-up steps that made SHIPPED: `--warmup-steps 1000` (the default) loads it


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer: every character is one token."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per char
    tok.decoder = decoders.Fuse()  # decode without spaces between characters
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>", padding_side="left"
    )


def build_model(tokenizer, seed: int = 0) -> Qwen2ForCausalLM:
    """A random-weight Qwen2 causal LM sized for the arithmetic task (~1.0M parameters)."""
    cfg = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg)


def sft_batch(tokenizer, problems: list[Problem]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded `question answer <eos>` sequences and labels that score only `answer <eos>`."""
    seqs, labels = [], []
    for p in problems:
        q = tokenizer(p.question, add_special_tokens=False).input_ids
        a = tokenizer(p.gold, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        seqs.append(q + a)
        labels.append([-100] * len(q) + a)  # -100: ignored by the model's own loss
    width = max(map(len, seqs))
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(s)) + s for s in seqs])  # (B, L)
    lab = torch.tensor([[-100] * (width - len(s)) + s for s in labels])  # (B, L)
    mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(s) for s in seqs])[:, None]).long()  # (B, L)
    return ids, mask, lab


def warm_up(model, tokenizer, steps: int, batch_size: int = 128, lr: float = 1e-3, seed: int = 0) -> list[float]:
    """Supervised steps on the arithmetic training split; returns the loss of each step.

    The schedule is a 50-step linear warm-up, then a constant learning rate: the policy is left where
    supervised training is still noisy (no annealing). Measured when the recipe was chosen: annealing it
    (cosine to 10%) reached 37% instead of about 25%, and then GRPO gained only about 4 points in 300 steps;
    a doubt that part of GRPO's gain is any movement of an un-annealed policy. The null control with
    shuffled rewards answers it: accuracy falls instead (results/README.md, "The gain is the reward's").
    """
    train, _ = arithmetic_problems()
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50))  # linear warm-up, then flat
    model.train()
    losses = []
    for _ in range(steps):
        ids, mask, labels = sft_batch(tokenizer, rng.sample(train, batch_size))
        pos = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, L) positions skip left padding
        loss = model(input_ids=ids, attention_mask=mask, position_ids=pos, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
    model.eval()
    return losses


def cache_path(cache_dir: str, warmup_steps: int) -> Path:
    return Path(cache_dir) / f"tiny-v{VERSION}-warmup{warmup_steps}"


def load_tiny(cache_dir: str, warmup_steps: int, log=print):
    """The warmed-up tiny policy and its tokenizer: shipped, cached, or built here (then cached).

    `warmup_steps == SHIPPED_WARMUP` loads the shipped weights (the same on every machine); any other
    number runs that many warm-up steps on this machine once and caches the result under `cache_dir`.
    """
    if warmup_steps == SHIPPED_WARMUP and (SHIPPED / "model.safetensors").is_file():
        log(f"tiny policy: the shipped weights in {SHIPPED.name}/ ({SHIPPED_WARMUP} warm-up steps)")
        fix = f"restore it (git checkout -- {SHIPPED.name}/), or rebuild it: python -m engine.tiny --rebuild"
        return read_saved(SHIPPED, fix)
    path = cache_path(cache_dir, warmup_steps)
    if (path / "config.json").is_file():
        log(f"tiny policy: loaded from cache {path}")
        return read_saved(path, f"delete the folder {path}, and the next run builds it again")
    log(f"tiny policy: building, {warmup_steps} supervised warm-up steps (cached at {path} afterwards)")
    tokenizer = build_tokenizer()
    model = build_model(tokenizer)
    warm_up(model, tokenizer, warmup_steps)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_save_pretrained(model, tokenizer, path)  # an interrupted build leaves no half-written model
    return model, tokenizer


LFS_POINTER = b"version https://git-lfs.github.com/spec/"


def read_saved(path: Path, fix: str):
    """The tiny policy saved in `path`, and its tokenizer. Weights that cannot be read (a file cut short, a git-lfs
    pointer left by a clone without LFS) are one ConfigError naming the file and what to do, not safetensors'
    traceback."""
    weights = path / "model.safetensors"
    with open(weights, "rb") as f:
        head = f.read(len(LFS_POINTER))
    if head == LFS_POINTER:
        raise ConfigError(
            f"--model tiny: {weights} is a git-lfs pointer, not the weights (a clone without git-lfs): run "
            "`git lfs install && git lfs pull` in the checkout"
        )
    try:
        return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    except Exception as e:  # safetensors' SafetensorError, a JSON error, ...: the folder is damaged
        text = str(e).strip()
        reason = text.splitlines()[0][:160] if text else type(e).__name__
        raise ConfigError(f"--model tiny: {path} cannot be read ({type(e).__name__}: {reason}); {fix}") from None


def rebuild(out: Path = SHIPPED, steps: int = SHIPPED_WARMUP, log=print) -> None:
    """Run the warm-up from the fixed seed and (re)write `out` atomically: what made the shipped folder."""
    tok = build_tokenizer()
    policy = build_model(tok)
    losses = warm_up(policy, tok, steps)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    atomic_save_pretrained(policy, tok, Path(out))
    log(f"tiny policy: {steps} warm-up steps, final loss {losses[-1]:.4f}, written to {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description="Rebuild the shipped tiny policy: the supervised warm-up, then "
        "save_pretrained into tiny_policy/ (the result depends on this CPU's kernels)."
    )
    parser.add_argument("--rebuild", action="store_true", help="run the warm-up and rewrite the shipped folder")
    parser.add_argument("--out", default=str(SHIPPED), help="where to write it (default: the shipped folder)")
    if not parser.parse_args().rebuild:
        parser.error("nothing to do without --rebuild")
    rebuild(Path(parser.parse_args().out))
