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

REPO = Path(__file__).resolve().parents[3]
DISTS = ["shardscale-core", "shardscale-collectives", "shardscale-clip", "shardscale-fsdp",
         "shardscale-telemetry", "shardscale"]  # fmt: skip
# Not dependencies of shardscale: checked where installed (the tests session), skipped alone.
INTEGRATIONS = ["shardscale-lightning", "shardscale-accelerate", "shardscale-transformers",
                "shardscale-torchtitan"]  # fmt: skip


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


@pytest.mark.parametrize("dist", DISTS + INTEGRATIONS)
def test_torch_floor_is_the_oldest_tested_torch(dist: str) -> None:
    _installed(dist)
    torch_reqs = [r for r in md.requires(dist) or [] if re.match(r"torch\b", r)]
    assert len(torch_reqs) == 1, torch_reqs
    floor = re.fullmatch(r"torch\s*>=\s*([\d.]+)", torch_reqs[0].split(";")[0].strip())
    assert floor, torch_reqs
    tested = _noxfile_torch_versions()
    # The declared floor is a version the test matrix runs, and nothing older is claimed.
    oldest = min(tested, key=_version_key)
    assert _version_key(floor.group(1)) == _version_key(oldest)[: len(floor.group(1).split("."))]
