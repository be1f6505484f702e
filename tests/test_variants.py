"""variants/registry.py's promise: a new variant is one class and one `register` line, and the real loop
(train.train) runs it with no other change; and [A]'s core stays [A]'s: objective.policy_loss takes a handful of
settings and objective.py names no other engine's correction."""

import ast
import inspect
import random
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import objective
import problems.prompts
import train
import variants
from config import Config, resolve
from conftest import TEST_WARMUP, jsonl
from variants.registry import REGISTRY, Variant, register


class HalveAdvantages(Variant):
    """A <- A / 2 after group_advantages: the whole of a variant, one hook. It records the advantages it saw."""

    seen: list = []

    @classmethod
    def from_config(cls, cfg):
        return cls()  # registered only inside a test: while it is, every run asks for it

    def advantages(self, rewards, gen, inner, **kw):
        A, valid = inner(rewards, **kw)  # (N,) each: the rest of the chain, ending in group_advantages
        type(self).seen.append(A.clone())
        return A / 2, valid


@pytest.fixture
def registry_restored(monkeypatch):
    """REGISTRY as it was, whatever a test registers; HalveAdvantages' record emptied."""
    before = dict(REGISTRY)
    monkeypatch.setattr(HalveAdvantages, "seen", [])
    yield
    REGISTRY.clear()
    REGISTRY.update(before)
    assert list(REGISTRY) == list(before)


def test_register_adds_a_unit_in_order_and_refuses_a_name_twice(registry_restored):
    names = list(REGISTRY)
    assert variants.recipe(Config()).names == []  # the default run: [A] alone
    register("halve-advantages")(HalveAdvantages)
    assert list(REGISTRY) == names + ["halve-advantages"] and HalveAdvantages.name == "halve-advantages"
    recipe = variants.recipe(Config(group_size=4, asymre_shift=0.1))
    assert recipe.names == ["asymre", "halve-advantages"]  # REGISTRY's order: AsymRE outermost, then the new unit
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    A, valid = recipe.advantages(rewards, torch.Generator().manual_seed(0))
    # AsymRE wraps the halving, which wraps group_advantages: (r - mean) / 2 + shift
    assert torch.allclose(A, torch.tensor([0.75, -0.25, -0.25, -0.25]) / 2 + 0.1) and valid.all()
    assert len(HalveAdvantages.seen) == 1
    with pytest.raises(ValueError, match="registered already"):
        register("halve-advantages")(HalveAdvantages)


@pytest.mark.model
def test_a_variant_in_one_class_and_one_register_line_changes_the_real_loop(
    warm_cache, tmp_path, monkeypatch, registry_restored
):
    def run(name):
        coin = random.Random(0)  # the same rewards in both runs, and every step with signal
        monkeypatch.setattr(problems.prompts, "math_reward", lambda c, g: float(coin.random() < 0.5))
        cfg = Config(
            steps=2,
            prompts_per_step=4,
            group_size=4,
            lr=1e-3,
            eval_size=4,
            eval_every=0,
            eval_start=False,
            progress=False,
            warmup_steps=TEST_WARMUP,
            cache_dir=warm_cache,
            out=str(tmp_path / name),
        )
        train.train(resolve(cfg))
        rows = {r["step"]: r for r in jsonl(tmp_path / name / "metrics.jsonl") if "loss" in r}
        return rows, load_file(tmp_path / name / "final" / "model.safetensors")

    plain_rows, plain_weights = run("plain")
    assert HalveAdvantages.seen == []  # not registered: no run calls it

    register("halve-advantages")(HalveAdvantages)  # the one line
    rows, weights = run("halve")
    assert len(HalveAdvantages.seen) == 2  # step 4 of each step of the run went through the unit
    # Step 0 samples the same batch with the same rewards (the starting weights, the same generator): its advantages
    # are the plain run's, halved, so are its loss and gradient (the loss is 0 where the completions are equally
    # long: the advantages of a group sum to 0).
    assert 0 in rows and 0 in plain_rows and plain_rows[0]["grad_norm"] > 1e-6
    assert rows[0]["reward"] == plain_rows[0]["reward"]
    assert rows[0]["loss"] == pytest.approx(plain_rows[0]["loss"] / 2, rel=1e-6, abs=1e-9)
    assert rows[0]["grad_norm"] == pytest.approx(plain_rows[0]["grad_norm"] / 2, rel=1e-5)
    # and the run ends elsewhere
    assert weights.keys() == plain_weights.keys()
    assert not all(torch.equal(weights[k], plain_weights[k]) for k in weights)


def test_the_core_takes_few_settings_and_names_no_other_engines_correction():
    params = inspect.signature(objective.policy_loss).parameters
    assert len(params) <= 8, list(params)
    assert list(params) == ["x", "clip_eps", "clip_eps_high", "clip_center", "beta", "kl_estimator", "agg"]
    assert list(inspect.signature(objective.surrogate).parameters) == ["x", "clip_eps", "clip_eps_high", "clip_center"]
    assert list(inspect.signature(objective.aggregate).parameters) == ["per_token", "loss_mask", "agg", "total"]
    assert objective.CLIP_CENTERS == ("pi_k", "alpha")
    assert [f for f in objective.LossInput.__dataclass_fields__] == [
        "logp",
        "alpha_logp",
        "pi_k_logp",
        "ref_logp",
        "advantages",
        "loss_mask",
        "total",
    ]
    source = Path(objective.__file__).read_text()
    # Its text, docstrings included, names none of the corrections variants/ holds, nor their engine's flags.
    corrections = ["decoupled", "TIS", "MIS", "M2PO", "OPSM", "AReaL", "importance_weight", "keep_objective"]
    corrections += ["is_cap", "is_mask", "is_level", "m2_threshold", "opsm_delta", "correction_args", "REC", "OPMD"]
    corrections += ["RED", "AsymRE", "rec_loss", "opmd_loss"]
    named = [n for n in corrections if re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", source, re.IGNORECASE)]
    assert named == [], named
    # Its code (every name it defines, binds or reads) has no correction's argument: no weight, keep or mask of a
    # variant, no max_new_tokens in a loss (Z is `total`, counted once by the caller).
    identifiers = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name):
            identifiers.add(node.id)
        elif isinstance(node, ast.arg):
            identifiers.add(node.arg)
        elif isinstance(node, ast.Attribute):
            identifiers.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            identifiers.add(node.name)
    assert "policy_loss" in identifiers and "loss_mask" in identifiers  # the walk sees the code
    words = ("weight", "keep", "decoupled", "importance", "cap", "opsm", "m2", "mis", "tis")
    found = sorted(i for i in identifiers if any(w in i.lower().split("_") for w in words))
    assert found == [], found
    params = {p for f in (objective.policy_loss, objective.surrogate) for p in inspect.signature(f).parameters}
    assert "max_new_tokens" not in params
