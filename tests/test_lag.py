"""--lag s, a constant lag, and the queue it shares with the periodic refresh (train.steps_to_draw, rollout.Queue):
the schedule step by step, --lag 0 and the first s + 1 steps against the runs they must equal bit for bit, a resume
mid-queue, log alpha of a lagged batch against the weights of step k - s read back from a checkpoint, and the
memory a queued batch holds."""

import shutil

import pytest
import torch
from safetensors.torch import load_file

import train
from bookkeeping.checkpoint import checkpoints, load_checkpoint, load_policy_state
from config import Config, ConfigError, resolve
from conftest import TEST_WARMUP, error_line, jsonl, tiny_run_args
from engine import queue_fit
from problems.prompts import Draw, PromptStream, load_problems, run_rewards
from problems.tasks import encode_prompts
from rollout import Queue, Sampled

pytestmark = pytest.mark.model  # trains the tiny model

TIMINGS = (
    "wall_s",
    "tokens_per_s",
    "peak_mem_gb",
    "peak_reserved_gb",
    "mem_gb",
    "t_sample",
    "t_score",
    "t_logprob",
    "t_update",
)
# Enough rows a step that most groups carry signal, and a learning rate that moves the weights step by step.
SIGNAL = ["--prompts-per-step", 4, "--group-size", 4, "--lr", 1e-3]


def rows_of(out) -> list[dict]:
    """metrics.jsonl without the figures that time the run."""
    return [{k: v for k, v in m.items() if k not in TIMINGS} for m in jsonl(out / "metrics.jsonl")]


def weights(out) -> dict:
    return load_file(out / "final" / "model.safetensors")


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --- the schedule ----------------------------------------------------------------------------------------------------


def drawn_by_step(steps: int, **kw) -> list[list[int]]:
    """steps_to_draw run as grpo_step runs it: the steps whose batches each step draws, from an empty queue."""
    cfg = resolve(Config(steps=steps, out="x", **kw))
    queue, out = None, []
    for k in range(steps):
        queue = queue.from_step(k) if queue is not None and queue.covers(k) else Queue(k, [])
        ahead = list(train.steps_to_draw(cfg, k, queue))
        queue = Queue(queue.start, queue.batches + [None] * len(ahead))
        out.append(ahead)
    return out


def test_the_two_schedules_draw_what_the_definitions_say():
    # Written out by hand: --lag 2 draws steps 0-2 at step 0, then step k + 2 at step k, none past the last (6).
    assert drawn_by_step(7, lag=2) == [[0, 1, 2], [3], [4], [5], [6], [], []]
    # --offpolicy-steps 3: a refresh every 3 steps, the last refresh period cut at the run's end.
    assert drawn_by_step(7, offpolicy_steps=3) == [[0, 1, 2], [], [], [3, 4, 5], [], [], [6]]
    # --lag 0 and the on-policy run: each step its own batch.
    assert drawn_by_step(4, lag=0) == drawn_by_step(4) == [[0], [1], [2], [3]]
    # The lag's first s + 1 steps draw what --offpolicy-steps s + 1 draws.
    assert drawn_by_step(8, lag=3)[0] == drawn_by_step(8, offpolicy_steps=4)[0] == [0, 1, 2, 3]
    # A lost queue (a checkpoint without one) starts again from step k: s + 1 batches, or the rest of the period.
    cfg = resolve(Config(steps=20, lag=4, out="x"))
    assert list(train.steps_to_draw(cfg, 9, Queue(9, []))) == [9, 10, 11, 12, 13]
    cfg = resolve(Config(steps=20, offpolicy_steps=4, out="x"))
    assert list(train.steps_to_draw(cfg, 9, Queue(9, []))) == [9, 10, 11]


def test_lag_with_a_refresh_period_or_below_zero_is_refused_in_one_line(tmp_path, warm_cache, main):
    line = error_line(main(*tiny_run_args(warm_cache, tmp_path / "a", "--lag", 2, "--offpolicy-steps", 4)))
    assert line == "error: --lag 2 and --offpolicy-steps 4 are two schedules of one queue; give one"
    line = error_line(main(*tiny_run_args(warm_cache, tmp_path / "b", "--lag", -1)))
    assert line == "error: --lag must be >= 0 (0 = on-policy)"


