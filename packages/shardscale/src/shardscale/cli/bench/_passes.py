"""Gradient-sized passes per step, counted, and the floor they are judged against.

[Note: the pass-count floor]
A *pass* is one read or one write of as many bytes as this rank's local
gradients (parameters and Adam's two moments are the same size), so a step's
memory work, optimizer included, is a number of passes:

* the optimizer's own: SGD (foreach, no momentum) reads the gradient and reads
  and writes the parameter, 3; Adam reads the gradient and reads and writes
  the parameter and both moments, 7;
* torch's recipe adds unscale (R+W), the norm (R) and the clip multiply
  (R+W): 5 more, so 8 (SGD) / 12 (Adam);
* the floor for one read of statistics is that read plus the optimizer taking
  the unscale and clip factor (``grad_scale``) inside its own pass: 4 (SGD) /
  8 (Adam), so a post-processing time of 0.5 / 0.67 of torch's where memory
  bound. A fused optimizer takes it itself; an unfused torch SGD/Adam/AdamW
  takes it when the scaler runs its step through torch's fused kernel
  (``fuse_optimizer=True``, the ``ours_fuse_optimizer`` arm: [Note: the apply
  folded into the optimizer] in shardscale.core); by default (``ours``) it
  steps as built and the multiply adds one R+W: 6 for the benchmark's foreach
  SGD (0.75);
* with statistics streamed in backward the read leaves post-processing:
  3 / 7 (0.38 / 0.58) at the floor, plus the read in the hooks.

torch's fused kernels (SGD and Adam, CPU and CUDA alike) write each gradient
back, divided by ``grad_scale``, when they are given one, so with torch's
kernels ours counts one pass above that floor where the kernel takes
``grad_scale``: 5 (SGD, ``fuse_optimizer=True``) / 9, 0.62 / 0.75 of torch's
passes.
The benchmark prints the passes it counted (``GradBytesCounter``, gradients
plus parameters and optimizer state) beside the floor and the measured ratio.
"""

from __future__ import annotations

__all__ = [
    "FOLDING_ARMS",
    "KERNEL_WRITE_BACK",
    "OPTIMIZER_PASSES",
    "TAKES_GRAD_SCALE",
    "floor_passes",
    "floor_ratio",
]

#: Passes of the optimizer's own step over gradient, parameter and state memory.
OPTIMIZER_PASSES = {"sgd": 3, "adam_fused": 7}
#: Whether ours hands the benchmark's optimizer, as built, ``grad_scale``/``found_inf`` instead
#: of multiplying its gradients first (the fused Adam does; the foreach SGD only in the arms
#: that fold the apply into torch's fused kernel, ``FOLDING_ARMS``).
TAKES_GRAD_SCALE = {"sgd": False, "adam_fused": True}
#: The arms with ``fuse_optimizer=True``: every torch SGD/Adam/AdamW takes ``grad_scale``.
FOLDING_ARMS = ("ours_fuse_optimizer",)
#: The write-back of the unscaled gradient by torch's fused kernels when given ``grad_scale``.
KERNEL_WRITE_BACK = 1
#: torch's unscale (R+W), norm (R) and clip multiply (R+W).
_TORCH_EXTRA = 5


def floor_passes(arm: str, optimizer: str) -> int | None:
    """The passes of post-processing for ``arm`` at its floor (torch's recipe: what it does).

    ``None`` for an optimizer or arm this table does not know.
    """
    own = OPTIMIZER_PASSES.get(optimizer)
    if own is None:
        return None
    if arm.startswith("torch"):
        return _TORCH_EXTRA + own
    if not arm.startswith("ours"):
        return None
    multiply = 0 if TAKES_GRAD_SCALE[optimizer] or arm in FOLDING_ARMS else 2
    read = 0 if "streaming" in arm else 1
    return read + multiply + own


def floor_ratio(arm: str, optimizer: str) -> float | None:
    """The floor's passes over torch's: the post-processing ratio if memory bound."""
    mine, torch_s = floor_passes(arm, optimizer), floor_passes("torch", optimizer)
    return None if mine is None or torch_s is None else mine / torch_s
