"""The one mesh syntax every ``shardscale`` command reads (``--mesh``, ``--meshes``).

[Note: the mesh grammar]
A mesh is one or more dimensions joined by ``x``, outermost first; each
dimension is ``[name]N`` with ``name`` one of ``dp``, ``tp``, ``pp``, ``ep``
and ``N`` a whole number >= 1::

    mesh      := dim ("x" dim)*
    dim       := [name] N          name in dp | tp | pp | ep
    meshes    := mesh ("," mesh)*  (commands that run several meshes)

Names are written on every dimension or on none. A bare ``N`` is ``dpN``; a
bare ``AxB`` is ``dpA x tpB`` (FSDP over A ranks, tensor parallelism over B);
more than two bare sizes are refused, as is a name written twice. Case and
spaces do not matter (``PP2 x DP2`` is ``pp2xdp2``). Every error names the
part that is wrong and shows the grammar.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "DIM_NAMES",
    "MESH_GRAMMAR",
    "MeshSpec",
    "MeshSpecError",
    "parse_mesh_list",
    "parse_mesh_spec",
]

#: The dimension names a mesh may use, in no particular order.
DIM_NAMES = ("dp", "tp", "pp", "ep")

#: One line for help texts and errors.
MESH_GRAMMAR = (
    "a mesh is dims joined by 'x', outermost first, each [name]N with name dp, tp, pp or ep "
    "(e.g. 'dp4', 'dp2xtp2', 'pp2xdp2'); a bare N is dpN and a bare AxB is dpA x tpB; "
    "a comma separates several meshes"
)


class MeshSpecError(ValueError):
    """A mesh string that does not follow the grammar; the message names the bad part."""


@dataclass(frozen=True, slots=True)
class MeshSpec:
    """A parsed mesh: ``(name, size)`` per dimension, outermost first."""

    dims: tuple[tuple[str, int], ...]

    @property
    def names(self) -> tuple[str, ...]:
        """Dimension names, outermost first."""
        return tuple(name for name, _ in self.dims)

    @property
    def sizes(self) -> tuple[int, ...]:
        """Dimension sizes, outermost first (a ``DeviceMesh`` shape)."""
        return tuple(size for _, size in self.dims)

    @property
    def size(self) -> int:
        """Number of ranks the mesh needs."""
        return math.prod(self.sizes)

    def get(self, name: str) -> int:
        """The size of dimension ``name``; 1 when the mesh does not have it."""
        if name not in DIM_NAMES:
            raise KeyError(
                f"{name!r} is not a mesh dimension name; names are {', '.join(DIM_NAMES)}"
            )
        return dict(self.dims).get(name, 1)

    def __str__(self) -> str:
        """The canonical spelling, every dimension named: ``dp2xtp2``."""
        return "x".join(f"{name}{size}" for name, size in self.dims)


def _fail(option: str, text: str, problem: str) -> MeshSpecError:
    where = f"{option} {text!r}" if option else repr(text)
    return MeshSpecError(f"{where}: {problem}; {MESH_GRAMMAR}")


def _size(option: str, text: str, part: str, digits: str) -> int:
    if not digits.isdigit():
        what = f"{digits!r} is not a whole number" if digits else "has no size"
        raise _fail(option, text, f"the part {part!r} {what}")
    size = int(digits)
    if size < 1:
        raise _fail(option, text, f"the part {part!r} has size {size}; sizes are >= 1")
    return size


def parse_mesh_spec(text: str, *, option: str = "--mesh") -> MeshSpec:
    """Parse one mesh (no commas), e.g. ``"2x2"``, ``"pp2xdp2"``, ``"dp4"``.

    ``option`` is the flag named in errors. Raises :class:`MeshSpecError`.
    """
    compact = "".join(str(text).split()).lower()
    if not compact:
        raise _fail(option, str(text), "the mesh is empty")
    if "," in compact:
        raise _fail(option, str(text), "one mesh is expected here, not a list")
    parts = compact.split("x")
    if any(not p for p in parts):
        raise _fail(option, str(text), "a dimension is missing between two 'x' (or at an end)")
    named = [p[:2] in DIM_NAMES for p in parts]
    if any(named) and not all(named):
        bare = next(p for p, n in zip(parts, named, strict=True) if not n)
        if bare[:1].isdigit():
            raise _fail(option, str(text), f"the part {bare!r} has no name while others do; "
                        f"write every dimension named (e.g. 'dp{bare}')")  # fmt: skip
        raise _fail(option, str(text), f"{bare!r} is not a dimension")
    if not any(named):
        if not all(p.isdigit() for p in parts):
            bad = next(p for p in parts if not p.isdigit())
            raise _fail(option, str(text), f"{bad!r} is not a dimension")
        if len(parts) > 2:
            raise _fail(option, str(text), f"{len(parts)} bare sizes; bare sizes are N or AxB, "
                        "name the dimensions for more (e.g. 'pp2xdp2xtp2')")  # fmt: skip
        sizes = [_size(option, str(text), p, p) for p in parts]
        return MeshSpec(tuple(zip(("dp", "tp"), sizes, strict=False)))
    dims: list[tuple[str, int]] = []
    for part in parts:
        name = part[:2]
        if name in (n for n, _ in dims):
            raise _fail(option, str(text), f"the dimension {name!r} is written twice")
        dims.append((name, _size(option, str(text), part, part[2:])))
    return MeshSpec(tuple(dims))


def parse_mesh_list(text: str, *, option: str = "--meshes") -> tuple[MeshSpec, ...]:
    """Parse comma-separated meshes, e.g. ``"4,2x2,pp2xdp2"``; empty parts are refused."""
    pieces = str(text).split(",")
    if not "".join(pieces).strip():
        raise _fail(option, str(text), "no mesh is given")
    out: list[MeshSpec] = []
    for piece in pieces:
        if not piece.strip():
            raise _fail(option, str(text), "an empty mesh between two commas (or at an end)")
        out.append(parse_mesh_spec(piece, option=option))
    return tuple(out)
