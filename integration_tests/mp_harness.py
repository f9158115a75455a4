"""A pool of worker processes that share one process group and run many test cases in it.

[Note: why a pool]
Starting a process group costs seconds (spawning interpreters, importing torch,
rendezvous). A test module starts one :class:`Pool` (the ``pool2``/``pool4``
fixtures in ``conftest.py``) and runs each case in it with :meth:`Pool.run`, so
the price is paid once per module instead of once per test.

[Note: failure handling]
Every case has a deadline. A rank that does not answer by then makes the run
raise :class:`CaseTimeout`; a rank that raises (or dies) makes it raise
:class:`RankFailure` carrying each failing rank's traceback. In both cases the
workers are killed and a fresh group is started by the next ``run()``: ranks
that disagree about which collectives happened cannot be trusted again, and one
bad case must not poison the rest of the module. Workers also carry a
process-group timeout, so a collective never blocks forever, and they die with
the parent process.

Case functions are found by *file path* and qualified name, so they may live in
a test module imported by pytest's ``--import-mode=importlib``.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import importlib.util
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["CaseTimeout", "Pool", "RankFailure"]

#: How long the workers may take to spawn, import torch and rendezvous.
_START_TIMEOUT = 180.0
#: A collective waits at most this long for its peers before it raises.
_PG_TIMEOUT = datetime.timedelta(seconds=60)
#: After one rank fails, how long the others get to report before the pool is torn down.
_FAILURE_GRACE = 3.0
#: How long close() waits for a clean exit before killing.
_CLOSE_GRACE = 10.0


class CaseTimeout(AssertionError):
    """A rank did not answer in time; the pool was torn down and restarts at the next run."""


class RankFailure(AssertionError):
    """One or more ranks raised (or died); the message holds each failing rank's traceback."""


# -- worker side --------------------------------------------------------------------------------


def _die_with_parent() -> None:
    """Make this worker exit when the process that spawned it exits, however it exits."""
    if sys.platform.startswith("linux"):
        # The kernel kills us when the parent dies, even by SIGKILL.
        with contextlib.suppress(Exception):
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            pr_set_pdeathsig = 1
            libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()  # returns once the parent's sentinel closes
        os._exit(3)

    threading.Thread(target=watch, name="mp-harness-parent-watch", daemon=True).start()


def _load_case(path: str, module_name: str, qualname: str, cache: dict[str, Any]) -> Any:
    """Import the module at ``path`` once (under its parent-side name) and find ``qualname``."""
    module = cache.get(path)
    if module is None:
        existing = sys.modules.get(module_name)
        if (
            existing is not None
            and os.path.realpath(getattr(existing, "__file__", "") or "") == path
        ):
            module = existing
        else:
            # Registered under the parent's name so pickled objects of its classes round-trip.
            name = module_name if module_name not in sys.modules else f"_mp_case_{len(cache)}"
            spec = importlib.util.spec_from_file_location(name, path)
            if spec is None or spec.loader is None:
                raise ImportError(f"cannot load a module from {path}")
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[name]
                raise
        cache[path] = module
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _worker_main(
    rank: int,
    world_size: int,
    backend: str,
    store_path: str,
    stacks_path: str,
    conn: mp_connection.Connection,
) -> None:
    _die_with_parent()
    os.environ["OMP_NUM_THREADS"] = "1"
    stacks = open(stacks_path, "w")  # noqa: SIM115 - kept open for faulthandler until exit
    # The parent sends SIGUSR1 before killing a stuck rank: the dump says where it was stuck.
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    store = dist.FileStore(store_path, world_size)  # type: ignore[attr-defined]
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=_PG_TIMEOUT
    )
    conn.send(("ready", rank))
    cache: dict[str, Any] = {}
    while True:
        try:
            message = conn.recv()
        except EOFError:
            break
        if message[0] == "close":
            break
        _, case_id, path, module_name, qualname, payload = message
        saved_env = dict(os.environ)
        try:
            fn = _load_case(path, module_name, qualname, cache)
            args, kwargs = pickle.loads(payload)
            result = pickle.dumps(fn(*args, **kwargs))
            reply: tuple[Any, ...] = (case_id, "ok", result)
        except BaseException:
            reply = (case_id, "error", traceback.format_exc())
        finally:
            # A case that sets an environment variable must not leak it into the next one.
            os.environ.clear()
            os.environ.update(saved_env)
        conn.send(reply)
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    conn.close()
    stacks.close()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown (seconds with torch loaded): nothing is left to flush.
    os._exit(0)


# -- parent side --------------------------------------------------------------------------------


