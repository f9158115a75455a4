"""The one number a rank reads on the host after each step, instead of the W status slots.

ErrorBlocks reads the step's reason, computed on the vector's device by comparing the reduced
vector with what this rank expects (``StepScratch.probe``/``reason_into``): every status equal
to its own, or -1 when it failed itself. The W-slot block is read only when a rank failed or
ranks disagree (see [Note: errors that reach every rank]). Each rank's status packs its error
code with its chain and declarations fingerprints into one float64; the vectors here are
written slot by slot through VectorLayout, as W ranks' SUM would leave them, and each rank's
view of the same vector must give the same answer.
"""

from __future__ import annotations

import pytest
import torch

from shardscale.core.step import VectorLayout
from shardscale.core.step._arith import StepScratch, reason_into
from shardscale.core.step._errors import ERROR_KINDS, ErrorBlocks, fingerprint
from shardscale.core.step._vector import pack_status, unpack_status
from shardscale.core.step._verdict import SkipReason

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
        vec[layout.slot("status", r)] = pack_status(
            (codes or {}).get(r, 0),
            (chain or {}).get(r, 1234.0),
            (declarations or {}).get(r, 98765.0),
        )
    return vec


def _views(vec: torch.Tensor, codes: dict[int, int] | None = None) -> list[ErrorBlocks]:
    """Each rank's ErrorBlocks of the reduced ``vec`` (a rank with a code failed itself)."""
    layout = VectorLayout(WORLD)
    error = int(SkipReason.ERROR)
    views = []
    for rank in range(WORLD):
        own = -1.0 if (codes or {}).get(rank) else float(vec[layout.slot("status", rank)])
        found = StepScratch().probe(WORLD, own, (("status", error),), vec.device)
        reason = reason_into(vec, found, out=None)
        views.append(ErrorBlocks(vec, layout, reason, failed_at=error))
    return views


def _blocks(vec: torch.Tensor) -> ErrorBlocks:
    return _views(vec)[0]


@pytest.mark.parametrize(
    ("kwargs", "want"),
    [
        ({}, False),
        ({"codes": {2: 3}}, True),
        ({"codes": {0: 1, 4: 9}}, True),
        ({"codes": dict.fromkeys(range(WORLD), 2)}, True),  # every rank failed alike
        ({"chain": {3: 4321.0}}, True),
        ({"declarations": {0: 1.0}}, True),
        ({"declarations": {0: 98766.0}}, True),  # one unit apart: exact in float64
        ({"codes": {1: 8}, "chain": {1: 7.0}, "declarations": {4: 2.0}}, True),
    ],
)
def test_the_flag_says_whether_a_rank_failed_or_ranks_disagree(
    kwargs: dict[str, dict[int, float]], want: bool
) -> None:
    for errors in _views(_reduced(**kwargs), kwargs.get("codes")):  # type: ignore[arg-type]
        assert errors.read_failed(wait=False) is want
        assert errors.read_failed(wait=True) is want
        assert not errors.on_device and errors.arrived()


def test_blocks_are_decoded_by_name_on_the_failure_path() -> None:
    errors = _blocks(_reduced(codes={3: 6}, chain={1: 55.0}))
    blocks = errors.read(wait=True)
    assert blocks is not None
    assert blocks["error"] == [0.0, 0.0, 0.0, 6.0, 0.0]
    assert blocks["chain"] == [1234.0, 55.0, 1234.0, 1234.0, 1234.0]
    assert blocks["declarations"] == [98765.0] * WORLD


def test_status_holds_the_largest_code_and_fingerprints_exactly() -> None:
    # The extremes: the last code an error can get, and 24-bit fingerprints at their maximum.
    top = len(ERROR_KINDS) + 1
    for code, chain, decl in [(top, 2.0**24 - 1, 2.0**24 - 1), (0, 0.0, 0.0), (1, 0.0, 1.0)]:
        packed = pack_status(code, chain, decl)
        assert packed == float(int(packed)) and packed < 2.0**53  # an exact float64 integer
        assert unpack_status(packed) == (code, chain, decl)
    # Fingerprints of real text fit their 24 bits.
    assert unpack_status(pack_status(2, fingerprint("counting+c10d"), fingerprint("x")))[1:] == (
        fingerprint("counting+c10d"),
        fingerprint("x"),
    )
    with pytest.raises(ValueError, match="status out of range"):
        pack_status(16, 0.0, 0.0)
