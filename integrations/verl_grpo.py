"""[A]'s off-policy GRPO and [B]'s REC / OPMD as verl (0.9.1) plugins: policy losses and an advantage estimator.

Importing this module registers, with verl's own registries in `verl.trainer.ppo.core_algos`:
    policy losses  "offpolicy_grpo", "rec", "rec_is", "opmd"   (actor_rollout_ref.actor.policy_loss.loss_mode)
    advantage      "grpo_masked"                              (algorithm.adv_estimator)
Nothing else runs at import. verl's Ray workers import it when launched with VERL_USE_EXTERNAL_MODULES=verl_grpo
(and this folder on PYTHONPATH). The per-token objectives are objective.py's own `surrogate`,
`rec_per_token` and `opmd_per_token`, called on verl's tensors (tests/test_verl_grpo.py pins the losses to
`policy_loss`, `rec_loss`, `opmd_loss`); the advantages are advantage.py's `group_advantages`.

Translation of verl's inputs (legend, symbol -> verl tensor, all (N, T) with N sequences, T response tokens):
    log pi_theta -> log_prob (with grad);   log pi_k -> old_log_prob (verl's recompute at the start of the step);
    rho' = pi_k / alpha -> rollout_is_weights (None means alpha = pi_k, rho' = 1);
    log alpha = old_log_prob - log rollout_is_weights;   A -> advantages (N, T) (broadcast over the response);
    eps_low, eps_high -> actor.clip_ratio_low / clip_ratio_high (each falls back to actor.clip_ratio).
The loss is aggregated by verl's `agg_loss` with `config.global_batch_info` (global token / sequence counts and
the data-parallel size), so it does not change with the number of ranks or micro-batches. beta stays 0 here:
verl adds its own KL loss (actor.use_kl_loss=True; kl_loss_type=low_var_kl is the k3 estimator, clamped).

verl settings that make rollout_is_weights the untruncated token-level pi_k / alpha that [A] needs:
    actor_rollout_ref.rollout.calculate_log_probs=True    the sampler's log alpha (default True in 0.9.1)
    algorithm.rollout_correction.bypass_mode=False         recompute old_log_prob = log pi_k (bypass would
                                                           set old_log_prob = log alpha and drop the weights)
    algorithm.rollout_correction.rollout_is=token          per token, not the sequence product
    algorithm.rollout_correction.rollout_is_threshold=1e9  a float is a truncation cap (TIS): make it inert;
                                                           verl still clamps log rho' to [-20, 20]
    algorithm.rollout_correction.rollout_is_batch_normalize=False, rollout_rs=null   (the defaults)
A "lo_hi" threshold (IcePop) zeroes rho' outside [lo, hi]; such tokens, like padding, get no gradient here.

Staleness: which verl setting corresponds to train.py's `--offpolicy-steps v` (refresh alpha every v steps):
  - v = 1: trainer.v1.trainer_mode=sync (the default) with data.train_batch_size = actor.ppo_mini_batch_size;
    rho' is then 1 up to the rollout engine's numerics (vLLM bf16 against the trainer's fp32).
  - one-step-off (trainer.v1.trainer_mode=colocate_async with trainer.v1.colocate_async.num_warmup_batches=1,
    or the verl.experimental.one_step_off_policy recipe): alpha is always one version behind pi_k and
    old_log_prob is recomputed every step, so this is [A]'s surrogate exactly, under a constant lag of 1
    rather than [A]'s lag cycling 0..v-1. Partial rollouts mix two versions inside one response; token-level
    rho' accounts for that, a sequence-level weight would not.
  - fully async (trainer.v1.trainer_mode=separate_async with trainer.v1.separate_async.parameter_sync_step=v,
    or verl.experimental.fully_async_policy with async_training.trigger_parameter_sync_step=v): the sampler's
    weights are refreshed every v optimizer updates, as with --offpolicy-steps v. But in decoupled mode verl
    pins old_log_prob to the weights at the start of each refresh period of v updates, so rho' covers only the rollout's
    lag behind that point, and the drift within the period sits in pi_theta / pi_old, clipped around 1: for
    that part this is the alpha-centred clip (train.py --clip-center alpha), not [A]'s.
  Both experimental recipes ship with rollout_correction.bypass_mode=True: set it to False.

Deviations from objective.py:
  1. log pi_theta is clamped to within 20 nats of log pi_k (log(pi_theta / pi_k) to [-20, 20]) before it enters
     objective.py's per-token terms, as verl's own losses clamp that log-ratio before exp (numerical guard). A
     token past the bound gets no gradient, in every loss here (rec / opmd's REINFORCE term included).
  2. rho' comes from verl, which clamps log rho' to [-20, 20] (exp(20) ~ 4.9e8) even when untruncated.
  3. opmd reads tau_reg from actor.policy_loss.dro_beta (verl's coefficient of the same quadratic log-ratio
     penalty in its "dro" loss), 0.1 (reinforce.opmd_loss's default) when unset.
  4. actor/rho_prime_max is a mean over micro-batches of their maxima: verl averages every loss metric.
  5. M2PO and OPSM (offpolicy_grpo only; set by the environment variables OFFPOLICY_GRPO_M2_THRESHOLD, the M2
     threshold, and OFFPOLICY_GRPO_OPSM_DELTA delta, which verl's Ray workers inherit as they do
     VERL_USE_EXTERNAL_MODULES: verl's PolicyLossConfig takes no field of ours). verl calls the loss once per
     micro-batch, on one rank, with its normaliser counted beforehand from response_mask: M2PO's ranking runs over the
     call's tokens (AReaL's own granularity, its loss function is called per micro-batch too; train.py ranks the whole
     step, which is this with one micro-batch a step on one rank), and the tokens it drops add 0 but stay in verl's
     normaliser, where train.py takes them out. OPSM is a per-sequence mask and keeps the normaliser in train.py and TRL
     too: it is exact here. verl's KL loss (use_kl_loss) is its own term and neither mask touches it.
  6. M2PO as its authors run it, the M2PO paper's final mask and DPPO's mask (offpolicy_grpo only; one at a time,
     not with M2PO's mask): OFFPOLICY_GRPO_M2PO_CLIP_THRESHOLD (and _M2PO_CLIP_FLOOR=1), _M2PO_QUADRANT_THRESHOLD,
     _DPPO_DELTA, read as deviation 5's. Each is corrections' unit (M2POClip, M2POQuadrant, DPPO) with its own
     clip in place of clip_ratio_low / _high, on the call's tokens, as the authors' and ms-swift's losses are; the
     tokens the two masks drop add 0 and stay in verl's normaliser, as in train.py: exact here.
"""

