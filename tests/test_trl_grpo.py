"""integrations/trl_grpo.py: [A]'s off-policy GRPO inside TRL's GRPOTrainer, pinned to stock TRL and to objective.py:
the loss, the vLLM weight's composition with rho', the mapping of v onto TRL's fields, bad input. The schedule,
resume, LoRA and the command line: tests/test_trl_schedule.py.

Every test runs TRL's real code on CPU with the warmed-up tiny policy, whose groups have mixed rewards (so the
gradients and the policy's moves that the tests look at are not zero).
"""

import pytest

from conftest import needs

needs("trl", "trl")
# Trains or decodes a model: CI runs these again under ATEN_CPU_CAPABILITY=default (plain kernels).
pytestmark = pytest.mark.model

import torch  # noqa: E402
from trl import GRPOTrainer  # noqa: E402
from trl_testing import G, make_trainer, noisy, rows, save_policy, sequences  # noqa: E402

import objective  # noqa: E402
import variants  # noqa: E402
from advantage import group_advantages  # noqa: E402
from bookkeeping.diagnostics import drift_stats  # noqa: E402
from config import Config  # noqa: E402
from engine.chunked_logprobs import chunked_token_logprobs  # noqa: E402
from integrations import trl_grpo  # noqa: E402
from integrations.trl_grpo import OffPolicyGRPOConfig, checksum  # noqa: E402
from variants import corrections  # noqa: E402


@pytest.fixture(scope="module")
def policy_dir(warm_cache, tmp_path_factory):
    return save_policy(warm_cache, tmp_path_factory.mktemp("policy"))


@pytest.mark.parametrize("loss_type, bias_kl", [("dapo", False), ("grpo", False), ("dr_grpo", False), ("dapo", True)])
def test_parity_with_stock_trl(policy_dir, tmp_path, loss_type, bias_kl):
    """v=1, the alpha centre, masking off, beta 0.04: loss and gradient equal stock GRPOTrainer's on the same inputs,
    over two accumulated micro-batches (so the step's normaliser is exercised, not only one micro-batch's); with
    use_bias_correction_kl (TRL's default) kl_t is multiplied by pi_theta/pi_old in both."""
    kw = dict(
        beta=0.04,
        loss_type=loss_type,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        use_bias_correction_kl=bias_kl,
    )
    ours = make_trainer(
        policy_dir, tmp_path / "ours", offpolicy_steps=1, clip_center="alpha", mask_zero_std=False, **kw
    )
    stock = make_trainer(policy_dir, tmp_path / "stock", cls=GRPOTrainer, **kw)
    ours.model.train()
    stock.model.train()
    ours._prepare_inputs(rows(ours, 4))  # TRL's schedule: generate, shuffle, deal out the step's two slices
    slices = ours._buffered_inputs
    # one Z for the step: the loss tokens of both slices (dapo; masking off, so every completion token)
    tokens = sum(m["completion_mask"].sum().item() for m in slices)
    assert len(slices) == 2 and slices[0]["loss_total"].item() == slices[1]["loss_total"].item()
    assert loss_type != "dapo" or slices[0]["loss_total"].item() == tokens
    for i, micro in enumerate(slices):
        # Old and reference log-probs off the current policy, so that the clip acts and the KL has a gradient
        # (at pi_theta = pi_ref the k3 gradient is 0); pi_k = pi_old here, as in stock TRL.
        ref, cmask = micro["ref_per_token_logps"], micro["completion_mask"]
        micro["old_per_token_logps"] = noisy(ref, cmask, seed=1 + i)
        micro["ref_per_token_logps"] = noisy(ref, cmask, seed=3 + i)
    results = {}
    for name, trainer in (("ours", ours), ("stock", stock)):
        trainer.current_gradient_accumulation_steps = 2
        trainer.model.zero_grad()
        loss = 0.0
        for micro in slices:
            step_loss = trainer.compute_loss(trainer.model, micro)
            step_loss.backward()
            loss += step_loss.item()
        results[name] = (loss, [p.grad.clone() for p in trainer.model.parameters()])
    assert abs(results["ours"][0] - results["stock"][0]) < 1e-5
    for g_ours, g_stock in zip(results["ours"][1], results["stock"][1]):
        torch.testing.assert_close(g_ours, g_stock, atol=1e-5, rtol=0)
    assert max(g.abs().max().item() for g in results["stock"][1]) > 1e-3  # a gradient that could differ


