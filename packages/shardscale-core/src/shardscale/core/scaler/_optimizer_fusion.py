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

Opt-in (``ShardedGradScaler(fuse_optimizer=True)``, or per call of
``unscale_and_clip_``): by default the scaler steps exactly the optimizer the
user built. For the length of ``optimizer.step()`` every group gets
``fused=True, foreach=False`` and the optimizer ``grad_scale``/``found_inf``
attributes, as torch's own scalers hand a fused optimizer; all of it is
restored afterwards, also when the step raises. Numerics differ from the
foreach step at rounding level only: the kernel divides by ``grad_scale``
where the unfused path multiplies by a float32 factor.

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

Step hooks (:func:`step_hooks`: the optimizer's ``register_step_pre_hook``/
``register_step_post_hook`` or torch's global optimizer hooks) refuse the fold
for as long as they are registered: torch's recipe runs them on unscaled
gradients (the fold leaves them scaled until the kernel), only on steps taken
(the kernel is called on skipped ones too), and with the optimizer's own flags
(a ``state_dict()`` in a hook would record ``fused=True``). That step
multiplies instead, even with ``fuse_optimizer=True``; hooks registered
between ``unscale_and_clip_`` and ``step`` make ``step`` divide the
gradients it left scaled (:func:`unfold_gradients_`) and step unfused.

What the per-parameter checks read is compared on every call, in bulk
(:func:`_signature`): state cleared or replaced in place, a buffer swapped, a
parameter moved, a group flag flipped, a ``load_state_dict`` all make them
run again. The answers live in a :class:`FusionChecks` its owner (the
scaler) holds.

DTensor parameters: the kernel runs on their local shards
(:func:`_local_shards`), the state's buffers being updated in place through
their own local shards. That is the only way for SGD (torch 2.13 has no
DTensor sharding rule for ``_fused_sgd_``); for Adam/AdamW it skips
DTensor's dispatch (sharding propagation over every parameter, every step),
which is the same kernel on the same shards. Adam's first step, which
creates the state, runs through DTensor's own rule (which must exist), so the
state is DTensors. Natively fused (``fused=True``) SGD/Adam/AdamW steps take
the same local-shard run (:meth:`FusionChecks.local`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import itertools
import operator
import weakref
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any, cast

import torch
from torch.optim import optimizer as _torch_optimizer
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from shardscale.core.step._buckets import dtensor_type

__all__ = [
    "FIRST_MOMENTUM_STEP",
    "PASSING",
    "STEP_HOOKS",
    "FusionChecks",
    "fused_kernel_step",
    "fusion_refusal",
    "step_hooks",
    "unfold_gradients_",
]

#: torch's optimizers with fused kernels, and the kernel each runs.
#: torch's optimizer classes and their fused kernels: a constant table (read-only).
_FUSED_OPS: Mapping[type[torch.optim.Optimizer], str] = MappingProxyType(
    {
        torch.optim.SGD: "_fused_sgd_",
        torch.optim.AdamW: "_fused_adamw_",
        torch.optim.Adam: "_fused_adam_",
    }
)

#: Refusals that pass by themselves: even ``fuse_optimizer=True`` takes the unfused path for
#: that step, without an error. After its first step taken, momentum SGD qualifies.
FIRST_MOMENTUM_STEP = (
    "SGD with momentum before its first step: torch's fused kernel would leave the momentum "
    "buffers of a skipped first step uninitialised"
)
#: Step hooks, for as long as they are registered.
STEP_HOOKS = (
    "step hooks are registered (the optimizer's or torch's global ones): torch's recipe runs "
    "them on unscaled gradients, on steps taken only, with the optimizer's own flags"
)
PASSING = (FIRST_MOMENTUM_STEP, STEP_HOOKS)


def _base(optimizer: torch.optim.Optimizer) -> type[torch.optim.Optimizer] | None:
    """torch's fused-capable class whose own ``step`` this optimizer runs, if any."""
    for base in cast("list[type[torch.optim.Optimizer]]", type(optimizer).__mro__):
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


_DTYPE = operator.attrgetter("dtype")
_GRAD = operator.attrgetter("grad")
_SPARSE = operator.attrgetter("is_sparse")
_PRESENT = functools.partial(operator.is_not, None)
_DEVICE = operator.attrgetter("device")
_PRE_HOOKS = "_optimizer_step_pre_hooks"
_POST_HOOKS = "_optimizer_step_post_hooks"


def _state_key(optimizer: torch.optim.Optimizer) -> str | None:
    """The per-parameter state entry the refusal reads (None: it reads none)."""
    if isinstance(optimizer, torch.optim.SGD):
        return "momentum_buffer" if any(g.get("momentum") for g in optimizer.param_groups) else None
    return "step"


def _signature(optimizer: torch.optim.Optimizer) -> tuple[tuple[Any, ...] | None, list[Any]]:
    """Everything :func:`_refusal` and :func:`_runs_local` read, in bulk; and the parameters.

    C-level maps, no Python per tensor:

    * the class, the groups' flags the refusal reads, and each group's list;
    * each parameter: its identity (a list edited in place), class (DTensor or
      not), dtype and device (``module.to()`` changes them in place);
    * the state: which parameters have an entry (their identities, in the
      state's own order: no tensor hashing), how many entries each holds (a
      dict cleared or filled in place), and the identity of the one entry the
      refusal reads (SGD's momentum buffer, Adam's step counter: replaced by
      ``load_state_dict`` or by hand).

    None (no signature: nothing is remembered) when the state holds something
    that is not a dict.
    """
    groups = optimizer.param_groups
    params = list(itertools.chain.from_iterable([g["params"] for g in groups]))
    state = optimizer.state
    entries = list(state.values())
    key = _state_key(optimizer)
    try:
        lengths = list(map(len, entries))
        read = [] if key is None else list(map(id, map(dict.get, entries, itertools.repeat(key))))
    except TypeError:
        return None, params
    signature = (
        type(optimizer),
        id(state),
        tuple(
            (id(g["params"]), g.get("differentiable"), g.get("momentum"), g.get("fused"))
            for g in groups
        ),
        list(map(id, params)),
        list(map(type, params)),
        list(map(_DTYPE, params)),
        list(map(_DEVICE, params)),
        list(map(id, state)),
        lengths,
        read,
    )
    return signature, params


def step_hooks(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a step pre- or post-hook runs around ``optimizer.step()`` (its own or torch's global ones)."""
    return bool(
        getattr(optimizer, _PRE_HOOKS, None)
        or getattr(optimizer, _POST_HOOKS, None)
        or _torch_optimizer._global_optimizer_pre_hooks
        or _torch_optimizer._global_optimizer_post_hooks
    )


@dataclasses.dataclass(slots=True)
class _Answer:
    signature: tuple[Any, ...]
    refusal: str | None  # what the signature's contents decide
    local: bool
    token: object  # the owner's iteration the signature was compared in
    grads: str | None  # the gradients' refusal in that iteration
    grads_token: object  # the iteration the gradients were checked in


class FusionChecks:
    """Whether optimizers can run through torch's fused kernel, remembered per optimizer by its owner.

    The per-parameter checks (:func:`_refusal`) run again whenever anything
    they read changed (:func:`_signature`, compared in bulk). Within one
    iteration of the owner (``token``: the scaler's per-iteration record of
    the optimizer, new after every ``update()``) the answer is reused between
    ``unscale_`` and ``step``; each new iteration compares the signature again
    and checks the gradients (sparse, or of another dtype than their
    parameter), which change every step. Registered step hooks are looked at
    on every call. A scaler holds one: nothing is shared between owners.
    Copying or pickling gives an empty one (the answers are found again).
    """

    __slots__ = ("_table",)

    def __init__(self) -> None:
        self._table: weakref.WeakKeyDictionary[torch.optim.Optimizer, _Answer] = (
            weakref.WeakKeyDictionary()
        )

    def __reduce__(self) -> tuple[type[FusionChecks], tuple[()]]:
        return FusionChecks, ()  # a copy starts empty: weak references do not copy

    def refusal(self, optimizer: torch.optim.Optimizer, token: object = None) -> str | None:
        """Why ``optimizer``'s step cannot run through torch's fused kernel now (None: it can).

        See [Note: the apply folded into the optimizer] for the rules.
        """
        if step_hooks(optimizer):
            return STEP_HOOKS
        answer, params = self._answer(optimizer, token)
        if answer.refusal is not None:
            return answer.refusal
        if token is None or answer.grads_token is not token:
            if params is None:
                params = list(
                    itertools.chain.from_iterable([g["params"] for g in optimizer.param_groups])
                )
            dtypes = answer.signature[5] if answer.signature else None
            answer.grads, answer.grads_token = _grad_refusal(params, dtypes), token
        return answer.grads

    def local(self, optimizer: torch.optim.Optimizer, token: object = None) -> bool:
        """Whether :func:`fused_kernel_step` runs ``optimizer`` on DTensors' local shards."""
        dtensor = dtensor_type()
        params = itertools.chain.from_iterable([g["params"] for g in optimizer.param_groups])
        if dtensor is None or not any(
            map(issubclass, map(type, params), itertools.repeat(dtensor))
        ):
            return (
                False  # no DTensor: nothing to run locally (what a fused optimizer asks, cheaply)
            )
        answer, _ = self._answer(optimizer, token)
        return answer.refusal is None and answer.local

    def _answer(
        self, optimizer: torch.optim.Optimizer, token: object
    ) -> tuple[_Answer, list[Any] | None]:
        answer = self._table.get(optimizer)
        if answer is not None and token is not None and answer.token is token:
            return answer, None  # compared in this iteration already
        signature, params = _signature(optimizer)
        if answer is None or signature is None or answer.signature != signature:
            answer = _Answer((), _refusal(optimizer), _runs_local(optimizer), None, None, None)
        if signature is not None:
            answer.signature, answer.token = signature, token
            self._table[optimizer] = answer
        return answer, params


def fusion_refusal(optimizer: torch.optim.Optimizer) -> str | None:
    """:meth:`FusionChecks.refusal` without remembering anything (every check runs)."""
    if step_hooks(optimizer):
        return STEP_HOOKS
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return _refusal(optimizer) or _grad_refusal(params)


def _runs_local(optimizer: torch.optim.Optimizer) -> bool:
    # The kernel runs on the local shards where it can: SGD always (torch has no DTensor rule
    # for it), Adam/AdamW once every parameter has its state (the first step creates state,
    # which must be DTensors: it runs through DTensor's own rule). Skipping DTensor's dispatch
    # saves its sharding propagation over every parameter, on every step.
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return any(type(p).__name__ == "DTensor" for p in params) and (
        isinstance(optimizer, torch.optim.SGD) or all(optimizer.state.get(p) for p in params)
    )


def _grad_refusal(params: list[Any], dtypes: list[torch.dtype] | None = None) -> str | None:
    """The gradients' part of the refusal (they change every step), in bulk.

    ``dtypes``: the parameters' dtypes, where the caller has them already.
    """
    grads = list(map(_GRAD, params))
    present = list(filter(_PRESENT, grads))
    if dtypes is None or len(present) != len(grads):
        dtypes = [p.dtype for p, g in zip(params, grads, strict=True) if g is not None]
    if any(map(_SPARSE, present)) or list(map(_DTYPE, present)) != dtypes:
        return "a gradient is sparse or of another dtype than its parameter"
    return None


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
            if base is not torch.optim.SGD and type(p).__name__ == "DTensor":
                dtensor_ok = _dtensor_has_rule(op) if dtensor_ok is None else dtensor_ok
                if not dtensor_ok:
                    return f"torch's DTensor has no sharding rule for aten.{op}"
            state = optimizer.state.get(p, {})
            if base is torch.optim.SGD:
                # Every parameter, with a gradient now or not: the kernel takes all or none.
                if group["momentum"] != 0 and state.get("momentum_buffer") is None:
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
    momentum buffers: see :func:`fusion_refusal`; Adam's: :func:`_runs_local`),
    since state created here would be lost with the stand-ins.
    """
    from torch.distributed.tensor import DTensor

    # The list objects themselves come back: code may hold them, and the refusal's signature
    # holds their identity (a copy would force the per-parameter check on every step).
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


@contextlib.contextmanager
def _kernel_flags(optimizer: torch.optim.Optimizer, local: bool) -> Iterator[None]:
    """Every group ``fused=True, foreach=False`` (and the local shards), restored afterwards."""
    groups = optimizer.param_groups
    flags = [(g.get("fused", _ABSENT), g.get("foreach", _ABSENT)) for g in groups]
    try:
        for group in groups:
            group["fused"], group["foreach"] = True, False
        with _local_shards(optimizer) if local else contextlib.nullcontext():
            yield
    finally:
        for group, (fused, foreach) in zip(groups, flags, strict=True):
            for key, value in (("fused", fused), ("foreach", foreach)):
                if value is _ABSENT:
                    group.pop(key, None)
                else:
                    group[key] = value


def fused_kernel_step(
    optimizer: torch.optim.Optimizer,
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor,
    *args: Any,
    local: bool,
    **kwargs: Any,
) -> Any:
    """``optimizer.step(*args, **kwargs)`` run once through torch's fused kernel.

    The kernel divides each gradient by ``grad_scale`` (``None``: gradients are
    already unscaled) and skips the update when ``found_inf`` is 1; ``local``:
    on DTensors' local shards (:meth:`FusionChecks.local`). The optimizer's
    groups and attributes are exactly as before afterwards, also when the step
    raises. ``optimizer`` must pass :meth:`FusionChecks.refusal`, or be
    natively fused.

    Step hooks (possible here for a natively fused optimizer only; an unfused
    one with hooks is refused) see the optimizer as its user built it: its
    own flags and DTensor parameters, the stand-ins put in place after the
    last pre-hook and taken away before the first post-hook, so a
    ``state_dict()`` taken in a hook records the user's own optimizer. They
    see ``grad_scale`` and ``found_inf``, as with torch's scalers.
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(_swapped(optimizer, "grad_scale", grad_scale))
        stack.enter_context(_swapped(optimizer, "found_inf", found_inf))
        # SGD checks every parameter for the kernel once and then records that it did.
        check = "_need_device_dtype_check_for_fused"
        stack.enter_context(_swapped(optimizer, check, False))
        if not step_hooks(optimizer):
            stack.enter_context(_kernel_flags(optimizer, local))
            return optimizer.step(*args, **kwargs)
        inner = stack.enter_context(contextlib.ExitStack())

        def enter(*_: Any) -> None:
            inner.enter_context(_kernel_flags(optimizer, local))

        def leave(*_: Any) -> None:
            inner.close()

        # torch runs global pre-hooks, then the optimizer's in order; post-hooks the optimizer's
        # first: ours go last and first respectively.
        stack.callback(optimizer.register_step_pre_hook(enter).remove)
        post = optimizer.register_step_post_hook(leave)
        stack.callback(post.remove)
        getattr(optimizer, _POST_HOOKS).move_to_end(post.id, last=False)
        return optimizer.step(*args, **kwargs)


def unfold_gradients_(optimizer: torch.optim.Optimizer, grad_scale: torch.Tensor | None) -> None:
    """Divide every local gradient of ``optimizer`` by ``grad_scale``, as the kernel would have.

    For a step whose apply was left to the kernel but which must now run
    unfused (step hooks were registered in between): the gradients become what
    the multiply path gives (to rounding: the kernel's own division).
    """
    if grad_scale is None:
        return
    grads: dict[torch.device, list[torch.Tensor]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            grad = p.grad
            if grad is not None:
                if type(grad).__name__ == "DTensor":
                    grad = _local(grad)
                grads.setdefault(grad.device, []).append(grad)
    for device, tensors in grads.items():
        torch._foreach_div_(tensors, grad_scale.to(device))


_ABSENT = object()
