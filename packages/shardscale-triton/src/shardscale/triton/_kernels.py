"""``TritonKernels``: the step's statistics and its apply, one launch each per dtype.

[Note: when the Triton kernels are chosen]
The registry asks :meth:`TritonKernels.supports` for each device of a step.
The answer is yes only on a CUDA device, when ``triton`` imports, when it was
not imported in interpreter mode (``TRITON_INTERPRET=1`` makes Triton run
kernels in numpy on the host, which cannot follow CUDA pointers), and when
the kernels' own self-check passed on that device (run once per device per
process: a small mixed list, with a nan, against the ``foreach`` kernels).
Never on the CPU in a normal run. ``kernels="foreach"`` or
``SHARDSCALE_DISABLE_PLUGINS=triton`` opts out; :meth:`unavailable_reason`
says why they are not usable here, which ``shardscale plugins``/``doctor``
show.

Tests (and only tests) may run the same kernels on CPU tensors through
Triton's interpreter: set ``TRITON_INTERPRET=1`` *before triton is imported*
and ``SHARDSCALE_TRITON_INTERPRET=1``. The kernels then support the CPU (and
not CUDA) and outrank ``foreach`` and ``blas-dot`` there.

[Note: non-contiguous tensors]
The kernels address each tensor as ``numel`` consecutive elements from
``data_ptr()``. Every tensor whose elements fill such a span exactly
(contiguous, channels-last, any permutation of a contiguous tensor: gradients
always are) is read and written where it is, because a norm and an
elementwise multiply do not care about element order. A tensor with gaps or
overlaps (a strided slice) is copied: its norm is read from a contiguous copy,
and the in-place ops scale a copy and write it back (one extra read and write
of that tensor, outside the one launch).
"""

from __future__ import annotations

import collections
import importlib.util
import math
import os
import threading
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

__all__ = ["INTERPRET_ENV", "TritonKernels"]

#: Test-only: run the kernels through Triton's interpreter on CPU tensors (see the note).
INTERPRET_ENV = "SHARDSCALE_TRITON_INTERPRET"

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: Each program of the final step of a tensor folds this many block partials at a time.
_FBLOCK = 128
#: Layout tables kept on the device (gradient addresses rarely change between steps).
_CACHE_SIZE = 16


def _interpret_requested() -> bool:
    return os.environ.get(INTERPRET_ENV, "") == "1"


