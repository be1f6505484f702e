"""The layout promises of docs/design.md, checked on the source: the concept files at the top, the engines,
studies and benchmarks in folders; no import circle; no top-level file importing a folder; what each concept
file may import; which names cross a file boundary; that the benchmark times the training step; and that the
README's reading order names functions that exist, at the sizes it states."""

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
    [
        ("advantage.py", {"torch"}),
        ("objective.py", {"torch"}),
        ("corrections.py", {"torch", "objective"}),
        ("reinforce.py", {"torch", "objective"}),
        ("logprobs.py", {"torch"}),
        ("reward.py", set()),  # the numeric verifier: the standard library only, it copies alone
        ("math_verifier.py", {"math_verify", "reward"}),  # math-verify imported lazily, at the first call
    ],
)
def test_concept_files_import_only_torch_or_the_standard_library(name, allowed):
    for module, _ in imports(name):
        top = module.split(".")[0]
        assert top in allowed or top in STDLIB, f"{name} imports {module}"


def test_the_reference_sampler_copies_with_logprobs_alone():
    # rollout.py takes the fast loop as an argument (step.sampler chooses it): it imports no other project file.
    project = {p.stem for p in ROOT.glob("*.py")}
    assert {m.split(".")[0] for m, _ in imports("rollout.py")} & project == {"logprobs"}


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
    # transformers' own model.generate, the sampler's baseline, is timed as itself: not a step of ours.
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


def reading_order() -> tuple[list[tuple[str, str, int]], int]:
    """The README's "Read the code" table: (file, function, stated lines) per row, and the stated total."""
    import re

    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Read the code", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| \d+ \| \[`([\w.]+)`\]\(([\w/]+\.py)#L\d+\) \| (\d+) \|", section, flags=re.M)
    total = re.search(r"(\d+) lines in all", section)
    return [(path, name, int(n)) for name, path, n in rows], int(total.group(1)) if total else -1


def test_the_reading_order_names_functions_that_exist_at_the_stated_size_and_line():
    """Each row links to the function's first line and states its size (def to last line, docstring included)."""
    import importlib
    import re

    rows, total = reading_order()
    assert len(rows) >= 8, rows  # the path from the loop to the loss, not a stub
    readme = (ROOT / "README.md").read_text()
    for path, name, stated in rows:
        module = importlib.import_module(path.removesuffix(".py"))
        obj = module
        for part in name.split(".")[1:]:  # `step.update` -> step's update
            obj = getattr(obj, part)
        obj = inspect.unwrap(obj)
        lines, first = inspect.getsourcelines(obj)
        assert len(lines) == stated, f"{name}: {len(lines)} lines, the README says {stated}"
        assert f"[`{name}`]({path}#L{first})" in readme, f"{name} starts at line {first} of {path}"
    assert total == sum(n for _, _, n in rows), (total, sum(n for _, _, n in rows))
    # The section is the default run's path: every function it names is reached by `python train.py`.
    assert {name for _, name, _ in rows} >= {"train.train", "step.grpo_step", "step.update", "objective.policy_loss"}
    assert re.search(r"python train\.py", readme)


def test_the_reading_order_check_sees_a_wrong_size(monkeypatch, tmp_path):
    # The check itself can fail: a README whose stated size is off by one.
    import conftest

    rows, _ = reading_order()
    path, name, stated = rows[0]
    readme = (ROOT / "README.md").read_text()
    line = next(x for x in readme.splitlines() if f"[`{name}`]" in x)
    wrong = readme.replace(line, line.replace(f"| {stated} |", f"| {stated + 1} |"), 1)
    (tmp_path / "README.md").write_text(wrong)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(conftest, "ROOT", tmp_path)
    with pytest.raises(AssertionError, match="lines, the README says"):
        test_the_reading_order_names_functions_that_exist_at_the_stated_size_and_line()


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
