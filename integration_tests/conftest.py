"""Shared fixtures of the multi-process integration tests.

``pool2`` and ``pool4`` are module-scoped: a test module pays for starting its
process group once and runs every case in it (see ``mp_harness``).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from mp_harness import Pool


@pytest.fixture(scope="module")
def pool2() -> Iterator[Pool]:
    """A gloo process group of 2 ranks, started once per test module."""
    pool = Pool(2)
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture(scope="module")
def pool4() -> Iterator[Pool]:
    """A gloo process group of 4 ranks, started once per test module."""
    pool = Pool(4)
    try:
        yield pool
    finally:
        pool.close()
