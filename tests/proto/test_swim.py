"""The SWIM core (aenv.proto.swim): membership as the shell would see it.

Rules: no IO and no real time. The first tests drive cores by hand, handing
one core's `Send`s to another at explicit times; the rest run a cluster in
`tests/proto/swim_sim.py` (virtual clock, seeded, so every run is the same).
Timing *targets* live in bench/swim.py; the bounds here are the protocol's
own (a suspicion cannot end before its minimum timeout; every member must
know of a death within a bound derived from the timeouts).
"""

from __future__ import annotations

import json
import math
import random
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aenv.proto.swim import (
    MAX_META_BYTES,
    Ack,
    Alive,
    Dead,
    EventKind,
    Gossip,
    Left,
    MemberState,
    Message,
    MessageError,
    Nack,
    Ping,
    PingReq,
    Send,
    StateEntry,
    Suspect,
    Swim,
    SwimConfig,
    Sync,
    SyncReply,
    decode,
    encode,
    message_from_json,
    suspicion_timeout,
)
from tests.proto.swim_sim import SimNetwork, url_of

ALIVE, SUSPECT, DEAD, LEFT = (
    MemberState.ALIVE,
    MemberState.SUSPECT,
    MemberState.DEAD,
    MemberState.LEFT,
)


def core(name: str, **config: Any) -> Swim:
    return Swim(name, url_of(name), {"name": name}, SwimConfig(**config), random.Random(name))


def cluster(names: list[str], now: float = 0.0, **config: Any) -> dict[str, Swim]:
    """Cores that already know each other (as after a converged join)."""
    cores = {n: core(n, **config) for n in names}
    entries = [StateEntry(n, url_of(n), 0, ALIVE, {"name": n}) for n in names]
    for c in cores.values():
        c.restore(now, entries)
        c.join(now, [])
    return cores


def kinds(c: Swim) -> list[tuple[EventKind, str]]:
    return [(e.kind, e.member.id) for e in c.drain_events()]


def only(sends: list[Send], kind: type[Message]) -> list[Send]:
    return [s for s in sends if isinstance(s.message, kind)]


# -- by hand ------------------------------------------------------------------------


def test_join_through_a_seed_exchanges_full_state() -> None:
    a, b = core("a"), core("b")
    assert a.join(0.0, []) == []
    # b's own URL among the seeds is skipped
    sends = b.join(1.0, [url_of("a"), url_of("b")])
    assert [s.url for s in sends] == [url_of("a")]
    sync = sends[0].message
    assert isinstance(sync, Sync)
    assert sync.members == (StateEntry("b", url_of("b"), 0, ALIVE, {"name": "b"}),)

    replies = a.receive(1.01, url_of("b"), sync)
    assert [s.url for s in replies] == [url_of("b")]
    assert isinstance(replies[0].message, SyncReply)
    assert kinds(a) == [(EventKind.JOINED, "b")]

    assert b.receive(1.02, url_of("a"), replies[0].message) == []
    assert kinds(b) == [(EventKind.JOINED, "a")]
    assert [(m.id, m.state, m.meta) for m in b.members()] == [
        ("a", ALIVE, {"name": "a"}),
        ("b", ALIVE, {"name": "b"}),
    ]
    # a announces b to the cluster: its next gossip carries b's alive state
    gossip = only(a.tick(a.next_deadline()), Gossip)
    assert gossip and Alive("b", url_of("b"), 0, {"name": "b"}) in gossip[0].message.updates


def test_join_retries_the_seeds_until_someone_answers() -> None:
    b = core("b", join_retry_interval=2.0)
    assert len(b.join(0.0, [url_of("a")])) == 1
    retries = []
    now = 0.0
    while now < 7.0:
        now = b.next_deadline()
        retries += [s.url for s in only(b.tick(now), Sync)]
    assert retries.count(url_of("a")) >= 3


