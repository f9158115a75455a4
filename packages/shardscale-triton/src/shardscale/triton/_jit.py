"""The two Triton kernels: one launch reads a whole list of tensors, one launch scales it.

[Note: the block table]
A list of gradients of mixed sizes is cut into blocks of ``BLOCK`` elements,
and each program of the one launch handles one block of one tensor. Four
int64 tables (built on the host from ``data_ptr()`` and ``numel()``, copied to
the device once per layout) tell a program where it is: ``blk_tensor[b]`` is
the tensor block ``b`` belongs to, ``first[t]`` its first block (``first[T]``
is the total), ``addr[t]`` and ``numel[t]`` its memory. An empty tensor gets
one block of its own (every lane masked off) so that its entry is written too.

[Note: one launch for the statistics]
Each program writes its block's partial result: ``m_b`` = max|x| (nan when the
block holds a nan) and ``s_b``, the block's sum of |x| (p = 1), x² (p = 2) or
(|x|/m_b)^p (any other p: every term is at most 1, so no power overflows).
It then increments its tensor's counter with an acquire-release atomic; the
program that brings the counter to the tensor's block count is the last one,
sees every partial, and finishes the tensor in the same launch: nan if any
block held a nan, else inf if any held an inf, else Σ s_b (p = 1), √Σ s_b
(p = 2), max m_b (p = ∞) or M·(Σ s_b·(m_b/M)^p)^(1/p) with M = max m_b (the
same overflow-safe combination the step engine uses across ranks). It resets
the counter to zero, so the counters need no zeroing launch before the next
step. Summing the partials in block order makes the result deterministic
(no float atomics).

These functions import ``triton`` absolutely: this module is
``shardscale.triton._jit``, and ``triton`` here is always the real package.
"""

# Triton has no isnan that also runs in its interpreter: "x != x" is the nan test here, and
# "DT == tl.bfloat16" compares a constexpr the way Triton resolves it at compile time.
# ruff: noqa: PLR0124, SIM300

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["MODE_INF", "MODE_P1", "MODE_P2", "MODE_SCALED", "scale_kernel", "stats_kernel"]

# constexpr globals: the only globals a compiled kernel may read.
MODE_INF = tl.constexpr(0)
MODE_P1 = tl.constexpr(1)
MODE_P2 = tl.constexpr(2)
#: Any other p (and p = 2 for float64): normalised per block, overflow-safe.
MODE_SCALED = tl.constexpr(3)


@triton.jit
def _pow(y, p):  # type: ignore[no-untyped-def]
    # y^p for y >= 0 and p > 0 (0^p = 0), through exp2/log2 so it also runs in the interpreter.
    return tl.where(y > 0, tl.exp2(p * tl.log2(tl.where(y > 0, y, 1.0))), 0.0)


