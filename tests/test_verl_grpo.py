"""integrations/verl_grpo.py against objective.py, advantage.py, a plain loop, and verl's own stock "vanilla" loss.

Runs only where verl is installed (CI's .venv-verl); elsewhere the whole module is skipped.
Aggregation map, verl's loss_agg_mode -> objective.py's agg, with verl's global_batch_info as its trainer sets
it (global_batch_size = all N sequences of the mini-batch, loss_scale_factor unset = the padded length T):
    token-mean              -> token-mean          (sum / loss tokens)
    seq-mean-token-mean     -> seq-mean, total=N   (mean of per-sequence token means over N sequences)
    seq-mean-token-sum-norm -> constant, max_new_tokens=T   (sum / (N * T), Dr. GRPO)
"""

import functools
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import needs

needs("verl", "verl")

import torch  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.trainer.config import RolloutCorrectionConfig  # noqa: E402
from verl.trainer.ppo.core_algos import get_adv_estimator_fn, get_policy_loss_fn  # noqa: E402
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch  # noqa: E402
from verl.workers.config import ActorConfig, PolicyLossConfig  # noqa: E402

import objective  # noqa: E402
from bookkeeping.diagnostics import drift_stats  # noqa: E402
from integrations import verl_grpo  # noqa: E402
from objective import policy_loss  # noqa: E402
from variants import corrections, reinforce  # noqa: E402
from variants.reinforce import opmd_loss, rec_loss  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
AGG_MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def actor_config(**kwargs) -> ActorConfig:
    """verl's stock ActorConfig (no field of ours), with asymmetric clip widths so low and high are told apart."""
    kwargs.setdefault("clip_ratio_low", 0.2)
    kwargs.setdefault("clip_ratio_high", 0.28)
    return ActorConfig(strategy="fsdp", rollout_n=4, ppo_micro_batch_size_per_gpu=4, **kwargs)


def set_batch_info(cfg: ActorConfig, mask: torch.Tensor, n_seqs: int, dp_size: int = 1) -> None:
    """global_batch_info as verl's ppo_loss fills it: global token count, global sequence count, DP size."""
    cfg.global_batch_info.update(
        dp_size=dp_size, batch_num_tokens=int(mask.sum()), global_batch_size=n_seqs, loss_scale_factor=None
    )


def objective_agg(mode: str, n: int, t: int) -> dict:
    """objective.py's aggregation and Z equal to verl's `mode` (see the module docstring): {"agg", "total"}."""
    return {
        "token-mean": {"agg": "token-mean", "total": None},
        "seq-mean-token-mean": {"agg": "seq-mean", "total": float(n)},
        "seq-mean-token-sum-norm": {"agg": "constant", "total": float(n * t)},
    }[mode]


def loss_input(logp, alpha_logp, pi_k_logp, adv, mask, total=None) -> objective.LossInput:
    return objective.LossInput(logp, alpha_logp, pi_k_logp, None, adv, mask, total)


def random_batch(seed: int, n: int = 8, t: int = 6, stale: bool = True):
    """verl-shaped tensors in float64: log_prob, old_log_prob (log pi_k), rollout_is_weights, A (N,), mask.

    rollout_is_weights = pi_k / alpha on response tokens and 0 on padding, as verl's rollout correction gives them.
    Every sequence keeps at least one token.
    """
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (n,), generator=g)  # (N,)
    mask = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)  # (N, T) bool
    log_prob = -torch.rand(n, t, generator=g, dtype=torch.float64) * 2  # (N, T)
    old = log_prob + (torch.rand(n, t, generator=g, dtype=torch.float64) - 0.5) * 0.8  # (N, T) log pi_k
    log_w = (torch.rand(n, t, generator=g, dtype=torch.float64) - 0.5) * 1.2  # (N, T) log pi_k / alpha
    weights = torch.exp(log_w) * mask if stale else None  # (N, T)
    adv = torch.randn(n, generator=g, dtype=torch.float64)  # (N,)
    return log_prob, old, weights, adv, mask


