"""The layout promises of design.md and style.md, checked on the source: what each file may import,
which names cross a file boundary, and that the benchmark times the training step rather than a copy."""

import ast
import inspect
import sys

import pytest

from conftest import ROOT

STDLIB = set(sys.stdlib_module_names)


def imports(name: str) -> list[tuple[str, list[str]]]:
    """(module, imported names) for every import statement in ROOT/name."""
    tree = ast.parse((ROOT / name).read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append((node.module, [a.name for a in node.names]))
    return out


@pytest.mark.parametrize(
    "name, allowed",
    [("advantage.py", {"torch"}), ("objective.py", {"torch"}), ("logprobs.py", {"torch"}), ("reward.py", set())],
)
def test_concept_files_import_only_torch_or_the_standard_library(name, allowed):
    for module, _ in imports(name):
        top = module.split(".")[0]
        assert top in allowed or top in STDLIB, f"{name} imports {module}"


def test_rollout_uses_only_public_names_of_decoding():
    for module, names in imports("rollout.py"):
        if module == "decoding":
            assert not [n for n in names if n.startswith("_")], names


def test_bench_times_the_training_step_not_a_copy():
    called = {
        node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
        for node in ast.walk(ast.parse((ROOT / "bench.py").read_text()))
        if isinstance(node, ast.Call)
    }
    steps = {"generate", "token_logprobs", "group_advantages", "update", "policy_loss"}
    imported = {n for _, names in imports("bench.py") for n in names}
    assert "grpo_step" in called and "grpo_step" in imported
    # (`update` is also dict.update, so for it only the import counts.)
    assert not (called - {"update"}) & steps and not imported & steps, (called, imported)


def test_the_training_loop_stays_short():
    import train

    assert len(inspect.getsourcelines(train.train)[0]) <= 90