@triton.jit
def _store_cast(ptrs, y, mask, DT: tl.constexpr):  # type: ignore[no-untyped-def]
    # float32 -> bfloat16 rounded to nearest even by integer arithmetic, as torch does: the same
    # bits compiled (where cvt.rn would also do) and in Triton's interpreter (which truncates).
    if DT == tl.bfloat16:
        bits = y.to(tl.uint32, bitcast=True)
        rne = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        half = tl.where(y != y, 0x7FC0, rne).to(tl.uint16)
        tl.store(ptrs, half.to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(ptrs, y.to(DT), mask=mask)


@triton.jit
def stats_kernel(  # type: ignore[no-untyped-def]
    addr,
    numel,
    first,
    blk_tensor,
    part_m,
    part_s,
    counters,
    out,
    p,
    BLOCK: tl.constexpr,
    FBLOCK: tl.constexpr,
    MODE: tl.constexpr,
    DT: tl.constexpr,
    ACC: tl.constexpr,
):
    """Per-tensor p-norms of a list of tensors, in one launch (see [Note: one launch ...])."""
    b = tl.program_id(0)
    t = tl.load(blk_tensor + b)
    t_first = tl.load(first + t)
    nblk = tl.load(first + t + 1) - t_first
    n = tl.load(numel + t)
    base = tl.load(addr + t).to(tl.pointer_type(DT))
    offs = (b - t_first) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(base + offs, mask=mask, other=0.0).to(ACC)
    isnan = x != x
    a = tl.where(isnan, 0.0, tl.abs(x))
    m = tl.max(a, axis=0)
    has_nan = tl.max(isnan.to(tl.int32), axis=0)
    if MODE == MODE_P1:
        s = tl.sum(a, axis=0)
    elif MODE == MODE_P2:
        s = tl.sum(a * a, axis=0)
    elif MODE == MODE_SCALED:
        safe = tl.where((m > 0) & (m < float("inf")), m, 1.0)
        s = tl.sum(_pow(a / safe, p), axis=0)
    else:
        s = tl.zeros_like(m)
    tl.store(part_m + b, tl.where(has_nan > 0, float("nan"), m))
    tl.store(part_s + b, s)
    # Every thread's part of the stores is done before the count moves (the barrier), and
    # acq_rel publishes them to, and acquires them for, the program that comes last.
    tl.debug_barrier()
    done = tl.atomic_add(counters + t, 1, sem="acq_rel", scope="gpu")
    if done == nblk - 1:
        idx = tl.arange(0, FBLOCK)
        peak = tl.zeros([FBLOCK], dtype=ACC)
        nans = tl.zeros([FBLOCK], dtype=tl.int32)
        # while, not range(0, nblk, FBLOCK): Triton 3.6's interpreter cannot take a loaded
        # scalar as a range bound (it converts a 1-element array with int(), which numpy 2
        # refuses); a while loop compiles to the same loop. zero: an int64 0, a loop variable.
        zero = nblk - nblk
        start = zero
        while start < nblk:
            k = start + idx
            mm = tl.load(part_m + t_first + k, mask=k < nblk, other=0.0, cache_modifier=".cg")
            nans = tl.maximum(nans, (mm != mm).to(tl.int32))
            peak = tl.maximum(peak, tl.where(mm != mm, 0.0, mm))
            start += FBLOCK
        top = tl.max(peak, axis=0)
        any_nan = tl.max(nans, axis=0)
        total = tl.zeros([FBLOCK], dtype=ACC)
        if MODE != MODE_INF:
            safe_top = tl.where((top > 0) & (top < float("inf")), top, 1.0)
            start = zero
            while start < nblk:
                k = start + idx
                ss = tl.load(part_s + t_first + k, mask=k < nblk, other=0.0, cache_modifier=".cg")
                if MODE == MODE_SCALED:
                    mm = tl.load(
                        part_m + t_first + k, mask=k < nblk, other=0.0, cache_modifier=".cg"
                    )
                    ss = ss * _pow(tl.where(mm != mm, 0.0, mm) / safe_top, p)
                total += ss
                start += FBLOCK
        s_all = tl.sum(total, axis=0)
        if MODE == MODE_INF:
            result = top
        elif MODE == MODE_P1:
            result = s_all
        elif MODE == MODE_P2:
            result = tl.sqrt(s_all)
        else:
            root = safe_top * _pow(s_all, 1.0 / p)
            result = tl.where(top < float("inf"), tl.where(top > 0, root, 0.0), top)
        tl.store(out + t, tl.where(any_nan > 0, float("nan"), result))
        tl.store(counters + t, 0)


@triton.jit
def scale_kernel(  # type: ignore[no-untyped-def]
    addr,
    numel,
    first,
    blk_tensor,
    factor,
    found_inf,
    BLOCK: tl.constexpr,
    DT: tl.constexpr,
    COMPUTE: tl.constexpr,
    CHECK: tl.constexpr,
):
    """Multiply every tensor of the list in place by the device scalar ``factor``, in one launch.

    With ``CHECK`` it is torch's unscale: a block holding inf/nan stores 1.0 in
    ``found_inf`` (every writer writes the same value, so the race is benign).
    """
    b = tl.program_id(0)
    t = tl.load(blk_tensor + b)
    n = tl.load(numel + t)
    base = tl.load(addr + t).to(tl.pointer_type(DT))
    offs = (b - tl.load(first + t)) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(base + offs, mask=mask, other=0.0).to(COMPUTE)
    if CHECK:
        bad = tl.max(((x != x) | (tl.abs(x) == float("inf"))).to(tl.int32), axis=0)
        if bad > 0:
            tl.store(found_inf, 1.0)
    f = tl.load(factor).to(COMPUTE)
    _store_cast(base + offs, x * f, mask, DT)