def verl_call(name, log_prob, old, weights, adv, mask, mode, cfg):
    """Run a registered loss as verl's ppo_loss does; returns (loss, metrics, d loss / d log_prob)."""
    lp = log_prob.clone().requires_grad_(True)
    adv_tok = adv.unsqueeze(1) * mask  # (N, T) verl broadcasts the advantage over the response mask
    loss, metrics = get_policy_loss_fn(name)(
        old_log_prob=old,
        log_prob=lp,
        advantages=adv_tok,
        response_mask=mask,
        loss_agg_mode=mode,
        config=cfg,
        rollout_is_weights=weights,
    )
    loss.backward()
    return loss.detach(), metrics, lp.grad


def sampler_alpha_logp(old, weights):
    """log alpha = log pi_k - log rho'; on padding (weight 0) any finite value, it is masked out."""
    if weights is None:
        return old
    return old - torch.log(torch.where(weights > 0, weights, torch.ones_like(weights)))


# --------------------------------------------------------------------------- registration


def test_registered_under_verl_names():
    assert get_policy_loss_fn("offpolicy_grpo") is verl_grpo.offpolicy_grpo_loss
    assert get_policy_loss_fn("rec") is verl_grpo.rec_loss
    assert get_policy_loss_fn("rec_is") is verl_grpo.rec_is_loss
    assert get_policy_loss_fn("opmd") is verl_grpo.opmd_loss
    assert get_adv_estimator_fn("grpo_masked") is verl_grpo.grpo_masked_advantage


def test_loaded_by_verl_external_modules_variable():
    # What a Ray worker does: `import verl` reads VERL_USE_EXTERNAL_MODULES and imports the plugin itself.
    code = "import verl.trainer.ppo.core_algos as c; print(c.get_policy_loss_fn('offpolicy_grpo').__module__)"
    env = dict(os.environ, VERL_USE_EXTERNAL_MODULES="integrations.verl_grpo", PYTHONPATH=str(ROOT))
    env["OMP_NUM_THREADS"] = "1"  # every test subprocess: one thread on a shared machine
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd="/", capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "integrations.verl_grpo"


# --------------------------------------------------------------------------- offpolicy_grpo


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("seed", [1, 5])
def test_offpolicy_grpo_equals_objective_policy_loss(mode, seed):
    log_prob, old, weights, adv, mask = random_batch(seed)
    n, t = mask.shape
    cfg = actor_config()
    set_batch_info(cfg, mask, n)
    loss, metrics, grad = verl_call("offpolicy_grpo", log_prob, old, weights, adv, mask, mode, cfg)

    logp = log_prob.clone().requires_grad_(True)
    agg = objective_agg(mode, n, t)
    ref_loss, stats = policy_loss(
        loss_input(logp, sampler_alpha_logp(old, weights), old, adv, mask, agg["total"]),
        clip_eps=0.2,
        clip_eps_high=0.28,
        clip_center="pi_k",
        agg=agg["agg"],
    )
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(grad, logp.grad, rtol=1e-7, atol=1e-9)
    # The batch exercises both sides of the clip, so a wrong centre or width changes the result.
    assert stats["clip_low"] > 0 and stats["clip_high"] > 0
    assert metrics["actor/pg_clipfrac"] == pytest.approx(stats["clip_low"] + stats["clip_high"])
    mismatch = drift_stats(sampler_alpha_logp(old, weights), old, mask)
    assert metrics["actor/rho_prime_mean"] == pytest.approx(mismatch["rho_prime_mean"])
    assert metrics["actor/rho_prime_max"] == pytest.approx(mismatch["rho_prime_max"])


