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
