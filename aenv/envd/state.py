"""envd's mutable settings: what `POST /init` sets and every handler reads.

One `EnvdState` per envd process, owned by the app and passed to the
services. It holds the default user and working directory, the sandbox-wide
environment variables given to every user process, and the access token
that, once set, every request except `/health` must present. `apply_init`
validates and applies an /init body (the shape the E2B orchestrator sends);
stale bodies (an older `timestamp` than the last one applied) are ignored
apart from their token check, like E2B's envd.
"""

from __future__ import annotations

import datetime as _dt
import hmac
from dataclasses import dataclass, field
from typing import Any

from aenv.envd import trust

DEFAULT_USER = "root"


class InitError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _parse_time(value: str) -> float:
    text = value.strip()
    if text.endswith(("Z", "z")):
        text = text[:-1] + "+00:00"
    # fromisoformat in 3.11 accepts at most microseconds: trim nanoseconds.
    if "." in text:
        head, _, rest = text.partition(".")
        digits = ""
        while rest and rest[0].isdigit():
            digits, rest = digits + rest[0], rest[1:]
        text = f"{head}.{digits[:6]}{rest}" if digits else head + rest
    moment = _dt.datetime.fromisoformat(text)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=_dt.UTC)
    return moment.timestamp()


@dataclass
class EnvdState:
    default_user: str = DEFAULT_USER
    default_workdir: str | None = None
    env_vars: dict[str, str] = field(default_factory=lambda: {"E2B_SANDBOX": "true"})
    access_token: str | None = None
    last_init_time: float = float("-inf")
    initialized: bool = False
    # RLIMIT_NPROC of user processes (None: unlimited); /init's `processLimit` sets it
    process_limit: int | None = None

    def token_ok(self, presented: str | None) -> bool:
        """Whether a request presenting `presented` may pass (constant time)."""
        if self.access_token is None:
            return True
        if presented is None:
            return False
        return hmac.compare_digest(presented.encode(), self.access_token.encode())

    def apply_init(self, body: Any, header_token: str | None) -> None:
        """Apply a decoded /init JSON body. Raises InitError(status, message).

        A body may set or rotate the token when no token is set yet, when it
        carries the current token, or when the request's X-Access-Token header
        carries it (the node rotating the token of a forked sandbox).
        """
        if body is None:
            body = {}
        if not isinstance(body, dict):
            raise InitError(400, "init body must be a JSON object")
        token = body.get("accessToken")
        if token is not None and not isinstance(token, str):
            raise InitError(400, "accessToken must be a string")
        if self.access_token is not None and not (
            (token is not None and self.token_ok(token)) or self.token_ok(header_token)
        ):
            raise InitError(401, "access token validation failed")
        stamp = body.get("timestamp")
        if stamp is not None:
            if not isinstance(stamp, str):
                raise InitError(400, "timestamp must be an RFC 3339 string")
            try:
                when = _parse_time(stamp)
            except ValueError:
                raise InitError(400, f"invalid timestamp {stamp!r}") from None
            if when <= self.last_init_time:
                self.initialized = True
                return
            self.last_init_time = when
        env_vars = body.get("envVars")
        if env_vars is not None:
            if not isinstance(env_vars, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in env_vars.items()
            ):
                raise InitError(400, "envVars must map strings to strings")
            self.env_vars = {"E2B_SANDBOX": self.env_vars.get("E2B_SANDBOX", "true")}
            self.env_vars.update(env_vars)
        ca = body.get("caCertificates")  # aenv's own: the node's egress CA (PEM)
        if ca is not None:
            if not isinstance(ca, str) or "BEGIN CERTIFICATE" not in ca:
                raise InitError(400, "caCertificates must be PEM certificates")
            try:
                trusted = trust.install(ca)
            except OSError as e:
                raise InitError(500, f"installing caCertificates: {e}") from None
            for k, v in trusted.items():
                self.env_vars.setdefault(k, v)
        for key in ("defaultUser", "defaultWorkdir"):
            value = body.get(key)
            if value is not None and not isinstance(value, str):
                raise InitError(400, f"{key} must be a string")
        limit = body.get("processLimit")
        if limit is not None:
            if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
                raise InitError(400, "processLimit must be a positive integer")
            self.process_limit = limit
        if body.get("defaultUser"):
            self.default_user = body["defaultUser"]
        if body.get("defaultWorkdir"):
            self.default_workdir = body["defaultWorkdir"]
        self.access_token = token or None
        self.initialized = True
