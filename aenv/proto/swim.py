"""Cluster membership: SWIM with the Lifeguard extensions, as a sans-IO core.

Each node runs one `Swim`. It knows every member's id, URL, incarnation,
state (alive, suspect, dead, left) and meta (an opaque JSON object the member
owns: capacity, load, cached templates, draining). The shell (a trio task
with WebSocket connections) drives it with three calls and the time:

- `tick(now)` when `next_deadline()` is reached,
- `receive(now, sender, message)` for each message that arrives,
- `join`, `leave` and `set_meta` when the node starts, stops or changes;

each returns the `Send`s (a target URL and a message) to carry out, and
`drain_events()` says what changed (joined, updated, suspect, alive again,
dead, left, removed). Nothing here reads a clock, opens a socket or sleeps;
the randomness comes from the `rng` given.

The protocol is the one HashiCorp memberlist runs, with its LAN defaults:
every `probe_interval` a member pings the next one of a shuffled round-robin
list; without an ack within `probe_timeout` it asks `indirect_checks` others
to ping it (ping-req) and pings it once more itself; without any ack by the
end of the interval it suspects it. Suspicion is refuted by the suspect
itself, which gossips its alive state with a higher incarnation; otherwise
the suspect is declared dead when its suspicion times out. Updates (alive,
suspect, dead, left) ride piggyback on every message, each retransmitted
`retransmit_mult * ceil(log10(n + 1))` times, and are also gossiped to
`gossip_nodes` random members every `gossip_interval` while any are pending.
Every `push_pull_interval` (scaled up beyond 32 members) a member exchanges
its full state with a random member (`Sync`/`SyncReply`), which repairs what
gossip missed and heals partitions; joining is such an exchange with the
seeds. A member that leaves gossips `left`; dead and left members stay
listed for `reap_after` seconds, then are forgotten.

Lifeguard (Dadgar, Phillips, Currey: "Lifeguard: Local Health Awareness for
More Accurate Failure Detection", 2018) adds three things, all here:
local health (a score raised by failed probes whose helpers did not answer
either, and by having to refute a suspicion about oneself; lowered by each
successful probe) that multiplies the probe interval and timeout, so a slow
node accuses less; suspicion timeouts that start at
`suspicion_max_timeout_mult` times the minimum and shrink towards the
minimum, `suspicion_mult * max(1, log10(n)) * probe_interval`, as
independent members confirm the suspicion; and the buddy system: a probe of
a suspect carries the suspicion, so the suspect learns of it at once.

Messages are frozen dataclasses with `to_json()`/`from_json()`, `encode()`
and `decode()` for the wire (JSON text). Input from the network is checked
strictly: a malformed, oversized or out-of-range message raises
`MessageError` and never reaches the state. Authentication is the shell's:
`receive` trusts that `sender` is the URL of the authenticated peer that
sent the message, and replies go there.
"""

from __future__ import annotations

import enum
import heapq
import json
import math
import random
import re
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Final, TypeAlias

PROTOCOL_VERSION: Final = 1
MAX_MESSAGE_BYTES: Final = 16 << 20
"""Largest message `decode` accepts by default (a push-pull of a big cluster)."""
MAX_META_BYTES: Final = 16 << 10
"""Largest meta, as compact JSON, a member may carry."""
MAX_UPDATES: Final = 1024
"""Most piggybacked updates in one message."""
MAX_SYNC_MEMBERS: Final = 100_000
"""Most members in one push-pull."""
MAX_ID_LEN: Final = 128
MAX_URL_LEN: Final = 2048
MAX_INT: Final = (1 << 53) - 1
"""Incarnations and sequence numbers stay exact in every JSON implementation."""
MAX_RELAY_TIMEOUT: Final = 60.0
MAX_RELAYS: Final = 1024
"""Most ping-reqs this node works on at once; more are dropped."""

_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]*")
_URL_RE = re.compile(r"(?:https?|wss?)://[!-~]+")

Json: TypeAlias = dict[str, Any]


class MessageError(ValueError):
    """A message from the network is malformed; it was not applied."""


def is_member_id(value: object) -> bool:
    """A member id: 1-128 characters of letters, digits and `._:@-`, starting alphanumeric."""
    return (
        isinstance(value, str)
        and 0 < len(value) <= MAX_ID_LEN
        and _ID_RE.fullmatch(value) is not None
    )


def is_member_url(value: object) -> bool:
    """A member URL: http(s) or ws(s), printable ASCII without spaces, at most 2048 characters."""
    return (
        isinstance(value, str)
        and len(value) <= MAX_URL_LEN
        and _URL_RE.fullmatch(value) is not None
    )


def json_size(obj: object) -> int:
    """Bytes of `obj` as compact UTF-8 JSON (the wire form)."""
    return len(_dumps(obj).encode())


def _dumps(obj: object) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def check_meta(meta: object) -> dict[str, Any]:
    """A copy of `meta` if it is a JSON object of at most MAX_META_BYTES, else ValueError."""
    if not isinstance(meta, Mapping):
        raise ValueError("meta must be a JSON object")
    try:
        text = _dumps(dict(meta))
    except (TypeError, ValueError, RecursionError) as e:
        raise ValueError(f"meta is not JSON: {e}") from None
    if len(text.encode()) > MAX_META_BYTES:
        raise ValueError(f"meta is larger than {MAX_META_BYTES} bytes")
    copy: dict[str, Any] = json.loads(text)
    return copy


class MemberState(enum.Enum):
    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"
    LEFT = "left"


# Tuples, not sets: `in` compares by identity and skips Enum's slow hash.
_LIVE: Final = (MemberState.ALIVE, MemberState.SUSPECT)
_GONE: Final = (MemberState.DEAD, MemberState.LEFT)


# -- validation of decoded JSON -------------------------------------------------


def _get(obj: Mapping[str, Any], key: str, where: str) -> Any:
    try:
        return obj[key]
    except KeyError:
        raise MessageError(f"{where}: missing {key!r}") from None


def _int(obj: Mapping[str, Any], key: str, where: str) -> int:
    v = _get(obj, key, where)
    if type(v) is not int or not 0 <= v <= MAX_INT:
        raise MessageError(f"{where}: {key!r} must be an integer in 0..2^53-1")
    return v


