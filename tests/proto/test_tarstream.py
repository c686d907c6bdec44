"""TarReader: the streaming tar parser against archives written by Python's tarfile.

Hypothesis writes random archives (ustar, GNU and PAX formats; long names,
links, devices, large ids, fractional mtimes, xattrs), feeds them split at
random points, and checks the events equal those of a single feed and agree
with what tarfile reads back. Hand-made headers cover what tarfile will not
write: LIBARCHIVE xattrs, sparse members, bad checksums, truncation.
"""

from __future__ import annotations

import base64
import io
import tarfile
from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aenv.proto.tarstream import (
    MAX_EXTENDED,
    ArchiveEnd,
    Data,
    Event,
    Member,
    MemberEnd,
    TarError,
    TarHeader,
    TarReader,
)

Normalised = list[TarHeader | bytes | str]


def feed_split(raw: bytes, cuts: list[int]) -> list[Event]:
    reader = TarReader()
    events: list[Event] = []
    last = 0
    for cut in [*sorted(cuts), len(raw)]:
        events += reader.feed(raw[last:cut])
        last = cut
    reader.close()
    return events


def normalise(events: list[Event]) -> Normalised:
    """Events with each member's Data pieces joined (offsets checked contiguous)."""
    out: Normalised = []
    content = bytearray()
    expect = -1
    for ev in events:
        if isinstance(ev, Data):
            assert expect < 0 or ev.offset == expect
            if not content:
                expect = ev.offset
            content += ev.data
            expect = ev.offset + len(ev.data)
        elif isinstance(ev, Member):
            out.append(ev.header)
            content.clear()
            expect = ev.header.offset
        elif isinstance(ev, MemberEnd):
            out.append(bytes(content))
            content.clear()
        else:
            assert isinstance(ev, ArchiveEnd)
            out.append("end")
    return out


def build(members: list[tuple[tarfile.TarInfo, bytes]], fmt: int) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for info, data in members:
            tf.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return buf.getvalue()


def info(name: str, type_: bytes = tarfile.REGTYPE, **kw: object) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type = type_
    for k, v in kw.items():
        setattr(ti, k, v)
    return ti


def one(raw: bytes) -> list[Event]:
    return feed_split(raw, [])


_name = st.text(
    st.characters(codec="utf-8", exclude_characters="/\0", categories=("L", "N", "P", "S", "Zs")),
    min_size=1,
    max_size=40,
)


@st.composite
def _member(draw: st.DrawFn, fmt: int) -> tuple[tarfile.TarInfo, bytes]:
    long = fmt != tarfile.USTAR_FORMAT
    parts = draw(st.lists(_name, min_size=1, max_size=6 if long else 2))
    name = "/".join(parts)
    if not long:
        name = name.encode()[:99].decode("utf-8", "ignore") or "x"
        name = name.rstrip("/") or "x"
    ti = tarfile.TarInfo(name)
    ti.type = draw(
        st.sampled_from(
            [tarfile.REGTYPE] * 4
            + [tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE]
            + [tarfile.CHRTYPE, tarfile.BLKTYPE, tarfile.FIFOTYPE]
        )
    )
    ti.mode = draw(st.integers(0, 0o7777))
    big_ids = fmt != tarfile.USTAR_FORMAT
    ti.uid = draw(st.integers(0, 2**40 if big_ids else 0o7777777))
    ti.gid = draw(st.integers(0, 2**40 if big_ids else 0o7777777))
    ti.mtime = draw(st.integers(0, 2**33 if big_ids else 0o77777777777))
    if fmt == tarfile.PAX_FORMAT and draw(st.booleans()):
        ti.mtime = draw(st.integers(0, 2**31)) + draw(st.sampled_from([0.5, 0.25, 0.125]))
        ti.pax_headers = {
            "SCHILY.xattr.user." + draw(_name): draw(_name),
            "SCHILY.xattr.security.capability": "\udcff\udc80\udcfe",  # binary value
        }
    data = b""
    if ti.type == tarfile.REGTYPE:
        data = draw(st.binary(max_size=1500))
        ti.size = len(data)
    elif ti.type in (tarfile.SYMTYPE, tarfile.LNKTYPE):
        target = "/".join(draw(st.lists(_name, min_size=1, max_size=5 if long else 1)))
        ti.linkname = target if long else target.encode()[:99].decode("utf-8", "ignore") or "t"
    elif ti.type in (tarfile.CHRTYPE, tarfile.BLKTYPE):
        ti.devmajor, ti.devminor = draw(st.integers(0, 4095)), draw(st.integers(0, 2**19))
    return ti, data


