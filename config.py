"""Every knob of a training run: one dataclass with its defaults, and the CLI built from it.

Each field's `help` becomes its `--flag`'s help text (`python train.py --help`, grouped by the dataclass's sections); a
field `foo_bar` is the flag `--foo-bar`. Booleans that default to True get a `--no-...` flag. `validate` checks the
values that cannot work before any model is loaded, with a one-line error naming the flag.

`--out` is the run (docs/failure-modes.md): `--resume --out X` continues the run in X whatever X's config.json
recorded as its folder, and a flag given with `--resume` must equal the run's (RESUME_MAY_CHANGE lists the
exceptions). Paths are stored absolute, so a resume from another working directory finds them.
"""

import argparse
import inspect
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from logprobs import Truncation


class ConfigError(ValueError):
    """A flag value that cannot work; train.py prints it as one line and exits with status 2."""


def arg(default, help: str, choices=None, many: str | None = None, empty_ok: bool = False):
    """A Config field; `many`: "append" (a repeatable flag, one value each) or "+" (one flag, several values).
    A text field refuses "" (and blanks) unless `empty_ok` says that "" means something (refuse_empty)."""
    return field(default=default, metadata={"help": help, "choices": choices, "many": many, "empty_ok": empty_ok})


@dataclass
class Config:
    # --- model and task -------------------------------------------------------------------
    model: str = arg(
        "tiny",
        "'tiny' (the built-in offline policy of engine/tiny.py), a hub id, a local folder, or a GGUF file (or a folder "
        "holding one; needs the gguf package), loaded as a float32 model",
    )
    task: str = arg(
        "arithmetic",
        "arithmetic (built-in, offline), gsm8k, wordproblems (built-in, offline: one-step word problems, "
        "held-out phrasings disjoint from training), or math (MATH-style answers in \\boxed{}, scored with "
        "math-verify: the [math] extra; needs --data-files)",
        ["arithmetic", "gsm8k", "wordproblems", "math"],
    )
    data_files: str | None = arg(
        None,
        "local JSONL: 'question'/'answer' rows for --task gsm8k (instead of the hub); 'problem'/'answer' rows "
        "(or 'solution', its last \\boxed{} the answer) for --task math",
    )
    eval_files: str | None = arg(
        None,
        "held-out rows: a local JSONL for --task gsm8k / math, a file of --dataset's kind for --dataset (default: "
        "the first --eval-size rows of the training data)",
    )
    dataset: str | None = arg(
        None,
        "your own data instead of --task: a hub name, a local .jsonl/.json/.csv/.parquet file, or a folder written "
        "by Dataset.save_to_disk (docs/your-own-task.md)",
    )
    dataset_config: str | None = arg(None, "the hub data set's configuration (e.g. main for openai/gsm8k)")
    split: str = arg("train", "the split of --dataset (a hub name or a folder) to train on")
    eval_split: str | None = arg(None, "a split of --dataset to hold out (default: its first --eval-size rows)")
    prompt_field: str = arg("prompt", "the --dataset column holding the prompt: text, or a list of {role, content}")
    answer_field: str = arg("answer", "the --dataset column holding the gold answer the built-in verifier reads")
    trust_remote_code: bool = arg(
        False, "allow a hub model's own Python code to run (off: only built-in architectures)"
    )
    # --- prompts and rewards (step 3) -----------------------------------------------------------
    reward: list[str] | None = arg(
        None,
        "a reward function, repeatable: math (the built-in verifier; the default), math-symbolic, "
        "path/to/file.py:function or module:function, called as TRL calls one (problems/user_rewards.py)",
        many="append",
    )
    reward_weights: list[float] | None = arg(
        None, "one weight per --reward (default: 1 each); the reward is their weighted sum", many="+"
    )
    system_prompt: str | None = arg(None, "a system message before each prompt ('' for an empty one)", empty_ok=True)
    instruction: str | None = arg(
        None,
        "text after the question, replacing the task's ({question} in it stands for the question; '' for none)",
        empty_ok=True,
    )
    chat_template: bool = arg(True, "raw prompt text (for a base model) even where the tokenizer has a chat template")
    # --- sampling (steps 1-2) -----------------------------------------------------------------
    steps: int = arg(400, "training steps")
    prompts_per_step: int = arg(16, "B, prompts per step")
    group_size: int = arg(8, "G, completions sampled per prompt")
    max_new_tokens: int | None = arg(
        None, "completion length limit (default: 8 for arithmetic, 1024 for math, 512 for the others)"
    )
    temperature: float = arg(1.0, "sampling temperature tau; log-probs are computed from logits / tau")
    top_k: int = arg(0, "sample from the k most likely tokens only, renormalised (0 = off); so are all log-probs")
    top_p: float = arg(
        1.0, "sample from the most likely tokens up to this much mass, renormalised (1 = off); so are all log-probs"
    )
    min_p: float = arg(
        0.0, "sample from the tokens with p >= min_p x the top token's, renormalised (0 = off); so are all log-probs"
    )
    offpolicy_steps: int = arg(
        1, "v: every v steps the policy samples the next v steps' batches at once (alpha = pi_theta; 1 = on-policy)"
    )
    lag: int | None = arg(
        None,
        "s: a constant lag, as asynchronous trainers run: step k trains on a batch the policy sampled at step "
        "max(0, k - s), before that step's update (0 = on-policy); s + 1 batches are held; not with --offpolicy-steps",
    )
    alpha_logp_from: str = arg(
        "recompute",
        "log alpha: recompute (a batch sampled at its own step: pi_k's own forward, alpha = pi_k; a batch drawn "
        "ahead: a no-grad forward of pi_theta when it sampled, the training forward's numerics) or sampler (the "
        "log-probs the sampling loop recorded, for every batch, the refresh step's too; no extra forward)",
        ["recompute", "sampler"],
    )
    sample_rows: int | None = arg(
        None,
        "most rows (completions) per generate call when a step draws ahead; default: on CUDA as many as "
        "fit half of what the process may use (engine.policy.auto_sample_rows), elsewhere all the rows in one call",
    )
    sampling: str = arg(
        "auto",
        "the sampling loop: plain (rollout.sample, the reference), fast (engine/decoding.py's static KV cache, its "
        "decode step a CUDA graph on a GPU, eager on a CPU), auto (fast on CUDA where the model takes it, else plain; "
        "a failed graph capture falls back to plain with one line)",
        ["auto", "plain", "fast"],
    )
    compile: bool = arg(
        False,
        "torch.compile the fast loop's sampling step and the LM head's chunks (engine/compiled.py; compile_s logged)",
    )
    # --- advantages (step 4) ----------------------------------------------------------------------
    mask_zero_std: bool = arg(
        True, "drop groups whose rewards are all equal from the loss and its normaliser (--no-mask-zero-std keeps them)"
    )
    asymre_shift: float = arg(0.0, "AsymRE of [B]: baseline mean(r) - shift, advantages not divided by std")
    red: str = arg(
        "none", "data shaping of [B]: none, drop (RED-Drop), weight (RED-Weight)", ["none", "drop", "weight"]
    )
    red_tau: float = arg(1.0, "RED-Weight's scale: A <- A * exp(A / red_tau)")
    reward_shuffle: bool = arg(
        False,
        "a null control for experiments: deal the step's N rewards to its samples in "
        "random order before the advantages (same reward rate, no signal)",
    )
    # --- objective (step 6) -----------------------------------------------------------------
    loss: str = arg(
        "grpo",
        "grpo (clipped surrogate), rec, rec-is, opmd (the REINFORCE family of [B])",
        ["grpo", "rec", "rec-is", "opmd"],
    )
    clip_eps: float = arg(0.2, "eps_low, the lower clip width")
    clip_eps_high: float | None = arg(None, "eps_high, the upper clip width (default: --clip-eps)")
    clip_center: str = arg(
        "pi_k",
        "what the clip interval is centred on: pi_k ([A]: rho = pi_theta/alpha within rho' = pi_k/alpha +- eps), "
        "alpha (PPO: rho within 1 +- eps), or decoupled (AReaL: r = pi_theta/pi_k within 1 +- eps, weighted by rho')",
        ["pi_k", "alpha", "decoupled"],
    )
    is_cap: float | None = arg(None, "TIS: cap the decoupled centre's weight rho' at this value (>= 1)")
    is_mask: float | None = arg(
        None, "MIS: tokens whose rho' lies outside [1/M, M] leave the loss and its normaliser (M >= 1)"
    )
    is_level: str = arg(
        "token",
        "what --is-cap / --is-mask act on: token (rho'_t), sequence (the product of the sequence's rho'_t: TRL's "
        "sequence_truncate / sequence_mask, verl's sequence TIS / seq_sum_k1), geometric (their geometric mean: "
        "verl's Geo-RS, seq_mean_k1)",
        ["token", "sequence", "geometric"],
    )
    m2_threshold: float | None = arg(
        None, "M2PO (AReaL's; 0.04): the step's largest (log alpha - log pi_k)^2 leave until the rest's mean is below"
    )
    opsm_delta: float | None = arg(
        None, "OPSM (TRL's off_policy_mask_threshold): no surrogate for A < 0 and a mean log alpha/pi_theta above"
    )
    m2po_clip_threshold: float | None = arg(
        None, "M2PO as its authors run it (0.04): M2 over the tokens moved the way A pushes sets a clip around alpha"
    )
    m2po_clip_floor: bool = arg(
        False, "floor --m2po-clip-threshold's interval at [0.7, 1.5] (off in the authors' runs)"
    )
    m2po_quadrant_threshold: float | None = arg(
        None, "M2PO paper's final mask (0.04): active-quadrant tokens of largest M2 lose their term, kept in Z"
    )
    dppo_delta: float | None = arg(
        None, "DPPO (prime-rl's default; 0.2): no term where pi_theta - alpha moved past delta the way A pushes"
    )
    kl_estimator: str = arg(
        "k3", "KL estimator: k1 = log(pi_theta/pi_ref), k2 = k1^2 / 2, k3 (Schulman)", ["k1", "k2", "k3"]
    )
    beta: float = arg(0.0, "KL coefficient; > 0 keeps a reference model pi_ref")
    kl_importance_weight: bool = arg(
        False,
        "weight the KL term's per-token estimate by rho = pi_theta / alpha (TRL's use_bias_correction_kl, "
        "DeepSeek-V3.2): on alpha's samples it then estimates KL(pi_theta || pi_ref), the term [A] writes",
    )
    ref_refresh: int = arg(0, "a reset of the KL reference, pi_ref <- the policy, every this many steps (0 = never)")
    agg: str = arg(
        "token-mean",
        "loss aggregation: token-mean, seq-mean (GRPO), constant (Dr. GRPO)",
        ["token-mean", "seq-mean", "constant"],
    )
    tau_reg: float = arg(0.1, "OPMD's regulariser, (tau_reg / 2) * (log pi_theta - log alpha)^2")
    # --- optimisation ---------------------------------------------------------------------
    lr: float = arg(5e-5, "AdamW learning rate (the studies in results/ compare 5e-5 and 1e-4 on the built-in task)")
    lr_scheduler: str = arg(
        "constant",
        "the learning rate over the --steps: constant, linear or cosine to 0 (TRL's)",
        ["constant", "linear", "cosine"],
    )
    warmup_ratio: float = arg(0.0, "the first ceil(ratio x --steps) steps ramp the learning rate up from 0 (TRL's)")
    weight_decay: float = arg(0.0, "AdamW weight decay")
    max_grad_norm: float = arg(1.0, "the gradient-norm clip before each optimizer step (not the ratio clip)")
    inner_steps: int = arg(1, "optimizer steps on each batch ([A]'s mu); > 1 reuses samples")
    micro_batch: int | None = arg(
        None,
        "sequences per forward/backward chunk, a divisor of N (default: on CUDA the largest divisor of N whose "
        "activations fit the memory the process may use, policy.auto_micro_batch; on a CPU the whole batch N)",
    )
    # --- fitting the model in memory (policy.fit_policy) -----------------------------------------
    gradient_checkpointing: bool = arg(
        False, "recompute each decoder layer's activations in the backward (transformers', non-reentrant)"
    )
    param_dtype: str = arg(
        "float32",
        "dtype of the trained weights and their gradients: float32, or bfloat16 (every pass in bfloat16; AdamW "
        "keeps float32 moments and rounds each update stochastically into the weights: policy.BF16AdamW)",
        ["float32", "bfloat16"],
    )
    lora_rank: int = arg(0, "LoRA rank r (0 = full fine-tuning); needs peft. pi_ref is the base, adapter off")
    lora_alpha: float = arg(32.0, "LoRA's alpha: the adapter's update is scaled by alpha / r")
    lora_targets: str = arg("all-linear", "modules LoRA adapts: all-linear (peft's), or comma-separated names")
    # --- built-in tiny policy -------------------------------------------------------------------
    warmup_steps: int = arg(
        1000,
        "supervised warm-up steps of the tiny policy: 1000 loads the shipped "
        "tiny_policy/, any other number warms up here (cached)",
    )
    cache_dir: str = arg(".cache", "where a tiny policy warmed up here is cached")
    # --- evaluation, logging, output ---------------------------------------------------------
    eval_every: int = arg(50, "held-out greedy accuracy every this many steps (0 = start and end only)")
    eval_size: int = arg(500, "held-out problems evaluated")
    eval_start: bool = arg(True, "evaluate the starting policy (--no-eval-start: skip it; its accuracy is then null)")
    eval_samples: int = arg(
        0,
        "k: besides greedy accuracy, sample k completions per held-out problem and report their mean accuracy "
        "([A]'s pass@1 over k samples) as eval_pass1 (0 = greedy only)",
    )
    eval_temperature: float | None = arg(None, "temperature of the k evaluation samples (default: --temperature)")
    eval_top_k: int | None = arg(None, "top-k of the k evaluation samples (default: --top-k)")
    eval_top_p: float | None = arg(None, "top-p of the k evaluation samples (default: --top-p)")
    eval_min_p: float | None = arg(None, "min-p of the k evaluation samples (default: --min-p)")
    seed: int = arg(0, "seed of the data order, the sampling and everything else")
    device: str = arg("auto", "auto (cuda if available, else cpu), cpu, cuda, cuda:1, ...")
    dtype: str = arg(
        "auto", "auto (bfloat16 autocast on cuda, float32 on cpu), float32, bfloat16", ["auto", "float32", "bfloat16"]
    )
    out: str | None = arg(None, "output folder (default: runs/<date-time>-<process id>, a new one)")
    progress: bool = arg(True, "the tqdm progress bar (--no-progress hides it)")
    report_to: str = arg(
        "none",
        "also log every metric to: none, tensorboard (event files in --out/tensorboard), wandb, or both "
        "(tensorboard,wandb); each an optional extra",
    )
    log_completions: int = arg(
        0, "write N sampled completions a step, and the held-out ones, to --out/completions.jsonl (0 = none)"
    )
    # --- checkpoints ------------------------------------------------------------------------
    save_every: int = arg(0, "write a checkpoint every this many steps into --out/checkpoints (0 = never)")
    keep_checkpoints: int = arg(2, "how many of the newest checkpoints to keep")
    resume: bool = arg(False, "continue the run in --out from its newest readable checkpoint, with its config.json")
    overwrite: bool = arg(False, "start a new run in an --out that holds one, deleting that run's files")

    @property
    def truncation(self) -> Truncation:
        """The sampler's kept set (logprobs.Truncation): what every log-prob of the objective is renormalised over."""
        return Truncation(self.top_k, self.top_p, self.min_p)

    @property
    def eval_truncation(self) -> Truncation:
        """The kept set of the k evaluation samples: --eval-top-k / -top-p / -min-p, each defaulting to training's."""
        pick = lambda mine, train: train if mine is None else mine  # noqa: E731
        return Truncation(
            pick(self.eval_top_k, self.top_k), pick(self.eval_top_p, self.top_p), pick(self.eval_min_p, self.min_p)
        )

    @property
    def fast(self) -> bool | None:
        """rollout.generate's `fast`: None (auto), False (plain) or True (the static cache)."""
        return {"auto": None, "plain": False, "fast": True}[self.sampling]

    @property
    def autocast_dtype(self):
        """The autocast dtype of forward passes, None for plain float32."""
        return torch.bfloat16 if self.dtype == "bfloat16" else None


