"""A push-driven (sans-IO) tar stream reader: bytes in, member events out.

`TarReader.feed(data)` accepts the uncompressed tar stream in pieces of any
size as they arrive and returns the events those bytes complete: `Member`
(one header, with GNU long names/links and PAX records already folded in),
`Data` (a piece of that member's content, with its offset in the stream),
`MemberEnd`, and finally `ArchiveEnd` at the end-of-archive marker. Any split
of the same stream yields the same events up to how `Data` pieces are cut.

Supported: ustar, GNU and PAX headers; long names and link targets (GNU `L`
and `K`, PAX `path` and `linkpath`); PAX `size`, `uid`, `gid`, `uname`,
`gname` and `mtime` (fractional seconds kept as nanoseconds); extended
attributes from `SCHILY.xattr.*` (raw bytes) and `LIBARCHIVE.xattr.*`
(base64); PAX global headers; octal and base-256 numeric fields; device
numbers. Sparse files (GNU `S`, PAX `GNU.sparse.*`) and multi-volume members
raise `TarError`. Only headers and extended records are buffered (at most
`MAX_EXTENDED` bytes); member content passes through as zero-copy views of
the input. Names are decoded as UTF-8 with `surrogateescape`, so any byte
string survives a round trip through `os.fsencode`.
"""

from __future__ import annotations

import base64
import binascii
import urllib.parse
from dataclasses import dataclass, field

__all__ = [
    "BLOCK",
    "MAX_EXTENDED",
    "ArchiveEnd",
    "Data",
    "Event",
    "Member",
    "MemberEnd",
    "TarError",
    "TarHeader",
    "TarReader",
]

BLOCK = 512
# Largest PAX record set or GNU long name/link accepted (they are buffered whole).
MAX_EXTENDED = 8 << 20

# Typeflags whose size field never announces content that follows the header.
_HEADER_ONLY = frozenset(b"123456")
_EXTENDED = frozenset(b"xgLK")


