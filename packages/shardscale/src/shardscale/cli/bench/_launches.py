"""Kernel launches and host syncs of one call, for the GPU columns of the benchmark.

[Note: launches and syncs]
:func:`count_launches` runs a call once under ``torch.profiler``. On a CUDA
device it counts the kernels the call put on the GPU (copies and memsets
left out: they are not the step's arithmetic). On the CPU there are no
launches, so it counts what stands for them: the aten ops the host
dispatched at the top level (an op called by another op is part of it), the
unit a GPU would launch at least one kernel for -- which is how the counter
itself is tested without a GPU.

Kineto, the profiler's engine, writes ``USDT: ... profiler_start`` and
``profiler_stop`` lines to stderr on every profile at its default log level
(those are the lines that filled ``shardscale bench``'s output, once per
count and rank). :func:`quiet_kineto` sets ``KINETO_LOG_LEVEL`` above every
level kineto has; kineto reads it when a process first profiles, so the
counter calls it first, and the benchmark sets it before starting its ranks.
(A dispatch-mode counter would print nothing without it, but counts a
different unit -- the views a composite op decomposes into, the optimizer's
kernels inside its profiler scope, no ``aten::to`` that copies nothing -- and
the op budgets of ``test_step_op_budget`` and every published launch count
are in this one.)

:func:`host_sync` runs a call once under
``torch.cuda.set_sync_debug_mode("error")``, where any host-device
synchronisation raises, and returns what raised (``None``: no sync). On the
CPU there is nothing to synchronise with and it answers ``"n/a"`` without
running the call.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["count_launches", "host_sync", "quiet_kineto"]

_NOT_LAUNCHES = ("Memcpy", "Memset", "memcpy", "memset")


def _device_type(device: torch.device | str) -> str:
    return torch.device(device).type


#: Kineto's log levels are VERBOSE 0 ... ERROR 4 and USDT 5; above them it prints nothing.
_KINETO_SILENT = "6"


def quiet_kineto() -> None:
    """Keep kineto's per-profile log lines off stderr (effective before a process first profiles).

    A ``KINETO_LOG_LEVEL`` the user set is left as it is.
    """
    os.environ.setdefault("KINETO_LOG_LEVEL", _KINETO_SILENT)


def count_launches(fn: Callable[[], Any], device: torch.device | str) -> int:
    """The kernels ``fn()`` launches on a CUDA ``device``, or its top-level aten ops on the CPU."""
    from torch.profiler import ProfilerActivity, profile

    quiet_kineto()

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
