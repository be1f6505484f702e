"""Held-out evaluation, and the completions a run shows (--log-completions).

evaluate          the accuracy of a policy on held-out problems (Scores.accuracy's rule), or a function's mean
evaluation        the run's held-out metrics: greedy eval_accuracy, eval_pass1 over --eval-samples samples, and
                  with rewards of one's own eval_reward (the mean weighted reward) and each function's figures
logged_rows       --log-completions N: N of a step's completions with their rewards and advantages
"""

import math
import random

import torch

from bookkeeping.failures import Diverged
from config import Config
from engine.policy import autocast
from problems.prompts import completion_texts, run_rewards, score_rows
from problems.tasks import Problem, encode_prompts
from problems.user_rewards import BUILTIN, LOGGED, Rewards, RewardState, Scores, mean
from reward import math_reward
from rollout import Rollout, end_ids, generate


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
    truncation=None,
    generator: torch.Generator | None = None,
    batch_size: int = 256,
    loop=None,
    state: RewardState | None = None,
    scores_out: list | None = None,
    rows_out: list | None = None,
) -> float:
    """Held-out accuracy: the mean over problems of the share of `samples` completions each that are credited
    ([A]'s "pass@1 over k samples"). The default, one greedy completion (temperature 0), is the usual held-out
    accuracy.

    `reward`: (completion, gold) -> a float, whose mean this is, or the run's Rewards: then a completion is credited
    as Scores.credited says (the built-in verifier's credit, else a weighted reward > 0; `state` is their
    trainer_state), `scores_out` (a list) gets the Scores of all the completions (their weighted rewards among
    them), `rows_out` a dict per completion (prompt, completion, reward, rewards). `loop`: rollout.generate's
    loop (None: rollout.sample). Raises Diverged when the policy's logits are not finite."""
    was_training = model.training
    model.eval()
    correct, parts = 0.0, []
    # The same `generate` as training, so evaluation also exercises the sampling path the run uses.
    special = dict(eos_token_id=end_ids(model, tokenizer), pad_token_id=tokenizer.pad_token_id)  # every end id
    sampling = dict(temperature=temperature, truncation=truncation, generator=generator, loop=loop)
    per_call = max(1, batch_size // samples)  # problems per generate call: at most batch_size rows
    for s in range(0, len(problems), per_call):
        chunk = problems[s : s + per_call]
        ids, mask = encode_prompts(tokenizer, chunk, device)  # (b, P) left-padded
        try:
            r = generate(model, ids, mask, group_size=samples, max_new_tokens=max_new_tokens, **sampling, **special)
        except FloatingPointError:
            raise Diverged("held-out evaluation: the policy's logits are not finite; stopping") from None
        texts = completion_texts(tokenizer, r)  # rows are group-major
        if isinstance(reward, Rewards):
            rows = [p for p in chunk for _ in range(samples)]
            scores = score_rows(reward, rows, texts, r, state or RewardState(0, 0))
            values = scores.credited(reward.names).float().tolist()  # 0.0 or 1.0, never above 1
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
    cfg: Config,
    model,
    tokenizer,
    heldout: list[Problem],
    device,
    rewards=None,
    at_step: int = -1,
    writer=None,
    loop=None,
) -> dict:
    """The held-out metrics: eval_accuracy (greedy; the accuracy of metrics.jsonl: the built-in verifier's share
    credited, else the share of weighted rewards > 0) and, with --eval-samples k, eval_pass1 (the mean accuracy of
    k samples per problem). The samples draw from a generator of their own, seeded afresh each time: the training
    sampler's stream is untouched, and every evaluation of the run sees the same noise. With rewards of one's own
    (`own_rewards`) also the mean weighted reward (eval_reward), each function's mean (eval_rewards/NAME),
    eval_reward_none_frac and what they logged (eval_logged/NAME); the greedy completions go to completions.jsonl
    with --log-completions (`at_step`: the steps done, less one). `loop`: the run's sampling loop
    (train.sampling_loop), run under training's autocast."""
    reward = rewards or run_rewards(cfg)
    scores, rows = [], [] if writer is not None and cfg.log_completions else None
    kw = dict(state=RewardState(at_step + 1, cfg.steps), scores_out=scores, rows_out=rows, loop=loop)
    with autocast(cfg, device):
        out = {"eval_accuracy": evaluate(model, tokenizer, heldout, cfg.max_new_tokens, device, reward, **kw)}
        if scores and own_rewards(cfg):
            totals = scores[0].total.tolist()
            out["eval_reward"] = sum(totals) / max(len(totals), 1)
            out.update({f"eval_rewards/{k}": v for k, v in scores[0].means(reward.names).items()})
            out["eval_reward_none_frac"] = scores[0].none_frac()
            # A prefix of their own: no name a function logs can replace a held-out figure (eval_accuracy).
            out.update({f"eval_{LOGGED}{k}": v for k, v in scores[0].metrics.items()})
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
                loop=loop,
            )
    return out