import os
from functools import partial

import numpy as np
import torch
import verl.utils.torch_functional as verl_F
from verl.trainer.ppo.core_algos import agg_loss, register_adv_est, register_policy_loss

import advantage
import objective
from variants import corrections, reinforce

# verl's own guard on log-ratios before exp (core_algos, rollout_corr_helper)
LOG_RATIO_BOUND = 20.0
# reinforce.opmd_loss's default tau_reg, used when actor.policy_loss.dro_beta is unset
OPMD_TAU_REG_DEFAULT = 0.1
# Deviation 5: the staleness masks of offpolicy_grpo, read at each call
M2_THRESHOLD_ENV, OPSM_DELTA_ENV = "OFFPOLICY_GRPO_M2_THRESHOLD", "OFFPOLICY_GRPO_OPSM_DELTA"
# Deviation 6: M2PO's other forms and DPPO's mask (issue 57), each with its own clip; at most one, read at each call
M2PO_CLIP_ENV, M2PO_CLIP_FLOOR_ENV = "OFFPOLICY_GRPO_M2PO_CLIP_THRESHOLD", "OFFPOLICY_GRPO_M2PO_CLIP_FLOOR"
M2PO_QUADRANT_ENV, DPPO_DELTA_ENV = "OFFPOLICY_GRPO_M2PO_QUADRANT_THRESHOLD", "OFFPOLICY_GRPO_DPPO_DELTA"