def test_rollout_correction_settings_give_untruncated_token_rho_prime():
    # The settings the docstring names, through verl's own rollout-correction step: the loss must then equal
    # objective.policy_loss with the sampler's log-probs as alpha_logp, not a truncated or per-sequence rho'.
    log_prob, old, weights, adv, mask = random_batch(1)
    # log alpha, what vLLM would report: pi_k / alpha = weights**2, up to e^1.2 ~ 3.3, past verl's default cap
    rollout_log_prob = old - 2.0 * torch.log(torch.where(mask, weights, torch.ones_like(weights)))  # (N, T)
    batch = DataProto.from_dict(
        tensors={"old_log_probs": old, "rollout_log_probs": rollout_log_prob, "response_mask": mask.long()}
    )
    settings = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=1e9, bypass_mode=False)
    batch, _ = compute_rollout_correction_and_add_to_batch(batch, settings)
    w = batch.batch["rollout_is_weights"]
    assert w.max() > 2.5  # a cap of verl's default size (2.0) would bind on this batch's ratios
    cfg = actor_config()
    set_batch_info(cfg, mask, mask.shape[0])
    loss, _, grad = verl_call("offpolicy_grpo", log_prob, old, w, adv, mask, "token-mean", cfg)
    logp = log_prob.clone().requires_grad_(True)
    ref_loss, _ = policy_loss(loss_input(logp, rollout_log_prob, old, adv, mask), clip_eps=0.2, clip_eps_high=0.28)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(grad, logp.grad, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_offpolicy_grpo_without_weights_is_verl_vanilla_without_dual_clip(mode):
    # rollout_is_weights=None means alpha = pi_k: [A]'s interval centres at rho' = 1, PPO's clip.
    log_prob, old, _, adv, mask = random_batch(2, stale=False)
    cfg = actor_config(clip_ratio_c=1e9)  # dual clip out of reach
    set_batch_info(cfg, mask, mask.shape[0])
    loss, metrics, grad = verl_call("offpolicy_grpo", log_prob, old, None, adv, mask, mode, cfg)
    ref_loss, ref_metrics, ref_grad = verl_call("vanilla", log_prob, old, None, adv, mask, mode, cfg)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-7, atol=1e-9)
    assert ref_metrics["actor/pg_clipfrac"] > 0
    assert metrics["actor/pg_clipfrac"] == pytest.approx(ref_metrics["actor/pg_clipfrac"])
    assert metrics["actor/ppo_kl"] == pytest.approx(ref_metrics["actor/ppo_kl"])
    assert metrics["actor/rho_prime_mean"] == 1.0


def test_clip_widths_fall_back_to_clip_ratio():
    log_prob, old, weights, adv, mask = random_batch(3)
    both = actor_config(clip_ratio=0.25, clip_ratio_low=None, clip_ratio_high=None)
    explicit = actor_config(clip_ratio_low=0.25, clip_ratio_high=0.25)
    for cfg in (both, explicit):
        set_batch_info(cfg, mask, mask.shape[0])
    a = verl_call("offpolicy_grpo", log_prob, old, weights, adv, mask, "token-mean", both)
    b = verl_call("offpolicy_grpo", log_prob, old, weights, adv, mask, "token-mean", explicit)
    torch.testing.assert_close(a[0], b[0])
    torch.testing.assert_close(a[2], b[2])


# --------------------------------------------------------------------------- [B]'s losses


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("stale", [True, False])
@pytest.mark.parametrize("name", ["rec", "rec_is", "opmd"])
def test_b_losses_equal_objective(name, stale, mode):
    log_prob, old, weights, adv, mask = random_batch(4, stale=stale)
    n, t = mask.shape
    cfg = actor_config(policy_loss=PolicyLossConfig(loss_mode=name, dro_beta=0.3))
    set_batch_info(cfg, mask, n)
    loss, metrics, grad = verl_call(name, log_prob, old, weights, adv, mask, mode, cfg)

    logp = log_prob.clone().requires_grad_(True)
    alpha_logp = sampler_alpha_logp(old, weights)
    agg = objective_agg(mode, n, t)
    x = loss_input(logp, alpha_logp, old, adv, mask, agg["total"])
    if name == "opmd":
        ref_loss, _ = opmd_loss(x, tau_reg=0.3, agg=agg["agg"])
    else:
        ref_loss, stats = rec_loss(
            x, clip_eps=0.2, clip_eps_high=0.28, importance_weight=name == "rec_is", agg=agg["agg"]
        )
        assert stats["clip_low"] + stats["clip_high"] > 0  # the one-sided mask drops tokens on this batch
        assert metrics["actor/pg_clipfrac"] == pytest.approx(stats["clip_low"] + stats["clip_high"])
    ref_loss.backward()
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(grad, logp.grad, rtol=1e-7, atol=1e-9)


def test_opmd_default_tau_is_objective_default():
    log_prob, old, weights, adv, mask = random_batch(5)
    cfg = actor_config()  # policy_loss.dro_beta unset
    set_batch_info(cfg, mask, mask.shape[0])
    loss, _, _ = verl_call("opmd", log_prob, old, weights, adv, mask, "token-mean", cfg)
    ref_loss, _ = opmd_loss(loss_input(log_prob, sampler_alpha_logp(old, weights), old, adv, mask))
    torch.testing.assert_close(loss, ref_loss, rtol=1e-7, atol=1e-9)


