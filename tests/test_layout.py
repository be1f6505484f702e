"""The layout promises of docs/design.md, checked on the source: the brief's files and what they share at the top,
everything else in folders named for their role, each folder's docstring listing its files; no import circle; no
top-level file but train.py importing a folder; what each algorithm file may import; which names cross a file
boundary; that the benchmark times the training step; and that the functions the README names exist."""

import ast
import os
import sys

import pytest

from conftest import ROOT

STDLIB = set(sys.stdlib_module_names)
# The top level: the brief's five files, the log-prob function they share and the flags.
TOP = {"rollout", "advantage", "objective", "reward", "train", "logprobs", "config"}
ROLES = ("bookkeeping", "problems", "engine", "variants")  # what train.py calls: the run's housekeeping, by role
FOLDERS = (*ROLES, "integrations", "studies", "benchmarks")


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
    [
        ("advantage.py", {"torch"}),
        ("objective.py", {"torch"}),
        ("variants/registry.py", {"torch", "objective", "advantage"}),
        ("variants/corrections.py", {"torch", "objective", "variants"}),  # variants.registry: Variant, register
        ("variants/reinforce.py", {"torch", "objective", "variants"}),
        ("variants/shaping.py", {"torch", "variants"}),
        ("logprobs.py", {"torch"}),
        ("rollout.py", {"torch", "logprobs", "transformers"}),  # transformers' DynamicCache, in `sample` only
        ("reward.py", set()),  # the numeric verifier: the standard library only, it copies alone
        ("problems/math_verifier.py", {"math_verify", "reward"}),  # math-verify imported lazily, at the first call
    ],
)
def test_concept_files_import_only_torch_or_the_standard_library(name, allowed):
    for module, _ in imports(name):
        top = module.split(".")[0]
        assert top in allowed or top in STDLIB, f"{name} imports {module}"


def test_the_reference_sampling_loop_copies_with_logprobs_alone():
    # rollout.py takes the fast loop as an argument (train.sampling_loop chooses it): it imports no other project file.
    project = {p.stem for p in ROOT.glob("*.py")}
    assert {m.split(".")[0] for m, _ in imports("rollout.py")} & project == {"logprobs"}


def test_the_top_level_is_the_brief_and_each_folder_lists_its_files():
    assert {p.stem for p in ROOT.glob("*.py")} == TOP
    for folder in FOLDERS:
        listed = ast.get_docstring(ast.parse((ROOT / folder / "__init__.py").read_text())) or ""
        files = sorted(p.name for p in (ROOT / folder).glob("*.py") if p.name != "__init__.py")
        assert files and [f for f in files if f not in listed] == [], f"{folder}/__init__.py does not list {files}"


def test_every_python_file_is_where_ruff_and_this_test_look():
    # Code lives at the top, in FOLDERS or in tests/; results/ holds data only. Ruff excludes nothing but venvs.
    skip = (".venv", ".cache", ".git")
    files = [p.relative_to(ROOT) for p in ROOT.rglob("*.py") if not p.relative_to(ROOT).parts[0].startswith(skip)]
    stray = [str(f) for f in files if len(f.parts) > 1 and f.parts[0] not in (*FOLDERS, "tests")]
    assert not stray, stray
    assert [f for f in files if f.parts[0] == "results"] == []
    assert 'extend-exclude = [".venv*"]' in (ROOT / "pyproject.toml").read_text()


@pytest.mark.parametrize("module", [f"studies.real_model_{name}" for name in ("measure", "completions", "eval")])
def test_the_studies_scripts_import(module):
    # They run as `python -m studies.X`: importing one resolves every project name it uses.
    __import__(module)


def project_modules(root=ROOT) -> dict[str, list[str]]:
    """Every module of the project (top-level files and the folders' files, as dotted names) -> the project
    modules it imports, anywhere in the file (a function-level import counts: it is a dependency all the same)."""
    files = {p.stem: p for p in root.glob("*.py")}
    files |= {f"{d}.{p.stem}": p for d in FOLDERS for p in (root / d).glob("*.py") if p.stem != "__init__"}
    graph = {}
    for name, path in files.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                # `from studies import runner` imports studies.runner; `from train import update` imports train.
                deps |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        graph[name] = sorted(d for d in deps if d in files and d != name)
    return graph


def circles(graph: dict[str, list[str]]) -> list[list[str]]:
    """Every import circle, each as the path a -> ... -> a found by a depth-first walk (empty: none)."""
    found, done = [], set()

    def walk(node, path):
        if node in path:
            found.append(path[path.index(node) :] + [node])
            return
        if node in done:
            return
        for dep in graph[node]:
            walk(dep, path + [node])
        done.add(node)

    for node in graph:
        walk(node, [])
    return found


def test_no_import_circle():
    assert circles(project_modules()) == []


def test_only_train_py_imports_a_folder():
    # The algorithm files and the flags stand alone; train.py is where the folders meet the algorithm.
    graph = project_modules()
    bad = {m: deps for m, deps in graph.items() if "." not in m and m != "train" and any("." in d for d in deps)}
    assert bad == {}
    assert any(d.startswith("bookkeeping.") for d in graph["train"])  # the check sees a folder import


def test_the_circle_check_sees_a_circle(tmp_path):
    # The check itself can fail: two files that import each other, and a third importing a folder.
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from a import g\n")
    (tmp_path / "studies").mkdir()
    (tmp_path / "studies" / "runner.py").write_text("import a\n")
    (tmp_path / "c.py").write_text("from studies import runner\n")
    graph = project_modules(tmp_path)
    assert circles(graph) == [["a", "b", "a"]]
    assert graph["c"] == ["studies.runner"]


