"""Helpers of tests/test_trl_grpo.py and tests/test_trl_schedule.py: a trainer on the warmed-up tiny policy, TRL's
generation rows, noisy log-probs, and a trainer subclass that records what TRL's schedule did."""

import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from conftest import TEST_WARMUP
from engine import tiny
from engine.chunked_logprobs import chunked_token_logprobs
from integrations import trl_grpo
from integrations.trl_grpo import OffPolicyGRPOConfig, OffPolicyGRPOTrainer, checksum
from problems.tasks import arithmetic_problems

G = 4  # completions per prompt in these tests


def save_policy(warm_cache: str, path) -> str:
    """The warmed-up tiny policy saved as a folder, so that every trainer loads the very same weights."""
    model, tok = tiny.load_tiny(warm_cache, TEST_WARMUP, log=lambda m: None)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def make_trainer(policy_dir, out, cls=OffPolicyGRPOTrainer, trainer_kw=None, **kw):
    """A trainer on the arithmetic training split, CPU, float32, no checkpointing: kw overrides the config,
    trainer_kw is passed to the trainer (peft_config)."""
    tok = tiny.build_tokenizer()
    train = arithmetic_problems()[0][:512]
    args = dict(
        output_dir=str(out),
        per_device_train_batch_size=32,
        num_generations=G,
        max_completion_length=8,
        learning_rate=1e-4,
        lr_scheduler_type="constant",
        max_steps=4,
        gradient_checkpointing=False,
        bf16=False,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
    )
    args.update(kw)
    config = GRPOConfig(**args) if cls is GRPOTrainer else OffPolicyGRPOConfig(**args)
    data = Dataset.from_dict({"prompt": [p.question for p in train], "gold": [p.gold for p in train]})
    return cls(
        model=policy_dir,
        reward_funcs=trl_grpo.math_reward_func,
        args=config,
        train_dataset=data,
        processing_class=tok,
        **(trainer_kw or {}),
    )


def rows(trainer, prompts: int):
    """A generation batch as TRL's sampler hands it over: each row repeated G times, group-major."""
    return [trainer.train_dataset[i] for i in range(prompts) for _ in range(G)]


def noisy(logps, mask, seed: int, scale: float = 0.3):
    """log-probs of another policy: the given ones plus fixed noise, so ratios leave the clip interval."""
    g = torch.Generator().manual_seed(seed)
    return (logps + scale * torch.randn(logps.shape, generator=g)) * mask


def sequences(batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, P+T) input ids and attention mask of a TRL batch."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    return ids, torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)


class Recorder(OffPolicyGRPOTrainer):
    """Records what TRL's schedule did, independently of the trainer's own bookkeeping:

    generations: (step, the policy's checksum, max |old_per_token_logps - log-probs of the policy then|, completions)
    losses: (step, the slice dict, pi_k's log-probs kept in it before the call, the policy's log-probs now)
    """

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        if self.model.training:
            policy, mask = self.accelerator.unwrap_model(self.model), out["completion_mask"]
            old, gap = out.get("old_per_token_logps"), None
            if old is not None:
                with torch.no_grad():
                    alpha = chunked_token_logprobs(policy, *sequences(out), mask, self.temperature)
                gap = ((alpha - old) * mask).abs().max().item()
            record = (self.state.global_step, checksum(policy), gap, out["completion_ids"].clone())
            self.generations = getattr(self, "generations", []) + [record]
        return out

    def _compute_loss(self, model, inputs):
        kept = inputs.get("pi_k_logps")
        loss = super()._compute_loss(model, inputs)
        with torch.no_grad():
            now = chunked_token_logprobs(model, *sequences(inputs), inputs["completion_mask"], self.temperature)
        self.losses = getattr(self, "losses", []) + [(self.state.global_step, inputs, kept, now)]
        return loss
