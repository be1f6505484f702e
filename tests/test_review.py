"""Defects a close review found, each pinned by a test that failed before its fix (issue: "the house, part 2")."""

import dataclasses
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import train
from bookkeeping import run_io
from config import Config, resolve
from conftest import ROOT, needs
from engine.chunked_logprobs import chunked_token_logprobs
from objective import LossInput, aggregation_total, surrogate
from test_staleness import corrected_loss
from test_train import make_batch
from variants import Recipe, reinforce
from variants.corrections import mis_keep_mask
from variants.reinforce import opmd_loss, rec_loss


def overflow_outside_the_mask():
    """Two sequences of 3 tokens; the last token of each is outside the mask and its rho' overflows (inf)."""
    logp = torch.full((2, 3), -1.0, dtype=torch.float64, requires_grad=True)
    alpha_logp = torch.tensor([[-1.0, -1.2, -1000.0], [-0.8, -1.0, -1000.0]], dtype=torch.float64)
    pi_k_logp = torch.tensor([[-1.1, -1.0, 0.0], [-0.9, -1.1, 0.0]], dtype=torch.float64)  # exp(1000) = inf
    ref = torch.tensor([[-1.0, -1.0, 1000.0], [-1.0, -1.0, 1000.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    return logp, alpha_logp, pi_k_logp, ref, torch.tensor([1.0, -1.0], dtype=torch.float64), mask


@pytest.mark.parametrize(
    "loss",
    ["pi_k", "alpha", "decoupled", "decoupled-tis", "mis", "m2po", "opsm", "kl-is", "rec", "rec-is", "opmd"],
)
def test_a_token_outside_the_mask_cannot_make_the_loss_or_gradient_non_finite(loss):
    logp, alpha_logp, pi_k_logp, ref, adv, mask = overflow_outside_the_mask()
    center = loss.split("-")[0] if loss in ("pi_k", "alpha", "decoupled", "decoupled-tis") else "pi_k"
    kw = dict(
        is_cap=2.0 if loss == "decoupled-tis" else None,
        is_mask=4.0 if loss == "mis" else None,
        m2_threshold=0.01 if loss == "m2po" else None,
        opsm_delta=0.0 if loss == "opsm" else None,
        kl_importance_weight=loss == "kl-is",
        loss=loss if loss in ("rec", "rec-is", "opmd") else "grpo",
    )
    if loss in ("rec", "rec-is"):
        value, _ = rec_loss(LossInput(logp, alpha_logp, None, None, adv, mask), importance_weight=loss == "rec-is")
    elif loss == "opmd":
        value, _ = opmd_loss(LossInput(logp, alpha_logp, None, None, adv, mask))
    else:
        value, _ = corrected_loss(logp, alpha_logp, pi_k_logp, ref, adv, mask, clip_center=center, beta=0.1, **kw)
    value.backward()
    assert torch.isfinite(value) and torch.isfinite(logp.grad).all(), (value, logp.grad)
    assert (logp.grad[:, 2] == 0).all()  # the masked-out tokens get no gradient
    # ... and the value is that of the same batch without the masked-out column.
    sub = [t[:, :2] if t.dim() == 2 else t for t in overflow_outside_the_mask()]
    if loss in ("rec", "rec-is"):
        expected, _ = rec_loss(
            LossInput(sub[0], sub[1], None, None, sub[4], sub[5]), importance_weight=loss == "rec-is"
        )
    elif loss == "opmd":
        expected, _ = opmd_loss(LossInput(sub[0], sub[1], None, None, sub[4], sub[5]))
    else:
        expected, _ = corrected_loss(*sub, clip_center=center, beta=0.1, **kw)
    assert value.item() == pytest.approx(expected.item(), rel=1e-12)
    if loss in ("rec", "rec-is", "opmd"):  # the unit, through the recipe, as well
        y = logp.detach().clone().requires_grad_(True)
        unit, _ = corrected_loss(y, alpha_logp, pi_k_logp, ref, adv, mask, beta=0.1, **kw)
        unit.backward()
        assert torch.isfinite(y.grad).all() and (y.grad[:, 2] == 0).all()
        assert unit.item() == pytest.approx(expected.item(), rel=1e-12)


def test_per_token_terms_are_named_tuples():
    logp, alpha_logp, pi_k_logp, _, adv, mask = overflow_outside_the_mask()
    keep = mis_keep_mask(alpha_logp[:, :2], pi_k_logp[:, :2], 4.0, loss_mask=mask[:, :2])  # MIS's kept tokens
    x = LossInput(logp[:, :2], alpha_logp[:, :2], pi_k_logp[:, :2], None, adv, mask[:, :2] * keep)
    o = surrogate(x, clip_center="alpha")
    assert o._fields == ("objective", "rho", "clip_low", "clip_high")
    assert o.objective.shape == o.rho.shape == o.clip_low.shape == o.clip_high.shape == keep.shape == (2, 2)
    r = reinforce.rec_per_token(logp[:, :2], alpha_logp[:, :2], adv)
    assert r.objective.shape == r.rho.shape == r.clip_low.shape == r.clip_high.shape == (2, 2)
    m = reinforce.opmd_per_token(logp[:, :2], alpha_logp[:, :2], adv)
    assert m.per_token.shape == m.log_rho.shape == (2, 2)


def dropout_model(tok):
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attention_dropout=0.5,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg)


def test_dropout_is_off_in_every_log_prob_pass(tok):
    # A refresh step (alpha = pi_k = pi_theta): rho must be exactly 1, and log pi_k the model's eval forward.
    model = dropout_model(tok)
    batch = make_batch(model, tok)
    cfg = resolve(Config(group_size=4, prompts_per_step=4, out="/tmp/unused", lr=0.0))
    stats, pi_k = train.update(cfg, model, torch.optim.SGD(model.parameters(), lr=0.0), batch, None)
    model.eval()
    with torch.no_grad():
        eval_logp = chunked_token_logprobs(model, batch.input_ids, batch.attention_mask, batch.completion_mask, 1.0)
    m = batch.loss_mask > 0
    assert torch.equal(pi_k[m], eval_logp[m])
    assert stats["rho_mean"] == 1.0 and stats["clip_low"] == stats["clip_high"] == 0.0


def test_update_gives_every_micro_batch_the_final_normaliser_and_computes_the_mismatch_once(model, tok, monkeypatch):
    # A stale step with MIS, micro-batched: every micro-batch's loss gets the whole step's MIS normaliser.
    batch = make_batch(model, tok)
    with torch.no_grad():
        logp = chunked_token_logprobs(model, batch.input_ids, batch.attention_mask, batch.completion_mask, 1.0)
    alpha_logp = logp + 0.8 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(0))
    cfg = resolve(Config(group_size=4, prompts_per_step=4, out="/tmp/unused", micro_batch=4, is_mask=1.5))
    calls, keep_calls, stats_calls = [], [], []
    real_loss, real_keep, real_stats = Recipe.loss, Recipe.step_keep, train.drift_stats
    monkeypatch.setattr(Recipe, "loss", lambda self, x: calls.append(x) or real_loss(self, x))
    monkeypatch.setattr(Recipe, "step_keep", lambda self, *a: keep_calls.append(1) or real_keep(self, *a))
    monkeypatch.setattr(train, "drift_stats", lambda *a, **kw: stats_calls.append(1) or real_stats(*a, **kw))
    stale = dataclasses.replace(batch, alpha_logp=alpha_logp)
    stats, _ = train.update(cfg, model, torch.optim.SGD(model.parameters(), lr=0.0), stale, None)
    keep = mis_keep_mask(alpha_logp, logp, 1.5)
    expected = aggregation_total(batch.loss_mask * keep, cfg.agg, cfg.max_new_tokens)
    assert len(calls) == 4  # MIS's keep reaches every micro-batch, as its rows of the loss mask
    for c, rows in zip(calls, [slice(s, s + 4) for s in range(0, 16, 4)], strict=True):
        assert torch.equal(c.loss_mask, batch.loss_mask[rows] * keep[rows])
    assert {c.total for c in calls} == {expected} and expected < batch.loss_mask.sum().item()
    assert keep_calls == [1] and stats_calls == [1]  # the step's keep and its figures, once a step
    dropped = (batch.loss_mask * ~keep).sum().item() / batch.loss_mask.sum().item()
    assert stats["is_masked_frac"] == pytest.approx(dropped) and dropped > 0


def test_curves_of_a_run_without_a_clip_draw_without_warnings(tmp_path):
    needs("matplotlib", "plot")
    rows = [{"step": k, "reward": 0.5, "kl": 0.0, "entropy": 1.0, "rho_prime_max": 1.0} for k in range(3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run_io.write_curves(tmp_path, {"eval_accuracy_start": 0.1, "eval_accuracy_end": 0.2, "steps": 3})


@pytest.mark.model
def test_bench_trl_subclass_honours_steps_and_warmup_and_leaves_no_folder(tmp_path):
    needs("trl", "trl")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    sizes = ["--prompts-per-step", "2", "--group-size", "2", "--prompt-len", "4", "--max-new-tokens", "2"]
    sizes += ["--threads", "1"]
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench", "--trl-subclass", *sizes, "--steps", "2", "--warmup", "0"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(res) == {"TRL GRPOTrainer", "ours v=1", "ours v=4"} and all(r["steps"] == 2 for r in res.values())
    assert list(tmp_path.iterdir()) == []  # no model or output folder left behind
