"""fp16 loss scaling and clipping with pipeline and expert parallelism, on 4 gloo ranks.

Setups (one process group for the whole module):

* ``pp``: 4 pipeline stages, one per rank, plain tensors, ``ScheduleGPipe``;
* ``pp_fsdp``: 2 stages x 2 data-parallel ranks, FSDP2 inside each stage,
  ``Schedule1F1B``;
* ``ep``: a mixture-of-experts block whose experts are DTensors sharded over a
  4-rank expert mesh (tokens travel by all-to-all), dense layers plain and
  replicated (their gradients summed as DDP would);
* ``ep_plain``: the same with each rank's experts as ordinary parameters,
  declared through ``distinct_params``;
* ``ep_fsdp``: torchtitan's layout: dense layers FSDP2-sharded over all 4
  ranks, experts sharded over ``ep`` (2) and FSDP2-sharded over ``efsdp`` (2).

Each rank also trains an unsharded reference of the same model on the whole
batch with torch's recipe (``GradScaler`` + ``clip_grad_norm_``) in its own
process. Per step: the norm equals the reference's to fp32 rounding and is
bit-identical on every rank; skip decisions and scales equal the reference's
(an inf is injected on ONE rank: a pipeline stage that never scaled the loss,
or one expert rank); exactly one collective per step (counting middleware and
CommDebugMode); parameters equal the reference's after the run. Only the last
pipeline stage calls ``scaler.scale`` (inside the schedule's loss function).

Models compute in fp32: fp16 matmuls on CPU are slow, and loss scaling is the
same arithmetic whatever the compute dtype.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any

import pytest
import torch
import torch.distributed as dist
from mp_harness import Pool
from tolerances import clipped_grad_rtol, norm_rtol
from torch import nn

from shardscale.core.step import VectorLayout

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

STEPS = 5
POISON_STEP = 2
ROWS = 16  # global batch
D, H = 8, 12
N_EXPERTS = 4
MAX_NORM = 0.05  # small enough that every clean step clips
SCALER_KW: dict[str, Any] = {"init_scale": 2.0**10, "growth_interval": 2}


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(ROWS, D, generator=gen), torch.randn(ROWS, 1, generator=gen)


def loss_sum(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A share of the global loss: this slice's squared error over the GLOBAL row count.

    Summing these over microbatches and ranks gives the global mean, so every
    gradient is an exact sum of shares: no averaging factor to agree on.
    """
    return (out.float() - target).pow(2).sum() / ROWS


# -- the pipelined model ------------------------------------------------------------------------


def chain() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(D, D), nn.Tanh()]
    layers.append(nn.Linear(D, 1))
    return nn.Sequential(*layers)


def stage_slices(num_stages: int) -> list[slice]:
    """Which layers of ``chain()`` each stage holds (the head rides with the last block)."""
    per = 8 // num_stages
    return [
        slice(i * per, (i + 1) * per + (1 if i == num_stages - 1 else 0)) for i in range(num_stages)
    ]


# -- the mixture of experts ---------------------------------------------------------------------