def help_groups() -> dict[str, list[str]]:
    """--help's groups: the dataclass's own sections (its `# --- title ---` comments) and their fields, in order,
    so that the CLI, docs/flags.md and the source share one taxonomy."""
    groups, title = {}, None
    for line in inspect.getsource(Config).splitlines():
        if section := re.match(r"    # --- (.+?) -+$", line):
            title = section.group(1)
            groups[title] = []
        elif field_line := re.match(r"    (\w+): ", line):
            groups[title].append(field_line.group(1))
    return groups


# Flags that may differ from the run's own when it is resumed: how far to go, how it looks, and the memory knobs
# an out-of-memory error names (the micro-batches' gradients add up to the batch's; sampling rows in more calls
# changes which random numbers a row draws, not the distribution it draws from).
RESUME_MAY_CHANGE = (
    "steps",
    "progress",
    "resume",
    "micro_batch",
    "sample_rows",
    "gradient_checkpointing",
    "report_to",
    "log_completions",
)
REPORT_TO = ("tensorboard", "wandb")


def flag_name(f) -> str:
    """The command-line spelling of a Config field: --foo-bar, or --no-foo-bar for a boolean that is on."""
    return "--" + ("no-" if f.default is True else "") + f.name.replace("_", "-")


class Parser(argparse.ArgumentParser):
    """argparse's parser whose errors (a value of the wrong type, an unknown flag) are one line on stderr, as every
    other bad input's, not a usage block and a line: status 2 all the same."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (python train.py --help lists the flags)\n")


def build_parser(suppress_defaults: bool = False) -> argparse.ArgumentParser:
    """The CLI, built from Config: a group per section of the dataclass (`help_groups`), each flag's allowed values
    and default once.
    With suppress_defaults, the parsed namespace holds only the flags given (what --resume compares)."""
    p = Parser(
        usage="python train.py [flags]   (e.g. --offpolicy-steps 4; --resume --out RUN continues a run)",
        description="On- and off-policy GRPO on one device. docs/flags.md explains each group.",
    )
    for title, names in help_groups().items():
        add_flags(p.add_argument_group(title), names, suppress_defaults=suppress_defaults)
    return p


def add_flags(parser, names, defaults: dict | None = None, suppress_defaults: bool = False) -> None:
    """The named Config fields as their flags on `parser` (a parser or an argument group), with the fields' help
    and choices: train.py's CLI and the benchmark's share them. `defaults` replaces some fields' defaults."""
    by_name = {f.name: f for f in fields(Config)}
    for name in names:
        f = by_name[name]
        # Choices are checked by validate(), with a one-line error; here they are only shown.
        help_, choices = f.metadata["help"], f.metadata["choices"]
        value = (defaults or {}).get(name, f.default)
        default = argparse.SUPPRESS if suppress_defaults else value
        if f.type in (bool, "bool"):
            action = "store_false" if f.default else "store_true"
            parser.add_argument(flag_name(f), dest=f.name, action=action, default=default, help=help_)
            continue
        if value is not None:
            help_ += f" (default: {value})"
        kind = int if "int" in str(f.type) else float if "float" in str(f.type) else str
        metavar = "{" + ",".join(choices) + "}" if choices else {int: "N", float: "X", str: "TEXT"}[kind]
        many = {"append": dict(action="append"), "+": dict(nargs="+")}.get(f.metadata["many"], {})
        kw = dict(dest=f.name, type=kind, default=default, help=help_, metavar=metavar)
        parser.add_argument(flag_name(f), **kw, **many)


NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-(inf|nan)$", re.IGNORECASE)


def join_negative_values(argv: list[str]) -> list[str]:
    """Negative numbers as values: argparse takes a value that starts with '-' for a flag unless it looks like a
    plain negative number (-1, -.5), so `--lr -1e-5` or `--reward-weights 1 -1e-3` would read as an unknown flag.
    A one-value flag's is joined to it (`--lr=-1e-5`); each of a several-value flag's (`nargs="+"`, numbers only)
    gets a trailing space, which argparse reads as a value (a flag has no spaces) and int() / float() ignore."""
    out = []
    several = {flag_name(f) for f in fields(Config) if f.metadata["many"] == "+"}  # `--reward-weights -1 0.5`
    values_of = None  # the several-value flag whose values are being read
    for a in argv:
        if values_of and NUMBER.match(a):
            out.append(a + " ")
            continue
        values_of = a if a in several else values_of if not a.startswith("-") else None
        if out and out[-1].startswith("--") and "=" not in out[-1] and out[-1] not in several and NUMBER.match(a):
            out[-1] = f"{out[-1]}={a}"
        else:
            out.append(a)
    return out


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, set[str]]:
    """The parsed flags, and the names of the fields given on the command line."""
    argv = join_negative_values(sys.argv[1:] if argv is None else list(argv))
    given = set(vars(build_parser(suppress_defaults=True).parse_args(argv)))
    return build_parser().parse_args(argv), given