# --------------------------------------------------------------------------- a plain loop


def loop_loss(name, log_prob, old, weights, adv, mask, mode, eps_low=0.2, eps_high=0.28, tau_reg=0.3):
    """The four losses token by token in plain Python floats, from policy_loss's and reinforce.py's formulas.

    Returns the loss and d loss / d log_prob (each token's term depends on its own log-prob only).
    """
    n, t = mask.shape
    terms = [[0.0] * t for _ in range(n)]
    grads = [[0.0] * t for _ in range(n)]
    for i in range(n):
        a = adv[i].item()
        for j in range(t):
            if not mask[i, j]:
                continue
            lp = log_prob[i, j].item()
            rho_p = 1.0 if weights is None else weights[i, j].item()
            log_alpha = old[i, j].item() - math.log(rho_p)
            rho = math.exp(lp - log_alpha)
            if name == "offpolicy_grpo":
                # [A]'s f_eps: the interval is centred at rho'; the gradient is 0 where the clipped branch wins.
                lo, hi = max(rho_p - eps_low, 0.0), rho_p + eps_high
                unclipped, clipped = rho * a, min(max(rho, lo), hi) * a
                terms[i][j] = -min(unclipped, clipped)
                grads[i][j] = -rho * a if unclipped <= clipped else 0.0
            elif name in ("rec", "rec_is"):
                keep = (a > 0 and rho <= 1 + eps_high) or (a < 0 and rho >= 1 - eps_low)
                w = rho if name == "rec_is" else 1.0
                terms[i][j] = -a * w * lp * keep
                grads[i][j] = -a * w * keep
            else:
                d = lp - log_alpha
                terms[i][j] = -a * lp + 0.5 * tau_reg * d * d
                grads[i][j] = -a + tau_reg * d
    count = [int(mask[i].sum()) for i in range(n)]
    if mode == "token-mean":
        scale = [[1.0 / sum(count)] * t for _ in range(n)]
    elif mode == "seq-mean-token-mean":
        scale = [[1.0 / count[i] / n] * t for i in range(n)]
    else:
        scale = [[1.0 / (n * t)] * t for _ in range(n)]
    loss = sum(terms[i][j] * scale[i][j] for i in range(n) for j in range(t))
    grad = torch.tensor([[grads[i][j] * scale[i][j] for j in range(t)] for i in range(n)], dtype=log_prob.dtype)
    return loss, grad


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("stale", [True, False])
@pytest.mark.parametrize("name", ["offpolicy_grpo", "rec", "rec_is", "opmd"])
def test_losses_equal_a_plain_loop(name, stale, mode):
    log_prob, old, weights, adv, mask = random_batch(1, stale=stale)
    cfg = actor_config(policy_loss=PolicyLossConfig(loss_mode=name, dro_beta=0.3))
    set_batch_info(cfg, mask, mask.shape[0])
    loss, metrics, grad = verl_call(name, log_prob, old, weights, adv, mask, mode, cfg)
    ref_loss, ref_grad = loop_loss(name, log_prob, old, weights, adv, mask, mode)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-7, abs=1e-9)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-7, atol=1e-9)
    if name != "opmd":
        # The clip (or REC's mask) acts on this batch, so a wrong centre or width changes the result.
        assert metrics["actor/pg_clipfrac"] > 0


# --------------------------------------------------------------------------- objective.py's terms, verl's guard

LOSSES = ["offpolicy_grpo", "rec", "rec_is", "opmd"]
PER_TOKEN = {
    "offpolicy_grpo": "surrogate",
    "rec": "rec_per_token",
    "rec_is": "rec_per_token",
    "opmd": "opmd_per_token",
}