# --- bit for bit: --lag 0 is on-policy, the first s + 1 steps are --offpolicy-steps s + 1 ------------------------


def test_lag_zero_is_the_on_policy_run_bit_for_bit(tmp_path, warm_cache, main):
    runs = {}
    for name, extra in (("on", []), ("lag0", ["--lag", 0])):
        runs[name] = tmp_path / name
        assert main(*tiny_run_args(warm_cache, runs[name], *SIGNAL, *extra, steps=4)).returncode == 0
    assert same_weights(weights(runs["on"]), weights(runs["lag0"]))
    assert rows_of(runs["on"]) == rows_of(runs["lag0"])
    assert [(m["sampled_at"], m["staleness"]) for m in rows_of(runs["on"])] == [(k, 0) for k in range(4)]


@pytest.mark.parametrize("alpha_logp_from", ["recompute", "sampler"])
def test_the_first_s_plus_1_steps_of_a_lag_are_a_refresh_period_of_s_plus_1(
    tmp_path, warm_cache, main, alpha_logp_from
):
    # s = 2 over 6 steps: from step 1 on the lag draws a batch a step (the generator moves), the refresh none until 3.
    s, runs = 2, {}
    for name, extra in (("periodic", ["--offpolicy-steps", s + 1]), ("lag", ["--lag", s])):
        runs[name] = tmp_path / name
        extra += ["--alpha-logp-from", alpha_logp_from, "--log-completions", 100]
        assert main(*tiny_run_args(warm_cache, runs[name], *SIGNAL, *extra, steps=6)).returncode == 0
    periodic, lag = rows_of(runs["periodic"]), rows_of(runs["lag"])
    assert periodic[: s + 1] == lag[: s + 1]  # rewards, loss, clip and rho' figures, sampled_at, staleness: all of it
    assert [m["staleness"] for m in lag] == [0, 1, 2, 2, 2, 2]  # min(k, s)
    assert [m["staleness"] for m in periodic] == [0, 1, 2, 0, 1, 2]  # k mod v
    assert [m["sampled_at"] for m in lag] == [0, 0, 0, 1, 2, 3]
    # The batches themselves: every logged completion of the first s + 1 steps, and not those after.
    done = [[c for c in jsonl(runs[n] / "completions.jsonl") if c["split"] == "train"] for n in ("periodic", "lag")]
    first = [[c for c in d if c["step"] <= s] for d in done]
    assert first[0] == first[1] and len(first[0]) == (s + 1) * 16
    assert [c for c in done[0] if c["step"] > s] != [c for c in done[1] if c["step"] > s]


# --- the queue in a checkpoint ---------------------------------------------------------------------------------------


def test_a_lagged_run_killed_mid_queue_resumes_bit_for_bit(tmp_path, warm_cache, main):
    extra = [*SIGNAL, "--lag", 3, "--save-every", 1, "--keep-checkpoints", 10]
    full = tmp_path / "full"
    assert main(*tiny_run_args(warm_cache, full, *extra, steps=7)).returncode == 0
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    for name in ("final", "summary.json"):
        shutil.rmtree(cut / name) if (cut / name).is_dir() else (cut / name).unlink()
    for p in checkpoints(str(cut))[4:]:
        p.unlink()  # back to step 4: the queue holds steps 4-6's batches, sampled at steps 1-3
    ck = load_checkpoint(checkpoints(str(cut))[-1])
    queue = Queue.from_state(ck["queue"], "cpu")
    assert ck["step"] == 4 and queue.covers(4) and queue.end == 7
    assert [b.sampled_at for b in queue.from_step(4).batches] == [1, 2, 3]
    r = main("--resume", "--out", cut)
    assert r.returncode == 0, r.stderr[-2000:]
    assert same_weights(weights(full), weights(cut))
    assert rows_of(full) == rows_of(cut)


