"""Stage 2, check: options, devices, kernels and declarations, recorded (never raised) before the collective."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from shardscale.core._errors import DeclarationError
from shardscale.core._plain_adapter import PlainTensorAdapter
from shardscale.core.step._aliasing import check_no_aliased_grads
from shardscale.core.step._buckets import GradBuckets
from shardscale.core.step._contract import ALL_RANKS, check_max_norm, check_norm_type
from shardscale.core.step._errors import (
    GradientDeviceError,
)
from shardscale.core.step._plan import build_plan, replicas_unchanged
from shardscale.core.step._verdict import Verdict

if TYPE_CHECKING:
    pass
from shardscale.core.step._types import LocalStep, StepConfig, StepRequest


def check(
    local: LocalStep, items: list[torch.Tensor], config: StepConfig, request: StepRequest
) -> None:
    """Record (never raise) anything that makes this rank's part of the step wrong."""
    if local.error is not None:
        return
    try:
        if request.refusal is not None:
            raise request.refusal
        # The contract's checks: a rank that alone got a bad value still joins the all-reduce.
        local.norm_type = (
            check_norm_type(request.norm_type) if request.norm_type is not None else None
        )
        local.max_norm = check_max_norm(request.max_norm)
        _check_devices(local.buckets, request.scale, request.scale_device_type)
        if not local.warm:  # a plan's parameters and declarations passed these when it was built
            _check_distinct_dims(local.buckets, config.distinct_dims)
            _check_distinct_params(local.buckets, items, config.distinct_params)
        if not request.as_grads:  # parameters: the step or the optimizer writes their .grad
            check_no_aliased_grads(local.buckets)
        # Resolved here, not while reading: an unknown or unsupported kernels name is refused
        # before the unscale kernel writes anything.
        local.kernels = {
            dev: config.registry.kernels_for(dev, config.kernels) for dev in local.buckets.devices()
        }
        if local.seed is not None:
            key, catalog, trace = local.seed
            local.plan = build_plan(
                items, local.buckets, trace, key=key, catalog=catalog, as_grads=request.as_grads
            )
        local.declarations = _declarations(local, items, config, request.verdict)
    except Exception as exc:
        local.record(exc)
        return
    if local.seed is not None and local.plan is not None and request.plans is not None:
        request.plans.remember(local.plan)  # every check passed: the next step may reuse it


def _check_devices(buckets: GradBuckets, scale: torch.Tensor | None, expect: str | None) -> None:
    for device in buckets.devices():
        if device.type == "meta":
            raise GradientDeviceError(
                "a gradient is on the meta device, which holds no values to check or scale; "
                "move the parameters to a real device (model.to_empty(device=...), then "
                "initialise them) before training"
            )
        if scale is not None and device.type not in (scale.device.type, "cpu"):
            raise GradientDeviceError(
                f"a gradient is on {device}, but this scaler was built for {expect!r} and its "
                f"scale lives on {scale.device}; move the parameters to {scale.device.type}, or "
                f"build the scaler with device={device.type!r} and scale a loss on that device"
            )


_PLAIN = PlainTensorAdapter()


def _check_distinct_dims(buckets: GradBuckets, distinct: frozenset[str]) -> None:
    names = distinct - {ALL_RANKS}
    if not names:
        return
    known: set[str] = set()
    seen_mesh = False
    plain = 0
    for param in buckets.params():
        mesh = getattr(param, "device_mesh", None)
        if mesh is None:
            plain += _PLAIN.claims(param)
            continue
        seen_mesh = True
        root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
        for m in (mesh, root):
            known.update(n for n in (m.mesh_dim_names or ()) if n)
    if not seen_mesh and plain:
        # A mesh dim name cannot describe a plain tensor: it would be ignored, and every plain
        # tensor counted as a replica (only rank 0's pipeline stage, say).
        raise DeclarationError(
            f"distinct_dims names {sorted(names)}, but the {plain} parameter(s) of this step "
            "with a gradient are plain tensors, which have no device mesh for a mesh dim name "
            "to describe (it would be ignored and each plain tensor counted as a replica). "
            "Declare plain tensors instead: distinct_dims=('*',) when every rank holds its own "
            "(pipeline stages), or distinct_params=[...] with the tensors this rank holds its "
            "own of (experts) while the others are replicated"
        )
    if seen_mesh and not names <= known:
        raise DeclarationError(
            f"distinct_dims names {sorted(names - known)}, which no mesh of these parameters "
            f"has (their mesh dims: {sorted(known) or 'unnamed'}); name the mesh dims "
            "(init_device_mesh(..., mesh_dim_names=...)) and pass those names, or '*' for "
            "plain tensors held differently on every rank"
        )