def _is_dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill exactly ``numel`` consecutive slots from ``data_ptr()``."""
    if t.is_contiguous():
        return True
    dims = sorted((st, sz) for st, sz in zip(t.stride(), t.size(), strict=True) if sz != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


class _Triton:
    """The lazily imported ``triton`` modules and what importing them said."""

    def __init__(self) -> None:
        self.error: str | None = None
        self.jit: Any = None
        self.tl: Any = None
        self.interpreted = False
        if importlib.util.find_spec("triton") is None:
            self.error = "triton not importable: it is not installed ('pip install triton')"
            return
        try:
            import triton.language as tl
            from shardscale.triton import _jit
            from triton.runtime.interpreter import InterpretedFunction
        except Exception as exc:  # any import failure is a reason, never a crash
            self.error = f"triton not importable: {type(exc).__name__}: {exc}"
            return
        self.jit, self.tl = _jit, tl
        self.interpreted = isinstance(_jit.stats_kernel, InterpretedFunction)


_triton: _Triton | None = None
_triton_lock = threading.Lock()


def _load_triton() -> _Triton:
    global _triton
    with _triton_lock:
        if _triton is None:
            _triton = _Triton()
        return _triton


class _Layout:
    """The block table of one list of tensors on one device (see [Note: the block table])."""

    __slots__ = ("addr", "blk_tensor", "blocks", "first", "numel")

    def __init__(self, tensors: Sequence[torch.Tensor], block: int, device: torch.device) -> None:
        counts = [max(1, -(-t.numel() // block)) for t in tensors]
        starts = [0]
        for c in counts:
            starts.append(starts[-1] + c)
        owner = [i for i, c in enumerate(counts) for _ in range(c)]
        host = [t.data_ptr() for t in tensors] + [t.numel() for t in tensors] + starts + owner
        on_gpu = device.type == "cuda"
        staged = torch.tensor(host, dtype=torch.int64)
        if on_gpu:
            # Pinned memory and a non-blocking copy: no host sync.
            staged = staged.pin_memory()
        table = staged.to(device, non_blocking=on_gpu)
        n = len(tensors)
        self.addr = table[:n]
        self.numel = table[n : 2 * n]
        self.first = table[2 * n : 3 * n + 1]
        self.blk_tensor = table[3 * n + 1 :]
        self.blocks = starts[-1]


class TritonKernels:
    """Stats kernels written in Triton: one launch per dtype for the statistics, one for the apply.

    ``tensor_norms`` reads every tensor of the list in one launch and returns
    each tensor's p-norm (max|x| for ``inf``), overflow-safe for every p in
    that same read (``overflow_safe_norms``), nan for a tensor holding nan,
    inf for one holding inf. ``unscale_and_check_`` and ``mul_`` multiply
    every tensor in place by a 0-dim device tensor in one launch. Scalars stay
    on the device: no call synchronises with the host (the self-check, once
    per device, excepted). float16, bfloat16, float32 and float64 tensors;
    float32 accumulation (float64 for float64).

    ``block`` is the number of elements per program (a power of two).
    """

    name: ClassVar[str] = "triton"
    #: Above ``foreach`` (0) and ``blas-dot`` (10): chosen wherever it is usable.
    priority: ClassVar[int] = 20
    #: ``tensor_norms`` keeps powers from overflowing for every p itself: the step engine
    #: calls it once instead of normalising each tensor by its max first.
    overflow_safe_norms: ClassVar[bool] = True

    def __init__(self, *, block: int = 4096, self_check: bool = True) -> None:
        if block < 16 or block & (block - 1):
            raise ValueError(f"block must be a power of two >= 16, got {block}")
        self.block = block
        self._self_check = self_check
        self._checked: dict[tuple[torch.device, bool], str | None] = {}
        self._layouts: collections.OrderedDict[tuple[Any, ...], _Layout] = collections.OrderedDict()
        self._counters: dict[tuple[Any, ...], torch.Tensor] = {}
        self._lock = threading.Lock()

    # -- selection -----------------------------------------------------------------------------

    def supports(self, device: torch.device) -> bool:
        """CUDA devices where triton compiles and the self-check passed (see the module note)."""
        return self._reason_for(torch.device(device)) is None

    def unavailable_reason(self) -> str | None:
        """Why these kernels cannot run here (``None``: they can), for ``shardscale plugins``."""
        if _interpret_requested():
            return self._reason_for(torch.device("cpu"))
        if not torch.cuda.is_available():
            return (
                "no CUDA device (torch.cuda.is_available() is False); the Triton kernels run "
                "on CUDA GPUs only"
            )
        return self._reason_for(torch.device("cuda", torch.cuda.current_device()))

    def _reason_for(self, device: torch.device) -> str | None:
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        key = (device, _interpret_requested())
        known = self._checked.get(key, "")
        if known != "":
            return known
        with self._lock:
            reason = self._probe(device)
            self._checked[key] = reason
        return reason

    def _probe(self, device: torch.device) -> str | None:
        interpret = _interpret_requested()
        if device.type == "cpu" and not interpret:
            return f"the CPU is not supported (only under the test interpreter, {INTERPRET_ENV}=1)"
        if device.type not in ("cpu", "cuda"):
            return f"{device.type} devices are not supported (CUDA only)"
        if device.type == "cuda" and interpret:
            return f"{INTERPRET_ENV}=1 is set: the kernels run in Triton's interpreter on CPU only"
        if device.type == "cuda" and not torch.cuda.is_available():
            return "no CUDA device (torch.cuda.is_available() is False)"
        loaded = _load_triton()
        if loaded.error is not None:
            return loaded.error
        if interpret and not loaded.interpreted:
            return (
                f"{INTERPRET_ENV}=1 asks for Triton's interpreter, but triton was imported "
                "without TRITON_INTERPRET=1; set it before anything imports triton"
            )
        if not interpret and loaded.interpreted:
            return (
                "TRITON_INTERPRET=1 was set when triton was imported: Triton's interpreter "
                "runs on the host and cannot read CUDA gradients; unset it"
            )
        if device.type == "cuda" and self._self_check:
            return _self_check(self, device)
        return None

    # -- the protocol --------------------------------------------------------------------------

    def tensor_norms(self, tensors: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
        """Each tensor's p-norm (max|x| for inf) in one launch per dtype, as a 1-D tensor.

        float32 accumulation (float64 when any tensor is float64), 0 for an
        empty tensor, nan for a tensor holding nan and inf for one holding
        inf. Overflow-safe for every p > 0: a p other than 1 and 2 (and 2 for
        float64) is normalised per block inside the kernel.
        """
        p = float(norm_type)
        if not (p > 0):
            raise ValueError(f"norm_type must be > 0 or inf, got {norm_type}")
        if not tensors:
            return torch.zeros(0, dtype=torch.float32)
        acc = torch.float64 if any(t.dtype is torch.float64 for t in tensors) else torch.float32
        device = tensors[0].device
        groups = self._by_dtype(tensors)
        if len(groups) == 1:
            return self._norms(tensors, p, acc)
        out = torch.empty(len(tensors), dtype=acc, device=device)
        for idx in groups.values():
            got = self._norms([tensors[i] for i in idx], p, acc)
            out[torch.tensor(idx, device=device)] = got.to(acc)
        return out

    def unscale_and_check_(
        self, tensors: Sequence[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor
    ) -> None:
        """Multiply in place by ``inv_scale`` and store 1.0 in ``found_inf`` on any inf/nan."""
        self._scale(tensors, inv_scale, found_inf)

    def mul_(self, tensors: Sequence[torch.Tensor], coef: torch.Tensor) -> None:
        """Multiply every tensor in place by the 0-dim device tensor ``coef``."""
        self._scale(tensors, coef, None)

    # -- launches ------------------------------------------------------------------------------

    def _by_dtype(self, tensors: Sequence[torch.Tensor]) -> dict[torch.dtype, list[int]]:
        groups: dict[torch.dtype, list[int]] = {}
        device = tensors[0].device
        for i, t in enumerate(tensors):
            if t.dtype not in _DTYPES:
                raise TypeError(
                    f"the triton kernels read float16/bfloat16/float32/float64 tensors, got "
                    f"{t.dtype}; use kernels='foreach' for other dtypes"
                )
            if t.device != device:
                raise ValueError(
                    f"every tensor of one call must be on one device, got {device} and {t.device}"
                )
            groups.setdefault(t.dtype, []).append(i)
        return groups

    def _layout(self, tensors: Sequence[torch.Tensor], device: torch.device) -> _Layout:
        key = (device, self.block, tuple((t.data_ptr(), t.numel()) for t in tensors))
        with self._lock:
            layout = self._layouts.get(key)
            if layout is not None:
                self._layouts.move_to_end(key)
                return layout
        layout = _Layout(tensors, self.block, device)
        with self._lock:
            self._layouts[key] = layout
            while len(self._layouts) > _CACHE_SIZE:
                self._layouts.popitem(last=False)
        return layout

    def _counter_buffer(self, device: torch.device, n: int) -> torch.Tensor:
        # One per device and stream: each launch leaves its counters at zero (see _jit's note).
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
        key = (device, stream)
        with self._lock:
            buf = self._counters.get(key)
            if buf is None or buf.numel() < n:
                buf = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
                self._counters[key] = buf
            return buf

    def _norms(self, tensors: Sequence[torch.Tensor], p: float, acc: torch.dtype) -> torch.Tensor:
        loaded = self._loaded()
        dtype = tensors[0].dtype
        device = tensors[0].device
        keep = [t if _is_dense(t) else t.contiguous() for t in tensors]
        layout = self._layout(keep, device)
        own_acc = torch.float64 if dtype is torch.float64 else torch.float32
        if math.isinf(p):
            mode = loaded.jit.MODE_INF
        elif p == 1.0:
            mode = loaded.jit.MODE_P1
        elif p == 2.0 and dtype is not torch.float64:
            mode = loaded.jit.MODE_P2
        else:
            mode = loaded.jit.MODE_SCALED
        part_m = torch.empty(layout.blocks, dtype=own_acc, device=device)
        part_s = torch.empty(layout.blocks, dtype=own_acc, device=device)
        out = torch.empty(len(keep), dtype=own_acc, device=device)
        counters = self._counter_buffer(device, len(keep))
        tl = loaded.tl
        loaded.jit.stats_kernel[(layout.blocks,)](
            layout.addr,
            layout.numel,
            layout.first,
            layout.blk_tensor,
            part_m,
            part_s,
            counters,
            out,
            p if not math.isinf(p) else 1.0,
            BLOCK=self.block,
            FBLOCK=_FBLOCK,
            MODE=mode,
            DT=_tl_dtype(tl, dtype),
            ACC=_tl_dtype(tl, own_acc),
        )
        del keep  # copies of non-dense tensors live until the launch is queued
        return out if own_acc is acc else out.to(acc)

    def _scale(
        self, tensors: Sequence[torch.Tensor], factor: torch.Tensor, found_inf: torch.Tensor | None
    ) -> None:
        if not tensors:
            return
        loaded = self._loaded()
        device = tensors[0].device
        if factor.device != device:
            raise ValueError(
                f"the factor must be on the tensors' device {device} (no host sync), got "
                f"{factor.device}; pass a device tensor"
            )
        if found_inf is not None and (
            found_inf.device != device or found_inf.dtype is not torch.float32
        ):
            raise ValueError(
                f"found_inf must be a float32 tensor on {device}, got {found_inf.dtype} on "
                f"{found_inf.device}"
            )
        flag = found_inf if found_inf is not None else factor  # unused when CHECK is off
        for idx in self._by_dtype(tensors).values():
            group = [tensors[i] for i in idx]
            dtype = group[0].dtype
            work = [t if _is_dense(t) else t.contiguous() for t in group]
            layout = self._layout(work, device)
            compute = torch.float64 if dtype is torch.float64 else torch.float32
            loaded.jit.scale_kernel[(layout.blocks,)](
                layout.addr,
                layout.numel,
                layout.first,
                layout.blk_tensor,
                factor,
                flag,
                BLOCK=self.block,
                DT=_tl_dtype(loaded.tl, dtype),
                COMPUTE=_tl_dtype(loaded.tl, compute),
                CHECK=found_inf is not None,
            )
            for orig, used in zip(group, work, strict=True):
                if used is not orig:
                    orig.copy_(used)  # a non-dense tensor: write the scaled copy back

    def _loaded(self) -> _Triton:
        loaded = _load_triton()
        if loaded.error is not None:
            raise RuntimeError(f"the triton kernels cannot run: {loaded.error}")
        return loaded

    def __repr__(self) -> str:
        return f"TritonKernels(block={self.block})"


def _tl_dtype(tl: Any, dtype: torch.dtype) -> Any:
    return {
        torch.float16: tl.float16,
        torch.bfloat16: tl.bfloat16,
        torch.float32: tl.float32,
        torch.float64: tl.float64,
    }[dtype]


def _self_check(kernels: TritonKernels, device: torch.device) -> str | None:
    """Run the kernels once on ``device`` against ``foreach``; a reason if they disagree.

    Once per device per process, at selection time. It reads results on the
    host (a sync), so it runs with torch's sync debug mode switched off.
    """
    from shardscale.core import ForeachKernels

    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        with torch.no_grad(), torch.cuda.device(device):
            gen = torch.Generator(device="cpu").manual_seed(0)
            ref = ForeachKernels()
            for dtype in (torch.float32, torch.bfloat16):
                xs = [
                    torch.randn(n, generator=gen).to(device, dtype)
                    for n in (0, 1, kernels.block + 3, 5)
                ]
                xs[3][2] = math.nan
                for p in (2.0, 1.0, 3.0, math.inf):
                    got = kernels.tensor_norms(xs, p).cpu()
                    want = ref.tensor_norms(xs, p).cpu()
                    if not torch.allclose(got, want, rtol=1e-4, atol=0.0, equal_nan=True):
                        return (
                            f"self-check failed on {device}: {dtype} {p}-norms {got.tolist()} "
                            f"!= foreach {want.tolist()}"
                        )
                a = [x.clone() for x in xs]
                b = [x.clone() for x in xs]
                f_got = torch.zeros((), device=device)
                f_want = torch.zeros((), device=device)
                inv = torch.full((), 0.5, device=device)
                kernels.unscale_and_check_(a, f_got, inv)
                ref.unscale_and_check_(b, f_want, inv)
                same = all(
                    torch.equal(x.nan_to_num(), y.nan_to_num()) for x, y in zip(a, b, strict=True)
                )
                if not same or f_got.item() != f_want.item():
                    return f"self-check failed on {device}: {dtype} unscale differs from foreach"
        return None
    except Exception as exc:  # a compiler or driver failure: not usable, say why
        return f"self-check failed on {device}: {type(exc).__name__}: {exc}"
    finally:
        torch.cuda.set_sync_debug_mode(mode)
