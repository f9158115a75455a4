"""Walking a middleware chain such as ``counting+coalescing+c10d``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, TypeVar, overload

from shardscale.core import CollectiveBackend, PluginNotFoundError

__all__ = ["chain_names", "find_middleware", "iter_chain"]

_T = TypeVar("_T")


def iter_chain(backend: CollectiveBackend) -> Iterator[CollectiveBackend]:
    """Yield ``backend``, then each ``.inner`` down to the backend at the end of the chain."""
    seen: set[int] = set()
    current: Any = backend
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = getattr(current, "inner", None)


def chain_names(backend: CollectiveBackend) -> str:
    """The chain written as a spec, e.g. ``"counting+coalescing+c10d"``."""
    return "+".join(str(getattr(b, "name", type(b).__name__)) for b in iter_chain(backend))


@overload
def find_middleware(backend: CollectiveBackend, wanted: type[_T]) -> _T: ...
@overload
def find_middleware(backend: CollectiveBackend, wanted: str) -> CollectiveBackend: ...


def find_middleware(backend: CollectiveBackend, wanted: type[Any] | str) -> Any:
    """The first wrapper in ``backend``'s chain that is a ``wanted`` class or has that name.

    Raises :class:`~shardscale.core.PluginNotFoundError` naming the chain when
    there is none, e.g. ``find_middleware(scaler.backend, CountingMiddleware)``
    on a scaler built without ``backend="counting+..."``.
    """
    for item in iter_chain(backend):
        if isinstance(wanted, str):
            if getattr(item, "name", None) == wanted:
                return item
        elif isinstance(item, wanted):
            return item
    label = wanted if isinstance(wanted, str) else wanted.__name__
    raise PluginNotFoundError(
        f"no {label!r} in the backend chain {chain_names(backend)!r}; build the backend with "
        f"it, e.g. backend='{getattr(wanted, 'name', label)}+{chain_names(backend)}'"
    )
