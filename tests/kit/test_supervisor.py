"""Supervisor: restart budgets and backoff, restart types, strategies, the stop ladder.

Rules: every test runs on trio's MockClock (`autojump_clock`, or a MockClock
passed to `trio.run` in the property test), which starts at 0, so times are
asserted exactly; jitter is 0 unless a test is about jitter, and then the
RNG is seeded. Children record what happened to them (start times, the stop
reason they saw, when their `finally` ran) in plain lists the test reads.
"""

from __future__ import annotations

import itertools
import logging
import random
from collections.abc import Awaitable, Callable

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from aenv.kit.supervisor import (
    ChildHandle,
    ChildState,
    ChildStopped,
    Restart,
    RestartPolicy,
    StopToken,
    Strategy,
    SupervisionError,
    Supervisor,
    open_supervisor,
    run_supervisor,
)

EXACT = RestartPolicy(max_restarts=5, window_s=100, backoff_base_s=1, backoff_max_s=4, jitter=0)


def failing(starts: list[float], *, after: float = 0) -> Callable[[StopToken], Awaitable[None]]:
    """A child that records when it starts, runs `after` seconds and fails."""

    async def child(stop: StopToken) -> None:
        starts.append(trio.current_time())
        await trio.sleep(after)
        raise ValueError(f"failure {len(starts)}")

    return child


async def test_failures_restart_after_capped_exponential_backoff(
    autojump_clock: trio.testing.MockClock,
) -> None:
    starts: list[float] = []

    async def flaky(stop: StopToken) -> None:
        starts.append(trio.current_time())
        raise ValueError(f"failure {len(starts)}")

    with pytest.raises(SupervisionError) as ei:
        async with open_supervisor("sup") as sup:
            sup.start_soon("flaky", flaky, policy=EXACT)
            await trio.sleep_forever()
    # backoff 1, 2, 4, then capped at 4; the 6th failure finds 5 restarts in the window
    assert starts == [0, 1, 3, 7, 11, 15]
    assert trio.current_time() == 15
    assert ei.value.child == "flaky"
    assert ei.value.supervisor == "sup"
    assert "after 5 restarts within 100s" in str(ei.value)
    assert isinstance(ei.value.__cause__, ValueError)
    assert str(ei.value.__cause__) == "failure 6"
    assert sup.statistics().restarts == 5
    assert sup.statistics().failures == 6


async def test_jitter_comes_from_the_injected_rng(autojump_clock: trio.testing.MockClock) -> None:
    policy = RestartPolicy(max_restarts=4, window_s=100, backoff_base_s=1, backoff_max_s=4)

    async def restart_times(seed: int) -> list[float]:
        starts: list[float] = []

        async def flaky(stop: StopToken) -> None:
            starts.append(trio.current_time())
            raise ValueError("boom")

        t0 = trio.current_time()
        with pytest.raises(SupervisionError):
            async with open_supervisor(rng=random.Random(seed)) as sup:
                sup.start_soon("flaky", flaky, policy=policy)
                await trio.sleep_forever()
        return [t - t0 for t in starts]

    first = await restart_times(7)
    assert first == pytest.approx(await restart_times(7))
    assert first != pytest.approx(await restart_times(8))
    rng = random.Random(7)
    delays = [b - a for a, b in itertools.pairwise(first)]
    assert delays == pytest.approx([policy.backoff(n, rng) for n in range(4)])
    for n, delay in enumerate(delays):
        d = min(4, 2**n)
        assert d / 2 <= delay <= d


