"""lazy_exports: the integrations' names import on first use, once, and unknown names fail."""

from __future__ import annotations

import sys
import types

import pytest

from shardscale.core.plugins import lazy_exports


def test_a_name_is_imported_on_first_access_and_cached() -> None:
    # A real module not imported by anything in this process yet: its import is the proof.
    target = "json.tool"
    sys.modules.pop(target, None)
    pkg = types.ModuleType("lazy_pkg_under_test")
    pkg.__all__ = ["main"]  # type: ignore[attr-defined]
    sys.modules[pkg.__name__] = pkg
    try:
        getattr_, dir_ = lazy_exports(pkg.__name__, {"main": target})
        pkg.__getattr__ = getattr_  # type: ignore[method-assign]
        assert target not in sys.modules
        assert "main" in dir_()
        main = pkg.main  # type: ignore[attr-defined]
        assert target in sys.modules
        assert main is sys.modules[target].main
        assert vars(pkg)["main"] is main  # cached: later lookups skip __getattr__
        with pytest.raises(AttributeError, match="'lazy_pkg_under_test' has no attribute 'nope'"):
            pkg.nope  # type: ignore[attr-defined]
    finally:
        del sys.modules[pkg.__name__]


def test_a_later_change_to_the_callers_table_changes_nothing() -> None:
    pkg = types.ModuleType("lazy_pkg_table_under_test")
    sys.modules[pkg.__name__] = pkg
    try:
        where = {"dumps": "json"}
        getattr_, _ = lazy_exports(pkg.__name__, where)
        where["dumps"] = "pickle"  # the table is the caller's dict: written after the fact
        where["loads"] = "json"
        import json

        assert getattr_("dumps") is json.dumps
        with pytest.raises(AttributeError, match="no attribute 'loads'"):
            getattr_("loads")
    finally:
        del sys.modules[pkg.__name__]
