"""Fuzz the SWIM membership core, `aenv.proto.swim` (sans-IO).

Two kinds of input. Bytes and JSON for `decode`: arbitrary bytes, arbitrary
JSON values under a valid header, and valid messages with one field mangled
(removed, retyped, out of range, oversized). The rule: `decode` returns a
message that re-encodes to itself, or raises `MessageError`, nothing else.
And sequences for a core: a member of a 5-member cluster gets any mix of
valid messages (about itself, its peers, strangers; any incarnations, any
sequence numbers), ticks and meta changes, with time moving forward. The
rules: nothing raises; it never stops being alive (it never left); its
incarnation never goes down; after a tick its next deadline is in the
future; it is suspecting exactly the members it lists as suspect; its health
score stays within Lifeguard's bounds; it only ever sends to URLs. Runs under
pytest (short: 200 examples; `AENV_FUZZ_LONG=1`: 50 000;
`AENV_FUZZ_EXAMPLES=N`: N) or standalone with `python fuzz/fuzz_swim.py`.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable
from typing import Any

from _harness import FUZZ, main
from hypothesis import event, given
from hypothesis import strategies as st

from aenv.proto.swim import (
    Ack,
    Alive,
    Dead,
    Gossip,
    Left,
    MemberState,
    Message,
    MessageError,
    Nack,
    Ping,
    PingReq,
    StateEntry,
    Suspect,
    Swim,
    SwimConfig,
    Sync,
    SyncReply,
    decode,
    encode,
    is_member_url,
)

NAMES = ["me", "p1", "p2", "p3", "p4", "stranger"]


def url(name: str) -> str:
    return f"http://{name}.fuzz:8000"


json_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
names = st.sampled_from(NAMES)
small = st.integers(0, 6)
metas = st.dictionaries(st.sampled_from(["load", "draining", "x"]), st.integers(0, 9), max_size=2)
updates = st.one_of(
    st.builds(Alive, names, names.map(url), small, metas),
    st.builds(Suspect, names, small, names),
    st.builds(Dead, names, small, names),
    st.builds(Left, names, small),
)
ups = st.lists(updates, max_size=4).map(tuple)
entries = st.builds(StateEntry, names, names.map(url), small, st.sampled_from(MemberState), metas)
messages: st.SearchStrategy[Message] = st.one_of(
    st.builds(Ping, st.integers(0, 40), names, ups),
    st.builds(Ack, st.integers(0, 40), ups),
    st.builds(Nack, st.integers(0, 40), ups),
    st.builds(PingReq, st.integers(0, 40), names, names.map(url), st.floats(0, 2), ups),
    st.builds(Gossip, ups),
    st.builds(Sync, st.lists(entries, max_size=6).map(tuple)),
    st.builds(SyncReply, st.lists(entries, max_size=6).map(tuple)),
)


# -- decode -----------------------------------------------------------------------


def _decode(data: str | bytes) -> None:
    try:
        m = decode(data)
    except MessageError as e:
        assert str(e)
        event("rejected")
        return
    event(f"decoded {type(m).__name__}")
    assert decode(encode(m)) == m


@FUZZ
@given(data=st.binary(max_size=200))
def test_decode_bytes(data: bytes) -> None:
    _decode(data)


@FUZZ
@given(kind=st.sampled_from(["ping", "ack", "nack", "ping-req", "gossip", "sync", "sync-reply",
                             "x"]), body=st.dictionaries(st.text(max_size=8), json_values))  # fmt: skip
def test_decode_json_under_a_header(kind: str, body: dict[str, Any]) -> None:
    _decode(json.dumps({**body, "v": 1, "t": kind}))


@st.composite
def mangled(draw: st.DrawFn) -> str:
    obj: dict[str, Any] = draw(messages).to_json()
    paths: list[tuple[dict[str, Any], str]] = []

    def walk(o: Any) -> None:
        if isinstance(o, dict):
            for k, v in o.items():
                paths.append((o, k))
                walk(v)
        elif isinstance(o, list):
            for v in o:
                walk(v)

    walk(obj)
    where, key = draw(st.sampled_from(paths))
    how = draw(st.sampled_from(["drop", "retype", "range", "huge"]))
    if how == "drop":
        del where[key]
    elif how == "retype":
        where[key] = draw(json_values)
    elif how == "range":
        where[key] = draw(st.sampled_from([-1, 2**53, 1e300, True, "", " ", "a b", "ftp://x"]))
    else:
        where[key] = "x" * draw(st.integers(100, 20_000))
    return json.dumps(obj)


@FUZZ
@given(text=mangled())
def test_decode_near_valid(text: str) -> None:
    _decode(text)


# -- a core under any sequence --------------------------------------------------------


Step = tuple[str, float, Any]
steps = st.lists(
    st.one_of(
        st.tuples(st.just("receive"), st.floats(0, 3), st.tuples(names, messages)),
        st.tuples(st.just("tick"), st.floats(0, 3), st.none()),
        st.tuples(st.just("meta"), st.floats(0, 1), metas),
    ),
    max_size=40,
)


def _check(core: Swim, now: float, inc: int) -> int:
    me = core.member("me")
    assert me is not None and me.state is MemberState.ALIVE
    assert core.incarnation >= inc
    assert 0 <= core.health_score < core.config.awareness_max_multiplier
    for m in core.members():
        assert m.state in MemberState
        assert (core.suspicion_deadline(m.id) is not None) == (m.state is MemberState.SUSPECT)
    return core.incarnation


@FUZZ
@given(script=steps, seed=st.integers(0, 2**16))
def test_core_survives_any_sequence(script: list[Step], seed: int) -> None:
    core = Swim("me", url("me"), {"load": 0}, SwimConfig(), random.Random(seed))
    core.restore(0.0, [StateEntry(n, url(n), 0, MemberState.ALIVE, {}) for n in NAMES[1:5]])
    core.join(0.0, [url("p1")])
    now, inc = 0.0, 0
    for what, dt, arg in script:
        now += dt
        if what == "receive":
            sender, message = arg
            sends = core.receive(now, url(sender), message)
        elif what == "tick":
            now = max(now, core.next_deadline())
            sends = core.tick(now)
            assert core.next_deadline() > now
        else:
            core.set_meta(now, arg)
            sends = []
        assert all(is_member_url(s.url) for s in sends)
        for s in sends:
            assert decode(encode(s.message)) == s.message
        core.drain_events()
        inc = _check(core, now, inc)


TESTS: tuple[Callable[[], None], ...] = (
    test_decode_bytes,
    test_decode_json_under_a_header,
    test_decode_near_valid,
    test_core_survives_any_sequence,
)


if __name__ == "__main__":
    sys.exit(main(TESTS, __doc__ or ""))
