"""Running an unfused torch SGD/Adam/AdamW step through torch's own fused kernel.

[Note: the apply folded into the optimizer]
torch's fused optimizer kernels (``torch._fused_sgd_``, ``_fused_adam_``,
``_fused_adamw_``) take ``grad_scale`` and ``found_inf``: each divides every
gradient by ``grad_scale`` inside the optimizer's own pass and skips the whole
update on the device when ``found_inf`` is 1. torch documents ``fused=True``
and ``foreach`` as the same algorithm, so an optimizer the user built unfused
can have one step run through the fused kernel: the scaler's apply (the
multiply by ``coef / scale``) then costs no pass of its own, and the skip
needs no host sync. For SGD (foreach, no momentum) post-processing drops from
6 gradient-sized passes to 5 (docs/benchmark.md).

For the length of ``optimizer.step()`` every group gets ``fused=True,
foreach=False`` and the optimizer ``grad_scale``/``found_inf`` attributes, as
torch's own scalers hand a fused optimizer; all of it is restored afterwards,
also when the step raises. Numerics differ from the foreach step at rounding
level only: the kernel divides by ``grad_scale`` where the unfused path
multiplies by a float32 factor.

Which optimizers (:func:`fusion_refusal`): exactly torch's SGD, Adam or AdamW
or a subclass that does not override ``step`` (one that does may change the
algorithm, which the kernel would silently undo); not ``differentiable``;
every parameter on a device and of a dtype torch's fused kernels accept
(torch's own list and test, not ours), no sparse gradient. Two cases of
torch's kernels are refused because the result would differ from the unfused
step's:

* SGD with momentum before every parameter has a momentum buffer: the fused
  kernel allocates the buffers uninitialised on its first step and, when
  ``found_inf`` skips that step, leaves them so (the unfused path creates
  none); the first step with momentum therefore takes the unfused path;
* Adam/AdamW whose ``step`` counters live off the parameter's device or are
  not float32 (created by an unfused step with ``capturable=False`` on an
  accelerator, or under a float64 default dtype): the fused kernel needs them
  beside the parameters.

DTensor parameters: the kernel runs on their local shards
(:func:`_local_shards`), the state's buffers being updated in place through
their own local shards. That is the only way for SGD (torch 2.13 has no
DTensor sharding rule for ``_fused_sgd_``); for Adam/AdamW it skips
DTensor's dispatch (sharding propagation over every parameter, every step),
which is the same kernel on the same shards. Adam's first step, which
creates the state, runs through DTensor's own rule (which must exist), so the
state is DTensors. Natively fused (``fused=True``) SGD/Adam/AdamW steps take
the same local-shard run (:func:`runs_on_local_shards`).
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

__all__ = ["FIRST_MOMENTUM_STEP", "fused_kernel_step", "fusion_refusal", "runs_on_local_shards"]

#: torch's optimizers with fused kernels, and the kernel each runs.
_FUSED_OPS: dict[type[torch.optim.Optimizer], str] = {
    torch.optim.SGD: "_fused_sgd_",
    torch.optim.AdamW: "_fused_adamw_",
    torch.optim.Adam: "_fused_adam_",
}

#: The one refusal that passes by itself: after its first step taken, SGD qualifies (so even
#: ``fuse_optimizer=True`` takes the unfused path for that step, without an error).
FIRST_MOMENTUM_STEP = (
    "SGD with momentum before its first step: torch's fused kernel would leave the momentum "
    "buffers of a skipped first step uninitialised"
)

# optimizer -> (signature, refusal, SGD over DTensors): the per-parameter checks run when the
# layout changes only, not on every step.
_CACHE: weakref.WeakKeyDictionary[
    torch.optim.Optimizer, tuple[tuple[Any, ...], str | None, bool]
] = weakref.WeakKeyDictionary()


def _base(optimizer: torch.optim.Optimizer) -> type[torch.optim.Optimizer] | None:
    """torch's fused-capable class whose own ``step`` this optimizer runs, if any."""
    for base in type(optimizer).__mro__:
        if base in _FUSED_OPS:
            own = inspect.unwrap(type(optimizer).step)  # torch wraps step in profiling hooks
            runs = torch.optim.Adam if base is torch.optim.AdamW else base
            return base if own is inspect.unwrap(runs.step) else None
    return None


