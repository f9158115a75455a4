"""Every distribution ships its licence and says where it lives, what it is and what torch it needs.

Reads the metadata of the installed distributions (what a wheel's ``METADATA``
and ``licenses/`` hold), which is cheaper than building five wheels.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
from pathlib import Path

import pytest

from shardscale.cli._floors import TORCH_FLOOR, TRITON_FLOOR, TRITON_PINS, below

REPO = Path(__file__).resolve().parents[3]
DISTS = ["shardscale-core", "shardscale-collectives", "shardscale-clip", "shardscale-fsdp",
         "shardscale-telemetry", "shardscale-schedules", "shardscale"]  # fmt: skip
# Not dependencies of shardscale: checked where installed (the tests session; shardscale-verl
# in the verl session, shardscale-rlinf in the rlinf session), skipped alone.
INTEGRATIONS = ["shardscale-lightning", "shardscale-accelerate", "shardscale-transformers",
                "shardscale-torchtitan", "shardscale-verl", "shardscale-rlinf"]  # fmt: skip


def _installed(dist: str) -> str:
    try:
        md.version(dist)
    except md.PackageNotFoundError:
        pytest.skip(f"{dist} is not installed here")
    return dist


COPYRIGHT = "Copyright (c) 2026, the shardscale authors"
CLASSIFIERS = {
    "Development Status :: 3 - Alpha",
    "License :: OSI Approved :: BSD License",
    "Operating System :: OS Independent",
    "Programming Language :: Python :: 3.11",
    "Topic :: Scientific/Engineering :: Artificial Intelligence",
    "Typing :: Typed",
}
URL_LABELS = {"Homepage", "Documentation", "Repository", "Issues"}


def _noxfile_torch_versions() -> list[str]:
    tree = ast.parse((REPO / "noxfile.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "TORCH_VERSIONS" for t in node.targets
        ):
            return [str(v) for v in ast.literal_eval(node.value)]
    raise AssertionError("noxfile.py has no TORCH_VERSIONS")


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("."))


@pytest.mark.parametrize("dist", DISTS + INTEGRATIONS)
def test_distribution_ships_the_bsd_licence(dist: str) -> None:
    _installed(dist)
    meta = md.metadata(dist)
    assert meta["License-Expression"] == "BSD-3-Clause"
    assert meta.get_all("License-File") == ["LICENSE"]
    files = [str(f) for f in md.distribution(dist).files or []]
    assert any(f.endswith("licenses/LICENSE") for f in files), files
    text = md.distribution(dist).read_text("licenses/LICENSE") or ""
    assert COPYRIGHT in text and "Redistribution and use in source and binary forms" in text
    # The wheel's copy is the one in the distribution's directory.
    assert (REPO / "packages" / dist / "LICENSE").read_text(encoding="utf-8") == text


@pytest.mark.parametrize("dist", DISTS + INTEGRATIONS)
def test_distribution_declares_urls_and_classifiers(dist: str) -> None:
    _installed(dist)
    meta = md.metadata(dist)
    urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL") or [])
    assert set(urls) == URL_LABELS
    assert all(u.startswith("https://github.com/shardscale/shardscale") for u in urls.values())
    assert set(meta.get_all("Classifier") or []) >= CLASSIFIERS


def _floor(dist: str, name: str) -> str:
    """The version in ``dist``'s one ``name>=X`` requirement (its only bound)."""
    reqs = [r for r in md.requires(dist) or [] if re.match(rf"{name}\b", r)]
    assert len(reqs) == 1, reqs
    floor = re.fullmatch(rf"{name}\s*>=\s*([\d.]+)", reqs[0].split(";")[0].strip())
    assert floor, reqs
    return floor.group(1)


@pytest.mark.parametrize("dist", [*DISTS, *INTEGRATIONS, "shardscale-triton"])
def test_torch_floor_is_the_oldest_tested_torch(dist: str) -> None:
    _installed(dist)
    floor = _floor(dist, "torch")
    # One floor, stated in _floors.py, which doctor and tools/gpu_check.py judge by.
    assert floor == TORCH_FLOOR
    tested = _noxfile_torch_versions()
    # The declared floor is a version the test matrix runs, and nothing older is claimed.
    oldest = min(tested, key=_version_key)
    assert _version_key(floor) == _version_key(oldest)[: len(floor.split("."))]


def test_triton_floor_is_the_oldest_triton_a_supported_torch_pins() -> None:
    _installed("shardscale-triton")
    pinned = sorted(TRITON_PINS.values(), key=_version_key)
    floor = _floor("shardscale-triton", "triton")
    assert floor == TRITON_FLOOR
    # Installs beside the oldest torch's Triton, so beside every newer torch's as well.
    assert _version_key(pinned[0])[: len(floor.split("."))] == _version_key(floor)
    # Every torch of the matrix has its Triton stated (nox -s resolve checks it against pip).
    minors = {".".join(v.split(".")[:2]) for v in _noxfile_torch_versions()}
    assert minors <= set(TRITON_PINS), minors - set(TRITON_PINS)


@pytest.mark.parametrize(
    ("version", "floor", "older"),
    [
        ("2.10.1", "2.11", True),
        ("2.11.0+cu130", "2.11", False),
        ("2.11.0a0+git1234", "2.11", False),  # a source build of the floor counts as the floor
        ("2.9.0", "2.11", True),
        ("2.15.0", "2.11", False),
        ("3.5.1", "3.6", True),
        ("3.6.0", "3.6", False),
        ("2.27.7", "2.28.9", True),
        ("2.28.9", "2.28.9", False),
    ],
)
def test_below_compares_on_the_floors_precision(version: str, floor: str, older: bool) -> None:
    assert below(version, floor) is older
