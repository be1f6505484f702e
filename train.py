"""Train a language model with on- or off-policy GRPO on one device.

    python train.py --offpolicy-steps 4

The loop: each step k draws B prompts, runs `step.grpo_step` (steps 1-6 of [A]'s Algorithm 1:
refresh the sampler every v steps, sample, reward with the reward functions of rewards.py (the built-in
verifier by default), advantages, log-probs, update),
then logs a metrics row, evaluates held-out accuracy every --eval-every steps, and checkpoints every
--save-every steps. Bookkeeping lives in named functions below the loop's helpers: `setup`,
`restore`, `checkpoint_state`, `metrics_row`.

Reading order: `train` and `run` at the bottom are the whole run top to bottom (setup, resume or first
evaluation, the loop, the end); each block is a few lines that call a named function above it. The algorithm itself
is in step.py (`grpo_step`), objective.py and advantage.py; this file only feeds it prompts and keeps
the books. Outputs (run_io.py): config.json, metrics.jsonl (one row per step, README "Metrics"),
summary.json, final/ (save_pretrained), curves.png with matplotlib, checkpoints/ with --save-every,
completions.jsonl with --log-completions. The learning rate of step k is `lr_at(cfg, k)`, a function of the step
alone (--lr-scheduler, --warmup-ratio), so a resumed run needs no scheduler state.

Deviations from [A]:
  1. Held-out accuracy is greedy (temperature 0), the usual way to report it; training samples
     at --temperature.
  2. A run whose steps keep going non-finite stops (`Diverged`, exit status 3: `stop_if_diverged` has the rule),
     and weights that are not finite are never saved; bad input exits 2, Ctrl-C 130, SIGTERM 143, each with one
     line (docs/failure-modes.md).
"""