def _seconds(obj: Mapping[str, Any], key: str, where: str, hi: float) -> float:
    v = _get(obj, key, where)
    if type(v) not in (int, float) or not 0 <= v <= hi:
        raise MessageError(f"{where}: {key!r} must be a number of seconds in 0..{hi:g}")
    return float(v)


def _id(obj: Mapping[str, Any], key: str, where: str) -> str:
    v = _get(obj, key, where)
    if not is_member_id(v):
        raise MessageError(f"{where}: {key!r} is not a member id")
    assert isinstance(v, str)
    return v


def _url(obj: Mapping[str, Any], key: str, where: str) -> str:
    v = _get(obj, key, where)
    if not is_member_url(v):
        raise MessageError(f"{where}: {key!r} is not a member URL")
    assert isinstance(v, str)
    return v


def _meta(obj: Mapping[str, Any], key: str, where: str) -> dict[str, Any]:
    v = _get(obj, key, where)
    if not isinstance(v, dict):
        raise MessageError(f"{where}: {key!r} must be an object")
    try:
        size = json_size(v)
    except (ValueError, RecursionError):  # only from a message not built by decode
        raise MessageError(f"{where}: {key!r} is not JSON") from None
    if size > MAX_META_BYTES:
        raise MessageError(f"{where}: {key!r} is larger than {MAX_META_BYTES} bytes")
    return v


def _list(obj: Mapping[str, Any], key: str, where: str, limit: int) -> list[Any]:
    v = _get(obj, key, where)
    if not isinstance(v, list):
        raise MessageError(f"{where}: {key!r} must be a list")
    if len(v) > limit:
        raise MessageError(f"{where}: {key!r} has more than {limit} entries")
    return v


def _object(v: object, where: str) -> Mapping[str, Any]:
    if not isinstance(v, dict):
        raise MessageError(f"{where}: expected an object")
    return v


# -- updates: what is gossiped about one member ------------------------------------


@dataclass(frozen=True, slots=True)
class Alive:
    """`id` is alive at `incarnation`, reachable at `url`, with `meta` (refutes older news)."""

    KIND: ClassVar[str] = "alive"
    id: str
    url: str
    incarnation: int
    meta: dict[str, Any]

    def to_json(self) -> Json:
        return {"t": self.KIND, "id": self.id, "url": self.url, "inc": self.incarnation,
                "meta": self.meta}  # fmt: skip

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Alive:
        w = "alive"
        return cls(
            _id(obj, "id", w), _url(obj, "url", w), _int(obj, "inc", w), _meta(obj, "meta", w)
        )


@dataclass(frozen=True, slots=True)
class Suspect:
    """Member `by` suspects `id` at `incarnation`."""

    KIND: ClassVar[str] = "suspect"
    id: str
    incarnation: int
    by: str

    def to_json(self) -> Json:
        return {"t": self.KIND, "id": self.id, "inc": self.incarnation, "by": self.by}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Suspect:
        w = "suspect"
        return cls(_id(obj, "id", w), _int(obj, "inc", w), _id(obj, "by", w))


@dataclass(frozen=True, slots=True)
class Dead:
    """Member `by` declared `id` dead at `incarnation` (its suspicion timed out)."""

    KIND: ClassVar[str] = "dead"
    id: str
    incarnation: int
    by: str

    def to_json(self) -> Json:
        return {"t": self.KIND, "id": self.id, "inc": self.incarnation, "by": self.by}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Dead:
        w = "dead"
        return cls(_id(obj, "id", w), _int(obj, "inc", w), _id(obj, "by", w))


@dataclass(frozen=True, slots=True)
class Left:
    """`id` left the cluster on purpose at `incarnation`."""

    KIND: ClassVar[str] = "left"
    id: str
    incarnation: int

    def to_json(self) -> Json:
        return {"t": self.KIND, "id": self.id, "inc": self.incarnation}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Left:
        w = "left"
        return cls(_id(obj, "id", w), _int(obj, "inc", w))


Update: TypeAlias = Alive | Suspect | Dead | Left
_UPDATES: Final[dict[str, type[Update]]] = {c.KIND: c for c in (Alive, Suspect, Dead, Left)}


def _updates(obj: Mapping[str, Any], where: str) -> tuple[Update, ...]:
    raw = _list(obj, "u", where, MAX_UPDATES) if "u" in obj else []
    out: list[Update] = []
    for item in raw:
        u = _object(item, f"{where} update")
        kind = u.get("t")
        cls = _UPDATES.get(kind) if isinstance(kind, str) else None
        if cls is None:
            raise MessageError(f"{where}: unknown update type")
        out.append(cls.from_json(u))
    return tuple(out)


def _with_updates(body: Json, updates: tuple[Update, ...]) -> Json:
    if updates:
        body["u"] = [u.to_json() for u in updates]
    return body


@dataclass(frozen=True, slots=True)
class StateEntry:
    """One member in a push-pull: what the sender knows of it (meta only while live)."""

    id: str
    url: str
    incarnation: int
    state: MemberState
    meta: dict[str, Any]

    def to_json(self) -> Json:
        return {"id": self.id, "url": self.url, "inc": self.incarnation,
                "state": self.state.value, "meta": self.meta}  # fmt: skip

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> StateEntry:
        w = "member"
        raw = _get(obj, "state", w)
        try:
            state = MemberState(raw)
        except ValueError:
            raise MessageError(f"{w}: unknown state") from None
        return cls(_id(obj, "id", w), _url(obj, "url", w), _int(obj, "inc", w), state,
                   _meta(obj, "meta", w))  # fmt: skip


# -- messages ---------------------------------------------------------------------


def _header(kind: str) -> Json:
    return {"v": PROTOCOL_VERSION, "t": kind}


@dataclass(frozen=True, slots=True)
class Ping:
    """Are you alive? `target` is the id the sender means to reach (a new member at a
    reused URL must not answer for the old one)."""

    KIND: ClassVar[str] = "ping"
    seq: int
    target: str
    updates: tuple[Update, ...] = ()

    def to_json(self) -> Json:
        return _with_updates({**_header(self.KIND), "seq": self.seq, "target": self.target},
                             self.updates)  # fmt: skip

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Ping:
        w = cls.KIND
        return cls(_int(obj, "seq", w), _id(obj, "target", w), _updates(obj, w))


