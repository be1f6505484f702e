"""[A]'s off-policy GRPO inside TRL's GRPOTrainer: a frozen sampler refreshed every v steps, this project's loss.

    python -m integrations.trl_grpo --offpolicy-steps 4 --output_dir runs/trl   # built-in tiny policy, arithmetic, CPU
    torchrun --nproc_per_node 2 -m integrations.trl_grpo --offpolicy-steps 2 --max_steps 6 --output_dir runs/trl2
    accelerate launch --num_processes 8 -m integrations.trl_grpo --model Qwen/Qwen2.5-0.5B-Instruct --task gsm8k ...
    python -m benchmarks.bench --trl-subclass --prompts 8 --group 8    # cost of the stale copy vs stock TRL

A GRPO step k is one generation and `num_iterations` (i) optimizer steps, k = global_step // i:
  1. if k % v == 0, alpha <- pi_theta (v = offpolicy_steps); k, and under DDP the weights, are equal on every rank,
     so every rank holds the same alpha. v = 1 keeps no copy: the live policy samples, as in stock TRL;
  2. TRL's own generation runs on alpha (with vLLM, the engine holds alpha);
  3. TRL's reward functions, then `advantage.group_advantages` (population std, eps inside the square root); with
     mask_zero_std, equal-reward groups leave the loss and its normaliser (folded into `loss_mask`);
  4. log alpha from logits / tau: a no-grad pass of the copy on stale steps (vLLM: the engine's own log-probs);
     log pi_k: TRL's old_per_token_logps when it computes one, else the first forward's logp.detach() (dev. 1);
  5. `objective.policy_loss` (its docstring states [A]'s surrogate; clip_center="behaviour" is PPO / stock TRL), or
     [B]'s rec / rec-is / opmd, through TRL's optimizer, accumulation and DDP, with the whole step's normaliser Z.
     Z is the whole step's normaliser over every micro-batch and rank; each of the P ranks divides its sum by Z / P,
     so DDP's gradient average is exactly sum / Z, as on one device.
Legend (TRL field -> symbol): offpolicy_steps v, epsilon eps_low, epsilon_high eps_high, beta, temperature tau,
num_iterations i, num_generations G; loss_type -> Z: dapo -> token-mean (valid tokens), grpo -> seq-mean (valid
sequences), dr_grpo -> constant (N * max_completion_length): stock TRL's own normalisers when nothing is masked;
bnpo (per micro-batch), cispo, sapo, luspo, vespo have no counterpart and are a one-line error.

Deviations from [A]: 1. log pi_k costs no pass: until the step's optimizer step pi_theta is pi_k (as in train.py);
2. held-out accuracy is greedy (HF generate). vLLM: alpha reaches the engine at refresh steps and after a resume
only; TRL's importance-sampling correction is not applied on top, as its ratio exp(old - sampling) is rho' itself
(pi_k over the engine's alpha, mismatch included), which [A]'s surrogate already weights by (unscored tokens: rho' = 1).
Departures from stock GRPOTrainer: README, "At scale: TRL". Not supported (one-line error): sequence-level IS,
off-policy masks, entropy terms, batch reward scaling, normalize_then_sum, vision-language models, MoE aux loss;
with v > 1 also FSDP, DeepSpeed ZeRO-3, PEFT, rollout_func, cast_lm_head_to_fp32.
"""

import copy
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate.utils import gather_object
from datasets import Dataset
from transformers import AutoTokenizer, HfArgumentParser
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import add_fused_lm_head

import objective
import reinforce
import tiny
from advantage import group_advantages
from reward import math_reward
from run_io import atomic_write_text, gguf_file, load_gguf
from tasks import TaskError, encode_prompts, format_prompt, load_task

# TRL loss_type -> this project's aggregation (objective.py): the ones whose math is the same.
LOSS_TYPES = {"dapo": "token-mean", "grpo": "seq-mean", "dr_grpo": "constant"}
SAMPLER_FILE = "sampler.pt"  # alpha's state dict, inside each checkpoint-<step>/ folder