class _Workers:
    """One generation of worker processes and their process group."""

    def __init__(self, world_size: int, backend: str) -> None:
        ctx = mp.get_context("spawn")
        self.tmpdir = tempfile.mkdtemp(prefix="shardscale-mp-")
        self.ready = False
        self.procs: list[Any] = []
        self.conns: list[mp_connection.Connection] = []
        store_path = os.path.join(self.tmpdir, "store")
        # Children inherit the environment at spawn: set it for them, restore it for us.
        env_before = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME")}
        os.environ["OMP_NUM_THREADS"] = "1"  # torch's thread pools start small
        if sys.platform.startswith("linux") and env_before["GLOO_SOCKET_IFNAME"] is None:
            os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback: no hostname resolution needed
        try:
            for rank in range(world_size):
                parent_end, child_end = ctx.Pipe(duplex=True)
                proc = ctx.Process(
                    target=_worker_main,
                    args=(rank, world_size, backend, store_path, self.stacks_path(rank), child_end),
                    name=f"mp-harness-rank{rank}",
                    daemon=True,
                )
                proc.start()
                child_end.close()
                self.procs.append(proc)
                self.conns.append(parent_end)
        except BaseException:
            self.kill()
            raise
        finally:
            for key, value in env_before.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        self._finalizer = weakref.finalize(self, _kill_all, list(self.procs), self.tmpdir)

    def stacks_path(self, rank: int) -> str:
        return os.path.join(self.tmpdir, f"stacks-rank{rank}.txt")

    def stack_dumps(self, ranks: list[int]) -> str:
        """Ask stuck ranks where they are (SIGUSR1 -> faulthandler) and collect the dumps."""
        for rank in ranks:
            with contextlib.suppress(Exception):
                if self.procs[rank].is_alive() and self.procs[rank].pid is not None:
                    os.kill(self.procs[rank].pid, signal.SIGUSR1)
        time.sleep(0.5)
        parts = []
        for rank in ranks:
            with contextlib.suppress(OSError):
                text = Path(self.stacks_path(rank)).read_text()
                if text.strip():
                    parts.append(f"--- rank {rank} stacks ---\n{text[-4000:]}")
        return "\n".join(parts)

    def kill(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(Exception):
                proc.kill()
        for proc in self.procs:
            with contextlib.suppress(Exception):
                proc.join(timeout=5)
        for conn in self.conns:
            with contextlib.suppress(Exception):
                conn.close()
        shutil.rmtree(self.tmpdir, ignore_errors=True)

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(Exception):
                conn.send(("close",))
        deadline = time.monotonic() + _CLOSE_GRACE
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        self.kill()


def _kill_all(procs: list[Any], tmpdir: str) -> None:
    for proc in procs:
        with contextlib.suppress(Exception):
            if proc.is_alive():
                proc.kill()
    shutil.rmtree(tmpdir, ignore_errors=True)


def _describe(fn: Callable[..., Any]) -> tuple[str, str, str]:
    qualname = getattr(fn, "__qualname__", None)
    module_name = getattr(fn, "__module__", None)
    code = getattr(fn, "__code__", None)
    if not callable(fn) or qualname is None or module_name is None or code is None:
        raise TypeError(
            f"Pool.run() takes a module-level Python function, got {fn!r}; define the case "
            "with 'def' at the top level of the test module."
        )
    if "<locals>" in qualname or "<lambda>" in qualname:
        raise TypeError(
            f"Pool.run() cannot send {qualname!r} to the workers: they find cases by module "
            "file and name. Move the function to the top level of its module."
        )
    return os.path.realpath(code.co_filename), module_name, qualname


class Pool:
    """``world_size`` worker processes in one initialized default process group.

    Args:
        world_size: number of ranks.
        backend: the process-group backend (``"gloo"`` on CPU, ``"nccl"`` on GPUs).
        case_timeout: default seconds a case may take before :class:`CaseTimeout`.
    """

    def __init__(
        self, world_size: int, *, backend: str = "gloo", case_timeout: float = 120.0
    ) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        if not case_timeout > 0:
            raise ValueError(f"case_timeout must be > 0 seconds, got {case_timeout!r}")
        self.world_size = world_size
        self.backend = backend
        self.case_timeout = float(case_timeout)
        self._case_counter = 0
        self._closed = False
        # Spawn now, wait for readiness at the first run(): startup overlaps the caller's work.
        self._workers: _Workers | None = _Workers(world_size, backend)

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(
        self, fn: Callable[..., Any], /, *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> list[object]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        Raises :class:`RankFailure` if any rank raised or died and
        :class:`CaseTimeout` if a rank did not answer within ``timeout``
        (default: the pool's ``case_timeout``) seconds.
        """
        if self._closed:
            raise RuntimeError("this Pool is closed; create a new one")
        path, module_name, qualname = _describe(fn)
        payload = pickle.dumps((args, kwargs))
        limit = self.case_timeout if timeout is None else float(timeout)
        workers = self._ensure_started()
        self._case_counter += 1
        case_id = self._case_counter
        message = ("run", case_id, path, module_name, qualname, payload)
        try:
            for conn in workers.conns:
                conn.send(message)
            return self._collect(workers, case_id, qualname, limit)
        except (CaseTimeout, RankFailure):
            raise  # the pool was already torn down
        except BaseException:
            # Interrupted (Ctrl-C, pytest-timeout) or a broken pipe: ranks may be mid-case.
            self._teardown()
            raise

    def close(self) -> None:
        """Stop the workers (cleanly if they answer, killed otherwise)."""
        self._closed = True
        if self._workers is not None:
            workers, self._workers = self._workers, None
            workers.close()

    # -- internals -----------------------------------------------------------------------------

    def _ensure_started(self) -> _Workers:
        try:
            return self._start_once()
        except RankFailure as first:
            # One retry: a worker killed by the machine at start says nothing about the code.
            try:
                return self._start_once()
            except RankFailure as second:
                raise RankFailure(f"{second} (first attempt: {first})") from None

    def _start_once(self) -> _Workers:
        workers = self._workers
        if workers is not None and workers.ready and not all(p.is_alive() for p in workers.procs):
            self._teardown()  # a worker died between cases (e.g. killed by the OS): start afresh
            workers = None
        if workers is None:
            workers = self._workers = _Workers(self.world_size, self.backend)
        if workers.ready:
            return workers
        deadline = time.monotonic() + _START_TIMEOUT
        waiting = set(range(self.world_size))
        while waiting:
            remaining = deadline - time.monotonic()
            dead = [r for r in waiting if not workers.procs[r].is_alive()]
            if dead or remaining <= 0:
                self._teardown()
                what = (
                    f"rank(s) {sorted(dead)} exited (codes "
                    f"{[workers.procs[r].exitcode for r in dead]})"
                    if dead
                    else f"rank(s) {sorted(waiting)} did not start within {_START_TIMEOUT:.0f}s"
                )
                raise RankFailure(
                    f"could not start a {self.backend} process group of {self.world_size} "
                    f"ranks: {what}. See the captured stderr for the worker's error."
                )
            ready = mp_connection.wait(
                [workers.conns[r] for r in waiting] + [workers.procs[r].sentinel for r in waiting],
                timeout=min(remaining, 1.0),
            )
            for rank in list(waiting):
                if workers.conns[rank] in ready:
                    try:
                        tag, _ = workers.conns[rank].recv()
                    except EOFError:
                        continue  # its death is reported by the sentinel check above
                    if tag == "ready":
                        waiting.discard(rank)
        workers.ready = True
        return workers

    def _teardown(self) -> None:
        if self._workers is not None:
            workers, self._workers = self._workers, None
            workers.kill()

    def _collect(
        self, workers: _Workers, case_id: int, qualname: str, limit: float
    ) -> list[object]:
        deadline = time.monotonic() + limit
        results: dict[int, object] = {}
        errors: dict[int, str] = {}
        pending = set(range(self.world_size))
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            ready = mp_connection.wait(
                [workers.conns[r] for r in pending] + [workers.procs[r].sentinel for r in pending],
                timeout=remaining,
            )
            for rank in sorted(pending):
                conn, proc = workers.conns[rank], workers.procs[rank]
                if conn in ready or conn.poll():
                    try:
                        reply_id, status, body = conn.recv()
                    except (EOFError, OSError):
                        errors[rank] = f"rank {rank} died (exit code {proc.exitcode})"
                        pending.discard(rank)
                        continue
                    if reply_id != case_id:
                        continue  # a stale answer from an earlier generation cannot happen; be safe
                    pending.discard(rank)
                    if status == "ok":
                        try:
                            results[rank] = pickle.loads(body)
                        except Exception:
                            errors[rank] = (
                                "could not unpickle the result:\n" + traceback.format_exc()
                            )
                    else:
                        errors[rank] = body
                elif proc.sentinel in ready:
                    proc.join(timeout=1)
                    errors[rank] = f"rank {rank} died (exit code {proc.exitcode})"
                    pending.discard(rank)
            if errors and pending:
                # The others are probably blocked in a collective the failed rank never joined.
                deadline = min(deadline, time.monotonic() + _FAILURE_GRACE)
        if not pending and not errors:
            return [results[r] for r in range(self.world_size)]
        stacks = workers.stack_dumps(sorted(pending)) if pending else ""
        self._teardown()
        lines = []
        for rank in sorted(errors):
            lines.append(f"--- rank {rank} failed ---\n{errors[rank].rstrip()}")
        if pending:
            lines.append(f"rank(s) {sorted(pending)} did not answer")
        if stacks:
            lines.append(stacks)
        detail = "\n".join(lines)
        if errors:
            raise RankFailure(
                f"case {qualname} failed on rank(s) {sorted(errors)} of {self.world_size} "
                f"(the pool restarts at the next run):\n{detail}"
            )
        raise CaseTimeout(
            f"case {qualname} did not finish within {limit:g}s on rank(s) {sorted(pending)} "
            f"of {self.world_size} (the pool was torn down and restarts at the next run):\n{detail}"
        )
