"""Test-only shardscale plugin (shardscale-bad-interrupt): raises KeyboardInterrupt when imported with SHARDSCALE_TEST_INTERRUPT=1."""

from __future__ import annotations

import os

if os.environ.get("SHARDSCALE_TEST_INTERRUPT") == "1":
    raise KeyboardInterrupt  # stands in for the user's Ctrl-C during loading
