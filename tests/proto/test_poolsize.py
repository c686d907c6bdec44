"""The pool's size policy: demand in, pool size out; pure, times are arguments.

Rules: each test states a demand pattern (create times) and asserts the size
the pool is asked to hold, as a user's burst would meet it; Hypothesis
checks the bounds hold for any pattern.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from aenv.proto.poolsize import PoolLimits, PoolPolicy, allot, memory_budget

LIMITS = PoolLimits(
    min_size=2, max_size=32, hot_for_s=600.0, window_s=5.0, hold_s=60.0, half_life_s=120.0
)
MIB = 1 << 20


def _creates(policy: PoolPolicy, key: str, times: list[float]) -> None:
    for t in times:
        policy.created(key, t)


def test_a_template_asked_for_once_gets_no_pool_twice_gets_the_minimum() -> None:
    policy = PoolPolicy(LIMITS)
    policy.created("t", 0.0)
    assert policy.want("t", 0.0) == 0
    policy.created("t", 100.0)  # not a burst: 100 s apart
    assert policy.want("t", 100.0) == LIMITS.min_size


def test_a_burst_of_twenty_concurrent_creates_grows_the_pool_to_twenty() -> None:
    policy = PoolPolicy(LIMITS)
    _creates(policy, "t", [0.0] * 20)
    assert policy.want("t", 0.0) == 20
    # twenty in quick succession (one every 100 ms) count the same
    _creates(policy, "u", [i * 0.1 for i in range(20)])
    assert policy.want("u", 2.0) == 20


def test_the_pool_shrinks_back_as_demand_falls_and_empties_once_cold() -> None:
    policy = PoolPolicy(LIMITS)
    _creates(policy, "t", [0.0] * 20)
    assert policy.want("t", 60.0) == 20  # held for hold_s
    assert policy.want("t", 180.0) == 10  # then one half-life later
    assert policy.want("t", 300.0) == 5
    assert policy.want("t", 599.0) == LIMITS.min_size  # the floor while hot
    assert policy.want("t", 601.0) == 0  # cold: not asked for in hot_for_s
    assert policy.forget_cold(601.0) == ["t"]
    assert policy.targets(601.0, budget=100) == {}


def test_a_bigger_burst_raises_the_peak_a_smaller_one_does_not_lower_it() -> None:
    policy = PoolPolicy(LIMITS)
    _creates(policy, "t", [0.0] * 8)
    _creates(policy, "t", [10.0] * 3)
    assert policy.want("t", 10.0) == 8  # (8 decayed over 10 s: still above 7)
    _creates(policy, "t", [20.0] * 12)
    assert policy.want("t", 20.0) == 12


def test_a_steady_rate_keeps_what_arrives_during_a_refill() -> None:
    policy = PoolPolicy(
        PoolLimits(min_size=1, max_size=64, window_s=1.0, hold_s=0.0, half_life_s=60.0)
    )
    # 10 creates a second, evenly: never more than 10 in a 1 s window
    _creates(policy, "t", [i * 0.1 for i in range(3000)])
    for _ in range(50):
        policy.refilled(2.0)  # a refill restore takes 2 s under this load
    # ~10/s x 2 s = 20 arrive while one member is restored
    assert 18 <= policy.want("t", 300.0) <= 21


def test_the_size_never_exceeds_the_maximum() -> None:
    policy = PoolPolicy(PoolLimits(min_size=2, max_size=5))
    _creates(policy, "t", [0.0] * 50)
    assert policy.want("t", 0.0) == 5


def test_the_budget_is_shared_without_starving_the_small_template() -> None:
    assert allot({"big": 20, "small": 2}, budget=30) == {"big": 20, "small": 2}
    assert allot({"big": 20, "small": 2}, budget=10) == {"big": 8, "small": 2}
    assert allot({"a": 5, "b": 5}, budget=3) == {"a": 2, "b": 1}
    assert allot({"a": 5}, budget=-1) == {"a": 0}


def test_memory_allows_members_only_above_the_hibernation_mark() -> None:
    total = 1000 * MIB
    # mark 10 % + 5 % margin = 150 MiB; 550 MiB available: 400 MiB spare = 8 more of 50
    assert memory_budget(available=550 * MIB, total=total, low_pct=10, margin_pct=5,
                         member_bytes=50 * MIB, held=3) == 11  # fmt: skip
    # below the mark: no more than are held (the pool does not grow)
    assert memory_budget(available=100 * MIB, total=total, low_pct=10, margin_pct=5,
                         member_bytes=50 * MIB, held=3) == 3  # fmt: skip


def test_targets_apply_the_budget_across_templates() -> None:
    policy = PoolPolicy(LIMITS)
    _creates(policy, "a", [0.0] * 20)
    _creates(policy, "b", [0.0] * 4)
    assert policy.targets(0.0, budget=100) == {"a": 20, "b": 4}
    assert policy.targets(0.0, budget=10) == {"a": 6, "b": 4}


@given(
    gaps=st.lists(st.floats(min_value=0.0, max_value=900.0), min_size=1, max_size=60),
    later=st.floats(min_value=0.0, max_value=2000.0),
    budget=st.integers(min_value=0, max_value=100),
)
def test_sizes_stay_within_the_limits_and_the_budget(
    gaps: list[float], later: float, budget: int
) -> None:
    policy = PoolPolicy(LIMITS)
    now = 0.0
    for gap in gaps:
        now += gap
        policy.created("t", now)
        policy.created("u", now + gap / 2)
    now += later
    for key in ("t", "u"):
        want = policy.want(key, now)
        assert want == 0 or LIMITS.min_size <= want <= LIMITS.max_size
        assert (want == 0) == (not policy.hot(key, now))
    assert sum(policy.targets(now, budget).values()) <= budget