@pytest.mark.parametrize("weighted_kl", [False, True], ids=["kl", "rho-weighted-kl"])
def test_offpolicy_loss_is_the_loops_loss(policy_dir, tmp_path, weighted_kl):
    """v > 1, the pi_k centre: log alpha is TRL's old_per_token_logps, log pi_k the forward detached, and the loss
    equals the loop's (variants.Recipe.loss, objective.policy_loss) on the same tensors, with log-probs from
    chunked_logprobs, advantages from advantage.group_advantages and an independent normaliser. One KL: TRL's
    use_bias_correction_kl and train.py's --kl-importance-weight give the same term, and the other setting does
    not."""
    # beta 1: the KL term as large as the surrogate, so that its weight shows in the loss
    trainer = make_trainer(policy_dir, tmp_path, offpolicy_steps=3, beta=1.0, use_bias_correction_kl=weighted_kl)
    trainer.model.train()
    batch = trainer._generate_and_score_completions(rows(trainer, 8))
    cmask = batch["completion_mask"]
    batch["old_per_token_logps"] = noisy(batch["ref_per_token_logps"], cmask, seed=2)  # a stale alpha: rho' != 1
    batch["ref_per_token_logps"] = noisy(batch["ref_per_token_logps"], cmask, seed=3)  # pi_ref != pi_theta: kl > 0
    trainer._set_step_normalisers([batch], group=1)
    adv, valid = group_advantages(trainer._rewards.sum(dim=1), G)
    assert torch.equal(batch["advantages"], adv) and not valid.all() and valid.any()
    loss = trainer.compute_loss(trainer.model, batch)
    logp = chunked_token_logprobs(trainer.model, *sequences(batch), cmask, 1.0)
    mask = cmask * valid.unsqueeze(1)
    old, ref = batch["old_per_token_logps"], batch["ref_per_token_logps"]
    total = objective.aggregation_total(mask, "token-mean")

    def loops_loss(kl_importance_weight):
        cfg = Config(beta=1.0, clip_center="pi_k", kl_importance_weight=kl_importance_weight)
        x = objective.LossInput(logp, old, logp.detach(), ref, adv, mask, total)
        return variants.recipe(cfg).loss(x)[0].item()

    rho_prime_max = drift_stats(old, logp.detach(), mask)["rho_prime_max"]
    assert rho_prime_max > 1.5  # the two centres give different losses on these tensors
    assert abs(loss.item() - loops_loss(weighted_kl)) < 1e-5
    assert abs(loss.item() - loops_loss(not weighted_kl)) > 1e-3  # the weight changes the KL term


class EngineStub:
    """Stands in for TRL's VLLMGeneration: samples with the policy itself, reports log-probs `offset` below the
    trainer's own (an engine whose numerics differ by a known amount), and records each weight push."""

    def __init__(self, trainer, offset: float):
        self.trainer, self.offset, self.pushes = trainer, offset, []

    def policy(self):
        return self.trainer.accelerator.unwrap_model(self.trainer.model)

    def sync_weights(self):
        self.pushes.append((self.trainer.state.global_step, checksum(self.policy())))

    @torch.no_grad()
    def generate(self, prompts, images, num_generations, profiler):
        policy, t, completions, logprobs = self.policy(), self.trainer.max_completion_length, [], []
        for p in prompts:  # TRL hands over every row (each prompt G times), one completion each
            x = torch.tensor([p])
            out = policy.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=True, max_new_tokens=t)
            c = out[0, len(p) :].tolist()
            c = c[: c.index(1) + 1] if 1 in c else c  # up to EOS (id 1)
            ids = torch.tensor([p + c])
            lp = chunked_token_logprobs(
                policy, ids, torch.ones_like(ids), torch.ones(1, len(c)), self.trainer.temperature
            )
            completions.append(c)
            logprobs.append([[v - self.offset] for v in lp[0].tolist()])  # top-1 lists, as vLLM returns
        return prompts, completions, logprobs, None


def engine_trainer(policy_dir, out, offset: float, **kw):
    trainer = make_trainer(policy_dir, out, **kw)
    trainer.vllm_generation = EngineStub(trainer, offset)
    trainer.use_vllm, trainer._last_loaded_step = True, -1
    return trainer


