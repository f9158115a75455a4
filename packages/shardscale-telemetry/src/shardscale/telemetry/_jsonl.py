"""The JSONL observer: one line of strict JSON per step."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING

from shardscale.telemetry._paths import check_path_template, rank_path

if TYPE_CHECKING:
    from shardscale.telemetry._rows import StepRow

__all__ = ["JsonlObserver"]


class JsonlObserver:
    """Writes one JSON object per step to ``path`` (see :meth:`StepRow.to_json` for the keys).

    ``{rank}`` in ``path`` is replaced by the writing rank. The file is
    created (with its folders) when the first rows are written, replaced
    unless ``append=True``; each write ends with a flush, so a reader sees
    whole lines. Non-finite norms are written as ``null`` (strict JSON).
    """

    name = "jsonl"

    def __init__(self, path: str | os.PathLike[str], *, append: bool = False) -> None:
        self._template = check_path_template(path, what="JsonlObserver")
        self._append = bool(append)
        self._file: IO[str] | None = None
        self.path: Path | None = None

    def __repr__(self) -> str:
        return f"JsonlObserver({self._template!r})"

    @property
    def path_template(self) -> str:
        """The path as given, ``{rank}`` not yet replaced."""
        return self._template

    def open(self, rank: int) -> None:
        """Create the file for ``rank`` (and its folders)."""
        path = rank_path(self._template, rank)
        if path.is_dir():
            raise IsADirectoryError(
                f"the JSONL observer's path {path} is a folder; pass a file path"
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a" if self._append else "w", encoding="utf-8")  # noqa: SIM115
        self.path = path

    def write(self, rows: Sequence[StepRow]) -> None:
        """Append one line per row and flush the file."""
        if self._file is None:
            raise RuntimeError("JsonlObserver.write() before open(): a Telemetry session opens it")
        self._file.write("".join(json.dumps(r.to_json(), allow_nan=False) + "\n" for r in rows))
        self._file.flush()

    def close(self) -> None:
        """Close the file (a no-op if it was never opened)."""
        if self._file is not None:
            self._file.close()
            self._file = None
