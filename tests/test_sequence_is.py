"""The sequence-level staleness corrections (the TIS and MIS units of variants/corrections.py with
`is_level="sequence"` / `"geometric"`: correction_args's weight, mis_keep_mask's kept sequences) against a plain
Python loop (value and gradient), hand-built overflow cases, and the engines they are named after.

The engines' settings, with the sources read (TRL 1.16.0 as installed, verl 0.9.1 in .venv-verl):
- TRL: trl/trainer/grpo_trainer.py, `_generate_and_score_completions` l. 2660-2707 computes the ratio inline:
  the masked sum of log pi_old - log pi_vllm per sequence (float32, no clamp), exp, then "sequence_truncate"
  clamps it to [clip_min, clip_max] and "sequence_mask" sets it to 0 outside [clip_min, clip_max]; l. 3146-3147
  multiply the per-token PPO loss (r = pi_theta/pi_old clipped around 1) by it: the decoupled centre, w = the ratio.
  grpo_config.py l. 934-961: mode "sequence_mask", clip_max 3.0 and clip_min None by default (the deprecated
  `vllm_importance_sampling_cap` is clip_max). So the default mask is one-sided (it keeps R < 1/3), and the
  normaliser (l. 3153-3182: `mask`, never the ratio) still counts a masked sequence's tokens; here the sequence
  leaves the normaliser too, as token-level MIS does. A kept sequence is weighted by R in TRL; here by rho'_t,
  unless is_cap is set as well: TRL's "sequence_mask" with clip_min=1/M is is_mask=M plus is_cap=M.
- verl 0.9.1: verl/trainer/ppo/rollout_corr_helper.py, `compute_rollout_correction_weights` l. 578-596,
  rollout_is="sequence": exp(clamp(sum log-ratio, +-20)) then clamp(max=threshold) = sequence TIS;
  `compute_rollout_rejection_mask` l. 262 (per-token log-ratio clamped to +-20), l. 323-353: "seq_sum_k1" /
  "seq_mean_k1" keep -sum / -mean of the log-ratio in [log lower, log upper], lower = 1/upper by default: sequence
  / geometric MIS (Geo-RS; a "lower_upper" threshold bounds 1/R, not R), applied to response_mask (l. 1061), so a
  rejected sequence leaves the normaliser as here. core_algos.py l. 1364-1365 multiply the PPO loss by the weights.
  verl has no geometric-mean weight, and its `decoupled_geo_rs` preset (trainer/config/algorithm.py l. 262) has no
  weight at all (w = 1, no centre here).
"""

import math

import pytest
import torch

import variants
from config import Config, ConfigError, resolve, validate
from conftest import needs
from objective import LossInput, aggregation_total, surrogate
from test_staleness import corrected_loss, step_figures
from variants.corrections import MIS, TIS, correction_args, mis_keep_mask
from variants.registry import chain

EPS_LO, EPS_HI, MAX_NEW = 0.2, 0.28, 7


def unit_terms(x: LossInput, **flags):
    """The per-token surrogate o_t (N, T) the units of a run with these flags hand objective.policy_loss (the chain
    of variants.recipe(Config(**flags)) with `surrogate` at its end, for the decoupled weight w_t), on x."""
    recipe = variants.recipe(Config(**flags))
    eps = {k: recipe.settings[k] for k in ("clip_eps", "clip_eps_high")}
    core = lambda y, **settings: (surrogate(y, clip_center=settings["clip_center"], **eps).objective, {})  # noqa: E731
    return chain(recipe.variants, "loss", core)(x, **recipe.settings)[0]


def level_ratio_loop(alpha_logp, pi_k_logp, mask, i, level):
    """R_i (the product of rho'_t) or G_i (their geometric mean) over sequence i's loss tokens, in floats."""
    logs = [pi_k_logp[i][j] - alpha_logp[i][j] for j in range(len(mask[i])) if mask[i][j]]
    if not logs:
        return 1.0
    total = sum(logs) if level == "sequence" else sum(logs) / len(logs)
    return math.exp(total) if total < 700 else math.inf