def test_a_probe_answered_keeps_the_member_alive_and_health_good() -> None:
    cores = cluster(["a", "b"])
    a, b = cores["a"], cores["b"]
    t = a.next_deadline()
    pings = only(a.tick(t), Ping)
    assert [s.url for s in pings] == [url_of("b")]
    ping = pings[0].message
    assert isinstance(ping, Ping) and ping.target == "b"
    acks = b.receive(t + 0.01, url_of("a"), ping)
    assert [type(s.message) for s in acks] == [Ack] and acks[0].url == url_of("a")
    a.receive(t + 0.02, url_of("b"), acks[0].message)
    # past the probe's timeout and interval: nothing more to do for that probe
    assert only(a.tick(t + 0.6), PingReq) == []
    a.tick(t + 1.0)
    assert a.member("b").state is ALIVE  # type: ignore[union-attr]
    assert a.health_score == 0
    stats = a.statistics()
    assert stats.probes >= 1 and stats.probes_failed == 0


def test_a_ping_for_another_member_is_not_answered() -> None:
    b = core("b")
    b.join(0.0, [])
    assert b.receive(0.1, url_of("a"), Ping(1, "old-b")) == []
    assert b.statistics().misdirected == 1


def _first_probe(a: Swim, now: float) -> tuple[float, Send]:
    while True:
        now = a.next_deadline()
        pings = only(a.tick(now), Ping)
        if pings:
            return now, pings[0]


def test_no_answer_means_indirect_probes_then_suspicion_and_lower_health() -> None:
    cores = cluster(["a", "b", "c", "d"])
    a = cores["a"]
    t, ping = _first_probe(a, 0.0)
    target = ping.message.target  # type: ignore[union-attr]
    helpers = sorted({"b", "c", "d"} - {target})
    # no ack by the probe timeout: ping-reqs to the other two, and one more direct ping
    sends = a.tick(t + 0.5)
    reqs = only(sends, PingReq)
    assert sorted(s.url for s in reqs) == [url_of(h) for h in helpers]
    assert all(r.message.target == target for r in reqs)  # type: ignore[union-attr]
    assert [s.url for s in only(sends, Ping)] == [url_of(target)]
    # nobody answered, not even the helpers with a nack: maybe it is us
    a.tick(t + 1.0)
    assert a.member(target).state is SUSPECT  # type: ignore[union-attr]
    assert (EventKind.SUSPECT, target) in kinds(a)
    assert a.health_score == 2  # two nacks were missing
    assert a.statistics().probes_failed == 1


def test_low_health_widens_the_probe_timeout_and_interval() -> None:
    cores = cluster(["a", "b", "c", "d"])
    a = cores["a"]
    t, _ = _first_probe(a, 0.0)
    a.tick(t + 0.5)
    # the first probe fails (no nacks either) and the next one starts at once
    (ping,) = only(a.tick(t + 1.0), Ping)
    assert a.health_score == 2  # timeouts now scale by 3
    second = ping.message.target  # type: ignore[union-attr]
    assert only(a.tick(t + 1.5), PingReq) == []
    # timeout 1.5 s; one helper: the first target, now suspect, is none
    assert len(only(a.tick(t + 2.5), PingReq)) == 1
    a.tick(t + 3.99)
    assert a.member(second).state is ALIVE  # type: ignore[union-attr]
    a.tick(t + 4.0)  # interval 3 s
    assert a.member(second).state is SUSPECT  # type: ignore[union-attr]


def test_helpers_that_nack_show_the_target_is_the_problem() -> None:
    cores = cluster(["a", "b", "c", "d"])
    a = cores["a"]
    t, ping = _first_probe(a, 0.0)
    target = ping.message.target  # type: ignore[union-attr]
    for req in only(a.tick(t + 0.5), PingReq):
        helper = cores[req.url.split("//")[1].split(".")[0]]
        relayed = helper.receive(t + 0.51, url_of("a"), req.message)
        assert [s.url for s in relayed] == [url_of(target)]  # the helper pings the target
        # the target stays silent: the helper nacks in time for the prober's deadline
        nack_at = t + 0.51 + req.message.timeout  # type: ignore[union-attr]
        assert nack_at < t + 1.0
        assert only(helper.tick(nack_at - 0.001), Nack) == []
        nacks = only(helper.tick(nack_at), Nack)
        assert [s.url for s in nacks] == [url_of("a")]
        a.receive(nack_at + 0.01, req.url, nacks[0].message)
    a.tick(t + 1.0)
    assert a.member(target).state is SUSPECT  # type: ignore[union-attr]
    assert a.health_score == 0


