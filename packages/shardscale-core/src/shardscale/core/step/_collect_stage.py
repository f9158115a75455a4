"""Stage 1, collect: each gradient described by the adapter that claims it, or a warm plan's buckets."""

from __future__ import annotations

import functools
import itertools
import operator
from typing import TYPE_CHECKING

import torch

from shardscale.core.step._buckets import GradBuckets, GradOwners, Trace
from shardscale.core.step._collect import collect_grads
from shardscale.core.step._plan import warm_buckets

if TYPE_CHECKING:
    pass
from shardscale.core.step._types import LocalStep, StepConfig, StepRequest

_GRAD = operator.attrgetter("grad")


def collect(items: list[torch.Tensor], config: StepConfig, request: StepRequest) -> LocalStep:
    local = LocalStep(
        buckets=GradBuckets(),
        rank=config.backend.rank(config.group),
        world=config.backend.world_size(config.group),
    )
    try:
        group_ranks = _group_ranks(config)
        key = (
            request.as_grads,
            id(config.group),
            group_ranks,
            local.rank,
            local.world,
            config.distinct_dims,
            config.distinct_params,
        )
        catalog = config.registry.catalog_token()
        plans = request.plans
        plan = plans.find(key, catalog) if plans is not None and items else None
        if plan is not None:
            warm = warm_buckets(plan, items, as_grads=request.as_grads)
            if warm is not None:
                local.buckets, local.plan, local.warm = warm, plan, True
                return local
        trace = Trace()
        local.buckets = collect_grads(
            # A norm must see coalesced sparse values; the scaler, like torch's, coalesces fp16 only.
            _coalesced(items, as_grads=request.as_grads)
            if request.norm_type is not None
            else items,
            config.adapter_context(),
            config.registry,
            group_ranks=group_ranks,
            as_grads=request.as_grads,
            trace=trace,
        )
        if plans is not None:  # someone keeps plans: build one once the checks pass
            local.seed = (key, catalog, trace)
    except Exception as exc:
        local.record(exc)
    return local


def owners_of(local: LocalStep) -> GradOwners:
    """(parameter, local tensor) in bucket order, for overflow localisation."""
    tensors = list(itertools.chain.from_iterable(local.buckets.every.values()))
    if local.plan is not None and local.error is None:  # warm, or built from these buckets
        return GradOwners(local.plan.owner_ids, tensors)
    return GradOwners(list(map(id, local.buckets.params())), tensors)


def _group_ranks(config: StepConfig) -> tuple[int, ...] | None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return config.backend.group_ranks(config.group)


def _coalesced(items: list[torch.Tensor], *, as_grads: bool) -> list[torch.Tensor]:
    # A norm over uncoalesced sparse values counts duplicate indices separately.
    try:
        grads = items if as_grads else list(map(_GRAD, items))
        present = filter(functools.partial(operator.is_not, None), grads)  # C-level, no genexpr
        if not any(map(operator.attrgetter("is_sparse"), present)):
            return items  # the common case: nothing sparse, nothing to copy
    except AttributeError:
        pass  # not tensors: collect_grads names the problem
    out = []
    for item in items:
        grad = item if as_grads else getattr(item, "grad", None)
        if isinstance(grad, torch.Tensor) and grad.is_sparse and not grad.is_coalesced():
            if as_grads:
                out.append(grad.coalesce())  # the caller's tensor is only read: a copy will do
                continue
            item.grad = grad.coalesce()  # as torch's GradScaler does for fp16 sparse grads
        out.append(item)
    return out
