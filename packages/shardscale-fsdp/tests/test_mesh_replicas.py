"""The rank arithmetic that decides which replica of a DTensor slice counts (no process group)."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardscale.core import LayoutError
from shardscale.fsdp import ALL_DIMS
from shardscale.fsdp._mesh_replicas import counting_translate


def _table(*sizes: int) -> torch.Tensor:
    return torch.arange(int(torch.tensor(sizes).prod())).view(*sizes)


def test_dp_slice_of_dp_tp_counts_on_tp_coordinate_zero() -> None:
    table = _table(2, 2)  # [[0, 1], [2, 3]], names (dp, tp)
    names = ("dp", "tp")
    assert counting_translate(frozenset({0, 2}), table, names, frozenset())
    assert not counting_translate(frozenset({1, 3}), table, names, frozenset())


def test_tp_slice_counts_on_dp_coordinate_zero() -> None:
    table = _table(2, 2)
    names = ("dp", "tp")
    assert counting_translate(frozenset({0, 1}), table, names, frozenset())
    assert not counting_translate(frozenset({2, 3}), table, names, frozenset())


def test_pipeline_stages_declared_distinct_each_count() -> None:
    table = _table(2, 2, 2)  # (pp, dp, tp)
    names = ("pp", "dp", "tp")
    pp = frozenset({"pp"})
    # dp slices of stage 1: tp=0 -> {4, 6}, tp=1 -> {5, 7}
    assert counting_translate(frozenset({4, 6}), table, names, pp)
    assert not counting_translate(frozenset({5, 7}), table, names, pp)
    # Without the declaration stage 1 looks like a replica of stage 0.
    assert not counting_translate(frozenset({4, 6}), table, names, frozenset())
    assert counting_translate(frozenset({0, 2}), table, names, frozenset())


def test_star_makes_every_root_dim_distinct() -> None:
    table = _table(2, 2)
    assert counting_translate(frozenset({1, 3}), table, ("dp", "tp"), frozenset({ALL_DIMS}))


def test_flattened_slice_counts_once_per_tp_group() -> None:
    table = _table(2, 2, 2)  # (dp_replicate, dp_shard, tp); "dp" flattens the first two
    names = ("dp_replicate", "dp_shard", "tp")
    assert counting_translate(frozenset({0, 2, 4, 6}), table, names, frozenset())
    assert not counting_translate(frozenset({1, 3, 5, 7}), table, names, frozenset())


def test_coarse_root_from_unflatten_counts_once() -> None:
    # A 1-D world mesh unflattened into (dp=4, tp=2): the dp slice's root is the world mesh.
    table = _table(8)
    assert counting_translate(frozenset({0, 2, 4, 6}), table, ("world",), frozenset())
    assert not counting_translate(frozenset({1, 3, 5, 7}), table, ("world",), frozenset())


def test_unknown_distinct_name_is_not_a_root_dim() -> None:
    table = _table(2, 2)
    assert not counting_translate(frozenset({1, 3}), table, ("dp", "tp"), frozenset({"pp"}))


def test_slice_covering_the_root_counts() -> None:
    assert counting_translate(frozenset({0, 1, 2, 3}), _table(2, 2), ("a", "b"), frozenset())


def test_ranks_outside_the_root_are_an_error() -> None:
    with pytest.raises(LayoutError, match=r"ranks \[9\]"):
        counting_translate(frozenset({0, 9}), _table(2, 2), ("dp", "tp"), frozenset())


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 3), min_size=1, max_size=3),
    data=st.data(),
)
def test_exactly_one_counting_translate_per_distinct_coordinate(
    sizes: list[int], data: st.DataObject
) -> None:
    """Summing over counting translates sees each (slice element, distinct coordinate) once."""
    ndim = len(sizes)
    names = tuple(f"d{i}" for i in range(ndim))
    table = _table(*sizes)
    inside = data.draw(st.sets(st.sampled_from(range(ndim)), min_size=1))
    outside = [d for d in range(ndim) if d not in inside]
    distinct = data.draw(st.sets(st.sampled_from(outside))) if outside else set()
    distinct_names = frozenset(names[d] for d in distinct)
    counted: dict[tuple[int, ...], int] = {}
    for fixed in itertools.product(*(range(sizes[d]) for d in outside)):
        index: list[object] = [slice(None)] * ndim
        for d, c in zip(outside, fixed, strict=True):
            index[d] = c
        own = frozenset(int(r) for r in table[tuple(index)].flatten().tolist())
        key = tuple(c for d, c in zip(outside, fixed, strict=True) if d in distinct)
        if counting_translate(own, table, names, distinct_names):
            counted[key] = counted.get(key, 0) + 1
    expected_keys = set(itertools.product(*(range(sizes[d]) for d in outside if d in distinct)))
    assert counted == dict.fromkeys(expected_keys, 1)
