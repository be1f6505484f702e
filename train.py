"""Train a language model with on- or off-policy GRPO on one device.

    python train.py --offpolicy-steps 4

One training step k ([A] Algorithm 1; design.md):
  1. refresh the sampler: if k % v == 0, alpha <- pi_theta (v = --offpolicy-steps; v = 1 keeps
     no copy: the live model samples);
  2. sample G completions for each of B prompts from alpha;
  3. score them with the verifier (reward.py);
  4. group-relative advantages, zero-std groups masked out (advantage.py);
  5. log-probs under alpha (stale steps only), pi_k and pi_ref (only when beta > 0) (rollout.py);
  6. --inner-steps optimizer steps over the batch, each accumulated over --micro-batch chunks,
     on the clipped surrogate with k3 KL (objective.py).

Deviations from [A]:
  1. log pi_k is not a separate forward pass: until the step's first optimizer update,
     pi_theta *is* pi_k, so the first inner epoch records logp.detach() of its own forward.
     At refresh steps alpha = pi_k too, so then the behaviour pass is skipped as well: on-policy
     steps run no extra forward at all.
  2. Held-out accuracy is greedy (temperature 0), the usual way to report it; training samples
     at --temperature.
"""

import copy
import random
import sys
import time

import torch
from tqdm import tqdm

from advantage import group_advantages, red_drop, red_weight
from checkpoint import checkpoint_dir, latest_checkpoint, load_checkpoint, rng_state, save_checkpoint, set_rng_state
from config import Config, ConfigError, build_parser, config_from_args, validate
from objective import aggregation_total, opmd_loss, policy_loss, rec_loss
from reward import math_reward
from rollout import generate, sampling_path, token_logprobs
from run_io import RunWriter, current_memory_gb, load_policy, peak_memory_gb
from tasks import Problem, TaskError, encode_prompts, fit_context, load_task


def autocast(cfg: Config, device):
    """bfloat16 autocast on CUDA (float32 master weights); a no-op with --dtype float32."""
    device = torch.device(device)
    return torch.autocast(device.type, dtype=cfg.autocast_dtype or torch.float32, enabled=cfg.autocast_dtype is not None)


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


def clock(device) -> float:
    """time.time() once the device's queued work is done: CUDA runs asynchronously, so the phase
    timers would otherwise bill one phase's kernels to the next phase that waits for them."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.time()


@torch.no_grad()
def evaluate(model, tokenizer, problems: list[Problem], max_new_tokens: int, device, batch_size: int = 256) -> float:
    """Held-out greedy accuracy: the fraction of problems whose completion the verifier credits."""
    was_training = model.training
    model.eval()
    correct = 0.0
    for s in range(0, len(problems), batch_size):
        chunk = problems[s : s + batch_size]
        ids, mask = encode_prompts(tokenizer, chunk, device)
        r = generate(model, ids, mask, group_size=1, max_new_tokens=max_new_tokens, temperature=0.0,
                     eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        texts = tokenizer.batch_decode(r.completion_ids * r.completion_mask + tokenizer.pad_token_id * (1 - r.completion_mask), skip_special_tokens=True)
        correct += sum(math_reward(t, p.gold) for t, p in zip(texts, chunk))
    model.train(was_training)
    return correct / max(len(problems), 1)


def compute_advantages(cfg: Config, rewards: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and valid mask for the chosen loss and data shaping (advantage.py)."""
    if cfg.reward_shuffle:  # the null control: the same rewards, each credited to a random sample
        rewards = rewards[torch.randperm(rewards.numel(), generator=gen, device=rewards.device)]  # (N,)
    keep = red_drop(rewards, cfg.group_size, gen) if cfg.red == "drop" else None
    scale_std = cfg.loss in ("grpo", "rec", "rec-is") and cfg.asymre_shift == 0.0
    adv, valid = group_advantages(rewards, cfg.group_size, mask_zero_std=cfg.mask_zero_std,
                                  scale_std=scale_std, baseline_shift=cfg.asymre_shift, keep=keep)
    if cfg.red == "weight":
        adv = red_weight(adv, cfg.red_tau)
    return adv, valid