def test_log_alpha_of_a_lagged_batch_is_the_weights_of_step_k_minus_s_from_a_checkpoint(
    tmp_path, warm_cache, main, monkeypatch
):
    """Under recompute, log alpha came with the batch when it was sampled; recomputed now with the weights of step
    k - s (the checkpoint after k - s steps: before step k - s's update), it is equal, and it is not pi_k's."""
    s, seen = 2, {}
    real_step = train.grpo_step

    def step_spy(cfg, models, tokenizer, k, *a, **kw):
        res, queue = real_step(cfg, models, tokenizer, k, *a, **kw)
        seen[k] = (cfg, res.batch)
        return res, queue

    monkeypatch.setattr(train, "grpo_step", step_spy)
    out = tmp_path / "run"
    extra = [*SIGNAL, "--lag", s, "--save-every", 1, "--keep-checkpoints", 10]
    assert main(*tiny_run_args(warm_cache, out, *extra, steps=6)).returncode == 0
    assert sorted(seen) == list(range(6))
    saved = {load_checkpoint(p)["step"]: load_checkpoint(p)["policy"] for p in checkpoints(str(out))}
    policy = train.load_policy(seen[0][0])[0].eval()
    for k in range(s + 1, 6):  # steps whose batch was sampled after step 0: k - s >= 1 has a checkpoint
        cfg, batch = seen[k]
        load_policy_state(policy, saved[k - s])
        with torch.no_grad():
            recomputed = train.completion_logprobs(cfg, policy, batch)
        assert torch.equal(batch.alpha_logp, recomputed), k
        load_policy_state(policy, saved[k])  # the weights step k trains (pi_k): another policy, log alpha is not its
        with torch.no_grad():
            assert not torch.equal(batch.alpha_logp, train.completion_logprobs(cfg, policy, batch)), k


# --- memory: what a queued batch holds, and a queue that cannot fit -------------------------------------------------