def test_an_ack_through_a_helper_saves_the_target() -> None:
    cores = cluster(["a", "b", "c"])
    a = cores["a"]
    t, ping = _first_probe(a, 0.0)
    target = ping.message.target  # type: ignore[union-attr]
    helper_name = ({"b", "c"} - {target}).pop()
    helper, tgt = cores[helper_name], cores[target]
    (req,) = only(a.tick(t + 0.5), PingReq)
    (relay,) = helper.receive(t + 0.51, url_of("a"), req.message)
    (ack,) = only(tgt.receive(t + 0.52, url_of(helper_name), relay.message), Ack)
    (forwarded,) = only(helper.receive(t + 0.53, url_of(target), ack.message), Ack)
    assert forwarded.url == url_of("a")
    assert forwarded.message.seq == ping.message.seq  # type: ignore[union-attr]
    a.receive(t + 0.54, url_of(helper_name), forwarded.message)
    a.tick(t + 1.0)
    assert a.member(target).state is ALIVE  # type: ignore[union-attr]
    assert a.statistics().probes_failed == 0


def test_a_suspicion_is_refuted_with_a_higher_incarnation() -> None:
    cores = cluster(["a", "b", "c"])
    a, b = cores["a"], cores["b"]
    rumour = Gossip((Suspect("b", 0, "c"),))
    a.receive(1.0, url_of("c"), rumour)
    assert a.member("b").state is SUSPECT  # type: ignore[union-attr]
    assert kinds(a) == [(EventKind.SUSPECT, "b")]
    # b hears it and outbids it; local health notes that b was suspected
    b.receive(1.1, url_of("c"), rumour)
    assert b.incarnation == 1 and b.health_score == 1
    assert b.statistics().refutations == 1
    # its next answer carries the refutation
    (ack,) = b.receive(1.2, url_of("a"), Ping(99, "b"))
    assert Alive("b", url_of("b"), 1, {"name": "b"}) in ack.message.updates  # type: ignore[union-attr]
    a.receive(1.3, url_of("b"), ack.message)
    member = a.member("b")
    assert member is not None and (member.state, member.incarnation) == (ALIVE, 1)
    assert kinds(a) == [(EventKind.ALIVE, "b")]
    # an old suspicion (incarnation 0) no longer sticks
    a.receive(1.4, url_of("c"), rumour)
    assert a.member("b").state is ALIVE  # type: ignore[union-attr]


def test_a_probe_of_a_suspect_tells_it_first() -> None:
    """Lifeguard's buddy system: the suspect learns of the suspicion from the probe."""
    cores = cluster(["a", "b", "c"])
    a = cores["a"]
    a.receive(0.0, url_of("c"), Gossip((Suspect("b", 0, "c"),)))
    now = 0.0
    for _ in range(10):
        now = a.next_deadline()
        pings = [s for s in only(a.tick(now), Ping) if s.url == url_of("b")]
        if pings:
            break
    assert pings, "a never probed b"
    assert pings[0].message.updates[0] == Suspect("b", 0, "a")  # type: ignore[union-attr]


def test_suspicion_timeout_starts_at_max_and_shrinks_with_confirmations() -> None:
    names = ["a", "b", "c", "d", "e", "f"]
    a = cluster(names)["a"]
    lo = suspicion_timeout(4, 6, 1.0)  # 4 * max(1, log10(6)) * 1 s
    hi = 6 * lo
    assert lo == 4.0  # log10(6) < 1: the floor of one
    a.receive(10.0, url_of("c"), Gossip((Suspect("b", 0, "c"),)))
    assert a.suspicion_deadline("b") == pytest.approx(10.0 + hi)
    a.receive(11.0, url_of("d"), Gossip((Suspect("b", 0, "d"),)))
    one = hi - math.log(2) / math.log(3) * (hi - lo)  # k = suspicion_mult - 2 = 2
    assert a.suspicion_deadline("b") == pytest.approx(10.0 + one)
    a.receive(11.5, url_of("c"), Gossip((Suspect("b", 0, "c"),)))  # not independent
    assert a.suspicion_deadline("b") == pytest.approx(10.0 + one)
    a.receive(12.0, url_of("e"), Gossip((Suspect("b", 0, "e"),)))
    assert a.suspicion_deadline("b") == pytest.approx(10.0 + lo)
    kinds(a)
    a.tick(10.0 + lo - 0.01)
    assert a.member("b").state is SUSPECT  # type: ignore[union-attr]
    a.tick(10.0 + lo)
    assert a.member("b").state is DEAD  # type: ignore[union-attr]
    assert (EventKind.DEAD, "b") in kinds(a)
    assert a.suspicion_deadline("b") is None


