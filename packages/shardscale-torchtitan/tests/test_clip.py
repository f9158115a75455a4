"""shardscale.torchtitan.clip_grad_norm_ in one process: signature, parity with torch, bad input.

The multi-rank comparison with torchtitan's own function (FSDP, FSDP + TP,
pipeline, expert layouts; collectives counted) is integration_tests/test_torchtitan.py.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from shardscale.torchtitan import clip_grad_norm_


@pytest.fixture
def group_of_one() -> Iterator[None]:
    # A one-rank gloo group on an in-memory store: meshes and DTensors without a launcher.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_takes_torchtitans_arguments_in_torchtitans_order() -> None:
    titan = pytest.importorskip("torchtitan.distributed.utils")
    theirs = list(inspect.signature(titan.clip_grad_norm_).parameters)
    ours = list(inspect.signature(clip_grad_norm_).parameters)
    assert ours[: len(theirs)] == theirs
    assert "ep_dense_params_mesh_ndim" in ours  # older torchtitan releases pass it


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_plain_tensors_match_torch_clip_grad_norm(norm_type: float) -> None:
    g = torch.Generator().manual_seed(0)
    shapes = [(5, 3), (7,), (2, 2, 2)]
    grads = [torch.randn(s, generator=g) for s in shapes]
    ours = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    ref = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    for a, b, grad in zip(ours, ref, grads, strict=True):
        a.grad, b.grad = grad.clone(), grad.clone()
    n_ours = clip_grad_norm_(ours, 0.5, norm_type)
    n_ref = torch.nn.utils.clip_grad_norm_(ref, 0.5, norm_type)
    # One rounding per term, a sum of 35 terms, and the root (tolerances.py's bound).
    rtol = (35 + 8) * torch.finfo(torch.float32).eps
    torch.testing.assert_close(n_ours, n_ref, rtol=rtol, atol=0.0)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=2 * rtol, atol=0.0)


def test_a_pp_mesh_must_be_one_named_dim(group_of_one: None) -> None:
    from torch.distributed.device_mesh import DeviceMesh

    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    two_d = DeviceMesh("cpu", [[0]], mesh_dim_names=("pp", "dp"))
    with pytest.raises(ValueError, match=r"pp_mesh must be a 1-D DeviceMesh.*got a 2-D mesh"):
        clip_grad_norm_([p], 1.0, pp_mesh=two_d)
    assert torch.equal(p.grad, torch.ones(3))  # nothing changed


def test_a_pp_mesh_with_mixed_dtensor_and_plain_gradients_is_refused(group_of_one: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("pp",))
    d = torch.nn.Parameter(distribute_tensor(torch.ones(4), mesh, [Shard(0)]))
    d.grad = distribute_tensor(torch.ones(4), mesh, [Shard(0)])
    plain = torch.nn.Parameter(torch.ones(2))
    plain.grad = torch.ones(2)
    with pytest.raises(ValueError, match=r"all DTensors or all plain tensors; got 1 DTensor and 1"):
        clip_grad_norm_([d, plain], 1.0, pp_mesh=mesh)
    assert torch.equal(plain.grad, torch.ones(2))


def test_a_stage_of_plain_tensors_on_a_one_rank_pipeline(group_of_one: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("pp",))
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.full((4,), 3.0)  # norm 6
    norm = clip_grad_norm_([p], 1.5, pp_mesh=mesh, ep_enabled=False)
    assert float(norm) == pytest.approx(6.0, rel=1e-6)
    torch.testing.assert_close(p.grad, torch.full((4,), 3.0 * 1.5 / (6.0 + 1e-6)))


def test_plugins_lists_it_and_doctor_reports_torchtitan() -> None:
    pytest.importorskip("shardscale.cli")  # the command is another distribution
    import importlib.metadata as md

    from shardscale.cli._doctor import _integration_checks
    from shardscale.core import get_registry

    names = {(p.name, p.distribution) for p in get_registry().plugins()}
    assert ("torchtitan", "shardscale-torchtitan") in names
    (finding,) = [f for f in _integration_checks() if f.check == "shardscale-torchtitan"]
    try:
        version = md.version("torchtitan")
    except md.PackageNotFoundError:  # optional: the drop-in runs without it
        assert finding.status == "info" and "not needed" in finding.detail
    else:
        assert finding.status == "ok" and f"with torchtitan {version}" in finding.detail
