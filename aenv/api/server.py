"""Run a node: open it, wrap the REST app in the proxy, serve with Hypercorn.

Hypercorn serves HTTP/1.1, h2c (prior knowledge and upgrade) and WebSocket on
one port; with `AENV_TLS_CERT` and `AENV_TLS_KEY` it serves them over TLS
instead (h2 chosen by ALPN), and SIGHUP loads the certificate again. Shutdown (SIGINT/SIGTERM or the caller's cancel) stops accepting,
drains in-flight requests with a grace period, then stops the node, which
tears down every sandbox.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import ssl
from collections.abc import AsyncIterator
from functools import partial
from typing import Any, cast

import trio
from hypercorn.config import Config as HyperConfig
from hypercorn.trio import serve as hyper_serve

from aenv.api.app import create_app
from aenv.api.proxy import SandboxProxy
from aenv.cluster.member import ClusterMember, open_cluster_member
from aenv.cluster.router import ClusterRouter
from aenv.config import Config
from aenv.kit.asgiforward import ASGIApp
from aenv.kit.tls import ServerTLS, client_context
from aenv.node.node import Node, open_node
from aenv.node.service import LocalSandboxService, SandboxService

log = logging.getLogger("aenv.server")


class _HyperConfig(HyperConfig):
    """Hypercorn's settings, serving TLS from this node's reloadable context."""

    tls: ServerTLS | None = None

    def create_ssl_context(self) -> ssl.SSLContext | None:
        return None if self.tls is None else self.tls.context

    @property
    def ssl_enabled(self) -> bool:
        return self.tls is not None


def hypercorn_config(listen: str, tls: ServerTLS | None = None) -> HyperConfig:
    hc = _HyperConfig()
    hc.tls = tls
    hc.bind = [listen]
    hc.accesslog = None
    hc.errorlog = logging.getLogger("hypercorn.error")
    hc.graceful_timeout = 5.0
    hc.keep_alive_timeout = 75.0
    hc.h2_max_concurrent_streams = 1000
    hc.websocket_max_message_size = 16 * 1024 * 1024
    return hc


def build_asgi(
    node: Node, member: ClusterMember | None = None, *, peer_ssl: ssl.SSLContext | None = None
) -> ASGIApp:
    """The REST app behind the sandbox proxy (which sees every request first);
    in a cluster, both behind the router (which sends each request where it
    belongs)."""
    local = LocalSandboxService(node)
    service: SandboxService = local if member is None else member.service(local)
    app = cast(ASGIApp, create_app(service, node, member))
    proxy = SandboxProxy(app, local, domain=node.config.domain, proxied=node.m_proxied)
    if member is None:
        return proxy
    return ClusterRouter(
        proxy,
        member.cluster,
        http=member.http,
        domain=node.config.domain,
        ssl_context=peer_ssl,
        counter=lambda kind: node.m_forwarded.inc(kind=kind),
    )


@contextlib.asynccontextmanager
async def _cluster_of(
    config: Config, node: Node, tls: ServerTLS | None, peer_ssl: ssl.SSLContext
) -> AsyncIterator[ClusterMember | None]:
    if not config.clustered:
        yield None
        return
    serve_ssl = None if tls is None else tls.context
    async with open_cluster_member(config, node, peer_ssl=peer_ssl, serve_ssl=serve_ssl) as member:
        yield member


async def serve(
    config: Config,
    *,
    task_status: trio.TaskStatus[Node] = trio.TASK_STATUS_IGNORED,
    handle_signals: bool = True,
) -> None:
    """Serve until SIGINT/SIGTERM (or cancellation), then drain and tear down.

    With `on_stop = "keep"` (the default) a signal ends the process once the
    API has drained and paused sandboxes are on disk, without stopping the
    running ones: they run on, journaled, and the next node process takes
    them back. That is the path a crash takes too (which must work anyway),
    so nothing is torn down that a restart would need. With "stop", and on
    cancellation, every sandbox is stopped.

    The signal receiver stays installed until every sandbox is torn down, so a
    second signal during shutdown is logged, never fatal half-way through.
    SIGHUP reloads the TLS certificate.

    TLS files are read before anything else: one that cannot be used raises
    `TLSSetupError` before the node touches a sandbox.
    """
    shutdown = trio.Event()
    tls = None
    if config.tls_cert is not None and config.tls_key is not None:
        tls = ServerTLS.load(config.tls_cert, config.tls_key)
    peer_ssl = client_context(config.tls_ca)
    receiver = (
        trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        if handle_signals
        else contextlib.nullcontext(None)
    )
    with receiver as signals:
        async with (
            open_node(config) as node,
            _cluster_of(config, node, tls, peer_ssl) as member,
            trio.open_nursery() as outer,
        ):
            if signals is not None:
                outer.start_soon(_watch_signals, signals, shutdown, tls)
            async with trio.open_nursery() as inner:
                await inner.start(
                    partial(
                        hyper_serve,
                        cast(Any, build_asgi(node, member, peer_ssl=peer_ssl)),
                        hypercorn_config(config.listen, tls),
                        shutdown_trigger=shutdown.wait,
                    )
                )
                log.info(
                    "aenv node listening on %s://%s (home %s)",
                    config.scheme,
                    config.listen,
                    config.home,
                )
                task_status.started(node)
            # Hypercorn has drained its connections; stop the rest
            keep = config.on_stop == "keep" and shutdown.is_set()
            if keep:
                await node.park_node_served()  # they cannot run on without this process
                # paused in memory: a copy on disk, to survive a reboot; they stay frozen
                await node.write_behind_paused()
            else:
                await node.hibernate_paused()  # paused in memory: to disk, to survive
            running = node.statistics()["running"]
            if keep and running:
                log.info("leaving %d sandboxes running for the next node process", running)
                logging.shutdown()
                os._exit(0)
            log.info("stopping every sandbox")
            outer.cancel_scope.cancel()
    log.info("aenv node stopped")


async def _watch_signals(
    signals: AsyncIterator[int], shutdown: trio.Event, tls: ServerTLS | None
) -> None:
    async for sig in signals:
        if sig == signal.SIGHUP:
            if tls is None:
                log.info("received SIGHUP; no TLS certificate to reload (AENV_TLS_CERT unset)")
            else:
                await tls.reload()
        elif shutdown.is_set():
            log.warning("received %s again; already shutting down", signal.Signals(sig).name)
        else:
            log.info("received %s, shutting down", signal.Signals(sig).name)
            shutdown.set()