def test_a_member_told_it_is_dead_refutes_unless_it_is_leaving() -> None:
    b = cluster(["a", "b"])["b"]
    b.receive(1.0, url_of("a"), Gossip((Dead("b", 0, "a"),)))
    assert b.incarnation == 1
    b.leave(2.0)
    b.receive(3.0, url_of("a"), Gossip((Dead("b", 1, "a"), Suspect("b", 1, "a"))))
    assert b.incarnation == 1 and b.member("b").state is LEFT  # type: ignore[union-attr]


def test_set_meta_rejects_what_cannot_be_gossiped() -> None:
    a = core("a")
    a.join(0.0, [])
    with pytest.raises(ValueError, match="larger"):
        a.set_meta(1.0, {"x": "y" * MAX_META_BYTES})
    with pytest.raises(ValueError, match="JSON"):
        a.set_meta(1.0, {"x": object()})
    with pytest.raises(ValueError, match="JSON"):
        a.set_meta(1.0, {"x": float("nan")})
    assert a.incarnation == 0 and a.member("a").meta == {"name": "a"}  # type: ignore[union-attr]
    a.set_meta(2.0, {"load": {"cpu": 0.5}})
    assert a.incarnation == 1 and a.member("a").meta == {"load": {"cpu": 0.5}}  # type: ignore[union-attr]


# -- the wire -----------------------------------------------------------------------


def test_messages_round_trip_as_compact_json() -> None:
    msgs: list[Message] = [
        Ping(1, "b", (Alive("a", "http://a:1", 3, {"cpu": 2}), Suspect("c", 1, "a"))),
        Ack(1, (Dead("c", 1, "a"), Left("d", 7))),
        Nack(2),
        PingReq(3, "b", "https://b.example:8443/x", 0.4),
        Gossip(),
        Sync((StateEntry("a", "ws://a:1", 0, ALIVE, {"k": [1, 2]}),)),
        SyncReply((StateEntry("z", "wss://z:1", 9, DEAD, {}),)),
    ]
    for m in msgs:
        text = encode(m)
        assert " " not in text
        assert decode(text) == m
        assert decode(text.encode()) == m


BAD: list[tuple[str, str]] = [
    ("not json", "not JSON"),
    ("[1, 2]", "object"),
    ('{"v": 2, "t": "ping", "seq": 1, "target": "b"}', "version"),
    ('{"v": true, "t": "ping", "seq": 1, "target": "b"}', "version"),
    ('{"v": 1, "t": "pong"}', "unknown type"),
    ('{"v": 1, "t": ["ping"]}', "unknown type"),
    ('{"v": 1, "t": "ping", "target": "b"}', "missing 'seq'"),
    ('{"v": 1, "t": "ping", "seq": -1, "target": "b"}', "'seq'"),
    ('{"v": 1, "t": "ping", "seq": true, "target": "b"}', "'seq'"),
    ('{"v": 1, "t": "ping", "seq": 1.0, "target": "b"}', "'seq'"),
    ('{"v": 1, "t": "ping", "seq": 9007199254740992, "target": "b"}', "'seq'"),
    ('{"v": 1, "t": "ping", "seq": 1, "target": "b c"}', "member id"),
    ('{"v": 1, "t": "ping", "seq": 1, "target": ""}', "member id"),
    ('{"v": 1, "t": "ping", "seq": 1, "target": "b", "u": {}}', "list"),
    ('{"v": 1, "t": "ping", "seq": 1, "target": "b", "u": [{"t": "zombie"}]}', "update type"),
    ('{"v": 1, "t": "ack", "seq": 1, "u": [{"t": "left", "id": "d"}]}', "missing 'inc'"),
    ('{"v": 1, "t": "ack", "seq": 1, "u": [{"t": "alive", "id": "a", "url": "ftp://a", '
     '"inc": 1, "meta": {}}]}', "member URL"),
    ('{"v": 1, "t": "ack", "seq": 1, "u": [{"t": "alive", "id": "a", "url": "http://a", '
     '"inc": 1, "meta": []}]}', "object"),
    ('{"v": 1, "t": "ping-req", "seq": 1, "target": "b", "target_url": "http://b", '
     '"timeout": 1e9}', "seconds"),
    ('{"v": 1, "t": "ping-req", "seq": 1, "target": "b", "target_url": "http://b", '
     '"timeout": NaN}', "not JSON"),
    ('{"v": 1, "t": "sync", "members": [{"id": "a", "url": "http://a", "inc": 0, '
     '"state": "zombie", "meta": {}}]}', "state"),
    ('{"v": 1, "t": "sync"}', "missing 'members'"),
    ('{"v": 1, "t": "ack", "seq": 1' + "]" * 5, "not JSON"),
    ("[" * 100_000 + "]" * 100_000, "not JSON"),
    ('{"v": 1, "t": "ack", "seq": ' + "9" * 5000 + "}", "not JSON"),
    (b'{"v": 1, "t": "ack", "seq": 1, "x": "\xff"}'.decode("latin-1"), ""),  # latin-1 str is fine
]  # fmt: skip