@dataclass
class OffPolicyGRPOConfig(GRPOConfig):
    """GRPOConfig plus [A]'s off-policy knobs; TRL's own fields keep their meaning (module docstring)."""

    offpolicy_steps: int = field(default=1, metadata={"help": "v: alpha <- pi_theta every v steps (1 = on-policy)"})
    clip_center: str = field(default="current", metadata={"help": "current (rho', [A]) or behaviour (1, stock TRL)"})
    mask_zero_std: bool = field(default=True, metadata={"help": "drop equal-reward groups from loss and normaliser"})
    policy_loss: str = field(default="grpo", metadata={"help": "grpo (clipped surrogate), rec, rec-is, opmd ([B])"})
    tau_reg: float = field(default=0.1, metadata={"help": "opmd's regulariser (tau_reg / 2) (logp - log alpha)^2"})
    # TRL's default True multiplies kl_t by pi_theta/pi_old; the KL here is objective.kl_penalty's plain k3.
    use_bias_correction_kl: bool = field(default=False, metadata={"help": "not supported here: must stay False"})

    def __post_init__(self):
        super().__post_init__()
        # TRL options this loss does not implement, and the value each must keep
        fixed = dict(
            off_policy_mask_threshold=None,
            delta=None,
            top_entropy_quantile=1.0,
            entropy_coef=0.0,
            use_adaptive_entropy=False,
            use_bias_correction_kl=False,
            importance_sampling_level="token",
            multi_objective_aggregation="sum_then_normalize",
        )
        unsupported = [k for k, v in fixed.items() if getattr(self, k) != v]
        checks = [
            (self.offpolicy_steps >= 1, "offpolicy_steps must be >= 1"),
            (self.clip_center in ("current", "behaviour"), "clip_center must be 'current' or 'behaviour'"),
            (self.policy_loss in ("grpo", "rec", "rec-is", "opmd"), "policy_loss must be grpo, rec, rec-is or opmd"),
            (self.loss_type in LOSS_TYPES, f"loss_type {self.loss_type!r} has no counterpart: use dapo, grpo, dr_grpo"),
            (
                self.steps_per_generation == self.gradient_accumulation_steps,
                (
                    "steps_per_generation must equal "
                    "gradient_accumulation_steps (one generation per step; reuse a batch with num_iterations)"
                ),
            ),
            (self.beta == 0 or self.policy_loss == "grpo", "beta > 0 needs policy_loss='grpo'"),
            (self.tau_reg >= 0, "tau_reg must be >= 0"),
            (self.scale_rewards in ("group", "none"), "scale_rewards must be 'group' or 'none'"),
            (self.offpolicy_steps == 1 or not self.cast_lm_head_to_fp32, "cast_lm_head_to_fp32 needs v = 1"),
            (not unsupported, f"not supported, keep the default: {', '.join(unsupported)}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(f"OffPolicyGRPOConfig: {msg}")


def checksum(weights) -> str:
    """sha256 of a module's (or a state dict's) tensors, in order: equal iff the weights are bitwise equal."""
    h = hashlib.sha256()
    for t in (weights.state_dict() if isinstance(weights, torch.nn.Module) else weights).values():
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


class OffPolicyGRPOTrainer(GRPOTrainer):
    """GRPOTrainer with a frozen sampler alpha refreshed every v steps and this project's loss (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.aux_loss_enabled or self._is_vlm:
            raise ValueError("OffPolicyGRPOTrainer: MoE aux losses and vision-language models are not supported")
        self.sampler = None  # alpha (None: the live policy samples, v = 1)
        if self.args.offpolicy_steps > 1:
            if self.is_fsdp_enabled or self._dist.is_zero3 or self.rollout_func or hasattr(self.model, "peft_config"):
                raise ValueError(
                    "OffPolicyGRPOTrainer: offpolicy_steps > 1 needs full weights on every rank "
                    "(DDP, ZeRO-1/2), no PEFT, no rollout_func"
                )
            self.sampler = copy.deepcopy(self.accelerator.unwrap_model(self.model)).requires_grad_(False).eval()
            # TRL patched `forward` with a closure over the policy: the copy gets a patch of its own.
            self.sampler.__dict__.pop("forward", None)
            add_fused_lm_head(self.sampler, temperature=self.temperature)
        self._use_sampler = False  # True while a training generation runs on alpha
        self._vllm_needs_alpha = False  # the engine must receive alpha before its next generation
        self._rewards = None  # (N, F) the step's rewards per function, all ranks

    def _refresh_sampler(self) -> bool:
        """Step 1: alpha <- pi_theta when k % v == 0 (training only); returns whether this step refreshes."""
        k = self.state.global_step // self.num_iterations
        refresh = self.model.training and k % self.args.offpolicy_steps == 0
        if refresh and self.sampler is not None:
            self.sampler.load_state_dict(self.accelerator.unwrap_model(self.model).state_dict())
            self._vllm_needs_alpha = True
        self._use_sampler = self.model.training and self.sampler is not None
        return refresh

    def _generate_single_turn(self, *args, **kwargs):
        """Step 2 on alpha: TRL's generation with the copy in place of the policy, or vLLM fed alpha only."""
        if not self._use_sampler:
            # an evaluation generation may push the live policy to the engine: alpha must go back there after
            self._vllm_needs_alpha |= self.use_vllm and self.sampler is not None
            return super()._generate_single_turn(*args, **kwargs)
        if not self.use_vllm:
            wrapped, self.model_wrapped = self.model_wrapped, self.sampler
            try:
                return super()._generate_single_turn(*args, **kwargs)
            finally:
                self.model_wrapped = wrapped
        if self._vllm_needs_alpha:
            engine_model, self.vllm_generation.model = self.vllm_generation.model, self.sampler
            self.vllm_generation.sync_weights()
            self.vllm_generation.model, self._vllm_needs_alpha = engine_model, False
        # TRL pushes the live policy whenever global_step moved; marked done, the engine keeps alpha.
        self._last_loaded_step = self.state.global_step
        return super()._generate_single_turn(*args, **kwargs)

    def _calculate_rewards(self, *args, **kwargs):
        self._rewards = super()._calculate_rewards(*args, **kwargs)  # (N, F) gathered over ranks
        return self._rewards

    def _generate_and_score_completions(self, inputs):
        """Steps 1-4: TRL's batch, with this project's advantages, loss mask, normaliser and alpha's log-probs."""
        refresh = self._refresh_sampler()
        # alpha != pi_k on a stale step: its log-probs need a pass of their own
        stale = self._use_sampler and not refresh
        out = super()._generate_and_score_completions(inputs)
        self._use_sampler = False
        a, device, n = self.args, self.accelerator.device, out["completion_ids"].shape[0]
        group = self.num_generations if self.model.training else self.num_generations_eval
        rewards = (self._rewards * self.reward_weights.to(device)).nansum(dim=1)  # (N,) all ranks
        # opmd takes group-mean advantages ([B]); scale_rewards="none" is Dr. GRPO's unscaled advantage
        scale_std = a.scale_rewards == "group" and a.policy_loss != "opmd"
        adv, valid = group_advantages(rewards, group, mask_zero_std=a.mask_zero_std, scale_std=scale_std)  # (N,)
        rows = slice(self.accelerator.process_index * n, (self.accelerator.process_index + 1) * n)
        mask = out["completion_mask"] * out.get("tool_mask", 1) * valid[rows].unsqueeze(1)  # (n, T)
        out["advantages"], out["loss_mask"] = adv[rows], mask
        # Z of the whole step over all ranks: valid tokens, sequences with one, or n * max_completion_length
        # fmt: off
        local = {"token-mean": mask.sum(), "seq-mean": (mask.sum(1) > 0).sum(),
                 "constant": torch.tensor(n * self.max_completion_length)}[LOSS_TYPES[a.loss_type]]
        # fmt: on
        out["loss_total"] = self.accelerator.gather(local.float().to(device).reshape(1)).sum().clamp(min=1.0)
        if self.use_vllm:
            # the engine sampled: its log-probs are alpha's (NaN where it could not score)
            out["behaviour_logps"] = out.get("sampling_per_token_logps")
        elif stale:
            ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)  # (n, P+T)
            attn = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)  # (n, P+T)
            with torch.no_grad():
                out["behaviour_logps"] = self._get_per_token_logps_and_entropies(
                    self.sampler, ids, attn, out["completion_ids"].shape[1], batch_size=a.per_device_train_batch_size
                )[0]  # (n, T) log alpha, from logits / tau
        r = rewards.view(-1, group)  # (B, G)
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["offpolicy/zero_std_frac"].append((r.amax(1) == r.amin(1)).float().mean().item())
        self._metrics[mode]["offpolicy/refreshed"].append(float(refresh))
        return out

    def _compute_loss(self, model, inputs):
        """Step 5 on one micro-batch: objective.policy_loss (or rec / opmd) with the step's normaliser Z / P."""
        a, mode = self.args, "train" if self.model.training else "eval"
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)  # (n, P+T)
        attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)  # (n, P+T)
        logp, entropy, _ = self._get_per_token_logps_and_entropies(
            model, ids, attn, inputs["completion_ids"].shape[1], compute_entropy=True
        )  # (n, T) each
        # log pi_k: TRL's old_per_token_logps when it computed one (num_iterations > 1), else this forward's
        current = inputs.get("old_per_token_logps")
        current = logp.detach() if current is None else current  # (n, T)
        # log alpha; None when alpha = pi_k (refresh step, or v = 1)
        behaviour = inputs.get("behaviour_logps")
        behaviour = current if behaviour is None else torch.where(torch.isnan(behaviour), current, behaviour)
        mask, adv = inputs["loss_mask"], inputs["advantages"]  # (n, T), (n,)
        z = inputs["loss_total"].item() / self.accelerator.num_processes  # Z / P
        common = dict(agg=LOSS_TYPES[a.loss_type], max_new_tokens=self.max_completion_length, total=z)
        eps = dict(clip_eps=self.epsilon_low, clip_eps_high=self.epsilon_high)
        logps = dict(logp=logp, behaviour_logp=behaviour, advantages=adv, completion_mask=mask)
        if a.policy_loss == "grpo":
            ref = inputs.get("ref_per_token_logps")
            loss, st = objective.policy_loss(
                **logps, current_logp=current, ref_logp=ref, clip_center=a.clip_center, beta=self.beta, **eps, **common
            )
        elif a.policy_loss in ("rec", "rec-is"):
            loss, st = reinforce.rec_loss(**logps, importance_weight=a.policy_loss == "rec-is", **eps, **common)
        else:
            loss, st = reinforce.opmd_loss(**logps, tau_reg=a.tau_reg, **common)
        # Token-weighted means over all ranks in one collective: [5 sums, tokens, max rho'] per rank.
        m = mask.float()  # (n, T)
        rho = torch.exp(current - behaviour) * m  # (n, T) rho', 0 off the mask
        tok = m.sum()
        sums = [rho.sum(), tok * st.get("clip_low", 0.0), tok * st.get("clip_high", 0.0), tok * st.get("kl", 0.0)]
        row = torch.stack([*sums, (entropy.detach() * m).sum(), tok, rho.max()])
        g = self.accelerator.gather(row.unsqueeze(0))  # (P, 7)
        means, seen = (g[:, :5].sum(0) / g[:, 5].sum().clamp(min=1.0)).tolist(), g[:, 5].sum().item() > 0
        keys = ["offpolicy/rho_prime_mean", "clip_ratio/low_mean", "clip_ratio/high_mean", "kl", "entropy"]
        for key, v in zip(keys + ["offpolicy/rho_prime_max"], means + [g[:, 6].max().item()]):
            self._metrics[mode][key].append(v if seen else float("nan"))
        return loss

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self.sampler is not None and self.args.should_save:
            folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            torch.save(self.sampler.state_dict(), os.path.join(self._get_output_dir(trial), folder, SAMPLER_FILE))

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if self.sampler is None or checkpoint is None:
            return
        path = os.path.join(checkpoint, SAMPLER_FILE)
        if not os.path.isfile(path):
            raise ValueError(f"resume: {path} not found (saved with offpolicy_steps=1?); alpha cannot be restored")
        self.sampler.load_state_dict(torch.load(path, map_location=self.accelerator.device, weights_only=True))
        self._vllm_needs_alpha = True  # a fresh engine holds the initial weights, not alpha