class TarError(ValueError):
    """The tar stream is malformed, truncated or uses an unsupported feature."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TarHeader:
    name: str
    typeflag: str  # one character: "0" (also "\0", "7"), "1" .. "6", or anything else seen
    mode: int  # the raw mode field (may carry file-type bits on some archivers)
    uid: int
    gid: int
    size: int  # bytes of content that follow (0 for header-only types)
    mtime_ns: int  # may be negative
    linkname: str = ""
    uname: str = ""
    gname: str = ""
    devmajor: int = 0
    devminor: int = 0
    xattrs: dict[str, bytes] = field(default_factory=dict)
    offset: int = 0  # where the content starts in the stream
    header_offset: int = 0  # where this member's first header block starts


@dataclass(frozen=True, slots=True)
class Member:
    header: TarHeader


@dataclass(frozen=True, slots=True)
class Data:
    offset: int  # position of data[0] in the stream
    data: memoryview  # a view of the fed buffer; copy it if kept beyond the next feed()


@dataclass(frozen=True, slots=True)
class MemberEnd:
    pass


@dataclass(frozen=True, slots=True)
class ArchiveEnd:
    pass


Event = Member | Data | MemberEnd | ArchiveEnd


def _decode(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")


def _cstr(field_: memoryview) -> bytes:
    raw = bytes(field_)
    nul = raw.find(b"\0")
    return raw if nul < 0 else raw[:nul]


def _number(field_: memoryview, what: str) -> int:
    """An octal (NUL/space padded) or base-256 numeric header field."""
    first = field_[0]
    if first in (0x80, 0xFF):  # GNU base-256: big-endian, 0xff marks a negative number
        value = int.from_bytes(field_[1:], "big")
        return value - (1 << (8 * (len(field_) - 1))) if first == 0xFF else value
    text = bytes(field_).replace(b"\0", b" ").strip()
    if not text:
        return 0
    try:
        return int(text, 8)
    except ValueError:
        raise TarError(f"bad {what} field {bytes(field_)!r}") from None


def _pax_time(value: str) -> int:
    """PAX `mtime` ("[-]SECONDS[.FRACTION]") as nanoseconds."""
    sign = 1
    if value.startswith("-"):
        sign, value = -1, value[1:]
    whole, _, frac = value.partition(".")
    if not whole.isdigit() or (frac and not frac.isdigit()):
        raise TarError(f"bad PAX mtime {value!r}")
    return sign * (int(whole) * 1_000_000_000 + int((frac + "000000000")[:9]))


def _pax_int(key: str, value: str) -> int:
    if not value.isdigit():
        raise TarError(f"bad PAX {key} {value!r}")
    return int(value)


def _parse_pax(raw: bytes) -> dict[str, bytes]:
    """PAX extended records `"%d %s=%s\\n"`; values stay raw bytes."""
    out: dict[str, bytes] = {}
    pos = 0
    while pos < len(raw):
        if raw[pos] == 0:  # some writers NUL-pad the record block
            break
        space = raw.find(b" ", pos, pos + 24)
        if space < 0:
            raise TarError("bad PAX record: no length")
        try:
            length = int(raw[pos:space])
        except ValueError:
            raise TarError("bad PAX record length") from None
        end = pos + length
        if length <= space - pos + 1 or end > len(raw) or raw[end - 1] != 0x0A:
            raise TarError("bad PAX record length")
        key, eq, value = raw[space + 1 : end - 1].partition(b"=")
        if not eq:
            raise TarError("bad PAX record: no '='")
        out[_decode(key)] = value
        pos = end
    return out


class TarReader:
    """Incremental tar parser; see the module docstring for the events."""

    def __init__(self) -> None:
        self._pos = 0  # stream bytes consumed so far
        self._buf = bytearray()  # a partial header block or extended record
        self._want = BLOCK  # bytes `_buf` is collecting
        self._state = "header"  # header | ext | data | pad | end
        self._remaining = 0  # content bytes (data) or padding bytes (pad) left
        self._ext_type = 0  # typeflag of the extended record being collected
        self._header_start: int | None = None
        self._long_name: bytes | None = None
        self._long_link: bytes | None = None
        self._pax: dict[str, bytes] = {}
        self._pax_global: dict[str, bytes] = {}
        self._zero_blocks = 0

    @property
    def offset(self) -> int:
        """Bytes of the stream consumed so far."""
        return self._pos

    @property
    def ended(self) -> bool:
        """Whether the end-of-archive marker was seen."""
        return self._state == "end"

    def feed(self, data: bytes | memoryview) -> list[Event]:
        view = memoryview(data).cast("B")
        events: list[Event] = []
        i, n = 0, len(view)
        while i < n:
            state = self._state
            if state == "data":
                take = min(self._remaining, n - i)
                events.append(Data(self._pos, view[i : i + take]))
                i += take
                self._pos += take
                self._remaining -= take
                if not self._remaining:
                    self._end_content(events)
            elif state == "pad":
                take = min(self._remaining, n - i)
                i += take
                self._pos += take
                self._remaining -= take
                if not self._remaining:
                    self._state = "header"
                    self._want = BLOCK
            elif state == "end":
                self._pos += n - i  # trailing zero padding of the record; ignored
                i = n
            else:  # header or ext: collect `_want` bytes
                want = self._want
                if not self._buf and n - i >= want:
                    block = view[i : i + want]
                    i += want
                    self._pos += want
                else:
                    take = min(want - len(self._buf), n - i)
                    self._buf += view[i : i + take]
                    i += take
                    self._pos += take
                    if len(self._buf) < want:
                        continue
                    block = memoryview(bytes(self._buf))
                    self._buf.clear()
                start = self._pos - want
                if state == "header":
                    self._on_header(block, start, events)
                else:
                    self._on_extended(bytes(block))
        return events

    def close(self) -> None:
        """Declare the stream complete; raises `TarError` if it stopped mid-member.

        A stream that ends cleanly between members without the end-of-archive
        blocks is accepted, as Go's archive/tar (and so Docker) accepts it.
        """
        if self._state == "end":
            return
        if self._state == "header" and not self._buf and self._header_start is None:
            return
        raise TarError(f"tar stream truncated at byte {self._pos}")

    # -- internals -------------------------------------------------------------

    def _end_content(self, events: list[Event]) -> None:
        events.append(MemberEnd())
        pad = -self._pos % BLOCK
        if pad:
            self._state, self._remaining = "pad", pad
        else:
            self._state, self._want = "header", BLOCK

    def _on_extended(self, raw: bytes) -> None:
        size = self._remaining
        body = raw[:size]
        if self._ext_type == ord("L"):
            self._long_name = body.split(b"\0", 1)[0]
        elif self._ext_type == ord("K"):
            self._long_link = body.split(b"\0", 1)[0]
        elif self._ext_type == ord("x"):
            self._pax.update(_parse_pax(body))
        else:  # "g": applies to every following member
            for key, value in _parse_pax(body).items():
                if value:
                    self._pax_global[key] = value
                else:
                    self._pax_global.pop(key, None)
        self._state, self._want = "header", BLOCK

    def _on_header(self, block: memoryview, start: int, events: list[Event]) -> None:
        if not any(block):
            if self._header_start is not None:
                raise TarError(f"zero block after an extended header at byte {start}")
            self._zero_blocks += 1
            if self._zero_blocks == 2:
                self._state = "end"
                events.append(ArchiveEnd())
            return
        if self._zero_blocks:
            raise TarError(f"lone zero block before a header at byte {start}")
        self._check_sum(block, start)
        if self._header_start is None:
            self._header_start = start
        typeflag = block[156]
        size = _number(block[124:136], "size")
        if size < 0:
            raise TarError(f"negative size at byte {start}")
        if typeflag in _EXTENDED:
            if size > MAX_EXTENDED:
                raise TarError(f"extended header of {size} bytes is too large")
            self._ext_type, self._remaining = typeflag, size
            self._state, self._want = "ext", size + (-size % BLOCK)
            if self._want == 0:
                self._on_extended(b"")
            return
        if typeflag == ord("S"):
            raise TarError("sparse files (GNU 'S' members) are not supported")
        if typeflag == ord("M"):
            raise TarError("multi-volume archives are not supported")
        header = self._make_header(block, typeflag, size)
        self._header_start = None
        self._long_name = self._long_link = None
        self._pax = {}
        events.append(Member(header))
        if header.size:
            self._state, self._remaining = "data", header.size
        else:
            events.append(MemberEnd())
            self._want = BLOCK

    def _check_sum(self, block: memoryview, start: int) -> None:
        stored = _number(block[148:156], "checksum")
        raw = bytes(block)
        unsigned = sum(raw[:148]) + 8 * 0x20 + sum(raw[156:])
        if stored == unsigned:
            return
        # Historic writers summed signed chars; the checksum field itself counts as spaces.
        signed = sum(b - 256 if b & 0x80 else b for b in raw[:148] + raw[156:]) + 8 * 0x20
        if stored != signed:
            raise TarError(f"bad tar header checksum at byte {start}")

    def _make_header(self, block: memoryview, typeflag: int, size: int) -> TarHeader:
        pax = {**self._pax_global, **self._pax} if self._pax_global else self._pax
        pax = {k: v for k, v in pax.items() if v}  # an empty value unsets the key
        if any(k.startswith("GNU.sparse.") for k in pax):
            raise TarError("sparse files (PAX GNU.sparse) are not supported")
        name = _cstr(block[0:100])
        if bytes(block[257:263]) == b"ustar\0":  # POSIX ustar: a prefix field
            prefix = _cstr(block[345:500])
            if prefix:
                name = prefix + b"/" + name
        if self._long_name is not None:
            name = self._long_name
        link = self._long_link if self._long_link is not None else _cstr(block[157:257])
        uid = _number(block[108:116], "uid")
        gid = _number(block[116:124], "gid")
        mtime_ns = _number(block[136:148], "mtime") * 1_000_000_000
        uname = _decode(_cstr(block[265:297]))
        gname = _decode(_cstr(block[297:329]))
        xattrs: dict[str, bytes] = {}
        for key, value in pax.items():
            if key == "path":
                name = value
            elif key == "linkpath":
                link = value
            elif key == "size":
                size = _pax_int(key, _decode(value))
            elif key == "uid":
                uid = _pax_int(key, _decode(value))
            elif key == "gid":
                gid = _pax_int(key, _decode(value))
            elif key == "mtime":
                mtime_ns = _pax_time(_decode(value))
            elif key == "uname":
                uname = _decode(value)
            elif key == "gname":
                gname = _decode(value)
            elif key.startswith("SCHILY.xattr."):
                xattrs[key[len("SCHILY.xattr.") :]] = value
            elif key.startswith("LIBARCHIVE.xattr."):
                xname = urllib.parse.unquote(key[len("LIBARCHIVE.xattr.") :])
                try:
                    xattrs[xname] = base64.b64decode(value + b"=" * (-len(value) % 4))
                except binascii.Error:
                    raise TarError(f"bad base64 in PAX {key}") from None
        if uid < 0 or gid < 0:
            raise TarError(f"negative uid/gid for {_decode(name)!r}")
        devmajor = devminor = 0
        if typeflag in (ord("3"), ord("4")):
            devmajor = _number(block[329:337], "devmajor")
            devminor = _number(block[337:345], "devminor")
        assert self._header_start is not None
        return TarHeader(
            name=_decode(name),
            typeflag="0" if typeflag == 0 else chr(typeflag),
            mode=_number(block[100:108], "mode"),
            uid=uid,
            gid=gid,
            size=0 if typeflag in _HEADER_ONLY else size,
            mtime_ns=mtime_ns,
            linkname=_decode(link),
            uname=uname,
            gname=gname,
            devmajor=devmajor,
            devminor=devminor,
            xattrs=xattrs,
            offset=self._pos,
            header_offset=self._header_start,
        )
