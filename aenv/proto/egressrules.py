"""`network.rules`: per-host header transforms for requests leaving a sandbox, without IO.

E2B's SDK sends `network.rules` as `{host: [{"transform": {"headers": {name:
value}}}, ...]}`. Values may hold placeholders the egress proxy resolves on
the host side, per request, so the sandbox never holds what they stand for:
`${e2b.secrets.NAME}` (a secret of the node's store, `Secret.fill`) and
`${e2b.identity.tokens.NAME}` (a workload token; refused until the node
issues them). This module:

- validates a request's rules (`parse_rules`) into `HostRules`, which round-
  trip through `to_doc`/`from_doc` (journal, peers) and `to_api` (GET shows
  the placeholders, never a value);
- finds a connection's headers by host name (`HostRules.headers_for`: exact
  names beat `*.suffix` wildcards, rules apply in order, later ones override);
- lists and substitutes placeholders (`placeholders`, `substitute`);
- rewrites one HTTP/1.x request head (`rewrite_head`): the injected headers
  replace any of the same name the sandbox sent, and the request asks for
  `Connection: close`, so every request of the connection passes here.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from aenv.proto.netpolicy import PolicyError, host_matches, host_pattern

MAX_HOSTS: Final = 100
MAX_RULES_PER_HOST: Final = 20
MAX_HEADERS: Final = 50
MAX_HEADER_VALUE: Final = 8192
MAX_HEAD: Final = 64 * 1024  # bound on one request head the proxy reads

_TOKEN: Final = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
_PLACEHOLDER: Final = re.compile(r"\$\{e2b\.(secrets|identity\.tokens)\.([^{}\x00-\x1f]+)\}")
# headers the proxy owns: a rule may not set them (framing, routing)
_RESERVED: Final = frozenset(
    {"host", "content-length", "transfer-encoding", "connection", "upgrade", "te", "trailer"}
)


class HeadError(ValueError):
    """A request head the proxy cannot rewrite (the connection is refused)."""


@dataclass(frozen=True)
class Placeholder:
    kind: str  # "secret" | "token"
    name: str


@dataclass(frozen=True)
class HostRules:
    """Per host pattern, the headers its rules inject, in the order given."""

    rules: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.rules)

    @property
    def hosts(self) -> tuple[str, ...]:
        return tuple(h for h, _ in self.rules)

    def headers_for(self, name: str | None) -> tuple[tuple[str, str], ...] | None:
        """The headers for a connection to host `name` (None: no rule covers it,
        the connection is not intercepted). An exact pattern beats a wildcard;
        among wildcards the longest suffix wins."""
        if name is None:
            return None
        best: tuple[int, tuple[tuple[str, str], ...]] | None = None
        for pattern, headers in self.rules:
            if not host_matches(name, (pattern,)):
                continue
            rank = 1 << 16 if not pattern.startswith("*.") else len(pattern)
            if best is None or rank > best[0]:
                best = (rank, headers)
        return None if best is None else best[1]

    def to_doc(self) -> dict[str, list[list[str]]]:
        return {h: [[k, v] for k, v in hs] for h, hs in self.rules}

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any] | None) -> HostRules:
        if not doc:
            return cls()
        return cls(tuple((h, tuple((str(k), str(v)) for k, v in hs)) for h, hs in doc.items()))

    def to_api(self) -> dict[str, list[dict[str, Any]]]:
        """As E2B's `SandboxNetworkRuleInfo` lists: one rule per host with its
        headers (placeholders shown, never a resolved value)."""
        return {h: [{"transform": {"headers": dict(hs)}}] for h, hs in self.rules}

    def placeholders(self) -> set[Placeholder]:
        out: set[Placeholder] = set()
        for _, hs in self.rules:
            for _, v in hs:
                out |= placeholders(v)
        return out


def placeholders(value: str) -> set[Placeholder]:
    """The placeholders in a header value."""
    return {
        Placeholder("secret" if m.group(1) == "secrets" else "token", m.group(2))
        for m in _PLACEHOLDER.finditer(value)
    }


def substitute(value: str, resolve: Callable[[Placeholder], str]) -> str:
    """`value` with each placeholder replaced by `resolve(placeholder)`."""

    def one(m: re.Match[str]) -> str:
        kind = "secret" if m.group(1) == "secrets" else "token"
        out = resolve(Placeholder(kind, m.group(2)))
        if "\r" in out or "\n" in out or "\x00" in out:
            raise HeadError("a resolved header value holds a line break")
        return out

    return _PLACEHOLDER.sub(one, value)


def parse_rules(raw: object, *, iam_tokens: Iterable[str] | None = ()) -> HostRules:
    """Validate `network.rules` (E2B wire shape) into `HostRules`.

    Keys are host names or `*.suffix` wildcards (CIDR and IP keys are
    refused: interception is by name). `iam_tokens` are the workload tokens
    the sandbox registers; a token placeholder naming another is refused
    (None: not known here, any name passes and an unknown one fails when
    the proxy resolves it)."""
    if raw is None:
        return HostRules()
    if not isinstance(raw, Mapping):
        raise PolicyError("network.rules must be an object of host -> list of rules")
    if len(raw) > MAX_HOSTS:
        raise PolicyError(f"network.rules has {len(raw)} hosts; at most {MAX_HOSTS}")
    tokens = None if iam_tokens is None else set(iam_tokens)
    out: dict[str, dict[str, tuple[str, str]]] = {}
    for host, rules in raw.items():
        pattern = host_pattern(host) if isinstance(host, str) else None
        if pattern is None:
            raise PolicyError(f"network.rules: {host!r} is not a host name (nor *.suffix)")
        if not isinstance(rules, list) or len(rules) > MAX_RULES_PER_HOST:
            raise PolicyError(
                f"network.rules[{host!r}] must be a list of at most {MAX_RULES_PER_HOST} rules"
            )
        headers = out.setdefault(pattern, {})
        for rule in rules:
            if not isinstance(rule, Mapping):
                raise PolicyError(f"network.rules[{host!r}]: a rule must be an object")
            transform = rule.get("transform") or {}
            if not isinstance(transform, Mapping):
                raise PolicyError(f"network.rules[{host!r}]: transform must be an object")
            hs = transform.get("headers") or {}
            if not isinstance(hs, Mapping):
                raise PolicyError(f"network.rules[{host!r}]: headers must be an object")
            for k, v in hs.items():
                _check_header(host, k, v, tokens)
                headers[k.lower()] = (k, v)  # a later rule overrides an earlier one
        if len(headers) > MAX_HEADERS:
            raise PolicyError(f"network.rules[{host!r}]: at most {MAX_HEADERS} headers")
    return HostRules(tuple((h, tuple(hs.values())) for h, hs in out.items()))


def _check_header(host: object, k: object, v: object, tokens: set[str] | None) -> None:
    if not isinstance(k, str) or not _TOKEN.match(k):
        raise PolicyError(f"network.rules[{host!r}]: invalid header name {k!r}")
    if k.lower() in _RESERVED:
        raise PolicyError(f"network.rules[{host!r}]: header {k!r} cannot be set by a rule")
    if not isinstance(v, str) or len(v) > MAX_HEADER_VALUE or re.search(r"[\r\n\x00]", v):
        raise PolicyError(f"network.rules[{host!r}]: invalid value for header {k!r}")
    for p in placeholders(v):
        if p.kind == "token" and tokens is not None and p.name not in tokens:
            raise PolicyError(
                f"network.rules[{host!r}]: workload token {p.name!r} is not in iam.tokens"
            )


def head_end(buf: bytes) -> int:
    """The length of the request head at the start of `buf` (through the blank
    line), or -1 while incomplete. Raises HeadError past `MAX_HEAD`."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        if len(buf) > MAX_HEAD:
            raise HeadError("request head too long")
        return -1
    return end + 4


