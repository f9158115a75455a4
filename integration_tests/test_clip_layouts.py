"""unscale_and_clip_ and clip_grad_norm_ on real sharded models, against torch on one copy.

Every case runs on each rank of a gloo pool. Each rank also trains an
unsharded copy of the model, in the same process, with torch's recipe
(``GradScaler.unscale_`` + ``torch.nn.utils.clip_grad_norm_`` + ``step`` +
``update``) on the whole global batch; the sharded model sees only its
data-parallel slice, so its averaged gradients are the reference's. Checked on
every rank and step:

* the returned norm equals the reference's to 1e-5 relative, is a plain tensor,
  and is bit-identical across ranks;
* where the gradients are DTensors, it also equals torch's own norm of the
  very same gradients gathered to full tensors (float64);
* exactly ONE collective goes through the scaler's ``counting`` backend per
  step (norm and overflow together), and none from ``step``/``update``;
* an overflow on ONE rank makes every rank skip (same scales as torch);
* the parameters after training equal the reference's within fp32 rounding.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from mp_harness import Pool
from tolerances import clipped_grad_rtol, norm_rtol
from torch import nn

from shardscale.core.step import VectorLayout

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

STEPS = 5
POISON_STEP = 2  # rank 1 (only) multiplies its loss by inf at this step
D_IN, HIDDEN, D_OUT = 8, 16, 4
SCALER_KW: dict[str, Any] = {"init_scale": 2.0**10, "growth_interval": 2}


# -- models ---------------------------------------------------------------------------------------


class Net(nn.Module):
    """An MLP with a TP-able residual block (``up``/``down``) and non-TP layers around it."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.up = nn.Linear(HIDDEN, 2 * HIDDEN)
        self.down = nn.Linear(2 * HIDDEN, HIDDEN)
        self.out = nn.Linear(HIDDEN, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.tanh(self.inp(x)))
        h = h + self.down(torch.tanh(self.up(h)))
        return self.out(h)


class Towers(nn.Module):
    """Two independent towers whose losses add: a stand-in for two pipeline stages."""

    def __init__(self) -> None:
        super().__init__()
        self.stages = nn.ModuleList([Net(), Net()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum((loss_of(stage(x)) for stage in self.stages), torch.zeros(()))


def loss_of(y: torch.Tensor) -> torch.Tensor:
    return y.float().pow(2).mean()


ROWS = 8


def global_batch(step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(ROWS, D_IN, generator=gen) * (1.0 + step)


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, foreach=True),
    "adam_fused": lambda p: torch.optim.Adam(p, lr=1e-2, eps=1e-3, fused=True),
}


# -- layouts: a sharded copy of the reference, this rank's data slice, how to read params -----------


class Layout:
    """A sharded copy of the reference model plus what the training loop needs to know about it."""

    def __init__(
        self,
        model: nn.Module,
        *,
        dp_rank: int,
        dp_size: int,
        loss: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None,
        distinct_dims: tuple[str, ...] = (),
        full_params: Callable[[], list[torch.Tensor]] | None = None,
        ref_params: Callable[[nn.Module], list[torch.Tensor]] | None = None,
    ) -> None:
        self.model = model
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.loss = loss or (lambda m, x: loss_of(m(x)))
        self.distinct_dims = distinct_dims
        self.full_params = full_params or (lambda: [_full(p) for p in model.parameters()])
        self.ref_params = ref_params or (lambda ref: [p.detach() for p in ref.parameters()])

    def local_batch(self, x: torch.Tensor) -> torch.Tensor:
        return x.chunk(self.dp_size)[self.dp_rank]


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor().detach() if isinstance(t, DTensor) else t.detach()


def _tp_plan() -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"up": ColwiseParallel(), "down": RowwiseParallel()}


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def layout_fsdp2(ref: nn.Module) -> Layout:
    from torch.distributed.fsdp import fully_shard

    mesh = _mesh((dist.get_world_size(),), ("dp",))
    model = copy.deepcopy(ref)
    for name in ("inp", "up", "down"):
        fully_shard(getattr(model, name), mesh=mesh)
    fully_shard(model, mesh=mesh)
    return Layout(model, dp_rank=dist.get_rank(), dp_size=dist.get_world_size())