def _dtensor_has_rule(op_name: str) -> bool:
    """Whether torch's DTensor dispatch can run ``aten.<op_name>.default`` on DTensors."""
    from torch.distributed.tensor import DTensor

    op = getattr(torch.ops.aten, op_name).default
    prop = DTensor._op_dispatcher.sharding_propagator
    tables = ("op_strategy_funcs", "op_single_dim_strategy_funcs", "op_to_rules")
    return any(op in getattr(prop, name, {}) for name in tables)


def _signature(optimizer: torch.optim.Optimizer) -> tuple[Any, ...]:
    # What the refusal depends on and can change between steps, cheaply (O(groups)); a
    # load_state_dict() replaces the state and the groups, so their ids change.
    return (
        type(optimizer),
        id(optimizer.state),
        len(optimizer.state),
        tuple(
            (id(g["params"]), len(g["params"]), g.get("differentiable"), g.get("momentum"))
            for g in optimizer.param_groups
        ),
    )


def fusion_refusal(optimizer: torch.optim.Optimizer) -> str | None:
    """Why ``optimizer``'s step cannot run through torch's fused kernel (None: it can).

    See [Note: the apply folded into the optimizer] for the rules.
    """
    return _checked(optimizer)[1]


def runs_on_local_shards(optimizer: torch.optim.Optimizer) -> bool:
    """Whether :func:`fused_kernel_step` would run ``optimizer`` on DTensors' local shards."""
    checked = _checked(optimizer)
    return checked[1] is None and checked[2]


def _checked(optimizer: torch.optim.Optimizer) -> tuple[tuple[Any, ...], str | None, bool]:
    signature = _signature(optimizer)
    cached = _CACHE.get(optimizer)
    if cached is not None and cached[0] == signature:
        return cached
    params = [p for g in optimizer.param_groups for p in g["params"]]
    # The kernel runs on the local shards where it can: SGD always (torch has no DTensor rule
    # for it), Adam/AdamW once every parameter has its state (the first step creates state,
    # which must be DTensors: it runs through DTensor's own rule). Skipping DTensor's dispatch
    # saves its sharding propagation over every parameter, on every step.
    local = any(type(p).__name__ == "DTensor" for p in params) and (
        isinstance(optimizer, torch.optim.SGD) or all(optimizer.state.get(p) for p in params)
    )
    checked = (signature, _refusal(optimizer), local)
    _CACHE[optimizer] = checked
    return checked


def _refusal(optimizer: torch.optim.Optimizer) -> str | None:
    base = _base(optimizer)
    name = type(optimizer).__name__
    if base is None:
        return (
            f"{name} is not torch's SGD, Adam or AdamW (or a subclass that keeps their step), "
            "so torch has no fused kernel for its algorithm"
        )
    devices = _get_fused_kernels_supported_devices()
    op = _FUSED_OPS[base]
    dtensor_ok: bool | None = None
    for group in optimizer.param_groups:
        if group.get("differentiable", False):
            return f"{name}(differentiable=True): torch's fused kernels are not differentiable"
        for p in group["params"]:
            if not (p.device.type in devices and torch.is_floating_point(p)):
                return (
                    f"a parameter is {p.dtype} on {p.device.type}; torch's fused kernels take "
                    f"floating-point tensors on {devices}"
                )
            grad = p.grad
            if grad is not None and (grad.is_sparse or grad.dtype != p.dtype):
                return "a gradient is sparse or of another dtype than its parameter"
            if base is not torch.optim.SGD and type(p).__name__ == "DTensor":
                dtensor_ok = _dtensor_has_rule(op) if dtensor_ok is None else dtensor_ok
                if not dtensor_ok:
                    return f"torch's DTensor has no sharding rule for aten.{op}"
            state = optimizer.state.get(p, {})
            if base is torch.optim.SGD:
                # Every parameter, with a gradient now or not: the kernel takes all or none.
                if group["momentum"] != 0 and "momentum_buffer" not in state:
                    return FIRST_MOMENTUM_STEP
            elif "step" in state:
                step = state["step"]
                if not (
                    isinstance(step, torch.Tensor)
                    and step.dtype is torch.float32
                    and step.device == p.device
                ):
                    return (
                        "Adam's step counters are not float32 tensors beside the parameters "
                        "(made by an unfused step), which torch's fused kernel needs"
                    )
    return None


