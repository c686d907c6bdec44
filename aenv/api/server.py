"""Run a node: open it, wrap the REST app in the proxy, serve with Hypercorn.

Hypercorn serves HTTP/1.1, h2c (prior knowledge and upgrade) and WebSocket on
one port. Shutdown (SIGINT/SIGTERM or the caller's cancel) stops accepting,
drains in-flight requests with a grace period, then stops the node, which
tears down every sandbox.
"""

from __future__ import annotations

import logging
import signal
from typing import Any, cast

import trio
from hypercorn.config import Config as HyperConfig
from hypercorn.trio import serve as hyper_serve

from aenv.api.app import create_app
from aenv.api.proxy import ASGIApp, SandboxProxy
from aenv.config import Config
from aenv.node.node import Node, open_node

log = logging.getLogger("aenv.server")


def hypercorn_config(listen: str) -> HyperConfig:
    hc = HyperConfig()
    hc.bind = [listen]
    hc.accesslog = None
    hc.errorlog = logging.getLogger("hypercorn.error")
    hc.graceful_timeout = 5.0
    hc.keep_alive_timeout = 75.0
    hc.h2_max_concurrent_streams = 1000
    hc.websocket_max_message_size = 16 * 1024 * 1024
    return hc


def build_asgi(node: Node) -> SandboxProxy:
    """The REST app behind the sandbox proxy (which sees every request first)."""
    return SandboxProxy(cast(ASGIApp, create_app(node)), node)


async def serve(
    config: Config,
    *,
    task_status: trio.TaskStatus[Node] = trio.TASK_STATUS_IGNORED,
    handle_signals: bool = True,
) -> None:
    async with open_node(config) as node:
        app = build_asgi(node)
        shutdown = trio.Event()
        async with trio.open_nursery() as nursery:
            if handle_signals:
                nursery.start_soon(_wait_signals, shutdown)
            await nursery.start(
                lambda task_status: hyper_serve(
                    cast(Any, app),
                    hypercorn_config(config.listen),
                    shutdown_trigger=shutdown.wait,
                    task_status=task_status,
                )
            )
            log.info("aenv node listening on http://%s (home %s)", config.listen, config.home)
            task_status.started(node)
            await shutdown.wait()
            # hypercorn drains its connections, then returns; then stop the rest
            nursery.cancel_scope.deadline = trio.current_time() + 10
        log.info("stopping every sandbox")
    log.info("aenv node stopped")


async def _wait_signals(shutdown: trio.Event) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for sig in signals:
            log.info("received %s, shutting down", signal.Signals(sig).name)
            shutdown.set()
            return
