"""The code's shape: small modules and functions, imports in one direction, cited documents present.

Read from the source files (ast), nothing imported: cheap, and a failure
names the module, the function or the import at fault.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("laplace_passes", "model_zoo")
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 60

# Layers of laplace_passes, bottom up (docs/DESIGN.md section 2), one subpackage or more each:
# a module may import its own layer and those below, never one above.
LAYERS = {
    "infra": ["infra"],
    "ops": ["ops"],
    "passes": ["fx", "unroll", "collectives", "fla"],
    "lowering": ["lowering"],
    "driver": ["driver"],
    "front door": ["tools", "demo", "__init__"],
}

def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def imports(name: str) -> set[str]:
    """The project modules `name` imports, anywhere in it (function-local imports too)."""
    found = set()
    for node in ast.walk(TREES[name]):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            # `from package import module` imports the module; `from module import name`, the module.
            targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
                       for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in MODULES and t != name}
    return found


def layer_of(name: str) -> int | None:
    parts = name.split(".")
    if parts[0] != "laplace_passes":
        return None
    top = parts[1] if len(parts) > 1 else "__init__"
    return next(i for i, (_, members) in enumerate(LAYERS.items()) if top in members)


def test_every_laplace_passes_module_has_a_layer():
    tops = {name.split(".")[1] if "." in name else "__init__" for name in MODULES if name.startswith("laplace_passes")}
    assert tops == {m for members in LAYERS.values() for m in members}


def test_the_package_root_holds_only_the_public_api():
    """Every module lives in the subpackage of its layer; the root's __init__ only hands names on."""
    loose = sorted(p.name for p in (ROOT / "laplace_passes").glob("*.py") if p.name != "__init__.py")
    assert not loose, f"modules outside a subpackage: {loose}"


def test_laplace_passes_targets_imports_as_docs_api_names_it():
    """docs/api.md's `laplace_passes.targets.TRN2`: reached as an attribute and imported as a module alike."""
    import laplace_passes
    from laplace_passes.targets import TRN2, get_target

    assert TRN2 is get_target("trn2") is laplace_passes.targets.TRN2
    assert importlib.import_module("laplace_passes.targets") is laplace_passes.targets


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_and_function_sizes(name):
    lines = MODULES[name].read_text().count("\n")
    assert lines <= MAX_MODULE_LINES, f"{name}: {lines} lines (at most {MAX_MODULE_LINES})"
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines, line {node.lineno})"
        for node in ast.walk(TREES[name])
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, f"{name}: functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_no_import_cycle():
    graph = nx.DiGraph((name, target) for name in MODULES for target in imports(name))
    cycles = sorted(nx.simple_cycles(graph), key=len)
    assert not cycles, f"import cycles, shortest first: {cycles[:5]}"


def test_imports_go_down_the_layers():
    layer_names = list(LAYERS)
    upward = [
        f"{name} ({layer_names[layer_of(name)]}) imports {target} ({layer_names[layer_of(target)]})"
        for name in MODULES if layer_of(name) is not None
        for target in imports(name) if layer_of(target) is not None and layer_of(target) > layer_of(name)
    ]
    assert not upward, "\n".join(upward)


def test_unroll_and_collectives_do_not_import_the_dynamo_level_passes():
    offending = [(name, target) for name in MODULES
                 if name.startswith(("laplace_passes.unroll", "laplace_passes.collectives"))
                 for target in imports(name) if target.startswith("laplace_passes.fx.")]
    assert not offending


DOCUMENT = re.compile(r"(?<![\w./])((?:\.\.?/)*(?:[\w-]+/)*[\w-]+\.md)\b")


def cited_documents() -> dict[str, set[str]]:
    """Every Markdown file a source file or document of the repository names, by the file naming it."""
    files = [*MODULES.values(), *ROOT.glob("benchmarks/*.py"), *ROOT.glob("tests/*.py"),
             ROOT / "README.md", *ROOT.glob("docs/*.md"), ROOT / "laplace.py", ROOT / "setup.cfg"]
    cited: dict[str, set[str]] = {}
    for path in files:
        for document in DOCUMENT.findall(path.read_text()):
            cited.setdefault(document, set()).add(str(path.relative_to(ROOT)))
    return cited


def test_every_cited_document_is_in_the_repository():
    cited = cited_documents()
    assert "docs/DESIGN.md" in cited
    missing = {doc: sorted(where) for doc, where in cited.items()
               if not (ROOT / doc).is_file() or ROOT not in (ROOT / doc).resolve().parents}
    assert not missing, f"cited but not in the repository: {missing}"


def test_the_slowest_modules_handed_out_first_exist():
    """tests/conftest.py orders modules for the two workers by name: a renamed module would silently run last."""
    from tests.conftest import SLOWEST_MODULES_FIRST

    missing = [name for name in SLOWEST_MODULES_FIRST if not (ROOT / "tests" / name).is_file()]
    assert not missing and len(set(SLOWEST_MODULES_FIRST)) == len(SLOWEST_MODULES_FIRST), missing


def test_tests_readme_lists_every_test_module():
    listed = (ROOT / "tests" / "README.md").read_text()
    missing = sorted(p.name for p in (ROOT / "tests").glob("test_*.py") if f"`{p.name}`" not in listed)
    assert not missing, f"tests/README.md does not list {missing}"
