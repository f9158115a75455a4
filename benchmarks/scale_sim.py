"""The real step engine at 10^3 to 10^5 ranks, in one process, on torch's fake process group.

Part of the scale table (``nox -s bench_scale``, ``bench_scale.py``); not in any wheel.

[Note: simulating W ranks in one process]
torch's fake process group (``backend="fake"`` with a ``FakeStore``) lets one
process be rank r of a group of W: ``DeviceMesh`` and ``DTensor`` work as on
a real group of that size, and collectives return at once, leaving their
input unchanged. The engine runs unmodified on tiny FSDP2-style parameters
(DTensors sharded over a 1-D mesh of all W ranks, the local shard of
``local_numel`` elements) plus a few plain, replicated tensors; only the
step's one all-reduce is completed by hand:

* every rank other than the *representative* ranks (0, W // 2 and W - 1)
  holds exactly the gradients of a *template* rank (rank 1). A rank's
  contribution to the reduced vector depends only on its gradients and its
  rank (the slots it writes; whether it counts the replicated plain tensors,
  which only group rank 0 does), so every other rank's contribution is rank
  1's, moved to that rank's slots: computable without running it;
* the engine runs at each representative rank and at the template rank, and
  the vector each hands to the all-reduce is captured (:class:`SimBackend`);
* the reduced vector is their SUM, composed by name through
  :class:`~shardscale.core.step.VectorLayout` (per-rank blocks: the template's
  value in every other rank's slot; shared values: W - 3 times the
  template's), exactly what a real SUM over W ranks holding these gradients
  returns;
* the engine then runs again at each representative rank, its all-reduce
  (the fake group's, then :class:`SimBackend`) returning the composed vector,
  and decides. Those runs are timed: the host time to build the vector and
  decide, at W ranks, with W-rank DTensors.

The reference norm is computed independently: float64 norms of the same
local tensors, summed as (W - 3) x the template's + each representative's +
the plain tensors' once.
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from shardscale.core import MiddlewareBase

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from shardscale.core import CollectiveBackend, Handle, ReduceOp

__all__ = [
    "SCALE",
    "TEMPLATE_RANK",
    "SimBackend",
    "SimConfig",
    "SimResult",
    "median_interval",
    "representative_ranks",
    "simulate",
]

#: The loss scale the simulated gradients carry (the step unscales the norm by it).
SCALE = 2.0**16
#: The rank whose gradients every non-representative rank holds.
TEMPLATE_RANK = 1


def representative_ranks(world: int) -> tuple[int, ...]:
    """Rank 0 (counts the replicas), a middle rank and the last rank (the one with an inf)."""
    return (0, world // 2, world - 1)


@dataclass(frozen=True, slots=True, kw_only=True)
class SimConfig:
    """One simulated world."""

    world: int
    dtensor_params: int = 8
    plain_params: int = 2
    local_numel: int = 8
    norm_type: float = 2.0
    max_norm: float = 1.0
    repeats: int = 15
    #: Put an inf into the last rank's first gradient.
    inf_on_last: bool = False

    def __post_init__(self) -> None:
        if self.world < 8:
            raise ValueError(f"world={self.world}: the simulation needs at least 8 ranks")
        if self.repeats < 1:
            raise ValueError(f"repeats={self.repeats}: time at least one step")


@dataclass(frozen=True, slots=True, kw_only=True)
class SimResult:
    """What the simulation of one world measured and checked."""

    world: int
    inf_on_last: bool
    vector_numel: int
    vector_bytes: int
    #: Host seconds of each timed step (every representative rank's, in rank order).
    step_s: tuple[float, ...]
    #: Per representative rank: (found_inf, norm) it decided.
    decisions: dict[int, tuple[float, float]]
    #: The float64 reference norm (unscaled).
    reference: float
    #: Relative error allowed between the decided norm and the reference (see ``norm_rtol``).
    rtol: float
    #: All-reduces per timed step (counted by :class:`SimBackend`).
    collectives_per_step: float

    @property
    def correct(self) -> bool:
        """Every representative rank decided the same, and what the reference says."""
        values = set(self.decisions.values())
        if len(values) != 1:
            return False
        ((found, norm),) = values
        if self.inf_on_last:
            return found == 1.0 and math.isinf(norm) and norm > 0
        return found == 0.0 and abs(norm - self.reference) <= self.rtol * self.reference


def norm_rtol(local_numel: int, terms: int, norm_type: float) -> float:
    """How far the decided norm may be from the float64 reference.

    Each local tensor's norm is accumulated in float32 (its relative error at
    most (n + 8)·u32·2 for n elements, integration_tests/tolerances.py's
    bound); a sum of non-negative terms each within a relative error keeps
    it; combining ``terms`` per-tensor norms in float64 adds at most
    terms·u64; the result is rounded to float32 (u32).
    """
    u32 = torch.finfo(torch.float32).eps / 2
    u64 = torch.finfo(torch.float64).eps / 2
    per_tensor = (local_numel + 8) * u32 * max(1.0, 1.0 / norm_type) * 2
    return per_tensor + terms * u64 * 4 + u32


class SimBackend(MiddlewareBase):
    """The step's collective on the fake group, completed with a vector composed by hand.

    Wraps the c10d backend (rank, world size and group ranks come from the
    fake group; its all-reduce runs and leaves the vector unchanged). Records
    the vector each step hands over (``seen``) and, when ``reduced`` is set,
    writes it into the tensor, as a real SUM over W ranks would.
    """

    name: ClassVar[str] = "simulated"

    def __init__(self, inner: CollectiveBackend) -> None:
        super().__init__(inner)
        self.reduced: torch.Tensor | None = None
        self.seen: torch.Tensor | None = None
        #: All-reduces issued through this backend (the step's one collective).
        self.calls = 0

    def all_reduce(
        self, tensor: torch.Tensor, *, op: ReduceOp, group: ProcessGroup | None
    ) -> Handle:
        """Record ``tensor``, run the fake all-reduce, then write the composed result."""
        from shardscale.core.plugins import CompletedHandle

        self.calls += 1
        if self.reduced is None:
            self.seen = tensor.clone()  # capturing (untimed)
        self.inner.all_reduce(tensor, op=op, group=group).wait()
        if self.reduced is not None:
            tensor.copy_(self.reduced)  # what the real all-reduce would write
        return CompletedHandle()


# -- gradients ------------------------------------------------------------------------------------


def _factor(rank: int, world: int) -> float:
    """How rank ``rank``'s gradients differ from the template's (distinct, so mixing shows)."""
    if rank == 0:
        return 2.0
    if rank == world // 2:
        return 3.0
    if rank == world - 1:
        return 0.5
    return 1.0  # the template, and so every other rank


def local_grads(rank: int, cfg: SimConfig) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(DTensor parameters' local gradient shards, plain parameters' gradients) on ``rank``.

    Values of the order of a loss-scaled gradient (the step unscales by :data:`SCALE`).
    """
    base = torch.arange(1, cfg.local_numel + 1, dtype=torch.float32) * 37.0
    sharded = [base * (i + 1) * _factor(rank, cfg.world) for i in range(cfg.dtensor_params)]
    if cfg.inf_on_last and rank == cfg.world - 1:
        sharded[0][0] = math.inf
    plain = [base * (i + 0.5) for i in range(cfg.plain_params)]  # replicas: the same everywhere
    return sharded, plain


