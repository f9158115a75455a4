"""shardscale-core's own plugin: registered through the ``shardscale`` entry point like any other."""

from __future__ import annotations

from collections.abc import Sequence

from shardscale.core._blas_kernels import BlasDotKernels
from shardscale.core._foreach_kernels import ForeachKernels
from shardscale.core._hookspecs import hookimpl
from shardscale.core._local import LocalBackend
from shardscale.core._loop_kernels import LoopKernels
from shardscale.core._plain_adapter import PlainTensorAdapter
from shardscale.core.scaler._options import LossCheck
from shardscale.core.step._verdict import SpikeSkip

__all__ = [
    "shardscale_collective_backends",
    "shardscale_grad_adapters",
    "shardscale_skip_policies",
    "shardscale_stats_kernels",
]


@hookimpl
def shardscale_collective_backends() -> Sequence[type]:
    """The single-process ``local`` backend."""
    return [LocalBackend]


@hookimpl
def shardscale_grad_adapters() -> Sequence[object]:
    """The plain-tensor adapter."""
    return [PlainTensorAdapter()]


@hookimpl
def shardscale_stats_kernels() -> Sequence[object]:
    """Every built-in kernels: ``foreach`` (any device), ``blas-dot`` (CPU) and ``loop``.

    All three are core's, so the automatic choice per device (highest priority
    that supports it: ``blas-dot`` on the CPU, ``foreach`` elsewhere) does not
    depend on which other shardscale distributions are installed.
    """
    return [ForeachKernels(), BlasDotKernels(), LoopKernels()]


@hookimpl
def shardscale_skip_policies() -> Sequence[type]:
    """The built-in skip policies that are option objects: ``spike`` (:class:`SpikeSkip`) and
    ``loss`` (:class:`LossCheck`)."""
    return [SpikeSkip, LossCheck]