import contextlib
import functools
import json
import math
import random
import signal
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from bookkeeping.checkpoint import (
    checkpoint_dir,
    checkpoints,
    latest_checkpoint,
    load_checkpoint,
    load_policy_state,
    policy_state,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from bookkeeping.run_io import RunWriter, current_memory_gb, peak_memory_gb
from config import Config, ConfigError, config_from_args, parse_args, validate
from engine.decoding import sampling_path
from engine.policy import load_policy
from logprobs import Truncation
from problems.tasks import (
    Problem,
    Prompting,
    TaskError,
    encode_prompts,
    fit_context,
    load_dataset_problems,
    load_task,
    prompt_record,
)
from problems.user_rewards import RewardError, Rewards, RewardState, Scores, load_rewards
from reward import math_reward
from rollout import Cycle, Rollout, generate
from step import Models, StepResult, autocast, grpo_step, make_models, sampler


class Diverged(Exception):
    """The run's steps keep going non-finite (`stop_if_diverged`), or its weights are: the run stops with exit
    status 3, and its newest checkpoint on disk is a good one."""


class Stopped(BaseException):
    """Ctrl-C (SIGINT) or SIGTERM: `main` prints one line, where the run stands and how to resume it. A
    BaseException, as KeyboardInterrupt is: code that catches errors (a reward function's call) lets it through."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.exit_status = 128 + signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM


# A signal that arrives while a checkpoint or final/ is being written waits for the write to finish: cut short,
# torch.save raises an error of its own, and the stopped run would not end in its one line.
_writing, _pending_signal = False, None


def stop_on_signal(signum, frame):
    global _pending_signal
    if _writing:
        _pending_signal = signum
        return
    raise Stopped(signum)


@contextlib.contextmanager
def signals_wait():
    """Ctrl-C and SIGTERM take effect once the block is done (`stop_on_signal`)."""
    global _writing, _pending_signal
    _writing = True
    try:
        yield
    finally:
        _writing = False
        if _pending_signal is not None:
            signum, _pending_signal = _pending_signal, None
            raise Stopped(signum)


class PromptStream:
    """Training prompts in a fresh seeded shuffle each epoch; `position` counts prompts served."""

    def __init__(self, problems: list[Problem], seed: int, position: int = 0):
        self.problems, self.seed, self.position = problems, seed, position

    def next(self, k: int) -> list[Problem]:
        # The order is a function of (seed, epoch) alone, so a resumed run that restores `position`
        # draws exactly the prompts the uninterrupted run would have drawn.
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
def evaluate(
    model,
    tokenizer,
    problems: list[Problem],
    max_new_tokens: int,
    device,
    reward=math_reward,
    *,
    samples: int = 1,
    temperature: float = 0.0,
    truncation: Truncation | None = None,
    generator: torch.Generator | None = None,
    batch_size: int = 256,
    sampler=None,
    state: RewardState | None = None,
    scores_out: list | None = None,
    rows_out: list | None = None,
) -> float:
    """Held-out accuracy: the mean over problems of the mean reward of `samples` completions each ([A]'s "pass@1
    over k samples"). The default, one greedy completion (temperature 0), is the usual held-out accuracy.

    `reward`: (completion, gold) -> a float, or the run's Rewards (their weighted sum; `state` is their
    trainer_state): then `scores_out` (a list) gets the Scores of all the completions, `rows_out` a dict per
    completion (prompt, completion, reward, rewards)."""
    was_training = model.training
    model.eval()
    correct, parts = 0.0, []
    # The same `generate` as training, so evaluation also exercises the sampling path the run uses.
    special = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    sampling = dict(temperature=temperature, truncation=truncation, generator=generator, sampler=sampler)
    per_call = max(1, batch_size // samples)  # problems per generate call: at most batch_size rows
    for s in range(0, len(problems), per_call):
        chunk = problems[s : s + per_call]
        ids, mask = encode_prompts(tokenizer, chunk, device)  # (b, P) left-padded
        try:
            r = generate(model, ids, mask, group_size=samples, max_new_tokens=max_new_tokens, **sampling, **special)
        except FloatingPointError:
            raise Diverged("held-out evaluation: the policy's logits are not finite; stopping") from None
        # Tokens after EOS are padding; the verifier reads the decoded text only. Rows are group-major.
        ids = torch.where(r.completion_mask.bool(), r.completion_ids, tokenizer.pad_token_id)  # (b * k, T)
        texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
        if isinstance(reward, Rewards):
            rows = [p for p in chunk for _ in range(samples)]
            scores = score_rows(reward, rows, texts, r, state or RewardState(0, 0))
            values = scores.total.tolist()
            parts.append(scores)
            if rows_out is not None:
                rows_out += completion_rows(tokenizer, r, texts, scores, reward.names, range(len(rows)))
        else:
            golds = [p.gold for p in chunk for _ in range(samples)]
            values = [reward(t, g) for t, g in zip(texts, golds)]
        correct += sum(values) / samples
    model.train(was_training)
    if scores_out is not None and parts:
        scores_out.append(merge_scores(parts))
    return correct / max(len(problems), 1)


EVAL_SEED = 0x5EED  # the k evaluation samples' generator: seed + this, the same at every evaluation of the run


def evaluation(
    cfg: Config, model, tokenizer, heldout: list[Problem], device, rewards=None, at_step: int = -1, writer=None
) -> dict:
    """The held-out metrics: eval_accuracy (greedy: the mean reward, the accuracy with the built-in verifier) and,
    with --eval-samples k, eval_pass1 (the mean accuracy of k samples per problem). The samples draw from a
    generator of their own, seeded afresh each time: the training sampler's stream is untouched, and every
    evaluation of the run sees the same noise. With rewards of one's own also each function's mean
    (eval_rewards/NAME), eval_reward_none_frac and what they logged (eval_NAME); the greedy completions go to
    completions.jsonl with --log-completions (`at_step`: the steps done, less one)."""
    reward = rewards or run_rewards(cfg)
    scores, rows = [], [] if writer is not None and cfg.log_completions else None
    kw = dict(state=RewardState(at_step + 1, cfg.steps), scores_out=scores, rows_out=rows)
    # The sampler as training runs it: the same path, under the same autocast (on CUDA its own static decoder,
    # kept beside training's).
    with autocast(cfg, device):
        out = {
            "eval_accuracy": evaluate(
                model, tokenizer, heldout, cfg.max_new_tokens, device, reward, sampler=sampler(cfg), **kw
            )
        }
        if scores and cfg.reward != ["math"]:
            out.update({f"eval_rewards/{k}": v for k, v in scores[0].means(reward.names).items()})
            out["eval_reward_none_frac"] = scores[0].none_frac()
            out.update({f"eval_{k}": v for k, v in scores[0].metrics.items()})
        if rows is not None:
            writer.completions([{"split": "eval", "step": at_step, **row} for row in rows])
        if cfg.eval_samples:
            gen = torch.Generator(device=device).manual_seed(cfg.seed + EVAL_SEED)
            temperature = cfg.temperature if cfg.eval_temperature is None else cfg.eval_temperature
            sampling = dict(samples=cfg.eval_samples, temperature=temperature, truncation=cfg.eval_truncation)
            out["eval_pass1"] = evaluate(
                model,
                tokenizer,
                heldout,
                cfg.max_new_tokens,
                device,
                reward,
                **sampling,
                generator=gen,
                sampler=sampler(cfg),
            )
    return out


def measure(cfg: Config) -> str:
    """What eval_accuracy measures: the accuracy with the built-in verifier, else the mean weighted reward."""
    return "accuracy" if cfg.reward == ["math"] else "reward"


def pass1_words(metrics: dict, k: int) -> str:
    """The log's words for eval_pass1, when it was measured."""
    return f"; pass@1 over {k} samples: {metrics['eval_pass1']:.3f}" if "eval_pass1" in metrics else ""


NONFINITE_IN_A_ROW, NONFINITE_WINDOW, NONFINITE_IN_WINDOW = 3, 20, 4


def stop_if_diverged(nonfinite_steps: list[int], step: int) -> None:
    """The run stops when 3 steps in a row, or 4 of the last 20, were not finite (their updates skipped).

    One bad step is skipped and the run goes on. A streak means the run has diverged; so do bad steps that keep
    coming back between good ones (a learning rate far too high can leave the loss finite every other step while
    the policy collapses). No checkpoint is written after a non-finite step until the next finite one, so the
    newest checkpoint on disk is a good one."""
    recent = [k for k in nonfinite_steps if k > step - NONFINITE_WINDOW]
    streak = all(step - j in nonfinite_steps for j in range(NONFINITE_IN_A_ROW))
    if streak or len(recent) >= NONFINITE_IN_WINDOW:
        why = f"{NONFINITE_IN_A_ROW} in a row" if streak else f"{len(recent)} of the last {NONFINITE_WINDOW} steps"
        raise Diverged(f"step {step}: loss or gradient not finite, {why}; stopping (try a lower --lr)")


def check_finite_weights(policy, when: str) -> None:
    """Weights that are not finite are never saved (as a checkpoint or final/) nor evaluated: the run stops."""
    if not all(torch.isfinite(p).all() for p in policy.parameters()):
        raise Diverged(f"{when}: the policy's weights are not finite; stopping (try a lower --lr)")


def reward_of(task: str):
    """The task's verifier, (completion, gold) -> 0.0 or 1.0: reward.math_reward, or for MATH-style answers
    math_verifier.symbolic_reward (imported here: math-verify is the [math] extra)."""
    if task == "math":
        from problems.math_verifier import symbolic_reward

        return symbolic_reward
    return math_reward


def run_rewards(cfg: Config) -> Rewards:
    """The run's reward functions (--reward, --reward-weights; rewards.py): `math` is the task's verifier."""
    kw = dict(answer_field=cfg.answer_field, symbolic=cfg.task == "math", score=reward_of(cfg.task))
    return load_rewards(cfg.reward, cfg.reward_weights, **kw)


def score_rows(rewards: Rewards, rows: list[Problem], texts: list[str], ro: Rollout, state: RewardState) -> Scores:
    """Every reward function on N decoded completions, called as TRL calls them (rewards.py): `rows` are their
    problems, one a completion (group-major)."""
    completion_ids = [ids[m.bool()].tolist() for ids, m in zip(ro.completion_ids.cpu(), ro.completion_mask.cpu())]
    completions = [t if p.messages is None else [{"role": "assistant", "content": t}] for p, t in zip(rows, texts)]
    keys = dict.fromkeys(k for p in rows for k in p.reward_columns)
    columns = {k: [p.reward_columns.get(k) for p in rows] for k in keys}
    return rewards.score([p.prompt for p in rows], completions, completion_ids, columns, state)


def merge_scores(parts: list[Scores]) -> Scores:
    """The Scores of several batches as one (evaluation's chunks): rows concatenated, logged metrics averaged."""
    metrics = {}
    for p in parts:
        for k, v in p.metrics.items():
            metrics.setdefault(k, []).append(v)
    parts_ = torch.cat([p.parts for p in parts], dim=1)
    total = torch.cat([p.total for p in parts])
    return Scores(parts_, total, {k: sum(v) / len(v) for k, v in metrics.items()}, {})


def completion_rows(tokenizer, ro: Rollout, texts: list[str], scores: Scores, names: list[str], rows) -> list[dict]:
    """completions.jsonl's rows for the completions `rows` of a batch: the prompt as the policy saw it (padding
    dropped), the completion as the rewards read it, the weighted reward, each function's (None: no opinion) and
    what log_extra added."""
    out = []
    for i in rows:
        prompt = tokenizer.decode(ro.prompt_ids[i][ro.prompt_mask[i].bool()], skip_special_tokens=False)
        parts = {n: (None if math.isnan(x) else x) for n, x in zip(names, scores.parts[:, i].tolist())}
        row = {"prompt": prompt, "completion": texts[i], "reward": scores.total[i].item(), "rewards": parts}
        for column, values in scores.extras.items():
            if len(values) == len(texts):
                row[column] = values[i]
        out.append(row)
    return out


LOG_SEED = 0x10C5  # the rows --log-completions shows: drawn with seed * 1_000_003 + step + this, apart from training


def logged_rows(cfg: Config, tokenizer, step: int, res: StepResult, scores: Scores | None, names) -> list[dict]:
    """--log-completions N: N of the step's completions, drawn afresh from a generator of their own (the
    training's random streams are untouched), with their advantages."""
    ro = res.rollout
    n = ro.completion_ids.shape[0]
    pick = sorted(random.Random(cfg.seed * 1_000_003 + step + LOG_SEED).sample(range(n), min(cfg.log_completions, n)))
    ids = torch.where(ro.completion_mask.bool(), ro.completion_ids, tokenizer.pad_token_id)  # (N, T)
    texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
    if scores is None:  # the step's scores are lost (a checkpoint from before --log-completions existed)
        nan = torch.full((len(names), n), math.nan)
        scores = Scores(nan, res.rewards.float().cpu())
    rows = completion_rows(tokenizer, ro, texts, scores, names, pick)
    return [
        {
            "split": "train",
            "step": step,
            "row": i,
            "group": i // cfg.group_size,
            **row,
            "advantage": res.batch.advantages[i].item(),
        }
        for i, row in zip(pick, rows)
    ]


def reward_metrics(scores: Scores | None, names: list[str]) -> dict:
    """The step's rewards/NAME (each function's mean over the completions it scored), reward_none_frac and what
    the functions logged (log_metric)."""
    if scores is None:
        return {}
    out = {f"rewards/{k}": v for k, v in scores.means(names).items()}
    out["reward_none_frac"] = scores.none_frac()
    out.update(scores.metrics)
    return out


def lr_at(cfg: Config, step: int) -> float:
    """The learning rate of step k (every inner step of it), as transformers' schedulers give it for optimizer step
    k (TRL's lr_scheduler_type): a warm-up from 0 over the first W = ceil(--warmup-ratio x --steps) steps, then
    constant, linear to 0 or cosine to 0 at --steps. A function of the step alone: a resume needs no state."""
    warmup = math.ceil(cfg.warmup_ratio * cfg.steps)
    if step < warmup:
        return cfg.lr * (float(step) / float(max(1, warmup)))
    if cfg.lr_scheduler == "constant":
        return cfg.lr
    if cfg.lr_scheduler == "linear":
        return cfg.lr * max(0.0, float(cfg.steps - step) / float(max(1, cfg.steps - warmup)))
    progress = float(step - warmup) / float(max(1, cfg.steps - warmup))
    return cfg.lr * max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress)))


