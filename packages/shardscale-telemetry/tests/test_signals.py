"""SIGTERM and SIGHUP write every buffered row, then end the process exactly as they would have.

Real processes: each trains 7 steps with ``every=5`` (so 2 rows are buffered),
says READY and blocks reading stdin; the test sends the signal. torchrun ends
surviving ranks this way, and neither signal runs ``atexit``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardscale import telemetry

STEPS, EVERY = 7, 5
_CHILD = r"""
import os, signal, sys
sys.path.insert(0, sys.argv[1])
path, mode, signum, steps, every = sys.argv[2], sys.argv[3], *map(int, sys.argv[4:7])
if mode == "yours":
    def yours(got, frame):
        # What the handler sees when it runs: the rows are on disk already. os._exit skips
        # atexit, so every row in the file was written by the signal's flush.
        with open(path, encoding="utf-8") as f:
            rows = len(f.readlines())
        print(f"YOURS signal={got} rows={rows}", flush=True)
        os._exit(3)
    signal.signal(signum, yours)
elif mode == "ignored":
    signal.signal(signum, signal.SIG_IGN)  # nohup's SIGHUP
from shardscale import telemetry
if mode in ("default", "stuck"):
    os.environ[telemetry.ENV] = f"jsonl:{path},every={every}"  # as a launcher sets it
else:
    telemetry.enable(telemetry.JsonlObserver(path), flush_every=every)
from conftest import train
train(steps, poison=frozenset({5}))
print("IGNORED_KEPT" if signal.getsignal(signum) == signal.SIG_IGN else "READY", flush=True)
if mode == "stuck":
    # A survivor waiting for a dead peer: one C++ call that ignores signals until it times out.
    from datetime import timedelta
    import torch.distributed as dist
    dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=300)).wait(["never"])
sys.stdin.readline()
print("ALIVE", flush=True)
"""

_SIGNALS = [signal.SIGTERM, signal.SIGHUP]
#: Seconds from each signal to the process's end, filled by the fixture.
ELAPSED: dict[tuple[int, str], float] = {}
# Each is a process that imports torch: the default action for both signals, and one each
# for a handler of yours (chained) and an ignored SIGHUP (left alone).
_CASES = [
    (signal.SIGTERM, "default"),
    (signal.SIGHUP, "default"),
    (signal.SIGTERM, "yours"),
    (signal.SIGHUP, "ignored"),
    (signal.SIGTERM, "stuck"),
]


@pytest.fixture(scope="module")
def ended(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, str], tuple[int, str, Path]]:
    """Every case at once (they are independent processes): (exit status, output, file)."""
    folder = tmp_path_factory.mktemp("signals")
    env = {k: v for k, v in os.environ.items() if k not in (telemetry.ENV, "RANK", "WORLD_SIZE")}
    procs = {}
    for sig, mode in _CASES:
        path = folder / f"{sig.name}-{mode}.jsonl"
        argv = [sys.executable, "-c", _CHILD, str(Path(__file__).parent), str(path), mode,
                str(int(sig)), str(STEPS), str(EVERY)]  # fmt: skip
        procs[(sig, mode)] = (
            subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True),
            path,
        )  # fmt: skip
    out: dict[tuple[int, str], tuple[int, str, Path]] = {}
    took: dict[tuple[int, str], float] = {}
    try:
        for key, (proc, path) in procs.items():
            assert proc.stdout is not None and proc.stdin is not None
            seen = []
            for line in proc.stdout:  # until the child is blocked on stdin
                seen.append(line)
                if line.startswith(("READY", "IGNORED_KEPT")):
                    break
            proc.send_signal(key[0])
            sent = time.monotonic()
            with contextlib.suppress(BrokenPipeError):  # it may have ended already
                proc.stdin.write("go\n")
                proc.stdin.flush()
            rest, _ = proc.communicate(timeout=120)
            out[key] = (proc.returncode, "".join(seen) + rest, path)
            took[key] = time.monotonic() - sent
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                proc.kill()
    ELAPSED.update(took)
    return out


def _steps(path: Path) -> list[int]:
    return [json.loads(x)["step"] for x in path.read_text(encoding="utf-8").splitlines()]


@pytest.mark.parametrize("sig", _SIGNALS, ids=lambda s: s.name)
def test_the_default_action_still_ends_the_process_by_the_signal_with_every_row(
    ended: dict[tuple[int, str], tuple[int, str, Path]], sig: signal.Signals
) -> None:
    status, output, path = ended[(sig, "default")]
    assert status == -sig, (status, output)  # killed by that very signal, as without telemetry
    assert "ALIVE" not in output
    assert _steps(path) == list(range(1, STEPS + 1)), output


def test_your_handler_still_runs_after_the_rows_are_written(
    ended: dict[tuple[int, str], tuple[int, str, Path]],
) -> None:
    sig = signal.SIGTERM
    status, output, path = ended[(sig, "yours")]
    assert status == 3, (status, output)  # your handler decided how the process ends
    assert f"YOURS signal={int(sig)} rows={STEPS}" in output, output
    assert _steps(path) == list(range(1, STEPS + 1))


def test_a_main_thread_stuck_in_c_still_ends_by_the_signal_with_every_row(
    ended: dict[tuple[int, str], tuple[int, str, Path]],
) -> None:
    # Python would run the handler only when the C call returns (300 s here): the watchdog
    # flushes and ends the process by SIGTERM itself, within its grace and flush limits.
    from shardscale.telemetry._signals import FLUSH_LIMIT_S, GRACE_S

    status, output, path = ended[(signal.SIGTERM, "stuck")]
    assert status == -signal.SIGTERM, (status, output)
    assert _steps(path) == list(range(1, STEPS + 1)), output
    # Grace and flush limit, plus room for a loaded machine; far below the C call's 300 s.
    assert ELAPSED[(signal.SIGTERM, "stuck")] < GRACE_S + FLUSH_LIMIT_S + 30


def test_an_ignored_signal_stays_ignored(
    ended: dict[tuple[int, str], tuple[int, str, Path]],
) -> None:
    status, output, path = ended[(signal.SIGHUP, "ignored")]
    assert status == 0 and "IGNORED_KEPT" in output and "ALIVE" in output, output
    assert _steps(path) == list(range(1, STEPS + 1))  # at exit, as always


def test_handlers_are_put_back_when_the_last_session_closes(tmp_path: Path) -> None:
    before = {s: signal.getsignal(s) for s in _SIGNALS}
    first = telemetry.enable(telemetry.JsonlObserver(tmp_path / "a.jsonl"))
    second = telemetry.enable(telemetry.JsonlObserver(tmp_path / "b.jsonl"))
    assert all(signal.getsignal(s) != before[s] for s in _SIGNALS)
    first.close()
    assert all(signal.getsignal(s) != before[s] for s in _SIGNALS)  # one session still open
    second.close()
    assert {s: signal.getsignal(s) for s in _SIGNALS} == before
