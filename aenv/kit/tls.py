"""TLS for the node: the certificate it serves, replaceable while serving, and how it checks peers.

`ServerTLS.load(cert, key)` reads a PEM certificate chain and its key
(`AENV_TLS_CERT`, `AENV_TLS_KEY`) into the context the listener uses. The
listener keeps that one context for its whole life, so a new certificate
cannot be loaded into it without touching a context live handshakes read.
Instead the listening context's SNI callback hands every new handshake the
context of the certificate loaded last: `reload()` builds a fresh context in
a worker thread and swaps one reference. A certificate that fails to load
leaves the one in use in place. Connections already open keep the
certificate they were made with.

`client_context(ca)` is the context the node dials other nodes with: it
verifies their certificates against the CA bundle `ca` (`AENV_TLS_CA`), or
against the system's store (which honours `SSL_CERT_FILE`) when None.

Settings match Hypercorn's own TLS defaults: TLS 1.2 or newer, no
compression, ECDHE+AESGCM for TLS 1.2, ALPN offering h2 then HTTP/1.1.
"""

from __future__ import annotations

import logging
import ssl
from pathlib import Path

import trio

__all__ = ["ALPN", "ServerTLS", "TLSSetupError", "client_context"]

log = logging.getLogger("aenv.tls")

ALPN = ("h2", "http/1.1")
CIPHERS = "ECDHE+AESGCM"


class TLSSetupError(ValueError):
    """A certificate, key or CA bundle that cannot be used; the message says which and why."""


def _server_context(cert: Path, key: Path) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.set_ciphers(CIPHERS)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.options |= ssl.OP_NO_COMPRESSION
    ctx.set_alpn_protocols(list(ALPN))
    for what, path in (("certificate", cert), ("key", key)):
        if not path.is_file():
            raise TLSSetupError(f"TLS {what} not found: {path}")
    try:
        ctx.load_cert_chain(certfile=str(cert), keyfile=str(key))
    except PermissionError:
        raise TLSSetupError(f"TLS certificate {cert} or key {key} not readable") from None
    except (ssl.SSLError, OSError) as e:
        raise TLSSetupError(
            f"cannot use TLS certificate {cert} with key {key}: {e} "
            "(want a PEM certificate chain, leaf first, and its PEM private key, unencrypted)"
        ) from None
    return ctx


class ServerTLS:
    """The node's server certificate; see the module docstring."""

    def __init__(self, cert: Path, key: Path, first: ssl.SSLContext) -> None:
        self.cert = cert
        self.key = key
        self._current = first
        self.reloads = 0
        # the listener's context: its own certificate answers only if a handshake
        # never reaches the callback; every other handshake gets `_current`
        self.context = first
        first.sni_callback = self._pick

    @classmethod
    def load(cls, cert: Path, key: Path) -> ServerTLS:
        """Read the certificate and key (blocking: call it before serving)."""
        return cls(cert, key, _server_context(cert, key))

    def _pick(self, sock: ssl.SSLObject, server_name: str | None, ctx: ssl.SSLContext) -> None:
        if ctx is not self._current:
            sock.context = self._current

    async def reload(self) -> bool:
        """Read the certificate and key again; new handshakes get them.

        On failure the certificate in use stays and the reason is logged."""
        try:
            fresh = await trio.to_thread.run_sync(_server_context, self.cert, self.key)
        except TLSSetupError as e:
            log.error("TLS certificate not reloaded, the previous one stays in use: %s", e)
            return False
        self._current = fresh
        self.reloads += 1
        log.info("TLS certificate reloaded from %s", self.cert)
        return True


def client_context(ca: Path | None) -> ssl.SSLContext:
    """A context that verifies servers against `ca`, else the system's store."""
    if ca is not None and not ca.is_file():
        raise TLSSetupError(f"TLS CA bundle not found: {ca}")
    try:
        return ssl.create_default_context(cafile=str(ca) if ca is not None else None)
    except (ssl.SSLError, OSError) as e:
        raise TLSSetupError(f"cannot use TLS CA bundle {ca}: {e} (want PEM certificates)") from None