@st.composite
def _archive(draw: st.DrawFn) -> bytes:
    fmt = draw(st.sampled_from([tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT]))
    members = draw(st.lists(_member(fmt), max_size=6))
    return build(members, fmt)


@settings(max_examples=150, deadline=None)
@given(_archive(), st.data())
def test_any_split_gives_the_same_events_as_tarfile_reads(raw: bytes, data: st.DataObject) -> None:
    whole = normalise(one(raw))
    cuts = data.draw(st.lists(st.integers(0, len(raw)), max_size=20))
    assert normalise(feed_split(raw, cuts)) == whole
    # One byte at a time, too (up to the record's zero padding: it is slow by design).
    used = min(len(raw), len(raw.rstrip(b"\0")) + 1024)
    reader = TarReader()
    events = [ev for i in range(used) for ev in reader.feed(raw[i : i + 1])]
    events += reader.feed(raw[used:])
    assert normalise(events) == whole
    # And the members agree with tarfile's reading of the same bytes.
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r:", encoding="utf-8") as tf:
        expected = tf.getmembers()
        contents = [tf.extractfile(m).read() if m.isreg() else b"" for m in expected]  # type: ignore[union-attr]
    assert whole[-1] == "end"
    headers = whole[:-1:2]
    assert len(headers) == len(expected)
    for h, m, body, content in zip(headers, expected, whole[1:-1:2], contents, strict=True):
        assert isinstance(h, TarHeader)
        assert h.name.rstrip("/") == m.name
        assert (h.mode, h.uid, h.gid) == (m.mode, m.uid, m.gid)
        mtime = Decimal(m.pax_headers.get("mtime", m.mtime))  # exact, unlike a float
        assert h.mtime_ns == int(mtime * 1_000_000_000)
        assert h.size == (m.size if m.isreg() else 0)
        assert h.linkname == m.linkname
        assert body == content
        assert h.typeflag == m.type.decode()
        if m.ischr() or m.isblk():
            assert (h.devmajor, h.devminor) == (m.devmajor, m.devminor)
        want_x = {
            k.removeprefix("SCHILY.xattr."): v.encode("utf-8", "surrogateescape")
            for k, v in m.pax_headers.items()
            if k.startswith("SCHILY.xattr.")
        }
        assert h.xattrs == want_x


def test_offsets_point_into_the_stream() -> None:
    raw = build(
        [(info("a", size=3), b"abc"), (info("b" * 150, size=600), b"z" * 600)], tarfile.GNU_FORMAT
    )
    events = one(raw)
    for ev in events:
        if isinstance(ev, Data):
            assert raw[ev.offset : ev.offset + len(ev.data)] == ev.data
    headers = [ev.header for ev in events if isinstance(ev, Member)]
    assert [h.header_offset for h in headers] == [0, 1024]  # long name: 'L' header + name block
    assert headers[1].offset == 1024 + 3 * 512


def test_base256_fields_and_negative_mtime() -> None:
    raw = build([(info("f", uid=2**40, gid=2**33, mtime=-5), b"")], tarfile.GNU_FORMAT)
    (h,) = [ev.header for ev in one(raw) if isinstance(ev, Member)]
    assert (h.uid, h.gid, h.mtime_ns) == (2**40, 2**33, -5_000_000_000)


def test_pax_overrides_and_fractional_mtime() -> None:
    ti = info("short", size=4)
    ti.pax_headers = {
        "path": "p/" + "n" * 200,
        "mtime": "12.3456789123",
        "uname": "ü",
        "uid": "70000",
    }
    raw = build([(ti, b"data")], tarfile.PAX_FORMAT)
    (h,) = [ev.header for ev in one(raw) if isinstance(ev, Member)]
    assert h.name == "p/" + "n" * 200
    assert h.mtime_ns == 12_345_678_912
    assert (h.uname, h.uid) == ("ü", 70000)


def test_pax_global_header_applies_to_later_members() -> None:
    buf = io.BytesIO()
    with tarfile.open(
        fileobj=buf, mode="w", format=tarfile.PAX_FORMAT, pax_headers={"uid": "4242"}
    ) as tf:
        tf.addfile(info("a"), io.BytesIO(b""))
        tf.addfile(info("b"), io.BytesIO(b""))
    headers = [ev.header for ev in one(buf.getvalue()) if isinstance(ev, Member)]
    assert [h.uid for h in headers] == [4242, 4242]


