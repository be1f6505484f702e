"""Train a language model with on- or off-policy GRPO on one device.

    python train.py --offpolicy-steps 4

The loop: each step k draws B prompts, runs `step.grpo_step` (steps 1-6 of [A]'s Algorithm 1:
refresh the sampler every v steps, sample, reward with the verifier, advantages, log-probs, update),
then logs a metrics row, evaluates held-out accuracy every --eval-every steps, and checkpoints every
--save-every steps. Bookkeeping lives in named functions below the loop's helpers: `setup`,
`restore`, `checkpoint_state`, `metrics_row`.

Deviations from [A]:
  1. Held-out accuracy is greedy (temperature 0), the usual way to report it; training samples
     at --temperature.
  2. Three non-finite steps in a row stop the run (`Diverged`, exit status 3); bad input exits 2.
"""

import copy
import random
import sys
import time

import torch
from tqdm import tqdm

from checkpoint import checkpoint_dir, latest_checkpoint, load_checkpoint, rng_state, save_checkpoint, set_rng_state
from config import Config, ConfigError, build_parser, config_from_args, validate
from reward import math_reward
from rollout import Rollout, generate, sampling_path
from run_io import RunWriter, current_memory_gb, load_policy, peak_memory_gb
from step import Batch, Models, StepResult, clock, compute_advantages, grpo_step, update  # noqa: F401 (re-exported)
from tasks import Problem, TaskError, encode_prompts, fit_context, load_task


class Diverged(Exception):
    """Three non-finite steps in a row: the run stops (exit status 3; its newest checkpoint is good)."""


class PromptStream:
    """Training prompts in a fresh seeded shuffle each epoch; `position` counts prompts served."""

    def __init__(self, problems: list[Problem], seed: int, position: int = 0):
        self.problems, self.seed, self.position = problems, seed, position

    def next(self, k: int) -> list[Problem]:
        out = []
        for _ in range(k):
            epoch, i = divmod(self.position, len(self.problems))
            if i == 0 or not hasattr(self, "_order") or self._epoch != epoch:
                self._order = list(range(len(self.problems)))
                random.Random(self.seed * 1_000_003 + epoch).shuffle(self._order)
                self._epoch = epoch
            out.append(self.problems[self._order[i]])
            self.position += 1
        return out


@torch.no_grad()
def evaluate(model, tokenizer, problems: list[Problem], max_new_tokens: int, device, batch_size: int = 256) -> float:
    """Held-out greedy accuracy: the fraction of problems whose completion the verifier credits."""
    was_training = model.training
    model.eval()
    correct = 0.0
    for s in range(0, len(problems), batch_size):
        chunk = problems[s : s + batch_size]
        ids, mask = encode_prompts(tokenizer, chunk, device)
        r = generate(
            model,
            ids,
            mask,
            group_size=1,
            max_new_tokens=max_new_tokens,
            temperature=0.0,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        texts = tokenizer.batch_decode(
            r.completion_ids * r.completion_mask + tokenizer.pad_token_id * (1 - r.completion_mask),
            skip_special_tokens=True,
        )
        correct += sum(math_reward(t, p.gold) for t, p in zip(texts, chunk))
    model.train(was_training)
    return correct / max(len(problems), 1)


def stop_if_diverged(streak: int, step: int) -> None:
    """Three non-finite steps in a row end the run; no checkpoint was written during the streak,
    so the newest one on disk is the last good one."""
    if streak >= 3:
        raise Diverged(f"step {step}: loss or gradient not finite 3 steps in a row; stopping (try a lower --lr)")


def verifier(tokenizer, problems: list[Problem], group_size: int):
    """The training reward: `math_reward` of each decoded completion against its prompt's gold answer."""
    golds = [p.gold for p in problems for _ in range(group_size)]

    def reward_fn(ro: Rollout) -> torch.Tensor:
        ids = torch.where(ro.completion_mask.bool(), ro.completion_ids, tokenizer.pad_token_id)  # (N, T)
        texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
        return torch.tensor([math_reward(c, g) for c, g in zip(texts, golds)], device=ro.completion_ids.device)

    return reward_fn


def setup(cfg: Config, writer: RunWriter, train_set: list[Problem], heldout: list[Problem]):
    """The policy, its frozen copies and optimizer, the tokenizer, and the prompts that fit its context."""
    policy, tokenizer = load_policy(cfg, log=writer.log)
    context = getattr(policy.config, "max_position_embeddings", None)
    if context:
        # Prompts that leave no room for max_new_tokens are skipped, with a count.
        train_set, dropped = fit_context(tokenizer, train_set, context - cfg.max_new_tokens, "training")
        heldout, dropped_eval = fit_context(tokenizer, heldout, context - cfg.max_new_tokens, "held-out")
        if dropped or dropped_eval:
            writer.log(
                f"skipped {dropped} training and {dropped_eval} held-out prompts longer than the "
                f"model's context ({context}) minus --max-new-tokens ({cfg.max_new_tokens})"
            )
    policy.to(cfg.device)
    frozen = lambda: copy.deepcopy(policy).requires_grad_(False).eval()  # noqa: E731
    models = Models(
        policy,
        torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay),
        sampler=frozen() if cfg.offpolicy_steps > 1 else None,
        ref=frozen() if cfg.beta > 0 else None,
    )
    return models, tokenizer, train_set, heldout


