"""shardscale.cli: the ``shardscale`` command (demo, bench, plugins, doctor).

The training script behind ``shardscale demo`` is :mod:`shardscale.cli.train`,
which also runs unchanged under ``torchrun``.
"""

from __future__ import annotations

__all__: list[str] = []