def config_record(saved, path: Path) -> dict:
    """The fields of a run's config.json (`saved`, as json.loads read it) that Config knows, each of the type its
    field has: else a ConfigError naming the file and the field (a resume must not meet `[1, 2]` as an
    AttributeError, nor `"group_size": "eight"` as a TypeError in validate). `config_from_args` calls it."""
    if not isinstance(saved, dict):
        raise ConfigError(f"--resume: {path} is not a run's config (a JSON {type(saved).__name__}, not an object)")
    kept = {}
    for f in fields(Config):
        if f.name not in saved:
            continue
        value, kinds = saved[f.name], str(f.type)
        ok = (value is None and "None" in kinds) or (
            (isinstance(value, bool) and "bool" in kinds)
            or (isinstance(value, int) and not isinstance(value, bool) and ("int" in kinds or "float" in kinds))
            or (isinstance(value, float) and "float" in kinds)
            or (isinstance(value, str) and kinds.split(" ")[0] in ("<class", "str") and "str" in kinds.split("[")[0])
            or (isinstance(value, list) and kinds.startswith("list[") and all(_of(v, kinds) for v in value))
        )
        if not ok:
            want = kinds.replace("<class '", "").replace("'>", "")
            raise ConfigError(
                f"--resume: {path}: field {f.name!r} is {json.dumps(value)[:60]}, not a {want}; the run's config.json "
                "is damaged: restore it, or start a new run (another --out, or --overwrite)"
            )
        kept[f.name] = float(value) if "float" in kinds and "int" not in kinds and type(value) is int else value
    return kept


