"""The three flags a rank reads on the host after each step, instead of the 3·W error slots.

ErrorBlocks computes them on the vector's device; the W-slot blocks are read only when one is
set (see [Note: errors that reach every rank]). The vectors here are written slot by slot
through VectorLayout, as W ranks' SUM would leave them.
"""

from __future__ import annotations

import pytest
import torch

from shardscale.core import VectorLayout
from shardscale.core._step_errors import ErrorBlocks

WORLD = 5


def _reduced(
    *,
    codes: dict[int, int] | None = None,
    chain: dict[int, float] | None = None,
    declarations: dict[int, float] | None = None,
) -> torch.Tensor:
    layout = VectorLayout(WORLD)
    vec = torch.zeros(layout.size, dtype=torch.float64)
    for r in range(WORLD):
        vec[layout.slot("chain", r)] = (chain or {}).get(r, 1234.0)
        vec[layout.slot("declarations", r)] = (declarations or {}).get(r, 98765.0)
        vec[layout.slot("error", r)] = (codes or {}).get(r, 0)
    return vec


@pytest.mark.parametrize(
    ("kwargs", "want"),
    [
        ({}, (0, False, False)),
        ({"codes": {2: 3}}, (1, False, False)),
        ({"codes": {0: 1, 4: 9}}, (2, False, False)),
        ({"chain": {3: 4321.0}}, (0, True, False)),
        ({"declarations": {0: 1.0}}, (0, False, True)),
        ({"codes": {1: 8}, "chain": {1: 7.0}, "declarations": {4: 2.0}}, (1, True, True)),
    ],
)
def test_flags_say_what_the_blocks_hold(
    kwargs: dict[str, dict[int, float]], want: tuple[int, bool, bool]
) -> None:
    errors = ErrorBlocks(_reduced(**kwargs), VectorLayout(WORLD))
    assert errors.read_flags(wait=False) == want
    assert errors.read_flags(wait=True) == want
    assert not errors.on_device and errors.arrived()


def test_blocks_are_read_by_name_on_the_failure_path() -> None:
    errors = ErrorBlocks(_reduced(codes={3: 6}, chain={1: 55.0}), VectorLayout(WORLD))
    blocks = errors.read(wait=True)
    assert blocks is not None
    assert blocks["error"] == [0.0, 0.0, 0.0, 6.0, 0.0]
    assert blocks["chain"] == [1234.0, 55.0, 1234.0, 1234.0, 1234.0]
    assert blocks["declarations"] == [98765.0] * WORLD