def loss_fn(cfg: Config, logp, behaviour_logp, current_logp, ref_logp, adv, mask, total):
    """The per-micro-batch loss selected by --loss (objective.py)."""
    common = dict(agg=cfg.agg, max_new_tokens=cfg.max_new_tokens, total=total)
    if cfg.loss == "grpo":
        return policy_loss(logp, behaviour_logp, current_logp, ref_logp, adv, mask, clip_eps=cfg.clip_eps,
                           clip_eps_high=cfg.clip_eps_high, clip_center=cfg.clip_center, beta=cfg.beta, **common)
    if cfg.loss in ("rec", "rec-is"):
        return rec_loss(logp, behaviour_logp, adv, mask, clip_eps=cfg.clip_eps, clip_eps_high=cfg.clip_eps_high,
                        importance_weight=cfg.loss == "rec-is", **common)
    return opmd_loss(logp, behaviour_logp, adv, mask, tau_reg=cfg.tau_reg, **common)


def update(cfg: Config, policy, opt, batch: dict, behaviour_logp, ref_logp) -> dict:
    """--inner-steps optimizer steps over the batch, micro-batched; returns averaged stats.

    behaviour_logp=None means alpha = pi_k (a refresh step): it is recorded from the first
    inner epoch, like log pi_k. Micro-batch losses are normalised by the whole step's total,
    so their summed gradients equal the whole-batch gradient.
    """
    ids, attn, mask, adv = batch["input_ids"], batch["attention_mask"], batch["loss_mask"], batch["advantages"]
    n = ids.shape[0]
    mb = cfg.micro_batch or n
    total = aggregation_total(mask, cfg.agg, cfg.max_new_tokens)
    pi_k_logp = torch.zeros_like(mask, dtype=torch.float32)  # (N, T) log pi_k, filled in epoch 0
    sums, tokens, rho_max, grad_norms, skipped, loss_sum = {}, 0.0, 1.0, [], 0, 0.0
    policy.train()
    for epoch in range(cfg.inner_steps):
        opt.zero_grad(set_to_none=True)
        for s in range(0, n, mb):
            rows = slice(s, s + mb)
            if mask[rows].sum() == 0 and epoch > 0:
                continue  # no valid token here: zero loss and zero gradient
            with autocast(cfg, ids.device):
                logp = token_logprobs(policy, ids[rows], attn[rows], batch["completion_mask"][rows], cfg.temperature)  # (mb, T)
            if epoch == 0:
                pi_k_logp[rows] = logp.detach()  # pi_theta == pi_k until the first optimizer step
            b_logp = pi_k_logp[rows] if behaviour_logp is None else behaviour_logp[rows]
            r_logp = ref_logp[rows] if ref_logp is not None else None
            loss, st = loss_fn(cfg, logp, b_logp, pi_k_logp[rows], r_logp, adv[rows], mask[rows], total)
            loss.backward()
            w = st.pop("tokens")
            tokens += w
            rho_max = max(rho_max, st.pop("rho_prime_max", 1.0))
            for key, v in st.items():
                sums[key] = sums.get(key, 0.0) + v * w
            loss_sum += loss.item()  # micro-batch losses add up to the step's loss
        norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm)
        if torch.isfinite(norm):
            opt.step()
        else:
            skipped += 1  # non-finite gradient: no optimizer step
        grad_norms.append(norm.item())
    stats = {k: v / max(tokens, 1.0) for k, v in sums.items()}
    stats.update(loss=loss_sum / cfg.inner_steps, rho_prime_max=rho_max, grad_norm=sum(grad_norms) / len(grad_norms),
                 nonfinite_updates=skipped)
    stats["_pi_k_logp"] = pi_k_logp
    return stats


def stop_if_diverged(streak: int, step: int) -> None:
    """Three non-finite steps in a row end the run; no checkpoint was written during the streak,
    so the newest one on disk is the last good one."""
    if streak >= 3:
        raise ConfigError(f"step {step}: loss or gradient not finite 3 steps in a row; stopping (try a lower --lr)")


