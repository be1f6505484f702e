"""The layout promises of docs/design.md, checked on the source: the concept files at the top, the engines,
studies and benchmarks in folders; no import circle; no top-level file importing a folder; what each concept
file may import; which names cross a file boundary; and that the benchmark times the training step."""

import ast
import inspect
import sys

import pytest

from conftest import ROOT

STDLIB = set(sys.stdlib_module_names)
FOLDERS = ("integrations", "studies", "benchmarks")


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
                # `from studies import runner` imports studies.runner; `from step import clock` imports step.
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


def test_no_top_level_file_imports_a_folder():
    graph = project_modules()
    bad = {m: deps for m, deps in graph.items() if "." not in m and any("." in d for d in deps)}
    assert bad == {}


def test_the_top_level_holds_at_most_14_files_and_no_file_is_over_400_lines():
    assert len(list(ROOT.glob("*.py"))) <= 14, sorted(p.name for p in ROOT.glob("*.py"))
    py = [*ROOT.glob("*.py"), *(p for d in FOLDERS for p in (ROOT / d).glob("*.py")), *(ROOT / "tests").glob("*.py")]
    long = {p.name: n for p in py if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}


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
    called = {
        node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
        for node in ast.walk(ast.parse((ROOT / "benchmarks" / "bench.py").read_text()))
        if isinstance(node, ast.Call)
    }
    steps = {"generate", "token_logprobs", "group_advantages", "update", "policy_loss"}
    imported = {n for _, names in imports("benchmarks/bench.py") for n in names}
    assert "grpo_step" in called and "grpo_step" in imported
    # (`update` is also dict.update, so for it only the import counts.)
    assert not (called - {"update"}) & steps and not imported & steps, (called, imported)


def test_the_training_loop_stays_short():
    import train

    assert len(inspect.getsourcelines(train.train)[0]) <= 90


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
