"""[A]'s off-policy GRPO inside TRL's GRPOTrainer, on TRL's own generation schedule: no copy of the weights.

    python -m integrations.trl_grpo --offpolicy-steps 4 --output_dir runs/trl   # built-in tiny policy, arithmetic, CPU
    torchrun --nproc_per_node 2 -m integrations.trl_grpo --offpolicy-steps 4 --max_steps 8 --output_dir runs/trl2
    accelerate launch --num_processes 8 -m integrations.trl_grpo --model Qwen/Qwen2.5-0.5B-Instruct --task gsm8k ...
    python -m benchmarks.bench --trl-subclass --prompts-per-step 8 --group-size 8  # v = 4, v = 1 and stock TRL

v (offpolicy_steps) is TRL's generation period: steps_per_generation = v * gradient_accumulation_steps (GA), so TRL
generates one batch for v optimizer steps (generation_batch_size = per_device_train_batch_size * processes * v * GA
completions), from the policy as it is then: alpha. A user who sets steps_per_generation (or generation_batch_size)
instead gets v = steps_per_generation / GA; it must be a multiple of GA, and agree with offpolicy_steps if both are
set. Neither set: v = 1, stock TRL's one generation per optimizer step. A GRPO step is one optimizer step:
  1. every v x i steps (i = num_iterations) TRL generates the next v batches at once (vLLM gets the weights then),
     shuffles them and deals them out, GA slices a step; under DDP every rank does so at the same step;
  2. TRL's reward functions, then `advantage.group_advantages` over the whole generation (population std, the
     guard inside the root); with mask_zero_std, equal-reward groups leave the loss and its normaliser (in `loss_mask`);
  3. log alpha = TRL's `old_per_token_logps`: with v > 1 (or vLLM's correction on) TRL computes it at generation time
     from logits / tau; with v = mu = 1 alpha = pi_k and it is None. log pi_k = the step's own forward, detached (until
     the step's optimizer step pi_theta is pi_k); with num_iterations (i) > 1 TRL trains on each slice i times, and
     pi_k is the policy of the slice's first pass (its log-probs kept in the slice for the later passes);
  4. `objective.policy_loss` (its docstring states [A]'s surrogate; clip_center="alpha" is PPO / stock TRL), or
     [B]'s rec / rec-is / opmd, through TRL's optimizer, accumulation and DDP. Z, the normaliser of each optimizer
     step over its GA slices and all P ranks, is counted when the generation is dealt out; each rank divides its sum
     by Z / P, so DDP's gradient average is exactly sum / Z, as on one device.
Legend (TRL field -> symbol): offpolicy_steps v, epsilon eps_low, epsilon_high eps_high, beta, temperature tau,
num_iterations i, num_generations G; loss_type -> Z: dapo -> token-mean (loss tokens), grpo -> seq-mean (sequences
with one), dr_grpo -> constant (N * max_completion_length): stock TRL's own normalisers when nothing is masked;
bnpo (per micro-batch), cispo, sapo, luspo, vespo have no counterpart and are a one-line error.

vLLM: TRL's `vllm_importance_sampling_correction` keeps its default (on). The engine samples from alpha_e (alpha's
weights, the engine's numerics), TRL's weight w_t = exp(old - sampling) = alpha / alpha_e (truncated at
vllm_importance_sampling_clip_max, or masked: TRL's mode) and multiplies the per-token surrogate, as stock TRL does:
here A_t = w_t * A, so o_t becomes w_t * o_t (w >= 0), the KL term unweighted. rho = pi_theta / alpha and
rho' = pi_k / alpha stay trainer-side: at r = 1 the weight is w * rho' = pi_k / alpha_e, the engine's mismatch
(w, TRL's truncation) times rho' ([A]'s clip centre). Correction off: w = 1, alpha the trainer's.

Checkpoints: each rank saves TRL's buffered generation (the unfinished refresh period's slices, pi_k's log-probs
included) and its micro-step counter in checkpoint-<step>/generation_buffer_rank<r>.pt; a resume restores both, so a
run resumed inside a refresh period trains on the very batches, and samples the very completions, of the
uninterrupted run. A checkpoint without them (stock TRL's, another world size) resumes as stock TRL does: a fresh
generation at the resume step, from the checkpoint's policy, starting a new refresh period there.

Staleness masks (policy_loss='grpo'): TRL's own off_policy_mask_threshold is OPSM's delta, computed as stock TRL
computes it (corrections.opsm_keep_mask: by sampling_per_token_logps where vLLM recorded them, else log alpha; the
masked sequences keep their KL term and their place in Z); m2_threshold is M2PO (corrections.m2po_keep_mask) over
the whole optimizer step, its GA slices on every rank: at the step's first slice a no-grad pass gives log pi_k of
all of them (`_m2po_prepass`, as train.mask_prepass), and Z counts the kept tokens.

m2po_clip_threshold (the M2PO authors' released algorithm), m2po_quadrant_threshold (the paper's final mask) and
dppo_delta (DPPO's mask) are corrections.M2POClip / M2POQuadrant / DPPO, the innermost unit of `_loss`, each on
the slice's tokens (a loss call: the authors' and ms-swift's granularity) with its own clip.

Deviations from [A]: 1. log pi_k costs no pass (as in train.py; with m2_threshold on a stale step, one no-grad
pass); 2. held-out accuracy is greedy (HF generate).
Departures from stock GRPOTrainer: docs/trl.md, "The loss, against stock `GRPOTrainer`". Not supported (one-line
error): sequence-level IS, TRL's `delta` (two-sided clip), entropy terms, batch reward scaling, normalize_then_sum,
vision-language models, steps_per_generation not a multiple of GA. Nothing else is refused: PEFT, FSDP, ZeRO-3,
rollout_func, MoE models (the router's loss added as stock TRL adds it) run TRL's own code (docs/trl.md, "What was
run here, and what was not"). TRL's use_bias_correction_kl (default True) is train.py's --kl-importance-weight:
kl_t times rho_t = pi_theta / alpha (TRL's coef_1), as stock TRL.
"""