@pytest.mark.parametrize("name", LOSSES)
def test_losses_call_objective_per_token_terms(name, monkeypatch):
    # The per-token objective is objective.py's (reinforce.py's) own function, not a copy of its lines.
    calls = []
    module = objective if name == "offpolicy_grpo" else reinforce
    fn = getattr(module, PER_TOKEN[name])

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return fn(*args, **kwargs)

    monkeypatch.setattr(module, PER_TOKEN[name], spy)
    log_prob, old, weights, adv, mask = random_batch(8)
    cfg = actor_config(policy_loss=PolicyLossConfig(loss_mode=name, dro_beta=0.3))
    set_batch_info(cfg, mask, mask.shape[0])
    verl_call(name, log_prob, old, weights, adv, mask, "token-mean", cfg)
    assert len(calls) == 1
    if name == "offpolicy_grpo":
        assert calls[0]["clip_center"] == "pi_k"


@pytest.mark.parametrize("stale", [True, False])
@pytest.mark.parametrize("name", LOSSES)
def test_log_ratio_guard(name, stale):
    # Deviation 1: log pi_theta is held within 20 nats of log pi_k, as verl clamps log(pi_theta / pi_k) before exp.
    # Tokens 30 nats past pi_k on either side, with both signs of A, give the loss of the clamped log-probs and no
    # gradient; every other token is untouched.
    log_prob, old, weights, adv, mask = random_batch(9, stale=stale)
    far = torch.zeros_like(mask)  # (N, T)
    far[0, 0] = far[1, 0] = far[2, 0] = far[3, 0] = True
    shift = torch.tensor([30.0, -30.0, 30.0, -30.0], dtype=old.dtype)
    adv[:4] = torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=adv.dtype)
    log_prob[:4, 0] = old[:4, 0] + shift
    clamped = log_prob.clone()
    clamped[:4, 0] = old[:4, 0] + shift.sign() * 20.0
    cfg = actor_config(policy_loss=PolicyLossConfig(loss_mode=name, dro_beta=0.3))
    set_batch_info(cfg, mask, mask.shape[0])
    loss, _, grad = verl_call(name, log_prob, old, weights, adv, mask, "token-mean", cfg)
    ref_loss, _, ref_grad = verl_call(name, clamped, old, weights, adv, mask, "token-mean", cfg)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    assert (grad[far] == 0).all()
    torch.testing.assert_close(grad[~far], ref_grad[~far], rtol=1e-12, atol=1e-12)
    assert (grad[~far & mask] != 0).any()


