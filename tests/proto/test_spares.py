"""How many spares a node keeps: the largest burst of takes, within bounds."""

from __future__ import annotations

from aenv.proto.spares import Bursts


def test_the_largest_burst_is_kept_within_bounds() -> None:
    d = Bursts(most=20, gap_s=1.0, least=2)
    assert (d.target, d.refill_at) == (2, float("-inf"))  # nothing seen: the least
    for i in range(5):  # five takes, each less than a second after the last
        d.took(10.0 + 0.5 * i)
    assert d.target == 5 and d.refill_at == 13.0
    d.took(20.0)  # a new burst of one: the peak stays
    assert d.target == 5 and d.refill_at == 21.0
    for i in range(30):
        d.took(30.0 + 0.01 * i)
    assert d.target == 20  # at most `most`


def test_takes_a_gap_apart_are_separate_bursts() -> None:
    d = Bursts(most=8, gap_s=1.0)
    for t in (0.0, 1.0, 2.0, 3.0):
        d.took(t)
    assert d.target == 1
    assert Bursts(most=0, gap_s=1.0, least=4).target == 0  # none at all