import hashlib
import json
import os
import sys
import time
import warnings
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import torch
from accelerate.utils import gather_object
from datasets import Dataset
from transformers import AutoTokenizer, HfArgumentParser
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOConfig, GRPOTrainer

import objective
from advantage import group_advantages
from bookkeeping.run_io import atomic_write_text
from engine import tiny
from engine.policy import gguf_file, load_gguf
from problems.tasks import TaskError, encode_prompts, format_prompt, load_task
from reward import math_reward
from variants import corrections, reinforce

# TRL loss_type -> this project's aggregation (objective.py): the ones whose math is the same.
LOSS_TYPES = {"dapo": "token-mean", "grpo": "seq-mean", "dr_grpo": "constant"}
BUFFER_FILE = "generation_buffer_rank{}.pt"  # TRL's buffered generation, one per rank, inside checkpoint-<step>/


@dataclass
class OffPolicyGRPOConfig(GRPOConfig):
    """GRPOConfig plus [A]'s off-policy knobs; TRL's own fields keep their meaning (module docstring)."""

    offpolicy_steps: int | None = field(
        default=None,
        metadata={"help": "v: one generation every v steps (steps_per_generation = v * GA; unset: from it, else 1)"},
    )
    clip_center: str = field(
        default="pi_k", metadata={"help": "pi_k ([A]: around rho') or alpha (around 1, stock TRL)"}
    )
    mask_zero_std: bool = field(default=True, metadata={"help": "drop equal-reward groups from loss and normaliser"})
    policy_loss: str = field(default="grpo", metadata={"help": "grpo (clipped surrogate), rec, rec-is, opmd ([B])"})
    tau_reg: float = field(default=0.1, metadata={"help": "opmd's regulariser (tau_reg / 2) (logp - log alpha)^2"})
    m2_threshold: float | None = field(
        default=None,
        metadata={
            "help": "M2PO (AReaL's m2_threshold, 0.04 there): the optimizer step's tokens of largest "
            "(log alpha - log pi_k)^2 leave the loss and its normaliser until the rest's mean is below this"
        },
    )

    m2po_clip_threshold: float | None = field(
        default=None,
        metadata={
            "help": "M2PO as its authors run it (0.04): M2 over the tokens moved the way A pushes sets a clip "
            "around alpha (corrections.M2POClip)"
        },
    )
    m2po_clip_floor: bool = field(
        default=False, metadata={"help": "floor m2po_clip_threshold's interval at [0.7, 1.5] (off in their runs)"}
    )
    m2po_quadrant_threshold: float | None = field(
        default=None,
        metadata={"help": "the M2PO paper's final mask on the active quadrants (corrections.M2POQuadrant)"},
    )
    dppo_delta: float | None = field(
        default=None, metadata={"help": "DPPO's probability-difference mask, prime-rl's default (corrections.DPPO)"}
    )

    def __post_init__(self):
        v, ga = self.offpolicy_steps, self.gradient_accumulation_steps
        if v is not None and v < 1:
            raise ValueError("OffPolicyGRPOConfig: offpolicy_steps must be >= 1")
        if v is not None and self.steps_per_generation is None and self.generation_batch_size is None:
            self.steps_per_generation = v * ga  # TRL derives generation_batch_size from it
        super().__post_init__()
        per_step, rest = divmod(self.steps_per_generation, ga)
        # TRL options this loss does not implement, and the value each must keep
        fixed = dict(
            delta=None,
            top_entropy_quantile=1.0,
            entropy_coef=0.0,
            use_adaptive_entropy=False,
            importance_sampling_level="token",
            multi_objective_aggregation="sum_then_normalize",
        )
        unsupported = [k for k, val in fixed.items() if getattr(self, k) != val]
        checks = [
            (rest == 0, f"steps_per_generation ({self.steps_per_generation}) must be a multiple of GA ({ga})"),
            (v in (None, per_step), f"offpolicy_steps={v} but steps_per_generation / GA = {per_step}"),
            (self.clip_center in ("pi_k", "alpha"), "clip_center must be 'pi_k' or 'alpha'"),
            (self.policy_loss in ("grpo", "rec", "rec-is", "opmd"), "policy_loss must be grpo, rec, rec-is or opmd"),
            (self.loss_type in LOSS_TYPES, f"loss_type {self.loss_type!r} has no counterpart: use dapo, grpo, dr_grpo"),
            (self.beta == 0 or self.policy_loss == "grpo", "beta > 0 needs policy_loss='grpo'"),
            (self.tau_reg >= 0, "tau_reg must be >= 0"),
            (self.m2_threshold is None or self.m2_threshold > 0, "m2_threshold (M2PO) must be > 0"),
            (
                self.off_policy_mask_threshold is None or self.off_policy_mask_threshold >= 0,
                "off_policy_mask_threshold (OPSM's delta) must be >= 0",
            ),
            (
                self.policy_loss == "grpo" or (self.m2_threshold is None and self.off_policy_mask_threshold is None),
                "m2_threshold and off_policy_mask_threshold act on policy_loss='grpo' only",
            ),
            *self._trust_region_checks(),
            (self.scale_rewards in ("group", "none"), "scale_rewards must be 'group' or 'none'"),
            (not unsupported, f"not supported, keep the default: {', '.join(unsupported)}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(f"OffPolicyGRPOConfig: {msg}")
        self.offpolicy_steps = per_step

    def _trust_region_checks(self) -> list[tuple[bool, str]]:
        """The checks of m2po_clip_threshold, m2po_quadrant_threshold, dppo_delta (issue 57) and their company."""
        forms = ("m2_threshold", "m2po_clip_threshold", "m2po_quadrant_threshold", "dppo_delta")
        on = [f for f in forms if getattr(self, f) is not None]
        own = [f for f in on if f != "m2_threshold"]  # the units with their own clip
        return [
            (self.m2po_clip_threshold is None or self.m2po_clip_threshold > 0, "m2po_clip_threshold must be > 0"),
            (self.m2po_quadrant_threshold is None or self.m2po_quadrant_threshold > 0, "m2po_quadrant_threshold > 0"),
            (self.dppo_delta is None or self.dppo_delta >= 0, "dppo_delta (DPPO) must be >= 0"),
            (len(on) <= 1, f"{' and '.join(on)}: one M2PO form or DPPO at a time"),
            (not own or self.policy_loss == "grpo", f"{', '.join(own)} act on policy_loss='grpo' only"),
            (not own or self.clip_center == "pi_k", f"{', '.join(own)} set their own clip: leave clip_center"),
            (not self.m2po_clip_floor or self.m2po_clip_threshold is not None, "m2po_clip_floor needs its threshold"),
        ]


def checksum(weights) -> str:
    """sha256 of a module's (or a state dict's) tensors, in order: equal iff the weights are bitwise equal."""
    h = hashlib.sha256()
    for t in (weights.state_dict() if isinstance(weights, torch.nn.Module) else weights).values():
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


class OffPolicyGRPOTrainer(GRPOTrainer):
    """GRPOTrainer with one generation every v steps (alpha) and this project's loss (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self._is_vlm:
            raise ValueError("OffPolicyGRPOTrainer: vision-language models are not supported")
        self._rewards = None  # (N, F) the generation's rewards per function, all ranks

    def _calculate_rewards(self, *args, **kwargs):
        self._rewards = super()._calculate_rewards(*args, **kwargs)  # (N, F) gathered over ranks
        return self._rewards

    def _generate_and_score_completions(self, inputs):
        """Steps 1-3: TRL's generation, log alpha and rewards, with this project's advantages and loss mask."""
        out = super()._generate_and_score_completions(inputs)
        a, device, n = self.args, self.accelerator.device, out["completion_ids"].shape[0]
        group = self.num_generations if self.model.training else self.num_generations_eval
        rewards = (self._rewards * self.reward_weights.to(device)).nansum(dim=1)  # (N,) all ranks
        # opmd takes group-mean advantages ([B]); scale_rewards="none" is Dr. GRPO's unscaled advantage
        scale_std = a.scale_rewards == "group" and a.policy_loss != "opmd"
        adv, valid = group_advantages(rewards, group, mask_zero_std=a.mask_zero_std, scale_std=scale_std)  # (N,)
        rows = slice(self.accelerator.process_index * n, (self.accelerator.process_index + 1) * n)
        out["advantages"] = adv[rows]  # (n,)
        out["loss_mask"] = out["completion_mask"] * out.get("tool_mask", 1) * valid[rows].unsqueeze(1)  # (n, T)
        r, mode = rewards.view(-1, group), "train" if self.model.training else "eval"  # (B, G)
        self._metrics[mode]["offpolicy/zero_std_frac"].append((r.amax(1) == r.amin(1)).float().mean().item())
        return out

    def _prepare_inputs(self, generation_batch):
        """TRL's schedule (generate every v * i steps, deal out the slices); each new slice gets its step's Z."""
        before = self._buffered_inputs
        inputs = super()._prepare_inputs(generation_batch)
        if not self.model.training:
            self._set_step_normalisers([inputs], group=1)  # evaluation: one batch, no accumulation
        elif self._buffered_inputs is not before:  # TRL has just generated
            self._set_step_normalisers(self._buffered_inputs, group=self.args.gradient_accumulation_steps)
        ga, index = self.args.gradient_accumulation_steps, self._step % self.args.steps_per_generation
        if self.model.training and self.args.m2_threshold is not None and index % ga == 0 and "m2po_keep" not in inputs:
            self._m2po_prepass(self._buffered_inputs[index : index + ga])  # the optimizer step's first slice
        return inputs

    @torch.no_grad()
    def _m2po_prepass(self, slices: list[dict]) -> None:
        """M2PO over the whole optimizer step, as train.mask_prepass: its GA slices on every rank. Each slice gets
        log pi_k (`pi_k_logps`, a no-grad forward now, before the step's optimizer step; its later passes reuse it),
        the tokens M2PO keeps (`m2po_keep`, corrections.m2po_keep_mask over the step's loss tokens, all ranks'
        in rank order, so every rank computes the same cut) and the step's Z over the kept tokens. Without
        old_per_token_logps alpha = pi_k: every M2 is 0 and nothing leaves (no pass)."""
        if any(s.get("old_per_token_logps") is None for s in slices):
            return
        for s in slices:
            ids = torch.cat([s["prompt_ids"], s["completion_ids"]], dim=1)  # (n, P+T)
            attn = torch.cat([s["prompt_mask"], s["completion_mask"]], dim=1)  # (n, P+T)
            s["pi_k_logps"] = self._get_per_token_logps_and_entropies(
                self.model, ids, attn, s["completion_ids"].shape[1]
            )[0]  # (n, T)
        # log alpha - log pi_k on this rank's loss tokens, in slice order, then every rank's, in rank order
        mine = torch.cat([(s["old_per_token_logps"] - s["pi_k_logps"])[s["loss_mask"] > 0] for s in slices])
        counts = self.accelerator.gather(torch.tensor([mine.numel()], device=mine.device))  # (P,)
        padded = self.accelerator.gather(self.accelerator.pad_across_processes(mine, dim=0))
        padded = padded.view(counts.numel(), -1)  # (P, the longest)
        everyone = torch.cat([padded[r, :c] for r, c in enumerate(counts.tolist())]).unsqueeze(0)  # (1, all)
        m2po = corrections.M2PO(self.args.m2_threshold)  # the loop's unit, on every rank's tokens at once
        keep = m2po.step_keep(everyone, torch.zeros_like(everyone), torch.ones_like(everyone))[0][0]  # (all,)
        start = counts[: self.accelerator.process_index].sum().item()
        keep = keep[start : start + mine.numel()]  # (this rank's,)
        for s in slices:
            counted = s["loss_mask"] > 0  # (n, T)
            s["m2po_keep"] = torch.ones_like(counted)  # (n, T) True off the loss
            s["m2po_keep"][counted], keep = keep[: counted.sum()], keep[counted.sum() :]
        self._set_step_normalisers(slices, group=len(slices))

    def _set_step_normalisers(self, slices: list[dict], group: int) -> None:
        """`loss_total` = Z of each optimizer step: its `group` consecutive slices, summed over all ranks (1 gather).

        Z counts loss tokens (token-mean), sequences with one (seq-mean) or n * max_completion_length (constant)."""
        agg = LOSS_TYPES[self.args.loss_type]
        counts = []
        for s in slices:
            m = s["loss_mask"] * s.get("m2po_keep", 1)  # (n, T) the loss's tokens, less those M2PO dropped
            counts.append(
                {
                    "token-mean": m.sum(),
                    "seq-mean": (m.sum(1) > 0).sum(),
                    "constant": torch.tensor(m.shape[0] * self.max_completion_length),
                }[agg]
            )
        local = torch.stack(counts).float().to(self.accelerator.device).view(-1, group).sum(1)  # (steps,)
        z = self.accelerator.gather(local.unsqueeze(0)).sum(0).clamp(min=1.0)  # (steps,) over the P ranks
        for j, s in enumerate(slices):
            s["loss_total"] = z[j // group]

    def _compute_loss(self, model, inputs):
        """Step 4 on one slice: objective.policy_loss (or rec / opmd) with the step's normaliser Z / P."""
        a, mode = self.args, "train" if self.model.training else "eval"
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)  # (n, P+T)
        attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)  # (n, P+T)
        logp, entropy, aux = self._get_per_token_logps_and_entropies(
            model,
            ids,
            attn,
            inputs["completion_ids"].shape[1],
            compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled,
        )  # (n, T) each; aux: an MoE's load-balancing loss, or None
        # log pi_k: this forward, detached, on the slice's first pass; kept in the slice for its later passes
        pi_k_logp = inputs.get("pi_k_logps")
        if pi_k_logp is None:
            pi_k_logp = logp.detach()  # (n, T)
            if self.model.training and self.num_iterations > 1:
                inputs["pi_k_logps"] = pi_k_logp
        # log alpha: TRL's old_per_token_logps (the policy at generation time); TRL leaves it out when alpha = pi_k
        alpha_logp = inputs.get("old_per_token_logps")
        alpha_logp = pi_k_logp if alpha_logp is None else alpha_logp  # (n, T)
        mask = inputs["loss_mask"]  # (n, T)
        # vLLM: TRL's engine-mismatch weight w = alpha / alpha_e (n, T) or (n, 1), folded into A (module docstring)
        w = inputs.get("importance_sampling_ratio")
        adv = inputs["advantages"] if w is None else inputs["advantages"].unsqueeze(1) * w  # (n,) or (n, T)
        z = inputs["loss_total"].item() / self.accelerator.num_processes  # Z / P
        m2po_keep = inputs.get("m2po_keep")  # (n, T) M2PO's kept tokens of the whole step, None without it
        x = objective.LossInput(
            logp=logp,
            alpha_logp=alpha_logp,
            pi_k_logp=pi_k_logp,
            ref_logp=inputs.get("ref_per_token_logps"),
            advantages=adv,
            loss_mask=mask if m2po_keep is None else mask * m2po_keep,  # M2PO's dropped tokens leave the loss and Z
            total=z,
        )
        loss, st = self._loss(x, sampling=inputs.get("sampling_per_token_logps"))
        if aux is not None:  # as stock TRL: the MoE router's loss, scaled for accumulation
            loss = loss + self.router_aux_loss_coef * aux / (
                self.current_gradient_accumulation_steps if mode == "train" else 1
            )
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather(aux.detach().reshape(1)).mean().item())
        # Token-weighted means over all ranks in one collective: [7 sums, tokens, max rho'] per rank.
        m = mask.float()  # (n, T)
        rho_prime = torch.exp(pi_k_logp - alpha_logp) * m  # (n, T) rho', 0 off the mask
        tok = m.sum()
        counted = torch.tensor(float(st.get("tokens", 0.0)), device=tok.device)  # the loss's tokens, less M2PO's drops
        sums = [rho_prime.sum(), *(counted * st.get(key, 0.0) for key in ("clip_low", "clip_high", "kl"))]
        sums.append((entropy.detach() * m).sum())
        dropped = torch.zeros_like(tok) if m2po_keep is None else (m * ~m2po_keep).sum()  # the tokens M2PO dropped
        sums += [dropped, counted * st.get("opsm_masked_frac", 0.0)]  # ... and OPSM's
        row = torch.stack([*sums, tok, rho_prime.max()])
        g = self.accelerator.gather(row.unsqueeze(0))  # (P, 9)
        means, seen = (g[:, :7].sum(0) / g[:, 7].sum().clamp(min=1.0)).tolist(), g[:, 7].sum().item() > 0
        keys = ["offpolicy/rho_prime_mean", "clip_ratio/low_mean", "clip_ratio/high_mean", "kl", "entropy"]
        keys += ["offpolicy/m2po_masked_frac", "offpolicy/opsm_masked_frac"]
        on = [True] * 5 + [a.m2_threshold is not None, a.off_policy_mask_threshold is not None]
        for key, val, logged in zip(keys + ["offpolicy/rho_prime_max"], means + [g[:, 8].max().item()], on + [True]):
            if logged:
                self._metrics[mode][key].append(val if seen else float("nan"))
        for key in ("m2po_clip_lo", "m2po_clip_hi", "m2po_quadrant_masked_frac", "dppo_masked_frac"):  # issue 57
            if key in st:  # a mean over the ranks of each rank's figure for this slice
                figure = self.accelerator.gather(torch.tensor([float(st[key])], device=tok.device)).mean().item()
                self._metrics[mode][f"offpolicy/{key}"].append(figure)
        return loss

    def _loss(self, x: objective.LossInput, sampling) -> tuple[torch.Tensor, dict]:
        """The loop's loss on one slice: objective.policy_loss through the same variant units train.py's Recipe
        runs (kl-is for use_bias_correction_kl, opsm for off_policy_mask_threshold), or [B]'s rec / rec-is / opmd.

        OPSM reads, as stock TRL, the log-probs vLLM recorded where it did (`sampling`), else log alpha."""
        a = self.args
        settings = dict(
            clip_eps=self.epsilon_low,
            clip_eps_high=self.epsilon_high,
            clip_center=a.clip_center,
            beta=self.beta,
            kl_estimator="k3",
            agg=LOSS_TYPES[a.loss_type],
        )
        if a.policy_loss != "grpo":
            unit = {"rec": reinforce.REC, "rec-is": reinforce.RECIS}.get(a.policy_loss)
            unit = reinforce.OPMD(a.tau_reg) if unit is None else unit(self.epsilon_low, self.epsilon_high)
            return unit.loss(x, objective.policy_loss, **settings)
        inner = objective.policy_loss
        own = self._trust_region_unit()
        if own is not None:  # innermost, as in train.py's Recipe (registered after kl-is and opsm)
            inner = partial(own.loss, inner=inner)
        if a.use_bias_correction_kl:  # kl_t * rho_t, rho = pi_theta / alpha with grad: TRL's coef_1
            kl_is = corrections.KLImportanceWeight(self.beta, "k3")
            inner = partial(kl_is.loss, inner=inner)
        if a.off_policy_mask_threshold is None:
            return inner(x, **settings)
        # OPSM's D_i by vLLM's log-probs (stock TRL's), its surrogate by log alpha: the unit sees the first,
        # and what it passes on gets the second back. A times vLLM's w >= 0 keeps A's sign, so the kept sequences
        # are stock TRL's (a token with w = 0 adds nothing either way).
        opsm = corrections.OPSM(a.off_policy_mask_threshold)
        if sampling is None:
            return opsm.loss(x, inner=inner, **settings)
        back = lambda y, **s: inner(replace(y, alpha_logp=x.alpha_logp), **s)
        return opsm.loss(replace(x, alpha_logp=sampling), inner=back, **settings)

    def _trust_region_unit(self):
        """The unit of m2po_clip_threshold, m2po_quadrant_threshold or dppo_delta (at most one), else None."""
        a = self.args
        if a.m2po_clip_threshold is not None:
            return corrections.M2POClip(a.m2po_clip_threshold, a.m2po_clip_floor)
        if a.m2po_quadrant_threshold is not None:
            return corrections.M2POQuadrant(a.m2po_quadrant_threshold)
        if a.dppo_delta is not None:
            return corrections.DPPO(a.dppo_delta)
        return None

    def _save_checkpoint(self, model, trial):
        """TRL's checkpoint, plus this rank's buffered generation and micro-step counter (module docstring)."""
        super()._save_checkpoint(model, trial)
        folder = os.path.join(self._get_output_dir(trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        os.makedirs(folder, exist_ok=True)
        state = {"step": self._step, "world_size": self.accelerator.num_processes, "buffer": self._buffered_inputs}
        torch.save(state, self._buffer_path(folder))

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        path = self._buffer_path(checkpoint)
        state = None
        if os.path.isfile(path):
            state = torch.load(path, map_location=self.accelerator.device, weights_only=True)
        if state is None or state["world_size"] != self.accelerator.num_processes:
            warnings.warn(f"resume: no generation buffer for this world size in {checkpoint}: TRL generates anew")
            return
        self._step, self._buffered_inputs = state["step"], state["buffer"]

    def _buffer_path(self, checkpoint_folder: str) -> str:
        """This rank's buffered generation inside a checkpoint-<step>/ folder."""
        return os.path.join(checkpoint_folder, BUFFER_FILE.format(self.accelerator.process_index))


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
BUILTIN = dict(
    learning_rate=5e-5,
    max_steps=200,
    per_device_train_batch_size=128,
    num_generations=8,
    max_completion_length=8,
    lr_scheduler_type="constant",
    gradient_checkpointing=False,
    bf16=False,
    use_cpu=True,
    logging_steps=25,
    save_strategy="no",
    report_to="none",
    seed=0,
)


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
    # every rank's policy checksum: DDP must leave them equal
    sums = gather_object([checksum(policy)])
    summary = {
        "eval_accuracy_start": acc_start,
        "eval_accuracy_end": acc_end,
        "steps": trainer.state.global_step,
        "world_size": acc.num_processes,
        "wall_s": time.time() - t0,
        "offpolicy_steps": cfg.offpolicy_steps,
        "eval_size": len(heldout),
        "rank_checksums": sums,
    }
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
