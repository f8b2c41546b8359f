"""The project keeps its promises about itself: the README's commands, CI, proofs and the public API."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

import otb_spec

ROOT = Path(__file__).resolve().parents[1]


def _marked(name: str) -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    match = re.search(rf"<!-- {name} -->\s*```bash\n(.*?)\n```\s*<!-- /{name} -->", text, re.S)
    assert match, f"README.md has no {name} block"
    return match.group(1).strip()


def test_readme_has_exactly_two_quick_start_commands():
    main, tests = _marked("main-command"), _marked("test-command")
    assert "\n" not in main and "\n" not in tests
    assert main.startswith("python -m pip install torch==2.13.0") and tests.startswith(
        "python -m pip install torch==2.13.0"), "torch 2.13.0 must be installed before anything that requires it"
    assert "otb-spec" in main
    assert tests.split(" && ")[-1].startswith("python -m pytest"), "the test command ends by running pytest"


def test_ci_runs_the_readme_test_command():
    script = ROOT / ".ci" / "run"
    assert script.stat().st_mode & 0o111, ".ci/run must be executable"
    extracted = subprocess.run(
        ["bash", "-c", "sed -n '/<!-- test-command -->/,/<!-- \\/test-command -->/p' README.md "
                       "| grep -v '^<!--' | grep -v '^```'"],
        cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    assert extracted == _marked("test-command")
    assert 'eval "$command"' in script.read_text()


def _test_functions() -> dict[str, set[str]]:
    functions: dict[str, set[str]] = {}
    for path in (ROOT / "tests").glob("test_*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        functions[f"tests/{path.name}"] = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
    return functions


PROOFS = sorted(path for path in (ROOT / "proofs").glob("*.md") if path.name != "README.md")


@pytest.mark.parametrize("proof", PROOFS, ids=[path.name for path in PROOFS])
def test_every_proof_names_checks_that_exist(proof):
    """Each proof file has Statement, Derivation and Check sections; every test it names exists."""
    text = proof.read_text(encoding="utf-8")
    for section in ("## Statement", "## Derivation", "## Check"):
        assert section in text, f"{proof.name}: missing '{section}'"
    check = text.split("## Check", 1)[1]
    named = re.findall(r"`(tests/test_\w+\.py)::(\w+)`", check)
    assert named, f"{proof.name}: the Check section names no test"
    functions = _test_functions()
    for path, function in named:
        assert function in functions.get(path, set()), f"{proof.name}: {path}::{function} does not exist"


def test_public_api_is_curated():
    assert len(otb_spec.__all__) == len(set(otb_spec.__all__))
    for name in otb_spec.__all__:
        assert hasattr(otb_spec, name), name
    for module in ("otb_spec.strategies", "otb_spec.tolerances"):
        imported = __import__(module, fromlist=["__all__"])
        for name in imported.__all__:
            assert hasattr(imported, name), f"{module}.{name}"


def test_documented_files_exist():
    """Every repository path the docs and docstrings point to exists."""
    sources = list((ROOT / "otb_spec").rglob("*.py")) + list((ROOT / "adapters").rglob("*.py")) + \
        list((ROOT / "docs").rglob("*.md")) + list((ROOT / "proofs").rglob("*.md")) + [ROOT / "README.md"]
    missing = set()
    for source in sources:
        for reference in re.findall(r"\b((?:docs|proofs|benchmarks|tests)/[\w./-]+\.(?:md|py))", source.read_text(
                encoding="utf-8")):
            if not (ROOT / reference).exists():
                missing.add(f"{source.relative_to(ROOT)} → {reference}")
    assert not missing, sorted(missing)


def _package_imports() -> dict[str, set[str]]:
    """otb_spec module → the otb_spec modules it imports, at module level or inside functions (a deferred import
    still closes a cycle: it only moves the failure from import time to call time)."""
    modules = {}
    for path in (ROOT / "otb_spec").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
            else:
                continue
            edges |= {target for target in targets if target in modules and target != name}
        graph[name] = edges
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A chain of imports leading from a module back to itself, or None (depth-first search)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        stack.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                return stack[stack.index(target):] + [target]
            if target not in state and (found := visit(target)):
                return found
        stack.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module)):
            return found
    return None


def test_the_package_has_no_import_cycle():
    """No chain of imports — module-level or deferred inside a function — leads from an otb_spec module back to itself
    (issue 11: otb → _validation → tolerances → otb was closed by a function-level import)."""
    cycle = _find_cycle(_package_imports())
    assert cycle is None, "import cycle: " + " → ".join(cycle)


def test_the_import_cycle_check_can_fail():
    """The old layout's deferred import (tolerances importing otb, which imports _validation, which imports the
    tolerances' table) is found as a cycle."""
    graph = _package_imports()
    graph["otb_spec._dtypes"] = graph["otb_spec._dtypes"] | {"otb_spec.tolerances"}
    assert _find_cycle(graph) is not None
