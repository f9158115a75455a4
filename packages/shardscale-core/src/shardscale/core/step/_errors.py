"""Errors that reach every rank: the step engine's cross-rank error protocol.

[Note: errors that reach every rank]
A rank that finds something wrong while collecting or checking (a layout no
adapter combines, a meta gradient, a bad option, a declaration that does not
fit) records it instead of raising: its peers are about to wait for it in the
step's all-reduce, so it must join. It writes an error *code* (the kind of
error, classified by exception type: :data:`ERROR_KINDS`) into its slot of the
vector's ``status`` block, packed with the fingerprints of its backend chain
and of its declarations (``pack_status``: one exact float64 per rank). After
the reduction every rank reads one flag on the host, computed from that block
on the device (a rank failed, or two ranks' status differ; on a GPU through a
pinned copy, never a host sync), and only when it is set the block itself
(``VectorLayout.HOST_READ``, W slots), decoded on the host into each rank's
code and fingerprints. Then, in this order of precedence:

1. a failing rank raises its own error, with a note that its peers were told;
2. ranks whose backend chains differ all raise (their collectives can
   mismatch and hang next time);
3. the other ranks raise :class:`StepError`, naming the failing ranks;
4. ranks whose declarations differ all raise :class:`DeclarationError`,
   naming which ranks agree with which (a wrong norm is never returned).

On a GPU the copy may not have arrived when the step returns: the result
stays in :data:`_pending` and is raised by the next step or ``update()``
(:func:`poll_errors`).
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from shardscale.core._errors import (
    BackendUnavailableError,
    DeclarationError,
    GradientDtypeError,
    LayoutError,
    PluginNotFoundError,
    ShardscaleError,
)
from shardscale.core.step._aliasing import AliasedGradientError
from shardscale.core.step._host_copy import HostCopy
from shardscale.core.step._vector import VectorLayout, unpack_status

if TYPE_CHECKING:
    from shardscale.core._protocols import CollectiveBackend

__all__ = [
    "ERROR_KINDS",
    "ErrorBlocks",
    "GradientDeviceError",
    "StepError",
    "chain_names",
    "error_code",
    "fingerprint",
    "poll_errors",
    "raise_pending_errors",
    "raise_step_errors",
    "verify_same_chain",
]


class StepError(ShardscaleError):
    """Another rank (or ranks) failed inside a step that every rank joined.

    Raised on the ranks that were fine; the failing ranks raise their own
    error, with a note saying the others were told. ``ranks`` lists the
    failing ranks of the reduction group, ``kinds`` what each had.
    """

    def __init__(self, message: str, *, ranks: tuple[int, ...], kinds: dict[int, str]) -> None:
        super().__init__(message)
        self.ranks = ranks
        self.kinds = kinds


class GradientDeviceError(ShardscaleError, ValueError):
    """A gradient on a device the step cannot read (meta, or not the scale's device)."""


#: Error code k (1-based) is the k-th entry: what peers can say about a failing rank.
#: Classified by type, most specific first; anything else is the last entry's code + 1.
ERROR_KINDS: tuple[tuple[type[BaseException] | tuple[type[BaseException], ...], str], ...] = (
    (LayoutError, "a gradient layout no installed adapter can combine (LayoutError)"),
    (
        GradientDeviceError,
        "a gradient on a device this step cannot read (meta, another accelerator)",
    ),
    (GradientDtypeError, "a gradient that is not real floating point"),
    (PluginNotFoundError, "a parameter no installed adapter claims, or unknown kernels"),
    (BackendUnavailableError, "kernels that cannot run on its device"),
    (DeclarationError, "a distinct_dims/distinct_params declaration that does not fit"),
    (AliasedGradientError, "parameters that share one gradient tensor"),
    ((TypeError, ValueError), "bad arguments to the step (see that rank's error)"),
)
_UNEXPECTED = "an unexpected error while reading gradients"
# Codes are packed into 4 bits of a rank's status slot (VectorLayout's pack_status).
assert len(ERROR_KINDS) + 1 < 16


def error_code(exc: BaseException) -> int:
    """The code a rank writes for ``exc`` (1-based; never 0, which means "no error")."""
    for code, (kind, _) in enumerate(ERROR_KINDS, start=1):
        if isinstance(exc, kind):
            return code
    return len(ERROR_KINDS) + 1


def _kind_text(code: int) -> str:
    return ERROR_KINDS[code - 1][1] if 1 <= code <= len(ERROR_KINDS) else _UNEXPECTED


def fingerprint(text: str) -> float:
    """A 24-bit CRC of ``text``: exact in float32 and float64, so it survives a SUM."""
    return float(zlib.crc32(text.encode()) & 0xFFFFFF)


# -- reading the error blocks on the host ---------------------------------------------------------


class ErrorBlocks:
    """The host's view of a reduced vector's ``status`` block, started right after the reduce.

    The same path on every device, and never a device-to-host sync. The
    success path reads one number on the host, whatever the world size: the
    step's reason (``_verdict.SkipReason``, computed on the device from the
    vector), which is ``failed_at`` or more exactly when a rank failed or ranks'
    chain or declaration fingerprints differ (``_step_arith.Probe``). The W
    slots themselves are turned into Python numbers only then
    (:meth:`read`): at 10^5 ranks reading them on every step cost more host
    time than the rest of the step (docs/benchmark.md, the scale table). On
    a GPU both are copied into pinned host memory asynchronously, so the
    failure path needs no second copy; elsewhere they are read where they are.
    """

    __slots__ = ("_at", "_blocks", "_flags", "_vector", "layout")

    def __init__(
        self, vector: torch.Tensor, layout: VectorLayout, reason: torch.Tensor, *, failed_at: int
    ) -> None:
        """``reason``: the step's 0-dim reason; ``failed_at``: the reason an error gives."""
        self.layout = layout
        self._at = failed_at
        # The reason first, blocks second: once the blocks' copy has landed, so has the reason.
        self._flags = HostCopy(reason)
        self._vector = vector
        # Off an accelerator the block is read where it is, only on the failure path.
        on_host = vector.device.type == "cpu"
        self._blocks = None if on_host else HostCopy(vector[layout.host_read()])

    @property
    def on_device(self) -> bool:
        """Whether the copy is asynchronous (an accelerator's vector)."""
        return self._flags.on_device

    def arrived(self) -> bool:
        """Whether the copy is done (always, off the GPU)."""
        return self._blocks is None or self._blocks.arrived()

    def read_failed(self, *, wait: bool) -> bool | None:
        """Whether a rank failed or ranks disagree; None if not ``wait`` and the copy is still on
        its way."""
        got = self._flags.read(wait=wait)
        return None if got is None else got[0] >= self._at

    def read(self, *, wait: bool) -> dict[str, list[float]] | None:
        """The ``error``, ``chain`` and ``declarations`` of every rank, decoded from ``status``,
        or None if not ``wait`` and the copy is still on its way.

        W numbers per name: for the failure path (:meth:`read_failed` first).
        """
        if self._blocks is None:
            values: list[float] | None = self._vector[self.layout.host_read()].tolist()
        else:
            values = self._blocks.read(wait=wait)
        if values is None:
            return None
        decoded = [unpack_status(v) for v in values]
        return {
            "error": [float(code) for code, _, _ in decoded],
            "chain": [chain for _, chain, _ in decoded],
            "declarations": [declarations for _, _, declarations in decoded],
        }


def failing_ranks(blocks: dict[str, list[float]]) -> tuple[int, ...]:
    """Ranks that recorded an error."""
    return tuple(r for r, code in enumerate(blocks["error"]) if code)


def disagree(blocks: dict[str, list[float]], name: str) -> bool:
    """Whether the ranks' fingerprints in block ``name`` differ."""
    return len(set(blocks[name])) > 1


def raise_step_errors(
    blocks: dict[str, list[float]] | None,
    *,
    rank: int,
    local_error: BaseException | None,
    chain: str,
    group: Any,
    declarations: str,
) -> None:
    """Raise on every rank if any rank failed or ranks disagree (see the note); else return."""
    blocks = blocks or {}
    failing = failing_ranks(blocks) if blocks else ()
    if local_error is not None:
        others = [r for r in failing if r != rank]
        local_error.add_note(
            "shardscale: this rank still joined the step's all-reduce, so every rank of the "
            "reduction group raised too" + (f" (other failing ranks: {others})" if others else "")
        )
        raise local_error
    if blocks and disagree(blocks, "chain"):
        _raise_chain_mismatch(chain, group, len(blocks["chain"]))
    if failing:
        kinds = {r: _kind_text(int(blocks["error"][r])) for r in failing}
        listing = "; ".join(f"rank {r}: {k}" for r, k in kinds.items())
        raise StepError(
            f"rank(s) {list(failing)} of the reduction group failed in this step ({listing}); "
            "this rank stops with them instead of waiting for a timeout. The failing rank's own "
            "error says what to fix.",
            ranks=failing,
            kinds=kinds,
        )
    if blocks and disagree(blocks, "declarations"):
        _raise_declaration_mismatch(blocks["declarations"], rank, declarations)


def _raise_declaration_mismatch(prints: Sequence[float], rank: int, declarations: str) -> None:
    groups: dict[float, list[int]] = {}
    for r, value in enumerate(prints):
        groups.setdefault(value, []).append(r)
    listing = " vs ".join(f"ranks {ranks}" for ranks in groups.values())
    raise DeclarationError(
        f"the ranks of this step declared different things ({listing} agree among "
        f"themselves); a norm or verdict combined from them would be wrong, so every rank "
        f"stops, nothing changed. This rank ({rank}) has: {declarations}. Every rank must pass "
        "the same distinct_dims, norm_type and max_norm, build its scaler with the same "
        "loss_scaling, spike and max_consecutive_skips, and hold the same replicated plain tensors: "
        "declare the plain tensors a rank holds its own of (experts) in distinct_params on "
        "that rank, or '*' in distinct_dims when every plain tensor differs per rank "
        "(pipeline stages). Compare this message across ranks."
    )


# -- errors still on their way from an accelerator ----------------------------------------------


class _PendingResult(Protocol):
    def raise_errors(self, *, wait: bool = True) -> None: ...

    @property
    def errors_arrived(self) -> bool: ...


class _PendingList(threading.local):  # type: ignore[misc]
    """Accelerator steps whose error blocks are still being copied to the host, per thread:
    a training (or a rank run as a thread) raises only its own steps' errors."""

    def __init__(self) -> None:
        self.results: list[_PendingResult] = []


_pending = _PendingList()


def add_pending(result: _PendingResult) -> None:
    """Keep ``result`` until its error blocks are read (``raise_errors`` removes it)."""
    _pending.results.append(result)


def drop_pending(result: _PendingResult) -> None:
    """Forget ``result`` (its error blocks were read)."""
    if result in _pending.results:
        _pending.results.remove(result)


def raise_pending_errors(*, wait: bool) -> None:
    """Raise a failure recorded by an earlier accelerator step (see ``StepResult.raise_errors``)."""
    pending = _pending.results
    while pending:
        result = pending[0]
        if not wait and not result.errors_arrived:
            return
        pending.pop(0)
        result.raise_errors(wait=True)


def poll_errors() -> None:
    """Raise now if an earlier step on an accelerator recorded an error and its copy arrived.

    Never waits: called by ``ShardedGradScaler.update()`` so that a failure on
    another rank surfaces within the iteration without a host sync.
    """
    raise_pending_errors(wait=False)


# -- the backend-chain check ---------------------------------------------------------------------


def chain_names(backend: CollectiveBackend) -> str:
    """``"counting+coalescing+c10d"``: the names along a backend's ``inner`` chain."""
    names = []
    node: Any = backend
    while node is not None:
        names.append(str(getattr(node, "name", type(node).__name__)))
        node = getattr(node, "inner", None)
    return "+".join(names)


def verify_same_chain(backend: CollectiveBackend, group: Any, device: torch.device) -> None:
    """Every rank must use the same backend chain: checked beside the chain.

    Different chains can issue different collectives and deadlock before the
    step's own fingerprint check could run, so this exchange goes straight
    through torch.distributed. Only when ``StepConfig.verify_chain`` asks.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    world = backend.world_size(group)
    if world <= 1:
        return
    chain = chain_names(backend)
    mine = fingerprint(chain)
    vec = torch.zeros(world, dtype=torch.float64, device=device)
    vec[backend.rank(group)] = mine
    dist.all_reduce(vec, group=group)
    if all(v == mine for v in vec.tolist()):  # once per scaler: a host read is fine here
        return
    _raise_chain_mismatch(chain, group, world)


def _raise_chain_mismatch(chain: str, group: Any, world: int) -> None:
    import torch.distributed as dist

    chains: list[Any] = [None] * world
    dist.all_gather_object(chains, chain, group=group)
    listing = ", ".join(f"rank {r}: {c!r}" for r, c in enumerate(chains))
    raise ShardscaleError(
        f"ranks use different collective backend chains ({listing}); every rank of a step must "
        "use the same chain or their collectives can mismatch and hang. Set the same "
        "backend= (or $SHARDSCALE_BACKEND) on every rank."
    )
