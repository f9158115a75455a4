"""``{rank}`` in an observer's path: each writing rank gets its own file or folder."""

from __future__ import annotations

import os
from pathlib import Path

from shardscale.telemetry._errors import TelemetryConfigError

__all__ = ["check_path_template", "rank_path"]


def check_path_template(path: str | os.PathLike[str], *, what: str) -> str:
    """Validate a path that may hold ``{rank}``; returns it as a string (no file is touched)."""
    if not isinstance(path, str | os.PathLike):
        raise TelemetryConfigError(
            f"{what} takes a path (str or pathlib.Path), got {type(path).__name__} {path!r}"
        )
    text = os.fspath(path)
    if not text.strip():
        raise TelemetryConfigError(f"{what} got an empty path; pass e.g. 'runs/steps.jsonl'")
    try:
        text.format(rank=0)
    except (KeyError, IndexError, ValueError) as exc:
        raise TelemetryConfigError(
            f"{what} path {text!r} may contain only the placeholder {{rank}} (double other "
            f"braces: {{{{ and }}}}); it has {exc!r}"
        ) from None
    return text


def rank_path(template: str, rank: int) -> Path:
    """The path ``rank`` writes to: ``{rank}`` replaced, ``~`` expanded."""
    return Path(template.format(rank=rank)).expanduser()
