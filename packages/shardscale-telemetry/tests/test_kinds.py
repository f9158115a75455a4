"""One table of observer kinds: the variable, ``enable()``, the listing and the docs agree with it.

And the package's modules import each other without a cycle (the table sits
below the parser and the sessions, above the observers).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from shardscale import telemetry
from shardscale.telemetry import OBSERVER_KINDS, TelemetryConfigError, parse_spec

PACKAGE = Path(telemetry.__file__).parent
DOCS = Path(__file__).resolve().parents[3] / "docs" / "telemetry.md"


def test_the_variable_builds_each_kind_from_the_table(tmp_path: Path) -> None:
    for name, kind in OBSERVER_KINDS.items():
        if kind.unavailable_reason() is not None:
            continue  # its extra is not installed here
        spec = parse_spec(f"{name}:{tmp_path}/{kind.example}")
        assert spec is not None
        (observer,) = telemetry.observers_from_spec(spec)
        assert type(observer) is kind.cls
        if kind.required:
            with pytest.raises(TelemetryConfigError, match=f"{name} needs a {kind.target}"):
                parse_spec(name)
    with pytest.raises(TelemetryConfigError) as info:
        parse_spec("tensorbord:runs/tb")
    assert all(kind.spelling in str(info.value) for kind in OBSERVER_KINDS.values())


def test_the_listing_names_every_kind() -> None:
    assert list(telemetry.observer_kinds()) == list(OBSERVER_KINDS)


@pytest.mark.skipif(not DOCS.is_file(), reason="docs/ is not beside this package (installed alone)")
def test_the_docs_table_of_the_variable_is_the_table() -> None:
    text = DOCS.read_text(encoding="utf-8")
    section = text.split("### The variable's syntax", 1)[1].split("\n\n", 3)[2]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        entry = cells[0].replace("`", "")
        if line.startswith("| `") and not re.match(r"(every|ranks)=", entry):
            rows[entry] = cells[1]
    assert rows == {k.spelling: k.description for k in OBSERVER_KINDS.values()}


def _imports(path: Path) -> set[str]:
    """The package modules ``path`` imports when it runs (type-checking imports left out)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = {
        id(node)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for node in ast.walk(node)
    }
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            if node.module == "shardscale.telemetry":
                found |= {f"shardscale.telemetry.{a.name}" for a in node.names}
            elif node.module.startswith("shardscale.telemetry."):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("shardscale.telemetry")}
    # "from shardscale.telemetry import enable" is the package itself, not a module.
    return {
        m if (PACKAGE / f"{m.rpartition('.')[2]}.py").is_file() else "shardscale.telemetry"
        for m in found
    }


def test_no_import_cycles_inside_the_package() -> None:
    graph = {
        f"shardscale.telemetry.{p.stem}": _imports(p)
        for p in PACKAGE.glob("*.py")
        if p.stem != "__init__"
    }
    # The package's __init__ imports its modules; a module importing the package is a cycle.
    for module, deps in graph.items():
        assert "shardscale.telemetry" not in deps, f"{module} imports the package itself"

    def visit(module: str, path: tuple[str, ...]) -> None:
        for dep in graph.get(module, ()):
            assert dep not in path, f"import cycle: {' -> '.join((*path, dep))}"
            visit(dep, (*path, dep))

    for module in graph:
        visit(module, (module,))
