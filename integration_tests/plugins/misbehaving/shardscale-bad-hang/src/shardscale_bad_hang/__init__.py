"""Test-only shardscale plugin (shardscale-bad-hang): with SHARDSCALE_TEST_HANG=1 its import never returns."""

from __future__ import annotations

import os
import threading

if os.environ.get("SHARDSCALE_TEST_HANG") == "1":
    # Stands in for an import that waits on a lock, a server or input that never comes.
    print("shardscale_bad_hang: waiting for the license server")
    threading.Event().wait()