@dataclass(frozen=True, slots=True)
class Ack:
    """The answer to the ping numbered `seq` (direct, or forwarded by a helper)."""

    KIND: ClassVar[str] = "ack"
    seq: int
    updates: tuple[Update, ...] = ()

    def to_json(self) -> Json:
        return _with_updates({**_header(self.KIND), "seq": self.seq}, self.updates)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Ack:
        return cls(_int(obj, "seq", cls.KIND), _updates(obj, cls.KIND))


@dataclass(frozen=True, slots=True)
class Nack:
    """A helper asked to ping for `seq` got no answer: the helper itself is fine."""

    KIND: ClassVar[str] = "nack"
    seq: int
    updates: tuple[Update, ...] = ()

    def to_json(self) -> Json:
        return _with_updates({**_header(self.KIND), "seq": self.seq}, self.updates)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Nack:
        return cls(_int(obj, "seq", cls.KIND), _updates(obj, cls.KIND))


@dataclass(frozen=True, slots=True)
class PingReq:
    """Ping `target` at `target_url` for me; forward its ack for `seq`, or nack after `timeout` s."""

    KIND: ClassVar[str] = "ping-req"
    seq: int
    target: str
    target_url: str
    timeout: float
    updates: tuple[Update, ...] = ()

    def to_json(self) -> Json:
        body = {**_header(self.KIND), "seq": self.seq, "target": self.target,
                "target_url": self.target_url, "timeout": self.timeout}  # fmt: skip
        return _with_updates(body, self.updates)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> PingReq:
        w = cls.KIND
        return cls(_int(obj, "seq", w), _id(obj, "target", w), _url(obj, "target_url", w),
                   _seconds(obj, "timeout", w, MAX_RELAY_TIMEOUT), _updates(obj, w))  # fmt: skip


@dataclass(frozen=True, slots=True)
class Gossip:
    """Nothing but updates."""

    KIND: ClassVar[str] = "gossip"
    updates: tuple[Update, ...] = ()

    def to_json(self) -> Json:
        return _with_updates(_header(self.KIND), self.updates)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Gossip:
        return cls(_updates(obj, cls.KIND))


def _members(obj: Mapping[str, Any], where: str) -> tuple[StateEntry, ...]:
    raw = _list(obj, "members", where, MAX_SYNC_MEMBERS)
    return tuple(StateEntry.from_json(_object(e, f"{where} member")) for e in raw)


@dataclass(frozen=True, slots=True)
class Sync:
    """Push-pull: the sender's full state; answer with a `SyncReply` of yours."""

    KIND: ClassVar[str] = "sync"
    members: tuple[StateEntry, ...]

    def to_json(self) -> Json:
        return {**_header(self.KIND), "members": [m.to_json() for m in self.members]}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Sync:
        return cls(_members(obj, cls.KIND))


@dataclass(frozen=True, slots=True)
class SyncReply:
    """The answer to a `Sync`: the replier's full state."""

    KIND: ClassVar[str] = "sync-reply"
    members: tuple[StateEntry, ...]

    def to_json(self) -> Json:
        return {**_header(self.KIND), "members": [m.to_json() for m in self.members]}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> SyncReply:
        return cls(_members(obj, cls.KIND))


Message: TypeAlias = Ping | Ack | Nack | PingReq | Gossip | Sync | SyncReply
_MESSAGES: Final[dict[str, type[Message]]] = {
    c.KIND: c for c in (Ping, Ack, Nack, PingReq, Gossip, Sync, SyncReply)
}


def message_from_json(obj: object) -> Message:
    """The message a decoded JSON value holds, or MessageError."""
    o = _object(obj, "message")
    if o.get("v") != PROTOCOL_VERSION or type(o.get("v")) is not int:
        raise MessageError(f"message: protocol version must be {PROTOCOL_VERSION}")
    kind = o.get("t")
    cls = _MESSAGES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise MessageError("message: unknown type")
    return cls.from_json(o)


def _no_constants(name: str) -> Any:
    raise MessageError(f"message: {name} is not JSON")


def decode(data: str | bytes, *, max_bytes: int = MAX_MESSAGE_BYTES) -> Message:
    """Parse and check one wire message; MessageError if it is not a valid one.

    Fields the message type does not define are ignored (a newer member may send
    more); every field it defines is checked for type and range.
    """
    if len(data) > max_bytes:
        raise MessageError(f"message: larger than {max_bytes} bytes")
    try:
        obj = json.loads(data, parse_constant=_no_constants)
    except MessageError:
        raise
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError
        raise MessageError(f"message: not JSON ({type(e).__name__})") from None
    return message_from_json(obj)


def encode(message: Message) -> str:
    """The wire form of `message`: compact JSON text."""
    return _dumps(message.to_json())


# -- what the core hands to the shell -------------------------------------------------


@dataclass(frozen=True, slots=True)
class Send:
    """Send `message` to the member at `url`."""

    url: str
    message: Message


@dataclass(frozen=True, slots=True)
class Member:
    """A snapshot of one member; `since` is when it entered `state` (the core's clock).

    `meta` is shared with the core: read it, never change it.
    """

    id: str
    url: str
    incarnation: int
    state: MemberState
    meta: dict[str, Any]
    since: float


class EventKind(enum.Enum):
    JOINED = "joined"  # a new member, or one that was dead or had left is back
    UPDATED = "updated"  # an alive member's URL or meta changed
    SUSPECT = "suspect"
    ALIVE = "alive"  # a suspect refuted the suspicion
    DEAD = "dead"
    LEFT = "left"
    REMOVED = "removed"  # a dead or left member was forgotten (reap_after)


@dataclass(frozen=True, slots=True)
class Event:
    kind: EventKind
    member: Member


