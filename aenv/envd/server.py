"""Serving envd with Hypercorn's trio worker (HTTP/1.1, h2c upgrade and prior knowledge).

`serve_envd` owns the service nursery in which user processes and polling
watchers live, builds the ASGI app on it and runs Hypercorn until cancelled
or until SIGTERM/SIGINT, then drains with a deadline. Should Hypercorn's
serving loop ever fail, it is restarted without touching the services, so
user processes outlive a server fault. `guard_hypercorn_h2` works around a
Hypercorn 0.18 bug where an HTTP/2 DATA frame for a stream already answered
(a response sent before the request body was read) raised KeyError and took
the whole server down. `guard_hypercorn_idle_close` works around another:
a connection its client closed while idle stayed open on envd's side until
the keep-alive timeout, which a memory image must never catch (see there).
"""

from __future__ import annotations

import logging
import signal
import socket
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from aenv.envd.app import EnvdApp
from aenv.envd.guard import DEFAULT_PROCESS_LIMIT, reap_orphans, watch_memory
from aenv.envd.spawner import SpawnerClient, fork_spawner
from aenv.envd.state import EnvdState
from aenv.envd.taskguard import end_largest_group_on_signal

DEFAULT_PORT = 49983
log = logging.getLogger("aenv.envd")


def guard_hypercorn_h2() -> None:
    """Drop (but flow-control-acknowledge) DATA for streams Hypercorn closed."""
    import h2.events
    from hypercorn.protocol.h2 import H2Protocol

    original = H2Protocol._handle_events
    if getattr(original, "_aenv_guarded", False):
        return

    async def _handle_events(self: H2Protocol, events: list[h2.events.Event]) -> None:
        # Each DATA frame is checked just before it is handled: handling the
        # events before it may open its stream, and may let the app answer
        # and close it (an answer that does not wait for the body)
        batch: list[h2.events.Event] = []
        for event in events:
            if isinstance(event, h2.events.DataReceived):
                if batch:
                    await original(self, batch)
                    batch = []
                if event.stream_id not in self.streams:
                    self.connection.acknowledge_received_data(
                        event.flow_controlled_length, event.stream_id
                    )
                    continue
            batch.append(event)
        await original(self, batch)

    _handle_events._aenv_guarded = True  # type: ignore[attr-defined]
    H2Protocol._handle_events = _handle_events  # type: ignore[method-assign]


def guard_hypercorn_idle_close() -> None:
    """Close a connection as soon as its client closes it, also when it was idle.

    Hypercorn 0.18's trio TCPServer closes its socket only once every task
    of the connection has ended, the keep-alive timer included: a client
    that closes an idle keep-alive connection left envd's socket half-open
    (CLOSE_WAIT) for `keep_alive_timeout` (75 s). The node closes its
    connections before it checkpoints a sandbox and waits for envd to close
    its side; a socket envd still holds when runsc (20240729,
    --net-disconnect-ok) takes the image is reset inside the save, which
    leaves envd's epoll instance unable to report anything once the image
    is restored: a fork child or a sandbox resumed from disk whose envd
    accepts TCP handshakes but never reads a request.
    """
    from hypercorn.trio.tcp_server import TCPServer

    original = TCPServer._read_data
    if getattr(original, "_aenv_guarded", False):
        return

    async def _read_data(self: TCPServer) -> None:
        await original(self)
        # the client is gone: nothing is left for the keep-alive timer to time
        await self.idle_task.stop()

    _read_data._aenv_guarded = True  # type: ignore[attr-defined]
    TCPServer._read_data = _read_data  # type: ignore[method-assign]