def _mask_settings() -> tuple[float | None, float | None]:
    """M2PO's M2 threshold and OPSM's delta from the environment (deviation 5); None where unset. ValueError, one line,
    for a value that is not a number or out of range (corrections' checks)."""
    values = []
    for name in (M2_THRESHOLD_ENV, OPSM_DELTA_ENV):
        text = os.environ.get(name, "").strip()
        try:
            values.append(float(text) if text else None)
        except ValueError:
            raise ValueError(f"{name}={text!r}: not a number") from None
    corrections.check_m2_threshold(values[0])
    corrections.check_opsm_delta(values[1])
    return values[0], values[1]


def _trust_region_unit():
    """The unit of deviation 6 from the environment (corrections.M2POClip, M2POQuadrant or DPPO), None when none is
    set. ValueError, one line, for a value that is not a number or out of range, two set at once (M2_THRESHOLD_ENV
    included), or a floor without its threshold."""
    values = {}
    for name in (M2PO_CLIP_ENV, M2PO_QUADRANT_ENV, DPPO_DELTA_ENV):
        text = os.environ.get(name, "").strip()
        try:
            values[name] = float(text) if text else None
        except ValueError:
            raise ValueError(f"{name}={text!r}: not a number") from None
    floor_text = os.environ.get(M2PO_CLIP_FLOOR_ENV, "").strip()
    if floor_text not in ("", "0", "1"):
        raise ValueError(f"{M2PO_CLIP_FLOOR_ENV}={floor_text!r}: 1 (floor at [0.7, 1.5]) or 0")
    on = [name for name, v in values.items() if v is not None]
    on += [M2_THRESHOLD_ENV] if os.environ.get(M2_THRESHOLD_ENV, "").strip() else []
    if len(on) > 1:
        raise ValueError(f"{' and '.join(on)}: one M2PO form or DPPO at a time")
    if floor_text == "1" and values[M2PO_CLIP_ENV] is None:
        raise ValueError(f"{M2PO_CLIP_FLOOR_ENV} floors the clip of {M2PO_CLIP_ENV}, which is unset")
    if values[M2PO_CLIP_ENV] is not None:
        return corrections.M2POClip(values[M2PO_CLIP_ENV], floor_text == "1")
    if values[M2PO_QUADRANT_ENV] is not None:
        return corrections.M2POQuadrant(values[M2PO_QUADRANT_ENV])
    if values[DPPO_DELTA_ENV] is not None:
        return corrections.DPPO(values[DPPO_DELTA_ENV])
    return None


def _trust_region_loss(unit, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, weights):
    """offpolicy_grpo with deviation 6's unit: objective.surrogate with the unit's own clip (its settings), on this
    call's tokens (the authors' and ms-swift's granularity: a verl micro-batch), aggregated by verl; a token the
    unit masks adds 0 and stays in verl's normaliser, as in train.py. OPSM (OPSM_DELTA_ENV) wraps it as in TRL."""
    logp, alpha_logp, pi_k_logp, rho_prime, live = _logps(old_log_prob, log_prob, weights)
    opsm_delta = _mask_settings()[1]
    x = objective.LossInput(logp, alpha_logp, pi_k_logp, None, advantages, response_mask)
    fractions = {}

    def unit_surrogate(y: objective.LossInput, **settings):  # o_t with the unit's interval, aggregated as verl does
        clip = {k: settings[k] for k in ("clip_eps", "clip_eps_high", "clip_center")}
        o = objective.surrogate(y, **clip)  # (N, T)
        fractions["pg_clipfrac"] = (o.clip_low | o.clip_high) & live
        return _aggregate(-o.objective, live, response_mask, loss_agg_mode, config), {}

    inner = partial(unit.loss, inner=unit_surrogate)
    loss, st = inner(x) if opsm_delta is None else corrections.OPSM(opsm_delta).loss(x, inner=inner)
    fractions |= {k: float(v) for k, v in st.items()}
    return loss, _metrics(log_prob, old_log_prob, rho_prime, response_mask, **fractions)