class Experts(nn.Module):
    """``N_EXPERTS`` two-layer MLPs stored as two stacked weights (torchtitan's GroupedExperts)."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(N_EXPERTS, D, H) * 0.4)
        self.w2 = nn.Parameter(torch.randn(N_EXPERTS, H, D) * 0.4)

    def local(self) -> tuple[torch.Tensor, torch.Tensor]:
        from torch.distributed.tensor import DTensor

        w1, w2 = self.w1, self.w2
        if isinstance(w1, DTensor):
            return w1.to_local(), w2.to_local()  # type: ignore[union-attr]
        return w1, w2

    def forward(self, h: torch.Tensor, expert: torch.Tensor, first: int) -> torch.Tensor:
        """Apply expert ``first + e`` (e = local index) to the rows whose ``expert`` says so."""
        w1, w2 = self.local()
        out = torch.zeros_like(h)
        for e in range(w1.shape[0]):
            # An expert with no rows still runs (on 0 rows): every rank's autograd graph then
            # holds the same collectives and every expert weight gets a (zero) gradient.
            rows = torch.nonzero(expert == first + e).flatten()
            y = torch.tanh(h[rows] @ w1[e]) @ w2[e]
            out = out.index_add(0, rows, y)
        return out


class MoE(nn.Module):
    """Dense input layer, a top-1 router, the experts and a dense head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(D, D)
        self.router = nn.Linear(D, N_EXPERTS, bias=False)
        self.experts = Experts()
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor, ep_group: Any = None) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        probs = torch.softmax(self.router(h), dim=-1)
        top = probs.argmax(dim=-1)
        gate = probs.gather(1, top[:, None])
        order = torch.argsort(top, stable=True)
        routed = self._dispatch(h[order], top[order], ep_group)
        mixed = torch.zeros_like(h).index_add(0, order, routed)
        return self.head(h + mixed * gate)

    def _dispatch(self, h: torch.Tensor, expert: torch.Tensor, group: Any) -> torch.Tensor:
        if group is None:
            return self.experts(h, expert, 0)
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        ep, me = dist.get_world_size(group), dist.get_rank(group)
        per = N_EXPERTS // ep
        send = torch.bincount(expert // per, minlength=ep)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        send_splits, recv_splits = send.tolist(), recv.tolist()
        got_h = all_to_all_single_autograd(h, recv_splits, send_splits, group)
        got_e = torch.empty(sum(recv_splits), dtype=expert.dtype)
        dist.all_to_all_single(got_e, expert, recv_splits, send_splits, group=group)
        out = self.experts(got_h, got_e, me * per)
        return all_to_all_single_autograd(out, send_splits, recv_splits, group)


def dense_params(model: MoE) -> list[nn.Parameter]:
    return [p for n, p in model.named_parameters() if not n.startswith("experts.")]


# -- layouts ------------------------------------------------------------------------------------


class Setup(ABC):
    """One rank's sharded model, its training step, and how to compare it with the reference."""

    distinct_dims: tuple[str, ...] = ()
    distinct_params: list[torch.Tensor]
    poison_rank = 1

    def __init__(self) -> None:
        self.distinct_params = []

    @abstractmethod
    def params(self) -> list[torch.Tensor]: ...

    @abstractmethod
    def forward_backward(self, scaler: Any, x: torch.Tensor, y: torch.Tensor) -> None: ...

    @abstractmethod
    def full_params(self) -> list[torch.Tensor]:
        """This rank's parameters as full tensors, in the order of ``ref_params``."""
        ...

    @abstractmethod
    def ref_params(self, ref: nn.Module) -> list[torch.Tensor]: ...


def _sum_gradients(model: nn.Module) -> None:
    """FSDP2 reduce-scatters a SUM, not a mean: every rank's loss is already a share."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor().detach() if isinstance(t, DTensor) else t.detach()


class PipelineSetup(Setup):
    def __init__(self, *, pp: int, dp: int, schedule: str) -> None:
        super().__init__()
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
        self.pp, self.dp = pp, dp
        self.stage_idx = mesh["pp"].get_local_rank()
        self.pp_group = mesh["pp"].get_group()
        self.dp_rank = mesh["dp"].get_local_rank()
        self.layers = stage_slices(pp)[self.stage_idx]
        self.module = nn.Sequential(*list(chain())[self.layers])
        if dp > 1:
            for layer in self.module:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=False)
            fully_shard(self.module, mesh=mesh["dp"], reshard_after_forward=False)
            _sum_gradients(self.module)
        # distinct_dims: stages differ along pp; plain stage tensors (no dp) differ everywhere.
        self.distinct_dims = ("pp",) if dp > 1 else ("*",)
        stage = PipelineStage(
            self.module, self.stage_idx, pp, torch.device("cpu"), group=mesh["pp"].get_group()
        )
        self.is_last = self.stage_idx == pp - 1
        self.scaler: Any = None
        cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
        self.schedule = cls(stage, n_microbatches=4, loss_fn=self._loss, scale_grads=False)
        self.poison_rank = 0 if dp > 1 else 1  # a stage that never calls scaler.scale()

    def _loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # The loss is computed -- and scaled -- only here, on the last stage.
        return self.scaler.scale(loss_sum(out, target))  # type: ignore[no-any-return]

    def params(self) -> list[torch.Tensor]:
        return list(self.module.parameters())

    def forward_backward(self, scaler: Any, x: torch.Tensor, y: torch.Tensor) -> None:
        self.scaler = scaler
        x, y = x.chunk(self.dp)[self.dp_rank], y.chunk(self.dp)[self.dp_rank]
        if self.stage_idx == 0:
            self.schedule.step(x)
        elif self.is_last:
            self.schedule.step(target=y, losses=[])
        else:
            self.schedule.step()

    def full_params(self) -> list[torch.Tensor]:
        return [_full(p) for p in self.module.parameters()]

    def ref_params(self, ref: nn.Module) -> list[torch.Tensor]:
        return [p.detach() for p in nn.Sequential(*list(ref)[self.layers]).parameters()]


class ExpertSetup(Setup):
    def __init__(self, *, style: str) -> None:
        super().__init__()
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        world = dist.get_world_size()
        self.style = style
        self.model = MoE()
        if style == "ep_fsdp":
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("efsdp", "ep"))
            dense_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
            ep_mesh = mesh["ep"]
            self._distribute_experts(ep_mesh)
            fully_shard(
                self.model.experts,
                mesh=mesh["efsdp"],
                shard_placement_fn=lambda p: Shard(1),
                reshard_after_forward=False,
            )
            for name in ("inp", "router", "head"):
                fully_shard(getattr(self.model, name), mesh=dense_mesh, reshard_after_forward=False)
            _sum_gradients(self.model)
            self.row_slice = dist.get_rank()
        else:
            ep_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
            if style == "ep":
                self._distribute_experts(ep_mesh)
            else:  # plain: this rank's experts as ordinary parameters
                per = N_EXPERTS // world
                me = dist.get_rank()
                experts = self.model.experts
                experts.w1 = nn.Parameter(experts.w1.detach()[me * per : (me + 1) * per].clone())
                experts.w2 = nn.Parameter(experts.w2.detach()[me * per : (me + 1) * per].clone())
                self.distinct_params = [experts.w1, experts.w2]
            self.row_slice = dist.get_rank()
        del distribute_tensor
        self.ep_group = ep_mesh.get_group()
        self.poison_rank = 2

    def _distribute_experts(self, ep_mesh: Any) -> None:
        from torch.distributed.tensor import Shard, distribute_tensor

        experts = self.model.experts
        for name in ("w1", "w2"):
            full = getattr(experts, name).detach()
            setattr(experts, name, nn.Parameter(distribute_tensor(full, ep_mesh, [Shard(0)])))

    def params(self) -> list[torch.Tensor]:
        return list(self.model.parameters())

    def forward_backward(self, scaler: Any, x: torch.Tensor, y: torch.Tensor) -> None:
        world = dist.get_world_size()
        xs, ys = x.chunk(world)[self.row_slice], y.chunk(world)[self.row_slice]
        scaler.scale(loss_sum(self.model(xs, self.ep_group), ys)).backward()
        if self.style != "ep_fsdp":
            # Dense layers are replicated: sum their shares across ranks, as DDP would.
            for p in dense_params(self.model):
                assert p.grad is not None
                dist.all_reduce(p.grad)

    def full_params(self) -> list[torch.Tensor]:
        out = []
        for name, p in self.model.named_parameters():
            if self.style == "ep_plain" and name.startswith("experts."):
                parts = [torch.empty_like(p) for _ in range(dist.get_world_size())]
                dist.all_gather(parts, p.detach())
                out.append(torch.cat(parts))
            else:
                out.append(_full(p))
        return out

    def ref_params(self, ref: nn.Module) -> list[torch.Tensor]:
        return [p.detach() for p in ref.parameters()]


SETUPS = {
    "pp": lambda: PipelineSetup(pp=4, dp=1, schedule="gpipe"),
    "pp_fsdp": lambda: PipelineSetup(pp=2, dp=2, schedule="1f1b"),
    "ep": lambda: ExpertSetup(style="ep"),
    "ep_plain": lambda: ExpertSetup(style="ep_plain"),
    "ep_fsdp": lambda: ExpertSetup(style="ep_fsdp"),
}


def reference_model(name: str) -> nn.Module:
    return chain() if name.startswith("pp") else MoE()


def _poison(params: list[torch.Tensor]) -> None:
    """One element of the first non-empty local gradient becomes inf."""
    from torch.distributed.tensor import DTensor

    for p in params:
        g = p.grad
        if g is None:
            continue
        local = g._local_tensor if isinstance(g, DTensor) else g
        if local.numel():
            local.view(-1)[0] = math.inf
            return
    raise AssertionError("no local gradient to poison")


# -- the case, on every rank --------------------------------------------------------------------


def train_case(name: str) -> dict[str, Any]:
    from torch.distributed.tensor.debug import CommDebugMode

    from shardscale.clip import unscale_and_clip_
    from shardscale.collectives import CountingMiddleware, find_middleware
    from shardscale.core import ShardedGradScaler

    setup = SETUPS[name]()
    ref = reference_model(name)
    rank = dist.get_rank()
    opt = torch.optim.SGD(setup.params(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    scaler = ShardedGradScaler(
        "cpu",
        backend="counting+c10d",
        distinct_dims=setup.distinct_dims,
        distinct_params=setup.distinct_params,
        **SCALER_KW,
    )
    ref_scaler = torch.amp.GradScaler("cpu", **SCALER_KW)
    counter = find_middleware(scaler.backend, CountingMiddleware)
    out: dict[str, Any] = {k: [] for k in ("norms", "ref_norms", "scales", "ref_scales", "skipped")}
    out["counted"], out["comm"] = [], []
    out["called_scale"] = False
    for step in range(STEPS):
        x, y = batch(step)
        poisoned = step == POISON_STEP
        # Reference: the whole batch, one process, torch's recipe.
        ref_opt.zero_grad(set_to_none=True)
        ref_scaler.scale(loss_sum(ref(x), y)).backward()
        if poisoned:
            _poison(_matching_ref_params(setup, ref))
        ref_scaler.unscale_(ref_opt)
        out["ref_norms"].append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)))
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        out["ref_scales"].append(ref_scaler.get_scale())
        # Ours.
        opt.zero_grad(set_to_none=True)
        setup.forward_backward(scaler, x, y)
        if step == 0:
            out["called_scale"] = scaler._get_scale_async() is not None
        if poisoned and rank == setup.poison_rank:
            _poison(setup.params())
        counter.reset()
        with CommDebugMode() as comm:  # type: ignore[no-untyped-call]
            norm = unscale_and_clip_(scaler, opt, MAX_NORM)
            scaler.step(opt)
            scaler.update()
        out["comm"].append(comm.get_total_counts())
        out["counted"].append([(r.op.value, r.numel) for r in counter.records])
        out["norms"].append(float(norm))
        out["scales"].append(scaler.get_scale())
        out["skipped"].append(bool(scaler.last_step_skipped))
    ours, theirs = setup.full_params(), setup.ref_params(ref)
    assert len(ours) == len(theirs) > 0
    out["param_diff"] = max(
        float((a - b).abs().max() / b.abs().max()) for a, b in zip(ours, theirs, strict=True)
    )
    out["numel"] = sum(p.numel() for p in ref.parameters())
    return out


def _matching_ref_params(setup: Setup, ref: nn.Module) -> list[torch.Tensor]:
    """Reference parameters holding the parameter the poisoned rank poisons (same skip)."""
    if isinstance(setup, PipelineSetup):
        num = setup.pp
        stage = setup.poison_rank // setup.dp  # the pp coordinate of the poisoned rank
        return list(nn.Sequential(*list(ref)[stage_slices(num)[stage]]).parameters())
    return list(ref.parameters())


# -- checks, in the parent ----------------------------------------------------------------------


def check(results: list[dict[str, Any]]) -> None:
    first = results[0]
    world = len(results)
    # Two fp32 norms of gradients that agree to rounding (different summation orders:
    # microbatches, reduce-scatter, all-to-all) differ by at most twice the norm bound plus
    # one rounding per summed row in each gradient element.
    bound = (
        2 * norm_rtol(first["numel"], torch.float32, 2.0)
        + 2 * ROWS * torch.finfo(torch.float32).eps
    )
    param_bound = STEPS * 2 * clipped_grad_rtol(first["numel"], torch.float32, 2.0) + bound
    expected = [("sum", VectorLayout(world).size)]  # the engine's one all-reduce
    for rank, res in enumerate(results):
        assert res["norms"] == first["norms"] or all(
            (math.isnan(a) and math.isnan(b)) or a == b
            for a, b in zip(res["norms"], first["norms"], strict=True)
        ), f"rank {rank} norms {res['norms']} != rank 0 {first['norms']}"
        assert res["scales"] == res["ref_scales"], f"rank {rank}: {res['scales']}"
        assert res["skipped"] == [s == POISON_STEP for s in range(STEPS)], res["skipped"]
        for step, (ours, ref) in enumerate(zip(res["norms"], res["ref_norms"], strict=True)):
            if step == POISON_STEP:
                assert not math.isfinite(ours) and not math.isfinite(ref)
                continue
            assert ref > MAX_NORM, "the case must really clip"
            assert abs(ours - ref) <= bound * ref, f"rank {rank} step {step}: {ours} vs {ref}"
        for step, (records, comm) in enumerate(zip(res["counted"], res["comm"], strict=True)):
            assert records == expected, f"rank {rank} step {step}: {records}"
            # The scaler's first step also checks, once, that every rank uses the same backend
            # chain (one small all-reduce beside the chain); every later step is the one reduce.
            assert comm == (2 if step == 0 else 1), f"rank {rank} step {step}: {comm} collectives"
        assert res["param_diff"] <= param_bound, f"rank {rank}: {res['param_diff']}"


@pytest.mark.parametrize("name", list(SETUPS))
def test_matches_single_process_reference(pool4: Pool, name: str) -> None:
    results = pool4.run(train_case, name)
    check(results)  # type: ignore[arg-type]
    res: dict[str, Any] = results[0]  # type: ignore[assignment]
    errors = [
        abs(a - b) / b
        for i, (a, b) in enumerate(zip(res["norms"], res["ref_norms"], strict=True))
        if i != POISON_STEP
    ]
    # The README's numbers (pytest -s): collectives per step and the norm's relative error.
    print(f"{name}: collectives {res['comm']}, max norm rel. error {max(errors):.2e}")
    if name.startswith("pp"):
        # Only the last stage ever scaled a loss; the others created their scale at step.
        last = results[-1]
        assert last["called_scale"] and not results[0]["called_scale"]  # type: ignore[index]


# -- torch's recipe on the same setups: the baseline ----------------------------------------------


def _torchtitan_style_norm(setup: Setup, params: list[torch.Tensor]) -> torch.Tensor:
    """The norm torchtitan's ``clip_grad_norm_(..., pp_mesh=..., ep_enabled=...)`` computes.

    Rewritten here from its behaviour: with ``ep_enabled`` every parameter must
    be a DTensor (it asserts so); those whose mesh has an ``ep`` dim and the
    others get one ``get_total_norm`` each, each made a plain tensor by
    ``full_tensor()`` (an all-reduce), combined; then one all-reduce over the
    pipeline group when a ``pp_mesh`` is given.
    """
    from torch.distributed.tensor import DTensor

    ep_enabled = isinstance(setup, ExpertSetup)
    grads = [p.grad for p in params if p.grad is not None]
    if ep_enabled:
        for g in grads:
            assert isinstance(g, DTensor), "torchtitan's EP clipping takes DTensor parameters only"
        ep = [g for g in grads if "ep" in (g.device_mesh.mesh_dim_names or ())]  # type: ignore[union-attr]
        parts = [ep, [g for g in grads if all(g is not e for e in ep)]]
    else:
        parts = [grads]
    total = torch.zeros(())
    for part in parts:
        norm = torch.nn.utils.get_total_norm(part, 2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        total = total + norm.pow(2)
    if isinstance(setup, PipelineSetup):
        dist.all_reduce(total, group=setup.pp_group)
    return total.sqrt()


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:150]}"


def torch_recipe_case(name: str) -> dict[str, Any]:
    """One step of torchtitan's clipping (bf16: no scaler), then of torch's fp16 recipe."""
    from torch.distributed.tensor.debug import CommDebugMode

    setup = SETUPS[name]()
    ref = reference_model(name)
    x, y = batch(0)
    loss_sum(ref(x), y).backward()
    out: dict[str, Any] = {
        "ref_norm": float(
            torch.nn.utils.get_total_norm([p.grad for p in ref.parameters() if p.grad is not None])
        )
    }
    params = setup.params()
    setup.forward_backward(_Unscaled(), x, y)
    try:
        with CommDebugMode() as comm:  # type: ignore[no-untyped-call]
            norm = _torchtitan_style_norm(setup, params)
        out["torchtitan"] = (comm.get_total_counts(), float(norm))
    except Exception as exc:
        out["torchtitan"] = _error(exc)
    # torch's fp16 recipe: GradScaler.unscale_ + clip_grad_norm_ + step + update.
    for p in params:
        p.grad = None
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = torch.amp.GradScaler("cpu", **SCALER_KW)
    setup.forward_backward(scaler, x, y)
    try:
        with CommDebugMode() as comm:  # type: ignore[no-untyped-call]
            scaler.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_(params, math.inf)
            scaler.step(opt)
            scaler.update()
        out["torch"] = (comm.get_total_counts(), float(_plain(norm)))
    except Exception as exc:
        out["torch"] = _error(exc)
    return out


class _Unscaled:
    def scale(self, t: torch.Tensor) -> torch.Tensor:
        return t


def _plain(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


#: What torch's recipe does on each setup (checked, so a torch that fixes it shows up here).
TORCH_FINDINGS = {
    # Stages that never scale the loss cannot unscale; the last stage's norm is its own.
    "pp": "_scale is None",
    "pp_fsdp": "_scale is None",
    # Plain dense parameters beside DTensor experts: the unscale kernel refuses the mix.
    "ep": "mixed torch.Tensor and DTensor",
    # Plain experts: nothing tells torch they differ per rank; the norm is this rank's own.
    "ep_plain": None,
    # Two meshes: clip_grad_norm_ stacks per-mesh norms and fails (pytorch #180346).
    "ep_fsdp": "same mesh",
}


@pytest.mark.parametrize("name", list(SETUPS))
def test_torch_recipe_baseline(pool4: Pool, name: str) -> None:
    """torch's recipe fails or is wrong where shardscale's one collective is right."""
    results: list[dict[str, Any]] = pool4.run(torch_recipe_case, name)  # type: ignore[assignment]
    rtol = 2 * norm_rtol(500, torch.float32, 2.0) + 2 * ROWS * torch.finfo(torch.float32).eps
    finding = TORCH_FINDINGS[name]
    for rank, res in enumerate(results):
        print(f"{name} rank {rank}: {res}")  # the README's numbers (pytest -s)
        ref, torch_res, titan = res["ref_norm"], res["torch"], res["torchtitan"]
        if finding is None:  # runs, but each rank's norm is its own, not the model's
            assert isinstance(torch_res, tuple) and abs(torch_res[1] - ref) > 1e-3 * ref
        elif name.startswith("pp") and rank == len(results) - 1:
            # The last stage scaled its loss: its recipe runs but measures this stage only.
            assert isinstance(torch_res, tuple) and abs(torch_res[1] - ref) > 1e-3 * ref
        elif not (name == "pp_fsdp" and rank >= 2):
            assert isinstance(torch_res, str) and finding in torch_res, torch_res
        if name in ("pp", "pp_fsdp", "ep_fsdp"):  # torchtitan's clipping is right there
            assert isinstance(titan, tuple), titan
            assert abs(titan[1] - ref) <= rtol * ref, (titan, ref)
        else:  # it takes DTensor parameters only
            assert isinstance(titan, str) and "DTensor" in titan, titan


def dtensor_in_distinct_params_case() -> tuple[str, str]:
    """Rank 0 alone wrongly declares a DTensor expert in distinct_params; every rank must stop."""
    from shardscale.clip import unscale_and_clip_
    from shardscale.core import ShardedGradScaler

    setup = ExpertSetup(style="ep")
    wrong = [setup.model.experts.w1] if dist.get_rank() == 0 else []
    scaler = ShardedGradScaler("cpu", distinct_params=wrong, **SCALER_KW)
    opt = torch.optim.SGD(setup.params(), lr=0.1)
    x, y = batch(0)
    setup.forward_backward(scaler, x, y)
    before = [p.grad.clone() for p in setup.params() if p.grad is not None]  # type: ignore[union-attr]
    try:
        unscale_and_clip_(scaler, opt, MAX_NORM)
    except Exception as exc:
        after = [p.grad for p in setup.params() if p.grad is not None]
        unchanged = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))  # type: ignore[arg-type]
        return type(exc).__name__, f"{exc} unchanged={unchanged}"
    return "none", ""


def test_a_wrong_declaration_on_one_rank_stops_every_rank(pool4: Pool) -> None:
    results: list[tuple[str, str]] = pool4.run(dtensor_in_distinct_params_case)  # type: ignore[assignment]
    kind, message = results[0]
    assert kind == "ValueError" and "distinct_dims" in message, results[0]
    for other_kind, other in results[1:]:
        assert other_kind == "StepError" and "rank(s) [0]" in other, other
    assert all(m.endswith("unchanged=True") for _, m in results), results