def checkpoint_state(models: Models, gen, stream: PromptStream, step: int, acc_start: float, wall: float) -> dict:
    """Everything the next step reads, so that a resumed run continues bit for bit."""
    state = {
        "policy": models.policy.state_dict(),
        "optimizer": models.opt.state_dict(),
        "rng": rng_state(gen),
        "step": step,
        "data_position": stream.position,
        "eval_accuracy_start": acc_start,
        "wall_s": wall,
    }
    if models.sampler is not None:
        state["sampler"] = models.sampler.state_dict()
    if models.ref is not None:
        state["ref"] = models.ref.state_dict()
    return state


def restore(cfg: Config, models: Models, gen, stream: PromptStream, writer: RunWriter) -> tuple[int, float, float]:
    """Load the newest complete checkpoint into the models; returns (step, start accuracy, wall seconds)."""
    path = latest_checkpoint(cfg.out)
    if path is None:
        raise ConfigError(f"--resume: no complete checkpoint in {checkpoint_dir(cfg.out)}")
    ck = load_checkpoint(path)
    models.policy.load_state_dict(ck["policy"])
    if models.sampler is not None:
        models.sampler.load_state_dict(ck["sampler"])
    if models.ref is not None:
        models.ref.load_state_dict(ck["ref"])
    models.opt.load_state_dict(ck["optimizer"])
    set_rng_state(ck["rng"], gen)
    stream.position = ck["data_position"]
    writer.truncate_metrics(ck["step"])
    writer.log(f"resumed from {path} at step {ck['step']}")
    return ck["step"], ck["eval_accuracy_start"], ck["wall_s"]


def metrics_row(step: int, res: StepResult, group_size: int, wall_s: float, step_s: float, device) -> dict:
    """The step's line of metrics.jsonl (README, "Metrics")."""
    ro, rewards, loss_mask = res.rollout, res.rewards, res.batch.loss_mask
    groups = rewards.view(-1, group_size)  # (B, G)
    cm = ro.completion_mask.float()  # (N, T)
    n_tok = cm.sum().item()
    mismatch = 0.0
    if res.alpha_logp is not None:
        # |log alpha while sampling - log alpha of a full forward| over the loss's tokens.
        gap = (ro.sampler_logp - res.alpha_logp).abs() * loss_mask  # (N, T)
        mismatch = gap.sum().item() / max(loss_mask.sum().item(), 1)
    t = res.times
    return {
        "step": step,
        "wall_s": wall_s,
        "reward": rewards.mean().item(),
        "accuracy": (rewards == 1.0).float().mean().item(),
        "zero_std_frac": (groups.amax(1) == groups.amin(1)).float().mean().item(),
        "completion_len": cm.sum(1).mean().item(),
        "truncated_frac": ro.truncated.float().mean().item(),
        "entropy": (ro.entropy * cm).sum().item() / max(n_tok, 1),
        "sampler_mismatch": mismatch,
        **res.stats,
        "t_sample": t["refresh"] + t["sample"],
        "t_score": t["score"],
        "t_logprob": t["logprob"],
        "t_update": t["update"],
        "tokens_per_s": n_tok / step_s,
        "peak_mem_gb": peak_memory_gb(device),
        "mem_gb": current_memory_gb(device),
    }