def reference_norm(cfg: SimConfig) -> float:
    """The unscaled global norm, float64, from the same gradients (not through the engine)."""
    p = cfg.norm_type

    def power_sum(tensors: Sequence[torch.Tensor]) -> float:
        return math.fsum(float(torch.linalg.vector_norm(t.double(), p)) ** p for t in tensors)

    reps = representative_ranks(cfg.world)
    total = (cfg.world - len(reps)) * power_sum(local_grads(TEMPLATE_RANK, cfg)[0])
    total += sum(power_sum(local_grads(r, cfg)[0]) for r in reps)
    total += power_sum(local_grads(0, cfg)[1])  # replicated plain tensors count once
    return float(total ** (1.0 / p)) / SCALE


# -- one rank of the fake group ------------------------------------------------------------------


#: Each simulated session names its mesh dimension afresh (``dp0``, ``dp1``, ...); see fake_rank.
_SESSIONS = itertools.count()


@contextmanager
def fake_rank(rank: int, world: int) -> Iterator[Any]:
    """This process as rank ``rank`` of a fake group of ``world``, with a 1-D mesh over it.

    A real job builds its mesh once; here every rank's session builds one of the same shape.
    Meshes of the same ranks and names compare equal, so a cache keyed by mesh anywhere in the
    stack would compare the new mesh with the old ones, an O(world) comparison per lookup,
    inside the timed steps. Each session's dimension gets a name of its own (no adapter gives
    the data-parallel dimension's name a meaning), so its mesh equals no earlier one.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError(
            "a process group is already initialised; the simulation needs its own fake group "
            "(run it in a fresh process)"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield init_device_mesh("cpu", (world,), mesh_dim_names=(f"dp{next(_SESSIONS)}",))
    finally:
        dist.destroy_process_group()


def _params(rank: int, cfg: SimConfig, mesh: Any) -> list[torch.nn.Parameter]:
    from torch.distributed.tensor import DTensor, Shard

    sharded, plain = local_grads(rank, cfg)
    shape = torch.Size((cfg.world * cfg.local_numel,))
    params = []
    for grad in sharded:
        local = torch.zeros(cfg.local_numel)
        param = torch.nn.Parameter(
            DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=shape, stride=(1,))
        )
        param.grad = DTensor.from_local(
            grad, mesh, [Shard(0)], run_check=False, shape=shape, stride=(1,)
        )
        params.append(param)
    for grad in plain:
        param = torch.nn.Parameter(torch.zeros(cfg.local_numel))
        param.grad = grad
        params.append(param)
    return params


def _step(params: list[torch.nn.Parameter], backend: SimBackend, cfg: SimConfig) -> Any:
    from shardscale.core import get_registry
    from shardscale.core.step import Apply, StepConfig, StepRequest, run_step

    config = StepConfig(backend=backend, registry=get_registry())  # type: ignore[arg-type]
    # The fused-optimizer path: found_inf, norm, clip coefficient and grad_scale all decided,
    # no gradient written, so the timed repeats see the same gradients.
    return run_step(
        params,
        config,
        StepRequest(
            apply=Apply.FUSED,
            norm_type=cfg.norm_type,
            max_norm=cfg.max_norm,
            scale=torch.tensor(SCALE),
            defer_errors=True,
        ),
    )


def _capture(rank: int, cfg: SimConfig) -> torch.Tensor:
    from shardscale.core import get_registry

    with fake_rank(rank, cfg.world) as mesh:
        backend = SimBackend(get_registry().make_backend("c10d"))
        _step(_params(rank, cfg, mesh), backend, cfg)
        assert backend.seen is not None
        return backend.seen


def compose(local: dict[int, torch.Tensor], world: int) -> torch.Tensor:
    """The SUM over ``world`` ranks of the local vectors: ``local`` has the representative ranks'
    and the template's; every other rank contributes the template's, moved to its slots."""
    from shardscale.core.step import VectorLayout

    layout = VectorLayout(world)
    template = local[TEMPLATE_RANK]
    reps = representative_ranks(world)
    total = torch.zeros_like(template)
    for r in reps:
        total += local[r]
    others = torch.ones(world, dtype=torch.bool)
    others[list(reps)] = False
    for name in layout.PER_RANK:
        block = total[layout.block(name)]
        block[others] += template[layout.slot(name, TEMPLATE_RANK)]
    for name in layout.SHARED:
        total[layout.shared(name)] += (world - len(reps)) * template[layout.shared(name)]
    return total


def simulate(cfg: SimConfig, *, clock: Callable[[], float] = time.perf_counter) -> SimResult:
    """Capture, compose, then time and check the decision at every representative rank."""
    from shardscale.core import get_registry

    reps = representative_ranks(cfg.world)
    local = {r: _capture(r, cfg) for r in (*reps, TEMPLATE_RANK)}
    reduced = compose(local, cfg.world)
    times: list[float] = []
    decisions: dict[int, tuple[float, float]] = {}
    calls = 0
    for rank in reps:
        with fake_rank(rank, cfg.world) as mesh:
            backend = SimBackend(get_registry().make_backend("c10d"))
            backend.reduced = reduced
            params = _params(rank, cfg, mesh)
            _step(params, backend, cfg)  # warm: adapters, kernels resolved once
            backend.calls = 0
            for _ in range(cfg.repeats):
                start = clock()
                result = _step(params, backend, cfg)
                times.append(clock() - start)
            assert result.norm is not None
            decisions[rank] = (float(result.found_inf), float(result.norm))
            calls += backend.calls
    terms = cfg.world * cfg.dtensor_params + cfg.plain_params
    return SimResult(
        world=cfg.world,
        inf_on_last=cfg.inf_on_last,
        vector_numel=reduced.numel(),
        vector_bytes=reduced.numel() * reduced.element_size(),
        step_s=tuple(times),
        decisions=decisions,
        reference=reference_norm(cfg),
        rtol=norm_rtol(cfg.local_numel, terms, cfg.norm_type),
        collectives_per_step=calls / len(times),
    )


def median_interval(
    samples: Sequence[float], *, resamples: int = 2000, seed: int = 0
) -> tuple[float, float, float]:
    """(median, low, high): the 95 % bootstrap interval of the median (seeded: reproducible)."""
    rng = random.Random(seed)
    n = len(samples)
    med = statistics.median
    boot = sorted(med([samples[rng.randrange(n)] for _ in range(n)]) for _ in range(resamples))
    return med(samples), boot[int(0.025 * resamples)], boot[int(0.975 * resamples) - 1]
