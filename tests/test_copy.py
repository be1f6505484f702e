"""The algorithm's files copy into another project: advantage.py, objective.py, logprobs.py, rollout.py and the
numeric verifier, put into a package of another name, run one sampling call and one loss step there, in a fresh
interpreter that cannot see this checkout (nothing else of the project is imported, engine/decoding.py included).

It is the README's "Lift the loss" list as code: log alpha from sampling (`ro.sampler_logp`), log pi_k = log pi_theta
detached at the first inner step, loss_mask = completion_mask x valid, the whole step's `total` for each micro-batch,
dropout off (`.eval()`: the scorer's log pi_theta then equals the sampler's log alpha, `gap`)."""

import shutil
import subprocess
import sys
import textwrap

from conftest import ROOT

COPIED = ("advantage.py", "objective.py", "logprobs.py", "rollout.py", "reward.py")

SCRIPT = textwrap.dedent(
    """
    import sys

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from my_grpo import advantage, logprobs, objective, reward, rollout

    config = Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    prompts = torch.tensor([[0, 5, 6, 7], [8, 9, 10, 11]])  # (B, P) left-padded
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    G = 4
    ro = rollout.generate(model, prompts, mask, group_size=G, max_new_tokens=6, temperature=1.0,
                          eos_token_id=1, pad_token_id=0, generator=torch.Generator().manual_seed(0))
    # The verifier scores a text per row; here "i mod 2" for row i against the gold "1": every group is mixed.
    rewards = torch.tensor([reward.math_reward(f"#### {i % 2}", "1") for i in range(ro.completion_ids.shape[0])])
    advantages, valid = advantage.group_advantages(rewards, G)
    loss_mask = ro.completion_mask * valid[:, None]
    logp = logprobs.token_logprobs(model, ro.input_ids, ro.attention_mask, ro.completion_mask, 1.0)
    x = objective.LossInput(logp, ro.sampler_logp, logp.detach(), None, advantages, loss_mask)
    loss, stats = objective.policy_loss(x)
    loss.backward()
    grad = sum(p.grad.abs().sum().item() for p in model.parameters() if p.grad is not None)
    whole = [p.grad.clone() for p in model.parameters()]
    # Two micro-batches of the same step, each divided by the whole step's `total`: their gradients sum to the whole's.
    model.zero_grad()
    total = objective.aggregation_total(loss_mask, "token-mean")
    for rows in (slice(0, 3), slice(3, None)):
        ids, att, cm = ro.input_ids[rows], ro.attention_mask[rows], ro.completion_mask[rows]
        logp_mb = logprobs.token_logprobs(model, ids, att, cm, 1.0)
        x = objective.LossInput(logp_mb, ro.sampler_logp[rows], logp_mb.detach(), None, advantages[rows],
                                loss_mask[rows], total=total)
        objective.policy_loss(x)[0].backward()
    micro = max((a - p.grad).abs().max().item() for a, p in zip(whole, model.parameters()))
    gap = (logp.detach() - ro.sampler_logp).abs().max().item()
    project = sorted({"logprobs", "rollout", "decoding", "train", "config", "tasks", "reward"} & set(sys.modules))
    scores = ",".join(str(r) for r in rewards.tolist())
    print(f"rows={ro.completion_ids.shape[0]} rewards=[{scores}] loss={loss.item():.6f} grad={grad:.6f} "
          f"gap={gap:.2e} signal={int(valid.sum())} micro={micro:.2e} flat_modules={project}")
    """
)


def test_the_algorithm_copies_into_a_package_of_another_name(tmp_path):
    package = tmp_path / "my_grpo"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name in COPIED:
        shutil.copy(ROOT / name, package / name)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(tmp_path)!r})\n{SCRIPT}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    fields = dict(item.split("=", 1) for item in out.stdout.split() if "=" in item)
    assert fields["rows"] == "8"
    assert fields["flat_modules"] == "[]"  # nothing imported by a flat name: the package holds all it needs
    assert float(fields["gap"]) < 1e-5  # the copied sampler and scorer agree on log alpha
    assert fields["rewards"] == "[0.0,1.0,0.0,1.0,0.0,1.0,0.0,1.0]"  # the copied verifier scored
    assert int(fields["signal"]) == 8 and float(fields["grad"]) > 0  # a loss step with a gradient
    assert float(fields["micro"]) < 1e-6  # micro-batches, each over the whole step's total, make the whole gradient