def _pax_member(records: dict[str, bytes], name: str = "f") -> bytes:
    """A PAX 'x' header with raw records, then an empty regular file, then the end."""
    body = b""
    for k, v in records.items():
        rec = b" " + k.encode() + b"=" + v + b"\n"
        n = len(rec) + 1
        while len(str(n).encode()) + len(rec) != n:
            n += 1
        body += str(n).encode() + rec
    x = info("././@PaxHeader", type_=tarfile.XHDTYPE, size=len(body))
    hdr = x.tobuf(tarfile.USTAR_FORMAT)
    pad = b"\0" * (-len(body) % 512)
    return hdr + body + pad + info(name).tobuf(tarfile.USTAR_FORMAT) + b"\0" * 1024


def test_libarchive_xattrs_are_base64_with_escaped_names() -> None:
    value = b"\x00\x01binary\xff"
    raw = _pax_member(
        {
            "LIBARCHIVE.xattr.user.with%20space": base64.b64encode(value).rstrip(b"="),
            "SCHILY.xattr.user.raw": b"\xfe\x00\n=x",
        }
    )
    (h,) = [ev.header for ev in one(raw) if isinstance(ev, Member)]
    assert h.xattrs == {"user.with space": value, "user.raw": b"\xfe\x00\n=x"}


def _patch(raw: bytes, at: int, field: slice, value: bytes) -> bytes:
    """Overwrite a header field and fix the header's checksum."""
    block = bytearray(raw[at : at + 512])
    block[field] = value.ljust(field.stop - field.start, b"\0")
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % sum(block)
    return raw[:at] + bytes(block) + raw[at + 512 :]


def test_sparse_and_multivolume_members_are_refused() -> None:
    raw = build([(info("f", size=3), b"abc")], tarfile.GNU_FORMAT)
    for flag in (b"S", b"M"):
        with pytest.raises(TarError, match=r"sparse|multi-volume"):
            one(_patch(raw, 0, slice(156, 157), flag))
    with pytest.raises(TarError, match="sparse"):
        one(_pax_member({"GNU.sparse.major": b"1", "GNU.sparse.minor": b"0"}))


def test_bad_headers_are_refused() -> None:
    raw = build([(info("f", size=3), b"abc")], tarfile.USTAR_FORMAT)
    corrupt = bytearray(raw)
    corrupt[10] ^= 0xFF
    with pytest.raises(TarError, match="checksum"):
        one(bytes(corrupt))
    with pytest.raises(TarError, match="size"):
        one(_patch(raw, 0, slice(124, 136), b"12x4"))
    huge = _pax_member({"path": b"x"})
    with pytest.raises(TarError, match="too large"):
        one(_patch(huge, 0, slice(124, 136), b"%011o" % (MAX_EXTENDED + 1)))
    with pytest.raises(TarError, match="PAX"):
        one(_pax_member({"mtime": b"1.x"}))
    # A single zero block then more headers is not an end marker.
    with pytest.raises(TarError, match="zero block"):
        one(b"\0" * 512 + raw)


def test_truncation_and_missing_end_marker() -> None:
    raw = build([(info("f", size=700), b"x" * 700)], tarfile.USTAR_FORMAT)
    end = 512 + 1024  # header + padded content
    for cut in (100, 512, 800, end - 1):
        with pytest.raises(TarError, match="truncated"):
            feed_split(raw[:cut], [])
    # Ending cleanly between members (or after one zero block) is accepted, as Go does.
    for cut in (end, end + 512):
        events = feed_split(raw[:cut], [])
        assert normalise(events) == [normalise(one(raw))[0], b"x" * 700]
    # An extended header with nothing after it is truncated.
    with pytest.raises(TarError, match="truncated"):
        feed_split(_pax_member({"path": b"x"})[:1024], [])


def test_header_only_types_carry_no_content() -> None:
    # Some writers put a size on hard links; no data follows such headers.
    raw = build(
        [(info("f", size=2), b"ab"), (info("h", tarfile.LNKTYPE, linkname="f"), b"")],
        tarfile.USTAR_FORMAT,
    )
    raw = _patch(raw, 1024, slice(124, 136), b"%011o" % 2)
    events = normalise(one(raw))
    assert events[1] == b"ab" and events[3] == b"" and events[-1] == "end"
    h = events[2]
    assert isinstance(h, TarHeader) and h.typeflag == "1" and h.size == 0