def loop_loss(logp, alpha_logp, pi_k_logp, ref_logp, adv, mask, center, cap, mis, level, beta, agg):
    """policy_loss's docstring, sequence by sequence and token by token, in plain Python floats."""
    all_terms, seq_means = [], []
    for i in range(len(logp)):
        rho_level = level_ratio_loop(alpha_logp, pi_k_logp, mask, i, level)
        if mis is not None and not 1.0 / mis <= rho_level <= mis:
            continue  # sequence MIS: the whole sequence leaves the sum and the normaliser
        terms = []
        for j in range(len(logp[i])):
            if not mask[i][j]:
                continue
            rho, rho_p = math.exp(logp[i][j] - alpha_logp[i][j]), math.exp(pi_k_logp[i][j] - alpha_logp[i][j])
            a = adv[i]
            if center == "decoupled":
                r = rho / rho_p
                w = rho_p if cap is None else min(rho_level, cap)
                s = w * min(r * a, min(max(r, 1 - EPS_LO), 1 + EPS_HI) * a)
            else:
                lo, hi = (max(rho_p - EPS_LO, 0.0), rho_p + EPS_HI) if center == "pi_k" else (1 - EPS_LO, 1 + EPS_HI)
                s = min(rho * a, min(max(rho, lo), hi) * a)
            d = ref_logp[i][j] - logp[i][j]
            terms.append(s - beta * (math.exp(d) - d - 1))
        all_terms += terms
        if terms:
            seq_means.append(sum(terms) / len(terms))
    if agg == "token-mean":
        return -sum(all_terms) / max(len(all_terms), 1)
    if agg == "seq-mean":
        return -sum(seq_means) / max(len(seq_means), 1)
    return -sum(all_terms) / (len(logp) * MAX_NEW)


def batch(seed, n=10, t=6, spread=0.5):
    g = torch.Generator().manual_seed(seed)
    u = lambda: torch.rand(n, t, generator=g, dtype=torch.float64) - 0.5
    logp = -torch.rand(n, t, generator=g, dtype=torch.float64) * 2
    alpha_logp, pi_k_logp, ref_logp = logp + 2 * spread * u(), logp + 2 * spread * u(), logp + u()
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = (torch.rand(n, t, generator=g) > 0.25).long()
    mask[0] = 0  # an invalid group's member: no loss token
    alpha_logp[mask == 0] += 300.0  # padding far off: it must not reach a sequence's ratio
    return logp, alpha_logp, pi_k_logp, ref_logp, adv, mask


# (centre, cap C, band M): sequence TIS, sequence MIS on every centre, and both together. The bands are chosen so
# that each level keeps some sequences and drops others, and the cap truncates some weights and not others.
CASES = [
    ("decoupled", "cap", None),
    ("pi_k", None, "band"),
    ("alpha", None, "band"),
    ("decoupled", None, "band"),
    ("decoupled", "cap", "band"),
]
CAP = {"sequence": 1.6, "geometric": 1.08}
BAND = {"sequence": 2.0, "geometric": 1.12}


@pytest.mark.parametrize("level", ["sequence", "geometric"])
@pytest.mark.parametrize("center,cap,mis", CASES)
@pytest.mark.parametrize("agg,beta", [("token-mean", 0.0), ("seq-mean", 0.1), ("constant", 0.0)])
def test_sequence_forms_match_the_loop_in_value_and_gradient(level, center, cap, mis, agg, beta):
    logp, alpha_logp, pi_k_logp, ref_logp, adv, mask = batch(seed=3)
    cap, mis = (CAP[level] if cap else None), (BAND[level] if mis else None)
    # The case is not trivial: the level ratio of the sequences with a loss token lies on both sides of the cap / band.
    ratios = [level_ratio_loop(alpha_logp.tolist(), pi_k_logp.tolist(), mask.tolist(), i, level) for i in range(1, 10)]
    for bound in [b for b in (cap, mis) if b is not None]:
        assert min(ratios) < 1 / bound or max(ratios) > bound, ratios
        assert any(1 / bound <= x <= bound for x in ratios), ratios
    kw = dict(clip_eps=EPS_LO, clip_eps_high=EPS_HI, clip_center=center, beta=beta, agg=agg, max_new_tokens=MAX_NEW)
    x = logp.clone().requires_grad_(True)
    loss, _ = corrected_loss(
        x, alpha_logp, pi_k_logp, ref_logp, adv, mask, is_cap=cap, is_mask=mis, is_level=level, **kw
    )
    loss.backward()
    args = [
        alpha_logp.tolist(),
        pi_k_logp.tolist(),
        ref_logp.tolist(),
        adv.tolist(),
        mask.tolist(),
        center,
        cap,
        mis,
        level,
    ]
    L = lambda lp: loop_loss(lp, *args, beta, agg)
    assert loss.item() == pytest.approx(L(logp.tolist()), rel=1e-10, abs=1e-12)
    h = 1e-6  # the loop's gradient by central finite differences, token by token
    for i in range(logp.shape[0]):
        for j in range(logp.shape[1]):
            up, dn = logp.tolist(), logp.tolist()
            up[i][j] += h
            dn[i][j] -= h
            assert x.grad[i, j].item() == pytest.approx((L(up) - L(dn)) / (2 * h), abs=1e-6), (i, j)