@dataclass
class ScriptArguments:
    """train.py's flags of the same names; the tiny policy's warm-up is renamed (TRL owns warmup_steps)."""

    model: str | None = field(
        default=None, metadata={"help": "hub id, folder or GGUF file (default: the built-in tiny policy)"}
    )
    task: str = field(default="arithmetic", metadata={"help": "arithmetic (built-in, offline) or gsm8k"})
    data_files: str | None = field(default=None, metadata={"help": "local JSONL (question/answer) for --task gsm8k"})
    eval_files: str | None = field(default=None, metadata={"help": "local JSONL of held-out rows"})
    eval_size: int = field(default=500, metadata={"help": "held-out problems, greedy accuracy before and after"})
    cache_dir: str = field(default=".cache", metadata={"help": "where a non-shipped tiny policy is cached"})
    tiny_warmup_steps: int = field(default=1000, metadata={"help": "supervised warm-up steps of the tiny policy"})


# Defaults of the built-in run (tiny policy, CPU; 16 prompts x 8 completions a step); flags override them.
# fmt: off
BUILTIN = dict(learning_rate=5e-5, max_steps=200, per_device_train_batch_size=128, num_generations=8,
               max_completion_length=8, lr_scheduler_type="constant", gradient_checkpointing=False, bf16=False,
               use_cpu=True, logging_steps=25, save_strategy="no", report_to="none", seed=0)
