"""shardscale-schedules is found through its ``shardscale`` entry point: listed, with no hook."""

from __future__ import annotations

import json
import subprocess
import sys


def test_listed_by_the_registry_with_no_hook() -> None:
    # A fresh interpreter: the registry reads the installed entry points, as `shardscale plugins`.
    code = (
        "import json\n"
        "from shardscale.core import get_registry\n"
        "info = [p for p in get_registry().plugins() if p.name == 'schedules']\n"
        "print(json.dumps({'info': [[i.distribution, list(i.hooks)] for i in info],"
        " 'failures': [f.name for f in get_registry().failures()]}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["info"] == [["shardscale-schedules", []]]
    assert "schedules" not in result["failures"]