@pytest.mark.parametrize("clip_center", ["pi_k", "alpha"])
def test_vllm_weight_composes_with_rho_prime(policy_dir, tmp_path, clip_center):
    """An engine whose log-probs are c below the trainer's: TRL's default correction (sequence_mask, C_max 3) weighs
    each sequence by w = exp(c * its length), and the loss is objective.policy_loss with A -> w A, alpha the trainer's
    (rho' does not see the engine's offset). Taking alpha from the engine instead would differ (the test can fail)."""
    c = 0.1
    trainer = engine_trainer(policy_dir, tmp_path, c, offpolicy_steps=2, clip_center=clip_center)
    trainer.model.train()
    batch = trainer._generate_and_score_completions(rows(trainer, 8))
    cmask, w = batch["completion_mask"], batch["importance_sampling_ratio"]  # (n, T), (n, 1)
    torch.testing.assert_close(w[:, 0], torch.exp(c * cmask.sum(1).float()), atol=1e-4, rtol=1e-5)
    batch["old_per_token_logps"] = noisy(batch["old_per_token_logps"], cmask, seed=4)  # a stale alpha
    trainer._set_step_normalisers([batch], group=1)
    loss = trainer.compute_loss(trainer.model, batch)
    rho_prime = trainer._metrics["train"]["offpolicy/rho_prime_mean"][-1]
    logp = chunked_token_logprobs(trainer.model, *sequences(batch), cmask, 1.0)
    old, mask, adv = batch["old_per_token_logps"], batch["loss_mask"], batch["advantages"]
    total = objective.aggregation_total(mask, "token-mean")
    x = objective.LossInput(logp, old, logp.detach(), None, adv.unsqueeze(1) * w, mask, total)
    expected, _ = objective.policy_loss(x, clip_center=clip_center)
    assert abs(loss.item() - expected.item()) < 1e-6
    assert abs(rho_prime - objective.masked_mean(torch.exp(logp.detach() - old), mask)) < 1e-5
    engine = batch["sampling_per_token_logps"]
    wrong, _ = objective.policy_loss(
        objective.LossInput(logp, engine, logp.detach(), None, adv, mask, total), clip_center=clip_center
    )
    assert abs(wrong.item() - expected.item()) > 1e-3


def test_vllm_gets_weights_only_when_trl_generates(policy_dir, tmp_path):
    """A real run with the stub engine, v=2: TRL pushes the weights at steps 0, 2, 4 only (its generations), each
    time the policy as it is then (stock TRL pushes at every step's generation; here there is one every v steps)."""
    trainer = engine_trainer(policy_dir, tmp_path, 0.0, offpolicy_steps=2, max_steps=5)
    trainer.train()
    steps = [s for s, _ in trainer.vllm_generation.pushes]
    assert steps == [0, 2, 4]
    assert len({h for _, h in trainer.vllm_generation.pushes}) == 3  # the policy moved between pushes
    assert trainer.state.global_step == 5


def test_offpolicy_steps_maps_onto_trls_generation_fields(tmp_path):
    """v sets steps_per_generation = v * GA and TRL's generation_batch_size; set directly, they give v."""
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, use_cpu=True)
    cfg = OffPolicyGRPOConfig(**base, offpolicy_steps=4, gradient_accumulation_steps=2)
    assert (cfg.steps_per_generation, cfg.generation_batch_size, cfg.offpolicy_steps) == (8, 64, 4)
    assert OffPolicyGRPOConfig(**base).offpolicy_steps == 1  # neither set: stock TRL's schedule
    cfg = OffPolicyGRPOConfig(**base, steps_per_generation=6, gradient_accumulation_steps=2)
    assert cfg.offpolicy_steps == 3
    cfg = OffPolicyGRPOConfig(**base, generation_batch_size=24, offpolicy_steps=3)
    assert cfg.steps_per_generation == 3
    for bad in (
        dict(steps_per_generation=3, gradient_accumulation_steps=2),
        dict(steps_per_generation=2, offpolicy_steps=3),
        dict(offpolicy_steps=0),
    ):
        with pytest.raises(ValueError, match="OffPolicyGRPOConfig"):
            OffPolicyGRPOConfig(**base, **bad)