def verifier(tokenizer, problems: list[Problem], group_size: int, reward=math_reward):
    """A reward_fn of `reward` (completion, gold) -> float on each decoded completion against its prompt's gold:
    the loop's scorer (`Draw.scorer`) for one per-completion function, what tests of the decoding call."""
    golds = [p.gold for p in problems for _ in range(group_size)]

    def reward_fn(ro: Rollout) -> torch.Tensor:
        # Rows are group-major: row i belongs to prompt i // G, whose gold answer is golds[i].
        ids = torch.where(ro.completion_mask.bool(), ro.completion_ids, tokenizer.pad_token_id)  # (N, T)
        texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
        return torch.tensor([reward(c, g) for c, g in zip(texts, golds)], device=ro.completion_ids.device)

    return reward_fn


class Draw:
    """The loop's `draw(n, start)`: the next n steps' prompts, in stream order, each with its scorer (a refresh
    samples them all at once). `scored` keeps each step's Scores (its reward functions' figures) until its
    metrics row is written; a checkpoint holds those of its unfinished cycle."""

    def __init__(self, cfg: Config, tokenizer, stream: PromptStream, rewards: Rewards, device):
        self.cfg, self.tokenizer, self.stream, self.rewards, self.device = cfg, tokenizer, stream, rewards, device
        self.scored: dict[int, Scores] = {}

    def __call__(self, n: int, start: int) -> list:
        batches = [self.stream.next(self.cfg.prompts_per_step) for _ in range(n)]
        state = RewardState(start, self.cfg.steps, self.stream.position / len(self.stream.problems))
        return [
            (*encode_prompts(self.tokenizer, b, self.device), self.scorer(b, start + j, state))
            for j, b in enumerate(batches)
        ]

    def scorer(self, problems: list[Problem], k: int, state: RewardState):
        """Rollout -> (N,) rewards of step k's batch: the reward functions on its decoded completions."""
        rows = [p for p in problems for _ in range(self.cfg.group_size)]  # group-major, as the rollout's rows

        def reward_fn(ro: Rollout) -> torch.Tensor:
            ids = torch.where(ro.completion_mask.bool(), ro.completion_ids, self.tokenizer.pad_token_id)  # (N, T)
            texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
            self.scored[k] = score_rows(self.rewards, rows, texts, ro, state)
            return self.scored[k].total.to(ro.completion_ids.device)

        return reward_fn


