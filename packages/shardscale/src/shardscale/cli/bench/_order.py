"""The order in which the arms take their steps: balanced, so drift hits every arm alike.

[Note: balanced order]
A Williams design: for k arms, the rows of a k x k Latin square whose first
row is 0, 1, k-1, 2, k-2, ... and whose row i adds i (mod k). Over one cycle
of rows every arm runs once in every position, and every arm directly follows
every other arm exactly once, so neither a warmer cache nor a slow drift of
the machine's load favours one arm. For odd k the cycle also runs each row
reversed (2k rows), which restores the second property. For two arms this is
ABBA. Rounds are counted in whole cycles (:func:`rounds_for`).
"""

from __future__ import annotations

__all__ = ["balanced_order", "rounds_for"]


def _cycle(n_arms: int) -> list[list[int]]:
    first = [0]
    low, high = 1, n_arms - 1
    while low <= high:
        first.append(low)
        if low != high:
            first.append(high)
        low, high = low + 1, high - 1
    rows = [[(x + i) % n_arms for x in first] for i in range(n_arms)]
    if n_arms % 2:
        rows += [row[::-1] for row in rows]
    return rows


def rounds_for(steps: int, n_arms: int) -> int:
    """``steps`` rounded up to a whole number of balanced cycles."""
    cycle = len(_cycle(n_arms)) if n_arms > 1 else 1
    return -(-steps // cycle) * cycle


def balanced_order(n_arms: int, n_rounds: int) -> list[list[int]]:
    """Arm indices per round: round r runs its arms in the order ``result[r]``."""
    if n_arms < 1 or n_rounds < 0:
        raise ValueError(f"need n_arms >= 1 and n_rounds >= 0, got {n_arms}, {n_rounds}")
    rows = _cycle(n_arms)
    return [list(rows[r % len(rows)]) for r in range(n_rounds)]