def test_bench_times_the_training_step_not_a_copy():
    tree = ast.parse((ROOT / "benchmarks" / "bench.py").read_text())
    # transformers' own model.generate, the sampling loop's baseline, is timed as itself: not a step of ours.
    baseline = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "generate_tokens_per_s")
    in_baseline = {id(node) for node in ast.walk(baseline)}
    called = {
        node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and id(node) not in in_baseline
    }
    steps = {"generate", "token_logprobs", "chunked_token_logprobs", "group_advantages", "update", "policy_loss"}
    imported = {n for _, names in imports("benchmarks/bench.py") for n in names}
    assert "grpo_step" in called and "grpo_step" in imported
    # (`update` is also dict.update, so for it only the import counts.)
    assert not (called - {"update"}) & steps and not imported & steps, (called, imported)


def test_top_level_files_re_export_nothing():
    # A name is imported from the module that defines it (tests included), never through a re-export.
    modules = {p.stem for p in ROOT.glob("*.py")}
    for path in ROOT.glob("*.py"):
        for line in path.read_text().splitlines():
            if line.startswith("from ") and "noqa: F401" in line:
                assert line.split()[1] not in modules, f"{path.name} re-exports: {line}"


def test_every_cited_document_and_readme_section_exists():
    """A reader who clones the repository can follow every reference: docs/*.md files, and README sections
    cited as README section names in quotes."""
    import re

    readme = (ROOT / "README.md").read_text()
    headings = {h.strip() for h in re.findall(r"^#+ (.+)$", readme, flags=re.M)}
    texts = [*ROOT.glob("*.py"), *(p for d in FOLDERS for p in (ROOT / d).glob("*.py")), *(ROOT / "tests").glob("*.py")]
    texts += [*ROOT.glob("*.md"), *(ROOT / "docs").glob("*.md"), *(ROOT / "results").glob("*.md")]
    texts += [ROOT / "benchmarks" / "gpu_check.sh"]
    for path in texts:
        text = path.read_text()
        for doc in re.findall(r"(?<![\w/.])((?:design|style)\.md)\b", text):
            # A bare name of a design document means the project's own, in docs/.
            assert (ROOT / "docs" / doc).is_file(), f"{path.name} cites {doc}"
        for doc in re.findall(r"\b(?:docs|results)/[\w-]+\.md", text):
            assert (ROOT / doc).is_file(), f"{path.name} cites {doc}"
        for section in re.findall("README" + r', "([^"]+)"', text):  # split: this line must not match itself
            assert section in headings, f"{path.name} cites the README section {section!r}"


def named_functions(readme: str) -> list[str]:
    """Every `module.function` (or `folder.module.function`) the README names in backquotes, of a project module."""
    import re

    names = re.findall(r"`((?:[a-z_]+\.)+[A-Za-z_]+)`", readme)
    modules = TOP | {f"{d}.{p.stem}" for d in FOLDERS for p in (ROOT / d).glob("*.py")}
    files = {n for n in names if n.rsplit(".", 1)[1] in ("py", "md", "sh")}  # `train.py` names a file
    return [n for n in dict.fromkeys(names) if n.rsplit(".", 1)[0] in modules and n not in files]


def test_every_function_the_readme_names_exists():
    """The README links functions by name, never by line or size: each one it names is defined where it says."""
    import importlib

    readme = (ROOT / "README.md").read_text()
    names = named_functions(readme)
    # The reading path is the one the default run takes: the loop, the step, the update, the loss.
    assert {"train.train", "train.grpo_step", "train.update", "objective.policy_loss"} <= set(names), names
    for name in names:
        module, attr = name.rsplit(".", 1)
        assert hasattr(importlib.import_module(module), attr), f"the README names {name}, which does not exist"


def test_the_name_check_sees_a_missing_function():
    # The check itself can fail: a README naming a function that is not there.
    import importlib

    name = named_functions("read `objective.policy_loss`, then `train.no_such_step`")[-1]
    module, attr = name.rsplit(".", 1)
    assert name == "train.no_such_step" and not hasattr(importlib.import_module(module), attr)


def test_the_help_groups_are_the_dataclass_sections_and_cover_every_flag():
    # One taxonomy: --help's groups are config.py's `# --- title ---` sections, docs/flags.md's headings the same.
    import re
    from dataclasses import fields

    from config import Config, help_groups

    groups = help_groups()
    assert [n for names in groups.values() for n in names] == [f.name for f in fields(Config)]  # each once, in order
    headings = re.findall(r"^## (.+)$", (ROOT / "docs" / "flags.md").read_text(), flags=re.M)
    first_word = lambda title: title.lower().removeprefix("the ").split()[0].strip(",")  # noqa: E731
    assert [first_word(t) for t in groups] == [first_word(h) for h in headings], (list(groups), headings)


def test_help_names_only_files_that_exist_and_imports_nothing_heavy():
    # Issue 51: --help named rewards.py and tiny.py, gone since, and took 13 s importing transformers and peft
    # through train.py's top. Each file it names must exist; importing train.py (what --help runs) must not import
    # transformers, peft or datasets: they are imported where a run uses them.
    import re
    import subprocess

    from config import build_parser

    text = build_parser().format_help()
    named = set(re.findall(r"[\w/]+\.py\b", text)) - {"path/to/file.py"}
    assert named and all((ROOT / n).is_file() for n in named), sorted(n for n in named if not (ROOT / n).is_file())
    probe = "import sys, train; print(sorted({'transformers', 'peft', 'datasets'} & set(sys.modules)))"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # a shared machine: one thread, as every test subprocess
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "[]", (out.stdout, out.stderr[-2000:])
