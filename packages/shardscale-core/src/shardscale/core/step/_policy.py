"""The skip-policy protocol: what a policy adds to the reduced vector, how it flags, its state.

[Note: a skip policy]
A skip policy is a frozen option object (like :class:`SpikeSkip`) that
declares, as class attributes:

* ``name``: unique among the registered policies (its checkpoint keys are
  ``policy.<name>``);
* ``code``: the value ``scaler.last_skip_reason`` holds when it decides a
  step. The built-ins keep :class:`SkipReason`'s values (1..5); a third-party
  policy takes one in :data:`PLUGIN_CODES` (16..62: a streak's reasons mask
  is an int64 with one bit per code);
* ``precedence``: when several policies flag a step, the reason is the code
  of the one with the highest precedence. The built-ins: error 50 > overflow
  40 > non-finite gradient 30 > non-finite loss 20 > spike 10
  (:data:`BUILTIN_PRECEDENCE`); a third-party policy takes a number in
  :data:`PLUGIN_PRECEDENCE` (1..29, not 10 or 20): it ranks below the
  engine's own blocks (a non-finite gradient, an error), whose steps carry
  no usable gradients whatever a policy says, and the scale backs off only
  for them;
* ``slots``: names of SUM slots it adds to the step's reduced vector (each
  rank writes its own contribution, the one all-reduce adds them), which is
  how a policy sees what other ranks saw without a collective of its own.

and binds device state per scaler with ``bind(device)``, a :class:`PolicyState`:

* ``fill(out, loss=...)``: write this rank's values into the 0-dim float64
  views ``out[slot]`` (device ops with ``out=``, no host read) before the
  all-reduce; ``loss`` is the sum of the losses this rank observed in the
  iteration (``scaler.scale(loss)`` / ``scaler.observe_loss(loss)``), or None;
* ``flag(reduced, norm=..., found_inf=..., loss=...)``: a 0-dim bool device
  tensor from the reduced slots (identical on every rank), the step's global
  norm (or None) and its found_inf flag; it must only use values identical on
  every rank, so every rank takes the same verdict;
* ``after_update(reason)``: called by ``scaler.update()`` with the
  iteration's 0-dim reason, so windows hold only accepted values;
* ``state_dict()`` / ``load_state_dict(state)``: host values for checkpoints.

The policy's ``fingerprint()`` joins the step's declarations: ranks whose
policies differ would decide differently on the same vector, so they all
raise instead (see [Note: declarations] in ``_contract``).

The non-finite gradient/overflow and error reasons stay the engine's own:
they are the step's own blocks of the vector (the counts its read produces
and every rank's status), not options. The non-finite loss and the spike
test keep their fused places in the vector (``loss_nonfinite``) and in the
flags (one op for the reason when only built-ins are on:
``test_step_op_budget``); they declare the same name/code/precedence.
With a third-party policy the reason is an ``amax`` over the flags weighted
by precedence and one ``take`` into a codes table.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from shardscale.core.step._verdict import SkipReason

__all__ = [
    "BUILTIN_PRECEDENCE",
    "PLUGIN_CODES",
    "PLUGIN_PRECEDENCE",
    "BoundPolicies",
    "PolicyState",
    "SkipPolicy",
    "check_policies",
    "policy_problem",
]

#: The built-in reasons' precedence (higher wins).
BUILTIN_PRECEDENCE: dict[SkipReason, int] = {
    SkipReason.SPIKE: 10,
    SkipReason.LOSS: 20,
    SkipReason.NONFINITE: 30,
    SkipReason.OVERFLOW: 40,
    SkipReason.ERROR: 50,
}
#: The reason codes a third-party policy may take.
PLUGIN_CODES = range(16, 63)
#: The precedence numbers a third-party policy may take (below a non-finite gradient).
PLUGIN_PRECEDENCE = range(1, 30)
_TABLE = 64  # precedence values a codes table covers (0..50 used)


@runtime_checkable
class PolicyState(Protocol):
    """A policy's device state for one scaler (see [Note: a skip policy])."""

    def fill(self, out: Mapping[str, torch.Tensor], *, loss: torch.Tensor | None) -> None:
        """Write this rank's contribution into ``out[slot]`` (0-dim float64 views)."""

    def flag(
        self,
        reduced: Mapping[str, torch.Tensor],
        *,
        norm: torch.Tensor | None,
        found_inf: torch.Tensor,
        loss: torch.Tensor | None,
    ) -> torch.Tensor:
        """A 0-dim bool tensor: whether this policy skips the step."""
        ...

    def after_update(self, reason: torch.Tensor) -> None:
        """Take the iteration's verdict (0-dim int64 reason; 0: the step was taken)."""

    def state_dict(self) -> dict[str, Any]:
        """Host values for a checkpoint."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s values (raise ``ValueError`` on a bad one)."""


