"""How two nodes of a cluster prove themselves to each other and seal what they send, sans-IO.

Nodes talk over WebSocket (`aenv.cluster.transport`), which may be plain
HTTP on a private network: the cluster secret never goes on the wire, and a
recorded conversation is worth nothing to whoever replays it.

The handshake (the connecting node is the client):

1. server -> client  `Challenge`: a fresh random nonce and the server's id.
2. client -> server  `Hello`: the client's id and URL, a fresh nonce of its
   own, and a MAC over both nonces, both ids and its URL under the cluster
   key. A replayed Hello fails: the server's nonce is new for every
   connection.
3. server -> client  `Welcome`: its URL and a MAC (another label) over the
   same. The client now knows the server holds the secret too; a replayed
   Welcome fails on the client's nonce.

Both sides then derive a session key from the cluster key and the two nonces
and `Sealer.seal`/`Opener.open` every frame: a sequence number, then a MAC
over direction, sequence and payload, then the payload. A frame that is
altered, replayed, reordered or sent in the other direction is refused.

`ClusterKey` derives the MAC key from the configured secret; nonces come from
the caller (`secrets.token_bytes(NONCE_BYTES)` in the shell) so this module
reads neither clocks nor the system's randomness.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import struct
from dataclasses import dataclass
from typing import Any, Final

VERSION: Final = 1
NONCE_BYTES: Final = 16
MAC_BYTES: Final = 32
MAX_FRAME: Final = 4 * 1024 * 1024
_SEQ: Final = struct.Struct(">Q")
_ID_RE: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
_MAX_URL: Final = 512


class WireError(Exception):
    """The peer sent something this side refuses (malformed, or failing authentication)."""


class AuthError(WireError):
    """The peer does not hold the cluster secret, or replayed an old message."""


def valid_node_id(node_id: str) -> bool:
    """Node ids travel in handshakes, gossip and object names: 1-63 safe characters."""
    return bool(_ID_RE.match(node_id))


@dataclass(frozen=True)
class ClusterKey:
    """The MAC key every node derives from `AENV_CLUSTER_SECRET`."""

    key: bytes

    @classmethod
    def from_secret(cls, secret: str) -> ClusterKey:
        if not secret:
            raise ValueError("the cluster secret is empty")
        return cls(hashlib.sha256(b"aenv-cluster-key/v1\0" + secret.encode()).digest())

    def mac(self, label: str, *parts: str | bytes) -> bytes:
        h = hmac.new(self.key, label.encode(), hashlib.sha256)
        for part in parts:
            raw = part.encode() if isinstance(part, str) else part
            h.update(_SEQ.pack(len(raw)))  # length-prefixed: no ambiguity between parts
            h.update(raw)
        return h.digest()


# -- handshake messages ------------------------------------------------------------


@dataclass(frozen=True)
class Challenge:
    node: str
    nonce: bytes


@dataclass(frozen=True)
class Hello:
    node: str
    url: str
    nonce: bytes
    mac: bytes


@dataclass(frozen=True)
class Welcome:
    node: str
    url: str
    mac: bytes


def encode(msg: Challenge | Hello | Welcome) -> str:
    """A handshake message as one JSON text frame."""
    doc: dict[str, Any] = {"v": VERSION, "t": type(msg).__name__.lower(), "node": msg.node}
    if isinstance(msg, Challenge):
        doc["nonce"] = msg.nonce.hex()
    elif isinstance(msg, Hello):
        doc.update(url=msg.url, nonce=msg.nonce.hex(), mac=msg.mac.hex())
    else:
        doc.update(url=msg.url, mac=msg.mac.hex())
    return json.dumps(doc, separators=(",", ":"))


def decode(text: str | bytes, expect: type[Challenge] | type[Hello] | type[Welcome]) -> Any:
    """Parse a handshake frame of type `expect`; `WireError` for anything else."""
    if len(text) > 4096:
        raise WireError("handshake message too large")
    try:
        doc = json.loads(text)
    except (ValueError, UnicodeDecodeError):
        raise WireError("handshake message is not JSON") from None
    if not isinstance(doc, dict) or doc.get("v") != VERSION:
        raise WireError(f"unsupported cluster protocol (want version {VERSION})")
    if doc.get("t") != expect.__name__.lower():
        raise WireError(f"expected {expect.__name__.lower()}, got {str(doc.get('t'))[:20]!r}")
    node = doc.get("node")
    if not isinstance(node, str) or not valid_node_id(node):
        raise WireError("bad node id in handshake")
    if expect is Challenge:
        return Challenge(node, _hex(doc, "nonce", NONCE_BYTES))
    url = doc.get("url")
    if not isinstance(url, str) or not url or len(url) > _MAX_URL:
        raise WireError("bad url in handshake")
    if expect is Hello:
        return Hello(node, url, _hex(doc, "nonce", NONCE_BYTES), _hex(doc, "mac", MAC_BYTES))
    return Welcome(node, url, _hex(doc, "mac", MAC_BYTES))


def _hex(doc: dict[str, Any], field: str, size: int) -> bytes:
    raw = doc.get(field)
    try:
        value = bytes.fromhex(raw) if isinstance(raw, str) else b""
    except ValueError:
        value = b""
    if len(value) != size:
        raise WireError(f"bad {field} in handshake")
    return value


# -- the two sides -------------------------------------------------------------------


@dataclass(frozen=True)
class Session:
    """An authenticated connection: who the peer is, and the frame codecs."""

    peer: str
    peer_url: str
    sealer: Sealer
    opener: Opener


class ServerHandshake:
    """The accepting side: `challenge()`, then `hello(frame)` gives the Welcome and the session."""

    def __init__(self, key: ClusterKey, node: str, url: str, nonce: bytes) -> None:
        self._key, self._node, self._url, self._nonce = key, node, url, nonce

    def challenge(self) -> str:
        return encode(Challenge(self._node, self._nonce))

    def hello(self, frame: str | bytes) -> tuple[str, Session]:
        hello: Hello = decode(frame, Hello)
        want = self._key.mac("hello", self._nonce, hello.nonce, hello.node, self._node, hello.url)
        if not hmac.compare_digest(want, hello.mac):
            raise AuthError(f"node {hello.node!r} failed authentication (wrong cluster secret?)")
        if hello.node == self._node:
            raise AuthError(f"a peer claims this node's own id {self._node!r}")
        mac = self._key.mac("welcome", self._nonce, hello.nonce, self._node, hello.node, self._url)
        session = _session(self._key, hello.node, hello.url, self._nonce, hello.nonce, "s")
        return encode(Welcome(self._node, self._url, mac)), session


class ClientHandshake:
    """The connecting side: `challenge(frame)` gives the Hello; `welcome(frame)` the session."""

    def __init__(self, key: ClusterKey, node: str, url: str, nonce: bytes) -> None:
        self._key, self._node, self._url, self._nonce = key, node, url, nonce
        self._server_nonce = b""
        self._server = ""

    def challenge(self, frame: str | bytes) -> str:
        ch: Challenge = decode(frame, Challenge)
        self._server_nonce, self._server = ch.nonce, ch.node
        mac = self._key.mac("hello", ch.nonce, self._nonce, self._node, ch.node, self._url)
        return encode(Hello(self._node, self._url, self._nonce, mac))

    def welcome(self, frame: str | bytes) -> Session:
        if not self._server_nonce:
            raise WireError("welcome before challenge")
        w: Welcome = decode(frame, Welcome)
        if w.node != self._server:
            raise AuthError(f"the server changed its id from {self._server!r} to {w.node!r}")
        want = self._key.mac("welcome", self._server_nonce, self._nonce, w.node, self._node, w.url)
        if not hmac.compare_digest(want, w.mac):
            raise AuthError(f"node {w.node!r} failed authentication (wrong cluster secret?)")
        return _session(self._key, w.node, w.url, self._server_nonce, self._nonce, "c")


def _session(
    key: ClusterKey, peer: str, peer_url: str, server_nonce: bytes, client_nonce: bytes, side: str
) -> Session:
    session_key = key.mac("session", server_nonce, client_nonce)
    other = "s" if side == "c" else "c"
    return Session(peer, peer_url, Sealer(session_key, side), Opener(session_key, other))


# -- sealed frames ---------------------------------------------------------------------


class Sealer:
    """Seals this side's frames: sequence number, MAC, payload."""

    def __init__(self, key: bytes, direction: str) -> None:
        self._key, self._dir, self._seq = key, direction.encode(), 0

    def seal(self, payload: bytes) -> bytes:
        if len(payload) > MAX_FRAME:
            raise ValueError(f"frame of {len(payload)} bytes exceeds {MAX_FRAME}")
        self._seq += 1
        seq = _SEQ.pack(self._seq)
        mac = hmac.new(self._key, self._dir + seq + payload, hashlib.sha256).digest()
        return seq + mac + payload


class Opener:
    """Checks the peer's frames: each must carry the next sequence number and a valid MAC."""

    def __init__(self, key: bytes, direction: str) -> None:
        self._key, self._dir, self._seq = key, direction.encode(), 0

    def open(self, frame: bytes) -> bytes:
        head = _SEQ.size + MAC_BYTES
        if len(frame) < head or len(frame) > head + MAX_FRAME:
            raise WireError(f"frame of {len(frame)} bytes is malformed")
        seq, mac, payload = frame[: _SEQ.size], frame[_SEQ.size : head], frame[head:]
        want = hmac.new(self._key, self._dir + seq + payload, hashlib.sha256).digest()
        if not hmac.compare_digest(want, mac):
            raise AuthError("a frame failed its MAC (altered, or from another session)")
        (n,) = _SEQ.unpack(seq)
        if n != self._seq + 1:
            raise AuthError(f"frame {n} out of sequence (expected {self._seq + 1}): a replay?")
        self._seq = n
        return payload