@pytest.mark.parametrize("alpha_logp_from", ["recompute", "sampler"])
def test_a_queued_batch_holds_the_bytes_the_formula_gives(warm_cache, tmp_path, alpha_logp_from):
    # Fixed-length completions (ignore_eos): every (N, T) tensor is T = --max-new-tokens wide, the formula's case.
    cfg = resolve(
        Config(
            steps=4,
            lag=2,
            prompts_per_step=3,
            group_size=4,
            max_new_tokens=6,
            alpha_logp_from=alpha_logp_from,
            warmup_steps=TEST_WARMUP,
            cache_dir=warm_cache,
            out=str(tmp_path),
            progress=False,
            eval_size=4,
        )
    )
    rewards = run_rewards(cfg)
    train_set, _ = load_problems(cfg, rewards)
    policy, tok = train.load_policy(cfg, log=lambda m: None)
    draw = Draw(cfg, tok, PromptStream(train_set, 0), rewards, torch.device("cpu"))
    timer = train.Timer(torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    batches = train.sample_ahead(cfg, policy, tok, 0, range(0, 3), draw, gen, timer, ignore_eos=True)

    def held(b: Sampled) -> int:  # every distinct tensor the batch keeps
        ro = vars(b.rollout)
        tensors = {id(t): t for t in [*ro.values(), b.rewards, b.alpha_logp] if t is not None}
        return sum(t.numel() * t.element_size() for t in tensors.values())

    for j, b in enumerate(batches):
        prompt_len = b.rollout.prompt_ids.shape[1]
        expected = queue_fit.queue_batch_bytes(cfg, prompt_len)
        if j == 0 and alpha_logp_from == "recompute":  # step 0's own batch: alpha = pi_k, no log alpha kept
            expected -= 4 * 12 * 6
        assert held(b) == expected, j


def test_a_queue_that_cannot_fit_is_refused_with_its_size(tmp_path, warm_cache, main, monkeypatch, tok):
    monkeypatch.setattr(queue_fit, "host_available_bytes", lambda: 10**6)  # 1 MB free
    line = error_line(main(*tiny_run_args(warm_cache, tmp_path / "run", *SIGNAL, "--lag", 255, steps=300)))
    # N = 16 rows, T = 8, P the longest training prompt (encode_prompts pads the whole set to it): a batch is
    # 16 (16 P + 24 x 8 + 5) + 4 x 16 x 8 bytes (the formula tested above), 256 of them above half of 1 MB.
    cfg = resolve(Config(out="x"))
    prompt_len = encode_prompts(tok, load_problems(cfg, run_rewards(cfg))[0], "cpu")[0].shape[1]
    per_batch = 16 * (16 * prompt_len + 24 * 8 + 5) + 4 * 16 * 8
    assert line == (
        f"error: --lag 255: the queue of 256 batches drawn ahead needs {256 * per_batch / 1e9:.3g} GB (256 x "
        f"{per_batch / 1e6:.3g} MB), more than half the 0.001 GB free on cpu; lower it, or --prompts-per-step, "
        "--group-size, --max-new-tokens"
    )
    assert not (tmp_path / "run" / "config.json").exists()  # refused before the run folder is written
    assert main(*tiny_run_args(warm_cache, tmp_path / "ok", *SIGNAL, "--lag", 2)).returncode == 0  # 3 fit
    # A lag past the run's end holds no more batches than the run has steps: --lag 255 over 3 steps holds 3.
    assert main(*tiny_run_args(warm_cache, tmp_path / "short", *SIGNAL, "--lag", 255)).returncode == 0


def test_on_cuda_the_queue_is_measured_against_what_the_process_may_use(monkeypatch, tok):
    # No GPU needed: the CUDA branch reads engine.policy.available_bytes (the driver and the allocator), here 2 MB.
    seen = []
    monkeypatch.setattr(queue_fit, "available_bytes", lambda device: seen.append(device) or 2 * 10**6)
    monkeypatch.setattr(queue_fit, "host_available_bytes", lambda: pytest.fail("a CPU figure for a CUDA run"))
    cfg = resolve(Config(out="x", lag=99))
    train_set = load_problems(cfg, run_rewards(cfg))[0]
    with pytest.raises(
        ConfigError, match=r"^--lag 99: the queue of 100 batches .* more than half the 0.002 GB free on cuda:0;"
    ):
        queue_fit.check_queue_fits(cfg, tok, train_set, torch.device("cuda:0"))
    queue_fit.check_queue_fits(resolve(Config(out="x", lag=9)), tok, train_set, torch.device("cuda:0"))  # 10 fit
    assert seen == [torch.device("cuda:0")] * 2
    queue_fit.check_queue_fits(resolve(Config(out="x")), tok, train_set, torch.device("cuda:0"))  # on-policy: no queue
    assert len(seen) == 2


def test_a_reward_failure_while_the_lag_draws_resumes_to_the_uninterrupted_run(tmp_path, warm_cache, main):
    # The reward fails at step 3, which draws step 5's batch while the queue holds steps 3 and 4's (sampled at 1
    # and 2): the run checkpoints that queue with the generator and the stream as they were before the draw.
    from test_reward_failure_resume import write_reward

    reward, marker = write_reward(tmp_path, 3, "raise ValueError('the grader is down')")
    extra = [*SIGNAL, "--lag", 2, "--reward", f"{reward}:flaky"]
    assert main(*tiny_run_args(warm_cache, tmp_path / "clean", *extra, steps=6)).returncode == 0
    marker.write_text("")
    assert "the grader is down" in error_line(main(*tiny_run_args(warm_cache, tmp_path / "run", *extra, steps=6)))
    ck = load_checkpoint(checkpoints(str(tmp_path / "run"))[-1])
    assert ck["step"] == 3 and [b["sampled_at"] for b in ck["queue"]["batches"]] == [0, 1, 2]  # steps 2, 3, 4
    marker.unlink()
    r = main("--resume", "--out", tmp_path / "run")
    assert r.returncode == 0, r.stderr[-2000:]
    assert same_weights(weights(tmp_path / "clean"), weights(tmp_path / "run"))
    assert rows_of(tmp_path / "clean") == rows_of(tmp_path / "run")