def _check_distinct_params(
    buckets: GradBuckets, items: Sequence[torch.Tensor], distinct: frozenset[int]
) -> None:
    if not distinct:
        return
    strangers = len(distinct - {id(item) for item in items})
    if strangers:
        # Matched by id(): a tensor that is not one of the step's would be ignored silently.
        raise DeclarationError(
            f"distinct_params holds {strangers} tensor(s) that are not among the "
            f"{len(items)} tensors of this step (the optimizer's parameters, or those passed "
            "to the clip call), so they would be ignored. Declare the tensors the optimizer "
            "holds: after fully_shard/.to()/copying the model, pass the new parameters "
            "(e.g. list(model.experts.parameters()) taken after the model is ready)"
        )
    for param in buckets.params():
        if id(param) in distinct and type(param) not in (torch.Tensor, torch.nn.Parameter):
            raise ValueError(
                f"distinct_params holds a {type(param).__name__} parameter of shape "
                f"{tuple(param.shape)}; it is for plain tensors only. A DTensor already says "
                "which ranks hold which part through its mesh: put the mesh dim whose "
                "coordinates hold different parameters in distinct_dims instead"
            )


def _declarations(
    local: LocalStep, items: Sequence[torch.Tensor], config: StepConfig, verdict: Verdict | None
) -> str:
    """What must agree across the ranks of this step (see [Note: declarations])."""
    # The scaler's skip policies decide on the same reduced vector everywhere: they must agree.
    policies = f", {verdict.declared}" if verdict is not None and verdict.declared else ""
    if local.norm_type is None:
        return "no norm" + policies
    if local.world <= 1:
        return "one rank"  # nothing to agree with; spares the walk below
    plan = local.plan
    if plan is not None and plan.replica_listing is not None and replicas_unchanged(plan, items):
        listing = plan.replica_listing  # the same tensors, shapes and dtypes as last time
    else:
        positions = _replica_positions(items, config)
        listing = _replica_listing(items, positions)
        if plan is not None:
            plan.remember_replicas(items, positions, listing)
    return (
        f"distinct_dims={sorted(config.distinct_dims)}, norm_type={local.norm_type}, "
        f"max_norm={local.max_norm}, replicated plain tensors [{listing}]{policies}"
    )


def _replica_positions(items: Sequence[torch.Tensor], config: StepConfig) -> list[int]:
    """Where the plain tensors that are replicas on every rank sit among the step's tensors."""
    if ALL_RANKS in config.distinct_dims:
        return []
    distinct = config.distinct_params
    kinds = list(map(type, items))
    never = {kind for kind in set(kinds) if _PLAIN.claims_type(kind) is False}
    if len(never) == len(set(kinds)):
        return []  # no plain tensor at all (an FSDP2 model): no walk
    # The step's tensors, with a gradient or not: a replica may lack one on some rank.
    return [
        i
        for i, (item, kind) in enumerate(zip(items, kinds, strict=True))
        if kind not in never and id(item) not in distinct and _PLAIN.claims(item)
    ]


def _replica_listing(items: Sequence[torch.Tensor], positions: Sequence[int]) -> str:
    replicas: Counter[tuple[tuple[int, ...], torch.dtype]] = Counter(
        (tuple(items[i].shape), items[i].dtype) for i in positions
    )
    # Sorted: the multiset, not the order the parameters happen to be listed in.
    return ", ".join(
        sorted(
            f"{n} x {shape} {str(dtype).removeprefix('torch.')}"
            for (shape, dtype), n in replicas.items()
        )
    )