# --------------------------------------------------------------------------- data-parallel invariance


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("name", ["offpolicy_grpo", "opmd"])
def test_two_ranks_give_the_one_rank_gradient(name, mode):
    # Two simulated ranks hold 3 and 9 sequences (unequal token counts). Each normalises with the global counts
    # and multiplies by dp_size, as verl's agg_loss does; DDP/FSDP then average the ranks' gradients.
    log_prob, old, weights, adv, mask = random_batch(6, n=12)
    n = mask.shape[0]
    one = actor_config()
    set_batch_info(one, mask, n, dp_size=1)
    loss_one, _, grad_one = verl_call(name, log_prob, old, weights, adv, mask, mode, one)

    ranks = [slice(0, 3), slice(3, n)]
    assert mask[ranks[0]].sum() != mask[ranks[1]].sum()
    losses, grads = [], []
    for rows in ranks:
        cfg = actor_config()
        set_batch_info(cfg, mask, n, dp_size=2)  # global counts, not this rank's
        loss, _, grad = verl_call(name, log_prob[rows], old[rows], weights[rows], adv[rows], mask[rows], mode, cfg)
        losses.append(loss)
        grads.append(grad)
    dp = len(ranks)
    torch.testing.assert_close(sum(losses) / dp, loss_one, rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(torch.cat(grads) / dp, grad_one, rtol=1e-7, atol=1e-9)


# --------------------------------------------------------------------------- M2PO and OPSM (deviation 5)


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("which", ["m2po", "opsm", "both"])
def test_masks_equal_objective_policy_loss(mode, which, monkeypatch):
    """offpolicy_grpo with OFFPOLICY_GRPO_M2_THRESHOLD / _OPSM_DELTA equals objective.policy_loss with the masks of
    variants.corrections over the call's tokens as keep_objective: the dropped tokens add 0 and stay in verl's
    normaliser (deviation 5), in value and gradient."""
    log_prob, old, weights, adv, mask = random_batch(7, n=12)
    n, t = mask.shape
    m2_threshold, delta = 0.03, 0.02
    if which != "opsm":
        monkeypatch.setenv(verl_grpo.M2_THRESHOLD_ENV, str(m2_threshold))
    if which != "m2po":
        monkeypatch.setenv(verl_grpo.OPSM_DELTA_ENV, str(delta))
    cfg = actor_config()
    set_batch_info(cfg, mask, n)
    loss, metrics, grad = verl_call("offpolicy_grpo", log_prob, old, weights, adv, mask, mode, cfg)

    alpha = sampler_alpha_logp(old, weights)
    keep = torch.ones_like(mask)
    m2po = corrections.m2po_keep_mask(alpha, old, mask, m2_threshold)
    opsm = corrections.opsm_keep_mask(alpha, log_prob, adv, mask, delta).expand_as(mask)
    if which != "opsm":
        keep = keep & m2po
        assert 0 < int((mask & ~m2po).sum()) < int(mask.sum())
        assert metrics["actor/m2po_masked_frac"] == pytest.approx((mask & ~m2po).sum().item() / mask.sum().item())
    if which != "m2po":
        keep = keep & opsm
        assert 0 < int((mask & ~opsm).sum()) < int(mask.sum())
        assert metrics["actor/opsm_masked_frac"] == pytest.approx((mask & ~opsm).sum().item() / mask.sum().item())
    logp = log_prob.clone().requires_grad_(True)
    agg = objective_agg(mode, n, t)
    adv_kept = torch.where(keep, adv.unsqueeze(1), torch.zeros_like(adv.unsqueeze(1)))  # (N, T) as the OPSM unit
    x = loss_input(logp, alpha, old, adv_kept, mask, agg["total"])
    ref_loss, _ = policy_loss(x, clip_eps=0.2, clip_eps_high=0.28, agg=agg["agg"])
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(grad, logp.grad, rtol=1e-7, atol=1e-9)
    monkeypatch.delenv(verl_grpo.M2_THRESHOLD_ENV, raising=False)
    monkeypatch.delenv(verl_grpo.OPSM_DELTA_ENV, raising=False)
    plain, _, _ = verl_call("offpolicy_grpo", log_prob, old, weights, adv, mask, mode, cfg)
    assert abs(plain.item() - loss.item()) > 1e-6  # the masks dropped something that counted


def test_mask_settings_are_checked(monkeypatch):
    log_prob, old, weights, adv, mask = random_batch(3)
    cfg = actor_config(policy_loss=PolicyLossConfig(loss_mode="rec", dro_beta=0.3))
    set_batch_info(cfg, mask, mask.shape[0])
    for env, value, match in [
        (verl_grpo.M2_THRESHOLD_ENV, "0", "m2_threshold must be > 0"),
        (verl_grpo.OPSM_DELTA_ENV, "-1", "delta must be >= 0"),
        (verl_grpo.OPSM_DELTA_ENV, "half", "not a number"),
    ]:
        monkeypatch.setenv(env, value)
        with pytest.raises(ValueError, match=match):
            verl_call("offpolicy_grpo", log_prob, old, weights, adv, mask, "token-mean", cfg)
        monkeypatch.delenv(env)
    monkeypatch.setenv(verl_grpo.OPSM_DELTA_ENV, "0.1")
    with pytest.raises(ValueError, match="offpolicy_grpo only, not rec"):
        verl_call("rec", log_prob, old, weights, adv, mask, "token-mean", cfg)


# --------------------------------------------------------------------------- M2PO's other forms and DPPO (deviation 6)

TRUST_REGION_UNITS = {
    "m2po-clip": (verl_grpo.M2PO_CLIP_ENV, 0.005, lambda: corrections.M2POClip(0.005)),
    "m2po-clip-floor": (verl_grpo.M2PO_CLIP_ENV, 0.005, lambda: corrections.M2POClip(0.005, floor=True)),
    "m2po-quadrant": (verl_grpo.M2PO_QUADRANT_ENV, 0.005, lambda: corrections.M2POQuadrant(0.005)),
    "dppo": (verl_grpo.DPPO_DELTA_ENV, 0.02, lambda: corrections.DPPO(0.02)),
}


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("opsm", [False, True])
@pytest.mark.parametrize("which", list(TRUST_REGION_UNITS))
def test_m2po_forms_and_dppo_equal_the_loops_units(mode, opsm, which, monkeypatch):
    """offpolicy_grpo with OFFPOLICY_GRPO_M2PO_CLIP_THRESHOLD (and _FLOOR), _M2PO_QUADRANT_THRESHOLD or
    _DPPO_DELTA equals the loop's unit (variants.corrections) around objective.policy_loss on the call's tokens, in
    value and gradient, with OPSM outside it as in train.py's Recipe; tests/test_m2po_forms.py pins each unit to
    its float loop."""
    env, value, make = TRUST_REGION_UNITS[which]
    log_prob, old, weights, adv, mask = random_batch(7, n=12)
    n, t = mask.shape
    monkeypatch.setenv(env, str(value))
    if which == "m2po-clip-floor":
        monkeypatch.setenv(verl_grpo.M2PO_CLIP_FLOOR_ENV, "1")
    if opsm:
        monkeypatch.setenv(verl_grpo.OPSM_DELTA_ENV, "0.02")
    cfg = actor_config()
    set_batch_info(cfg, mask, n)
    loss, metrics, grad = verl_call("offpolicy_grpo", log_prob, old, weights, adv, mask, mode, cfg)

    alpha = sampler_alpha_logp(old, weights)
    logp = log_prob.clone().requires_grad_(True)
    agg = objective_agg(mode, n, t)
    x = loss_input(logp, alpha, old, adv.unsqueeze(1) * mask, mask, agg["total"])
    settings = dict(clip_eps=0.2, clip_eps_high=0.28, clip_center="pi_k", beta=0.0, kl_estimator="k3", agg=agg["agg"])
    unit = make()
    inner = functools.partial(unit.loss, inner=policy_loss)
    ref_loss, st = corrections.OPSM(0.02).loss(x, inner=inner, **settings) if opsm else inner(x, **settings)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(grad, logp.grad, rtol=1e-7, atol=1e-9)
    for key in ("m2po_clip_lo", "m2po_clip_hi", "m2po_quadrant_masked_frac", "dppo_masked_frac", "opsm_masked_frac"):
        if key in st:
            assert metrics[f"actor/{key}"] == pytest.approx(st[key])
    if which.startswith("m2po-clip"):
        assert 1.0 <= st["m2po_clip_hi"] < 1e5
    else:
        assert st[f"{which.replace('-', '_')}_masked_frac"] > 0  # the mask dropped something
    for name in (env, verl_grpo.M2PO_CLIP_FLOOR_ENV, verl_grpo.OPSM_DELTA_ENV):
        monkeypatch.delenv(name, raising=False)
    plain, _, _ = verl_call("offpolicy_grpo", log_prob, old, weights, adv, mask, mode, cfg)
    assert abs(plain.item() - loss.item()) > 1e-6


def test_trust_region_settings_are_checked(monkeypatch):
    log_prob, old, weights, adv, mask = random_batch(3)
    cfg = actor_config()
    set_batch_info(cfg, mask, mask.shape[0])
    for envs, match in [
        ({verl_grpo.M2PO_CLIP_ENV: "0"}, "must be > 0"),
        ({verl_grpo.M2PO_QUADRANT_ENV: "x"}, "not a number"),
        ({verl_grpo.DPPO_DELTA_ENV: "-1"}, "must be >= 0"),
        ({verl_grpo.DPPO_DELTA_ENV: "0.2", verl_grpo.M2_THRESHOLD_ENV: "0.04"}, "one M2PO form or DPPO at a time"),
        ({verl_grpo.M2PO_CLIP_FLOOR_ENV: "1"}, "which is unset"),
        ({verl_grpo.M2PO_CLIP_ENV: "0.04", verl_grpo.M2PO_CLIP_FLOOR_ENV: "yes"}, "1 \\(floor"),
    ]:
        for name, value in envs.items():
            monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match=match):
            verl_call("offpolicy_grpo", log_prob, old, weights, adv, mask, "token-mean", cfg)
        for name in envs:
            monkeypatch.delenv(name)
    monkeypatch.setenv(verl_grpo.DPPO_DELTA_ENV, "0.2")
    with pytest.raises(ValueError, match="act on offpolicy_grpo, not opmd"):
        verl_call("opmd", log_prob, old, weights, adv, mask, "token-mean", cfg)
