"""Argument checks shared by every public function: bad input fails before anything changes."""

from __future__ import annotations

import math
import numbers

import torch

__all__ = ["check_max_norm", "check_norm_type", "kernels_name"]


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


def kernels_name(foreach: bool | None, kernels: str | None) -> str | None:
    """Which stats kernels to ask the registry for (``None``: the best for the device).

    An explicit ``foreach`` wins over a scaler's configured kernels, as it is
    the more specific request: True means the multi-tensor kernels, False the
    per-tensor loop.
    """
    if foreach is None:
        return kernels
    if not isinstance(foreach, bool):
        raise TypeError(f"foreach must be True, False or None, got {foreach!r}")
    return "foreach" if foreach else "loop"
