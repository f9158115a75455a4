"""``shardscale.torchtitan.clip_grad_norm_`` against torchtitan's own, on 4 gloo ranks.

torchtitan's function is imported from the installed package
(``torchtitan.distributed.utils.clip_grad_norm_``) and run on the same
gradients as ours, on each layout torchtitan trains with:

- ``fsdp``: 1-D FSDP (every parameter ``Shard(0)`` over 4 ranks);
- ``fsdp_tp``: FSDP x TP on a 2 x 2 mesh (a norm weight replicated over tp);
- ``pp``: 2 pipeline stages x 2 FSDP ranks (``pp_mesh`` given; stages hold
  different parameters);
- ``pp_plain``: 4 pipeline stages, one per rank, plain tensors;
- ``ep``: dense parameters FSDP over 4 ranks, experts on an ``("efsdp", "ep")``
  2 x 2 mesh (``ep_enabled=True``);
- ``pp_ep``: 2 stages, each with a dense layer FSDP over its 2 ranks and
  experts sharded over ``ep`` (``pp_mesh`` and ``ep_enabled``).
Both must return the same norm (within the dtype's accumulation bound) and
leave the same clipped gradients, for p = 2 and p = inf; collectives are
counted with torch's ``CommDebugMode`` around each call. torchtitan's trainer
itself is not run: its ``device_type`` is "cuda" without an accelerator.

A frozen pipeline stage (real FSDP2 stages, one backward, the frozen stage's
ranks without any gradient) runs on 2 ranks (pp 2 x dp 1) and on 4 (pp 2 x
dp 2), each case with a deadline: every rank must join the same reduction.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from mp_harness import Pool
from tolerances import clipped_grad_rtol, norm_rtol

pytest.importorskip("torchtitan")
pytest.importorskip("shardscale.torchtitan")

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

MAX_NORM = 0.5  # below every layout's norm (checked), so clipping acts


def _full(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _dtensor_param(full: torch.Tensor, mesh: Any, placements: list[Any], seed: int) -> Any:
    from torch.distributed.tensor import distribute_tensor

    p = torch.nn.Parameter(distribute_tensor(full, mesh, placements))
    p.grad = distribute_tensor(_full(tuple(full.shape), seed), mesh, placements)
    return p


def _fsdp() -> tuple[list[Any], dict[str, Any], float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    # No rank's shard is empty: torch's foreach inf-norm (inside torchtitan's) raises on one.
    shapes = [(8, 6), (8,), (4, 3)]
    params = [_dtensor_param(_full(s, i), mesh, [Shard(0)], 100 + i) for i, s in enumerate(shapes)]
    ref = [_full(s, 100 + i) for i, s in enumerate(shapes)]
    return params, {}, _ref_norm(ref)


def _fsdp_tp() -> tuple[list[Any], dict[str, Any], float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    layout = [((8, 6), [Shard(0), Shard(1)]), ((6, 8), [Shard(0), Shard(0)]),
              ((6,), [Shard(0), Replicate()])]  # fmt: skip
    params = [_dtensor_param(_full(s, i), mesh, pl, 200 + i) for i, (s, pl) in enumerate(layout)]
    return params, {}, _ref_norm([_full(s, 200 + i) for i, (s, _) in enumerate(layout)])


def _pp() -> tuple[list[Any], dict[str, Any], float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    root = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage = root.get_coordinate()[0]  # type: ignore[index]
    shapes = [(8, 6), (6,)]
    params = [
        _dtensor_param(_full(s, 10 * stage + i), root["dp"], [Shard(0)], 300 + 10 * stage + i)
        for i, s in enumerate(shapes)
    ]
    ref = [_full(s, 300 + 10 * st + i) for st in range(2) for i, s in enumerate(shapes)]
    return params, {"pp_mesh": root["pp"]}, _ref_norm(ref)


def _pp_plain() -> tuple[list[Any], dict[str, Any], float]:
    from torch.distributed.device_mesh import init_device_mesh

    pp_mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("pp",))
    stage = dist.get_rank()
    shapes = [(4, 3), (3,)]
    params = []
    for i, s in enumerate(shapes):
        p = torch.nn.Parameter(_full(s, 10 * stage + i))
        p.grad = _full(s, 400 + 10 * stage + i)
        params.append(p)
    ref = [_full(s, 400 + 10 * st + i) for st in range(4) for i, s in enumerate(shapes)]
    return params, {"pp_mesh": pp_mesh}, _ref_norm(ref)


def _ep() -> tuple[list[Any], dict[str, Any], float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    dense_mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    expert_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep"))
    dense = [((8, 6), 500), ((8,), 501)]
    experts = [((4, 6, 8), 510), ((4, 8, 6), 511)]  # [num_experts, ...], experts over ep
    params = [_dtensor_param(_full(s, seed), dense_mesh, [Shard(0)], seed + 50)
              for s, seed in dense]  # fmt: skip
    params += [_dtensor_param(_full(s, seed), expert_mesh, [Shard(1), Shard(0)], seed + 50)
               for s, seed in experts]  # fmt: skip
    return (
        params,
        {"ep_enabled": True},
        _ref_norm([_full(s, seed + 50) for s, seed in dense + experts]),
    )


def _pp_ep() -> tuple[list[Any], dict[str, Any], float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    # 2 stages x 2 ranks; in each stage a dense layer FSDP over the pair and experts over "ep".
    # (torchtitan tells experts apart by an "ep" dim in their mesh: two meshes over the ranks.)
    dense_root = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    expert_root = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "ep"))
    stage = dense_root.get_coordinate()[0]  # type: ignore[index]
    layout = [((8, 6), 600, dense_root["dp"]), ((4, 6, 8), 610, expert_root["ep"])]
    params = [
        _dtensor_param(_full(s, seed + stage), mesh, [Shard(0)], seed + 50 + stage)
        for s, seed, mesh in layout
    ]
    ref = [_full(s, seed + 50 + st) for st in range(2) for s, seed, _ in layout]
    return params, {"pp_mesh": dense_root["pp"], "ep_enabled": True}, _ref_norm(ref)


LAYOUTS: dict[str, Callable[[], tuple[list[Any], dict[str, Any], float]]] = {
    "fsdp": _fsdp, "fsdp_tp": _fsdp_tp, "pp": _pp, "pp_plain": _pp_plain, "ep": _ep,
    "pp_ep": _pp_ep,
}  # fmt: skip


def _ref_norm(full_grads: list[torch.Tensor]) -> float:
    """The norm of every gradient of the whole model, from the full tensors, in float64."""
    return float(torch.nn.utils.get_total_norm([g.double() for g in full_grads], 2.0))


def _local_grads(params: list[Any]) -> list[torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return [(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).clone() for p in params]


def _set_grads(params: list[Any], locals_: list[torch.Tensor]) -> None:
    from torch.distributed.tensor import DTensor

    for p, g in zip(params, locals_, strict=True):
        target = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        target.copy_(g)


def _case(layout: str) -> dict[str, Any]:
    from torch.distributed.tensor.debug import CommDebugMode
    from torchtitan.distributed.utils import clip_grad_norm_ as titan_clip

    from shardscale.torchtitan import clip_grad_norm_ as ours_clip

    params, kwargs, ref = LAYOUTS[layout]()
    original = _local_grads(params)
    out: dict[str, Any] = {"ref": ref, "numel": sum(p.numel() for p in params)}
    # A first call builds shardscale's plan for this layout; the counted calls are warm ones
    # (a training loop calls it every step).
    ours_clip(params, math.inf, **kwargs)
    for norm_type in (2.0, math.inf):
        for name, fn in (("titan", titan_clip), ("ours", ours_clip)):
            _set_grads(params, original)
            with CommDebugMode() as comm:  # type: ignore[no-untyped-call]
                norm = fn(params, MAX_NORM, norm_type, **kwargs)
            out[(name, norm_type)] = {
                "norm": float(norm),
                "collectives": comm.get_total_counts(),
                "grads": _local_grads(params),
            }
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_same_norm_and_clipped_grads_as_torchtitan_with_one_collective(
    pool4: Pool, layout: str
) -> None:
    results = pool4.run(_case, layout)
    for rank, res in enumerate(results):
        rtol = 2 * norm_rtol(res["numel"], torch.float32, 2.0)  # each within the bound
        titan, ours = res[("titan", 2.0)], res[("ours", 2.0)]
        assert res["ref"] > MAX_NORM
        # torchtitan's norm is the whole model's (the reference from the full tensors) ...
        assert titan["norm"] == pytest.approx(res["ref"], rel=rtol), (layout, rank)
        # ... and so is ours, with one collective where torchtitan needs one per mesh group
        # and one more across pipeline stages.
        assert ours["norm"] == pytest.approx(titan["norm"], rel=rtol), (layout, rank)
        # The inf-norm is a max: exact up to the final rounding.
        inf_t, inf_o = res[("titan", math.inf)], res[("ours", math.inf)]
        assert inf_o["norm"] == inf_t["norm"], (layout, rank)
        for p in (2.0, math.inf):
            t, o = res[("titan", p)], res[("ours", p)]
            assert o["collectives"] == 1, (layout, rank, p, o["collectives"])
            tol = clipped_grad_rtol(res["numel"], torch.float32, 2.0)
            for a, b in zip(t["grads"], o["grads"], strict=True):
                torch.testing.assert_close(b, a, rtol=tol, atol=0.0)
        print(
            f"{layout} rank {rank}: norm {ours['norm']:.6f} (torchtitan {titan['norm']:.6f}); "
            f"collectives ours {ours['collectives']} torchtitan {titan['collectives']} "
            f"(inf-norm: {inf_t['collectives']})"
        )
    # Every rank got the same norm.
    assert len({res[("ours", 2.0)]["norm"] for res in results}) == 1
    # torchtitan's structural minimum: one reduction per mesh group (dense, experts) and one
    # across stages (torch's DTensor may add one per mesh dim: 2 on the 2-D mesh with 2.13).
    least = {"fsdp": 1, "fsdp_tp": 1, "pp": 2, "pp_plain": 1, "ep": 2, "pp_ep": 3}[layout]
    assert results[0][("titan", 2.0)]["collectives"] >= least


def _empty_shard_case() -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from shardscale.torchtitan import clip_grad_norm_ as ours_clip

    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    # 6 rows over 4 ranks: FSDP2 gives ranks 2, 2, 2, 0 rows; rank 3's shard is empty.
    params = [_dtensor_param(_full((6,), 1), mesh, [Shard(0)], 700)]
    local = params[0].grad.to_local()
    out: dict[str, Any] = {"local_numel": local.numel()}
    out["ours"] = float(ours_clip(params, math.inf, math.inf))
    # What torchtitan's inf-norm runs first on each rank (torch's foreach norm of the local
    # shard), alone: on the empty shard it raises, so torchtitan's call raises on that rank
    # while its peers wait in the all-reduce.
    try:
        torch._foreach_norm([local], math.inf)
    except RuntimeError as exc:
        out["foreach_norm"] = str(exc).splitlines()[0]
    return out


def test_inf_norm_with_an_empty_fsdp_shard(pool4: Pool) -> None:
    """Ours counts nothing on a rank with an empty shard and returns the max over the ranks
    that hold data; torch's foreach inf-norm, which torchtitan's starts with, raises there."""
    ref = float(_full((6,), 700).abs().max())
    results = pool4.run(_empty_shard_case)
    assert [r["local_numel"] for r in results] == [2, 2, 2, 0]
    assert [r["ours"] for r in results] == [ref] * 4
    assert "infinity norm on an empty tensor" in results[3]["foreach_norm"]
    assert all("foreach_norm" not in r for r in results[:3])


# -- a frozen pipeline stage (issue 27, #5) ------------------------------------------------------

#: Seconds a frozen-stage case may take: ample on a loaded 2-core machine (each takes a few
#: seconds), and well under the module's pytest timeout so a hang fails the case, not the run.
FROZEN_TIMEOUT = 90.0


def _frozen_stage_case(frozen: int, pass_frozen_params: bool) -> dict[str, Any]:
    """pp 2 x dp (world / 2), a real FSDP2 model per stage (as torchtitan shards a stage), one
    backward; stage ``frozen`` has ``requires_grad=False``, so its ranks hold no gradient.

    ``pass_frozen_params=False`` gives the frozen stage's ranks an empty parameter list (a caller
    that passes only the parameters that train). Returns, per rank, torchtitan's and our norms,
    clipped local gradients and collective counts, and the reference: this stage's norm from the
    full gradients in float64 (0 on the frozen stage).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode
    from torchtitan.distributed.utils import clip_grad_norm_ as titan_clip

    from shardscale.torchtitan import clip_grad_norm_ as ours_clip

    world = dist.get_world_size()
    root = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "dp"))
    stage = root.get_coordinate()[0]  # type: ignore[index]
    torch.manual_seed(10 + stage)  # each stage its own layers, the same on its dp ranks
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4), torch.nn.Tanh()
    )
    if stage == frozen:
        model.requires_grad_(False)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=root["dp"])
    fully_shard(model, mesh=root["dp"])
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(100 + dist.get_rank()))
    loss = model(x).square().sum()
    if stage != frozen:
        loss.backward()
    params = list(model.parameters())
    assert all(isinstance(p, DTensor) for p in params)  # FSDP2's, frozen or not
    has_grads = [p.grad is not None for p in params]
    if not pass_frozen_params and stage == frozen:
        params = []
    grads = [p.grad for p in params if p.grad is not None]
    full = [g.full_tensor().double() for g in grads if isinstance(g, DTensor)]
    assert len(full) == len(grads)
    out: dict[str, Any] = {
        "stage": stage,
        "has_grads": has_grads,
        "ref": float(torch.nn.utils.get_total_norm(full, 2.0)) if full else 0.0,
        "numel": sum(p.numel() for p in params),
    }
    original = _local_grads([p for p in params if p.grad is not None])
    for norm_type in (2.0, math.inf):
        for name, fn in (("titan", titan_clip), ("ours", ours_clip)):
            _set_grads([p for p in params if p.grad is not None], original)
            with CommDebugMode() as comm:  # type: ignore[no-untyped-call]
                norm = fn(params, MAX_NORM, norm_type, pp_mesh=root["pp"])
            out[(name, norm_type)] = {
                "norm": float(norm),
                "collectives": comm.get_total_counts(),
                "grads": _local_grads([p for p in params if p.grad is not None]),
            }
    return out