async def test_spent_budget_escalates_loudly_and_stops_siblings(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    starts: list[float] = []
    sibling_end: list[float] = []

    async def sibling(stop: StopToken) -> None:
        try:
            await trio.sleep_forever()
        finally:
            sibling_end.append(trio.current_time())

    policy = RestartPolicy(max_restarts=2, window_s=10, backoff_base_s=1, jitter=0)
    body_cancelled_at: list[float] = []
    with pytest.raises(SupervisionError, match="'flaky' failed: ValueError"):
        async with open_supervisor("node") as sup:
            sib = sup.start_soon("sibling", sibling)
            flaky = sup.start_soon("flaky", failing(starts), policy=policy)
            try:
                await trio.sleep_forever()
            finally:
                body_cancelled_at.append(trio.current_time())
    assert starts == [0, 1, 3]
    assert sibling_end == body_cancelled_at == [3]
    assert flaky.state is ChildState.FAILED
    assert sib.state is ChildState.CANCELLED
    assert sup.statistics().failed == 1
    assert any(r.levelno == logging.ERROR and "giving up" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(("window_s", "gives_up_at"), [(5, None), (30, 21)])
async def test_restarts_outside_the_window_do_not_count(
    autojump_clock: trio.testing.MockClock, window_s: float, gives_up_at: float | None
) -> None:
    starts: list[float] = []
    policy = RestartPolicy(max_restarts=1, window_s=window_s, backoff_base_s=1, jitter=0)
    sup: Supervisor | None = None
    try:
        async with open_supervisor() as sup:
            child = sup.start_soon("slow", failing(starts, after=10), policy=policy)
            await trio.sleep(60)
            await child.stop("enough", grace_s=0)
    except SupervisionError:
        assert trio.current_time() == gives_up_at
        assert starts == [0, 11]
    else:
        assert gives_up_at is None
        # one failure every 11 s never finds the previous restart in a 5 s
        # window: the budget and the backoff (always the first step) reset
        assert starts == [0, 11, 22, 33, 44, 55]
        assert child.state is ChildState.STOPPED
        assert sup.statistics().restarts == 5


@pytest.mark.parametrize(
    ("restart", "after_return", "after_failure"),
    [
        (Restart.PERMANENT, [0, 2, 4, 6, 8], [0, 2, 4, 6, 8]),
        (Restart.TRANSIENT, [0], [0, 2, 4, 6, 8]),
        (Restart.TEMPORARY, [0], [0]),
    ],
)
async def test_restart_types(
    autojump_clock: trio.testing.MockClock,
    restart: Restart,
    after_return: list[float],
    after_failure: list[float],
) -> None:
    policy = RestartPolicy(
        restart=restart, max_restarts=100, window_s=100, backoff_base_s=1, backoff_max_s=1, jitter=0
    )
    returned: list[float] = []
    failed: list[float] = []

    async def returns(stop: StopToken) -> None:
        returned.append(trio.current_time())
        await trio.sleep(1)

    async with open_supervisor() as sup:
        r = sup.start_soon("returns", returns, policy=policy)
        f = sup.start_soon("fails", failing(failed, after=1), policy=policy)
        await trio.sleep(9.5)
        stats = sup.statistics()
    assert returned == after_return
    assert failed == after_failure
    # a temporary child's failure is recorded, not escalated
    assert r.state is (ChildState.STOPPED if restart is Restart.PERMANENT else ChildState.EXITED)
    assert f.state is (ChildState.FAILED if restart is Restart.TEMPORARY else ChildState.STOPPED)
    assert stats.restarts == len(after_return) + len(after_failure) - 2
    assert stats.running == 2 - (restart is not Restart.PERMANENT) - (restart is Restart.TEMPORARY)


async def test_a_child_that_honours_the_stop_request_is_not_cancelled(
    autojump_clock: trio.testing.MockClock,
) -> None:
    seen: list[tuple[str, float, str | None]] = []

    async def polite(stop: StopToken) -> None:
        try:
            await stop.wait()
            seen.append(("asked", trio.current_time(), stop.reason))
            await trio.sleep(1)  # finish the current piece of work
        except trio.Cancelled:
            seen.append(("cancelled", trio.current_time(), None))
            raise
        finally:
            seen.append(("finally", trio.current_time(), None))

    async with open_supervisor(grace_s=5) as sup:
        child = sup.start_soon("polite", polite, policy=RestartPolicy(restart=Restart.PERMANENT))
        await trio.sleep(3)
        assert child.state is ChildState.RUNNING
        await child.stop("test over")
        assert trio.current_time() == 4
    assert seen == [("asked", 3, "test over"), ("finally", 4, None)]
    assert child.state is ChildState.STOPPED
    assert child.stop_reason == "test over"
    assert child.restarts == 0  # a permanent child's return after a stop request is final


async def test_a_child_that_ignores_the_stop_request_is_cancelled_at_the_grace_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    seen: list[tuple[str, float]] = []

    async def stubborn(stop: StopToken) -> None:
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            seen.append(("cancelled", trio.current_time()))
            raise
        finally:
            with trio.move_on_after(2, shield=True):
                await trio.sleep(1)  # cleanup, shielded, with its own deadline
                seen.append(("cleaned up", trio.current_time()))

    async with open_supervisor(grace_s=60) as sup:
        child = sup.start_soon("stubborn", stubborn)
        await trio.sleep(3)
        child.request_stop("test over", grace_s=5)
        assert child.state is ChildState.STOPPING
        await trio.sleep(4.5)
        assert seen == []
        await child.wait()
    assert seen == [("cancelled", 8), ("cleaned up", 9)]
    assert trio.current_time() == 9
    assert child.state is ChildState.STOPPED


async def test_a_later_stop_request_can_only_shorten_the_grace_period(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def stubborn(stop: StopToken) -> None:
        await trio.sleep_forever()

    async with open_supervisor() as sup:
        child = sup.start_soon("stubborn", stubborn)
        await trio.sleep(1)
        child.request_stop("first", grace_s=10)
        child.request_stop("second", grace_s=20)
        child.request_stop("third", grace_s=4)
        await child.wait()
        assert trio.current_time() == 5
    assert child.stop_reason == "first"


async def test_a_stop_during_backoff_ends_the_child_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    starts: list[float] = []
    policy = RestartPolicy(backoff_base_s=30, backoff_max_s=30, jitter=0)
    async with open_supervisor() as sup:
        child = sup.start_soon("flaky", failing(starts, after=1), policy=policy)
        await trio.sleep(2)
        assert child.state is ChildState.BACKOFF
        await child.stop("not needed any more")
        assert trio.current_time() == 2
    assert starts == [0]
    assert child.state is ChildState.STOPPED
    assert sup.statistics().restarts == 0


async def test_leaving_the_block_stops_children_on_the_ladder(
    autojump_clock: trio.testing.MockClock,
) -> None:
    reasons: list[str | None] = []
    ended: dict[str, float] = {}

    async def polite(stop: StopToken) -> None:
        await stop.wait()
        reasons.append(stop.reason)
        ended["polite"] = trio.current_time()

    async def stubborn(stop: StopToken) -> None:
        try:
            await trio.sleep_forever()
        finally:
            ended["stubborn"] = trio.current_time()

    async with open_supervisor(grace_s=3) as sup:
        sup.start_soon("polite", polite)
        sup.start_soon("stubborn", stubborn, grace_s=7)
        await trio.sleep(1)
    assert reasons == ["owner left"]
    assert ended == {"polite": 1, "stubborn": 8}
    assert trio.current_time() == 8
    with pytest.raises(RuntimeError, match="closing"):
        sup.start_soon("late", polite)


async def test_fail_strategy_marks_the_child_failed_and_keeps_siblings(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ticks: list[float] = []

    async def ticker(stop: StopToken) -> None:
        while not stop.requested:
            await trio.sleep(1)
            ticks.append(trio.current_time())

    starts: list[float] = []
    async with open_supervisor() as sup:
        sup.start_soon("ticker", ticker)
        bad = sup.start_soon("bad", failing(starts, after=2.5), strategy=Strategy.FAIL)
        await trio.sleep(9.5)
        assert bad.done
        assert bad.state is ChildState.FAILED
        assert str(bad.error) == "failure 1"
        assert sup.get("bad") is None
        stats = sup.statistics()
        assert (stats.running, stats.restarts, stats.failures, stats.failed) == (1, 0, 1, 1)
    # the ticker notices the stop request after its current sleep
    assert ticks == [float(t) for t in range(1, 11)]
    assert starts == [0]
    assert trio.current_time() == 10


async def test_give_up_can_mark_failed_instead_of_escalating(
    autojump_clock: trio.testing.MockClock,
) -> None:
    starts: list[float] = []
    policy = RestartPolicy(max_restarts=1, backoff_base_s=1, jitter=0)
    async with open_supervisor() as sup:
        child = sup.start_soon("flaky", failing(starts), policy=policy, give_up=Strategy.FAIL)
        await child.wait()
        assert trio.current_time() == 1
    assert starts == [0, 1]
    assert child.state is ChildState.FAILED
    assert sup.statistics().failed == 1
    with pytest.raises(ValueError, match="give_up"):
        sup.start_soon("x", failing([]), give_up=Strategy.RESTART)


async def test_escalate_strategy_reraises_the_childs_error_unwrapped(
    autojump_clock: trio.testing.MockClock,
) -> None:
    sibling_end: list[float] = []

    async def sibling(stop: StopToken) -> None:
        try:
            await trio.sleep_forever()
        finally:
            sibling_end.append(trio.current_time())

    async def invariant(stop: StopToken) -> None:
        await trio.sleep(4)
        raise AssertionError("table and disk disagree")

    with pytest.raises(AssertionError, match="table and disk disagree") as ei:
        async with open_supervisor("node") as sup:
            sup.start_soon("sibling", sibling)
            sup.start_soon("checker", invariant, strategy=Strategy.ESCALATE)
            await trio.sleep_forever()
    assert ei.value.__notes__ == ["escalated by child 'checker' of supervisor 'node'"]
    assert sibling_end == [4]
    assert sup.statistics().restarts == 0


async def test_cancelling_the_owner_tears_everything_down(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ended: list[tuple[str, float]] = []

    async def worker(stop: StopToken) -> None:
        try:
            await trio.sleep_forever()
        finally:
            ended.append(("worker", trio.current_time()))

    starts: list[float] = []
    policy = RestartPolicy(backoff_base_s=10, jitter=0)
    with trio.move_on_after(5) as scope:
        async with open_supervisor(grace_s=100) as sup:
            w = sup.start_soon("worker", worker)
            f = sup.start_soon("flaky", failing(starts, after=1), policy=policy)
            await trio.sleep_forever()
    assert scope.cancelled_caught
    assert trio.current_time() == 5  # no grace period: cancellation is immediate
    assert ended == [("worker", 5)]
    assert starts == [0]
    assert w.state is f.state is ChildState.CANCELLED
    assert sup.statistics().running == 0


async def test_keyboard_interrupt_is_never_caught(autojump_clock: trio.testing.MockClock) -> None:
    starts: list[float] = []

    async def interrupted(stop: StopToken) -> None:
        starts.append(trio.current_time())
        await trio.sleep(1)
        raise KeyboardInterrupt

    with pytest.RaisesGroup(KeyboardInterrupt):
        async with open_supervisor() as sup:
            sup.start_soon("ki", interrupted, policy=RestartPolicy(restart=Restart.PERMANENT))
            await trio.sleep_forever()
    assert starts == [0]
    assert sup.statistics().failures == 0


async def test_start_waits_for_readiness_and_restarts_report_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    incarnations: list[float] = []

    async def server(stop: StopToken, *, task_status: trio.TaskStatus[str]) -> None:
        incarnations.append(trio.current_time())
        await trio.sleep(2)  # bind, load, ...
        task_status.started(f"port-{len(incarnations)}")
        await trio.sleep(3)
        raise OSError("listener died")

    policy = RestartPolicy(backoff_base_s=1, jitter=0)
    async with open_supervisor() as sup:
        child = await sup.start("server", server, policy=policy)
        assert trio.current_time() == 2
        assert child.value == "port-1"
        assert child.state is ChildState.RUNNING
        await trio.sleep(4.5)  # failed at 5, restarted at 6, ready at 8
        assert child.state is ChildState.STARTING
        await trio.sleep(2)
        assert child.value == "port-2"
        assert child.state is ChildState.RUNNING
        await child.stop("done", grace_s=0)
    assert incarnations == [0, 6]


async def test_a_failure_before_readiness_goes_to_the_starter(
    autojump_clock: trio.testing.MockClock,
) -> None:
    attempts: list[float] = []

    async def broken(stop: StopToken, *, task_status: trio.TaskStatus[None]) -> None:
        attempts.append(trio.current_time())
        await trio.sleep(1)
        raise OSError("address in use")

    async def quitter(stop: StopToken, *, task_status: trio.TaskStatus[None]) -> None:
        await trio.sleep(1)

    async with open_supervisor() as sup:
        with pytest.raises(OSError, match="address in use"):
            await sup.start("broken", broken, policy=RestartPolicy(restart=Restart.PERMANENT))
        with pytest.raises(RuntimeError, match="started"):
            await sup.start("quitter", quitter)
        assert sup.get("broken") is None
        stats = sup.statistics()
        assert (stats.running, stats.restarts, stats.failures) == (0, 0, 1)
        # the supervisor is unharmed
        again = await sup.start("quitter2", _ready_then_wait)
        assert again.state is ChildState.RUNNING
    assert attempts == [0]
    assert trio.current_time() == 2


async def test_a_child_stopped_before_it_is_ready_fails_its_start(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def never_ready(stop: StopToken, *, task_status: trio.TaskStatus[None]) -> None:
        await stop.wait()

    async def starter(sup: Supervisor) -> None:
        with pytest.raises(RuntimeError, match="started"):
            await sup.start("slow", never_ready)

    async with open_supervisor() as sup, trio.open_nursery() as nursery:
        nursery.start_soon(starter, sup)
        await trio.sleep(1)
        child = sup.get("slow")
        assert child is not None
        assert child.state is ChildState.STARTING
        await child.stop("abandoned")
    assert child.state is ChildState.STOPPED
    assert trio.current_time() == 1


async def _ready_then_wait(stop: StopToken, *, task_status: trio.TaskStatus[None]) -> None:
    task_status.started()
    await stop.wait()


async def test_names_are_unique_among_supervised_children(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_supervisor() as sup:
        first = await sup.start("x", _ready_then_wait)
        with pytest.raises(ValueError, match="already runs a child called 'x'"):
            sup.start_soon("x", lambda stop: stop.wait())
        await first.stop("replace")
        second = await sup.start("x", _ready_then_wait)
        assert sup.get("x") is second


async def test_run_supervisor_under_nursery_start(autojump_clock: trio.testing.MockClock) -> None:
    ended: list[float] = []

    async def worker(stop: StopToken) -> None:
        await stop.wait()
        ended.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        sup: Supervisor = await nursery.start(run_supervisor, "node")
        sup.start_soon("worker", worker)
        await trio.sleep(2)
        await sup.aclose("node shutting down")
    assert ended == [2]
    assert trio.current_time() == 2

    starts: list[float] = []
    with pytest.RaisesGroup(SupervisionError):
        async with trio.open_nursery() as nursery:
            sup = await nursery.start(run_supervisor, "node")
            sup.start_soon("flaky", failing(starts), policy=RestartPolicy(max_restarts=0))
    assert starts == [2]
    assert trio.current_time() == 2


async def test_run_returns_the_jobs_result_or_raises_its_final_failure(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def answer(stop: StopToken) -> int:
        await trio.sleep(1)
        return 42

    starts: list[float] = []
    retried = RestartPolicy(max_restarts=2, window_s=100, backoff_base_s=1, jitter=0)
    async with open_supervisor("node") as sup:
        assert await sup.run("answer", answer) == 42
        assert trio.current_time() == 1
        assert sup.get("answer") is None  # ended
        with pytest.raises(ValueError, match="failure 1"):
            await sup.run("once", failing(starts))  # one-shot: no restart
        assert starts == [1]
        starts.clear()
        with pytest.raises(ValueError, match="failure 3"):
            await sup.run("retried", failing(starts), policy=retried)
        assert starts == [1, 2, 4]  # restarted twice with backoff, then given up
        sibling = sup.start_soon("sibling", lambda stop: stop.wait())
        assert sibling.state is ChildState.RUNNING  # failures never escalate
    assert sup.statistics().failed == 2


async def test_a_run_outlives_its_callers_cancellation_and_stops_with_the_supervisor(
    autojump_clock: trio.testing.MockClock,
) -> None:
    finished: list[float] = []

    async def job(stop: StopToken) -> str:
        await trio.sleep(5)
        finished.append(trio.current_time())
        return "done"

    async def endless(stop: StopToken) -> None:
        await trio.sleep_forever()

    async with open_supervisor("node", grace_s=2) as sup:
        with trio.move_on_after(1):
            await sup.run("job", job)
        assert sup.get("job") is not None  # still running, the caller is gone
        await trio.sleep(10)
        assert finished == [5]
        handle: list[ChildHandle[None]] = []

        async def caller() -> None:
            with pytest.raises(ChildStopped, match="node/endless was stopped"):
                await sup.run("endless", endless)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(caller)
            await trio.testing.wait_all_tasks_blocked()
            child = sup.get("endless")
            assert child is not None
            handle.append(child)
            await child.stop("shutting down")
    assert handle[0].state is ChildState.STOPPED
    assert handle[0].ended_at == 13  # cancelled at the end of its 2 s grace


@given(
    n=st.integers(0, 64),
    base=st.floats(0, 10),
    spread=st.floats(0, 100),
    jitter=st.floats(0, 1),
    seed=st.integers(0, 2**32),
)
def test_backoff_is_capped_exponential_shortened_by_at_most_the_jitter(
    n: int, base: float, spread: float, jitter: float, seed: int
) -> None:
    policy = RestartPolicy(backoff_base_s=base, backoff_max_s=base + spread, jitter=jitter)
    d = min(base + spread, base * 2.0**n)
    delay = policy.backoff(n, random.Random(seed))
    assert d * (1 - jitter) - 1e-9 <= delay <= d


@settings(deadline=None, max_examples=60)
@given(
    runs=st.lists(st.integers(0, 12), min_size=1, max_size=12),
    max_restarts=st.integers(0, 4),
)
def test_never_more_restarts_in_a_window_than_the_budget(
    runs: list[int], max_restarts: int
) -> None:
    """A child whose k-th run lasts runs[k] s (then the last one forever) and then
    fails: it gives up exactly at the first failure that finds `max_restarts`
    restarts in the last 10 s, and each restart waits the backoff of the
    restarts in the window."""
    policy = RestartPolicy(
        max_restarts=max_restarts, window_s=10, backoff_base_s=1, backoff_max_s=4, jitter=0
    )
    starts: list[float] = []
    failures: list[float] = []

    async def child(stop: StopToken) -> None:
        starts.append(trio.current_time())
        k = len(starts) - 1
        if k >= len(runs):
            await trio.sleep_forever()
        await trio.sleep(runs[k])
        failures.append(trio.current_time())
        raise ValueError(k)

    async def main() -> float | None:
        with trio.move_on_after(1000):
            try:
                async with open_supervisor() as sup:
                    sup.start_soon("child", child, policy=policy)
                    await trio.sleep_forever()
            except SupervisionError:
                return trio.current_time()
        return None

    gave_up_at = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))

    restarted: list[float] = []  # failure times that led to a restart
    for i, failed_at in enumerate(failures):
        in_window = [t for t in restarted if failed_at - t < 10]
        if len(in_window) >= max_restarts:
            assert gave_up_at == failed_at
            assert i == len(failures) - 1
            break
        assert starts[i + 1] == failed_at + min(4, 2 ** len(in_window))
        restarted.append(failed_at)
    else:
        assert gave_up_at is None
        assert len(starts) == len(runs) + 1
