"""The kernels run compiled on a CUDA device, and through Triton's interpreter on CPU tensors.

[Note: interpreter mode in tests]
Triton decides at import time whether ``@triton.jit`` compiles or interprets
(``TRITON_INTERPRET=1``), so the variable must be set before anything imports
triton. Without a CUDA device this conftest sets it (the noxfile's tests
session also sets it for the whole run, in case another package's tests import
triton first); with one it leaves it alone and the ``gpu`` cases run
compiled. The kernels are then *selected* on the CPU only where a test sets
``SHARDSCALE_TRITON_INTERPRET=1`` (the ``device`` fixture does), so no other
test of the run is affected.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(
    params=[
        pytest.param("cpu", id="interpreted-cpu"),
        pytest.param("cuda", id="compiled-cuda", marks=pytest.mark.gpu),
    ]
)
def device(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The device the kernels run on here: CPU through the interpreter, or a CUDA GPU."""
    from shardscale.triton import INTERPRET_ENV, TritonKernels

    if request.param == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA device")
        monkeypatch.delenv(INTERPRET_ENV, raising=False)
    else:
        if torch.cuda.is_available():
            pytest.skip("CUDA present: triton compiles here, the interpreter cases run in CI")
        monkeypatch.setenv(INTERPRET_ENV, "1")
    reason = TritonKernels().unavailable_reason()
    if reason is not None:
        # Never a silent skip: in CI these are the only runs of the kernels.
        pytest.fail(f"the triton kernels cannot run on {request.param} here: {reason}")
    yield request.param