# fmt: on


class _Parser(HfArgumentParser):
    def error(self, message):
        # one line, instead of argparse's usage block of TRL's ~200 flags
        raise ValueError(message)


def parse_args(argv: list[str]) -> tuple[ScriptArguments, OffPolicyGRPOConfig]:
    """ScriptArguments first (they pick the defaults), then every flag, TRL's included. ValueError on bad input."""
    first, _ = _Parser(ScriptArguments).parse_args_into_dataclasses(argv, return_remaining_strings=True)
    parser = _Parser((ScriptArguments, OffPolicyGRPOConfig))
    parser.set_defaults(**(BUILTIN if first.model is None else {}))
    return parser.parse_args_into_dataclasses(argv)


@torch.no_grad()
def evaluate(model, tokenizer, problems, max_new_tokens: int, accelerator, batch_size: int = 250) -> float:
    """Held-out greedy accuracy, the problems sharded over ranks: the fraction the verifier credits (model left in
    eval mode; Trainer.train puts it back in training mode)."""
    model.eval()
    mine, correct = problems[accelerator.process_index :: accelerator.num_processes], 0.0
    for s in range(0, len(mine), batch_size):
        chunk = mine[s : s + batch_size]
        ids, mask = encode_prompts(tokenizer, chunk, accelerator.device)  # (b, P) left-padded
        special = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, **special
        )
        texts = tokenizer.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True)
        correct += sum(math_reward(t, p.gold) for t, p in zip(texts, chunk))
    total = accelerator.reduce(torch.tensor([correct, len(mine)], dtype=torch.float64, device=accelerator.device))
    return (total[0] / total[1].clamp(min=1.0)).item()