def train(cfg: Config) -> dict:
    """Run GRPO as configured; returns the summary (also written to --out/summary.json)."""
    validate(cfg)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    device = torch.device(cfg.device)
    train_set, heldout = load_task(cfg.task, cfg.data_files, cfg.eval_files, cfg.eval_size)  # bad rows fail fast
    writer = RunWriter(cfg)
    policy, tokenizer = load_policy(cfg, log=writer.log)
    context = getattr(policy.config, "max_position_embeddings", None)
    if context:  # prompts that leave no room for max_new_tokens are skipped, with a count
        train_set, dropped = fit_context(tokenizer, train_set, context - cfg.max_new_tokens, "training")
        heldout, dropped_eval = fit_context(tokenizer, heldout, context - cfg.max_new_tokens, "held-out")
        if dropped or dropped_eval:
            writer.log(f"skipped {dropped} training and {dropped_eval} held-out prompts longer than the "
                       f"model's context ({context}) minus --max-new-tokens ({cfg.max_new_tokens})")
    policy.to(device)
    v = cfg.offpolicy_steps
    sampler = copy.deepcopy(policy).requires_grad_(False).eval() if v > 1 else None  # alpha; None: the live model
    ref = copy.deepcopy(policy).requires_grad_(False).eval() if cfg.beta > 0 else None  # pi_ref, only with KL
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)  # the sampling generator
    writer.log(f"sampling path: {sampling_path(sampler or policy)}; sampler: "
               f"{'a copy refreshed every %d steps' % v if sampler is not None else 'the live policy (v=1)'}")
    stream = PromptStream(train_set, cfg.seed)

    start_step, nonfinite_streak, last, wall_before = 0, 0, {}, 0.0
    if cfg.resume:  # continue from the newest complete checkpoint: every state the next step reads
        path = latest_checkpoint(cfg.out)
        if path is None:
            raise ConfigError(f"--resume: no complete checkpoint in {checkpoint_dir(cfg.out)}")
        ck = load_checkpoint(path)
        policy.load_state_dict(ck["policy"])
        if sampler is not None:
            sampler.load_state_dict(ck["sampler"])
        if ref is not None:
            ref.load_state_dict(ck["ref"])
        opt.load_state_dict(ck["optimizer"])
        set_rng_state(ck["rng"], gen)
        stream.position, start_step, acc_start = ck["data_position"], ck["step"], ck["eval_accuracy_start"]
        wall_before = ck["wall_s"]
        writer.truncate_metrics(start_step)
        writer.log(f"resumed from {path} at step {start_step}")
    t0 = time.time() - wall_before
    if not cfg.resume:
        acc_start = evaluate(policy, tokenizer, heldout, cfg.max_new_tokens, device)
    writer.log(f"held-out greedy accuracy before training: {acc_start:.3f} ({len(heldout)} problems)")
    bar = tqdm(range(start_step, cfg.steps), desc="grpo", dynamic_ncols=True, disable=not cfg.progress,
               initial=start_step, total=cfg.steps)
    for step in bar:
        t_step = time.time()
        refresh = step % v == 0
        if sampler is not None and refresh:
            sampler.load_state_dict(policy.state_dict())  # 1. alpha <- pi_theta
        if ref is not None and cfg.ref_refresh and step > 0 and step % cfg.ref_refresh == 0:
            ref.load_state_dict(policy.state_dict())

        problems = stream.next(cfg.prompts_per_step)  # 2. sample from alpha
        prompt_ids, prompt_mask = encode_prompts(tokenizer, problems, device)
        policy.eval()
        try:
            with autocast(cfg, device):
                ro = generate(sampler or policy, prompt_ids, prompt_mask, group_size=cfg.group_size,
                              max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                              eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, generator=gen)
        except FloatingPointError:  # the sampler's logits are not finite: a diverged policy
            writer.metrics({"step": step, "wall_s": time.time() - t0, "nonfinite_updates": 1, "nonfinite_logits": 1})
            nonfinite_streak += 1
            stop_if_diverged(nonfinite_streak, step)
            continue
        t_sample = time.time() - t_step

        t = time.time()  # 3. reward
        texts = tokenizer.batch_decode(torch.where(ro.completion_mask.bool(), ro.completion_ids, tokenizer.pad_token_id), skip_special_tokens=True)
        golds = [p.gold for p in problems for _ in range(cfg.group_size)]
        rewards = torch.tensor([math_reward(c, g) for c, g in zip(texts, golds)], device=device)  # (N,)
        adv, valid = compute_advantages(cfg, rewards, gen)  # 4. advantages, (N,) each
        loss_mask = ro.completion_mask * valid.unsqueeze(1)  # (N, T) valid groups' completion tokens
        t_score = time.time() - t

        t = time.time()  # 5. log-probs without grad: alpha on stale steps, pi_ref with KL
        batch = dict(input_ids=ro.input_ids, attention_mask=ro.attention_mask, completion_mask=ro.completion_mask,
                     loss_mask=loss_mask, advantages=adv)
        with torch.no_grad(), autocast(cfg, device):
            behaviour_logp = None if refresh else token_logprobs(sampler, ro.input_ids, ro.attention_mask, ro.completion_mask, cfg.temperature)
            ref_logp = token_logprobs(ref, ro.input_ids, ro.attention_mask, ro.completion_mask, cfg.temperature) if ref is not None else None
        t_logprob = clock(device) - t

        t = time.time()  # 6. update
        if loss_mask.sum() > 0:
            st = update(cfg, policy, opt, batch, behaviour_logp, ref_logp)
        else:
            st = {"nonfinite_updates": 0, "skipped_no_signal": 1}  # every group had equal rewards
        t_update = clock(device) - t

        pi_k_logp = st.pop("_pi_k_logp", None)
        alpha_logp = pi_k_logp if behaviour_logp is None else behaviour_logp
        groups = rewards.view(-1, cfg.group_size)  # (B, G)
        cm = ro.completion_mask.float()
        n_tok = cm.sum().item()
        wall = time.time() - t_step
        last = {
            "step": step,
            "wall_s": time.time() - t0,
            "reward": rewards.mean().item(),
            "accuracy": (rewards == 1.0).float().mean().item(),
            "zero_std_frac": (groups.amax(1) == groups.amin(1)).float().mean().item(),  # groups with equal rewards
            "completion_len": cm.sum(1).mean().item(),
            "truncated_frac": ro.truncated.float().mean().item(),
            "entropy": (ro.entropy * cm).sum().item() / max(n_tok, 1),
            "sampler_mismatch": ((ro.sampler_logp - alpha_logp).abs() * loss_mask).sum().item() / max(loss_mask.sum().item(), 1) if alpha_logp is not None else 0.0,
            **{k: v for k, v in st.items()},
            "t_sample": t_sample, "t_score": t_score, "t_logprob": t_logprob, "t_update": t_update,
            "tokens_per_s": n_tok / wall,
            "peak_mem_gb": peak_memory_gb(device),
            "mem_gb": current_memory_gb(device),
        }
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.steps:
            last["eval_accuracy"] = evaluate(policy, tokenizer, heldout, cfg.max_new_tokens, device)
        writer.metrics(last)
        bar.set_postfix(reward=f"{last['reward']:.2f}", acc=f"{last['accuracy']:.2f}", kl=f"{last.get('kl', 0):.3f}",
                        clip=f"{last.get('clip_low', 0) + last.get('clip_high', 0):.3f}",
                        rho=f"{last.get('rho_prime_max', 1):.2f}", tok_s=f"{last['tokens_per_s']:.0f}")
        nonfinite_streak = nonfinite_streak + 1 if st.get("nonfinite_updates") else 0
        stop_if_diverged(nonfinite_streak, step)
        if cfg.save_every and (step + 1) % cfg.save_every == 0 and nonfinite_streak == 0:
            state = {"policy": policy.state_dict(), "optimizer": opt.state_dict(), "rng": rng_state(gen),
                     "step": step + 1, "data_position": stream.position, "eval_accuracy_start": acc_start,
                     "wall_s": time.time() - t0}
            if sampler is not None:
                state["sampler"] = sampler.state_dict()
            if ref is not None:
                state["ref"] = ref.state_dict()
            save_checkpoint(cfg.out, state, step + 1, cfg.keep_checkpoints)

    acc_end = evaluate(policy, tokenizer, heldout, cfg.max_new_tokens, device)
    summary = {"eval_accuracy_start": acc_start, "eval_accuracy_end": acc_end, "steps": cfg.steps,
               "wall_s": time.time() - t0, "eval_size": len(heldout), "out": str(writer.out)}
    writer.log(f"held-out greedy accuracy after training:  {acc_end:.3f} (start {acc_start:.3f}, {acc_end - acc_start:+.3f})")
    writer.finish(policy, tokenizer, summary)
    return summary


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = config_from_args(args)
        train(cfg)
    except (ConfigError, TaskError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