def _clip_widths(config) -> tuple[float, float]:
    """eps_low, eps_high from verl's stock ActorConfig: clip_ratio_low / high, else clip_ratio."""
    eps = config.get("clip_ratio", 0.2)
    eps_low = config.get("clip_ratio_low", None)
    eps_high = config.get("clip_ratio_high", None)
    return (eps if eps_low is None else eps_low), (eps if eps_high is None else eps_high)


def _no_masks(loss_mode: str) -> None:
    """[B]'s losses have no surrogate for M2PO or OPSM to mask: a mask set for them is an error, not a no-op."""
    if _trust_region_unit() is not None:
        raise ValueError(
            f"{M2PO_CLIP_ENV} / {M2PO_QUADRANT_ENV} / {DPPO_DELTA_ENV} act on offpolicy_grpo, not {loss_mode}"
        )
    if any(v is not None for v in _mask_settings()):
        raise ValueError(f"{M2_THRESHOLD_ENV} / {OPSM_DELTA_ENV} act on loss_mode=offpolicy_grpo only, not {loss_mode}")


def _logps(old_log_prob, log_prob, rollout_is_weights):
    """verl's tensors as objective.py's arguments, all (N, T).

    Returns log pi_theta (guarded, with grad), log alpha, log pi_k, rho' = pi_k / alpha as verl gives it, and the
    tokens with rho' > 0 (`live`).
    """
    pi_k_logp = old_log_prob.detach()  # (N, T)
    # Deviation 1: log(pi_theta / pi_k) kept in [-20, 20], as verl clamps it; the gradient is 0 past the bound.
    logp = torch.clamp(log_prob, pi_k_logp - LOG_RATIO_BOUND, pi_k_logp + LOG_RATIO_BOUND)  # (N, T)
    if rollout_is_weights is None:
        # No correction weights: alpha = pi_k, rho' = 1.
        ones = torch.ones_like(pi_k_logp)  # (N, T)
        return logp, pi_k_logp, pi_k_logp, ones, ones > 0
    rho_prime = rollout_is_weights.detach().to(pi_k_logp.dtype)  # (N, T)
    # Padding (and IcePop-rejected tokens) carry rho' = 0: clamp so that log alpha stays finite there.
    log_rho_prime = torch.log(rho_prime.clamp(min=torch.finfo(pi_k_logp.dtype).tiny))  # (N, T)
    alpha_logp = pi_k_logp - log_rho_prime  # (N, T) log alpha = log pi_k - log rho'
    return logp, alpha_logp, pi_k_logp, rho_prime, rho_prime > 0


def _aggregate(loss_mat, live, response_mask, loss_agg_mode, config):
    """verl's agg_loss over the response tokens with the global batch counts; tokens with rho' = 0 add 0."""
    loss_mat = torch.where(live, loss_mat, torch.zeros_like(loss_mat))  # (N, T)
    mask = response_mask.bool()  # (N, T)
    return agg_loss(loss_mat=loss_mat, loss_mask=mask, loss_agg_mode=loss_agg_mode, **config.global_batch_info)


def _metrics(log_prob, old_log_prob, rho_prime, response_mask, **fractions) -> dict:
    """verl-style actor metrics: ppo_kl = mean(log pi_k - log pi_theta), rho' mean and max, clip fractions."""
    mask = response_mask.bool()  # (N, T)
    with torch.no_grad():
        metrics = {
            "actor/ppo_kl": verl_F.masked_mean(old_log_prob - log_prob, mask).item(),
            "actor/rho_prime_mean": verl_F.masked_mean(rho_prime, mask).item(),
            "actor/rho_prime_max": rho_prime[mask].max().item() if mask.any() else 1.0,
        }
        for name, frac in fractions.items():  # a bool mask (N, T), or a fraction computed already
            frac = frac if isinstance(frac, float) else verl_F.masked_mean(frac.to(rho_prime.dtype), mask).item()
            metrics[f"actor/{name}"] = frac
    return metrics