def math_reward_func(completions, gold, **kwargs) -> list[float]:
    """TRL reward function: reward.math_reward of each completion against its row's gold answer."""
    return [math_reward(c, g) for c, g in zip(completions, gold)]


def build(script: ScriptArguments, cfg: OffPolicyGRPOConfig):
    """The trainer on the task's training prompts, the tokenizer and the held-out problems."""
    train_set, heldout = load_task(script.task, script.data_files, script.eval_files, script.eval_size)
    if script.model is None:
        # rank 0 loads (or builds and caches) the tiny policy first, the others load it after
        with cfg.main_process_first():
            model, tokenizer = tiny.load_tiny(script.cache_dir, script.tiny_warmup_steps, log=lambda m: None)
    elif (gguf := gguf_file(script.model)) is not None:
        model, tokenizer = load_gguf(gguf)  # a float32 model built here (GRPOTrainer takes a model or a path)
        tokenizer.padding_side = "left"
    else:
        model, tokenizer = script.model, AutoTokenizer.from_pretrained(script.model, padding_side="left")
    data = Dataset.from_dict(
        {"prompt": [format_prompt(tokenizer, p.question) for p in train_set], "gold": [p.gold for p in train_set]}
    )
    trainer = OffPolicyGRPOTrainer(
        model=model, reward_funcs=math_reward_func, args=cfg, train_dataset=data, processing_class=tokenizer
    )
    return trainer, tokenizer, heldout


