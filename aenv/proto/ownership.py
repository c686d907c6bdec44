"""One owner per sandbox: lease and claim records, fencing epochs and timing rules, without IO.

Two kinds of record live in the object store. A node's lease
(`cluster/nodes/{node}`, `NodeLease`) says which epoch of the node is live;
the node renews it with a compare-and-swap every `ttl / 3`. A sandbox's
claim (`cluster/sandboxes/{sid}`, `SandboxClaim`) names its node, that
node's epoch and the sandbox's own fencing epoch, which grows by one on
every change of owner. A claim is *held* while its node's lease is live at
the claim's node epoch; renewing one lease keeps every claim of the node,
so the store sees one request per node per `ttl / 3`, whatever the number
of sandboxes.

Safety rests on monotonic clocks whose rates differ from real time by at
most `drift` (a rate, e.g. 1 %), never on synchronised clocks:
- the holder counts from the moment it *sent* its last renewal that
  succeeded (`sent`), stops serving at `sent + ttl*(1-drift) - stop_grace`
  and has stopped by `sent + ttl*(1-drift)`: at most `ttl` of real time
  after the renewal left, which is before it was applied;
- another node may fence the lease only after it has itself seen the lease
  unchanged (same version) for `ttl*(1+drift)` of its own clock, counted
  from when the first read that returned that version *arrived*: at least
  `ttl` of real time after the renewal was applied;
- fencing is a compare-and-swap on the version observed, so it fails if
  the holder renewed meanwhile (every write carries a fresh `writer` nonce,
  so a version never comes back). A fenced epoch is dead forever: the
  holder's next renewal is refused and it drops every claim of that epoch;
  its claims are *orphaned* and may be moved by compare-and-swap at once.

`LeaseTiming` holds the rules, `LeaseHolder` is the own node's side (what to
write to join and renew, how to read the answers, whether it may serve at a
given time), `Observer` is the watcher's side (when may a lease be fenced),
`claim_status` and the `*_claim` / `*_lease` functions say what a record
means and what to write next. Times are arguments (trio's clock in the
shell); versions are opaque values the shell gets from the store.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Hashable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

FORMAT = 1
NODES_PREFIX = "cluster/nodes"
SANDBOXES_PREFIX = "cluster/sandboxes"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class RecordError(ValueError):
    """A lease or claim record that cannot be read."""


def check_name(name: str, what: str) -> str:
    """Node ids and sandbox ids become object keys: letters, digits, '.', '_', '-'."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"invalid {what} {name!r}: letters, digits, '.', '_' and '-' only")
    return name


def lease_key(node: str) -> str:
    return f"{NODES_PREFIX}/{check_name(node, 'node id')}"


def claim_key(sid: str) -> str:
    return f"{SANDBOXES_PREFIX}/{check_name(sid, 'sandbox id')}"


# -- timing -------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class LeaseTiming:
    """The lease's clock rules (see the module docstring); cluster-wide settings.

    `ttl`: how long a renewal keeps a node's claims. `drift`: the largest rate
    by which any node's monotonic clock may run fast or slow. `stop_grace`:
    time the holder reserves, before its lease could lapse, to stop its
    sandboxes. `renew_every`: ttl/3, so two renewals may fail in a row
    without the node stopping; `retry_every`: pace of retries after a failure.
    """

    ttl: float = 10.0
    drift: float = 0.01
    stop_grace: float = 1.0

    def __post_init__(self) -> None:
        if not (0 <= self.drift < 0.5 and self.ttl > 0 and self.stop_grace >= 0):
            raise ValueError(f"invalid lease timing {self}")
        if self.serve_for <= self.renew_every:
            raise ValueError(
                f"lease ttl {self.ttl}s leaves no serving time after stop_grace "
                f"{self.stop_grace}s and renewals every {self.renew_every:.3g}s"
            )

    @property
    def renew_every(self) -> float:
        return self.ttl / 3

    @property
    def retry_every(self) -> float:
        return self.ttl / 12

    @property
    def serve_for(self) -> float:
        """How long after sending a renewal that succeeds the holder may serve."""
        return self.ttl * (1 - self.drift) - self.stop_grace

    def serve_until(self, sent: float) -> float:
        return sent + self.serve_for

    def stopped_by(self, sent: float) -> float:
        return sent + self.ttl * (1 - self.drift)

    def fence_after(self, seen: float, ttl: float | None = None, drift: float = 0.0) -> float:
        """When a lease first seen (unchanged) at `seen` may be fenced; `ttl` and `drift`
        are the holder's own when its lease states them (the larger drift counts)."""
        return seen + max(ttl or 0.0, self.ttl) * (1 + max(drift, self.drift))

    def requests_per_second(self, nodes: int) -> float:
        """Store requests per second to keep every claim of `nodes` nodes alive."""
        return nodes / self.renew_every


