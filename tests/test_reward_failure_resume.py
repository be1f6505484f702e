"""A reward that fails mid-run (an exception, SystemExit, KeyboardInterrupt of its own) ends the run in one line,
exit 2, and leaves a run folder that `--resume` continues: to the same final weights as a run that never failed.

The reward below fails only while a marker file exists, so the resumed run calls the very same (unchanged) file."""

import textwrap

import pytest
import torch
from safetensors.torch import load_file

import train
from conftest import TEST_WARMUP
from test_run_folder import error_lines

pytestmark = pytest.mark.model

REWARD = textwrap.dedent(
    """
    import os, sys

    MARKER = {marker!r}

    def flaky(completions, answer, trainer_state, **kwargs):
        # fails at step {fail_at}'s refresh, or on the held-out set (trainer_state.max_steps is the run's steps)
        if os.path.exists(MARKER) and trainer_state.global_step == {fail_at}:
            {how}
        return [float(c.strip().endswith(a)) for c, a in zip(completions, answer)]
    """
)


def args(cache, out, reward, *extra):
    return [
        *("--steps", 6, "--offpolicy-steps", 2, "--prompts-per-step", 2, "--group-size", 4, "--eval-size", 4),
        *("--eval-every", 0, "--warmup-steps", TEST_WARMUP, "--cache-dir", cache, "--no-progress"),
        *("--reward", f"{reward}:flaky", "--out", out, *extra),
    ]


def write_reward(tmp_path, fail_at: int, how: str):
    marker = tmp_path / "fail-now"
    reward = tmp_path / "flaky.py"
    reward.write_text(REWARD.format(marker=str(marker), fail_at=fail_at, how=how))
    return reward, marker


@pytest.mark.parametrize(
    "fail_at, how",
    [
        (2, "raise SystemExit(5)"),  # at step 2's refresh, the second period's sampling
        (4, "raise KeyboardInterrupt"),  # the third period
        (2, "raise ValueError('the grader is down')"),
        (6, "sys.exit(0)"),  # the end's held-out evaluation: every step done
    ],
    ids=["exit-5-step-2", "keyboard-interrupt-step-4", "value-error-step-2", "exit-0-at-the-end"],
)
def test_a_reward_failure_mid_run_resumes_to_the_same_weights(warm_cache, tmp_path, capsys, fail_at, how):
    reward, marker = write_reward(tmp_path, fail_at, how)
    clean = [str(a) for a in args(warm_cache, tmp_path / "clean", reward)]
    assert train.main(clean) == 0  # the marker is absent: the reward never fails
    marker.write_text("")
    failing = [str(a) for a in args(warm_cache, tmp_path / "run", reward)]
    capsys.readouterr()
    assert train.main(failing) == 2
    err = error_lines(capsys.readouterr().err)
    assert len(err) == 1 and err[0].startswith("error: --reward") and "flaky" in err[0], err
    assert (tmp_path / "run" / "checkpoints").is_dir()  # a folder --resume continues
    marker.unlink()
    assert train.main(["--resume", "--out", str(tmp_path / "run"), "--no-progress"]) == 0
    a = load_file(tmp_path / "clean" / "final" / "model.safetensors")
    b = load_file(tmp_path / "run" / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_reward_failure_at_the_first_step_leaves_no_run(warm_cache, tmp_path, capsys):
    reward, marker = write_reward(tmp_path, 0, "raise SystemExit(3)")
    marker.write_text("")
    out = tmp_path / "run"
    assert train.main([str(a) for a in args(warm_cache, out, reward, "--no-eval-start")]) == 2
    assert not out.exists() or not any(out.iterdir()), list(out.iterdir())  # nothing to resume: no run there


@pytest.mark.parametrize("big", [1e20, -3e19, 3e38])
def test_rewards_too_large_for_float32_group_statistics_are_one_error(big):
    # Each reward fits float32, but the group's variance squares it: without the check every advantage would be 0
    # (1e20: the variance is inf) or NaN (3e38), silently.
    import variants
    from config import Config
    from problems.user_rewards import RewardError

    rewards = torch.tensor([big, 0.0, 0.0, 1.0])
    with pytest.raises(RewardError, match="beyond what float32 group statistics hold"):
        train.check_rewards(rewards)
    fits = torch.tensor([1e15, 0.0, 0.0, 1.0])
    assert train.check_rewards(fits) is fits  # fits: fine, and its advantages are finite
    advantages, _ = variants.recipe(Config(group_size=4)).advantages(fits, torch.Generator().manual_seed(0))
    assert torch.isfinite(advantages).all() and advantages[0] > 0
