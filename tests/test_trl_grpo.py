"""integrations/trl_grpo.py: [A]'s off-policy GRPO inside TRL's GRPOTrainer, pinned to stock TRL and to objective.py.

Every test runs TRL's real code on CPU with the warmed-up tiny policy, whose groups have mixed rewards (so the
gradients and the policy's moves that the tests look at are not zero).
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("trl")
# Trains or decodes a model: CI runs these again under ATEN_CPU_CAPABILITY=default (plain kernels).
pytestmark = pytest.mark.model

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.trainer.utils import split_tensor_dict  # noqa: E402

import objective  # noqa: E402
import tiny  # noqa: E402
from advantage import group_advantages  # noqa: E402
from conftest import ROOT, TEST_WARMUP  # noqa: E402
from integrations import trl_grpo  # noqa: E402
from integrations.trl_grpo import OffPolicyGRPOConfig, OffPolicyGRPOTrainer, checksum  # noqa: E402
from logprobs import token_logprobs  # noqa: E402
from tasks import arithmetic_problems  # noqa: E402

G = 4  # completions per prompt in these tests


@pytest.fixture(scope="module")
def policy_dir(warm_cache, tmp_path_factory):
    """The warmed-up tiny policy saved as a folder, so that every trainer loads the very same weights."""
    model, tok = tiny.load_tiny(warm_cache, TEST_WARMUP, log=lambda m: None)
    path = tmp_path_factory.mktemp("policy")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def make_trainer(policy_dir, out, cls=OffPolicyGRPOTrainer, **kw):
    """A trainer on the arithmetic training split, CPU, float32, no checkpointing: kw overrides the config."""
    tok = tiny.build_tokenizer()
    train = arithmetic_problems()[0][:512]
    args = dict(
        output_dir=str(out),
        per_device_train_batch_size=32,
        num_generations=G,
        max_completion_length=8,
        learning_rate=1e-4,
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
        model=policy_dir, reward_funcs=trl_grpo.math_reward_func, args=config, train_dataset=data, processing_class=tok
    )


def rows(trainer, prompts: int):
    """A generation batch as TRL's sampler hands it over: each row repeated G times, group-major."""
    return [trainer.train_dataset[i] for i in range(prompts) for _ in range(G)]


def noisy(logps, mask, seed: int, scale: float = 0.3):
    """log-probs of another policy: the given ones plus fixed noise, so ratios leave the clip interval."""
    g = torch.Generator().manual_seed(seed)
    return (logps + scale * torch.randn(logps.shape, generator=g)) * mask


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_parity_with_stock_trl(policy_dir, tmp_path, loss_type):
    """v=1, behaviour centre, masking off, beta 0.04: loss and gradient equal stock GRPOTrainer's on the same inputs,
    over two accumulated micro-batches (so the step's normaliser is exercised, not only one micro-batch's)."""
    # use_bias_correction_kl: stock TRL's default True multiplies kl_t by pi_theta/pi_old; the k3 here is plain.
    kw = dict(
        beta=0.04,
        loss_type=loss_type,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        use_bias_correction_kl=False,
    )
    ours = make_trainer(
        policy_dir, tmp_path / "ours", offpolicy_steps=1, clip_center="behaviour", mask_zero_std=False, **kw
    )
    stock = make_trainer(policy_dir, tmp_path / "stock", cls=GRPOTrainer, **kw)
    ours.model.train()
    stock.model.train()
    batch = ours._generate_and_score_completions(rows(ours, 4))
    # Old and reference log-probs off the current policy, so that the clip acts and the KL has a gradient
    # (at pi_theta = pi_ref the k3 gradient is 0); pi_k = pi_old here, as in stock TRL.
    ref, cmask = batch["ref_per_token_logps"], batch["completion_mask"]
    batch["old_per_token_logps"], batch["ref_per_token_logps"] = noisy(ref, cmask, seed=1), noisy(ref, cmask, seed=3)
    results = {}
    for name, trainer in (("ours", ours), ("stock", stock)):
        trainer.current_gradient_accumulation_steps = 2
        trainer.model.zero_grad()
        loss = 0.0
        for micro in split_tensor_dict(batch, 2):
            step_loss = trainer.compute_loss(trainer.model, micro)
            step_loss.backward()
            loss += step_loss.item()
        results[name] = (loss, [p.grad.clone() for p in trainer.model.parameters()])
    assert abs(results["ours"][0] - results["stock"][0]) < 1e-5
    for g_ours, g_stock in zip(results["ours"][1], results["stock"][1]):
        torch.testing.assert_close(g_ours, g_stock, atol=1e-5, rtol=0)
    assert max(g.abs().max().item() for g in results["stock"][1]) > 1e-3  # a gradient that could differ


