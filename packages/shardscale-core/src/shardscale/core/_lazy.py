"""Names a package exports without importing them until first use.

The trainer integrations (Lightning, Accelerate, the 🤗 Trainer) must be
importable by the plugin registry without importing their framework, so their
``__init__`` resolves public names on first access. One helper for all of them.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    module: str, where: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A module's ``__getattr__`` and ``__dir__`` that import each name from ``where[name]``.

    Use it as ``__getattr__, __dir__ = lazy_exports(__name__, {"name": "pkg._mod", ...})``.
    A name is imported on first access and then cached in the module's globals;
    an unknown name raises ``AttributeError`` as a normal module would. ``where``
    is copied read-only: a later change to the caller's dict changes nothing.
    """
    where = MappingProxyType(dict(where))

    def __getattr__(name: str) -> Any:
        source = where.get(name)
        if source is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(source), name)
        setattr(sys.modules[module], name, value)
        return value

    def __dir__() -> list[str]:
        namespace = vars(sys.modules[module])
        return sorted(set(namespace) | set(namespace.get("__all__", ())))

    return __getattr__, __dir__
