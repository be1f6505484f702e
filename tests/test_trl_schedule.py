"""integrations/trl_grpo.py on TRL's own generation schedule, in real runs: one generation every v steps (alpha),
pi_k with num_iterations > 1, resume inside a refresh period, LoRA with v > 1, the command line, two processes.

Every test runs TRL's real code on CPU with the warmed-up tiny policy (tests/trl_testing.py).
"""

import json
import os
import subprocess
import sys

import pytest

from conftest import needs

needs("trl", "trl")
# Trains or decodes a model: CI runs these again under ATEN_CPU_CAPABILITY=default (plain kernels).
pytestmark = pytest.mark.model

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from trl_testing import Recorder, make_trainer, rows, save_policy, sequences  # noqa: E402

from conftest import ROOT  # noqa: E402
from engine.chunked_logprobs import chunked_token_logprobs  # noqa: E402
from integrations import trl_grpo  # noqa: E402
from integrations.trl_grpo import checksum  # noqa: E402


@pytest.fixture(scope="module")
def policy_dir(warm_cache, tmp_path_factory):
    return save_policy(warm_cache, tmp_path_factory.mktemp("policy"))


def gap(a, b, mask) -> float:
    return ((a - b) * mask).abs().max().item()


def test_one_generation_every_v_steps(policy_dir, tmp_path):
    """v=3, 7 steps: TRL generates at steps 0, 3, 6 only, from the policy as it is then (its old_per_token_logps are
    that policy's log-probs: log alpha), and on the steps in between log pi_k (the step's own policy) moved away
    from log alpha while at generation steps pi_k = alpha."""
    v = 3
    trainer = make_trainer(policy_dir, tmp_path, cls=Recorder, offpolicy_steps=v, max_steps=7)
    trainer.train()
    assert [g[0] for g in trainer.generations] == [0, 3, 6]
    assert len({g[1] for g in trainer.generations}) == 3  # the policy moved between generations
    assert all(g[2] < 1e-5 for g in trainer.generations)  # log alpha = the generating policy's log-probs
    assert [s for s, *_ in trainer.losses] == list(range(7))
    for step, inputs, _, now in trainer.losses:
        staleness = gap(now, inputs["old_per_token_logps"], inputs["completion_mask"])
        assert (staleness < 1e-5) == (step % v == 0), (step, staleness)


def test_pi_k_with_num_iterations_is_the_slices_first_pass(policy_dir, tmp_path):
    """v=2, num_iterations=2: TRL generates every 4 steps and trains on slices A, B, A, B; the second pass over a
    slice keeps log pi_k of its first (the very tensor, equal to that policy's log-probs), while the policy moved."""
    trainer = make_trainer(policy_dir, tmp_path, cls=Recorder, offpolicy_steps=2, num_iterations=2, max_steps=6)
    trainer.train()
    assert [g[0] for g in trainer.generations] == [0, 4]
    first, second = trainer.losses[:2], trainer.losses[2:4]
    for (_, slice_a, kept_a, now_a), (_, slice_b, kept_b, now_b) in zip(first, second):
        assert slice_a is slice_b and kept_a is None  # the same slice; first pass: pi_k from its own forward
        mask = slice_a["completion_mask"]
        assert kept_b is slice_a["pi_k_logps"] and gap(kept_b, now_a, mask) < 1e-5
        assert gap(now_b, now_a, mask) > 1e-4  # the policy moved between the passes