def _of(value, kinds: str) -> bool:
    inner = kinds[len("list[") :].split("]")[0]
    if inner == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, str) if inner == "str" else True


def config_from_args(args: argparse.Namespace, given: set[str] | None = None) -> Config:
    """The run's Config; with --resume, the one saved in --out/config.json, with --out as given (the folder is
    the run, wherever it has been copied or moved) and only the flags of RESUME_MAY_CHANGE allowed to differ."""
    refuse_empty(args)
    if not args.resume:
        return resolve(Config(**vars(args)))
    if not args.out:
        raise ConfigError("--resume needs --out, the folder of the run to continue")
    if args.overwrite:
        raise ConfigError("--resume continues the run in --out and --overwrite deletes it: give one of them")
    path = Path(args.out) / "config.json"
    if not path.is_file():
        raise ConfigError(f"--resume: {no_run_to_resume(Path(args.out))}")
    try:
        saved = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"--resume: {path} cannot be read ({e})") from None
    saved = config_record(saved, path)  # the known fields, each of its type, or one line naming the field
    known = {f.name for f in fields(Config)}
    cfg = Config(**{k: v for k, v in saved.items() if k in known})
    changed = [
        f"{flag_name(f)} {getattr(args, f.name)} (the run has {getattr(cfg, f.name)})"
        for f in fields(Config)
        if f.name in (given or set()) - {"out", *RESUME_MAY_CHANGE}
        and normalised(f.name, getattr(args, f.name)) != normalised(f.name, getattr(cfg, f.name))
    ]
    if changed:
        raise ConfigError(f"--resume continues the run as it was configured; these differ: {'; '.join(changed)}")
    cfg.out, cfg.resume, cfg.progress = args.out, True, args.progress
    for name in set(RESUME_MAY_CHANGE) & (given or set()):  # --steps extends the run, or stops it earlier
        setattr(cfg, name, getattr(args, name))
    return resolve(cfg)


def no_run_to_resume(out: Path) -> str:
    """Why --resume finds no config.json in `out`, and what to do instead (never "--resume" again)."""
    if not out.exists():
        return f"{out} does not exist: there is no run to continue; the command without --resume starts one there"
    if (out / "manifest.json").is_file():  # a run's folder (bookkeeping/manifest.py) that lost its config.json
        return (
            f"{out / 'config.json'} is missing, and the run in {out} cannot be continued without it: restore it, "
            "or start a new run there with --overwrite (it deletes that run's files only)"
        )
    return f"{out} holds no run to continue (no config.json): the command without --resume starts a new run there"


def absolute(path: str | None) -> str | None:
    """A path as an absolute one, so that the run's config.json still names it from another working directory."""
    return None if path is None else str(Path(path).expanduser().absolute())


def absolute_spec(spec: str) -> str:
    """A --reward SPEC whose file path is made absolute (problems/user_rewards.py's rule for a file: `.py` or a `/`
    before the last `:`); a built-in name or module:function stays as it is."""
    where, colon, name = spec.rpartition(":")
    if colon and (where.endswith(".py") or "/" in where):
        return f"{absolute(where)}:{name}"
    return spec


def local_or_hub(name: str | None) -> str | None:
    """--dataset (and --model): a local path made absolute, a hub name as it is."""
    return absolute(name) if name is not None and Path(name).expanduser().exists() else name


def looks_like_path(name: str, suffixes: tuple[str, ...] = ()) -> bool:
    """Whether a --dataset / --model name can only be a local path, never a hub id (NAME or ORG/NAME): it starts with
    ./ ../ / or ~, holds more than one '/' or a backslash, or ends in one of `suffixes` (a data file's). Such a name
    that does not exist is a missing file or folder, said as such, not sent to the hub to fail there as a bad repo
    id."""
    return (
        name.startswith(("./", "../", "/", "~"))
        or name in (".", "..")
        or name.count("/") > 1
        or "\\" in name
        or Path(name).suffix.lower() in suffixes
    )


def refuse_empty(values) -> None:
    """Every text flag refuses "" and blanks, naming the flag: an unset shell variable (`--dataset $DATA`) would
    otherwise be read as the working directory (Path("") is "."), a hub name "" or an empty column name. The
    exceptions are the fields marked empty_ok, where "" means something (--system-prompt "": an empty system
    message; --instruction "": none). `values`: a Config or the parsed flags (same names)."""
    for f in fields(Config):
        if "str" not in str(f.type) or f.metadata["empty_ok"]:
            continue
        value = getattr(values, f.name, None)
        if any(isinstance(v, str) and not v.strip() for v in (value if isinstance(value, list) else [value])):
            raise ConfigError(
                f"{flag_name(f)}: empty (an unset shell variable?); give a value, or leave the flag out for its default"
            )


def normalised(name: str, value):
    """A flag's value as resolve() stores it, so that --resume compares like with like."""
    if name in ("data_files", "eval_files", "cache_dir", "out"):
        return absolute(value)
    if name == "reward":
        return [absolute_spec(spec) for spec in value] if value else ["math"]
    if name in ("dataset", "model") and value != "tiny":
        return local_or_hub(value)
    return value


_OUTS_GIVEN: set[str] = set()  # the default --out folders this process has handed out


def default_out() -> str:
    """runs/<date-time>-<process id>, a new folder: two runs started in the same second (each its own process, or
    two Configs of one process) never share one, which would make the second refuse to start. The process id tells
    processes apart; a numbered suffix tells apart this process's own names and a folder already on disk."""
    name = base = time.strftime("runs/%Y%m%d-%H%M%S") + f"-{os.getpid()}"
    n = 1
    while name in _OUTS_GIVEN or Path(name).exists():
        n += 1
        name = f"{base}-{n}"
    _OUTS_GIVEN.add(name)
    return name