def _check_frozen_stage(results: list[Any], frozen: int) -> None:
    stages = [res["stage"] for res in results]
    assert sorted(stages) == [0] * (len(results) // 2) + [1] * (len(results) // 2)
    # The frozen stage's ranks hold no gradient at all; the other stage's hold every one.
    for res in results:
        want = [res["stage"] != frozen] * len(res["has_grads"])
        assert res["has_grads"] == want, (res["stage"], res["has_grads"])
    trained = [res for res in results if res["stage"] != frozen]
    # The whole model's norm is the trained stage's (the frozen one adds 0), from its full
    # gradients in float64: the same tensors on each of its ranks, so the same value.
    ref = trained[0]["ref"]
    assert all(res["ref"] == ref for res in trained) and ref > MAX_NORM
    numel = trained[0]["numel"]  # the trained stage's whole parameters (DTensor numel is global)
    rtol = 2 * norm_rtol(numel, torch.float32, 2.0)  # each within the float32 bound
    for rank, res in enumerate(results):
        titan, ours = res[("titan", 2.0)], res[("ours", 2.0)]
        assert titan["norm"] == pytest.approx(ref, rel=rtol), rank
        assert ours["norm"] == pytest.approx(titan["norm"], rel=rtol), rank
        # The inf-norm is a max: exact.
        assert res[("ours", math.inf)]["norm"] == res[("titan", math.inf)]["norm"], rank
        for p in (2.0, math.inf):
            t, o = res[("titan", p)], res[("ours", p)]
            assert o["collectives"] == 1, (rank, p, o["collectives"])  # frozen or not
            tol = clipped_grad_rtol(numel, torch.float32, 2.0)
            for a, b in zip(t["grads"], o["grads"], strict=True):
                torch.testing.assert_close(b, a, rtol=tol, atol=0.0)
    assert len({res[("ours", 2.0)]["norm"] for res in results}) == 1


@pytest.mark.parametrize("frozen", [0, 1], ids=["first-stage-frozen", "last-stage-frozen"])
def test_a_frozen_stage_on_2_ranks_returns_torchtitans_norm(pool2: Pool, frozen: int) -> None:
    """pp 2 x dp 1: the frozen stage's rank joins the same reduction as its peer (it picked
    another path from its missing gradients and both ranks raised a DeclarationError)."""
    results = pool2.run(_frozen_stage_case, frozen, True, timeout=FROZEN_TIMEOUT)
    _check_frozen_stage(results, frozen)


@pytest.mark.parametrize("pass_frozen_params", [True, False], ids=["all-params", "no-params"])
def test_a_frozen_stage_on_pp2_dp2_returns_torchtitans_norm_and_never_hangs(
    pool4: Pool, pass_frozen_params: bool
) -> None:
    """pp 2 x dp 2, FSDP2 inside each stage: the frozen stage's ranks waited in the pipeline
    group while the others reduced over the whole world, until the process-group timeout."""
    results = pool4.run(_frozen_stage_case, 0, pass_frozen_params, timeout=FROZEN_TIMEOUT)
    _check_frozen_stage(results, 0)