def run(trainer: OffPolicyGRPOTrainer, tokenizer, heldout, t0: float) -> dict:
    """Evaluate, train, evaluate; writes summary.json and final/ (save_pretrained) under output_dir."""
    cfg, acc = trainer.args, trainer.accelerator
    acc_start = evaluate(trainer.model, tokenizer, heldout, cfg.max_completion_length, acc)
    trainer.train(resume_from_checkpoint=cfg.resume_from_checkpoint)
    policy = acc.unwrap_model(trainer.model)
    acc_end = evaluate(policy, tokenizer, heldout, cfg.max_completion_length, acc)
    trainer.save_model(os.path.join(cfg.output_dir, "final"))
    # [policy, alpha] checksums of every rank: DDP must leave them equal
    sums = gather_object([[checksum(policy)] + ([checksum(trainer.sampler)] if trainer.sampler is not None else [])])
    # fmt: off
    summary = {"eval_accuracy_start": acc_start, "eval_accuracy_end": acc_end, "steps": trainer.state.global_step,
               "world_size": acc.num_processes, "wall_s": time.time() - t0, "offpolicy_steps": cfg.offpolicy_steps,
               "eval_size": len(heldout), "rank_checksums": sums}
    # fmt: on
    if acc.is_main_process:
        atomic_write_text(Path(cfg.output_dir) / "summary.json", json.dumps(summary, indent=1) + "\n")
        print(
            f"held-out greedy accuracy: {acc_start:.3f} -> {acc_end:.3f} ({acc_end - acc_start:+.3f}); "
            f"{summary['steps']} steps on {acc.num_processes} process(es), {summary['wall_s']:.0f} s",
            flush=True,
        )
    return summary


def main(argv: list[str] | None = None) -> int:
    t0 = time.time()
    # Bad input (flags, config, task files, model path) is one line and exit 2, before any training.
    try:
        script, cfg = parse_args(sys.argv[1:] if argv is None else argv)
        built = build(script, cfg)
    except (ValueError, TaskError, OSError) as e:
        print(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2
    run(*built, t0)
    if torch.distributed.is_initialized():  # every rank leaves together: an early exit aborts gloo's threads
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