def resolve(cfg: Config) -> Config:
    """Fill in the defaults that depend on other fields or on the machine; make the paths absolute."""
    refuse_empty(cfg)  # before "" becomes the working directory below
    if cfg.max_new_tokens is None:
        cfg.max_new_tokens = 512 if cfg.dataset else {"arithmetic": 8, "math": 1024}.get(cfg.task, 512)
    if cfg.device == "auto":
        cfg.device = "cuda" if torch.cuda.is_available() else "cpu"
    if cfg.dtype == "auto":
        cfg.dtype = "bfloat16" if cfg.device.startswith("cuda") else "float32"
    if cfg.out is None:
        cfg.out = default_out()
    cfg.out, cfg.cache_dir = absolute(cfg.out), absolute(cfg.cache_dir)
    cfg.data_files, cfg.eval_files = absolute(cfg.data_files), absolute(cfg.eval_files)
    cfg.reward = [absolute_spec(spec) for spec in cfg.reward] if cfg.reward else ["math"]
    cfg.dataset = local_or_hub(cfg.dataset)
    if cfg.model != "tiny" and Path(cfg.model).expanduser().exists():  # a local folder or file, not a hub id
        cfg.model = absolute(cfg.model)
    return cfg


def refuse_units_that_cannot_act(cfg: Config) -> None:
    """A correction that cannot act in the run is an error, not a no-op (docs/flags.md). On-policy (v = 1, no
    --lag or --lag 0) alpha = pi_k at every step: rho' = 1, so TIS, MIS and AReaL's M2PO rule never act. With one
    inner step as well, pi_theta = alpha where the gradient is taken, so neither do the units that compare
    pi_theta with alpha (OPSM, M2PO's other forms, DPPO). The studies' shared on-policy baseline passes none."""
    if cfg.offpolicy_steps != 1 or cfg.lag:
        return
    by_rho_prime = {"--is-cap": cfg.is_cap, "--is-mask": cfg.is_mask, "--m2-threshold": cfg.m2_threshold}
    for flag, value in by_rho_prime.items():
        if value is not None:
            raise ConfigError(
                f"{flag} {value} cannot act on-policy (alpha = pi_k at every step, rho' = 1): "
                "add --offpolicy-steps v > 1 or --lag s > 0, or drop it"
            )
    by_pi_theta = {
        "--opsm-delta": cfg.opsm_delta,
        "--m2po-clip-threshold": cfg.m2po_clip_threshold,
        "--m2po-quadrant-threshold": cfg.m2po_quadrant_threshold,
        "--dppo-delta": cfg.dppo_delta,
    }
    for flag, value in by_pi_theta.items():
        if value is not None and cfg.inner_steps == 1:
            raise ConfigError(
                f"{flag} {value} cannot act on-policy with one inner step (pi_theta = alpha where the gradient is "
                "taken): add --offpolicy-steps v > 1, --lag s > 0 or --inner-steps > 1, or drop it"
            )


