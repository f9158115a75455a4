"""Read a W&B offline run's history back from its transaction log, with W&B's own protobufs.

An offline run keeps every record it would upload in ``run-<id>.wandb``: a
7-byte header (``:W&B``, a magic number, a version) followed by LevelDB-log
framed records (32 KiB blocks; each piece has a 7-byte header: crc32, length,
type FULL/FIRST/MIDDLE/LAST), each record a
``wandb.proto.wandb_internal_pb2.Record``. wandb ships no Python reader for it
any more (its core is in Go), so the tests read the framing here.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any

__all__ = ["history", "records"]

_BLOCK = 32 * 1024
_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def records(path: Path) -> list[bytes]:
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    out, pos, partial = [], _HEADER, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # the block's tail is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        body = data[pos + _HEADER : pos + _HEADER + length]
        pos += _HEADER + length
        if kind == 0 and length == 0:
            continue
        if kind == _FULL:
            out.append(body)
        elif kind == _FIRST:
            partial = body
        elif kind == _MIDDLE:
            partial += body
        elif kind == _LAST:
            out.append(partial + body)
    return out


def _parsed(log: Path) -> list[Any]:
    from wandb.proto import wandb_internal_pb2 as pb

    out = []
    for raw in records(log):
        record = pb.Record()
        record.ParseFromString(raw)
        out.append(record)
    return out


def history(run_dir: Path, *, timeout: float = 60.0) -> list[dict[str, Any]]:
    """The run's history rows, read once W&B's writer has logged the run's end.

    ``run.finish()`` returns when W&B's service has the run's records, which its
    own process writes out to the file on its schedule: wait (up to ``timeout``
    seconds) for the ``exit`` record, which comes after every history record.
    """
    (log,) = run_dir.glob("run-*.wandb")
    deadline = time.monotonic() + timeout
    parsed = _parsed(log)
    while not any(r.WhichOneof("record_type") == "exit" for r in parsed):
        if time.monotonic() > deadline:
            break  # read what is there: the assertions on it say what is missing
        time.sleep(0.2)
        parsed = _parsed(log)
    rows = []
    for record in parsed:
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {
                    "/".join(item.nested_key) or item.key: json.loads(item.value_json)
                    for item in record.history.item
                }
            )
    return rows
