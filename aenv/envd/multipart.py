"""Incremental multipart/form-data parser (sans-IO).

`MultipartParser(boundary).feed(chunk)` returns events in order: `PartStart`
(with the part's headers and Content-Disposition parameters), `PartData`
chunks and `PartEnd`, then `Done` after the closing delimiter. It keeps at
most one delimiter's worth of body bytes buffered, so arbitrarily large parts
stream through in bounded memory. Malformed input raises `MultipartError`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import unquote

MAX_HEADER_BYTES = 16 * 1024


class MultipartError(ValueError):
    pass


@dataclass(frozen=True)
class PartStart:
    headers: dict[str, str]
    params: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str | None:
        return self.params.get("name")

    @property
    def filename(self) -> str | None:
        return self.params.get("filename")


@dataclass(frozen=True)
class PartData:
    data: bytes


@dataclass(frozen=True)
class PartEnd:
    pass


@dataclass(frozen=True)
class Done:
    pass


Event = PartStart | PartData | PartEnd | Done


def boundary_of(content_type: str) -> str | None:
    """The `boundary` parameter of a multipart Content-Type, if any."""
    _, params = parse_header_params(content_type)
    return params.get("boundary") or None


def parse_header_params(value: str) -> tuple[str, dict[str, str]]:
    """Split `type; a=b; c="d"` into ("type", {"a": "b", "c": "d"})."""
    parts: list[str] = []
    current, quoted, escaped = "", False, False
    for ch in value:
        if escaped:
            current += ch
            escaped = False
        elif ch == "\\" and quoted:
            escaped = True
            current += ch
        elif ch == '"':
            quoted = not quoted
            current += ch
        elif ch == ";" and not quoted:
            parts.append(current)
            current = ""
        else:
            current += ch
    parts.append(current)
    main = parts[0].strip().lower()
    params: dict[str, str] = {}
    for part in parts[1:]:
        key, sep, val = part.partition("=")
        if not sep:
            continue
        key = key.strip().lower()
        val = val.strip()
        if len(val) >= 2 and val[0] == val[-1] == '"':
            val = val[1:-1].replace('\\"', '"').replace("\\\\", "\\")
        if key.endswith("*"):
            key = key[:-1]
            _, _, val = val.partition("''")
            val = unquote(val)
        params[key] = val
    return main, params


class MultipartParser:
    def __init__(self, boundary: str) -> None:
        if not boundary or len(boundary) > 200:
            raise MultipartError("invalid multipart boundary")
        self._dash_boundary = b"--" + boundary.encode("latin-1")
        self._delimiter = b"\r\n" + self._dash_boundary
        self._buf = bytearray()
        self._state = "preamble"

    def feed(self, data: bytes) -> list[Event]:
        self._buf += data
        events: list[Event] = []
        while True:
            if self._state == "preamble":
                idx = self._buf.find(self._dash_boundary)
                if idx < 0:
                    # keep a tail that could start the boundary
                    keep = len(self._dash_boundary)
                    if len(self._buf) > keep:
                        del self._buf[: len(self._buf) - keep]
                    return events
                del self._buf[: idx + len(self._dash_boundary)]
                self._state = "after_boundary"
            elif self._state == "after_boundary":
                if len(self._buf) < 2:
                    return events
                if self._buf[:2] == b"--":
                    self._state = "done"
                    self._buf.clear()
                    events.append(Done())
                    return events
                # transport padding then CRLF
                idx = self._buf.find(b"\r\n")
                if idx < 0:
                    if len(self._buf) > 1024:
                        raise MultipartError("garbage after boundary")
                    return events
                if self._buf[:idx].strip(b" \t"):
                    raise MultipartError("garbage after boundary")
                del self._buf[: idx + 2]
                self._state = "headers"
            elif self._state == "headers":
                idx = self._buf.find(b"\r\n\r\n")
                if idx < 0:
                    if self._buf.startswith(b"\r\n"):
                        del self._buf[:2]
                        events.append(PartStart({}))
                        self._state = "body"
                        continue
                    if len(self._buf) > MAX_HEADER_BYTES:
                        raise MultipartError("part headers too large")
                    return events
                raw = bytes(self._buf[:idx])
                del self._buf[: idx + 4]
                events.append(self._part_start(raw))
                self._state = "body"
            elif self._state == "body":
                idx = self._buf.find(self._delimiter)
                if idx < 0:
                    safe = len(self._buf) - len(self._delimiter) + 1
                    if safe > 0:
                        events.append(PartData(bytes(self._buf[:safe])))
                        del self._buf[:safe]
                    return events
                if idx:
                    events.append(PartData(bytes(self._buf[:idx])))
                del self._buf[: idx + len(self._delimiter)]
                events.append(PartEnd())
                self._state = "after_boundary"
            else:  # done: ignore the epilogue
                self._buf.clear()
                return events

    def close(self) -> None:
        if self._state != "done":
            raise MultipartError("multipart body ended before its closing boundary")

    @staticmethod
    def _part_start(raw: bytes) -> PartStart:
        headers: dict[str, str] = {}
        for line in raw.decode("utf-8", errors="replace").split("\r\n"):
            if not line.strip():
                continue
            name, sep, value = line.partition(":")
            if not sep:
                raise MultipartError(f"malformed part header {line!r}")
            headers[name.strip().lower()] = value.strip()
        params: dict[str, str] = {}
        disposition = headers.get("content-disposition")
        if disposition:
            _, params = parse_header_params(disposition)
            if "filename" in params:
                params["filename"] = params["filename"].replace("%22", '"')
        return PartStart(headers, params)