def coalesce_hypercorn_h11_writes() -> None:
    """Write each ASGI message in one piece, and the headers with the first body.

    Hypercorn 0.18 writes an HTTP/1.1 response's headers, each body chunk and
    the chunked terminator in separate socket writes: a command's answer was
    four (headers, `start`, `end`, terminator), each a system call, a
    scheduling round and a segment the node's proxy wakes up for. Here the
    bytes h11 makes for one ASGI message go out in one write; the headers
    wait for the message after them (envd always writes a body right after
    the start of a response: a Connect stream its first message). Anything
    else hypercorn sends (the stream closing, an error) writes what is held
    first, so the order on the wire is unchanged. HTTP/2 is left as it is.
    """
    import h11
    from hypercorn.events import Closed, RawData
    from hypercorn.protocol.events import Body, EndBody, Response
    from hypercorn.protocol.h11 import H11Protocol
    from hypercorn.protocol.http_stream import HTTPStream
    from hypercorn.trio.tcp_server import TCPServer

    original_app_send = HTTPStream.app_send
    if getattr(original_app_send, "_aenv_guarded", False):
        return
    original_event = H11Protocol._send_h11_event
    original_stream_send = H11Protocol.stream_send

    async def flush(proto: H11Protocol) -> None:
        held: list[bytes] | None = getattr(proto, "_aenv_held", None)
        proto._aenv_held = None  # type: ignore[attr-defined]
        if held and (data := b"".join(held)):
            await proto.send(RawData(data=data))

    async def _send_h11_event(self: H11Protocol, event: Any) -> None:
        held: list[bytes] | None = getattr(self, "_aenv_held", None)
        if held is None:
            await original_event(self, event)
            return
        try:
            held.append(self.connection.send(event) or b"")
        except h11.LocalProtocolError:
            if self.connection.their_state != h11.ERROR:
                raise

    async def stream_send(self: H11Protocol, event: Any) -> None:
        if not isinstance(event, Response | Body | EndBody):
            await flush(self)
        await original_stream_send(self, event)

    async def app_send(self: HTTPStream, message: Any) -> None:
        proto = getattr(self.send, "__self__", None)
        if message is None or not isinstance(proto, H11Protocol):
            await original_app_send(self, message)
            return
        if getattr(proto, "_aenv_held", None) is None:
            proto._aenv_held = []  # type: ignore[attr-defined]
        hold = False
        try:
            await original_app_send(self, message)
            hold = message["type"] == "http.response.start"
        finally:
            if not hold:
                await flush(proto)

    original_protocol_send = TCPServer.protocol_send

    async def protocol_send(self: TCPServer, event: Any) -> None:
        # (uncontended, the lock is taken without yielding: the bytes go out a
        # scheduling round sooner; otherwise, and for other events, as before)
        if not isinstance(event, RawData) or self.send_lock.locked():
            await original_protocol_send(self, event)
            return
        self.send_lock.acquire_nowait()
        try:
            with trio.CancelScope(shield=True):
                await self.stream.send_all(event.data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            await self.protocol.handle(Closed())
        finally:
            self.send_lock.release()

    app_send._aenv_guarded = True  # type: ignore[attr-defined]
    TCPServer.protocol_send = protocol_send  # type: ignore[method-assign]
    H11Protocol._send_h11_event = _send_h11_event  # type: ignore[method-assign]
    H11Protocol.stream_send = stream_send  # type: ignore[method-assign]
    HTTPStream.app_send = app_send  # type: ignore[method-assign]


def hypercorn_config(host: str, port: int, *, access_log: bool = False) -> Config:
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = "-" if access_log else None
    config.errorlog = logging.getLogger("hypercorn.error")
    config.loglevel = "INFO" if access_log else "WARNING"
    config.keep_alive_timeout = 75
    config.read_timeout = None
    config.graceful_timeout = 3
    config.h2_max_concurrent_streams = 1000
    config.include_server_header = False
    return config


async def _wait_for_signal() -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            return


async def serve_envd(
    *,
    host: str = "0.0.0.0",
    port: int = DEFAULT_PORT,
    state: EnvdState | None = None,
    handle_signals: bool = True,
    access_log: bool = False,
    guard: bool = False,
    spawner: tuple[int, socket.socket] | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve envd until cancelled (or a signal, when `handle_signals`); with
    `guard`, also keep the machine's memory and processes in bounds
    (`aenv.envd.guard`: only as a sandbox's pid 1, never on a host), and
    start user processes through `spawner` (forked by `__main__` before the
    large imports; forked here if not given)."""
    guard_hypercorn_h2()
    guard_hypercorn_idle_close()
    coalesce_hypercorn_h11_writes()
    client = None
    if guard:
        try:
            client = SpawnerClient(*(spawner or fork_spawner(DEFAULT_PROCESS_LIMIT)))
        except OSError:
            log.exception("could not start the spawner; envd spawns processes itself")
    async with trio.open_nursery() as services:
        if state is None:
            state = EnvdState()
        if client is not None:
            services.start_soon(client.run)
        app = EnvdApp(services, state=state, spawner=client)
        if guard:
            state.process_limit = DEFAULT_PROCESS_LIMIT
            services.start_soon(lambda: watch_memory(spare=app.process.spawner_pids))
            services.start_soon(end_largest_group_on_signal, app.process.spawner_pids)
            services.start_soon(reap_orphans, app.process.live.keys, lambda: app.process.spawning)
        config = hypercorn_config(host, port, access_log=access_log)
        trigger = _wait_for_signal if handle_signals else None
        status: trio.TaskStatus[list[str]] | None = task_status
        while True:
            try:
                if status is not None:
                    await serve(app, config, shutdown_trigger=trigger, task_status=status)  # type: ignore[arg-type]
                else:
                    await serve(app, config, shutdown_trigger=trigger)  # type: ignore[arg-type]
                break
            except Exception:
                log.exception("HTTP server failed; restarting it")
                status = None
                await trio.sleep(0.2)
        services.cancel_scope.cancel()


def main(
    argv: list[str] | None = None, *, spawner: tuple[int, socket.socket] | None = None
) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m aenv.envd", description=__doc__)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--log-level", default="WARNING")
    parser.add_argument("--access-log", action="store_true", help="log every request to stderr")
    parser.add_argument(
        "--guard", action="store_true", help="as a sandbox's pid 1: OOM killer and process limit"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    trio.run(
        lambda: serve_envd(
            host=args.host,
            port=args.port,
            access_log=args.access_log,
            guard=args.guard,
            spawner=spawner if args.guard else None,
        )
    )