@register_policy_loss("offpolicy_grpo")
def offpolicy_grpo_loss(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, rollout_is_weights=None
):
    """[A]'s clipped off-policy surrogate (objective.surrogate, clip_center="pi_k"), as a verl loss.

        loss = agg_t [ - o_t ],  o_t as objective.policy_loss states it, with log pi_k = old_log_prob and
        rho'_t = pi_k / alpha = rollout_is_weights

    The clip is centred at the ratio of the policy at the start of the step, rho' = pi_k / alpha, so a stale
    sampler does not clip tokens just for being stale. With rollout_is_weights=None (rho' = 1) this is PPO's
    clip, verl's "vanilla" loss without its dual clip. beta = 0: verl adds its own KL loss. Metrics:
    actor/pg_clipfrac (tokens whose gradient the clip removed), actor/ppo_kl, actor/rho_prime_mean,
    actor/rho_prime_max.
    """
    unit = _trust_region_unit()  # deviation 6: a unit with its own clip
    if unit is not None:
        args = (old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights)
        return _trust_region_loss(unit, *args)
    eps_low, eps_high = _clip_widths(config)
    logp, alpha_logp, pi_k_logp, rho_prime, live = _logps(old_log_prob, log_prob, rollout_is_weights)
    m2_threshold, opsm_delta = _mask_settings()
    x = objective.LossInput(logp, alpha_logp, pi_k_logp, None, advantages, response_mask)
    fractions = {}  # each mask's dropped tokens, (N, T) bool
    if m2_threshold is not None:  # the loop's unit, over this call's tokens (deviation 5): a dropped token adds 0
        kept = corrections.M2PO(m2_threshold).step_keep(alpha_logp, pi_k_logp, response_mask)[0]  # (N, T)
        live, fractions["m2po_masked_frac"] = live & kept, ~kept  # ... and stays in verl's normaliser

    def verl_surrogate(y: objective.LossInput, **settings):  # [A]'s o_t, aggregated as verl does
        o = objective.surrogate(y, clip_eps=eps_low, clip_eps_high=eps_high, clip_center="pi_k")  # (N, T)
        fractions["pg_clipfrac"] = (o.clip_low | o.clip_high) & live  # a dropped token has no gradient to clip
        return _aggregate(-o.objective, live, response_mask, loss_agg_mode, config), {}

    if opsm_delta is None:
        loss, _ = verl_surrogate(x)
    else:  # the loop's unit: a dropped sequence's A is 0, so it adds 0 and stays in verl's normaliser, as TRL's
        loss, st = corrections.OPSM(opsm_delta).loss(x, inner=verl_surrogate)
        fractions["opsm_masked_frac"] = st["opsm_masked_frac"]
    return loss, _metrics(log_prob, old_log_prob, rho_prime, response_mask, **fractions)


def _rec(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights, is_weight):
    """REC / REC-IS of [B] (reinforce.rec_per_token) on verl's tensors; see `rec_loss` below for the formula."""
    _no_masks("rec_is" if is_weight else "rec")
    eps_low, eps_high = _clip_widths(config)
    logp, alpha_logp, _, rho_prime, live = _logps(old_log_prob, log_prob, rollout_is_weights)
    o = reinforce.rec_per_token(
        logp, alpha_logp, advantages, clip_eps=eps_low, clip_eps_high=eps_high, importance_weight=is_weight
    )  # (N, T) A * [sg(rho_t)] * log pi_theta * M_t
    loss = _aggregate(-o.objective, live, response_mask, loss_agg_mode, config)
    return loss, _metrics(log_prob, old_log_prob, rho_prime, response_mask, pg_clipfrac=o.clip_low | o.clip_high)


@register_policy_loss("rec")
def rec_loss(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, rollout_is_weights=None
):
    """REC of [B] (reinforce.rec_per_token states it): REINFORCE on the tokens a one-sided clip would keep.
    actor/pg_clipfrac is the fraction of tokens the mask drops."""
    return _rec(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights, False)