def test_offpolicy_loss_is_objective_policy_loss(policy_dir, tmp_path):
    """v > 1, current centre: the trainer's loss equals objective.policy_loss on the same tensors, with log-probs
    from logprobs.token_logprobs, advantages from advantage.group_advantages and an independent normaliser."""
    trainer = make_trainer(policy_dir, tmp_path, offpolicy_steps=3, beta=0.04)
    trainer.model.train()
    batch = trainer._generate_and_score_completions(rows(trainer, 8))
    cmask = batch["completion_mask"]
    batch["behaviour_logps"] = noisy(batch["ref_per_token_logps"], cmask, seed=2)  # a stale alpha: rho' != 1
    adv, valid = group_advantages(trainer._rewards.sum(dim=1), G)
    assert torch.equal(batch["advantages"], adv) and not valid.all() and valid.any()
    loss = trainer.compute_loss(trainer.model, batch)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attn = torch.cat([batch["prompt_mask"], cmask], dim=1)
    logp = token_logprobs(trainer.model, ids, attn, cmask, 1.0)
    mask = cmask * valid.unsqueeze(1)
    expected, st = objective.policy_loss(
        logp,
        batch["behaviour_logps"],
        logp.detach(),
        batch["ref_per_token_logps"],
        adv,
        mask,
        clip_center="current",
        beta=0.04,
        total=objective.aggregation_total(mask, "token-mean"),
    )
    rho_prime_max = objective.sampler_mismatch_stats(batch["behaviour_logps"], logp.detach(), mask)["rho_prime_max"]
    assert rho_prime_max > 1.5  # the two centres give different losses on these tensors
    assert abs(loss.item() - expected.item()) < 1e-5


class Recorder(OffPolicyGRPOTrainer):
    """Records, at every training generation, the step, alpha's and the policy's checksums, and how far the
    recorded behaviour log-probs are from alpha's own (logprobs.token_logprobs of the sampler)."""

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        gap = 0.0
        if out.get("behaviour_logps") is not None:
            ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
            attn = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
            alpha = token_logprobs(self.sampler, ids, attn, out["completion_mask"], self.temperature)
            gap = (alpha - out["behaviour_logps"]).abs().max().item()
        policy = self.accelerator.unwrap_model(self.model)
        self.records = getattr(self, "records", []) + [
            (self.state.global_step, checksum(self.sampler), checksum(policy), gap)
        ]
        return out


def test_sampler_refreshes_exactly_every_v_steps(policy_dir, tmp_path):
    """A real run, v=3: alpha changes exactly at optimizer steps 0, 3, 6 (equal to the policy right then), stays
    frozen in between while the policy moves, and the behaviour log-probs are alpha's."""
    v = 3
    trainer = make_trainer(policy_dir, tmp_path, cls=Recorder, offpolicy_steps=v, max_steps=7)
    trainer.train()
    steps = [r[0] for r in trainer.records]
    assert steps == list(range(7))
    for (step, alpha, policy, gap), prev in zip(trainer.records, [None] + trainer.records[:-1]):
        if step % v == 0:
            assert alpha == policy, step  # alpha <- pi_theta
            assert gap == 0.0  # refresh step: alpha = pi_k, no separate pass
        else:
            assert alpha == prev[1] and alpha != policy, step  # frozen while the policy moved
            assert gap < 1e-5, step
        if step > 0:
            assert (alpha != prev[1]) == (step % v == 0), step


class StubVLLM:
    """Stands in for TRL's VLLMGeneration: records each weight push and returns fixed completions."""

    def __init__(self, trainer):
        self.trainer, self.model, self.pushes = trainer, None, []

    def sync_weights(self):
        policy = self.trainer.accelerator.unwrap_model(self.trainer.model)
        self.pushes.append((self.trainer.state.global_step, checksum(self.model or policy)))

    def generate(self, prompts, images, num_generations, profiler):
        n = len(prompts) * num_generations
        return prompts, [[5, 1]] * n, [[[-0.5], [-0.1]]] * n, None


