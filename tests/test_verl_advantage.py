"""integrations/verl_grpo.py's advantage estimator `grpo_masked` against advantage.group_advantages and a plain
loop, on verl's own tensors. Runs only where verl is installed (CI's .venv-verl); elsewhere it is skipped."""

from conftest import needs

needs("verl", "verl")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from verl.trainer.config import AlgoConfig  # noqa: E402
from verl.trainer.ppo.core_algos import get_adv_estimator_fn  # noqa: E402

from advantage import group_advantages  # noqa: E402
from integrations import verl_grpo  # noqa: F401, E402 (importing it registers grpo_masked)

# --------------------------------------------------------------------------- grpo_masked


def outcome_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl's token_level_rewards: the outcome reward on each response's last token, 0 elsewhere."""
    last = mask.long().sum(dim=1) - 1  # (N,)
    out = torch.zeros(mask.shape, dtype=torch.float32)  # (N, T)
    out[torch.arange(len(rewards)), last] = rewards
    return out


def loop_advantages(rewards: list[float], index: list[str], guard: float) -> list[float]:
    """[A]'s advantage written out per group in plain Python: population std, the guard inside the sqrt, 0 if equal."""
    out = []
    for i, uid in enumerate(index):
        group = [r for r, u in zip(rewards, index) if u == uid]
        mu = sum(group) / len(group)
        var = sum((r - mu) ** 2 for r in group) / len(group)
        out.append(0.0 if max(group) == min(group) else (rewards[i] - mu) / (var + guard) ** 0.5)
    return out


def test_grpo_masked_equals_group_advantages_in_any_order():
    g_size = 4
    # Four prompts, group-major: mixed, all equal (masked), one right, three right.
    rewards = torch.tensor([1.0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1])
    n = len(rewards)
    gen = torch.Generator().manual_seed(7)
    lengths = torch.randint(1, 6, (n,), generator=gen)  # (N,)
    mask = torch.arange(5).unsqueeze(0) < lengths.unsqueeze(1)  # (N, T)
    index = np.array([f"uid-{i // g_size}" for i in range(n)], dtype=object)
    expected, valid = group_advantages(rewards, g_size)
    assert not valid[4:8].any() and (expected[4:8] == 0).all()

    est = get_adv_estimator_fn("grpo_masked")
    adv, returns = est(token_level_rewards=outcome_rewards(rewards, mask), response_mask=mask, index=index)
    torch.testing.assert_close(adv, expected.unsqueeze(1) * mask)
    assert returns is adv or torch.equal(returns, adv)

    # Shuffled rows (verl's balance_batch reorders the batch): the same advantage follows each response.
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(11))
    adv_p, _ = est(
        token_level_rewards=outcome_rewards(rewards[perm], mask[perm]),
        response_mask=mask[perm],
        index=index[perm.numpy()],
    )
    torch.testing.assert_close(adv_p, expected[perm].unsqueeze(1) * mask[perm])
    torch.testing.assert_close(
        adv_p[:, 0],
        torch.tensor(loop_advantages(rewards[perm].tolist(), list(index[perm.numpy()]), 1e-6), dtype=torch.float32),
    )


def test_grpo_masked_unequal_groups_and_no_std_scaling():
    # Groups of 3, 1 and 2 interleaved; a lone response carries no group-relative signal (0, not r).
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 0.0])
    index = np.array(["a", "b", "a", "c", "a", "c"], dtype=object)
    mask = torch.ones(6, 2, dtype=torch.bool)
    est = get_adv_estimator_fn("grpo_masked")
    adv, _ = est(token_level_rewards=outcome_rewards(rewards, mask), response_mask=mask, index=index, epsilon=0.0)
    expected = loop_advantages(rewards.tolist(), list(index), 0.0)
    torch.testing.assert_close(adv[:, 0], torch.tensor(expected))
    assert adv[1, 0] == 0.0
    # norm_adv_by_std_in_grpo=False: r - mean(r) per group ([B]'s OPMD, Dr. GRPO).
    cfg = AlgoConfig(norm_adv_by_std_in_grpo=False)
    adv, _ = est(token_level_rewards=outcome_rewards(rewards, mask), response_mask=mask, index=index, config=cfg)
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.5, 0.0, 0.0, 0.5, -0.5, -0.5]))
