"""Floating-point tolerances derived from the dtype and the operation, never from one machine.

[Note: how far a computed p-norm may be from the exact one]
A p-norm of n values accumulated in a precision with unit roundoff u (half
the dtype's eps) is Σ|x|^p followed by the p-th root. Recursive (or pairwise,
or blocked: every BLAS and torch kernel is one of these) summation of n
non-negative terms has a relative error of at most (n - 1)·u; forming each
term |x|^p adds at most about 2u (one rounding for a square, a few for a
general power), and the root divides the sum's relative error by p and adds
u. shardscale's engine may also normalise each tensor by its max (one more
rounding per element) and combines per-tensor norms the same way again. So
|computed - exact| / exact ≤ (n + 8)·u·max(1, 1/p)·2 + u for every kernel,
on every machine (the last u: rounding the result to its dtype); two computed
values are within twice that of each other. The inf-norm (a max) is exact
up to that last rounding. The bound is a worst case: real errors are far
smaller, and a wrong algorithm is off by far more.
"""

from __future__ import annotations

import math

import torch

__all__ = ["accumulation_dtype", "clipped_grad_rtol", "norm_rtol"]


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 data, float32 for everything narrower (torch's and ours)."""
    return torch.float64 if dtype is torch.float64 else torch.float32


def norm_rtol(numel: int, dtype: torch.dtype, norm_type: float) -> float:
    """Bound on the relative error of a computed p-norm of ``numel`` values (see the note)."""
    u = torch.finfo(accumulation_dtype(dtype)).eps / 2
    if math.isinf(norm_type):
        return u
    return (numel + 8) * u * max(1.0, 1.0 / norm_type) * 2 + u


def clipped_grad_rtol(numel: int, dtype: torch.dtype, norm_type: float) -> float:
    """Bound for a gradient multiplied by min(1, max_norm / norm): the norm's error, the
    float32 coefficient's rounding, and one rounding back to the gradient's dtype."""
    return (
        norm_rtol(numel, dtype, norm_type)
        + 2 * torch.finfo(torch.float32).eps
        + torch.finfo(dtype).eps
    )