def test_vllm_receives_weights_only_at_refresh_steps(policy_dir, tmp_path):
    """With a stubbed engine, v=2: alpha is pushed at steps 0, 2, 4 and never the moving policy in between; after an
    evaluation generation (which pushes the live policy, as stock TRL does) and after a resume, alpha goes back."""
    trainer = make_trainer(policy_dir, tmp_path, offpolicy_steps=2)
    stub = trainer.vllm_generation = StubVLLM(trainer)
    trainer.use_vllm, trainer._last_loaded_step = True, -1
    policy = trainer.accelerator.unwrap_model(trainer.model)
    expected = []
    for step in range(6):
        trainer.state.global_step = step
        if step == 3:  # an evaluation generation: the live policy goes to the engine
            trainer.model.eval()
            trainer._refresh_sampler()
            trainer._generate_single_turn([[3, 4, 16]], None, {}, G)
            expected.append((step, checksum(policy)))
        trainer.model.train()
        trainer._refresh_sampler()
        if step == 5:  # as after a resume inside a window
            trainer._vllm_needs_alpha = True
        if step in (0, 2, 3, 4, 5):
            expected.append((step, checksum(trainer.sampler)))
        trainer._generate_single_turn([[3, 4, 16]], None, {}, G)
        with torch.no_grad():  # an optimizer step
            next(policy.parameters()).add_(0.01)
    assert stub.pushes == expected
    assert checksum(trainer.sampler) != checksum(policy)


def test_resume_restores_the_sampler(policy_dir, tmp_path):
    """Stopped after a checkpoint at step 3 (v=2: alpha = the policy after 2 optimizer steps), resumed: the first
    generation samples from the saved alpha, not from the initial policy nor the checkpoint's policy."""
    first = make_trainer(policy_dir, tmp_path, offpolicy_steps=2, max_steps=3, save_strategy="steps", save_steps=3)
    first.train()
    ckpt = tmp_path / "checkpoint-3"
    saved = checksum(torch.load(ckpt / trl_grpo.SAMPLER_FILE, weights_only=True))
    assert saved == checksum(first.sampler)
    resumed = make_trainer(policy_dir, tmp_path, cls=Recorder, offpolicy_steps=2, max_steps=4)
    initial = checksum(resumed.sampler)
    resumed.train(resume_from_checkpoint=str(ckpt))
    step, alpha, policy, gap = resumed.records[0]
    assert step == 3 and alpha == saved and alpha not in (initial, policy) and gap < 1e-5


def test_learning_on_the_builtin_task(warm_cache, tmp_path):
    """A short run of the command line (v=4) raises held-out greedy accuracy by at least 5 points."""
    argv = [
        "--offpolicy-steps",
        "4",
        "--max_steps",
        "60",
        "--eval-size",
        "300",
        "--output_dir",
        str(tmp_path),
        "--cache-dir",
        warm_cache,
        "--disable_tqdm",
        "True",
        "--logging_steps",
        "1000",
    ]
    assert trl_grpo.main(argv) == 0
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["steps"] == 60 and s["world_size"] == 1
    assert s["eval_accuracy_end"] - s["eval_accuracy_start"] >= 0.05, s


def test_two_processes_with_torchrun(warm_cache, tmp_path):
    """torchrun --nproc_per_node 2 (gloo on CPU, DDP by TRL/accelerate): exit 0, world_size 2, both ranks hold the
    same policy and the same alpha at the end, and final/ loads with transformers and holds that policy."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "integrations.trl_grpo",
        "--offpolicy-steps",
        "2",
        "--max_steps",
        "5",
        "--per_device_train_batch_size",
        "32",
        "--eval-size",
        "40",
        "--output_dir",
        str(tmp_path),
        "--cache-dir",
        warm_cache,
        "--disable_tqdm",
        "True",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["world_size"] == 2 and s["steps"] == 5
    (policy_0, alpha_0), (policy_1, alpha_1) = s["rank_checksums"]
    assert policy_0 == policy_1 and alpha_0 == alpha_1 and policy_0 != alpha_0
    assert checksum(AutoModelForCausalLM.from_pretrained(tmp_path / "final")) == policy_0


def test_bad_input_is_one_line_and_exit_2(capsys):
    for argv in (["--offpolicy-steps", "0"], ["--loss_type", "bnpo"], ["--task", "nope"], ["--clip_center", "one"]):
        assert trl_grpo.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err, err