@register_policy_loss("rec_is")
def rec_is_loss(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, rollout_is_weights=None
):
    """REC-IS of [B] (reinforce.rec_per_token states it): REC with the detached importance weight."""
    return _rec(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights, True)


@register_policy_loss("opmd")
def opmd_loss(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, rollout_is_weights=None
):
    """OPMD of [B] (reinforce.opmd_per_token states it): REINFORCE pulled back towards the sampler.

    tau_reg -> actor.policy_loss.dro_beta (0.1 when unset). [B] uses group-mean advantages r - mean(r):
    algorithm.adv_estimator=grpo_masked (or grpo) with algorithm.norm_adv_by_std_in_grpo=False.
    """
    _no_masks("opmd")
    tau_reg = config.policy_loss.get("dro_beta", None) if config.get("policy_loss", None) is not None else None
    tau_reg = OPMD_TAU_REG_DEFAULT if tau_reg is None else tau_reg
    logp, alpha_logp, _, rho_prime, live = _logps(old_log_prob, log_prob, rollout_is_weights)
    per_token = reinforce.opmd_per_token(logp, alpha_logp, advantages, tau_reg=tau_reg).per_token  # (N, T)
    loss = _aggregate(per_token, live, response_mask, loss_agg_mode, config)
    return loss, _metrics(log_prob, old_log_prob, rho_prime, response_mask)


@register_adv_est("grpo_masked")
def grpo_masked_advantage(token_level_rewards, response_mask, index, epsilon=1e-6, config=None, **kwargs):
    """[A]'s group-relative advantages (advantage.group_advantages) per group of `index`, as a verl estimator.

        mu_g = mean_i r_i,   sigma_g^2 = mean_i (r_i - mu_g)^2   (population variance)
        A_i = (r_i - mu_g) / sqrt(sigma_g^2 + guard)              (verl's epsilon, the guard, inside the root)
        A_i = 0 for every i of a group whose rewards are all equal (and for a group of one)

    r_i is the response's summed token_level_rewards (N, T) -> (N,); `index` (N,) holds each response's
    prompt uid, in any order (verl's balance_batch reorders rows), and groups may differ in size. The
    advantage is broadcast over the response: (N, T) = A_i * response_mask. Returns (advantages, returns),
    both the same tensor, as verl's outcome estimators do. algorithm.norm_adv_by_std_in_grpo=False gives
    r - mean(r) ([B]'s OPMD, Dr. GRPO) instead.

    Verl's estimator can zero the equal-reward groups but cannot take their tokens out of the loss's
    normaliser as train.py's `valid` does. To drop those groups instead, set algorithm.filter_groups.enable=True
    with algorithm.filter_groups.metric=reward: verl's replay buffer then evicts every group whose rewards have
    zero spread and refills the batch with fresh prompts (DAPO's dynamic sampling), so no equal-reward group
    reaches the loss. That keeps the batch full where [A]'s masking shrinks it.
    """
    scale_std = True if config is None else bool(config.get("norm_adv_by_std_in_grpo", True))
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1).float()  # (N,)
        _, group = np.unique(np.asarray(index), return_inverse=True)
        group = torch.as_tensor(group.reshape(-1), device=scores.device)  # (N,) group id per row
        sizes = torch.bincount(group)  # (number of groups,)
        # Rows sorted by group: group-major, the layout advantage.group_advantages expects.
        order = torch.argsort(group, stable=True)  # (N,)
        adv = torch.zeros_like(scores)  # (N,)
        for size in sizes.unique().tolist():
            rows = order[sizes[group[order]] == size]  # groups of this size, still group-major
            adv[rows], _ = advantage.group_advantages(scores[rows], size, guard=epsilon, scale_std=scale_std)
        advantages = adv.to(token_level_rewards.dtype).unsqueeze(-1) * response_mask  # (N, T)
    return advantages, advantages