@contextlib.contextmanager
def _swapped(obj: Any, name: str, value: Any) -> Iterator[None]:
    missing = object()
    old = obj.__dict__.get(name, missing) if hasattr(obj, "__dict__") else missing
    setattr(obj, name, value)
    try:
        yield
    finally:
        if old is missing:
            delattr(obj, name)
        else:
            setattr(obj, name, old)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    local: torch.Tensor = tensor._local_tensor  # type: ignore[attr-defined]
    return local


@contextlib.contextmanager
def _local_shards(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """The step sees each DTensor parameter's local shard instead of the DTensor.

    Each parameter's local tensor stands in for it in ``param_groups`` and
    ``state`` (its gradient the gradient's local tensor, its momentum buffer
    the buffer's local tensor: updated in place, the DTensor sees it), all
    restored afterwards. Only once every parameter has its state (SGD's
    momentum buffers: see :func:`fusion_refusal`; Adam's: :func:`_checked`),
    since state created here would be lost with the stand-ins.
    """
    from torch.distributed.tensor import DTensor

    # The list objects themselves come back: code may hold them, and the refusal cache is keyed
    # on their identity (a copy would force the per-parameter check on every step).
    saved = [g["params"] for g in optimizer.param_groups]
    stand_ins: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    try:
        for group in optimizer.param_groups:
            params = []
            for p in group["params"]:
                if not isinstance(p, DTensor):
                    params.append(p)
                    continue
                local = _local(p)
                stand_ins.append((local, local.grad))
                grad = p.grad
                local.grad = _local(grad) if isinstance(grad, DTensor) else grad
                state = optimizer.state.get(p)
                if state:
                    # DTensor buffers by their local shard (updated in place, the DTensor sees
                    # it); anything else (Adam's step counter, updated in place) as it is.
                    optimizer.state[local] = {
                        k: _local(v) if isinstance(v, DTensor) else v for k, v in state.items()
                    }
                params.append(local)
            group["params"] = params
        yield
    finally:
        for group, params in zip(optimizer.param_groups, saved, strict=True):
            group["params"] = params
        for local, grad in stand_ins:
            local.grad = grad
            optimizer.state.pop(local, None)


def fused_kernel_step(
    optimizer: torch.optim.Optimizer,
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """``optimizer.step(*args, **kwargs)`` run once through torch's fused kernel.

    The kernel divides each gradient by ``grad_scale`` (``None``: gradients are
    already unscaled) and skips the update when ``found_inf`` is 1. The
    optimizer's groups and attributes are exactly as before afterwards, also
    when the step raises. ``optimizer`` must pass :func:`fusion_refusal`.
    """
    groups = optimizer.param_groups
    flags = [(g.get("fused", _ABSENT), g.get("foreach", _ABSENT)) for g in groups]
    local = _checked(optimizer)[2]  # SGD over DTensors: the kernel runs on the local shards
    try:
        for group in groups:
            group["fused"], group["foreach"] = True, False
        with contextlib.ExitStack() as stack:
            stack.enter_context(_swapped(optimizer, "grad_scale", grad_scale))
            stack.enter_context(_swapped(optimizer, "found_inf", found_inf))
            # SGD checks every parameter for the kernel once and then records that it did.
            check = "_need_device_dtype_check_for_fused"
            stack.enter_context(_swapped(optimizer, check, False))
            if local:
                stack.enter_context(_local_shards(optimizer))
            return optimizer.step(*args, **kwargs)
    finally:
        for group, (fused, foreach) in zip(groups, flags, strict=True):
            for key, value in (("fused", fused), ("foreach", foreach)):
                if value is _ABSENT:
                    group.pop(key, None)
                else:
                    group[key] = value


_ABSENT = object()
