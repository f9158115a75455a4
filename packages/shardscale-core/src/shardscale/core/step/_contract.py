"""The step contract: every option a step takes, checked in one place, with one error text.

[Note: one contract]
Every front end -- ``ShardedGradScaler.unscale_``/``clip_grad_norm_``,
``shardscale.clip``'s functions, the Lightning and Accelerate integrations,
the CLI -- hands its options to the functions here, so a bad value gets the
same error whichever door it came through, and it is refused before anything
changes (no gradient, scale or optimizer state is touched by a refused call).

The norm options (``max_norm``, ``norm_type``) are checked again by the step
engine's *check* stage, where a refusal is recorded and reaches every rank
through the step's one collective: a rank that alone passes a bad value (a
per-rank schedule gone wrong) stops every rank instead of leaving them waiting.
Declarations (``distinct_dims``, ``distinct_params``) are checked for their
types where they are given -- a constructor or a clip call -- because they are
built into the step's configuration; whether they fit the parameters, and
agree across ranks, is the step's business ([Note: declarations] in
``_step_engine``). A backend spec is checked in one place,
``Registry.make_backend``, which every front end calls.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from shardscale.core._registry import Registry

__all__ = [
    "ALL_RANKS",
    "check_distinct_dims",
    "check_error_if_nonfinite",
    "check_kernels",
    "check_max_norm",
    "check_norm_type",
    "distinct_param_ids",
    "kernels_name",
    "nonfinite_norm_error",
]

#: In ``distinct_dims``: every rank holds its own plain tensors (and every mesh dim differs).
ALL_RANKS = "*"


def _as_float(value: object, what: str) -> float:
    # Accept what torch accepts (Python numbers, 'inf', one-element tensors), reject bools.
    if isinstance(value, bool):
        raise TypeError(f"{what} must be a number, got the bool {value!r}")
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"{what} must be a number or a one-element tensor, got shape {tuple(value.shape)}"
            )
        return float(value.item())
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    raise TypeError(f"{what} must be a number (or 'inf'), got {type(value).__name__} {value!r}")


def check_norm_type(norm_type: object) -> float:
    """``norm_type`` as a float: any p > 0, or ``inf``.

    p <= 0 and nan are rejected: they are not norms, and torch silently returns
    nonsense (a count of non-zeros, or nan) for them.
    """
    p = _as_float(norm_type, "norm_type")
    if math.isnan(p) or p <= 0:
        raise ValueError(
            f"norm_type must be > 0 (e.g. 1.0, 2.0) or float('inf'), got {norm_type!r}"
        )
    return p


def check_max_norm(max_norm: object) -> float:
    """``max_norm`` as a float in (0, inf].

    ``inf`` is accepted as torch accepts it: nothing is clipped and only the norm
    is computed. 0, negative values and nan are rejected because they would
    zero, flip or poison every gradient.
    """
    value = _as_float(max_norm, "max_norm")
    if math.isnan(value) or value <= 0:
        raise ValueError(
            f"max_norm must be a positive number (float('inf') to only measure the norm), "
            f"got {max_norm!r}"
        )
    return value


def check_error_if_nonfinite(value: object) -> bool:
    """``error_if_nonfinite`` must be a bool (a truthy string would silently mean True)."""
    if not isinstance(value, bool):
        raise TypeError(
            f"error_if_nonfinite must be True or False, got {type(value).__name__} {value!r}"
        )
    return value


def nonfinite_norm_error(norm_type: object) -> RuntimeError:
    """What ``error_if_nonfinite=True`` raises (on every rank) when the total norm is inf/nan."""
    return RuntimeError(
        f"the total norm of order {norm_type} of the gradients is non-finite (inf or nan), so "
        "it cannot be clipped. Find the layer producing inf/nan, use a GradScaler with "
        "unscale_and_clip_ to skip such steps, or pass error_if_nonfinite=False to clip anyway."
    )


def check_kernels(name: object, registry: Registry | None = None) -> str | None:
    """A stats-kernels name (or None: the best per device), known to ``registry`` if given."""
    if name is None:
        return None
    if not isinstance(name, str) or not name:
        raise TypeError(
            f"kernels must be the name of installed stats kernels (e.g. 'foreach') or None for "
            f"the best per device, got {type(name).__name__} {name!r}"
        )
    if registry is not None:
        registry._lookup("kernels", name)  # PluginNotFoundError naming the installed ones
    return name


def kernels_name(
    foreach: object, kernels: str | None, registry: Registry | None = None
) -> str | None:
    """Which stats kernels to ask the registry for (``None``: the best for the device).

    An explicit ``foreach`` wins over a scaler's configured kernels, as it is
    the more specific request: True means the multi-tensor kernels, False the
    per-tensor loop.
    """
    if foreach is None:
        return check_kernels(kernels, registry)
    if not isinstance(foreach, bool):
        raise TypeError(f"foreach must be True, False or None, got {foreach!r}")
    return check_kernels("foreach" if foreach else "loop", registry)


def check_distinct_dims(names: object) -> frozenset[str]:
    """``distinct_dims`` as a frozenset of names: mesh dimension names, or ``"*"``.

    A bare string is refused (``frozenset("pp")`` would silently mean ``{"p"}``).
    Whether the names exist in the parameters' meshes is checked by the step
    engine, which sees the parameters.
    """
    if isinstance(names, (str, bytes)) or not isinstance(names, Iterable):
        shown = names.decode() if isinstance(names, bytes) else names
        raise TypeError(
            f"distinct_dims takes a collection of mesh dimension names, got "
            f"{'the string ' if isinstance(names, (str, bytes)) else type(names).__name__ + ' '}"
            f"{names!r}; write e.g. distinct_dims=({shown!r},)"
        )
    out = []
    for name in names:
        if not isinstance(name, str) or not name:
            raise TypeError(
                f"distinct_dims takes mesh dimension names (non-empty strings) or '*', got "
                f"{type(name).__name__} {name!r}; name the mesh dims with "
                "init_device_mesh(..., mesh_dim_names=...) and pass those names"
            )
        out.append(name)
    return frozenset(out)


def distinct_param_ids(
    params: Iterable[torch.Tensor], *, name: str = "distinct_params"
) -> frozenset[int]:
    """The ``id()`` of each tensor of ``params``, for ``StepConfig.distinct_params``.

    Raises ``TypeError`` (before any collective: arguments are checked where
    they are given) for a single tensor, a string or a non-tensor element.
    """
    if isinstance(params, (torch.Tensor, str, bytes)) or not isinstance(params, Iterable):
        raise TypeError(
            f"{name} takes an iterable of parameters (e.g. list(experts.parameters())), got "
            f"{type(params).__name__}; wrap a single parameter in a list"
        )
    ids = []
    for p in params:
        if not isinstance(p, torch.Tensor):
            raise TypeError(
                f"{name} takes parameters (tensors), got a {type(p).__name__}; pass "
                "list(module.parameters()) of the modules this rank holds its own copy of"
            )
        ids.append(id(p))
    return frozenset(ids)


# -- the verdict's options (see [Note: the verdict] in ``_verdict``) --------------------------------