def rewrite_head(head: bytes, inject: Iterable[tuple[str, str]]) -> bytes:
    """The HTTP/1.x request `head` (through its blank line) with `inject`
    replacing headers of the same names, and `Connection: close`."""
    try:
        text = head.decode("latin-1")
    except UnicodeDecodeError as e:  # pragma: no cover - latin-1 decodes every byte
        raise HeadError(str(e)) from None
    lines = text[:-4].split("\r\n") if text.endswith("\r\n\r\n") else None
    if not lines:
        raise HeadError("not a complete request head")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise HeadError(f"not an HTTP/1.x request line: {lines[0][:80]!r}")
    injected = list(inject)
    for k, v in injected:  # checked again here: a head is never split by a value
        if not _TOKEN.match(k) or re.search(r"[\r\n\x00]", v):
            raise HeadError(f"header {k[:40]!r} cannot be injected")
    drop = {k.lower() for k, _ in injected} | {"connection", "keep-alive", "proxy-connection"}
    kept = [lines[0]]
    for line in lines[1:]:
        name, sep, _ = line.partition(":")
        if not sep or line[:1] in (" ", "\t"):
            raise HeadError("malformed or folded header line")
        if name.strip().lower() not in drop:
            kept.append(line)
    kept += [f"{k}: {v}" for k, v in injected]
    kept.append("Connection: close")
    try:
        return ("\r\n".join(kept) + "\r\n\r\n").encode("latin-1")
    except UnicodeEncodeError:
        raise HeadError("a header value is not latin-1 text") from None
