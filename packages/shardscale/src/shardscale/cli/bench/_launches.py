"""Kernel launches and host syncs of one call, for the GPU columns of the benchmark.

[Note: launches and syncs]
:func:`count_launches` runs a call once under ``torch.profiler``. On a CUDA
device it counts the kernels the call put on the GPU (copies and memsets
left out: they are not the step's arithmetic). On the CPU there are no
launches, so it counts what stands for them: the aten ops the host
dispatched at the top level (an op called by another op is part of it), the
unit a GPU would launch at least one kernel for -- which is how the counter
itself is tested without a GPU.

:func:`host_sync` runs a call once under
``torch.cuda.set_sync_debug_mode("error")``, where any host-device
synchronisation raises, and returns what raised (``None``: no sync). On the
CPU there is nothing to synchronise with and it answers ``"n/a"`` without
running the call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["count_launches", "host_sync"]

_NOT_LAUNCHES = ("Memcpy", "Memset", "memcpy", "memset")


def _device_type(device: torch.device | str) -> str:
    return torch.device(device).type


def count_launches(fn: Callable[[], Any], device: torch.device | str) -> int:
    """The kernels ``fn()`` launches on a CUDA ``device``, or its top-level aten ops on the CPU."""
    from torch.profiler import ProfilerActivity, profile

    cuda = _device_type(device) == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    events = prof.events()
    if cuda:
        return sum(
            1
            for e in events
            if e.device_type.name == "CUDA" and not any(n in e.name for n in _NOT_LAUNCHES)
        )
    return sum(1 for e in events if e.name.startswith("aten::") and e.cpu_parent is None)


def host_sync(fn: Callable[[], Any], device: torch.device | str) -> str | None:
    """Run ``fn()`` where a host sync raises: ``None`` if none happened, else the first line.

    ``"n/a"`` on the CPU (``fn`` is not run). Errors other than a sync propagate.
    """
    if _device_type(device) != "cuda":
        return "n/a"
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError as exc:
        text = str(exc)
        if "synchroniz" not in text:
            raise
        return text.strip().splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return None