def validate(cfg: Config) -> None:
    """Reject values that cannot work, naming the flag; runs before any model is loaded."""
    refuse_empty(cfg)
    for f in fields(Config):  # nan and inf pass every comparison below the wrong way, or crash a step later
        value = getattr(cfg, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{flag_name(f)} {value}: must be a finite number")
    checks = [
        (cfg.steps >= 1, "--steps must be >= 1"),
        (0 <= cfg.seed < 2**32, "--seed must be in [0, 2**32) (numpy's seeds)"),
        (cfg.weight_decay >= 0, "--weight-decay must be >= 0"),
        (cfg.prompts_per_step >= 1, "--prompts-per-step must be >= 1"),
        (cfg.group_size >= 2, "--group-size must be >= 2 (a group of one has no baseline)"),
        (cfg.offpolicy_steps >= 1, "--offpolicy-steps must be >= 1"),
        (cfg.lag is None or cfg.lag >= 0, "--lag must be >= 0 (0 = on-policy)"),
        (
            cfg.lag is None or cfg.offpolicy_steps == 1,
            f"--lag {cfg.lag} and --offpolicy-steps {cfg.offpolicy_steps} are two schedules of one queue; give one",
        ),
        (cfg.inner_steps >= 1, "--inner-steps must be >= 1"),
        (cfg.max_new_tokens >= 1, "--max-new-tokens must be >= 1"),
        (cfg.temperature > 0, "--temperature must be > 0 (training samples; evaluation is greedy)"),
        (cfg.top_k >= 0, "--top-k must be >= 0 (0 = off)"),
        (0 < cfg.top_p <= 1, "--top-p must be in (0, 1] (1 = off)"),
        (0 <= cfg.min_p < 1, "--min-p must be in [0, 1) (0 = off)"),
        (cfg.eval_samples >= 0, "--eval-samples must be >= 0 (0 = greedy accuracy only)"),
        (cfg.eval_temperature is None or cfg.eval_temperature >= 0, "--eval-temperature must be >= 0 (0 = greedy)"),
        (cfg.eval_top_k is None or cfg.eval_top_k >= 0, "--eval-top-k must be >= 0 (0 = off)"),
        (cfg.eval_top_p is None or 0 < cfg.eval_top_p <= 1, "--eval-top-p must be in (0, 1] (1 = off)"),
        (cfg.eval_min_p is None or 0 <= cfg.eval_min_p < 1, "--eval-min-p must be in [0, 1) (0 = off)"),
        (cfg.lr >= 0, "--lr must be >= 0"),
        (cfg.beta >= 0, "--beta must be >= 0"),
        (cfg.clip_eps >= 0, "--clip-eps must be >= 0"),
        (cfg.clip_eps_high is None or cfg.clip_eps_high >= 0, "--clip-eps-high must be >= 0"),
        (cfg.max_grad_norm > 0, "--max-grad-norm must be > 0"),
        (cfg.eval_size >= 1, "--eval-size must be >= 1"),
        (cfg.eval_every >= 0, "--eval-every must be >= 0"),
        (cfg.ref_refresh >= 0, "--ref-refresh must be >= 0"),
        (cfg.tau_reg >= 0, "--tau-reg must be >= 0"),
        (cfg.red_tau > 0, "--red-tau must be > 0"),
        (cfg.warmup_steps >= 0, "--warmup-steps must be >= 0"),
        (cfg.save_every >= 0, "--save-every must be >= 0"),
        (cfg.keep_checkpoints >= 1, "--keep-checkpoints must be >= 1"),
        (cfg.sample_rows is None or cfg.sample_rows >= 1, "--sample-rows must be >= 1"),
        (cfg.lora_rank >= 0, "--lora-rank must be >= 0 (0 = full fine-tuning)"),
        (cfg.lora_alpha > 0, "--lora-alpha must be > 0"),
        (0 <= cfg.warmup_ratio < 1, "--warmup-ratio must be in [0, 1)"),
        (cfg.log_completions >= 0, "--log-completions must be >= 0 (0 = none)"),
        (
            not (cfg.lora_rank and cfg.ref_refresh),
            "--ref-refresh needs full fine-tuning (with LoRA pi_ref is the base)",
        ),
    ]
    for f in fields(Config):
        value, choices = getattr(cfg, f.name), f.metadata["choices"]
        if choices and value not in choices:
            raise ConfigError(
                f"--{f.name.replace('_', '-')}: unknown value {value!r}; choose from {', '.join(choices)}"
            )
    for ok, msg in checks:
        if not ok:
            raise ConfigError(msg)
    n = cfg.prompts_per_step * cfg.group_size
    if cfg.micro_batch is not None and (cfg.micro_batch < 1 or n % cfg.micro_batch != 0):
        raise ConfigError(
            f"--micro-batch {cfg.micro_batch} must divide the batch N = prompts-per-step * group-size = {n}"
        )
    if cfg.is_cap is not None and (cfg.loss != "grpo" or cfg.clip_center != "decoupled" or cfg.is_cap < 1):
        raise ConfigError("--is-cap needs --loss grpo --clip-center decoupled and a value >= 1")
    if cfg.is_mask is not None and (cfg.loss != "grpo" or cfg.is_mask < 1):
        raise ConfigError("--is-mask needs --loss grpo and a value >= 1")
    if cfg.m2_threshold is not None and (cfg.loss != "grpo" or not cfg.m2_threshold > 0):
        raise ConfigError(f"--m2-threshold {cfg.m2_threshold}: M2PO needs --loss grpo and a threshold > 0")
    if cfg.opsm_delta is not None and (cfg.loss != "grpo" or not cfg.opsm_delta >= 0):
        raise ConfigError(f"--opsm-delta {cfg.opsm_delta}: OPSM needs --loss grpo and a delta >= 0")
    if cfg.m2po_clip_threshold is not None and (cfg.loss != "grpo" or not cfg.m2po_clip_threshold > 0):
        raise ConfigError(f"--m2po-clip-threshold {cfg.m2po_clip_threshold}: needs --loss grpo and a budget > 0")
    if cfg.m2po_quadrant_threshold is not None and (cfg.loss != "grpo" or not cfg.m2po_quadrant_threshold > 0):
        raise ConfigError(
            f"--m2po-quadrant-threshold {cfg.m2po_quadrant_threshold}: needs --loss grpo and a threshold > 0"
        )
    if cfg.dppo_delta is not None and (cfg.loss != "grpo" or not cfg.dppo_delta >= 0):
        raise ConfigError(f"--dppo-delta {cfg.dppo_delta}: DPPO needs --loss grpo and a delta >= 0")
    trust = [
        f
        for f in ("m2_threshold", "m2po_clip_threshold", "m2po_quadrant_threshold", "dppo_delta")
        if getattr(cfg, f) is not None
    ]
    if len(trust) > 1:
        raise ConfigError(
            f"--{trust[0].replace('_', '-')} and --{trust[1].replace('_', '-')}: one M2PO form or DPPO at a time"
        )
    own_trust = next((f for f in trust if f != "m2_threshold"), None)  # a unit with its own clip (corrections.py)
    if cfg.is_level != "token" and cfg.is_cap is None and cfg.is_mask is None:
        raise ConfigError(f"--is-level {cfg.is_level} sets what --is-cap / --is-mask act on; neither is set")
    refuse_units_that_cannot_act(cfg)
    if cfg.ref_refresh and cfg.beta == 0:
        raise ConfigError("--ref-refresh needs --beta > 0 (without KL there is no reference model)")
    # A flag that cannot act in this run is an error, not a silent no-op.
    changed = {f.name for f in fields(Config) if getattr(cfg, f.name) != f.default}
    cannot_act = [
        ("clip_center", cfg.loss != "grpo", f"--loss {cfg.loss} has no clip interval to centre (only --loss grpo)"),
        ("clip_eps", cfg.loss == "opmd", "--loss opmd has no clip (its proximal term is --tau-reg)"),
        ("clip_eps_high", cfg.loss == "opmd", "--loss opmd has no clip (its proximal term is --tau-reg)"),
        ("beta", cfg.loss != "grpo", f"--loss {cfg.loss} has no KL term (only --loss grpo)"),
        ("kl_estimator", cfg.beta == 0 or cfg.loss != "grpo", "the KL estimator needs --loss grpo and --beta > 0"),
        ("kl_importance_weight", cfg.beta == 0 or cfg.loss != "grpo", "it weights the KL term (--beta > 0)"),
        ("tau_reg", cfg.loss != "opmd", "--tau-reg is OPMD's regulariser (--loss opmd)"),
        *[
            (name, own_trust is not None, f"--{str(own_trust).replace('_', '-')} sets its own trust region")
            for name in ("clip_center", "clip_eps", "clip_eps_high")
        ],
        ("m2po_clip_floor", cfg.m2po_clip_threshold is None, "it floors the clip of --m2po-clip-threshold"),
        ("red_tau", cfg.red != "weight", "--red-tau is RED-Weight's scale (--red weight)"),
        ("warmup_steps", cfg.model != "tiny", "--warmup-steps warms up the built-in policy (--model tiny)"),
        ("lora_alpha", cfg.lora_rank == 0, "--lora-alpha scales a LoRA adapter (--lora-rank > 0)"),
        ("lora_targets", cfg.lora_rank == 0, "--lora-targets names a LoRA adapter's modules (--lora-rank > 0)"),
        *[
            (name, cfg.dataset is None, f"--{name.replace('_', '-')} reads a data set of your own (--dataset)")
            for name in ("dataset_config", "split", "eval_split", "prompt_field", "answer_field")
        ],
        *[
            (name, cfg.eval_samples == 0, f"--{name.replace('_', '-')} sets the k samples of --eval-samples k > 0")
            for name in ("eval_temperature", "eval_top_k", "eval_top_p", "eval_min_p")
        ],
    ]
    for name, idle, why in cannot_act:
        if name in changed and idle:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(cfg, name)}: cannot act here: {why}")
    for flag, path in (("--out", cfg.out), ("--cache-dir", cfg.cache_dir)):  # before anything writes there
        if path is None:
            continue
        try:
            os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            pass  # made when needed (a file in the way is refused where the folder is made)
        except OSError as e:  # a name too long, a folder without search permission, ...
            raise ConfigError(f"{flag} {path}: cannot be used: {e.strerror or e}") from None
    if Path(cfg.cache_dir).exists() and not Path(cfg.cache_dir).is_dir():
        raise ConfigError(f"--cache-dir {cfg.cache_dir}: is a file, not a folder")
    if not re.fullmatch(r"cpu|cuda(:\d+)?|mps", cfg.device):
        raise ConfigError(f"--device {cfg.device}: unknown device; use auto, cpu, cuda or cuda:N")
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {cfg.device}: CUDA is not available on this machine")
    if cfg.device.startswith("cuda:") and int(cfg.device[5:]) >= torch.cuda.device_count():
        raise ConfigError(f"--device {cfg.device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if cfg.device == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("--device mps: this torch build or machine has no MPS (Apple GPU); use cpu")
    validate_data_and_rewards(cfg, changed)
    if cfg.task not in ("gsm8k", "math") and (cfg.data_files or (cfg.eval_files and not cfg.dataset)):
        raise ConfigError(
            f"--data-files / --eval-files are read by --task gsm8k and math; --task {cfg.task} is built in"
        )
    if cfg.task == "math":
        if not cfg.data_files:
            raise ConfigError("--task math reads a local JSONL of 'problem'/'answer' rows: give it with --data-files")
        try:
            import math_verify  # noqa: F401  (its presence only; problems/math_verifier.py imports it to score)
        except ImportError:
            raise ConfigError(
                "--task math scores answers with math-verify, an optional extra: pip install -e '.[math]'"
            ) from None


def validate_data_and_rewards(cfg: Config, changed: set[str]) -> None:
    """--dataset and its flags, --reward and its weights, --report-to (docs/your-own-task.md)."""
    if cfg.dataset is not None:
        if "task" in changed or cfg.data_files:
            raise ConfigError("--dataset replaces --task and --data-files: give the one or the others")
        local = Path(cfg.dataset).expanduser().is_file()
        if local and ("split" in changed or cfg.eval_split):
            given = " and ".join(
                f"--{n.replace('_', '-')} {getattr(cfg, n)}" for n in ("split", "eval_split") if n in changed
            )
            raise ConfigError(
                f"{given}: cannot act here: a split is a hub data set's or a folder's; {cfg.dataset} is one file "
                "(held-out rows: --eval-files, or its first --eval-size rows)"
            )
        if local and cfg.dataset_config is not None:
            raise ConfigError(
                f"--dataset-config {cfg.dataset_config}: cannot act here: {cfg.dataset} is one file (a configuration "
                "is a hub data set's)"
            )
        if cfg.eval_split and cfg.eval_files:
            raise ConfigError("--eval-split and --eval-files both name the held-out rows: give one")
    if cfg.reward_weights is not None:
        if len(cfg.reward_weights) != len(cfg.reward):
            raise ConfigError(
                f"--reward-weights: {len(cfg.reward_weights)} weights for {len(cfg.reward)} rewards "
                f"({', '.join(cfg.reward)}); give one each"
            )
        if not all(math.isfinite(w) for w in cfg.reward_weights):
            raise ConfigError(f"--reward-weights {cfg.reward_weights}: each must be a finite number")
    targets = [t for t in cfg.report_to.split(",") if t] if cfg.report_to != "none" else []
    unknown = [t for t in targets if t not in REPORT_TO]
    if unknown or not (targets or cfg.report_to == "none"):
        raise ConfigError(
            f"--report-to: unknown value {cfg.report_to!r}; choose none, tensorboard, wandb or tensorboard,wandb"
        )
    if "math-symbolic" in cfg.reward:
        try:
            import math_verify  # noqa: F401  (its presence only; reward.py imports it to score)
        except ImportError:
            raise ConfigError(
                "--reward math-symbolic scores answers with math-verify, an optional extra: pip install -e '.[math]'"
            ) from None