def test_resume_mid_period_samples_what_the_uninterrupted_run_would(policy_dir, tmp_path):
    """v=3, checkpoints at steps 2 and 4 (both mid-period): resumed from step 2, the run trains on the buffered
    batches (no generation at step 2), generates at step 3 the very completions of the uninterrupted run, and ends
    with the same weights. A checkpoint without the buffer resumes as stock TRL does: a generation at once."""
    kw = dict(cls=Recorder, offpolicy_steps=3, max_steps=5, save_strategy="steps", save_steps=2)
    whole = make_trainer(policy_dir, tmp_path / "whole", **kw)
    whole.train()
    resumed = make_trainer(policy_dir, tmp_path / "resumed", **kw)
    resumed.train(resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-2"))
    assert [g[0] for g in whole.generations] == [0, 3] and [g[0] for g in resumed.generations] == [3]
    assert torch.equal(resumed.generations[0][3], whole.generations[1][3])
    assert checksum(resumed.model) == checksum(whole.model)
    bare = tmp_path / "whole" / "checkpoint-4"
    os.remove(bare / trl_grpo.BUFFER_FILE.format(0))
    fresh = make_trainer(policy_dir, tmp_path / "fresh", **kw)
    with pytest.warns(UserWarning, match="TRL generates anew"):
        fresh.train(resume_from_checkpoint=str(bare))
    assert [g[0] for g in fresh.generations] == [4]


def test_lora_with_v_4_trains_only_the_adapter(policy_dir, tmp_path):
    """PEFT (LoRA on q_proj, v_proj), v=4, beta 0.04: the run generates every 4 steps from the adapted policy, only
    adapter weights move, the base is frozen and unchanged, and pi_ref is the adapter-disabled base (as in stock
    TRL): its log-probs equal the original model's while the adapted policy's differ."""
    peft = needs("peft", "lora")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    kw = dict(cls=Recorder, trainer_kw=dict(peft_config=lora), offpolicy_steps=4, max_steps=5, beta=0.04)
    trainer = make_trainer(policy_dir, tmp_path, learning_rate=1e-3, **kw)
    before = {k: p.detach().clone() for k, p in trainer.model.named_parameters()}
    trainer.train()
    assert [g[0] for g in trainer.generations] == [0, 4] and all(g[2] < 1e-5 for g in trainer.generations)
    after = dict(trainer.model.named_parameters())
    adapter = [k for k in before if "lora_" in k]
    assert adapter and all(after[k].requires_grad for k in adapter)
    assert all(not torch.equal(before[k], after[k].detach()) for k in adapter if "lora_B" in k)
    for k in before.keys() - set(adapter):
        assert not after[k].requires_grad and torch.equal(before[k], after[k].detach()), k
    trainer.model.train()
    batch = trainer._generate_and_score_completions(rows(trainer, 4))
    base = AutoModelForCausalLM.from_pretrained(policy_dir)
    with torch.no_grad():
        base_logp = chunked_token_logprobs(base, *sequences(batch), batch["completion_mask"], 1.0)
        policy_logp = chunked_token_logprobs(trainer.model, *sequences(batch), batch["completion_mask"], 1.0)
    mask = batch["completion_mask"]
    assert gap(batch["ref_per_token_logps"], base_logp, mask) < 1e-5
    assert gap(policy_logp, base_logp, mask) > 1e-3


def test_learning_on_the_builtin_task(warm_cache, tmp_path):
    """A short run of the command line (v=4) raises held-out greedy accuracy by at least 5 points."""
    argv = ["--offpolicy-steps", "4", "--max_steps", "60", "--eval-size", "300", "--output_dir", str(tmp_path)]
    argv += ["--cache-dir", warm_cache, "--disable_tqdm", "True", "--logging_steps", "1000"]
    assert trl_grpo.main(argv) == 0
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["steps"] == 60 and s["world_size"] == 1 and s["offpolicy_steps"] == 4
    assert s["eval_accuracy_end"] - s["eval_accuracy_start"] >= 0.05, s


def test_two_processes_with_torchrun(warm_cache, tmp_path):
    """torchrun --nproc_per_node 2 (gloo on CPU, DDP by TRL/accelerate), v=4: exit 0, world_size 2, both ranks hold
    the same policy at the end, and final/ loads with transformers and holds that policy."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += ["-m", "integrations.trl_grpo", "--offpolicy-steps", "4", "--max_steps", "5"]
    cmd += ["--per_device_train_batch_size", "32", "--eval-size", "40", "--output_dir", str(tmp_path)]
    cmd += ["--cache-dir", warm_cache, "--disable_tqdm", "True"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["world_size"] == 2 and s["steps"] == 5
    policy_0, policy_1 = s["rank_checksums"]
    assert policy_0 == policy_1
    assert checksum(AutoModelForCausalLM.from_pretrained(tmp_path / "final")) == policy_0