@pytest.mark.parametrize("level", ["sequence", "geometric"])
def test_keep_mask_statistics_and_micro_batches_follow_the_sequence(level):
    logp, alpha_logp, pi_k_logp, ref_logp, adv, mask = batch(seed=5)
    cap, mis = CAP[level], BAND[level]
    keep = mis_keep_mask(alpha_logp, pi_k_logp, mis, loss_mask=mask, is_level=level)  # (N, T)
    extra = correction_args(alpha_logp, pi_k_logp, mask, is_cap=cap, is_mask=mis, is_level=level)
    assert keep.shape == mask.shape and torch.equal(keep, extra["keep"])
    assert torch.equal(MIS(mis, level).step_keep(alpha_logp, pi_k_logp, mask)[0], keep)  # the unit's keep
    scored = [i for i in range(10) if mask[i].any()]
    ratios = {i: level_ratio_loop(alpha_logp.tolist(), pi_k_logp.tolist(), mask.tolist(), i, level) for i in scored}
    for i in scored:  # a whole sequence is kept or dropped
        assert keep[i].all().item() == (1 / mis <= ratios[i] <= mis) and keep[i].all() == keep[i].any()
    # The fractions count tokens: those of the dropped sequences of all loss tokens, and those of the kept ones
    # above the cap of the tokens the loss keeps (a dropped sequence is dropped, not capped).
    n = mask.sum().item()
    masked = sum(mask[i].sum().item() for i in scored if not 1 / mis <= ratios[i] <= mis)
    capped = sum(mask[i].sum().item() for i in scored if 1 / mis <= ratios[i] <= mis and ratios[i] > cap)
    flags = dict(clip_center="decoupled", is_cap=cap, is_mask=mis, is_level=level)
    st = step_figures(alpha_logp, pi_k_logp, mask, **flags)
    assert masked > 0 and capped > 0
    expected = (masked / n, capped / (n - masked))
    assert (st["is_masked_frac"], st["is_capped_frac"]) == pytest.approx(expected, abs=1e-12)
    # Row micro-batches with the whole step's normaliser add up to the whole step (a sequence's ratio is its own).
    kw = dict(clip_center="decoupled", beta=0.1, is_cap=cap, is_mask=mis, is_level=level)
    for agg in ("token-mean", "seq-mean", "constant"):
        whole, _ = corrected_loss(
            logp, alpha_logp, pi_k_logp, ref_logp, adv, mask, agg=agg, max_new_tokens=MAX_NEW, **kw
        )
        total = aggregation_total(mask * keep, agg, MAX_NEW)
        parts = sum(
            corrected_loss(
                *(v[s : s + 3] for v in (logp, alpha_logp, pi_k_logp, ref_logp, adv, mask)),
                agg=agg,
                max_new_tokens=MAX_NEW,
                total=total,
                **kw,
            )[0]
            for s in range(0, 10, 3)
        )
        assert parts.item() == pytest.approx(whole.item(), rel=1e-12)


