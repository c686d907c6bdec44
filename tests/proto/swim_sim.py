"""An in-process network for the SWIM core (`aenv.proto.swim`): a virtual clock
and a heapq event queue; no trio, no sockets, no real time.

Each member is a `Swim` core. `SimNetwork` calls its `tick` at its
`next_deadline()` and delivers every `Send` it returns after a random
latency, unless the message is lost (`loss`: each message independently;
`set_link_loss` for one link), the two ends are on different sides of a
partition, or the target is down (`kill`). With `wire="full"` (the default)
messages go through `encode` and `decode`, so the wire format is exercised
and its size measured; `wire="size"` encodes only to count bytes and hands the
receiver the message object (faster); `wire="off"` counts no bytes. A message to a killed member counts no bytes (its connection is
refused); a lost one counts as sent. Events each core reports go to
`listeners` as (time, observer id, event), and with `record=True` into `log`.

Runs are deterministic for a given `seed`.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aenv.proto.swim import (
    Event,
    EventKind,
    Member,
    MemberState,
    Message,
    Send,
    StateEntry,
    Swim,
    SwimConfig,
    decode,
    encode,
)

Listener = Callable[[float, str, Event], None]

_TICK = 0
_DELIVER = 1


def url_of(node_id: str) -> str:
    return f"http://{node_id}.sim:8000"


@dataclass
class SimNode:
    id: str
    swim: Swim
    up: bool = True
    tick_at: float = math.inf
    bytes_sent: int = 0
    bytes_received: int = 0
    messages_sent: int = 0


@dataclass(frozen=True)
class Logged:
    at: float
    observer: str
    kind: EventKind
    member: Member


@dataclass
class SimNetwork:
    loss: float = 0.0
    latency: tuple[float, float] = (0.0005, 0.003)
    seed: int = 0
    config: SwimConfig = field(default_factory=SwimConfig)
    wire: str = "full"
    record: bool = True

    def __post_init__(self) -> None:
        self.now = 0.0
        self.rng = random.Random(self.seed)
        self.nodes: dict[str, SimNode] = {}
        self._by_url: dict[str, SimNode] = {}
        self._queue: list[tuple[float, int, int, Any]] = []
        self._n = 0
        self._group: dict[str, int] = {}
        self._link_loss: dict[frozenset[str], float] = {}
        self._slow: dict[str, float] = {}
        self.listeners: list[Listener] = []
        self.log: list[Logged] = []
        self.delivered = 0
        self.bytes_by_kind: Counter[str] = Counter()  # sent, by message type
        self.sent_by_kind: Counter[str] = Counter()

    # -- membership of the simulation ---------------------------------------------------

    def add(self, node_id: str, meta: Mapping[str, Any] | None = None) -> Swim:
        """A new member (not started: `join` or `bootstrap` it)."""
        rng = random.Random(f"{self.seed}/{node_id}/{len(self.nodes)}")
        swim = Swim(node_id, url_of(node_id), meta, self.config, rng)
        node = SimNode(node_id, swim)
        self.nodes[node_id] = node
        self._by_url[url_of(node_id)] = node
        return swim

    def bootstrap(self, ids: Iterable[str], meta: Mapping[str, Any] | None = None) -> None:
        """Add members that start out knowing each other (a converged cluster),
        without any gossip about it."""
        ids = list(ids)
        swims = [self.add(i, meta) for i in ids]
        entries = [StateEntry(i, url_of(i), 0, MemberState.ALIVE, dict(meta or {})) for i in ids]
        for s in swims:
            s.restore(self.now, entries)
            s.join(self.now, [])
            s.drain_events()
            self._schedule(self.nodes[s.id])

    def join(self, node_id: str, seeds: Iterable[str]) -> None:
        node = self.nodes[node_id]
        self._dispatch(node, node.swim.join(self.now, [url_of(s) for s in seeds]))

    def kill(self, node_id: str) -> None:
        """The member stops at once: no more ticks, messages to it are refused."""
        self.nodes[node_id].up = False

    def restart(self, node_id: str, seeds: Iterable[str]) -> Swim:
        """A killed member comes back as a new process with the same id and URL."""
        swim = self.add(node_id)
        self.join(node_id, seeds)
        return swim

    def leave(self, node_id: str) -> None:
        node = self.nodes[node_id]
        self._dispatch(node, node.swim.leave(self.now))

    def set_meta(self, node_id: str, meta: Mapping[str, Any]) -> None:
        node = self.nodes[node_id]
        node.swim.set_meta(self.now, meta)
        self._after(node)

    # -- faults ------------------------------------------------------------------------

    def partition(self, *groups: Iterable[str]) -> None:
        """Each group can only reach itself; members in no group form one more."""
        self._group = {i: g for g, members in enumerate(groups) for i in members}

    def heal(self) -> None:
        self._group = {}

    def set_slow(self, node_id: str, delay: float) -> None:
        """Every message to `node_id` waits `delay` more seconds before it is handled
        (a member starved of CPU); 0 makes it normal again."""
        self._slow[node_id] = delay

    def set_link_loss(self, a: str, b: str, loss: float) -> None:
        """Loss between a and b (both ways) instead of the network's."""
        self._link_loss[frozenset((a, b))] = loss

    # -- running -----------------------------------------------------------------------

    def run_until(self, t: float, stop: Callable[[], bool] | None = None) -> bool:
        """Run events up to time t (or until `stop()` holds after an event: True)."""
        q = self._queue
        while q and q[0][0] <= t:
            at, _, kind, payload = heapq.heappop(q)
            self.now = at
            if kind == _TICK:
                node = self.nodes[payload[0]]
                if node.up and node.swim is payload[1] and node.tick_at == at:
                    node.tick_at = math.inf
                    self._dispatch(node, node.swim.tick(at))
                    if node.swim.next_deadline() <= at:
                        raise AssertionError(f"{node.id}: tick at {at} left a deadline due")
            else:
                self._deliver(*payload)
            if stop is not None and stop():
                return True
        self.now = max(self.now, t)
        return False

    def run_for(self, dt: float, stop: Callable[[], bool] | None = None) -> bool:
        return self.run_until(self.now + dt, stop)

    # -- views -------------------------------------------------------------------------

    def up_ids(self) -> list[str]:
        return [i for i, n in self.nodes.items() if n.up]

    def view(self, observer: str, subject: str) -> MemberState | None:
        m = self.nodes[observer].swim.member(subject)
        return None if m is None else m.state

    def learned(self, subject: str, kinds: Iterable[EventKind]) -> dict[str, float]:
        """When each observer first reported one of `kinds` about `subject` (from `log`)."""
        want = set(kinds)
        first: dict[str, float] = {}
        for e in self.log:
            if e.member.id == subject and e.kind in want and e.observer not in first:
                first[e.observer] = e.at
        return first

    # -- internals ---------------------------------------------------------------------

    def _push(self, at: float, kind: int, payload: Any) -> None:
        self._n += 1
        heapq.heappush(self._queue, (at, self._n, kind, payload))

    def _schedule(self, node: SimNode) -> None:
        if not node.up:
            return
        d = max(node.swim.next_deadline(), self.now)
        if d < node.tick_at:
            node.tick_at = d
            self._push(d, _TICK, (node.id, node.swim))

    def _after(self, node: SimNode) -> None:
        events = node.swim.drain_events()
        for e in events:
            if self.record:
                self.log.append(Logged(self.now, node.id, e.kind, e.member))
            for listener in self.listeners:
                listener(self.now, node.id, e)
        self._schedule(node)

    def _dispatch(self, node: SimNode, sends: list[Send]) -> None:
        for s in sends:
            self._send(node, s)
        self._after(node)

    def _send(self, src: SimNode, s: Send) -> None:
        dst = self._by_url.get(s.url)
        if dst is None or not dst.up:
            return  # connection refused: nothing goes out
        if self._group.get(src.id, -1) != self._group.get(dst.id, -1):
            return  # no route
        payload: Message | str = s.message
        size = 0
        if self.wire != "off":
            text = encode(s.message)
            size = len(text.encode())
            if self.wire == "full":
                payload = text
        src.bytes_sent += size
        src.messages_sent += 1
        self.bytes_by_kind[s.message.KIND] += size
        self.sent_by_kind[s.message.KIND] += 1
        loss = self._link_loss.get(frozenset((src.id, dst.id)), self.loss)
        if loss and self.rng.random() < loss:
            return
        lo, hi = self.latency
        at = self.now + self.rng.uniform(lo, hi) + self._slow.get(dst.id, 0.0)
        self._push(at, _DELIVER, (dst, src.swim.id, payload, size))

    def _deliver(self, dst: SimNode, sender: str, payload: Message | str, size: int) -> None:
        if not dst.up:
            return
        dst.bytes_received += size
        self.delivered += 1
        message = decode(payload) if isinstance(payload, str) else payload
        self._dispatch(dst, dst.swim.receive(self.now, url_of(sender), message))
