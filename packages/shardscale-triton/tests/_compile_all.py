"""Compile every kernel variant for real NVIDIA targets, without a GPU (run by test_compile.py).

Triton's interpreter accepts code the compiler rejects (a plain global read in a
kernel, for one), so the interpreter tests alone cannot say the kernels compile.
This script runs in a process where TRITON_INTERPRET is unset and drives
Triton's compiler down to a cubin for each (kernel, dtype, mode) the kernels
launch. It needs no driver: nothing is loaded or run.
"""

# The environment is checked before triton is imported: E402 on purpose.
# ruff: noqa: E402

from __future__ import annotations

import os
import sys

assert os.environ.get("TRITON_INTERPRET", "") in ("", "0"), "run without TRITON_INTERPRET"

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from shardscale.triton import _jit

DTYPES = {"fp16": tl.float16, "bf16": tl.bfloat16, "fp32": tl.float32, "fp64": tl.float64}


def main() -> None:
    archs = [int(a) for a in sys.argv[1:]] or [90]
    done = 0
    for arch in archs:
        target = GPUTarget("cuda", arch, 32)
        for name, dt in DTYPES.items():
            acc, acc_name = (tl.float64, "fp64") if name == "fp64" else (tl.float32, "fp32")
            for mode in (_jit.MODE_INF, _jit.MODE_P1, _jit.MODE_P2, _jit.MODE_SCALED):
                signature = {
                    "addr": "*i64",
                    "numel": "*i64",
                    "first": "*i64",
                    "blk_tensor": "*i64",
                    "part_m": f"*{acc_name}",
                    "part_s": f"*{acc_name}",
                    "counters": "*i32",
                    "out": f"*{acc_name}",
                    "p": "fp32",
                    "BLOCK": "constexpr",
                    "FBLOCK": "constexpr",
                    "MODE": "constexpr",
                    "DT": "constexpr",
                    "ACC": "constexpr",
                }
                consts = {"BLOCK": 4096, "FBLOCK": 128, "MODE": mode, "DT": dt, "ACC": acc}
                src = ASTSource(fn=_jit.stats_kernel, signature=signature, constexprs=consts)
                assert triton.compile(src, target=target).asm["cubin"]
                done += 1
            for check in (False, True):
                signature = {
                    "addr": "*i64",
                    "numel": "*i64",
                    "first": "*i64",
                    "blk_tensor": "*i64",
                    "factor": "*fp32",
                    "found_inf": "*fp32",
                    "BLOCK": "constexpr",
                    "DT": "constexpr",
                    "COMPUTE": "constexpr",
                    "CHECK": "constexpr",
                }
                consts = {"BLOCK": 4096, "DT": dt, "COMPUTE": acc, "CHECK": check}
                src = ASTSource(fn=_jit.scale_kernel, signature=signature, constexprs=consts)
                assert triton.compile(src, target=target).asm["cubin"]
                done += 1
    print(f"compiled {done} kernel variants for sm_{archs}")


if __name__ == "__main__":
    main()
