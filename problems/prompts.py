"""What the loop feeds a step: the problems, their prompts in a seeded order, and the scorer of each batch.

load_problems     (train, held-out) problems of --task or --dataset, written as the prompt flags say
fit_to_context    drops the prompts that leave no room for --max-new-tokens in the model's context
warn_of_overlap   a warning when held-out questions are also training questions
run_rewards       the run's reward functions (--reward, --reward-weights): user_rewards.py
PromptStream      the training prompts, a fresh seeded shuffle each epoch; resumable by position
Draw              the step's `draw(k, n)`: the prompts of steps k, ..., k + n - 1, each with its scorer
completion_texts  the decoded completions of a rollout, what every reward reads
score_rows        every reward function on a batch's completions, called as TRL calls them
"""

import random

import torch

from config import Config, ConfigError
from problems.tasks import Problem, Prompting, encode_prompts, fit_context, load_dataset_problems, load_task
from problems.user_rewards import Rewards, RewardState, Scores, load_rewards
from reward import math_reward
from rollout import Rollout


def load_problems(cfg: Config, rewards: Rewards) -> tuple[list[Problem], list[Problem]]:
    """(train, held-out) problems: the --task, or the --dataset's rows, written as --system-prompt, --instruction and
    --no-chat-template say (tasks.py)."""
    prompting = Prompting(cfg.system_prompt, cfg.instruction, cfg.chat_template)
    if cfg.dataset is None:
        return load_task(cfg.task, cfg.data_files, cfg.eval_files, cfg.eval_size, prompting)
    fields = dict(prompt_field=cfg.prompt_field, answer_field=cfg.answer_field, answer_required=rewards.needs_answer)
    where = dict(config=cfg.dataset_config, split=cfg.split, eval_split=cfg.eval_split, eval_files=cfg.eval_files)
    return load_dataset_problems(cfg.dataset, **where, eval_size=cfg.eval_size, **fields, prompting=prompting)


def fit_to_context(cfg: Config, policy, tokenizer, train_set, heldout, log) -> tuple[list[Problem], list[Problem]]:
    """The problems whose prompts leave room for --max-new-tokens in the model's context; the others are skipped,
    with a count."""
    context = getattr(policy.config, "max_position_embeddings", None)
    if not context:
        return train_set, heldout
    if context <= cfg.max_new_tokens:
        raise ConfigError(f"--max-new-tokens {cfg.max_new_tokens} leaves no room for a prompt in {context} tokens")
    train_set, dropped = fit_context(tokenizer, train_set, context - cfg.max_new_tokens, "training")
    heldout, dropped_eval = fit_context(tokenizer, heldout, context - cfg.max_new_tokens, "held-out")
    if dropped or dropped_eval:
        log(
            f"skipped {dropped} training and {dropped_eval} held-out prompts longer than the "
            f"model's context ({context}) minus --max-new-tokens ({cfg.max_new_tokens})"
        )
    return train_set, heldout


def warn_of_overlap(train_set: list[Problem], heldout: list[Problem], log) -> None:
    """A warning when held-out questions are also training questions: the held-out figures would flatter the run."""
    if overlap := len({p.question for p in heldout} & {p.question for p in train_set}):
        log(f"warning: {overlap} of the {len(heldout)} held-out questions are also training questions")


def reward_of(task: str):
    """The task's verifier, (completion, gold) -> 0.0 or 1.0: reward.math_reward, or for MATH-style answers
    math_verifier.symbolic_reward (imported here: math-verify is the [math] extra)."""
    if task == "math":
        from problems.math_verifier import symbolic_reward

        return symbolic_reward
    return math_reward


def run_rewards(cfg: Config) -> Rewards:
    """The run's reward functions (--reward, --reward-weights; user_rewards.py): `math` is the task's verifier."""
    kw = dict(answer_field=cfg.answer_field, symbolic=cfg.task == "math", score=reward_of(cfg.task))
    return load_rewards(cfg.reward, cfg.reward_weights, **kw)


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


def completion_texts(tokenizer, ro: Rollout) -> list[str]:
    """The N completions as text, what the rewards read: the tokens up to and including EOS (what follows is
    padding), special tokens dropped."""
    ids = torch.where(ro.completion_mask.bool(), ro.completion_ids, tokenizer.pad_token_id)  # (N, T)
    return tokenizer.batch_decode(ids, skip_special_tokens=True)


def score_rows(rewards: Rewards, rows: list[Problem], texts: list[str], ro: Rollout, state: RewardState) -> Scores:
    """Every reward function on N decoded completions, called as TRL calls them (user_rewards.py): `rows` are their
    problems, one a completion (group-major)."""
    completion_ids = [ids[m.bool()].tolist() for ids, m in zip(ro.completion_ids.cpu(), ro.completion_mask.cpu())]
    completions = [t if p.messages is None else [{"role": "assistant", "content": t}] for p, t in zip(rows, texts)]
    keys = dict.fromkeys(k for p in rows for k in p.reward_columns)
    columns = {k: [p.reward_columns.get(k) for p in rows] for k in keys}
    return rewards.score([p.prompt for p in rows], completions, completion_ids, columns, state)


class Draw:
    """The step's `draw(k, n)`: the (prompt_ids, prompt_mask, reward_fn) of steps k, ..., k + n - 1, in stream
    order (a refresh samples them all at once; --lag s draws step k + s's at step k, `now`: the reward functions'
    trainer_state.global_step is the step that draws, as in TRL). `scored` keeps each step's Scores (its reward
    functions' figures) until its metrics row is written; a checkpoint holds those of the queue's steps."""

    def __init__(self, cfg: Config, tokenizer, stream: PromptStream, rewards: Rewards, device):
        self.cfg, self.tokenizer, self.stream, self.rewards, self.device = cfg, tokenizer, stream, rewards, device
        self.scored: dict[int, Scores] = {}

    def __call__(self, k: int, n: int, now: int | None = None) -> list:
        batches = [self.stream.next(self.cfg.prompts_per_step) for _ in range(n)]
        state = RewardState(k if now is None else now, self.cfg.steps, self.stream.position / len(self.stream.problems))
        return [
            (*encode_prompts(self.tokenizer, b, self.device), self.scorer(b, k + j, state))
            for j, b in enumerate(batches)
        ]

    def scorer(self, problems: list[Problem], k: int, state: RewardState):
        """Rollout -> (N,) rewards of step k's batch: the reward functions on its decoded completions."""
        rows = [p for p in problems for _ in range(self.cfg.group_size)]  # group-major, as the rollout's rows

        def reward_fn(ro: Rollout) -> torch.Tensor:
            self.scored[k] = score_rows(self.rewards, rows, completion_texts(self.tokenizer, ro), ro, state)
            return self.scored[k].total.to(ro.completion_ids.device)

        return reward_fn