def test_bad_input_is_one_line_and_exit_2(capsys):
    bad = (
        ["--offpolicy-steps", "0"],
        ["--loss_type", "bnpo"],
        ["--task", "nope"],
        ["--clip_center", "one"],
        ["--offpolicy-steps", "2", "--steps_per_generation", "3"],
    )
    for argv in bad:
        assert trl_grpo.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err, err


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_opsm_is_stock_trls_off_policy_mask(policy_dir, tmp_path, loss_type):
    """off_policy_mask_threshold (OPSM) in the subclass, the alpha centre, v = 1, masking off, beta 0.04: loss and
    gradient equal stock GRPOTrainer's with the same threshold, over two accumulated slices; the masked sequences
    stay in the normaliser and keep their KL term in both."""
    kw = dict(beta=0.04, loss_type=loss_type, per_device_train_batch_size=8, gradient_accumulation_steps=2)
    kw.update(off_policy_mask_threshold=0.05, use_bias_correction_kl=False)
    ours = make_trainer(
        policy_dir, tmp_path / "ours", offpolicy_steps=1, clip_center="alpha", mask_zero_std=False, **kw
    )
    stock = make_trainer(policy_dir, tmp_path / "stock", cls=GRPOTrainer, **kw)
    ours.model.train()
    stock.model.train()
    ours._prepare_inputs(rows(ours, 4))
    slices, dropped = ours._buffered_inputs, 0
    for i, micro in enumerate(slices):
        ref, cmask = micro["ref_per_token_logps"], micro["completion_mask"]
        micro["old_per_token_logps"] = noisy(ref, cmask, seed=1 + i)  # a stale sampler: OPSM has sequences to drop
        micro["ref_per_token_logps"] = noisy(ref, cmask, seed=3 + i)
        logp = chunked_token_logprobs(ours.model, *sequences(micro), cmask, 1.0).detach()
        keep = corrections.opsm_keep_mask(micro["old_per_token_logps"], logp, micro["advantages"], cmask, 0.05)
        dropped += int((~keep).sum())
    assert dropped > 0
    results = {}
    for name, trainer in (("ours", ours), ("stock", stock)):
        trainer.current_gradient_accumulation_steps = 2
        trainer.model.zero_grad()
        loss = 0.0
        for micro in slices:
            step_loss = trainer.compute_loss(trainer.model, micro)
            step_loss.backward()
            loss += step_loss.item()
        results[name] = (loss, [p.grad.clone() for p in trainer.model.parameters()])
    assert abs(results["ours"][0] - results["stock"][0]) < 1e-5
    for g_ours, g_stock in zip(results["ours"][1], results["stock"][1]):
        torch.testing.assert_close(g_ours, g_stock, atol=1e-5, rtol=0)
    assert ours._metrics["train"]["offpolicy/opsm_masked_frac"][-1] > 0


