"""Connect RPC server shell: routes Connect calls to envd's handlers over ASGI.

Unary calls accept application/proto and application/json; server- and
client-streaming calls application/connect+proto and application/connect+json
(5-byte envelopes, JSON end-of-stream). `Connect-Timeout-Ms` bounds each
call; a client that disconnects cancels its server stream. Handlers raise
`ConnectError` for RPC errors; anything else becomes `internal`. A server
stream's handler may return its last message rather than send it: it then
goes out with the end of the stream in one write (for a command, its `end`
event: one write less between a process's exit and the caller's answer).
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import trio

from aenv.envd.asgi import ClientDisconnected, Request, Response, watch_disconnect
from aenv.proto import connect
from aenv.proto.connect import Code, Codec, ConnectError
from aenv.proto.envd_schema import METHODS_BY_PATH, Method, StreamKind
from aenv.proto.pb import DecodeError, Message, MessageType

log = logging.getLogger("aenv.envd.rpc")

MAX_MESSAGE_SIZE = 16 * 1024 * 1024


@dataclass
class CallContext:
    request: Request
    method: Method
    codec: Codec
    timeout: float | None

    def header(self, name: str) -> str | None:
        return self.request.headers.get(name.lower())


SendMessage = Callable[[Message], Awaitable[None]]
UnaryHandler = Callable[[Message, CallContext], Awaitable[Message]]
ServerStreamHandler = Callable[[Message, CallContext, SendMessage], Awaitable[Message | None]]
ClientStreamHandler = Callable[[AsyncIterator[Message], CallContext], Awaitable[Message]]
Handler = UnaryHandler | ServerStreamHandler | ClientStreamHandler


def _decode(mtype: MessageType, codec: Codec, data: bytes) -> Message:
    try:
        if codec is Codec.JSON:
            return mtype.decode_json(data) if data else mtype.default()
        return mtype.decode(data)
    except DecodeError as e:
        raise ConnectError(
            Code.INVALID_ARGUMENT, f"unmarshal into {mtype.full_name}: {e}"
        ) from None


def _encode(mtype: MessageType, codec: Codec, msg: Message) -> bytes:
    return mtype.encode_json(msg) if codec is Codec.JSON else mtype.encode(msg)


def _decompress(data: bytes, encoding: str | None) -> bytes:
    if not encoding or encoding == "identity":
        return data
    if encoding != "gzip":
        raise ConnectError(Code.UNIMPLEMENTED, f"unknown compression {encoding!r}")
    d = zlib.decompressobj(wbits=31)
    try:
        out = d.decompress(data, MAX_MESSAGE_SIZE + 1)
    except zlib.error as e:
        raise ConnectError(Code.INVALID_ARGUMENT, f"invalid gzip data: {e}") from None
    if len(out) > MAX_MESSAGE_SIZE or d.unconsumed_tail:
        raise ConnectError(Code.RESOURCE_EXHAUSTED, "message too large")
    return out


async def _watch(request: Request, target: trio.CancelScope, own: trio.CancelScope) -> None:
    """Cancel `target` when the client disconnects (until `own` is cancelled)."""
    with own:
        await watch_disconnect(request, target)


class ConnectRouter:
    """Serves the methods in `handlers` (keyed by path, e.g. /process.Process/Start)."""

    def __init__(self, handlers: dict[str, Handler], *, watchers: trio.Nursery) -> None:
        self.handlers = handlers
        # where the tasks that watch for a client going away live (a nursery
        # per call would make the call wait for its watcher to end)
        self._watchers = watchers

    def handles(self, path: str) -> bool:
        return path in METHODS_BY_PATH

    async def __call__(self, request: Request, response: Response) -> None:
        method = METHODS_BY_PATH[request.path]
        handler = self.handlers.get(request.path)
        streaming = method.kind is not StreamKind.UNARY
        if request.method != "POST":
            await response.full(405, b"", [("allow", "POST")])
            return
        codec = connect.negotiate(request.headers.get("content-type"), streaming=streaming)
        if codec is None:
            accept = (
                "application/connect+proto, application/connect+json"
                if streaming
                else "application/proto, application/json"
            )
            await response.full(415, b"", [("accept-post", accept)])
            return
        try:
            timeout = connect.parse_timeout_ms(request.headers.get("connect-timeout-ms"))
        except DecodeError as e:
            timeout = None
            early: ConnectError | None = ConnectError(Code.INVALID_ARGUMENT, str(e))
        else:
            early = None
        if handler is None:
            early = ConnectError(Code.UNIMPLEMENTED, f"{method.path} is not implemented")
        ctx = CallContext(request, method, codec, timeout)
        if method.kind is StreamKind.UNARY:
            await self._unary(ctx, handler, response, early)  # type: ignore[arg-type]
        elif method.kind is StreamKind.SERVER_STREAM:
            await self._server_stream(ctx, handler, response, early)  # type: ignore[arg-type]
        else:
            await self._client_stream(ctx, handler, response, early)  # type: ignore[arg-type]

    # ------------------------------------------------------------- unary

    async def _unary(
        self,
        ctx: CallContext,
        handler: UnaryHandler,
        response: Response,
        early: ConnectError | None,
    ) -> None:
        method, codec = ctx.method, ctx.codec
        result: Message | None = None
        try:
            if early is not None:
                raise early
            try:
                body = await ctx.request.read_body(MAX_MESSAGE_SIZE)
            except ClientDisconnected:
                return
            except Exception:
                raise ConnectError(Code.RESOURCE_EXHAUSTED, "message too large") from None
            body = _decompress(body, ctx.request.headers.get("content-encoding"))
            msg = _decode(method.request, codec, body)
            result = await self._run_bounded(ctx, lambda: handler(msg, ctx))
            if ctx.request.disconnected:
                return
            if result is None:
                raise ConnectError(Code.DEADLINE_EXCEEDED, "the operation timed out")
        except ConnectError as err:
            await response.full(
                err.code.http_status,
                connect.error_body(err),
                [("content-type", "application/json")],
            )
            return
        except Exception as exc:
            log.exception("unary %s failed", method.path)
            internal = ConnectError(Code.INTERNAL, str(exc) or type(exc).__name__)
            await response.full(
                500, connect.error_body(internal), [("content-type", "application/json")]
            )
            return
        payload = _encode(method.response, codec, result)
        await response.full(
            200, payload, [("content-type", connect.content_type(codec, streaming=False))]
        )

    async def _run_bounded(self, ctx: CallContext, fn: Callable[[], Awaitable[Any]]) -> Any:
        """Run `fn()` under the call's deadline, cancelled if the client goes.

        Returns its result, or None if it was cut off by either. `fn` runs in
        this task; the watcher of the client runs in the router's nursery and
        is cancelled, not waited for, when `fn` is done: no scheduling round
        before the call or after it (each one a round trip through the
        sandbox's kernel, under gVisor)."""
        with trio.move_on_after(ctx.timeout if ctx.timeout is not None else float("inf")) as bound:
            watcher = trio.CancelScope()
            self._watchers.start_soon(_watch, ctx.request, bound, watcher)
            try:
                return await fn()
            finally:
                watcher.cancel()
        return None

    # ---------------------------------------------------------- streaming

    async def _read_single_envelope(self, ctx: CallContext) -> Message:
        decoder = connect.EnvelopeDecoder(max_message_size=MAX_MESSAGE_SIZE)
        envelopes: list[connect.Envelope] = []
        try:
            async for chunk in ctx.request.iter_body():
                envelopes.extend(decoder.feed(chunk))
            decoder.close()
        except DecodeError as e:
            raise ConnectError(Code.INVALID_ARGUMENT, str(e)) from None
        messages = [e for e in envelopes if not e.end_stream]
        if len(messages) != 1:
            raise ConnectError(
                Code.INVALID_ARGUMENT, f"expected exactly one request message, got {len(messages)}"
            )
        env = messages[0]
        data = env.data
        if env.compressed:
            data = _decompress(data, ctx.request.headers.get("connect-content-encoding"))
        return _decode(ctx.method.request, ctx.codec, data)

    async def _server_stream(
        self,
        ctx: CallContext,
        handler: ServerStreamHandler,
        response: Response,
        early: ConnectError | None,
    ) -> None:
        method, codec = ctx.method, ctx.codec
        ctype = connect.content_type(codec, streaming=True)

        async def ensure_started() -> None:
            if not response.started:
                await response.start(200, [("content-type", ctype)])

        async def send(msg: Message) -> None:
            await ensure_started()
            await response.write(connect.encode_envelope(_encode(method.response, codec, msg)))

        error: ConnectError | None = early
        last = b""
        try:
            if error is None:
                request_msg = await self._read_single_envelope(ctx)
                done = await self._run_bounded(
                    ctx, lambda: self._call_stream(handler, request_msg, ctx, send)
                )
                if ctx.request.disconnected:
                    return
                if done is None:
                    error = ConnectError(Code.DEADLINE_EXCEEDED, "the operation timed out")
                else:
                    last = b"".join(
                        connect.encode_envelope(_encode(method.response, codec, m)) for m in done
                    )
        except ClientDisconnected:
            return
        except ConnectError as err:
            error = err
        except Exception as exc:
            log.exception("stream %s failed", method.path)
            error = ConnectError(Code.INTERNAL, str(exc) or type(exc).__name__)
        await ensure_started()
        await response.write(
            last + connect.encode_envelope(connect.end_stream_body(error), end_stream=True),
            more=False,
        )

    @staticmethod
    async def _call_stream(
        handler: ServerStreamHandler, msg: Message, ctx: CallContext, send: SendMessage
    ) -> list[Message]:
        last = await handler(msg, ctx, send)
        return [] if last is None else [last]

    async def _client_stream(
        self,
        ctx: CallContext,
        handler: ClientStreamHandler,
        response: Response,
        early: ConnectError | None,
    ) -> None:
        method, codec = ctx.method, ctx.codec

        async def messages() -> AsyncIterator[Message]:
            decoder = connect.EnvelopeDecoder(max_message_size=MAX_MESSAGE_SIZE)
            try:
                async for chunk in ctx.request.iter_body():
                    for env in decoder.feed(chunk):
                        if env.end_stream:
                            continue
                        data = env.data
                        if env.compressed:
                            data = _decompress(
                                data, ctx.request.headers.get("connect-content-encoding")
                            )
                        yield _decode(method.request, codec, data)
                decoder.close()
            except DecodeError as e:
                raise ConnectError(Code.INVALID_ARGUMENT, str(e)) from None

        error: ConnectError | None = early
        result: Message | None = None
        try:
            if error is None:
                with trio.move_on_after(ctx.timeout if ctx.timeout is not None else float("inf")):
                    result = await handler(messages(), ctx)
                if result is None:
                    error = ConnectError(Code.DEADLINE_EXCEEDED, "the operation timed out")
        except ClientDisconnected:
            return
        except ConnectError as err:
            error = err
        except Exception as exc:
            log.exception("client stream %s failed", method.path)
            error = ConnectError(Code.INTERNAL, str(exc) or type(exc).__name__)
        await response.start(200, [("content-type", connect.content_type(codec, streaming=True))])
        if error is None and result is not None:
            await response.write(connect.encode_envelope(_encode(method.response, codec, result)))
        await response.write(
            connect.encode_envelope(connect.end_stream_body(error), end_stream=True)
        )
        await response.end()
