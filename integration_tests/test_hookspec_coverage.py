"""Meta-test: every hook specification is exercised by a test and documented for plugin authors."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardscale.core import _hookspecs
from shardscale.core.plugins import HOOK_KINDS

ROOT = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve()


def _texts(paths: list[Path]) -> dict[Path, str]:
    return {p: p.read_text(encoding="utf-8") for p in paths if p.resolve() != THIS}


TEST_FILES = _texts(
    sorted(ROOT.glob("packages/*/tests/**/*.py")) + sorted(ROOT.glob("integration_tests/**/*.py"))
)
DOC_FILES = _texts(sorted(ROOT.glob("docs/**/*.md")))


def test_hook_kinds_cover_every_hookspec() -> None:
    specs = {n for n in dir(_hookspecs) if n.startswith("shardscale_")}
    assert specs == set(HOOK_KINDS), "HOOK_KINDS must name every hookspec exactly once"


@pytest.mark.parametrize("hook", sorted(HOOK_KINDS))
def test_every_hook_has_a_test(hook: str) -> None:
    users = [p for p, text in TEST_FILES.items() if hook in text]
    assert users, f"no test implements or calls {hook}; add one beside the plugin that provides it"


@pytest.mark.parametrize("hook", sorted(HOOK_KINDS))
def test_every_hook_is_documented(hook: str) -> None:
    pages = [p for p, text in DOC_FILES.items() if hook in text]
    assert pages, f"no page under docs/ mentions {hook}; describe it in docs/writing-a-plugin.md"