def test_m2po_masks_the_whole_optimizer_step_as_the_loop_does(policy_dir, tmp_path):
    """m2_threshold (M2PO), v = 2, GA = 2: the mask is computed once over the step's two slices (not per slice), the
    step's normaliser counts the kept tokens, and the slices' losses add up to the loop's (variants.Recipe.loss) on the
    whole step with corrections.m2po_keep_mask."""
    m2_threshold = 0.02
    trainer = make_trainer(
        policy_dir,
        tmp_path,
        offpolicy_steps=2,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        m2_threshold=m2_threshold,
        mask_zero_std=False,
    )
    trainer.model.train()
    trainer._prepare_inputs(rows(trainer, 8))  # generates 4 slices; the prepass runs on the first step's two
    step = trainer._buffered_inputs[:2]
    assert all("m2po_keep" in s and "pi_k_logps" in s for s in step)
    assert all("m2po_keep" not in s for s in trainer._buffered_inputs[2:])  # the next step's come at its turn
    for i, s in enumerate(step):  # a staler alpha than step 0's, then the prepass again
        s["old_per_token_logps"] = noisy(s["old_per_token_logps"], s["completion_mask"], seed=5 + i, scale=0.2)
        del s["m2po_keep"]
    trainer._m2po_prepass(step)
    cat = lambda key: torch.cat([s[key] for s in step])  # noqa: E731
    alpha, pi_k, mask, adv = cat("old_per_token_logps"), cat("pi_k_logps"), cat("loss_mask"), cat("advantages")
    keep = corrections.m2po_keep_mask(alpha, pi_k, mask, m2_threshold)  # (2n, T) the whole step's
    assert torch.equal(cat("m2po_keep"), keep) and 0 < int((~keep).sum()) < int(mask.sum())
    per_slice = torch.cat(
        [
            corrections.m2po_keep_mask(s["old_per_token_logps"], s["pi_k_logps"], s["loss_mask"], m2_threshold)
            for s in step
        ]
    )
    kept = int((mask.bool() & keep).sum())
    assert step[0]["loss_total"].item() == step[1]["loss_total"].item() == kept
    trainer.current_gradient_accumulation_steps = 2
    loss = sum(trainer.compute_loss(trainer.model, s).item() for s in step)
    whole = {k: cat(k) for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
    logp = chunked_token_logprobs(trainer.model, *sequences(whole), whole["completion_mask"], 1.0)
    cfg = Config(clip_center="pi_k", m2_threshold=m2_threshold)
    x = objective.LossInput(logp, alpha, pi_k, None, adv, mask * keep, float(kept))  # the loop's update does so
    loop = variants.recipe(cfg).loss(x)[0].item()
    assert abs(loss - loop) < 1e-5
    assert trainer._metrics["train"]["offpolicy/m2po_masked_frac"][-1] > 0
    assert not torch.equal(per_slice, keep)  # per slice (AReaL's per micro-batch) would mask other tokens


def test_masks_refused_where_they_cannot_act(tmp_path):
    base = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none", num_generations=4)
    for bad, msg in [
        (dict(m2_threshold=0.0), "m2_threshold"),
        (dict(off_policy_mask_threshold=-1.0), "off_policy_mask_threshold"),
        (dict(policy_loss="rec", m2_threshold=0.04), "policy_loss='grpo' only"),
    ]:
        with pytest.raises(ValueError, match=msg):
            OffPolicyGRPOConfig(**base, **bad)


@pytest.mark.parametrize(
    "field, value, flags, stat",
    [
        ("m2po_clip_threshold", 0.005, dict(m2po_clip_threshold=0.005), "m2po_clip_hi"),
        ("m2po_quadrant_threshold", 0.005, dict(m2po_quadrant_threshold=0.005), "m2po_quadrant_masked_frac"),
        ("dppo_delta", 0.02, dict(dppo_delta=0.02), "dppo_masked_frac"),
    ],
)
def test_m2po_forms_and_dppo_are_the_loops_units(policy_dir, tmp_path, field, value, flags, stat):
    """Issue 57: m2po_clip_threshold, m2po_quadrant_threshold and dppo_delta give the loop's loss
    (variants.Recipe.loss with --m2po-clip-threshold, --m2po-quadrant-threshold, --dppo-delta) on the same slice, in
    value and gradient, and log the unit's figure; tests/test_m2po_forms.py pins each unit to its float loop."""
    trainer = make_trainer(policy_dir, tmp_path, offpolicy_steps=3, **{field: value})
    trainer.model.train()
    batch = trainer._generate_and_score_completions(rows(trainer, 8))
    cmask = batch["completion_mask"]
    batch["old_per_token_logps"] = noisy(batch["old_per_token_logps"], cmask, seed=2)  # a staler alpha
    trainer._set_step_normalisers([batch], group=1)
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    grads = [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]
    trainer.model.zero_grad()
    adv, valid = group_advantages(trainer._rewards.sum(dim=1), G)
    logp = chunked_token_logprobs(trainer.model, *sequences(batch), cmask, 1.0)
    mask = cmask * valid.unsqueeze(1)
    x = objective.LossInput(logp, batch["old_per_token_logps"], logp.detach(), None, adv, mask, float(mask.sum()))
    recipe = variants.recipe(Config(**flags))
    assert len(recipe.names) == 1
    loop, st = recipe.loss(x)
    loop.backward()
    loop_grads = [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]
    assert abs(loss.item() - loop.item()) < 1e-5
    for g_trl, g_loop in zip(grads, loop_grads, strict=True):
        torch.testing.assert_close(g_trl, g_loop, atol=1e-5, rtol=1e-4)
    logged = trainer._metrics["train"][f"offpolicy/{stat}"][-1]
    assert logged == pytest.approx(st[stat], rel=1e-5)
    if stat == "m2po_clip_hi":
        assert 1.0 <= logged < 1e5  # the budget bound on this slice
    else:
        assert logged > 0  # tokens masked on this slice
    plain = variants.recipe(Config(clip_center="pi_k")).loss(x)[0].item()
    assert abs(plain - loop.item()) > 1e-6  # the unit changed the loss


def test_m2po_forms_and_dppo_refused_where_they_cannot_act(tmp_path):
    base = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none", num_generations=4)
    for bad, msg in [
        (dict(m2po_clip_threshold=0.0), "m2po_clip_threshold must be > 0"),
        (dict(m2po_quadrant_threshold=-1.0), "m2po_quadrant_threshold > 0"),
        (dict(dppo_delta=-0.1), "dppo_delta"),
        (dict(dppo_delta=0.2, m2_threshold=0.04), "one M2PO form or DPPO at a time"),
        (dict(policy_loss="rec", dppo_delta=0.2), "policy_loss='grpo' only"),
        (dict(clip_center="alpha", m2po_clip_threshold=0.04), "set their own clip"),
        (dict(m2po_clip_floor=True), "m2po_clip_floor needs its threshold"),
    ]:
        with pytest.raises(ValueError, match=msg):
            OffPolicyGRPOConfig(**base, **bad)