def test_an_overflowing_sequence_ratio_is_masked_or_capped_never_nan():
    # 40 tokens of log rho' = 20 each: R = e^800, past float64's exp (inf); G = e^20. float32 log-probs, as in
    # training, where a product of ratios would be inf already after 5 such tokens.
    t = 40
    alpha_logp = torch.full((2, t), -30.0)
    pi_k_logp = torch.full((2, t), -10.0)
    pi_k_logp[1] = -30.0  # the second sequence is on-policy: rho' = 1
    mask, adv = torch.ones(2, t), torch.tensor([1.0, -1.0])
    for level in ("sequence", "geometric"):
        for cap, mis in ((3.0, None), (None, 3.0), (3.0, 3.0)):
            x = pi_k_logp.clone().requires_grad_(True)  # pi_theta = pi_k: r = 1, so o_t = w_t A and d o_t = w_t A
            loss, _ = corrected_loss(
                x,
                alpha_logp,
                pi_k_logp,
                None,
                adv,
                mask,
                clip_center="decoupled",
                is_cap=cap,
                is_mask=mis,
                is_level=level,
            )
            loss.backward()
            assert torch.isfinite(loss) and torch.isfinite(x.grad).all(), (level, cap, mis)
            # Sequence 0 (R = inf, G = e^20): dropped by MIS, else weighted by the cap, w = 3; sequence 1: w = 1.
            kept_tokens = t if mis is not None else 2 * t
            assert x.grad[0].tolist() == pytest.approx([0.0 if mis is not None else -3.0 / kept_tokens] * t)
            assert x.grad[1].tolist() == pytest.approx([1.0 / kept_tokens] * t)
        st = step_figures(alpha_logp, pi_k_logp, mask, clip_center="decoupled", is_cap=3.0, is_mask=3.0, is_level=level)
        assert st["is_masked_frac"] == 0.5 and st["is_capped_frac"] == 0.0
        st = step_figures(alpha_logp, pi_k_logp, mask, clip_center="decoupled", is_cap=3.0, is_level=level)
        assert st["is_capped_frac"] == 0.5  # without MIS sequence 0 is capped


def test_bad_levels_are_one_line_errors():
    logp, alpha_logp, pi_k_logp, ref_logp, adv, mask = batch(seed=1)
    with pytest.raises(ValueError, match="is_level must be one of") as err:  # the MIS unit, at the step's keep
        corrected_loss(logp, alpha_logp, pi_k_logp, ref_logp, adv, mask, is_mask=2.0, is_level="seq")
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="is_level must be one of") as err:  # the TIS unit, in the loss
        corrected_loss(
            logp, alpha_logp, pi_k_logp, ref_logp, adv, mask, clip_center="decoupled", is_cap=2.0, is_level="seq"
        )
    assert "\n" not in str(err.value)
    # A level without a correction, or TIS without the decoupled centre: the flags are refused (config.validate).
    for kw, message in [
        (dict(is_level="sequence"), "--is-level sequence sets what --is-cap / --is-mask act on; neither is set"),
        (dict(is_cap=2.0, is_level="geometric", clip_center="pi_k"), "--is-cap needs --loss grpo --clip-center"),
    ]:
        with pytest.raises(ConfigError, match=message) as err:
            validate(resolve(Config(out="/tmp/unused", **kw)))
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="neither is set"):
        correction_args(alpha_logp, pi_k_logp, mask, is_level="sequence")
    with pytest.raises(ValueError, match="needs loss_mask"):
        correction_args(alpha_logp, pi_k_logp, None, is_mask=2.0, is_level="sequence")
    with pytest.raises(ValueError, match="needs loss_mask"):
        mis_keep_mask(alpha_logp, pi_k_logp, 2.0, is_level="geometric")
    with pytest.raises(ValueError, match="is_level must be one of"):
        MIS(2.0, "tokens").step_keep(alpha_logp, pi_k_logp, mask)
    with pytest.raises(ValueError, match="is_level must be one of"):
        TIS(2.0, "tokens").step_stats(alpha_logp, pi_k_logp, mask)


# --------------------------------------------------------------------------- stock TRL 1.16


class StubVLLM:
    """Stands in for TRL's VLLMGeneration: fixed completions, and the sampler's per-token log-probs we choose."""

    def __init__(self, completions, logprobs):
        self.completions, self.logprobs = completions, logprobs

    def sync_weights(self):
        pass

    def generate(self, prompts, images, num_generations, profiler):
        return prompts, self.completions, [[[lp] for lp in seq] for seq in self.logprobs], None


