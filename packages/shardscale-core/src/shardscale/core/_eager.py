"""The compile boundary: the scaler's and the clip functions' calls run eagerly under torch.compile.

[Note: eager under torch.compile]
A step's decisions live in Python state the calls mutate (the scaler's
iteration, its per-optimizer stages, the step plans, the skip policies'
windows) and in host-side checks that must see every call. TorchDynamo does
not trace that faithfully: a compiled function holding ``unscale_and_clip_``,
``scaler.step`` and ``scaler.update`` returned the first step's norm on every
later step and never moved the scale. So each public call is marked with
:func:`eager`: under TorchDynamo it goes through ``torch.compiler.disable``
(Dynamo breaks the graph there and runs the call as it is, while the model
around it still compiles). The mark is lazy: importing TorchDynamo costs about
two seconds (and imports Triton where it is installed), which importing
shardscale (the CLI's ``plugins`` and ``doctor``) must not pay. Until Dynamo is
loaded -- nothing can be compiling then -- the function is called directly;
the disabled version is made on the first call after it was loaded (torch's
own ``Optimizer.__init__`` loads it, so in training that is the first call).
It then costs about 1.5 µs per call.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar, cast

__all__ = ["eager"]

_F = TypeVar("_F", bound=Callable[..., Any])


def eager(fn: _F) -> _F:
    """``fn``, run eagerly (a graph break) when called from code TorchDynamo compiles."""
    disabled: list[Callable[..., Any]] = []

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        dynamo = sys.modules.get("torch._dynamo")
        if dynamo is None:  # Dynamo not loaded: nothing is being compiled
            return fn(*args, **kwargs)
        if not disabled:
            disabled.append(dynamo.disable(fn))
        return disabled[0](*args, **kwargs)

    return cast(_F, call)
