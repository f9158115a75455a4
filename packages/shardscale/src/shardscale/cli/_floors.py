"""The oldest torch, Triton and NCCL shardscale supports: the one place that says so.

``shardscale doctor`` and ``tools/gpu_check.py`` judge an environment by these
numbers; ``tests/test_packaging.py`` checks that every distribution's
``torch>=`` and shardscale-triton's ``triton>=`` say the same, and that the
noxfile's test matrix starts at :data:`TORCH_FLOOR` and pairs each torch with
the Triton in :data:`TRITON_PINS`.
"""

from __future__ import annotations

__all__ = [
    "NCCL_FLOOR",
    "TORCH_FLOOR",
    "TRITON_FLOOR",
    "TRITON_PINS",
    "below",
    "version_tuple",
]

#: The oldest torch the whole test suite passes on (``torch>=`` in every pyproject).
TORCH_FLOOR = "2.11"
#: The Triton each supported torch's CUDA wheels pin (their metadata; ``nox -s resolve`` checks).
TRITON_PINS = {"2.11": "3.6.0", "2.13": "3.7.1", "2.14": "3.8.0", "2.15": "3.9.0"}
#: The oldest of those: shardscale-triton's ``triton>=``, so it installs beside every one.
TRITON_FLOOR = "3.6"
#: The NCCL that the floor torch's PyPI CUDA wheels ship (nvidia-nccl-cu13==2.28.9): the oldest
#: shardscale is paired with. Older builds of torch may carry an older one; doctor warns.
NCCL_FLOOR = "2.28.9"


def version_tuple(version: str) -> tuple[int, ...]:
    """The leading numeric release of ``version``: ``"2.11.0+cu130"`` -> ``(2, 11, 0)``."""
    out = []
    for part in version.split("+", maxsplit=1)[0].split("."):
        digits = ""
        for ch in part:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        out.append(int(digits))
        if len(digits) != len(part):  # "0rc1", "0a0": the release ends here
            break
    return tuple(out)


def below(version: str, floor: str) -> bool:
    """Whether ``version`` is older than ``floor``, compared on the floor's precision.

    ``below("2.11.0+cu130", "2.11")`` is False; a pre-release of the floor
    (``"2.11.0a0"``) counts as the floor.
    """
    want = version_tuple(floor)
    return version_tuple(version)[: len(want)] < want