def trl_ratio(model_dir, tok, rows, completions, engine_logps, **is_args):
    """TRL's own _generate_and_score_completions on a stubbed vLLM: (pi_old log-probs, mask, importance ratio)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(model_dir / "out"),
        per_device_train_batch_size=len(rows),
        num_generations=4,
        max_completion_length=8,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        gradient_checkpointing=False,
        disable_tqdm=True,
        **is_args,
    )
    data = Dataset.from_dict({"prompt": [r["prompt"] for r in rows]})
    trainer = GRPOTrainer(
        model=str(model_dir),
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=args,
        train_dataset=data,
        processing_class=tok,
    )
    trainer.use_vllm, trainer._last_loaded_step = True, -1
    trainer.vllm_generation = StubVLLM(completions, engine_logps)
    trainer.model.eval()
    out = trainer._generate_and_score_completions(rows)
    return out["old_per_token_logps"], out["completion_mask"], out.get("importance_sampling_ratio")


@pytest.mark.model
def test_the_product_form_is_stock_trls_sequence_truncate_and_sequence_mask(tok, model, tmp_path):
    """On the same log-probs, through TRL's real `_generate_and_score_completions`: is_level="sequence" with is_cap=C
    is "sequence_truncate" (clip_max C), and is_mask=M with is_cap=M is "sequence_mask" with clip_min 1/M, to 1e-6.
    With TRL's default clip_min=None, its mask keeps the sequences below 1/M that is_mask drops."""
    needs("trl", "trl")
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    g = torch.Generator().manual_seed(0)
    lengths = [8, 3, 5, 8, 1, 6, 8, 4, 2, 7, 8, 5]  # some end early: right padding in TRL's batch
    completions = [torch.randint(2, 17, (n,), generator=g).tolist() for n in lengths]  # no pad (0), no EOS (1)
    rows = [{"prompt": "3+4="}] * len(lengths)
    # A first pass learns pi_old's log-probs; the sampler's then sit a chosen sequence log-ratio d_i away.
    old, mask, _ = trl_ratio(tmp_path, tok, rows, completions, [[-1.0] * n for n in lengths])
    targets = [-2.5, -1.5, -0.8, -0.3, 0.0, 0.4, 0.9, 1.3, 2.0, 3.0, -4.0, 1.05]  # log 3 = 1.0986
    sampler = []
    for i, n in enumerate(lengths):
        jitter = torch.randn(n, generator=g, dtype=torch.float64) * 0.3
        jitter -= jitter.mean()  # sums to 0: the sequence's log-ratio stays d_i
        sampler.append((old[i, :n].double() - targets[i] / n + jitter).tolist())
    alpha = torch.zeros_like(old)
    for i, n in enumerate(lengths):
        alpha[i, :n] = torch.tensor(sampler[i])
    C = M = 3.0

    def ours(**kw):  # the units' o_t with r = 1 and A = 1, so o_t = w_t (0 where MIS drops); MIS's keep mask
        flags = dict(clip_center="decoupled", is_level="sequence", **kw)
        keep = variants.recipe(Config(**flags)).step_keep(alpha, old, mask)[0]  # (N, T)
        o = unit_terms(LossInput(old, alpha, old, None, torch.ones(len(rows)), mask * keep), **flags)
        return o, (keep if "is_mask" in kw else None)

    counted = mask.bool()
    runs = [
        (dict(vllm_importance_sampling_mode="sequence_truncate", vllm_importance_sampling_clip_max=C), dict(is_cap=C)),
        (
            dict(
                vllm_importance_sampling_mode="sequence_mask",
                vllm_importance_sampling_clip_max=M,
                vllm_importance_sampling_clip_min=1 / M,
            ),
            dict(is_cap=M, is_mask=M),
        ),
    ]
    for trl_args, our_args in runs:
        old2, mask2, ratio = trl_ratio(tmp_path, tok, rows, completions, sampler, **trl_args)
        assert torch.equal(old2, old) and torch.equal(mask2, mask) and ratio.shape == (len(rows), 1)
        w, keep = ours(**our_args)
        torch.testing.assert_close(w[counted], ratio.expand_as(w)[counted].to(w.dtype), atol=1e-6, rtol=1e-6)
        if keep is None:  # truncation acted on some sequences and not on others
            assert (ratio == C).any() and ((ratio < C) & (ratio > 0)).any()
        else:
            assert torch.equal(keep[:, 0], ratio[:, 0] > 0)
    assert 0 < (w[:, 0] == 0).sum() < len(rows) - 1  # both kinds: sequences dropped above M and below 1/M
    # TRL's default clip_min=None: one-sided. It keeps (weight R < 1/M) what is_mask drops below 1/M, and its
    # normaliser (`mask` in compute_loss) counts every masked sequence's tokens; ours counts neither.
    _, _, ratio = trl_ratio(
        tmp_path,
        tok,
        rows,
        completions,
        sampler,
        vllm_importance_sampling_mode="sequence_mask",
        vllm_importance_sampling_clip_max=M,
    )
    low = torch.tensor(targets) < -math.log(M)
    assert low.any() and (ratio[low, 0] > 0).all() and not keep[low].any()
    assert torch.equal(ratio[~low, 0] > 0, keep[~low, 0])