def show(bar, row: dict) -> None:
    """The key metrics in the progress bar's postfix."""
    bar.set_postfix(
        reward=f"{row['reward']:.2f}",
        acc=f"{row['accuracy']:.2f}",
        kl=f"{row.get('kl', 0):.3f}",
        clip=f"{row.get('clip_low', 0) + row.get('clip_high', 0):.3f}",
        rho=f"{row.get('rho_prime_max', 1):.2f}",
        tok_s=f"{row['tokens_per_s']:.0f}",
    )


def train(cfg: Config) -> dict:
    """Run GRPO as configured; returns the summary (also written to --out/summary.json)."""
    validate(cfg)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    device = torch.device(cfg.device)
    # Bad data fails here, before anything is written.
    train_set, heldout = load_task(cfg.task, cfg.data_files, cfg.eval_files, cfg.eval_size)
    writer = RunWriter(cfg)
    models, tokenizer, train_set, heldout = setup(cfg, writer, train_set, heldout)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)  # the sampling generator
    sampler_kind = f"a copy refreshed every {cfg.offpolicy_steps} steps" if models.sampler else "the live policy (v=1)"
    writer.log(f"sampling path: {sampling_path(models.sampler or models.policy)}; sampler: {sampler_kind}")
    stream = PromptStream(train_set, cfg.seed)
    start_step, wall_before = 0, 0.0
    if cfg.resume:
        start_step, acc_start, wall_before = restore(cfg, models, gen, stream, writer)
    t0 = time.time() - wall_before
    if not cfg.resume:
        acc_start = evaluate(models.policy, tokenizer, heldout, cfg.max_new_tokens, device)
    writer.log(f"held-out greedy accuracy before training: {acc_start:.3f} ({len(heldout)} problems)")
    bar = tqdm(
        range(start_step, cfg.steps),
        desc="grpo",
        dynamic_ncols=True,
        disable=not cfg.progress,
        initial=start_step,
        total=cfg.steps,
    )
    streak = 0  # non-finite steps in a row
    for step in bar:
        t_step = time.time()
        problems = stream.next(cfg.prompts_per_step)
        prompt_ids, prompt_mask = encode_prompts(tokenizer, problems, device)  # (B, P) each
        try:
            res = grpo_step(
                cfg,
                models,
                tokenizer,
                prompt_ids,
                prompt_mask,
                step,
                gen,
                verifier(tokenizer, problems, cfg.group_size),
            )
        except FloatingPointError:
            # The sampler's logits are not finite: a diverged policy. The step counts as non-finite.
            writer.metrics({"step": step, "wall_s": time.time() - t0, "nonfinite_updates": 1, "nonfinite_logits": 1})
            streak += 1
            stop_if_diverged(streak, step)
            continue
        row = metrics_row(step, res, cfg.group_size, time.time() - t0, time.time() - t_step, device)
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.steps:
            row["eval_accuracy"] = evaluate(models.policy, tokenizer, heldout, cfg.max_new_tokens, device)
        writer.metrics(row)
        show(bar, row)
        streak = streak + 1 if res.stats.get("nonfinite_updates") else 0
        stop_if_diverged(streak, step)
        # No checkpoint during a non-finite streak: the newest one on disk stays the last good one.
        if cfg.save_every and (step + 1) % cfg.save_every == 0 and streak == 0:
            state = checkpoint_state(models, gen, stream, step + 1, acc_start, time.time() - t0)
            save_checkpoint(cfg.out, state, step + 1, cfg.keep_checkpoints)

    acc_end = evaluate(models.policy, tokenizer, heldout, cfg.max_new_tokens, device)
    summary = {
        "eval_accuracy_start": acc_start,
        "eval_accuracy_end": acc_end,
        "steps": cfg.steps,
        "wall_s": time.time() - t0,
        "eval_size": len(heldout),
        "out": str(writer.out),
    }
    writer.log(
        f"held-out greedy accuracy after training:  {acc_end:.3f} (start {acc_start:.3f}, {acc_end - acc_start:+.3f})"
    )
    writer.finish(models.policy, tokenizer, summary)
    return summary


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = config_from_args(args)
        train(cfg)
    except (ConfigError, TaskError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Diverged as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
