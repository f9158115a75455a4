"""Bootstrap intervals and verdicts of ``shardscale bench`` against series whose answer is known."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from shardscale.cli.bench import balanced_order, ratio_interval, rounds_for, verdict


def _lognormal(n: int, seed: int, scale: float = 1.0) -> list[float]:
    rng = random.Random(seed)
    return [scale * math.exp(rng.gauss(0.0, 0.2)) for _ in range(n)]


def test_constant_series_gives_a_zero_width_interval() -> None:
    r = ratio_interval([3.0] * 30, [4.0] * 30)
    assert (r.ratio, r.low, r.high) == (0.75, 0.75, 0.75)
    assert r.verdict == "faster"


def test_identical_arms_give_an_interval_containing_one() -> None:
    a = _lognormal(40, seed=1)
    r = ratio_interval(a, list(a))
    assert r.low == r.high == r.ratio == 1.0
    assert r.verdict == "no difference measured"


def test_two_draws_of_one_distribution_are_not_called_different() -> None:
    r = ratio_interval(_lognormal(40, seed=2), _lognormal(40, seed=3), paired=False)
    assert r.low < 1.0 < r.high
    assert r.verdict == "no difference measured"


def test_a_known_factor_is_recovered_and_called() -> None:
    slow = _lognormal(200, seed=4, scale=2.0)
    r = ratio_interval(slow, _lognormal(200, seed=5), paired=False)
    assert r.low < 2.0 < r.high and r.low > 1.0
    assert r.verdict == "slower"


def test_pairing_cancels_drift_shared_by_a_round() -> None:
    # Each round's machine speed multiplies both arms; ours is exactly 0.9 of torch per round.
    drift = [1.0 + 2.0 * (i % 7) for i in range(30)]
    torch_ms = [10.0 * d for d in drift]
    ours_ms = [9.0 * d for d in drift]
    paired = ratio_interval(ours_ms, torch_ms)
    unpaired = ratio_interval(ours_ms, torch_ms, paired=False)
    assert paired.high - paired.low < 1e-9 and paired.verdict == "faster"
    assert unpaired.low < 1.0 < unpaired.high  # without pairing the drift hides the difference


def test_the_seed_fixes_the_interval() -> None:
    a, b = _lognormal(30, seed=6), _lognormal(30, seed=7)
    assert ratio_interval(a, b, seed=11) == ratio_interval(a, b, seed=11)


@pytest.mark.parametrize(
    ("low", "high", "expected"),
    [(0.8, 0.95, "faster"), (1.01, 1.2, "slower"), (0.9, 1.1, "no difference measured"),
     (1.0, 1.0, "no difference measured"), (0.5, 1.0, "no difference measured")],
)  # fmt: skip
def test_verdict_needs_the_interval_to_exclude_one(low: float, high: float, expected: str) -> None:
    assert verdict(low, high) == expected


@pytest.mark.parametrize(
    ("samples", "reference", "match"),
    [([], [1.0], "at least one"), ([1.0, 2.0], [1.0], "equal lengths")],
)
def test_bad_samples_are_refused(samples: list[float], reference: list[float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ratio_interval(samples, reference)


@pytest.mark.parametrize("arms", [2, 3, 4, 5])
def test_balanced_order_puts_every_arm_everywhere_equally(arms: int) -> None:
    rounds = rounds_for(1, arms)
    order = balanced_order(arms, rounds)
    assert all(sorted(row) == list(range(arms)) for row in order)
    # Every arm in every position equally often over one cycle.
    for pos in range(arms):
        counts = [sum(row[pos] == arm for row in order) for arm in range(arms)]
        assert len(set(counts)) == 1, (pos, counts)
    # Every ordered pair of different arms directly follows equally often (carry-over balance).
    pairs: dict[tuple[int, int], int] = {}
    for row in order:
        for first, second in itertools.pairwise(row):
            pairs[(first, second)] = pairs.get((first, second), 0) + 1
    assert len(pairs) == arms * (arms - 1) and len(set(pairs.values())) == 1


def test_two_arms_run_abba() -> None:
    assert balanced_order(2, 4) == [[0, 1], [1, 0], [0, 1], [1, 0]]


def test_rounds_are_whole_cycles() -> None:
    assert rounds_for(30, 4) == 32 and rounds_for(32, 4) == 32 and rounds_for(30, 3) == 30
    assert rounds_for(31, 3) == 36


def test_fewer_rounds_than_the_minimum_give_no_verdict_even_when_the_interval_excludes_one() -> (
    None
):
    from shardscale.cli.bench._stats import MIN_VERDICT_SAMPLES, TOO_FEW

    # A clear factor of 2 over 4 rounds: the interval excludes 1, but 4 rounds call nothing.
    r = ratio_interval([2.0, 2.1, 1.9, 2.05], [1.0, 1.05, 0.95, 1.0])
    assert r.low > 1.0 and r.samples == 4
    assert r.verdict == TOO_FEW and "slower" not in r.verdict and "faster" not in r.verdict
    assert r.as_dict()["verdict"] == TOO_FEW
    # The same factor at the minimum is called.
    n = MIN_VERDICT_SAMPLES
    assert ratio_interval([2.0] * n, [1.0] * n).verdict == "slower"
    assert ratio_interval([2.0] * (n - 1), [1.0] * (n - 1)).verdict == TOO_FEW
    # Unpaired: the smaller side counts.
    assert ratio_interval([2.0] * 40, [1.0] * (n - 1), paired=False).verdict == TOO_FEW
    assert verdict(1.1, 1.2, samples=n - 1) == TOO_FEW


def test_a_smoke_runs_aa_row_like_the_one_once_called_faster_gets_no_verdict() -> None:
    # Torch against itself over 4 rounds, as in a --quick run: whatever the draw, no verdict.
    for seed in range(20):
        r = ratio_interval(_lognormal(4, seed=seed), _lognormal(4, seed=seed + 100))
        assert r.verdict == "too few rounds for a verdict", (seed, r)