def layout_hsdp(ref: nn.Module) -> Layout:
    from torch.distributed.fsdp import fully_shard

    mesh = _mesh((2, dist.get_world_size() // 2), ("rep", "shard"))
    model = copy.deepcopy(ref)
    fully_shard(model.up, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return Layout(model, dp_rank=dist.get_rank(), dp_size=dist.get_world_size())


def layout_fsdp_tp(ref: nn.Module) -> Layout:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    world = dist.get_world_size()
    mesh = _mesh((world // 2, 2), ("dp", "tp"))
    model = copy.deepcopy(ref)
    parallelize_module(model, mesh["tp"], _tp_plan())
    fully_shard(model, mesh=mesh["dp"])
    return Layout(model, dp_rank=mesh["dp"].get_local_rank(), dp_size=world // 2)


def layout_tp(ref: nn.Module) -> Layout:
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = _mesh((dist.get_world_size(),), ("tp",))
    model = copy.deepcopy(ref)
    parallelize_module(model, mesh, _tp_plan())
    # Non-TP layers stay plain tensors, replicated on every rank (counted once, on rank 0).
    return Layout(model, dp_rank=0, dp_size=1)


def layout_two_meshes(ref: nn.Module) -> Layout:
    """FSDP2 on one mesh for the input layer, TP on another mesh for the block, plain for the rest."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    world = dist.get_world_size()
    dp_mesh = _mesh((world,), ("dp",))
    tp_mesh = _mesh((world,), ("tp",))
    model = copy.deepcopy(ref)
    parallelize_module(model, tp_mesh, _tp_plan())
    fully_shard(model.inp, mesh=dp_mesh)
    # Every rank sees the whole batch: FSDP's average of identical gradients is the gradient.
    return Layout(model, dp_rank=0, dp_size=1)


def layout_ddp(ref: nn.Module) -> Layout:
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(copy.deepcopy(ref))
    return Layout(model, dp_rank=dist.get_rank(), dp_size=dist.get_world_size())


def _fsdp1(ref: nn.Module, strategy: str, **kwargs: Any) -> Layout:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model = FSDP(
        copy.deepcopy(ref),
        sharding_strategy=ShardingStrategy[strategy],
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
        use_orig_params=True,
        device_id=torch.device("cpu"),
        **kwargs,
    )

    def full_params() -> list[torch.Tensor]:
        with FSDP.summon_full_params(model):
            return [p.detach().clone() for p in model.parameters()]

    return Layout(
        model, dp_rank=dist.get_rank(), dp_size=dist.get_world_size(), full_params=full_params
    )


def layout_fsdp1_full_shard(ref: nn.Module) -> Layout:
    return _fsdp1(ref, "FULL_SHARD")


def layout_fsdp1_shard_grad_op(ref: nn.Module) -> Layout:
    return _fsdp1(ref, "SHARD_GRAD_OP")


def layout_fsdp1_no_shard(ref: nn.Module) -> Layout:
    return _fsdp1(ref, "NO_SHARD")


def layout_fsdp1_hybrid(ref: nn.Module) -> Layout:
    mesh = _mesh((2, dist.get_world_size() // 2), ("rep", "shard"))
    return _fsdp1(ref, "HYBRID_SHARD", device_mesh=mesh)


def _stage_loss(stage: int) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    def loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return loss_of(model.stages[stage](x))  # type: ignore[index,operator]

    return loss


def _own_stage(stage: int) -> Callable[[nn.Module], list[torch.Tensor]]:
    return lambda ref: [p.detach() for p in ref.stages[stage].parameters()]  # type: ignore[index]


def layout_pipeline_fsdp2(ref: nn.Module) -> Layout:
    """pp x dp mesh: each pp coordinate holds one tower, FSDP2-sharded over its dp slice."""
    from torch.distributed.fsdp import fully_shard

    mesh = _mesh((2, dist.get_world_size() // 2), ("pp", "dp"))
    stage = mesh["pp"].get_local_rank()
    model = copy.deepcopy(ref)
    model.stages[1 - stage] = nn.Identity()  # type: ignore[index]
    fully_shard(model.stages[stage], mesh=mesh["dp"])  # type: ignore[index]
    own = model.stages[stage]  # type: ignore[index]
    return Layout(
        model,
        dp_rank=mesh["dp"].get_local_rank(),
        dp_size=dist.get_world_size() // 2,
        loss=_stage_loss(stage),
        distinct_dims=("pp",),
        full_params=lambda: [_full(p) for p in own.parameters()],
        ref_params=_own_stage(stage),
    )


def layout_pipeline_plain(ref: nn.Module) -> Layout:
    """One unsharded tower per rank: plain tensors that differ per rank (distinct_dims='*')."""
    stage = dist.get_rank()
    model = copy.deepcopy(ref)
    model.stages[1 - stage] = nn.Identity()  # type: ignore[index]
    own = model.stages[stage]  # type: ignore[index]
    return Layout(
        model,
        dp_rank=0,
        dp_size=1,
        loss=_stage_loss(stage),
        distinct_dims=("*",),
        full_params=lambda: [p.detach() for p in own.parameters()],
        ref_params=_own_stage(stage),
    )


LAYOUTS: dict[str, tuple[Callable[[nn.Module], Layout], type[nn.Module]]] = {
    "fsdp2": (layout_fsdp2, Net),
    "hsdp": (layout_hsdp, Net),
    "fsdp_tp": (layout_fsdp_tp, Net),
    "tp": (layout_tp, Net),
    "two_meshes": (layout_two_meshes, Net),
    "ddp": (layout_ddp, Net),
    "fsdp1_full_shard": (layout_fsdp1_full_shard, Net),
    "fsdp1_shard_grad_op": (layout_fsdp1_shard_grad_op, Net),
    "fsdp1_no_shard": (layout_fsdp1_no_shard, Net),
    "fsdp1_hybrid": (layout_fsdp1_hybrid, Net),
    "pipeline_fsdp2": (layout_pipeline_fsdp2, Towers),
    "pipeline_plain": (layout_pipeline_plain, Towers),
}


# -- the case, run on every rank --------------------------------------------------------------------


def _groups_by_type(model: nn.Module) -> list[dict[str, Any]]:
    """DTensor and plain parameters in separate param groups.

    torch's foreach and fused optimizer kernels refuse a group that mixes the
    two (TP-alone and multi-mesh models have both); per-group hyperparameters
    are the same, so this changes nothing else.
    """
    from torch.distributed.tensor import DTensor

    groups: dict[bool, list[nn.Parameter]] = {}
    for p in model.parameters():
        groups.setdefault(isinstance(p, DTensor), []).append(p)
    return [{"params": ps} for ps in groups.values()]


def _gathered_norm(model: nn.Module, norm_type: float, scaler: Any) -> float | None:
    """torch's norm of the current (scaled) DTensor gradients gathered whole; None if not all DTensor."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads or not all(isinstance(g, DTensor) for g in grads):
        return None
    full = [g.full_tensor().double() for g in grads]  # type: ignore[union-attr]
    return float(torch.nn.utils.get_total_norm(full, norm_type)) / scaler.get_scale()


def _reference_loss(ref: nn.Module, x: torch.Tensor, layout_name: str) -> torch.Tensor:
    y = ref(x)
    return y if LAYOUTS[layout_name][1] is Towers else loss_of(y)


def train_case(
    layout_name: str, opt_name: str, norm_type: float, api: str, max_norm: float
) -> dict[str, Any]:
    """Train the sharded model and an unsharded reference side by side; report what was seen."""
    from shardscale.clip import clip_grad_norm_, unscale_and_clip_
    from shardscale.collectives import CountingMiddleware, find_middleware
    from shardscale.core import ShardedGradScaler

    make_layout, model_cls = LAYOUTS[layout_name]
    torch.manual_seed(0)
    ref = model_cls()
    layout = make_layout(ref)
    rank = dist.get_rank()
    ref_opt = OPTIMIZERS[opt_name](ref.parameters())
    opt = OPTIMIZERS[opt_name](_groups_by_type(layout.model))
    ref_scaler = torch.amp.GradScaler("cpu", **SCALER_KW)
    scaler = ShardedGradScaler(
        "cpu", backend="counting+c10d", distinct_dims=layout.distinct_dims, **SCALER_KW
    )
    counter = find_middleware(scaler.backend, CountingMiddleware)
    stream = None
    if api == "streaming":
        from shardscale.clip._streaming import StreamingStats

        stream = StreamingStats(layout.model.parameters(), scaler, norm_type=norm_type)
    out: dict[str, Any] = {
        key: [] for key in ("norms", "ref_norms", "gathered", "collectives", "scales", "ref_scales")
    }
    out["types"], out["hooked"] = set(), []
    out["dtensor_params"] = sum(type(q).__name__ == "DTensor" for q in layout.model.parameters())
    out["numel"] = sum(q.numel() for q in ref.parameters())
    for step in range(STEPS):
        x = global_batch(step)
        poison = math.inf if step == POISON_STEP else 1.0
        # Reference: the whole batch, torch's recipe.
        ref_opt.zero_grad(set_to_none=True)
        ref_scaler.scale(_reference_loss(ref, x, layout_name) * poison).backward()
        ref_scaler.unscale_(ref_opt)
        out["ref_norms"].append(
            float(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type))
        )
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        out["ref_scales"].append(ref_scaler.get_scale())
        # Ours: this rank's slice of the batch; only rank 1 sees the poison.
        opt.zero_grad(set_to_none=True)
        loss = layout.loss(layout.model, layout.local_batch(x))
        scaler.scale(loss * (poison if rank == 1 else 1.0)).backward()
        # Each pipeline stage holds only its own parameters: nothing to gather globally there.
        gathered = None if layout.distinct_dims else _gathered_norm(layout.model, norm_type, scaler)
        out["gathered"].append(gathered)
        counter.reset()
        if api == "fused":
            norm = unscale_and_clip_(scaler, opt, max_norm, norm_type)
        elif api == "streaming":
            assert stream is not None
            seen = len(stream._seen)
            norm = unscale_and_clip_(scaler, opt, max_norm, norm_type, stats=stream)
            out["hooked"].append((seen, stream.last_used))
        else:  # the drop-in after the scaler's own unscale_, on the scaler's backend
            scaler.unscale_(opt)
            norm = clip_grad_norm_(
                layout.model.parameters(),
                max_norm,
                norm_type,
                backend=scaler.backend,
                distinct_dims=layout.distinct_dims,
            )
        scaler.step(opt)
        scaler.update()
        out["collectives"].append([(r.op.value, r.numel) for r in counter.records])
        out["types"].add(type(norm).__name__)
        out["norms"].append(float(norm))
        out["scales"].append(scaler.get_scale())
    ours_full, ref_full = layout.full_params(), layout.ref_params(ref)
    assert len(ours_full) == len(ref_full) > 0
    out["param_diff"] = max(
        float((a - b).abs().max() / (1e-6 + b.abs().max()))
        for a, b in zip(ours_full, ref_full, strict=True)
    )
    out["finite_params"] = all(bool(torch.isfinite(p).all()) for p in ours_full)
    return out


# -- checks, in the parent ------------------------------------------------------------------------


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def check(results: list[Any], *, api: str, norm_type: float, max_norm: float) -> None:
    first = results[0]
    # The engine's one SUM all-reduce: 5 slots per rank and a shared nan count (5·W + 1).
    expected = [("sum", VectorLayout(len(results)).size)]
    # Two float32 norms of the same gradients differ by at most twice the rounding bound
    # (``gathered``: our very gradients). The unsharded reference also sums each gradient
    # element over the batch's rows in another order (local batches, then reduce-scatter):
    # up to one rounding per row on top.
    same_grads = 2 * norm_rtol(first["numel"], torch.float32, norm_type)
    bound = same_grads + 2 * ROWS * torch.finfo(torch.float32).eps
    param_bound = STEPS * 2 * clipped_grad_rtol(first["numel"], torch.float32, norm_type) + bound
    for rank, res in enumerate(results):
        assert res["types"] == {"Tensor"}, f"rank {rank} returned {res['types']}, not a Tensor"
        assert all(_same(a, b) for a, b in zip(res["norms"], first["norms"], strict=True)), (
            f"rank {rank} disagrees with rank 0: {res['norms']} vs {first['norms']}"
        )
        assert res["scales"] == res["ref_scales"], f"rank {rank}: scales {res['scales']}"
        steps = zip(res["norms"], res["ref_norms"], res["gathered"], strict=True)
        for step, (ours, ref, gathered) in enumerate(steps):
            if step == POISON_STEP:
                assert not math.isfinite(ours), f"rank {rank}: overflow must give a non-finite norm"
                continue
            assert abs(ours - ref) <= bound * ref, f"rank {rank} step {step}: {ours} vs torch {ref}"
            if gathered is not None:
                assert abs(ours - gathered) <= same_grads * gathered, f"step {step}: {gathered}"
        for step, records in enumerate(res["collectives"]):
            if api in ("fused", "streaming"):
                assert records == expected, f"rank {rank} step {step}: collectives {records}"
            else:  # unscale_'s overflow flag, then clip_grad_norm_'s [norm, flag] vector
                assert len(records) == 2 and records[1] == expected[0], f"step {step}: {records}"
        if api == "streaming":  # every DTensor gradient was read by its hook during backward
            for seen, used in res["hooked"]:
                assert seen == res["dtensor_params"], res["hooked"]
                # Those counted here were not read again (replicas, e.g. a TP bias, never are).
                assert 0 < used <= seen, res["hooked"]
        assert res["finite_params"]
        assert res["param_diff"] <= param_bound, (
            f"rank {rank}: parameters differ by {res['param_diff']}"
        )
    finite = [n for i, n in enumerate(first["ref_norms"]) if i != POISON_STEP]
    assert max(finite) > max_norm, "the case must really clip"


WORLD2 = [
    "fsdp2",
    "tp",
    "two_meshes",
    "ddp",
    "fsdp1_full_shard",
    "fsdp1_shard_grad_op",
    "fsdp1_no_shard",
    "pipeline_plain",
]
WORLD4 = ["hsdp", "fsdp_tp", "fsdp1_hybrid", "pipeline_fsdp2"]


def _run(pool: Pool, layout: str, opt: str, norm_type: float = 2.0, api: str = "fused") -> None:
    max_norm = {1.0: 5.0, math.inf: 0.2}.get(norm_type, 0.5)
    results = pool.run(train_case, layout, opt, norm_type, api, max_norm)
    check(results, api=api, norm_type=norm_type, max_norm=max_norm)


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("layout", WORLD2)
def test_world2_layouts(pool2: Pool, layout: str, opt_name: str) -> None:
    _run(pool2, layout, opt_name)


@pytest.mark.parametrize("norm_type", [1.0, 3.0, math.inf])
def test_norm_types_on_fsdp2(pool2: Pool, norm_type: float) -> None:
    _run(pool2, "fsdp2", "sgd", norm_type)


@pytest.mark.parametrize("layout", ["fsdp2", "two_meshes"])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_streaming_statistics(pool2: Pool, layout: str, opt_name: str) -> None:
    """The benchmark's streaming mode: hooks read FSDP2/TP grads in backward, same results."""
    _run(pool2, layout, opt_name, api="streaming")


@pytest.mark.parametrize("layout", ["fsdp2", "fsdp1_full_shard", "two_meshes"])
def test_plain_clip_grad_norm_after_unscale(pool2: Pool, layout: str) -> None:
    _run(pool2, layout, "sgd", api="plain")


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("layout", WORLD4)
def test_world4_layouts(pool4: Pool, layout: str, opt_name: str) -> None:
    _run(pool4, layout, opt_name)


def total_norm_case(
    layout_name: str, norm_types: list[float]
) -> list[tuple[float, float, str, int]]:
    """get_total_norm on the gradients themselves vs torch's norm of the gathered gradients."""
    from shardscale.clip import get_total_norm
    from shardscale.collectives import CountingMiddleware
    from shardscale.core import get_registry

    make_layout, _ = LAYOUTS[layout_name]
    torch.manual_seed(0)
    layout = make_layout(Net())
    layout.loss(layout.model, layout.local_batch(global_batch(1))).backward()
    grads = [p.grad for p in layout.model.parameters() if p.grad is not None]
    full = [_full(g).double() for g in grads]
    out = []
    for norm_type in norm_types:
        backend = get_registry().make_backend("counting+c10d")
        assert isinstance(backend, CountingMiddleware)
        ours = get_total_norm(grads, norm_type, backend=backend)
        exact = float(torch.nn.utils.get_total_norm(full, norm_type))
        n = sum(f.numel() for f in full)
        out.append((float(ours), exact, type(ours).__name__, len(backend.records), n, norm_type))
    return out


@pytest.mark.parametrize("layout", ["fsdp2", "tp", "two_meshes"])
def test_get_total_norm_of_sharded_gradients(pool2: Pool, layout: str) -> None:
    norm_types = [1.0, 2.0, 3.0, math.inf]
    for rank_rows in pool2.run(total_norm_case, layout, norm_types):
        for ours, exact, kind, collectives, n, p in rank_rows:
            assert kind == "Tensor" and collectives == 1
            assert abs(ours - exact) <= 2 * norm_rtol(n, torch.float32, p) * exact, (ours, exact)
