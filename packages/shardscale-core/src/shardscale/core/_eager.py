"""The compile boundary: the scaler's and the clip functions' calls run eagerly under torch.compile.

[Note: eager under torch.compile]
A step's decisions live in Python state the calls mutate (the scaler's
iteration, its per-optimizer stages, the step plans, the skip policies'
windows) and in host-side checks that must see every call. TorchDynamo does
not trace that faithfully: a compiled function holding ``unscale_and_clip_``,
``scaler.step`` and ``scaler.update`` returned the first step's norm on every
later step and never moved the scale. So each public call is marked with
:func:`eager` (``torch.compiler.disable``): Dynamo breaks the graph there and
runs the call as it is, while the model around it still compiles. In eager
code the mark costs one frame-evaluation switch per call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

__all__ = ["eager"]

_F = TypeVar("_F", bound=Callable[..., Any])


def eager(fn: _F) -> _F:
    """``fn``, run eagerly (a graph break) when called from code TorchDynamo compiles."""
    return cast(_F, torch.compiler.disable(fn))  # type: ignore[no-untyped-call]
