"""Calling one plugin's item hook and checking what it returned.

Each plugin's implementation of ``shardscale_collective_backends``,
``shardscale_middlewares``, ``shardscale_grad_adapters`` and
``shardscale_stats_kernels`` and ``shardscale_skip_policies`` is called on its own (never through pluggy's
all-at-once call, where one raising plugin would take every other down with
it). A hook that raises, or returns something other than a list or tuple,
contributes nothing; a malformed item is dropped while its well-formed siblings
stay. Each problem comes back as one line for a :class:`LoadFailure`.
"""

from __future__ import annotations

from typing import Any

from shardscale.core._plugin_loading import describe_exception

__all__ = ["call_item_hook", "item_problem", "short_repr"]

# What the registry calls on adapters and kernels during *every* step, whoever installed them
# (see the protocols in _protocols.py). A backend or middleware is only used when a user
# names it, and fails then with its own error.
_METHODS: dict[str, tuple[str, ...]] = {
    "adapter": ("claims", "describe"),
    "kernels": ("supports", "unscale_and_check_", "tensor_norms", "mul_"),
}
_CLASS_KINDS = ("backend", "middleware", "policy")


def short_repr(obj: object) -> str:
    """A short description of ``obj`` for an error message."""
    if isinstance(obj, type):
        return f"the class {obj.__module__}.{obj.__qualname__}"
    cls = type(obj)
    if cls.__repr__ is object.__repr__:  # the default repr only adds a memory address
        return f"a {cls.__module__}.{cls.__qualname__} instance"
    try:
        text = repr(obj)
    except Exception:
        text = f"a {cls.__qualname__} instance"
    return text if len(text) <= 80 else text[:77] + "..."


_ARTICLE = {"backend": "a backend", "middleware": "a middleware", "adapter": "an adapter",
            "kernels": "kernels", "policy": "a skip policy"}  # fmt: skip


def item_problem(kind: str, obj: object) -> str | None:
    """What is wrong with one item a plugin returned for ``kind`` (``None``: nothing).

    The phrase follows "returned a <kind> ...", e.g. "without a string 'name' attribute".
    """
    try:
        name = getattr(obj, "name", None)
        if not isinstance(name, str) or not name.strip():
            return f"without a string 'name' attribute (got {name!r})"
        if any(sep in name for sep in ":+,") or name != name.strip():
            return (
                f"named {name!r}, with ':', '+', ',' or spaces, which separate names in backend "
                "specs and SHARDSCALE_DISABLE_PLUGINS"
            )
        if kind in _CLASS_KINDS:
            if not isinstance(obj, type):
                return (
                    f"that is an instance of {type(obj).__name__}, not a class (the registry "
                    f"instantiates it); return [{type(obj).__name__}]"
                )
            automatic = getattr(obj, "automatic_priority", None)
            if automatic is not None and (
                isinstance(automatic, bool) or not isinstance(automatic, int)
            ):
                return f"whose 'automatic_priority' is not an int or None: got {automatic!r}"
            if kind == "policy":
                for attr in ("code", "precedence"):
                    value = getattr(obj, attr, None)
                    if isinstance(value, bool) or not isinstance(value, int):
                        return f"whose '{attr}' is not an int: got {value!r}"
        else:
            if isinstance(obj, type):
                return f"that is a class, not an instance; return [{obj.__name__}()]"
            priority = getattr(obj, "priority", None)
            if isinstance(priority, bool) or not isinstance(priority, int):
                return f"whose 'priority' is not an int (higher wins): got {priority!r}"
        missing = [m for m in _METHODS.get(kind, ()) if not callable(getattr(obj, m, None))]
        if missing:
            return f"without the method(s) {', '.join(missing)} every {kind} must have"
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # a property that raises is a broken item, not a broken registry
        return f"whose attributes raise {describe_exception(exc)}"
    return None


def call_item_hook(function: Any, hook: str, kind: str) -> tuple[list[Any], list[str]]:
    """Call one plugin's ``hook`` implementation; return (well-formed items, problems).

    A problem with the hook starts with its name (``"shardscale_...() raised ..."``);
    one with an item starts with ``"returned"`` (``"returned a backend without ..."``).
    """
    try:
        result = function()
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # SystemExit included: one plugin's hook never ends the program
        return [], [f"{hook}() raised {describe_exception(exc)}"]
    if result is None:  # pluggy's own convention: "nothing from me"
        return [], []
    if not isinstance(result, (list, tuple)):
        wrap = f"; return a list, e.g. [{result.__name__}]" if isinstance(result, type) else ""
        return [], [f"{hook}() returned {short_repr(result)} instead of a list{wrap}"]
    items: list[Any] = []
    problems: list[str] = []
    for index, obj in enumerate(result):
        problem = item_problem(kind, obj)
        if problem is None:
            items.append(obj)
        else:
            problems.append(
                f"returned {_ARTICLE[kind]} {problem} from {hook}() (item {index}: "
                f"{short_repr(obj)})"
            )
    return items, problems
