"""``python -m shardscale.cli`` and the ``shardscale`` console script."""

from __future__ import annotations

import sys

from shardscale.cli._app import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