# --------------------------------------------------------------------------- verl 0.9 (where it is installed)


@pytest.mark.parametrize("level,option", [("sequence", "seq_sum_k1"), ("geometric", "seq_mean_k1")])
def test_the_sequence_forms_are_verls_rollout_correction(level, option):
    """verl's own functions on the same log-probs: rollout_is="sequence" (threshold C) is the product form's TIS
    weight, and rollout_rs=seq_sum_k1 / seq_mean_k1 (threshold M) its MIS / Geo-RS mask. Runs where verl is installed
    (.venv-verl/bin/python -m pytest tests/test_sequence_is.py -k verl)."""
    needs("verl", "verl")
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights, compute_rollout_rejection_mask

    logp, alpha_logp, pi_k_logp, _, adv, mask = batch(seed=3)
    mask[0, 0] = 1  # verl wants every sequence to have a response token
    cap, mis = CAP[level], BAND[level]
    keep = correction_args(alpha_logp, pi_k_logp, mask, is_mask=mis, is_level=level)["keep"]
    assert torch.equal(MIS(mis, level).step_keep(alpha_logp, pi_k_logp, mask)[0], keep)  # the unit's
    rs_mask, _ = compute_rollout_rejection_mask(pi_k_logp - alpha_logp, mask.double(), option, mis)
    assert torch.equal(rs_mask.bool(), keep & mask.bool()) and 0 < rs_mask.sum() < mask.sum()
    if level == "sequence":  # verl has no geometric-mean weight
        weights, _ = compute_rollout_correction_weights(pi_k_logp - alpha_logp, mask.double(), "sequence", cap)
        # the TIS unit's o_t with r = 1 and A = 1: o_t = w_t
        x = LossInput(pi_k_logp, alpha_logp, pi_k_logp, None, torch.ones_like(adv), mask)
        w = unit_terms(x, clip_center="decoupled", is_cap=cap, is_level=level)
        torch.testing.assert_close((w * mask)[1:], weights[1:], rtol=1e-12, atol=1e-12)
        # Sequence 0 is one token with log rho' ~ -300: verl clamps the log-ratio at -20 (its SAFETY_BOUND), we don't.
        assert weights[0, 0].item() == pytest.approx(math.exp(-20.0)) and w[0, 0] < 1e-100
        assert (weights == cap).any() and ((weights < cap) & (weights > 0)).any()


@pytest.mark.model
def test_train_py_runs_a_stale_step_with_geometric_mis_and_refuses_a_level_without_a_correction(
    warm_cache, tmp_path, capsys
):
    import json

    import train
    from conftest import TEST_WARMUP

    base = [
        "--steps",
        "4",
        "--offpolicy-steps",
        "4",
        "--prompts-per-step",
        "4",
        "--group-size",
        "4",
        "--eval-size",
        "10",
        "--warmup-steps",
        str(TEST_WARMUP),
        "--cache-dir",
        warm_cache,
        "--no-progress",
        "--lr",
        "1e-3",
    ]
    out = tmp_path / "geo"
    args = ["--clip-center", "decoupled", "--is-mask", "1.001", "--is-level", "geometric", "--out", str(out)]
    assert train.main(base + args) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    stale = [r for r in rows[1:] if "is_masked_frac" in r]
    assert stale and max(r["is_masked_frac"] for r in stale) > 0  # a sequence outside [1/M, M] left the loss
    assert train.main(base + ["--is-level", "sequence", "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == "error: --is-level sequence sets what --is-cap / --is-mask act on; neither is set"