@dataclass(frozen=True, kw_only=True)
class SwimConfig:
    """Timing and sizes; the defaults are memberlist's LAN profile (`DefaultLANConfig`).

    `gossip_interval` 0 turns the gossip timer off (updates then travel only
    piggyback on probes and their answers); `push_pull_interval` 0 turns
    periodic push-pull off (joining still syncs with the seeds).
    """

    probe_interval: float = 1.0
    probe_timeout: float = 0.5
    indirect_checks: int = 3
    fallback_ping: bool = True
    """At the probe timeout, ping the target once more directly (memberlist's
    TCP fallback ping: one more chance for a lost message)."""
    suspicion_mult: int = 4
    suspicion_max_timeout_mult: int = 6
    retransmit_mult: int = 4
    gossip_interval: float = 0.2
    gossip_nodes: int = 3
    gossip_to_the_dead: float = 30.0
    """Dead members still get gossip this long, so a wrongly declared one learns it."""
    push_pull_interval: float = 30.0
    awareness_max_multiplier: int = 8
    join_retry_interval: float = 2.0
    """While no other member is alive, sync with the seeds this often."""
    reap_after: float = 300.0
    leave_fanout: int = 5
    max_piggyback_bytes: int = 4096

    def __post_init__(self) -> None:
        positive = ("probe_interval", "probe_timeout", "join_retry_interval", "reap_after")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        if self.probe_timeout >= self.probe_interval:
            raise ValueError("probe_timeout must be shorter than probe_interval")
        for name in ("gossip_interval", "push_pull_interval", "gossip_to_the_dead"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0")
        for name in ("indirect_checks", "gossip_nodes", "leave_fanout"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        for name in ("suspicion_mult", "suspicion_max_timeout_mult", "retransmit_mult",
                     "awareness_max_multiplier"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_piggyback_bytes < 256:
            raise ValueError("max_piggyback_bytes must be >= 256")


@dataclass(frozen=True, slots=True)
class SwimStatistics:
    """Counters since start, for logs and metrics."""

    members: dict[str, int]  # state value -> count, this node included
    health_score: int  # Lifeguard local health: 0 is healthy; timeouts scale by score + 1
    pending_updates: int
    probes: int
    probes_failed: int  # probes that ended with the target suspected
    indirect_probes: int  # probes that needed ping-reqs
    refutations: int  # suspicions (or deaths) about this node it refuted
    misdirected: int  # pings for another id (a former member's URL)


def suspicion_timeout(mult: int, n: int, interval: float) -> float:
    """Memberlist's minimum suspicion timeout: mult * max(1, log10(n)) * interval."""
    return mult * max(1.0, math.log10(max(1, n))) * interval


def retransmit_limit(mult: int, n: int) -> int:
    """How many times each update is sent: mult * ceil(log10(n + 1))."""
    return mult * math.ceil(math.log10(n + 1))


def push_pull_interval(interval: float, n: int) -> float:
    """Memberlist's push-pull scaling: the base interval up to 32 members, then
    one more interval per doubling."""
    if n <= 32:
        return interval
    return interval * (math.ceil(math.log2(n) - math.log2(32)) + 1)


# -- internal state ---------------------------------------------------------------------


class _Node:
    __slots__ = ("id", "incarnation", "meta", "since", "state", "url")

    def __init__(self, id: str, url: str, inc: int, state: MemberState, meta: dict[str, Any],
                 since: float) -> None:  # fmt: skip
        self.id, self.url, self.incarnation = id, url, inc
        self.state, self.meta, self.since = state, meta, since

    def snapshot(self) -> Member:
        return Member(self.id, self.url, self.incarnation, self.state, self.meta, self.since)

    def entry(self) -> StateEntry:
        meta = self.meta if self.state in _LIVE else {}
        return StateEntry(self.id, self.url, self.incarnation, self.state, meta)


class _Suspicion:
    """Lifeguard's suspicion timer: max timeout shrinking to min with confirmations."""

    __slots__ = ("by", "k", "max", "min", "start", "token")

    def __init__(self, start: float, k: int, lo: float, hi: float, by: str, token: int) -> None:
        self.start, self.k, self.min, self.max = start, k, lo, hi
        self.by = {by}
        self.token = token

    def deadline(self) -> float:
        if self.k < 1:
            return self.start + self.min
        confirmations = len(self.by) - 1
        frac = math.log(confirmations + 1) / math.log(self.k + 1)
        return self.start + max(self.min, self.max - frac * (self.max - self.min))


class _Probe:
    __slots__ = ("deadline", "expected_nacks", "indirect", "nacks", "seq", "target",
                 "timeout_at")  # fmt: skip

    def __init__(self, seq: int, target: str, timeout_at: float, deadline: float) -> None:
        self.seq, self.target = seq, target
        self.timeout_at, self.deadline = timeout_at, deadline
        self.indirect = False
        self.expected_nacks = 0
        self.nacks = 0


class _Broadcasts:
    """Pending updates, one per member (a newer one replaces the older), sent
    fewest-transmissions first and newest first among equals (memberlist's
    TransmitLimitedQueue)."""

    def __init__(self) -> None:
        self._by_id: dict[str, tuple[Update, int, int]] = {}  # id -> (update, size, transmits)
        self._buckets: dict[int, dict[str, None]] = {}  # transmits -> ids, oldest first

    def __len__(self) -> int:
        return len(self._by_id)

    def add(self, update: Update) -> None:
        self._discard(update.id)
        self._by_id[update.id] = (update, json_size(update.to_json()), 0)
        self._buckets.setdefault(0, {})[update.id] = None

    def _discard(self, key: str) -> None:
        old = self._by_id.pop(key, None)
        if old is not None:
            bucket = self._buckets[old[2]]
            del bucket[key]
            if not bucket:
                del self._buckets[old[2]]

    def take(self, budget: int, limit: int) -> list[Update]:
        out: list[Update] = []
        chosen: list[str] = []
        skipped = 0
        for t in sorted(self._buckets):
            for key in reversed(self._buckets[t]):
                update, size, _ = self._by_id[key]
                if size > budget and out:
                    skipped += 1
                    if skipped > 32:  # the rest waits for the next message
                        break
                    continue
                out.append(update)
                chosen.append(key)
                budget -= size
                if budget < 48:  # smaller than any update
                    break
            if budget < 48 or skipped > 32:
                break
        for key in chosen:
            update, size, t = self._by_id[key]
            self._discard(key)
            if t + 1 < limit:
                self._by_id[key] = (update, size, t + 1)
                self._buckets.setdefault(t + 1, {})[key] = None
        return out


# -- the core ---------------------------------------------------------------------------


class Swim:
    """One member's view of the cluster and its side of the protocol.

    After every call, the shell sends what it returned, handles
    `drain_events()`, and re-reads `next_deadline()`: a `receive` or a
    `set_meta` may bring the next deadline forward. Time (`now`, seconds) must
    never go backwards; it need not be wall-clock time.
    """

    def __init__(
        self,
        self_id: str,
        url: str,
        meta: Mapping[str, Any] | None = None,
        config: SwimConfig | None = None,
        rng: random.Random | None = None,
    ) -> None:
        if not is_member_id(self_id):
            raise ValueError(f"invalid member id {self_id!r}")
        if not is_member_url(url):
            raise ValueError(f"invalid member URL {url!r}")
        self.id: Final = self_id
        self.config: Final = config or SwimConfig()
        self._rng = rng or random.Random()
        self._me = _Node(self_id, url, 0, MemberState.ALIVE, check_meta(meta or {}), 0.0)
        self._nodes: dict[str, _Node] = {self_id: self._me}
        self._live = 1  # alive + suspect members, this one included
        self._peers: list[str] = []  # every other member, for random choices
        self._peer_pos: dict[str, int] = {}
        self._order: list[str] = []  # this round of probes
        self._order_pos = 0
        self._probe: _Probe | None = None
        self._relays: dict[int, tuple[str, int, float]] = {}  # our seq -> (requester, seq, nack at)
        self._seq = 0
        self._queue = _Broadcasts()
        self._suspicions: dict[str, _Suspicion] = {}
        self._timers: list[tuple[float, int, str]] = []  # suspicion deadlines (lazy heap)
        self._token = 0
        self._reap: deque[tuple[float, str]] = deque()  # (since, id) of dead and left members
        self._events: list[Event] = []
        self._seeds: tuple[str, ...] = ()
        self._health = 0
        self._left = False
        self._started = False
        self._next_probe = math.inf
        self._next_gossip = math.inf
        self._next_push_pull = math.inf
        self._next_join = math.inf
        self._push_pull_phase = 0.0
        self._stats = {"probes": 0, "probes_failed": 0, "indirect_probes": 0, "refutations": 0,
                       "misdirected": 0}  # fmt: skip

    # -- the shell's calls --------------------------------------------------------------

    def join(self, now: float, seed_urls: Iterable[str]) -> list[Send]:
        """Start (if not yet started) and push-pull with every seed (this node's own
        URL is skipped). While no other member is alive, the seeds are tried again
        every `join_retry_interval`; they also serve to reconnect after a long
        partition. An empty list starts a new cluster."""
        self._start(now)
        seeds = tuple(dict.fromkeys(u for u in seed_urls if u != self._me.url))
        for u in seeds:
            if not is_member_url(u):
                raise ValueError(f"invalid seed URL {u!r}")
        self._seeds = seeds
        self._next_join = now + self.config.join_retry_interval
        if not seeds:
            return []
        state = self._state()
        return [Send(u, Sync(state)) for u in seeds]

    def restore(self, now: float, entries: Iterable[StateEntry]) -> None:
        """Take `entries` (a member list kept from an earlier run) as the starting view.

        Only live entries of other members are used; nothing is gossiped about them
        (each is probed in turn and found out if it is gone) and no events are
        reported (read `members()`). Call before `join`.
        """
        self._start(now)
        nodes, peers, pos = self._nodes, self._peers, self._peer_pos
        for e in entries:
            if e.state in _LIVE and e.id not in nodes:
                nodes[e.id] = _Node(e.id, e.url, e.incarnation, MemberState.ALIVE, e.meta, now)
                pos[e.id] = len(peers)
                peers.append(e.id)
                self._live += 1
        self._order_pos = len(self._order)  # the next probe starts a fresh, shuffled round
        self._schedule_push_pull(now)

    def tick(self, now: float) -> list[Send]:
        """Run the timers that are due."""
        self._start(now)
        out: list[Send] = []
        if not self._left:
            self._probe_step(now, out)
        # after the probe: its failure may confirm a suspicion past its new deadline
        self._expire_suspicions(now)
        self._relay_step(now, out)
        self._gossip_step(now, out)
        if not self._left:
            self._push_pull_step(now, out)
            self._join_step(now, out)
        self._reap_step(now)
        return out

    def receive(self, now: float, sender: str, message: Message) -> list[Send]:
        """Apply a message that `sender` (the authenticated peer's URL) sent."""
        self._start(now)
        out: list[Send] = []
        if isinstance(message, Sync | SyncReply):
            self._merge(now, message.members)
            if isinstance(message, Sync):
                out.append(Send(sender, SyncReply(self._state())))
            return out
        for u in message.updates:
            self._apply(now, u)
        if isinstance(message, Ping):
            if message.target == self.id:
                out.append(Send(sender, Ack(message.seq, self._piggyback())))
            else:
                self._stats["misdirected"] += 1
        elif isinstance(message, Ack):
            self._on_ack(message.seq, out)
        elif isinstance(message, Nack):
            p = self._probe
            if p is not None and p.seq == message.seq:
                p.nacks += 1
        elif isinstance(message, PingReq):
            self._on_ping_req(now, sender, message, out)
        return out

    def leave(self, now: float) -> list[Send]:
        """Leave the cluster: gossip `left` to `leave_fanout` members now. Keep calling
        `tick` and `receive` for a few gossip intervals (until `statistics().
        pending_updates` is 0) to spread it further; this node no longer probes,
        refutes or syncs. Leaving is final: a returning node is a new `Swim`."""
        self._start(now)
        if self._left:
            return []
        self._left = True
        self._probe = None
        left = Left(self.id, self._me.incarnation)
        self._set_state(self._me, MemberState.LEFT, now)
        self._queue.add(left)
        peers = self._sample(self.config.leave_fanout, lambda n: n.state in _LIVE)
        return [Send(n.url, Gossip((left,))) for n in peers]

    def set_meta(self, now: float, meta: Mapping[str, Any]) -> None:
        """Replace this node's meta (JSON object, at most MAX_META_BYTES) and gossip it
        with a new incarnation. ValueError if it is not valid."""
        self._start(now)
        self._me.meta = check_meta(meta)
        if not self._left:
            self._me.incarnation += 1
            self._queue.add(self._alive_self())

    def next_deadline(self) -> float:
        """When `tick` must run next (-inf before the first call that gave the time)."""
        if not self._started:
            return -math.inf
        d = self._next_gossip if len(self._queue) and self.config.gossip_interval > 0 else math.inf
        for _, _, nack_at in self._relays.values():
            d = min(d, nack_at)
        while self._timers:
            at, token, nid = self._timers[0]
            s = self._suspicions.get(nid)
            if s is not None and s.token == token:
                d = min(d, at)
                break
            heapq.heappop(self._timers)
        if self._reap:
            d = min(d, self._reap[0][0] + self.config.reap_after)
        if self._left:
            return d
        p = self._probe
        if p is None:
            d = min(d, self._next_probe)
        else:
            d = min(d, p.deadline if p.indirect else p.timeout_at)
        d = min(d, self._next_push_pull)
        if self._seeds and self._live <= 1:
            d = min(d, self._next_join)
        return d

    def members(self) -> list[Member]:
        """Every known member, this one included, by id (dead and left ones until reaped)."""
        return [self._nodes[k].snapshot() for k in sorted(self._nodes)]

    def member(self, member_id: str) -> Member | None:
        node = self._nodes.get(member_id)
        return None if node is None else node.snapshot()

    def suspicion_deadline(self, member_id: str) -> float | None:
        """When a suspect member will be declared dead unless it refutes (None if it
        is not suspect). Lifeguard: it starts `suspicion_max_timeout_mult` times the
        minimum after the suspicion and moves towards the minimum as other members
        independently confirm it."""
        s = self._suspicions.get(member_id)
        return None if s is None else s.deadline()

    @property
    def incarnation(self) -> int:
        return self._me.incarnation

    @property
    def health_score(self) -> int:
        return self._health

    def drain_events(self) -> list[Event]:
        """What changed since the last call, in order."""
        events, self._events = self._events, []
        return events

    def statistics(self) -> SwimStatistics:
        counts = {s.value: 0 for s in MemberState}
        for node in self._nodes.values():
            counts[node.state.value] += 1
        return SwimStatistics(members=counts, health_score=self._health,
                              pending_updates=len(self._queue), **self._stats)  # fmt: skip

    # -- timers -------------------------------------------------------------------------

    def _start(self, now: float) -> None:
        if self._started:
            return
        self._started = True
        cfg = self.config
        # Spread nodes that start together over the interval.
        self._next_probe = now + self._rng.uniform(0, cfg.probe_interval)
        self._next_gossip = now
        self._push_pull_phase = self._rng.random()
        self._schedule_push_pull(now)
        self._me.since = now

    def _schedule_push_pull(self, start: float) -> None:
        """The first push-pull, at a random point of the (size-scaled) interval, so
        that members started together do not all sync at once."""
        base = self.config.push_pull_interval
        if base > 0:
            self._next_push_pull = start + self._push_pull_phase * push_pull_interval(
                base, self._live
            )

    def _scale(self) -> int:
        return self._health + 1

    def _probe_step(self, now: float, out: list[Send]) -> None:
        cfg = self.config
        p = self._probe
        if p is not None and not p.indirect and now >= p.timeout_at:
            p.indirect = True
            target = self._nodes.get(p.target)
            if target is not None and target.state in _LIVE:
                self._stats["indirect_probes"] += 1
                helpers = self._sample(
                    cfg.indirect_checks, lambda n: n.state is MemberState.ALIVE, exclude=p.target
                )
                # Helpers nack a little before our deadline so the nack is back in time.
                wait = min(MAX_RELAY_TIMEOUT, max(0.0, (p.deadline - now) * 0.8))
                for h in helpers:
                    req = PingReq(p.seq, target.id, target.url, wait, self._piggyback())
                    out.append(Send(h.url, req))
                p.expected_nacks = len(helpers)
                if cfg.fallback_ping:
                    out.append(Send(target.url, self._ping(p.seq, target)))
        if p is not None and now >= p.deadline:
            self._probe = None
            self._probe_failed(now, p)
        if self._probe is None and now >= self._next_probe:
            self._start_probe(now, out)

    def _start_probe(self, now: float, out: list[Send]) -> None:
        cfg = self.config
        scale = self._scale()
        self._next_probe = now + cfg.probe_interval * scale
        target = self._next_target()
        if target is None:
            return
        self._stats["probes"] += 1
        seq = self._next_seq()
        self._probe = _Probe(
            seq, target.id, now + cfg.probe_timeout * scale, now + cfg.probe_interval * scale
        )
        out.append(Send(target.url, self._ping(seq, target)))

    def _ping(self, seq: int, target: _Node) -> Ping:
        """A ping; to a suspect it carries the suspicion first (Lifeguard's buddy system)."""
        first: Update | None = None
        if target.state is MemberState.SUSPECT:
            first = Suspect(target.id, target.incarnation, self.id)
        return Ping(seq, target.id, self._piggyback(first))

    def _probe_failed(self, now: float, p: _Probe) -> None:
        # Helpers that did not nack either point at this node's own trouble.
        missed = p.expected_nacks - p.nacks if p.expected_nacks else 1
        self._adjust_health(max(0, missed))
        target = self._nodes.get(p.target)
        if target is not None and target.state in _LIVE:
            self._stats["probes_failed"] += 1
            self._on_suspect(now, Suspect(target.id, target.incarnation, self.id))

    def _on_ack(self, seq: int, out: list[Send]) -> None:
        p = self._probe
        if p is not None and p.seq == seq:
            self._probe = None
            if not p.indirect:
                self._adjust_health(-1)
            return
        relay = self._relays.pop(seq, None)
        if relay is not None:
            out.append(Send(relay[0], Ack(relay[1], self._piggyback())))

    def _on_ping_req(self, now: float, sender: str, req: PingReq, out: list[Send]) -> None:
        if req.target == self.id:
            out.append(Send(sender, Ack(req.seq, self._piggyback())))
            return
        if len(self._relays) >= MAX_RELAYS:
            return
        seq = self._next_seq()
        self._relays[seq] = (sender, req.seq, now + req.timeout)
        target = self._nodes.get(req.target)
        first: Update | None = None
        if target is not None and target.state is MemberState.SUSPECT:
            first = Suspect(target.id, target.incarnation, self.id)
        out.append(Send(req.target_url, Ping(seq, req.target, self._piggyback(first))))

    def _relay_step(self, now: float, out: list[Send]) -> None:
        due = [seq for seq, (_, _, at) in self._relays.items() if at <= now]
        for seq in due:
            requester, their_seq, _ = self._relays.pop(seq)
            out.append(Send(requester, Nack(their_seq, self._piggyback())))

    def _gossip_step(self, now: float, out: list[Send]) -> None:
        cfg = self.config
        if cfg.gossip_interval <= 0 or now < self._next_gossip:
            return
        self._next_gossip = now + cfg.gossip_interval
        if not len(self._queue):
            return
        horizon = now - cfg.gossip_to_the_dead
        targets = self._sample(
            cfg.gossip_nodes,
            lambda n: n.state in _LIVE or (n.state is MemberState.DEAD and n.since >= horizon),
        )
        for t in targets:
            updates = self._piggyback()
            if not updates:
                break
            out.append(Send(t.url, Gossip(updates)))

    def _push_pull_step(self, now: float, out: list[Send]) -> None:
        cfg = self.config
        if now < self._next_push_pull:
            return
        self._next_push_pull = now + push_pull_interval(cfg.push_pull_interval, self._live)
        state: tuple[StateEntry, ...] | None = None
        peer = self._sample(1, lambda n: n.state is MemberState.ALIVE)
        if peer:
            state = self._state()
            out.append(Send(peer[0].url, Sync(state)))
        # One reconnect attempt, so that partitions heal when the network does: a dead
        # member (maybe only cut off), or, with probability 1/n (about one member of
        # the cluster per round, so seeds are not flooded), a seed that is not a live
        # member's URL: the way back after the other side was reaped.
        candidates = [n.url for n in self._nodes.values() if n.state is MemberState.DEAD]
        if self._seeds and self._rng.random() * self._live < 1:
            live_urls = {n.url for n in self._nodes.values() if n.state in _LIVE}
            candidates += [u for u in self._seeds if u not in live_urls]
        if candidates:
            url = self._rng.choice(candidates)
            out.append(Send(url, Sync(state if state is not None else self._state())))

    def _join_step(self, now: float, out: list[Send]) -> None:
        if not self._seeds or now < self._next_join:
            return
        self._next_join = now + self.config.join_retry_interval
        if self._live <= 1:
            state = self._state()
            out.extend(Send(u, Sync(state)) for u in self._seeds)

    def _expire_suspicions(self, now: float) -> None:
        while self._timers and self._timers[0][0] <= now:
            _, token, nid = heapq.heappop(self._timers)
            s = self._suspicions.get(nid)
            if s is None or s.token != token:
                continue
            del self._suspicions[nid]
            node = self._nodes[nid]
            self._on_dead(now, Dead(nid, node.incarnation, self.id))

    def _reap_step(self, now: float) -> None:
        after = self.config.reap_after
        while self._reap and self._reap[0][0] + after <= now:  # as in next_deadline
            since, nid = self._reap.popleft()
            node = self._nodes.get(nid)
            if node is not None and node.state in _GONE and node.since == since:
                self._remove(node)

    # -- applying what others say ----------------------------------------------------------

    def _apply(self, now: float, u: Update) -> None:
        if isinstance(u, Alive):
            self._on_alive(now, u)
        elif isinstance(u, Suspect):
            self._on_suspect(now, u)
        elif isinstance(u, Dead):
            self._on_dead(now, u)
        else:
            self._on_left(now, u)

    def _merge(self, now: float, entries: Iterable[StateEntry]) -> None:
        """Push-pull: take a peer's full state. A member it thinks dead is only
        suspected here (our own probes may still reach it), as memberlist does."""
        for e in entries:
            if e.state is MemberState.ALIVE:
                self._on_alive(now, Alive(e.id, e.url, e.incarnation, e.meta))
            elif e.state is MemberState.LEFT:
                self._on_left(now, Left(e.id, e.incarnation))
            else:  # suspect or dead there: suspect here (an unknown member is ignored)
                self._on_suspect(now, Suspect(e.id, e.incarnation, self.id))

    def _on_alive(self, now: float, a: Alive) -> None:
        if a.id == self.id:
            me = self._me
            if self._left or a.incarnation < me.incarnation:
                return
            if a.incarnation == me.incarnation and a.url == me.url and a.meta == me.meta:
                return
            self._refute(a.incarnation)  # an older life of ours, or a forgery: outbid it
            return
        node = self._nodes.get(a.id)
        if node is None:
            self._add(now, a.id, a.url, a.incarnation, MemberState.ALIVE, a.meta)
            self._queue.add(a)
            return
        if a.incarnation <= node.incarnation:
            return
        old = node.state
        changed = a.url != node.url or a.meta != node.meta
        node.incarnation, node.url, node.meta = a.incarnation, a.url, a.meta
        self._queue.add(a)
        if old is MemberState.ALIVE:
            if changed:
                self._emit(EventKind.UPDATED, node)
            return
        self._set_state(node, MemberState.ALIVE, now)
        if old is MemberState.SUSPECT:
            self._emit(EventKind.ALIVE, node)
        else:
            self._emit(EventKind.JOINED, node)

    def _on_suspect(self, now: float, s: Suspect) -> None:
        if s.id == self.id:
            if not self._left and s.incarnation >= self._me.incarnation:
                self._refute(s.incarnation)
            return
        node = self._nodes.get(s.id)
        if node is None or s.incarnation < node.incarnation or node.state in _GONE:
            return
        sus = self._suspicions.get(s.id)
        if node.state is MemberState.SUSPECT and sus is not None:
            if s.incarnation == node.incarnation:
                if s.by not in sus.by:  # an independent confirmation: shorten, re-gossip
                    sus.by.add(s.by)
                    heapq.heappush(self._timers, (sus.deadline(), sus.token, s.id))
                    self._queue.add(s)
                return
            # a newer incarnation is suspected (we missed its refutation): start over
            node.incarnation = s.incarnation
            self._suspect(now, node, s.by)
            self._queue.add(s)
            return
        node.incarnation = s.incarnation
        self._set_state(node, MemberState.SUSPECT, now)
        self._suspect(now, node, s.by)
        self._queue.add(s)
        self._emit(EventKind.SUSPECT, node)

    def _suspect(self, now: float, node: _Node, by: str) -> None:
        cfg = self.config
        n = self._live
        k = cfg.suspicion_mult - 2
        if n - 2 < k:  # not enough members to expect confirmations
            k = 0
        lo = suspicion_timeout(cfg.suspicion_mult, n, cfg.probe_interval)
        hi = cfg.suspicion_max_timeout_mult * lo
        self._token += 1
        sus = _Suspicion(now, k, lo, hi, by, self._token)
        self._suspicions[node.id] = sus
        heapq.heappush(self._timers, (sus.deadline(), sus.token, node.id))

    def _on_dead(self, now: float, d: Dead) -> None:
        self._gone(now, d, MemberState.DEAD)

    def _on_left(self, now: float, u: Left) -> None:
        self._gone(now, u, MemberState.LEFT)

    def _gone(self, now: float, u: Dead | Left, state: MemberState) -> None:
        if u.id == self.id:
            if not self._left and u.incarnation >= self._me.incarnation:
                self._refute(u.incarnation)
            return
        node = self._nodes.get(u.id)
        if node is None or u.incarnation < node.incarnation or node.state in _GONE:
            return
        node.incarnation = u.incarnation
        self._suspicions.pop(u.id, None)
        self._set_state(node, state, now)
        self._reap.append((now, node.id))
        self._queue.add(u)
        self._emit(EventKind.DEAD if state is MemberState.DEAD else EventKind.LEFT, node)

    def _refute(self, accused: int) -> None:
        """Someone thinks we are suspect, dead or gone at `accused`: outbid it."""
        self._me.incarnation = max(self._me.incarnation, accused) + 1
        self._queue.add(self._alive_self())
        self._stats["refutations"] += 1
        self._adjust_health(1)

    # -- bookkeeping ----------------------------------------------------------------------

    def _add(self, now: float, nid: str, url: str, inc: int, state: MemberState,
             meta: dict[str, Any]) -> None:  # fmt: skip
        node = _Node(nid, url, inc, state, meta, now)
        self._nodes[nid] = node
        self._live += 1
        self._peer_pos[nid] = len(self._peers)
        self._peers.append(nid)
        # Into the rest of this probe round at a random place, so a new member is
        # probed within a round (memberlist does the same).
        order = self._order
        order.append(nid)
        j = self._order_pos + int(self._rng.random() * (len(order) - self._order_pos))
        order[j], order[-1] = order[-1], order[j]
        self._emit(EventKind.JOINED, node)

    def _remove(self, node: _Node) -> None:
        del self._nodes[node.id]
        pos = self._peer_pos.pop(node.id)
        last = self._peers.pop()
        if last != node.id:
            self._peers[pos] = last
            self._peer_pos[last] = pos
        self._emit(EventKind.REMOVED, node)

    def _set_state(self, node: _Node, state: MemberState, now: float) -> None:
        was_live, is_live = node.state in _LIVE, state in _LIVE
        self._live += is_live - was_live
        node.state, node.since = state, now
        if state is not MemberState.SUSPECT:
            self._suspicions.pop(node.id, None)

    def _emit(self, kind: EventKind, node: _Node) -> None:
        self._events.append(Event(kind, node.snapshot()))

    def _adjust_health(self, delta: int) -> None:
        top = self.config.awareness_max_multiplier - 1
        self._health = min(top, max(0, self._health + delta))

    def _next_seq(self) -> int:
        self._seq = self._seq + 1 if self._seq < MAX_INT else 0
        return self._seq

    def _alive_self(self) -> Alive:
        me = self._me
        return Alive(me.id, me.url, me.incarnation, me.meta)

    def _state(self) -> tuple[StateEntry, ...]:
        return tuple(n.entry() for n in self._nodes.values())

    def _piggyback(self, first: Update | None = None) -> tuple[Update, ...]:
        cfg = self.config
        budget = cfg.max_piggyback_bytes
        if first is not None:
            budget -= json_size(first.to_json())
        taken = self._queue.take(budget, retransmit_limit(cfg.retransmit_mult, self._live))
        if first is not None:
            return (first, *(u for u in taken if u.id != first.id))
        return tuple(taken)

    def _next_target(self) -> _Node | None:
        for _ in range(2):
            while self._order_pos < len(self._order):
                nid = self._order[self._order_pos]
                self._order_pos += 1
                node = self._nodes.get(nid)
                if node is not None and node.state in _LIVE:
                    return node
            self._order = [p for p in self._peers if self._nodes[p].state in _LIVE]
            self._rng.shuffle(self._order)
            self._order_pos = 0
            if not self._order:
                return None
        return None

    def _sample(
        self, k: int, ok: Callable[[_Node], bool], exclude: str | None = None
    ) -> list[_Node]:
        """Up to k distinct random other members for which `ok(node)` holds."""
        peers, n = self._peers, len(self._peers)
        if k <= 0 or n == 0:
            return []
        picked: dict[str, _Node] = {}
        if n > 4 * k + 8:  # mostly a few random draws; a scan only when most fail `ok`
            for _ in range(8 * k + 16):
                nid = peers[self._rng.randrange(n)]
                if nid in picked or nid == exclude:
                    continue
                node = self._nodes[nid]
                if ok(node):
                    picked[nid] = node
                    if len(picked) == k:
                        return list(picked.values())
        rest = [self._nodes[p] for p in peers if p != exclude and p not in picked]
        rest = [node for node in rest if ok(node)]
        more = self._rng.sample(rest, min(k - len(picked), len(rest)))
        return [*picked.values(), *more]