@pytest.mark.parametrize(("text", "why"), BAD[:-1])
def test_malformed_messages_raise_a_clear_error(text: str, why: str) -> None:
    with pytest.raises(MessageError, match=why):
        decode(text)


def test_invalid_utf8_and_oversized_messages_are_refused() -> None:
    with pytest.raises(MessageError, match="not JSON"):
        decode(b'{"v": 1, "t": "ack", "seq": 1, "x": "\xff"}')
    with pytest.raises(MessageError, match="larger than 64 bytes"):
        decode(encode(Gossip((Left("a" * 100, 1),))), max_bytes=64)
    meta = {"x": "y" * MAX_META_BYTES}
    big = json.dumps({"v": 1, "t": "gossip", "u": [
        {"t": "alive", "id": "a", "url": "http://a", "inc": 1, "meta": meta}]})  # fmt: skip
    with pytest.raises(MessageError, match="larger than"):
        decode(big)


def test_unknown_fields_are_ignored_for_newer_members() -> None:
    assert decode('{"v": 1, "t": "nack", "seq": 4, "future": [1]}') == Nack(4)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)
kinds_ = st.sampled_from(["ping", "ack", "nack", "ping-req", "gossip", "sync", "sync-reply"])


@given(st.dictionaries(st.sampled_from(["t", "seq", "target", "u", "members", "timeout",
                                         "target_url", "x"]), json_values), kinds_)  # fmt: skip
def test_garbage_raises_only_message_error(obj: dict[str, Any], kind: str) -> None:
    obj = {"v": 1, "t": kind, **obj}
    try:
        m = message_from_json(obj)
    except MessageError:
        return
    assert decode(encode(m)) == m


ids = st.from_regex(r"[a-z0-9][a-z0-9.-]{0,20}", fullmatch=True)
urls = ids.map(lambda h: f"http://{h}:8000")
ints = st.integers(0, 2**53 - 1)
metas = st.dictionaries(st.text(max_size=8), json_values, max_size=4)
updates = st.one_of(
    st.builds(Alive, ids, urls, ints, metas),
    st.builds(Suspect, ids, ints, ids),
    st.builds(Dead, ids, ints, ids),
    st.builds(Left, ids, ints),
)
ups = st.lists(updates, max_size=5).map(tuple)
messages = st.one_of(
    st.builds(Ping, ints, ids, ups),
    st.builds(Ack, ints, ups),
    st.builds(PingReq, ints, ids, urls, st.floats(0, 60), ups),
    st.builds(Sync, st.lists(st.builds(StateEntry, ids, urls, ints,
                                       st.sampled_from(MemberState), metas)).map(tuple)),
)  # fmt: skip


@given(messages)
def test_any_valid_message_round_trips(m: Message) -> None:
    assert decode(encode(m)) == m


# -- a simulated cluster --------------------------------------------------------------


