"""The cluster handshake and sealed frames (aenv.proto.clusterwire).

Rules: two nodes with the same secret end with a session each, naming the
other; a wrong secret, a replayed or altered message, or a frame out of
order fails with `AuthError`; garbage fails with `WireError`, never another
exception.
"""

from __future__ import annotations

import json
import secrets

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aenv.proto.clusterwire import (
    NONCE_BYTES,
    AuthError,
    ClientHandshake,
    ClusterKey,
    Hello,
    ServerHandshake,
    Session,
    Welcome,
    WireError,
    decode,
    encode,
)

KEY = ClusterKey.from_secret("s3cret")


def _nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def _pair(client_key: ClusterKey = KEY, server_key: ClusterKey = KEY) -> tuple[Session, Session]:
    server = ServerHandshake(server_key, "b", "http://10.0.0.2:8000", _nonce())
    client = ClientHandshake(client_key, "a", "http://10.0.0.1:8000", _nonce())
    hello = client.challenge(server.challenge())
    welcome, s_session = server.hello(hello)
    c_session = client.welcome(welcome)
    return c_session, s_session


def test_same_secret_gives_each_side_a_session_naming_the_other() -> None:
    c, s = _pair()
    assert (c.peer, c.peer_url) == ("b", "http://10.0.0.2:8000")
    assert (s.peer, s.peer_url) == ("a", "http://10.0.0.1:8000")
    for payload in (b"", b"ping", b"x" * 100_000):
        assert s.opener.open(c.sealer.seal(payload)) == payload
        assert c.opener.open(s.sealer.seal(payload)) == payload


def test_a_wrong_secret_is_refused_by_the_server() -> None:
    with pytest.raises(AuthError, match="wrong cluster secret"):
        _pair(client_key=ClusterKey.from_secret("guess"))


def test_a_server_without_the_secret_is_refused_by_the_client() -> None:
    server = ServerHandshake(ClusterKey.from_secret("guess"), "b", "http://b", _nonce())
    client = ClientHandshake(KEY, "a", "http://a", _nonce())
    client.challenge(server.challenge())
    # the impostor cannot check the hello; say it answers anyway with what it can make
    fake = Welcome("b", "http://b", ClusterKey.from_secret("guess").mac("welcome", b"x"))
    with pytest.raises(AuthError):
        client.welcome(encode(fake))


def test_a_replayed_hello_fails_on_a_new_connection() -> None:
    first = ServerHandshake(KEY, "b", "http://b", _nonce())
    client = ClientHandshake(KEY, "a", "http://a", _nonce())
    hello = client.challenge(first.challenge())
    first.hello(hello)
    second = ServerHandshake(KEY, "b", "http://b", _nonce())
    second.challenge()
    with pytest.raises(AuthError):
        second.hello(hello)


def test_a_hello_with_a_changed_url_fails() -> None:
    server = ServerHandshake(KEY, "b", "http://b", _nonce())
    client = ClientHandshake(KEY, "a", "http://a", _nonce())
    hello: Hello = decode(client.challenge(server.challenge()), Hello)
    doc = json.loads(
        json.dumps(
            {"v": 1, "t": "hello", "node": "a", "url": "http://evil", "nonce": hello.nonce.hex()}
        )
    )
    doc["mac"] = hello.mac.hex()
    with pytest.raises(AuthError):
        server.hello(json.dumps(doc))


def test_a_peer_claiming_our_own_id_is_refused() -> None:
    server = ServerHandshake(KEY, "a", "http://b", _nonce())
    client = ClientHandshake(KEY, "a", "http://a", _nonce())
    with pytest.raises(AuthError, match="own id"):
        server.hello(client.challenge(server.challenge()))


def test_frames_replayed_reordered_altered_or_reflected_are_refused() -> None:
    c, s = _pair()
    one, two = c.sealer.seal(b"one"), c.sealer.seal(b"two")
    with pytest.raises(AuthError, match="out of sequence"):
        s.opener.open(two)
    assert s.opener.open(one) == b"one"
    with pytest.raises(AuthError, match="out of sequence"):
        s.opener.open(one)  # replayed
    altered = two[:-1] + bytes([two[-1] ^ 1])
    with pytest.raises(AuthError, match="MAC"):
        s.opener.open(altered)
    assert s.opener.open(two) == b"two"
    # the client's own frame sent back to it
    with pytest.raises(AuthError, match="MAC"):
        c.opener.open(c.sealer.seal(b"mirror"))


def test_a_frame_from_another_session_is_refused() -> None:
    c1, _ = _pair()
    _, s2 = _pair()
    with pytest.raises(AuthError):
        s2.opener.open(c1.sealer.seal(b"hi"))


@given(st.binary(max_size=200))
def test_garbage_frames_raise_only_wire_errors(data: bytes) -> None:
    _, s = _pair()
    with pytest.raises(WireError):
        s.opener.open(data)


@given(st.one_of(st.text(max_size=300), st.binary(max_size=300)))
def test_garbage_handshakes_raise_only_wire_errors(data: str | bytes) -> None:
    server = ServerHandshake(KEY, "b", "http://b", _nonce())
    server.challenge()
    with pytest.raises(WireError):
        server.hello(data)
    client = ClientHandshake(KEY, "a", "http://a", _nonce())
    with pytest.raises(WireError):
        client.challenge(data)


def test_an_empty_secret_is_a_configuration_error() -> None:
    with pytest.raises(ValueError, match="empty"):
        ClusterKey.from_secret("")
