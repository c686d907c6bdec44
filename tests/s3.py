"""A real S3 API for tests: moto in server mode on a loopback port, with failure injection.

`MotoS3` runs moto's `ThreadedMotoServer` on a free loopback port (or a free
port of another local address, `host`: the cluster lab binds it to its
bridge) and creates a bucket through boto3. It can be stopped (the port then refuses connections,
requests in flight have their connection reset) and started again on the same
port; moto keeps its state in the process, so the bucket and its objects
survive a restart, as with a real server that went away and came back.
Failure injection goes through a small WSGI wrapper in front of moto:
`fail_next(n, status=503)` answers the next `n` requests with an error status
(throttling, 5xx), `kill_after(n)` lets `n` more requests through and then
resets the connection of the next one and stops the server, so a test can
cut a multipart upload in the middle. `requests` counts requests seen.
Conditional writes (`If-Match`, `If-None-Match`) are serialised by the
wrapper: moto checks the condition and then writes without a lock, so two
racing requests could both pass, where S3 lets exactly one win.
`config()` gives the obstore S3 settings (endpoint, test credentials,
region) and `env()` the same as the provider's AWS_* environment variables.
The session fixture `s3_server` hands out one shared server (tests isolate by
key prefix); `s3_faulty` gives a test its own server to stop and restart.
"""

from __future__ import annotations

import contextlib
import secrets
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import boto3
import pytest
from moto.server import ThreadedMotoServer

from aenv.storage.objstore import MiB, ObjectStore, RetryPolicy, open_object_store

ACCESS_KEY = "test"
SECRET_KEY = "test"
REGION = "us-east-1"

_StartResponse = Callable[..., Any]
_App = Callable[[dict[str, Any], _StartResponse], Iterable[bytes]]


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class _Server(ThreadedMotoServer):
    """ThreadedMotoServer whose WSGI app is wrapped by `wrap`."""

    def __init__(self, host: str, port: int, wrap: Callable[[_App], _App]) -> None:
        super().__init__(ip_address=host, port=port, verbose=False)
        self._wrap = wrap

    def _server_entry(self) -> None:
        from moto.moto_server.werkzeug_app import (
            DomainDispatcherApplication,
            MotoRequestHandler,
            create_backend_app,
        )
        from werkzeug.serving import make_server

        app = self._wrap(DomainDispatcherApplication(create_backend_app))
        self._server = make_server(
            self._ip_address, self._port, app, True, request_handler=MotoRequestHandler
        )
        self._server_ready_event.set()
        self._server.serve_forever(poll_interval=0.05)


class MotoS3:
    def __init__(self, *, bucket: str = "aenv-test", host: str = "127.0.0.1") -> None:
        self.bucket = bucket
        self.host = host
        self.port = _free_port(host)
        self.endpoint = f"http://{host}:{self.port}"
        self.requests = 0
        self._lock = threading.Lock()
        self._conditional = threading.Lock()  # one conditional write at a time, as in S3
        self._fail: list[int] = []  # statuses to answer, one per request
        self._kill_after: int | None = None
        self._dead = False  # killed: reset every connection until stopped
        self._server: _Server | None = None

    # -- lifecycle -------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._server is not None

    def start(self) -> None:
        if self._server is not None:
            return
        self._dead = False
        server = _Server(self.host, self.port, self._wrap)
        server.start()
        self._server = server
        client = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name=REGION,
        )
        with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
            client.create_bucket(Bucket=self.bucket)

    def stop(self) -> None:
        with self._lock:
            server, self._server = self._server, None
            self._kill_after = None
        if server is not None:
            server.stop()

    # -- failure injection -------------------------------------------------

    def fail_next(self, n: int, *, status: int = 503) -> None:
        with self._lock:
            self._fail = [status] * n

    def kill_after(self, n: int) -> None:
        with self._lock:
            self._kill_after = n

    # -- client side ---------------------------------------------------------

    def url(self, prefix: str = "") -> str:
        return f"s3://{self.bucket}/{prefix}".rstrip("/")

    def config(self) -> dict[str, str]:
        """obstore S3 configuration for this server (no process environment needed)."""
        return {
            "endpoint": self.endpoint,
            "access_key_id": ACCESS_KEY,
            "secret_access_key": SECRET_KEY,
            "region": REGION,
        }

    def env(self) -> dict[str, str]:
        """The same settings as the AWS_* environment variables obstore reads."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": REGION,
            "AWS_ALLOW_HTTP": "true",
        }

    def boto(self) -> Any:
        """A boto3 client, to reach objects behind the store's back."""
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name=REGION,
        )

    # -- WSGI wrapper ----------------------------------------------------------

    def _wrap(self, app: _App) -> _App:
        def wrapped(environ: dict[str, Any], start_response: _StartResponse) -> Iterable[bytes]:
            with self._lock:
                self.requests += 1
                status = self._fail.pop(0) if self._fail else None
                kill = self._dead
                if self._kill_after is not None:
                    if self._kill_after <= 0:
                        kill = self._dead = True
                        self._kill_after = None
                        # The server goes away: no new connections are accepted...
                        threading.Thread(target=self.stop, daemon=True).start()
                    else:
                        self._kill_after -= 1
            if kill:
                # ...and the connections in flight are cut without an answer.
                sock = environ.get("werkzeug.socket")
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)
                start_response("500 Internal Server Error", [("Content-Length", "0")])
                return [b""]
            if status is not None:
                body = (
                    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
                    b"<Message>injected</Message></Error>"
                )
                start_response(
                    f"{status} Injected",
                    [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))],
                )
                return [body]
            conditional = "HTTP_IF_MATCH" in environ or "HTTP_IF_NONE_MATCH" in environ
            if conditional and environ.get("REQUEST_METHOD") == "PUT":
                with self._conditional:
                    return list(app(environ, start_response))
            return app(environ, start_response)

        return wrapped


@pytest.fixture(scope="session")
def s3_server() -> Iterator[MotoS3]:
    """One moto S3 server for the session, bucket created; tests isolate by prefix."""
    server = MotoS3(bucket="aenv-shared")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_faulty() -> Iterator[MotoS3]:
    """A moto S3 server of the test's own, to stop, restart and inject faults into."""
    server = MotoS3(bucket="aenv-faulty")
    server.start()
    try:
        yield server
    finally:
        server.stop()


# retries short enough for a test that stops its server on purpose
FAST_RETRY = RetryPolicy(attempts=3, base_delay=0.01, max_delay=0.05, transport_retries=0)


def s3_store(
    server: MotoS3,
    *,
    retry: RetryPolicy = FAST_RETRY,
    part_size: int = 8 * MiB,
    part_concurrency: int = 4,
) -> ObjectStore:
    """An object store on `server` under a prefix of its own."""
    return open_object_store(
        server.url(f"t/{secrets.token_hex(6)}"),
        config=server.config(),
        client_options={"allow_http": True},
        retry=retry,
        part_size=part_size,
        part_concurrency=part_concurrency,
    )