def setup(cfg: Config, writer: RunWriter, train_set: list[Problem], heldout: list[Problem]):
    """The policy, its frozen copies and optimizer, the tokenizer, and the prompts that fit its context."""
    # The built-in tiny policy (tiny.py) or any transformers causal LM; an unloadable one is a ConfigError.
    policy, tokenizer = load_policy(cfg, log=writer.log)
    context = getattr(policy.config, "max_position_embeddings", None)
    if context and context <= cfg.max_new_tokens:
        raise ConfigError(f"--max-new-tokens {cfg.max_new_tokens} leaves no room for a prompt in {context} tokens")
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
    models = make_models(cfg, policy)
    return models, tokenizer, train_set, heldout


def checkpoint_state(
    models: Models, gen, stream: PromptStream, cycle: Cycle | None, step: int, start: dict, wall: float, scored=None
) -> dict:
    """Everything the next step reads, so that a resumed run continues bit for bit.

    The unfinished refresh cycle is saved too: its batches were drawn from alpha, a policy up to v - 1 steps
    old that the current weights cannot reproduce (with their rewards and log alpha). The sampling
    generator's state and the data position (already past the cycle's prompts) make the next cycle's
    samples those of the uninterrupted run. So are the reward functions' own figures for the cycle's later steps
    (`scored`: each step's Scores), which its metrics rows report.
    """
    state = {
        "policy": policy_state(models.policy),
        "optimizer": models.opt.state_dict(),
        "rng": rng_state(gen),
        "step": step,
        "data_position": stream.position,
        "eval_accuracy_start": start.get("eval_accuracy"),
        "eval_pass1_start": start.get("eval_pass1"),
        "wall_s": wall,
    }
    if cycle is not None and cycle.covers(step):
        state["cycle"] = cycle.state()
        state["scores"] = {
            k: {
                "parts": sc.parts,
                "total": sc.total,
                "metrics": sc.metrics,
                "extras": json.dumps(sc.extras, default=str),
            }
            for k, sc in (scored or {}).items()
            if k >= step
        }
    if models.ref is not None:
        state["ref"] = models.ref.state_dict()
    return state