@runtime_checkable
class SkipPolicy(Protocol):
    """A frozen option object for one reason to skip a step (see [Note: a skip policy])."""

    # Read-only members: a policy declares them as class attributes (ClassVar).
    @property
    def name(self) -> str:
        """Unique among the registered policies; its checkpoint key is ``policy.<name>``."""
        ...

    @property
    def code(self) -> int:
        """Its reason code: 16..62 for a third-party policy."""
        ...

    @property
    def precedence(self) -> int:
        """Its rank among the reasons (higher wins): 1..29, not 10 or 20, for a third party."""
        ...

    @property
    def slots(self) -> tuple[str, ...]:
        """The names of the SUM slots it adds to the reduced vector."""
        ...

    def fingerprint(self) -> str:
        """The policy and its options as text, compared across ranks."""
        ...

    def bind(self, device: torch.device) -> PolicyState:
        """New device state for one scaler, on ``device``."""
        ...


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def policy_problem(policy: object) -> str | None:
    """What is wrong with a third-party policy's declarations (``None``: nothing)."""
    name = getattr(policy, "name", None)
    if not isinstance(name, str) or not name.isidentifier():
        return f"its 'name' must be an identifier string, got {name!r}"
    code, precedence = getattr(policy, "code", None), getattr(policy, "precedence", None)
    if not _int(code) or code not in PLUGIN_CODES:
        return f"its 'code' must be an int in 16..62 (third-party reason codes), got {code!r}"
    if not _int(precedence) or precedence not in PLUGIN_PRECEDENCE or precedence in (10, 20):
        return (
            "its 'precedence' must be an int in 1..29 other than the built-ins' 10 (spike) and "
            f"20 (non-finite loss), got {precedence!r}"
        )
    slots = getattr(policy, "slots", None)
    if not isinstance(slots, tuple) or not all(
        isinstance(s, str) and s.isidentifier() for s in slots
    ):
        return f"its 'slots' must be a tuple of identifier strings, got {slots!r}"
    missing = [m for m in ("fingerprint", "bind") if not callable(getattr(policy, m, None))]
    if missing:
        return f"it has no method(s) {', '.join(missing)}"
    return None


def check_policies(policies: object) -> tuple[SkipPolicy, ...]:
    """``ShardedGradScaler(policies=...)``: third-party policy objects, validated."""
    if isinstance(policies, (str, bytes)) or not isinstance(policies, Sequence):
        raise TypeError(
            "policies= takes a list of skip policy objects (e.g. [LossMedianSkip(k=3.0)]), got "
            f"{type(policies).__name__}"
        )
    seen: dict[str, object] = {}
    codes: dict[int, object] = {}
    ranks: dict[int, object] = {}
    for policy in policies:
        if isinstance(policy, type):
            raise TypeError(
                f"policies= takes policy objects, got the class {policy.__qualname__}; pass "
                f"{policy.__qualname__}(...)"
            )
        problem = policy_problem(policy)
        if problem is not None:
            raise ValueError(f"policies=: {policy!r} is not a skip policy: {problem}")
        for table, key, what in (
            (seen, policy.name, "name"),
            (codes, policy.code, "code"),
            (ranks, policy.precedence, "precedence"),
        ):
            if key in table:
                raise ValueError(
                    f"policies=: {table[key]!r} and {policy!r} share the {what} {key!r}; each "
                    "policy needs its own name, code and precedence"
                )
            table[key] = policy
    return tuple(policies)  # type: ignore[arg-type]


class BoundPolicies:
    """A scaler's third-party policies bound to its device: their states, slots and codes table.

    Owned by one scaler (never shared): the codes table maps a precedence to the
    reason code (built-ins and these policies).
    """

    __slots__ = ("codes", "policies", "ranks", "slots", "states")

    def __init__(self, policies: tuple[SkipPolicy, ...], device: torch.device) -> None:
        self.policies = policies
        self.states = tuple(p.bind(device) for p in policies)
        #: The vector slot names, namespaced ``<policy>.<slot>``, in order.
        self.slots = tuple(f"{p.name}.{s}" for p in policies for s in p.slots)
        table = torch.zeros(_TABLE, dtype=torch.int64)
        for reason, rank in BUILTIN_PRECEDENCE.items():
            table[rank] = int(reason)
        for p in policies:
            table[p.precedence] = p.code
        self.codes = table.to(device)
        #: code -> precedence (the inverse of :attr:`codes`).
        ranks = torch.zeros(_TABLE, dtype=torch.int64)
        for reason, rank in BUILTIN_PRECEDENCE.items():
            ranks[int(reason)] = rank
        for p in policies:
            ranks[p.code] = p.precedence
        self.ranks = ranks.to(device)

    def strongest(self, reasons: Sequence[torch.Tensor]) -> torch.Tensor:
        """The highest-precedence reason of several 0-dim reason codes (on one device)."""
        ranked = torch.take(self.ranks, torch.stack(list(reasons)))
        return torch.take(self.codes, ranked.amax())

    def fingerprint(self) -> str:
        """Every policy's fingerprint, in order."""
        return ", ".join(f"{p.name}:{p.fingerprint()}" for p in self.policies)

    def fill(self, out: Mapping[str, torch.Tensor], *, loss: torch.Tensor | None) -> None:
        """Each policy writes its slots (``out`` keyed by namespaced slot)."""
        for policy, state in zip(self.policies, self.states, strict=True):
            state.fill({s: out[f"{policy.name}.{s}"] for s in policy.slots}, loss=loss)

    def flags(
        self,
        reduced: Mapping[str, torch.Tensor],
        *,
        norm: torch.Tensor | None,
        found_inf: torch.Tensor,
        loss: torch.Tensor | None,
    ) -> list[torch.Tensor]:
        """Each policy's 0-dim bool flag, in order."""
        return [
            state.flag(
                {s: reduced[f"{policy.name}.{s}"] for s in policy.slots},
                norm=norm,
                found_inf=found_inf,
                loss=loss,
            )
            for policy, state in zip(self.policies, self.states, strict=True)
        ]