def own_rewards(cfg: Config) -> bool:
    """Whether the rewards are other than the default, the built-in verifier at weight 1: then the mean weighted
    reward is not the accuracy, and the held-out metrics report it (eval_reward) and each function's figures."""
    return cfg.reward != ["math"] or cfg.reward_weights not in (None, [1.0])


def measure(cfg: Config) -> str:
    """What eval_accuracy counts (Scores.credited): the built-in verifier's credit when it is among the rewards,
    else a weighted reward > 0."""
    return "accuracy" if any(spec in BUILTIN for spec in cfg.reward) else "accuracy (weighted reward > 0)"


def eval_line(cfg: Config, metrics: dict, heldout: int, start: dict | None = None) -> str:
    """The log's line for a held-out evaluation of `heldout` problems: before training, or after it (`start` given,
    the start's metrics or {}) with the gain over the start; with rewards of one's own also the mean weighted
    reward (eval_reward), likewise."""

    def figure(key: str) -> str:
        value = metrics[key]
        if start is None:
            return f"{value:.3f}"
        before = start.get(key)
        gain = "start not evaluated" if before is None else f"start {before:.3f}, {value - before:+.3f}"
        return f"{value:.3f} ({gain})"

    pass1 = f"; pass@1 over {cfg.eval_samples} samples: {metrics['eval_pass1']:.3f}" if "eval_pass1" in metrics else ""
    reward = f"; mean reward {figure('eval_reward')}" if "eval_reward" in metrics else ""
    if start is None:
        acc = f"{figure('eval_accuracy')} ({heldout} problems)"
        return f"held-out greedy {measure(cfg)} before training: {acc}{reward}{pass1}"
    return f"held-out greedy {measure(cfg)} after training:  {figure('eval_accuracy')}{reward}{pass1}"


def merge_scores(parts: list[Scores]) -> Scores:
    """The Scores of several batches as one (evaluation's chunks): rows concatenated, logged metrics averaged."""
    metrics = {}
    for p in parts:
        for k, v in p.metrics.items():
            metrics.setdefault(k, []).append(v)
    parts_ = torch.cat([p.parts for p in parts], dim=1)
    total = torch.cat([p.total for p in parts])
    return Scores(parts_, total, {k: mean(v) for k, v in metrics.items()}, {})


def completion_rows(tokenizer, ro: Rollout, texts: list[str], scores: Scores, names: list[str], rows) -> list[dict]:
    """completions.jsonl's rows for the completions `rows` of a batch: the prompt as the policy saw it (padding
    dropped), the completion as the rewards read it, the weighted reward, each function's (None: no opinion) and
    what log_extra added."""
    out = []
    for i in rows:
        prompt = tokenizer.decode(ro.prompt_ids[i][ro.prompt_mask[i].bool()], skip_special_tokens=False)
        parts = {n: (None if math.isnan(x) else x) for n, x in zip(names, scores.parts[:, i].tolist())}
        row = {"prompt": prompt, "completion": texts[i], "reward": scores.total[i].item(), "rewards": parts}
        for column, values in scores.extras.items():  # log_extra's, under a prefix: never the row's own keys
            if len(values) == len(texts):
                row[f"{LOGGED}{column}"] = values[i]
        out.append(row)
    return out


LOG_SEED = 0x10C5  # the rows --log-completions shows: drawn with seed * 1_000_003 + step + this, apart from training


def logged_rows(cfg: Config, tokenizer, step: int, res, scores: Scores | None, names) -> list[dict]:
    """--log-completions N: N of the step's completions (res: a train.StepResult), drawn afresh from a generator of
    their own (the training's random streams are untouched), with their advantages."""
    ro = res.rollout
    n = ro.completion_ids.shape[0]
    pick = sorted(random.Random(cfg.seed * 1_000_003 + step + LOG_SEED).sample(range(n), min(cfg.log_completions, n)))
    texts = completion_texts(tokenizer, ro)
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