def test_members_joining_through_seeds_converge() -> None:
    net = SimNetwork(seed=1)
    names = [f"n{i:02d}" for i in range(12)]
    for n in names:
        net.add(n, {"name": n})
    net.join("n00", [])
    for i, n in enumerate(names[1:], 1):
        net.join(n, [names[(i - 1) // 2]])  # a tree of seeds
        net.run_for(0.1)
    net.run_for(5.0)
    for o in names:
        assert [(m.id, m.state) for m in net.nodes[o].swim.members()] == [(n, ALIVE) for n in names]
    assert not [e for e in net.log if e.kind is not EventKind.JOINED]


def test_indirect_probes_save_a_member_behind_a_lossy_link() -> None:
    net = SimNetwork(seed=2)
    net.bootstrap([f"n{i}" for i in range(5)])
    net.set_link_loss("n0", "n1", 1.0)
    net.run_until(120.0)
    assert [e for e in net.log if e.kind is not EventKind.JOINED] == []
    for a, b in (("n0", "n1"), ("n1", "n0")):
        stats = net.nodes[a].swim.statistics()
        assert stats.indirect_probes >= 10 and stats.probes_failed == 0
        assert net.view(a, b) is ALIVE


def test_a_killed_member_is_suspected_then_declared_dead_by_all() -> None:
    net = SimNetwork(seed=3)
    names = [f"n{i}" for i in range(5)]
    net.bootstrap(names)
    net.run_until(5.0)
    net.kill("n2")
    net.run_until(40.0)
    suspected = net.learned("n2", [EventKind.SUSPECT])
    dead = net.learned("n2", [EventKind.DEAD])
    assert set(dead) == {"n0", "n1", "n3", "n4"}
    # nobody declared it dead before the minimum suspicion timeout
    lo = suspicion_timeout(4, 5, 1.0)
    assert min(dead.values()) >= min(suspected.values()) + lo
    assert max(dead.values()) - 5.0 < 6 * lo + 3.0
    assert not [e for e in net.log if e.kind in (EventKind.SUSPECT, EventKind.DEAD)
                and e.member.id != "n2"]  # fmt: skip


def test_a_member_that_leaves_is_left_everywhere_then_forgotten() -> None:
    net = SimNetwork(seed=4, config=SwimConfig(reap_after=20.0))
    names = [f"n{i}" for i in range(6)]
    net.bootstrap(names)
    net.run_until(5.0)
    net.leave("n3")
    net.run_until(8.0)
    for o in names:
        if o != "n3":
            assert net.view(o, "n3") is LEFT
    probes = net.nodes["n3"].swim.statistics().probes
    assert net.nodes["n3"].swim.statistics().pending_updates == 0
    net.run_until(30.0)
    assert net.nodes["n3"].swim.statistics().probes == probes  # it stopped probing
    about = {e.kind for e in net.log if e.member.id == "n3"}
    assert about == {EventKind.LEFT, EventKind.REMOVED}
    for o in names:
        if o != "n3":
            assert net.view(o, "n3") is None


def test_a_meta_update_reaches_every_member() -> None:
    net = SimNetwork(seed=5, loss=0.05)
    names = [f"n{i:02d}" for i in range(30)]
    net.bootstrap(names, meta={"draining": False})
    net.run_until(5.0)
    net.set_meta("n07", {"draining": True, "load": {"cpu": 0.9, "sandboxes": 12}})
    net.run_until(8.0)
    for o in names:
        m = net.nodes[o].swim.member("n07")
        assert m is not None and m.incarnation == 1 and m.meta["draining"] is True
    updated = [e.observer for e in net.log if e.kind is EventKind.UPDATED]
    assert sorted(updated) == [o for o in names if o != "n07"]


def test_push_pull_heals_a_partition() -> None:
    # no gossip to the dead: after the split only push-pull crosses over
    config = SwimConfig(push_pull_interval=5.0, gossip_to_the_dead=0.0)
    net = SimNetwork(seed=6, config=config)
    left, right = [f"l{i}" for i in range(5)], [f"r{i}" for i in range(5)]
    net.bootstrap(left + right)
    net.run_until(2.0)
    net.partition(left, right)
    net.run_until(60.0)
    for a, b in ((left, right), (right, left)):
        for o in a:
            assert {net.view(o, x) for x in b} == {DEAD}
            assert {net.view(o, x) for x in a} == {ALIVE}
    net.heal()
    healed = net.run_until(60.0 + 4 * 5.0, stop=lambda: all(
        net.view(o, x) is ALIVE for o in left + right for x in left + right))  # fmt: skip
    assert healed


def test_a_partition_longer_than_reaping_heals_through_the_seeds() -> None:
    config = SwimConfig(push_pull_interval=5.0, gossip_to_the_dead=0.0, reap_after=20.0)
    net = SimNetwork(seed=7, config=config)
    names = [f"n{i}" for i in range(8)]
    for n in names:
        net.add(n)
    net.join("n0", [])
    for n in names[1:]:
        net.join(n, ["n0"])
    net.run_until(5.0)
    net.partition(names[:4], names[4:])
    net.run_until(90.0)
    assert net.nodes["n5"].swim.member("n0") is None  # forgotten
    net.heal()
    healed = net.run_until(90.0 + 30.0, stop=lambda: all(
        net.view(o, x) is ALIVE for o in names for x in names))  # fmt: skip
    assert healed


def test_a_restarted_member_outbids_its_own_death() -> None:
    net = SimNetwork(seed=8)
    names = [f"n{i}" for i in range(6)]
    net.bootstrap(names)
    net.run_until(2.0)
    net.kill("n4")
    assert net.run_until(60.0, stop=lambda: all(net.view(o, "n4") is DEAD
                                               for o in names if o != "n4"))  # fmt: skip
    swim = net.restart("n4", ["n0"])
    assert net.run_for(10.0, stop=lambda: all(net.view(o, "n4") is ALIVE for o in names))
    assert swim.incarnation >= 1
    back = [e for e in net.log if e.member.id == "n4" and e.kind is EventKind.JOINED]
    assert {e.observer for e in back} == {"n0", "n1", "n2", "n3", "n5"}


def test_lifeguard_keeps_a_slow_member_from_accusing_the_others() -> None:
    """A member that handles every message 1.2 s late (starved of CPU) misses its
    acks. Local health stretches its probes until the acks fit; without it, it
    suspects about every member it probes."""
    falsely: dict[bool, int] = {}
    for lifeguard in (True, False):
        config = SwimConfig(awareness_max_multiplier=8 if lifeguard else 1)
        net = SimNetwork(seed=11, config=config, wire="off")
        names = [f"n{i:02d}" for i in range(30)]
        net.bootstrap(names)
        net.run_until(5.0)
        net.set_slow("n05", 1.2)
        net.run_until(65.0)
        accused = {(e.member.id, e.member.incarnation) for e in net.log
                   if e.kind is EventKind.SUSPECT and e.member.id != "n05"}  # fmt: skip
        falsely[lifeguard] = len(accused)
        assert not [e for e in net.log if e.kind is EventKind.DEAD]
        if lifeguard:
            assert net.nodes["n05"].swim.health_score > 0
    assert falsely[True] <= 2
    assert falsely[False] >= 30


def _failure_run(n: int, loss: float, seed: int) -> tuple[SimNetwork, str, float]:
    net = SimNetwork(seed=seed, loss=loss, wire="size")
    names = [f"n{i:04d}" for i in range(n)]
    net.bootstrap(names, meta={"draining": False, "load": {"cpu": 0.1, "sandboxes": 3}})
    net.run_until(10.0)
    victim = names[n // 3]
    net.kill(victim)
    others = [o for o in names if o != victim]
    # minimum suspicion timeout + time to a first failed probe + dissemination
    bound = suspicion_timeout(4, n, 1.0) + 10.0
    net.run_until(10.0 + bound, stop=lambda: all(net.view(o, victim) is DEAD for o in others))
    return net, victim, bound


def _assert_detected(net: SimNetwork, victim: str, bound: float) -> None:
    others = [o for o in net.nodes if o != victim]
    dead = net.learned(victim, [EventKind.DEAD])
    assert set(dead) == set(others), f"{len(others) - len(dead)} members never learned"
    assert max(dead.values()) - 10.0 <= bound
    false_deaths = [e for e in net.log if e.kind is EventKind.DEAD and e.member.id != victim]
    assert false_deaths == []


def test_150_members_at_5_percent_loss_all_learn_of_a_death_and_none_die_wrongly() -> None:
    net, victim, bound = _failure_run(150, 0.05, seed=9)
    _assert_detected(net, victim, bound)


@pytest.mark.slow
def test_1000_members_at_5_percent_loss() -> None:
    net, victim, bound = _failure_run(1000, 0.05, seed=10)
    _assert_detected(net, victim, bound)