def restore(cfg: Config, models: Models, gen, stream: PromptStream, writer: RunWriter):
    """Load the newest readable checkpoint into the models; returns (step, the start's held-out metrics, wall
    seconds, the unfinished refresh cycle or None, the reward functions' Scores of its steps)."""
    # Complete means renamed into place after an fsync; a file damaged since (a truncated copy, a bad disk) is
    # passed over for the one before it, with a notice naming both.
    found = checkpoints(cfg.out)
    if not found:
        raise ConfigError(f"--resume: no complete checkpoint in {checkpoint_dir(cfg.out)}")
    for path in reversed(found):
        try:
            ck = load_checkpoint(path)  # torch.load(weights_only=True): a checkpoint is data, never code
            break
        except Exception as e:  # a damaged file raises whatever the zip or unpickling layer meets first
            reason = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
            writer.log(f"--resume: {path} cannot be read ({reason}); trying the one before it")
    else:
        raise ConfigError(f"--resume: no readable checkpoint in {checkpoint_dir(cfg.out)} (newest: {found[-1]})")
    if path != found[-1]:
        writer.log(f"--resume: {found[-1]} was unreadable; resuming from {path}")
    load_policy_state(models.policy, ck["policy"])
    cycle = Cycle.from_state(ck["cycle"], cfg.device) if "cycle" in ck else None
    if models.ref is not None:
        models.ref.load_state_dict(ck["ref"])
    models.opt.load_state_dict(ck["optimizer"])
    set_rng_state(ck["rng"], gen)
    stream.position = ck["data_position"]
    # Steps after the checkpoint were logged by the run that died; they will be logged again.
    writer.truncate_metrics(ck["step"])
    writer.log(f"resumed from {path} at step {ck['step']}")
    start = {"eval_accuracy": ck["eval_accuracy_start"], "eval_pass1": ck.get("eval_pass1_start")}
    scored = {
        k: Scores(sc["parts"], sc["total"], sc["metrics"], json.loads(sc["extras"]))
        for k, sc in ck.get("scores", {}).items()
    }
    return ck["step"], {k: x for k, x in start.items() if x is not None}, ck["wall_s"], cycle, scored


