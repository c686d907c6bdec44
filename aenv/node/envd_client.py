"""The host's client for a sandbox's envd: Connect calls over the node's HTTP client.

Every caller on the host that runs processes in a sandbox goes through
`EnvdClient`: the exec WebSocket (`aenv.api.exec_ws`) and template builds
(`aenv.node.builds`). It speaks Connect with the protobuf codec
(`aenv.proto.connect` framing, `aenv.proto.envd_schema` messages) and
authenticates with the sandbox's envd access token and, for process calls,
the user to run as (HTTP Basic with an empty password, as the E2B SDKs do).

`start_process` opens `process.Process/Start`, a server stream, and returns a
`ProcessStream`: iterate it for the process's events; it reads one chunk from
envd at a time, so a slow consumer stops envd reading the process's output.
"""

from __future__ import annotations

import base64
import collections
from types import TracebackType

import httpx
import trio

from aenv.proto import connect as cn
from aenv.proto import envd_schema as es
from aenv.proto.pb import DecodeError, Message, MessageType

KEEPALIVE_S = 30  # envd sends a keepalive event this often on an idle stream
MAX_MESSAGE = 1024 * 1024
MAX_ERROR_BODY = 64 * 1024
UNARY_TIMEOUT = httpx.Timeout(connect=10.0, read=30.0, write=30.0, pool=10.0)
STREAM_TIMEOUT = httpx.Timeout(connect=10.0, read=None, write=30.0, pool=10.0)


class EnvdClient:
    """Connect calls to one sandbox's envd (at `base_url`) on behalf of one user.

    `user` None runs processes as the sandbox's default user. With
    `close_connections`, no connection stays idle after a call (a memory
    capture of the sandbox must not hold one).
    """

    def __init__(
        self,
        http: httpx.AsyncClient,
        base_url: str,
        access_token: str,
        *,
        user: str | None = None,
        close_connections: bool = False,
    ) -> None:
        self.http = http
        self.base_url = base_url
        self.headers = {"x-access-token": access_token, "connect-protocol-version": "1"}
        if user is not None:
            self.headers["authorization"] = (
                "Basic " + base64.b64encode(f"{user}:".encode()).decode()
            )
        if close_connections:
            self.headers["connection"] = "close"

    async def unary(self, procedure: str, request_type: MessageType, msg: Message) -> None:
        """Call `procedure` (such as "process.Process/SendInput"); the answer is dropped.

        Raises ConnectError if envd refuses, httpx errors if it is unreachable.
        """
        r = await self.http.post(
            f"{self.base_url}/{procedure}",
            content=request_type.encode(msg),
            headers={**self.headers, "content-type": "application/proto"},
            timeout=UNARY_TIMEOUT,
        )
        if r.status_code != 200:
            raise error_from(r.status_code, r.content)

    async def start_process(self, req: Message) -> ProcessStream:
        """Start a process (`req` is a `process.StartRequest`) and open its event stream.

        Raises ConnectError if envd refuses to start it, httpx errors if envd
        is unreachable. Close the stream (`async with`) when done with it.
        """
        request = self.http.build_request(
            "POST",
            f"{self.base_url}/process.Process/Start",
            content=cn.encode_envelope(es.START_REQUEST.encode(req)),
            headers={
                **self.headers,
                "content-type": "application/connect+proto",
                "keepalive-ping-interval": str(KEEPALIVE_S),
            },
            timeout=STREAM_TIMEOUT,
        )
        resp = await self.http.send(request, stream=True)
        if resp.status_code == 200:
            return ProcessStream(resp)
        try:
            body = b""
            async for chunk in resp.aiter_raw():
                body += chunk
                if len(body) > MAX_ERROR_BODY:
                    break
        finally:
            with trio.CancelScope(shield=True):
                await resp.aclose()
        raise error_from(resp.status_code, body)


class ProcessStream:
    """The events of one `process.Process/Start` stream, as `ProcessEvent` dicts.

    `async for event in stream` yields `{"start": ...}`, `{"data": ...}`,
    `{"end": ...}` and `{"keepalive": ...}` events. Iteration stops when envd
    ends the stream (`complete` is then True) or closes it without an end
    (`complete` stays False); an error envd ends the stream with is raised as
    ConnectError, a broken stream as an httpx error or DecodeError.
    """

    def __init__(self, resp: httpx.Response) -> None:
        self._resp = resp
        self._chunks = resp.aiter_raw()
        self._decoder = cn.EnvelopeDecoder(max_message_size=MAX_MESSAGE)
        self._pending: collections.deque[cn.Envelope] = collections.deque()
        self._done = False
        self.complete = False

    def __aiter__(self) -> ProcessStream:
        return self

    async def __anext__(self) -> Message:
        while not self._pending:
            if self._done:
                raise StopAsyncIteration
            try:
                chunk = await self._chunks.__anext__()
            except StopAsyncIteration:
                self._done = True
                self._decoder.close()  # DecodeError if a message was cut off
                raise
            self._pending.extend(self._decoder.feed(chunk))
        env = self._pending.popleft()
        if env.end_stream:
            self._done = self.complete = True
            self._pending.clear()
            error, _ = cn.parse_end_stream(env.data)
            if error is not None:
                raise error
            raise StopAsyncIteration
        event: Message = es.START_RESPONSE.decode(env.data).get("event", {})
        return event

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            await self._resp.aclose()

    async def __aenter__(self) -> ProcessStream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


def error_from(status: int, body: bytes) -> cn.ConnectError:
    """The ConnectError of a failed unary call or stream open (HTTP `status`, `body`)."""
    try:
        return cn.parse_error_body(body[:MAX_ERROR_BODY])
    except DecodeError:
        return cn.ConnectError(cn.code_from_http_status(status), f"envd answered HTTP {status}")
