"""Core's shape: a small face, tiers that resolve, no import cycles, a narrow engine entry."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

import shardscale.core
from shardscale.core import step

CORE = Path(shardscale.core.__file__).parent
TIERS = [
    "shardscale.core",
    "shardscale.core.step",
    "shardscale.core.scaler",
    "shardscale.core.plugins",
]


def test_the_face_has_at_most_40_names_and_every_tier_resolves() -> None:
    assert len(shardscale.core.__all__) <= 40
    for name in TIERS:
        module = importlib.import_module(name)
        assert len(set(module.__all__)) == len(module.__all__), f"{name}: a name listed twice"
        for attr in module.__all__:
            assert hasattr(module, attr), f"{name}.{attr} is listed but missing"


def test_no_name_is_on_two_tiers() -> None:
    seen: dict[str, str] = {}
    for name in TIERS:
        for attr in importlib.import_module(name).__all__:
            # The scaler tier repeats ShardedGradScaler for readers of that module alone.
            if attr == "ShardedGradScaler" and name == "shardscale.core.scaler":
                continue
            assert attr not in seen, f"{attr} is on {seen[attr]} and {name}"
            seen[attr] = name


def test_run_step_takes_at_most_four_parameters() -> None:
    assert list(inspect.signature(step.run_step).parameters) == ["items", "config", "request"]


def _module_name(path: Path) -> str:
    rel = path.relative_to(CORE.parent.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _runtime_imports(path: Path, modules: set[str]) -> set[str]:
    """Modules of core that ``path`` imports at run time (anywhere but ``if TYPE_CHECKING``)."""
    tree = ast.parse(path.read_text())
    type_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            type_only.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in modules else node.module)
    return {m for m in found if m in modules}


def test_core_has_no_import_cycles() -> None:
    paths = sorted(CORE.rglob("*.py"))
    modules = {_module_name(p) for p in paths}
    graph = {_module_name(p): _runtime_imports(p, modules) - {_module_name(p)} for p in paths}
    # Depth-first search for a back edge; the cycle is reported as a path.
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = [*stack[stack.index(nxt) :], nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert "shardscale.core.step._engine" in graph  # the walk saw the engine


def test_the_optional_members_the_engine_reads_are_declared_in_the_protocols() -> None:
    from shardscale.core import ForeachKernels, PlainTensorAdapter
    from shardscale.core._protocols import (
        LayoutAwareAdapter,
        OverflowSafeKernels,
        claims_type_of,
        layout_keys_of,
        overflow_safe,
        promises_stable_layout,
    )

    plain = PlainTensorAdapter()
    assert isinstance(plain, LayoutAwareAdapter)
    assert promises_stable_layout(plain) and layout_keys_of(plain) is not None
    assert claims_type_of(plain) is not None

    class Minimal:  # a GradAdapter with none of the optional members
        name = "minimal"
        priority = 0

        def claims(self, param: object) -> bool:
            return False

        def describe(self, param: object, grad: object, ctx: object) -> object:
            raise AssertionError("not called")

    minimal = Minimal()
    assert not isinstance(minimal, LayoutAwareAdapter)
    assert not promises_stable_layout(minimal) and layout_keys_of(minimal) is None
    assert claims_type_of(minimal) is None
    assert not overflow_safe(ForeachKernels()) and not isinstance(
        ForeachKernels(), OverflowSafeKernels
    )