def metrics_row(step: int, res: StepResult, group_size: int, wall_s: float, step_s: float, device) -> dict:
    """The step's line of metrics.jsonl (docs/metrics.md)."""
    # Means over the step's N samples or its completion tokens; the clip and rho' figures are update()'s.
    ro, rewards = res.rollout, res.rewards
    groups = rewards.view(-1, group_size)  # (B, G)
    cm = ro.completion_mask.float()  # (N, T)
    n_tok = cm.sum().item()
    t = res.times
    # The step's statistics (loss, clip fractions, rho', sampler_mismatch) come as they are.
    return {
        "step": step,
        "wall_s": wall_s,
        "reward": rewards.mean().item(),
        "accuracy": (rewards == 1.0).float().mean().item(),
        "zero_std_frac": (groups.amax(1) == groups.amin(1)).float().mean().item(),
        "completion_len": cm.sum(1).mean().item(),
        "truncated_frac": ro.truncated.float().mean().item(),
        "entropy": (ro.entropy * cm).sum().item() / max(n_tok, 1),
        **res.stats,
        "t_sample": t["refresh"] + t["sample"],  # a cycle's sampling is billed to its refresh step
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
    # ---- setup: flags, data, policy and its copies, the seeded generator ----
    validate(cfg)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    # Bad rewards and bad data fail here, before anything is written.
    rewards = run_rewards(cfg)
    train_set, heldout = load_data(cfg, rewards)
    writer = RunWriter(cfg)  # refuses a folder that holds another run, or that another process writes
    try:
        return run(cfg, writer, train_set, heldout, rewards)
    except BaseException:
        writer.discard_if_unstarted()  # a start that fails before its first step leaves --out unclaimed
        raise
    finally:
        writer.close()  # the folder is free again, however the run ended


def load_data(cfg: Config, rewards: Rewards) -> tuple[list[Problem], list[Problem]]:
    """(train, held-out) problems: the --task, or the --dataset's rows, written as --system-prompt, --instruction and
    --no-chat-template say (tasks.py)."""
    prompting = Prompting(cfg.system_prompt, cfg.instruction, cfg.chat_template)
    if cfg.dataset is None:
        return load_task(cfg.task, cfg.data_files, cfg.eval_files, cfg.eval_size, prompting)
    fields = dict(prompt_field=cfg.prompt_field, answer_field=cfg.answer_field, answer_required=rewards.needs_answer)
    where = dict(config=cfg.dataset_config, split=cfg.split, eval_split=cfg.eval_split, eval_files=cfg.eval_files)
    return load_dataset_problems(cfg.dataset, **where, eval_size=cfg.eval_size, **fields, prompting=prompting)


def run(
    cfg: Config, writer: RunWriter, train_set: list[Problem], heldout: list[Problem], rewards: Rewards | None = None
) -> dict:
    """The run itself, in its claimed folder: the policy, resume or the first evaluation, the loop, the end."""
    device = torch.device(cfg.device)
    if overlap := len({p.question for p in heldout} & {p.question for p in train_set}):
        writer.log(f"warning: {overlap} of the {len(heldout)} held-out questions are also training questions")
    models, tokenizer, train_set, heldout = setup(cfg, writer, train_set, heldout)
    rewards = rewards or run_rewards(cfg)
    writer.record({"reward_names": rewards.names, **prompt_record(tokenizer, train_set[0])})
    gen = torch.Generator(device=device).manual_seed(cfg.seed)  # the sampling generator
    v = cfg.offpolicy_steps
    schedule = (
        f"every {v} steps, the next {v} batches at once (log alpha: {cfg.alpha_logp_from})" if v > 1 else "every step"
    )
    writer.log(f"sampling path: {sampling_path(models.policy, cfg.fast)}; the policy samples {schedule}")
    stream = PromptStream(train_set, cfg.seed)
    draw = Draw(cfg, tokenizer, stream, rewards, device)  # the prompts of a refresh's steps, and their scorers

    # ---- resume, or evaluate the starting policy ----
    # A resumed run keeps its wall clock and its start's held-out metrics, so its summary reads like one run's.
    start_step, wall_before, cycle = 0, 0.0, None
    if cfg.resume:
        start_step, start, wall_before, cycle, draw.scored = restore(cfg, models, gen, stream, writer)
    t0 = time.time() - wall_before
    if not cfg.resume:
        # Evaluation draws no random numbers from the sampler's generator: skipping it (--no-eval-start) leaves the
        # run as it is.
        start = (
            evaluation(cfg, models.policy, tokenizer, heldout, device, rewards, -1, writer) if cfg.eval_start else {}
        )
    if start:
        acc, pass1 = start["eval_accuracy"], pass1_words(start, cfg.eval_samples)
        writer.log(f"held-out greedy {measure(cfg)} before training: {acc:.3f} ({len(heldout)} problems){pass1}")
    # The bar counts from the resumed step, so its rate and time left are those of the remaining steps.
    bar_kw = dict(desc="grpo", dynamic_ncols=True, disable=not cfg.progress, initial=start_step, total=cfg.steps)
    bar = tqdm(range(start_step, cfg.steps), **bar_kw)
    # ---- the loop: B prompts, one GRPO step (steps 1-6 in step.py), bookkeeping ----
    nonfinite = []  # the steps whose update was skipped as not finite (stop_if_diverged)
    for step in bar:
        t_step = time.time()
        for group in models.opt.param_groups:  # --lr-scheduler: a function of the step
            group["lr"] = lr_at(cfg, step)
        try:
            # A refresh step samples its cycle's batches (draw) at once; the others take theirs from it.
            res, cycle = grpo_step(cfg, models, tokenizer, step, gen, cycle, functools.partial(draw, start=step))
        except FloatingPointError:
            # The sampler's logits are not finite: a diverged policy. The step counts as non-finite.
            writer.metrics({"step": step, "wall_s": time.time() - t0, "nonfinite_updates": 1, "nonfinite_logits": 1})
            nonfinite.append(step)
            stop_if_diverged(nonfinite, step)
            continue
        # Bookkeeping: the metrics row, held-out accuracy every --eval-every steps, the divergence guard.
        row = metrics_row(step, res, cfg.group_size, time.time() - t0, time.time() - t_step, device)
        scores = draw.scored.pop(step, None)
        row.update(lr=lr_at(cfg, step), **reward_metrics(scores, rewards.names))
        if cfg.log_completions:
            writer.completions(logged_rows(cfg, tokenizer, step, res, scores, rewards.names))
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.steps:
            row.update(evaluation(cfg, models.policy, tokenizer, heldout, device, rewards, step, writer))
        writer.metrics(row)
        show(bar, row)
        if res.stats.get("nonfinite_updates"):
            nonfinite.append(step)
        stop_if_diverged(nonfinite, step)
        # No checkpoint of a non-finite step, nor of weights that are not finite: the newest one stays a good one.
        if cfg.save_every and (step + 1) % cfg.save_every == 0 and step not in nonfinite:
            check_finite_weights(models.policy, f"step {step}")
            state = checkpoint_state(models, gen, stream, cycle, step + 1, start, time.time() - t0, draw.scored)
            with signals_wait():
                save_checkpoint(cfg.out, state, step + 1, cfg.keep_checkpoints)

    # ---- the end: held-out accuracy, summary.json, final/ and curves.png ----
    check_finite_weights(models.policy, "the end of the run")
    end = evaluation(cfg, models.policy, tokenizer, heldout, device, rewards, cfg.steps - 1, writer)
    summary = {f"{k}_{when}": m.get(k) for k in end for when, m in (("start", start), ("end", end))}
    summary.update(steps=cfg.steps, wall_s=time.time() - t0, eval_size=len(heldout), out=str(writer.out))
    acc_start, acc_end = start.get("eval_accuracy"), end["eval_accuracy"]
    gain = "start not evaluated" if acc_start is None else f"start {acc_start:.3f}, {acc_end - acc_start:+.3f}"
    pass1 = pass1_words(end, cfg.eval_samples)
    writer.log(f"held-out greedy {measure(cfg)} after training:  {acc_end:.3f} ({gain}){pass1}")
    with signals_wait():
        writer.finish(models.policy, tokenizer, summary)
    return summary


def where_the_run_stands(out: str, steps: int) -> str:
    """The steps done, the newest checkpoint, and how to continue: for the line of a stopped run."""
    last = None
    try:
        with open(Path(out) / "metrics.jsonl", errors="replace") as f:
            for line in f:
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    last = json.loads(line)["step"]
    except OSError:
        pass
    done = f"{0 if last is None else last + 1} of {steps} steps done"
    ck = latest_checkpoint(out)
    if ck is None:
        return f"{done}; no checkpoint to resume from (--save-every writes them)"
    return f"{done}, newest checkpoint {ck.name}; continue with: python train.py --resume --out {out}"


def out_of_memory(cfg: Config, e: torch.OutOfMemoryError) -> str:
    """The line of a run that ran out of device memory: what ran out, the flags that bound it, where the run stands."""
    what = (str(e).strip().splitlines() or ["out of memory"])[0][:160]
    mb = cfg.micro_batch or "auto"
    levers = (
        f"lower --micro-batch (now {mb}: sequences per forward/backward) or --sample-rows (now {cfg.sample_rows}: "
        "rows per generate call), or add --gradient-checkpointing"
    )
    return f"out of memory ({what}); {levers}; {where_the_run_stands(cfg.out, cfg.steps)}"


def main(argv: list[str] | None = None) -> int:
    """The CLI. Every expected failure is one line on stderr: exit 2 for bad input (or a disk that fails), 3 for a
    diverged run, 130 for Ctrl-C and 143 for SIGTERM."""
    handlers = {sig: signal.signal(sig, stop_on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    args, given = parse_args(argv)
    cfg = None
    try:
        cfg = config_from_args(args, given)
        train(cfg)
    except (ConfigError, TaskError, RewardError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # A diverged run is not bad input: its own status, so scripts can tell the two apart.
    except Diverged as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except Stopped as e:
        where = "" if cfg is None else f"; {where_the_run_stands(cfg.out, cfg.steps)}"
        print(f"stopped by {e}{where}", file=sys.stderr)
        return e.exit_status
    except torch.OutOfMemoryError as e:
        print(f"error: {out_of_memory(cfg, e)}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk, a folder made read-only under the run, ...
        where = "" if cfg is None else f"; {where_the_run_stands(cfg.out, cfg.steps)}"
        print(f"error: {e}{where}", file=sys.stderr)
        return 2
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return 0


if __name__ == "__main__":
    sys.exit(main())
