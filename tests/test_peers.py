"""Peer paths: a job's blocks split over the own link and borrowed ones."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload_engine.device.peers import split_units

# ------------------------------------------------------------------ split_units


def counts(ranges: tuple[tuple[int, int], ...]) -> list[int]:
    return [stop - start for start, stop in ranges]


def check_partition(ranges: tuple[tuple[int, int], ...], units: int, paths: int) -> None:
    """One range per path, contiguous from 0 to ``units``: no unit lost or moved twice."""
    assert len(ranges) == paths
    position = 0
    for start, stop in ranges:
        assert start == position and stop >= start
        position = stop
    assert position == units


def test_a_split_follows_the_rates() -> None:
    assert split_units(12, (1.0, 1.0, 1.0)) == ((0, 4), (4, 8), (8, 12))
    assert split_units(10, (55.0, 53.0, 52.0, 0.0)) == ((0, 3), (3, 7), (7, 10), (10, 10))
    assert split_units(8, (3, 1)) == ((0, 6), (6, 8))
    assert split_units(0, (1.0, 2.0)) == ((0, 0), (0, 0))
    assert split_units(5, (7.0,)) == ((0, 5),)


def test_the_same_inputs_give_the_same_split() -> None:
    rates = (54.1, 53.7, 0.0, 51.9)
    assert len({split_units(37, rates, min_units=2) for _ in range(20)}) == 1


def test_dead_paths_get_nothing() -> None:
    ranges = split_units(9, (1.0, 0.0, -3.0, math.nan, -math.inf, 2.0))
    assert counts(ranges) == [3, 0, 0, 0, 0, 6]
    check_partition(ranges, 9, 6)


def test_no_positive_rate_puts_everything_on_the_own_link() -> None:
    assert split_units(7, (0.0, 0.0)) == ((0, 7), (7, 7))
    assert split_units(7, (math.nan, -1.0, 0)) == ((0, 7), (7, 7), (7, 7))


def test_a_dead_own_link_gets_nothing_while_a_peer_lives() -> None:
    assert counts(split_units(6, (0.0, 1.0, 1.0))) == [0, 3, 3]


def test_peer_parts_below_min_units_fold_into_the_own_link() -> None:
    # shares 10 / 1 / 5 of 16: the one-block part folds, the five-block part stays
    assert counts(split_units(16, (10.0, 1.0, 5.0))) == [10, 1, 5]
    assert counts(split_units(16, (10.0, 1.0, 5.0), min_units=2)) == [11, 0, 5]
    assert counts(split_units(16, (10.0, 1.0, 5.0), min_units=6)) == [16, 0, 0]
    # the own link's part is never folded, however small
    assert counts(split_units(16, (1.0, 15.0), min_units=4)) == [1, 15]


def test_extreme_rates_stay_exact() -> None:
    assert counts(split_units(4, (1e308, 1e308))) == [2, 2]
    assert counts(split_units(4, (5e-324, 5e-324))) == [2, 2]
    assert counts(split_units(3, (1e300, 1e-300))) == [3, 0]


@pytest.mark.parametrize(
    ("units", "rates", "min_units", "error", "match"),
    [
        (-1, (1.0,), 1, ValueError, "units"),
        (1.5, (1.0,), 1, ValueError, "units"),
        (True, (1.0,), 1, ValueError, "units"),
        (4, (1.0,), 0, ValueError, "min_units"),
        (4, (), 1, ValueError, "at least the own link"),
        (4, (1.0, math.inf), 1, ValueError, r"rates\[1\] must be finite"),
        (4, (1.0, "2"), 1, TypeError, r"rates\[1\] must be a number"),
        (4, (1.0, None), 1, TypeError, r"rates\[1\]"),
        (4, (True,), 1, TypeError, r"rates\[0\]"),
        (4, "12", 1, TypeError, "sequence of numbers"),
        (4, 3.0, 1, TypeError, "sequence of numbers"),
    ],
)
def test_bad_arguments_raise_typed_errors(
    units: object, rates: object, min_units: object, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        split_units(units, rates, min_units=min_units)  # type: ignore[arg-type]


rate = st.one_of(
    st.floats(min_value=0.0, max_value=1e6, allow_nan=False),
    st.sampled_from([0.0, -1.0, math.nan, -math.inf]),
)


@settings(max_examples=300, deadline=None)
@given(
    units=st.integers(0, 4096),
    rates=st.lists(rate, min_size=1, max_size=9).map(tuple),
    min_units=st.integers(1, 64),
)
def test_every_split_is_a_partition_in_proportion(
    units: int, rates: tuple[float, ...], min_units: int
) -> None:
    ranges = split_units(units, rates, min_units=min_units)
    check_partition(ranges, units, len(rates))
    got = counts(ranges)
    usable = [r if r > 0 else 0.0 for r in rates]
    total = sum(usable)
    for i, r in enumerate(rates):
        if not r > 0:
            assert got[i] == 0 or i == 0
        if i > 0:
            assert got[i] == 0 or got[i] >= min_units
    if total == 0:
        assert got[0] == units
        return
    unfolded = counts(split_units(units, rates))
    for i, r in enumerate(usable):
        assert abs(unfolded[i] - units * r / total) <= 1 + 1e-9
    # folding moves only parts below min_units, and only onto the own link
    moved = [i for i in range(1, len(rates)) if got[i] != unfolded[i]]
    assert all(0 < unfolded[i] < min_units and got[i] == 0 for i in moved)
    assert got[0] == unfolded[0] + sum(unfolded[i] for i in moved)