# -- records --------------------------------------------------------------------------


class LeaseState(enum.Enum):
    LIVE = "live"
    FENCED = "fenced"  # another node ended this epoch
    LEFT = "left"  # the node ended it after stopping everything


@dataclass(frozen=True, kw_only=True)
class NodeLease:
    """A node's lease. `writer` is unique per write, so no two writes are alike."""

    node: str
    epoch: int
    state: LeaseState
    writer: str
    ttl: float
    drift: float = 0.0
    url: str = ""
    renewals: int = 0  # within the epoch
    renewed_at: float = 0.0  # wall clock, for people reading the record; never compared
    fenced_by: str = ""

    def encode(self) -> bytes:
        doc = asdict(self) | {"v": FORMAT, "kind": "node", "state": self.state.value}
        return json.dumps(doc, sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes) -> NodeLease:
        doc = _load(data, "node")
        try:
            return cls(
                node=str(doc["node"]),
                epoch=int(doc["epoch"]),
                state=LeaseState(doc["state"]),
                writer=str(doc["writer"]),
                ttl=float(doc["ttl"]),
                drift=float(doc.get("drift", 0.0)),
                url=str(doc.get("url", "")),
                renewals=int(doc.get("renewals", 0)),
                renewed_at=float(doc.get("renewed_at", 0.0)),
                fenced_by=str(doc.get("fenced_by", "")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise RecordError(f"bad node lease record: {exc}") from exc


TOMBSTONE = "deleted"


@dataclass(frozen=True, kw_only=True)
class SandboxClaim:
    """Who owns a sandbox: `node` at `node_epoch`; `epoch` is the sandbox's fencing
    epoch. `state` is a hint for routing and adoption ("running", "paused", ...);
    "deleted" marks a released claim, final: nobody writes it again."""

    sid: str
    node: str
    node_epoch: int
    epoch: int
    writer: str
    state: str = ""
    meta: dict[str, str] = field(default_factory=dict)

    @property
    def released(self) -> bool:
        return self.state == TOMBSTONE

    def encode(self) -> bytes:
        doc = asdict(self) | {"v": FORMAT, "kind": "sandbox"}
        return json.dumps(doc, sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes) -> SandboxClaim:
        doc = _load(data, "sandbox")
        try:
            meta = doc.get("meta") or {}
            return cls(
                sid=str(doc["sid"]),
                node=str(doc["node"]),
                node_epoch=int(doc["node_epoch"]),
                epoch=int(doc["epoch"]),
                writer=str(doc["writer"]),
                state=str(doc.get("state", "")),
                meta={str(k): str(v) for k, v in dict(meta).items()},
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise RecordError(f"bad sandbox claim record: {exc}") from exc


def _load(data: bytes, kind: str) -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RecordError(f"{kind} record is not JSON: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("kind") != kind:
        raise RecordError(f"not a {kind} record")
    if doc.get("v") != FORMAT:
        raise RecordError(f"{kind} record has format {doc.get('v')!r}, this node reads {FORMAT}")
    return doc


# -- what a claim means ---------------------------------------------------------------


class ClaimStatus(enum.Enum):
    HELD = "held"  # its node's lease is live at its epoch: only that node may serve it
    ORPHANED = "orphaned"  # its node's epoch has ended: anyone may move it now
    RELEASED = "released"  # deleted by its owner


def claim_status(claim: SandboxClaim, lease: NodeLease | None) -> ClaimStatus:
    """What `claim` means given its node's lease as read (None: no lease object).

    A missing lease, or one at an older epoch than the claim (both only after
    someone deleted a lease by hand), count as held: the lease must be fenced,
    after the observation window, before the claim moves.
    """
    if claim.released:
        return ClaimStatus.RELEASED
    if lease is None or lease.epoch < claim.node_epoch:
        return ClaimStatus.HELD
    if lease.epoch > claim.node_epoch or lease.state is not LeaseState.LIVE:
        return ClaimStatus.ORPHANED
    return ClaimStatus.HELD


def new_claim(
    sid: str, node: str, node_epoch: int, writer: str, *, state: str = "", meta: dict[str, str]
) -> SandboxClaim:
    return SandboxClaim(
        sid=sid,
        node=node,
        node_epoch=node_epoch,
        epoch=1,
        writer=writer,
        state=state,
        meta=dict(meta),
    )


def moved_claim(claim: SandboxClaim, node: str, node_epoch: int, writer: str) -> SandboxClaim:
    """The claim taken over by `node`: the sandbox's fencing epoch grows by one."""
    return replace(claim, node=node, node_epoch=node_epoch, epoch=claim.epoch + 1, writer=writer)


def fenced_lease(
    lease: NodeLease | None, node: str, claim_epoch: int, by: str, writer: str, ttl: float
) -> NodeLease:
    """What a watcher writes to end `node`'s epoch (its lease as observed, or None)."""
    epoch = max(lease.epoch if lease else 0, claim_epoch)
    return NodeLease(
        node=node,
        epoch=epoch,
        state=LeaseState.FENCED,
        writer=writer,
        ttl=lease.ttl if lease else ttl,
        drift=lease.drift if lease else 0.0,
        url=lease.url if lease else "",
        renewals=lease.renewals if lease else 0,
        renewed_at=lease.renewed_at if lease else 0.0,
        fenced_by=by,
    )


# -- the holder's side ----------------------------------------------------------------


class HolderStatus(enum.Enum):
    JOINING = "joining"  # no live lease yet
    SERVING = "serving"  # may serve the claims of its epoch
    SUSPENDED = "suspended"  # renewals failed past the deadline; may come back if not fenced
    FENCED = "fenced"  # the epoch was ended by another node: drop every claim of it
    LEFT = "left"


class Join(enum.Enum):
    CREATE = "create"  # no lease object: create it
    SWAP = "swap"  # replace the lease read
    WAIT = "wait"  # a live lease of an earlier process: wait for it to lapse, then swap


@dataclass
class LeaseHolder:
    """The own node's lease: which epoch it holds and until when it may serve.

    The shell asks `join_plan` what to write first, then `next_renewal` before
    each renewal and reports how each write went; `status(now)` and
    `may_serve(now)` follow from the last renewal that is known to have been
    applied. A write whose answer was lost is resolved by reading the lease
    back: if it carries the writer nonce of one of our pending writes, that
    write was applied (and counts from when it was sent).
    """

    node: str
    timing: LeaseTiming
    url: str = ""
    lease: NodeLease | None = None  # the last write known to be applied
    sent: float | None = None  # when that write was sent
    fenced: bool = False
    left: bool = False
    pending: dict[str, tuple[NodeLease, float]] = field(default_factory=dict)
    failures: int = 0

    # -- queries --

    @property
    def epoch(self) -> int | None:
        return None if self.lease is None or self.fenced or self.left else self.lease.epoch

    def status(self, now: float) -> HolderStatus:
        if self.left:
            return HolderStatus.LEFT
        if self.fenced:
            return HolderStatus.FENCED
        if self.lease is None or self.sent is None:
            return HolderStatus.JOINING
        if now < self.timing.serve_until(self.sent):
            return HolderStatus.SERVING
        return HolderStatus.SUSPENDED

    def may_serve(self, now: float) -> bool:
        return self.status(now) is HolderStatus.SERVING

    def serve_until(self) -> float | None:
        if self.sent is None or self.fenced or self.left:
            return None
        return self.timing.serve_until(self.sent)

    def next_renewal_at(self, now: float) -> float:
        if self.sent is None:
            return now
        if self.failures:
            return now + self.timing.retry_every
        return self.sent + self.timing.renew_every

    # -- what to write --

    def join_plan(
        self, current: NodeLease | None, writer: str, *, resume: bool, wall: float = 0.0
    ) -> tuple[Join, NodeLease]:
        """How to start, given the lease as read: a new epoch after a fenced or left
        one; the same epoch over a live one (this node's earlier process: its claims
        stay valid), which is only safe once that process is gone, so the plan is
        WAIT (observe it unchanged for the fence window) unless `resume` says the
        caller knows it is dead. A new process never counts on an old one's renewals.
        """
        floor = self.lease.epoch if self.lease is not None else 0
        self.fenced = self.left = False
        self.lease = None
        self.sent = None
        self.pending.clear()
        self.failures = 0
        if current is None:  # never joined, or the lease was deleted by hand: never reuse
            return Join.CREATE, self._lease(floor + 1, writer, wall)
        if current.node != self.node:
            raise RecordError(f"lease of {current.node!r} found under node {self.node!r}")
        if current.state is LeaseState.LIVE:
            plan = Join.SWAP if resume else Join.WAIT
            return plan, replace(
                self._lease(current.epoch, writer, wall), renewals=current.renewals
            )
        return Join.SWAP, self._lease(current.epoch + 1, writer, wall)

    def next_renewal(self, writer: str, wall: float) -> NodeLease:
        """The lease to swap in next (not yet sent)."""
        if self.lease is None:
            raise RuntimeError("renewal before the lease was created")
        return replace(
            self.lease,
            writer=writer,
            renewals=self.lease.renewals + 1,
            renewed_at=wall,
            url=self.url,
            ttl=self.timing.ttl,
            drift=self.timing.drift,
        )

    def _lease(self, epoch: int, writer: str, wall: float) -> NodeLease:
        return NodeLease(
            node=self.node,
            epoch=epoch,
            state=LeaseState.LIVE,
            writer=writer,
            renewed_at=wall,
            ttl=self.timing.ttl,
            drift=self.timing.drift,
            url=self.url,
        )

    # -- how writes went --

    def sending(self, lease: NodeLease, sent: float) -> None:
        """Record a write before it is sent (its first attempt)."""
        self.pending[lease.writer] = (lease, sent)

    def written(self, lease: NodeLease) -> None:
        """The store applied `lease` (a write of ours that was `sending`)."""
        _, sent = self.pending.pop(lease.writer)
        self.pending.clear()  # earlier writes were not applied after this one
        if self.sent is None or sent >= self.sent:
            self.lease, self.sent = lease, sent
        self.failures = 0

    def refused(self, current: NodeLease | None) -> bool:
        """A conditional write was refused; `current` is the lease read back. Returns
        whether we still hold the epoch (one of our own writes was applied after
        all); if not, the epoch is over: FENCED."""
        if current is not None and current.writer in self.pending:
            self.written(current)
            return True
        self.fenced = True
        self.pending.clear()
        return False

    def failed(self) -> None:
        """The store could not be reached; the deadline stands."""
        self.failures += 1

    def ours(self, lease: NodeLease | None) -> bool:
        """Whether `lease` is a write of ours in the current epoch (applied or pending)."""
        return lease is not None and (
            lease.writer in self.pending
            or (self.lease is not None and lease.writer == self.lease.writer)
        )

    def leaving(self) -> NodeLease:
        """The lease to swap in when leaving: LEFT; stop serving before sending it."""
        if self.lease is None:
            raise RuntimeError("leave before the lease was created")
        self.left = True
        return replace(self.lease, state=LeaseState.LEFT)


# -- the watcher's side ---------------------------------------------------------------


@dataclass
class _Seen:
    version: Hashable
    since: float
    lease: NodeLease | None


@dataclass
class Observer:
    """When may another node's lease be fenced: after it has been seen unchanged
    for the fence window, counted from when a read returned its version."""

    timing: LeaseTiming
    _seen: dict[str, _Seen] = field(default_factory=dict)

    def saw(self, node: str, version: Hashable, lease: NodeLease | None, now: float) -> None:
        """A read of `node`'s lease returned `version` (None: no object), arriving at
        `now`. A different version starts the window again."""
        seen = self._seen.get(node)
        if seen is None or seen.version != version:
            self._seen[node] = _Seen(version, now, lease)

    def fence_at(self, node: str) -> float | None:
        """When the lease as last seen may be fenced (None: never seen)."""
        seen = self._seen.get(node)
        if seen is None:
            return None
        ttl = seen.lease.ttl if seen.lease else None
        drift = seen.lease.drift if seen.lease else 0.0
        return self.timing.fence_after(seen.since, ttl, drift)

    def may_fence(self, node: str, version: Hashable, now: float) -> bool:
        """Whether `node`'s lease at `version` has been seen unchanged long enough."""
        seen = self._seen.get(node)
        at = self.fence_at(node)
        return seen is not None and seen.version == version and at is not None and now >= at

    def forget(self, node: str) -> None:
        self._seen.pop(node, None)
