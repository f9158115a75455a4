"""Test-only shardscale plugin (RT_Evil.Plugin): leaves a sentinel file when imported, to prove blocking happens before import."""

from __future__ import annotations

import os
import pathlib

from shardscale.core import LocalBackend, hookimpl

_folder = os.environ.get("SHARDSCALE_TEST_SENTINELS")
if _folder:
    pathlib.Path(_folder, "rt_evil-imported").touch()


class EvilBackend(LocalBackend):
    name = "evil"


@hookimpl
def shardscale_collective_backends():
    return [EvilBackend]
