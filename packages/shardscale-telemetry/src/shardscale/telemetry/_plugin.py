"""shardscale-telemetry's plugin: the ``shardscale_on_step`` observer feeding every session.

It writes nothing unless a session is enabled (see [Note: opt-in] in ``_session``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardscale.core import hookimpl
from shardscale.telemetry._session import dispatch

if TYPE_CHECKING:
    from shardscale.core import StepRecord

__all__ = ["shardscale_on_step"]


@hookimpl
def shardscale_on_step(record: StepRecord) -> None:
    """Hand the step to the open telemetry sessions (none: nothing happens)."""
    dispatch(record)
