"""Object store: round trips, ranges, listing, blobs and failures on a directory and on real S3.

Every behavioural test runs against both backends: a local directory and
moto's S3 server on loopback (tests/s3.py). Failure tests stop the S3 server,
cut a multipart upload in the middle, inject 5xx/429 answers and tamper with
stored objects behind the store's back.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from aenv.storage.objstore import (
    CorruptObject,
    ErrorKind,
    MiB,
    ObjectNotFound,
    ObjectStore,
    RetryPolicy,
    StoreError,
    StoreUnavailable,
    blob_key,
    check_key,
    classify_error,
    is_transient_message,
    open_object_store,
    parse_store_url,
)

# Fixtures are imported by name, so test parameters shadow them (F811).
# ruff: noqa: F811
from tests.s3 import FAST_RETRY, MotoS3, s3_faulty, s3_server, s3_store  # noqa: F401

FAST = FAST_RETRY


@dataclass
class Backend:
    store: ObjectStore
    tamper: Callable[[str, bytes], None]  # overwrite a key behind the store's back
    s3: bool


@pytest.fixture(params=["local", "s3"])
async def backend(
    request: pytest.FixtureRequest, tmp_path: Path, s3_server: MotoS3
) -> AsyncIterator[Backend]:
    if request.param == "local":
        root = tmp_path / "store"
        store = open_object_store(root.as_uri(), retry=FAST)

        def tamper_local(key: str, data: bytes) -> None:
            (root / key).write_bytes(data)

        yield Backend(store, tamper_local, s3=False)
    else:
        store = s3_store(s3_server)
        prefix = store.where.split(" ")[0].split("/", 3)[3]

        def tamper_s3(key: str, data: bytes) -> None:
            s3_server.boto().put_object(Bucket=s3_server.bucket, Key=f"{prefix}/{key}", Body=data)

        yield Backend(store, tamper_s3, s3=True)


def random_file(path: Path, size: int) -> bytes:
    data = os.urandom(size)
    path.write_bytes(data)
    return data


# -- round trips -------------------------------------------------------------------


async def test_small_round_trip(backend: Backend) -> None:
    store = backend.store
    assert await store.head("a/b.txt") is None
    assert not await store.exists("a/b.txt")
    assert await store.put("a/b.txt", b"hello") is True
    assert await store.get("a/b.txt") == b"hello"
    info = await store.head("a/b.txt")
    assert info is not None
    assert (info.key, info.size) == ("a/b.txt", 5)
    assert info.etag
    await store.put("a/b.txt", b"second version")
    assert await store.get("a/b.txt") == b"second version"
    await store.put("empty", b"")
    assert await store.get("empty") == b""


async def test_large_file_round_trip(backend: Backend, tmp_path: Path) -> None:
    store = backend.store
    src = tmp_path / "src.bin"
    data = random_file(src, 20 * MiB + 123)
    before = store.statistics()
    assert await store.put("big/obj", src) is True
    assert store.statistics().bytes_uploaded - before.bytes_uploaded == len(data)
    info = await store.head("big/obj")
    assert info is not None and info.size == len(data)
    if backend.s3:
        # A multipart upload's etag is "<md5 of part md5s>-<parts>": 8 MiB parts -> 3.
        assert info.etag is not None and info.etag.strip('"').endswith("-3")
    dst = tmp_path / "out" / "dst.bin"
    dst.parent.mkdir()
    await store.download("big/obj", dst)
    assert dst.read_bytes() == data
    assert os.listdir(dst.parent) == ["dst.bin"]  # no temp file left behind
    assert await store.get("big/obj") == data


async def test_ranges(backend: Backend) -> None:
    store = backend.store
    data = bytes(range(256)) * 40
    await store.put("r", data)
    assert await store.get_range("r", 0, 10) == data[:10]
    assert await store.get_range("r", 1000, 2345) == data[1000:3345]
    assert await store.get_range("r", len(data) - 5, 100) == data[-5:]  # short at the end
    assert await store.get_range("r", 7, 0) == b""
    with pytest.raises(StoreError):
        await store.get_range("r", len(data) + 10, 5)
    with pytest.raises(ObjectNotFound):
        await store.get_range("missing", 0, 5)


async def test_list_and_delete(backend: Backend) -> None:
    store = backend.store
    for key in ["a/1", "a/2", "a/b/3", "ab/4"]:
        await store.put(key, key.encode())
    assert [i.key for i in await store.list("a")] == ["a/1", "a/2", "a/b/3"]
    assert [i.key for i in await store.list("a/")] == ["a/1", "a/2", "a/b/3"]
    assert [(i.key, i.size) for i in await store.list()] == [
        ("a/1", 3),
        ("a/2", 3),
        ("a/b/3", 5),
        ("ab/4", 4),
    ]
    assert await store.list("nothing") == []
    await store.delete("a/1")
    await store.delete("a/1")  # deleting a missing key is fine
    assert [i.key for i in await store.list("a")] == ["a/2", "a/b/3"]
    with pytest.raises(ObjectNotFound) as err:
        await store.get("a/1")
    assert isinstance(err.value, KeyError)
    assert "a/1" in str(err.value)
    assert store.statistics().errors == 0  # missing objects are not store errors


async def test_put_if_absent(backend: Backend, tmp_path: Path) -> None:
    store = backend.store
    assert await store.put("k", b"first", if_absent=True) is True
    assert await store.put("k", b"second", if_absent=True) is False
    assert await store.get("k") == b"first"
    # Larger than a part: checked with a head, then a multipart upload.
    src = tmp_path / "big"
    data = random_file(src, 9 * MiB)
    assert await store.put("big", src, if_absent=True) is True
    assert await store.put("big", b"other", if_absent=True) is False
    assert await store.get("big") == data


# -- conditional writes ----------------------------------------------------------------


async def test_create_and_compare_and_swap(backend: Backend) -> None:
    store = backend.store
    assert await store.get_versioned("c/k") is None
    v1 = await store.create("c/k", b"one")
    assert v1 is not None
    assert await store.create("c/k", b"two") is None  # exists: left alone
    got = await store.get_versioned("c/k")
    assert got is not None and (got.data, got.version) == (b"one", v1)
    v2 = await store.compare_and_swap("c/k", b"two", expect=v1)
    assert v2 is not None and v2 != v1
    # The version read before is stale now: the swap is refused and changes nothing.
    assert await store.compare_and_swap("c/k", b"three", expect=v1) is None
    got = await store.get_versioned("c/k")
    assert got is not None and (got.data, got.version) == (b"two", v2)
    # A swap of an object that is gone is refused too, and does not create it.
    await store.delete("c/k")
    assert await store.compare_and_swap("c/k", b"four", expect=v2) is None
    assert await store.get_versioned("c/k") is None


async def test_swap_notices_a_write_behind_its_back(backend: Backend) -> None:
    store = backend.store
    v1 = await store.create("c/t", b"mine")
    assert v1 is not None
    backend.tamper("c/t", b"someone else's")
    assert await store.compare_and_swap("c/t", b"mine again", expect=v1) is None
    assert await store.get("c/t") == b"someone else's"


async def test_racing_conditional_writes_have_one_winner(backend: Backend) -> None:
    store = backend.store
    created: list[int] = []
    swapped: list[int] = []

    async def create(n: int) -> None:
        if await store.create("race/k", f"create {n}".encode()) is not None:
            created.append(n)

    async with trio.open_nursery() as nursery:
        for n in range(8):
            nursery.start_soon(create, n)
    assert len(created) == 1
    base = await store.get_versioned("race/k")
    assert base is not None

    async def swap(n: int) -> None:
        if await store.compare_and_swap("race/k", f"swap {n}".encode(), expect=base.version):
            swapped.append(n)

    async with trio.open_nursery() as nursery:
        for n in range(8):
            nursery.start_soon(swap, n)
    assert len(swapped) == 1
    assert await store.get("race/k") == f"swap {swapped[0]}".encode()
    # The directory store's lock files and temporary files never show in listings.
    assert [i.key for i in await store.list()] == ["race/k"]


@pytest.mark.parametrize("key", ["", "/abs", "a//b", "a/../b", "./a", "a/", "..", "a/."], ids=repr)
async def test_bad_keys_are_refused(backend: Backend, key: str) -> None:
    with pytest.raises(ValueError, match="invalid object key"):
        await backend.store.put(key, b"x")


# -- content-addressed blobs ----------------------------------------------------------


async def test_put_blob_dedup(backend: Backend, tmp_path: Path) -> None:
    store = backend.store
    data = os.urandom(3 * MiB)
    digest = await store.put_blob(data)
    assert digest.startswith("sha256:")
    first = store.statistics()
    assert first.bytes_uploaded == len(data)
    # The same content again, as bytes and as a file: nothing is uploaded.
    assert await store.put_blob(data) == digest
    src = tmp_path / "same"
    src.write_bytes(data)
    assert await store.put_blob(src, digest=digest) == digest
    assert store.statistics().bytes_uploaded == first.bytes_uploaded
    assert [i.key for i in await store.list("blobs")] == [blob_key(digest)]
    assert blob_key(digest) == f"blobs/sha256/{digest[7:9]}/{digest[7:]}"
    assert await store.get_blob(digest) == data
    assert await store.has_blob(digest)
    # A claimed digest the content does not match is refused and nothing is stored.
    other = os.urandom(100)
    with pytest.raises(CorruptObject):
        await store.put_blob(other, digest=digest.replace(digest[-4:], "0000"))
    assert len(await store.list("blobs")) == 1


async def test_corrupted_blob_is_detected(backend: Backend, tmp_path: Path) -> None:
    store = backend.store
    digest = await store.put_blob(b"the real content" * 1000)
    backend.tamper(blob_key(digest), b"the fake content" * 1000)
    with pytest.raises(CorruptObject, match=digest):
        await store.get_blob(digest)
    dst = tmp_path / "restored"
    with pytest.raises(CorruptObject):
        await store.download_blob(digest, dst)
    assert not dst.exists()
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".restored")]
    with pytest.raises(ObjectNotFound):
        await store.get_blob("sha256:" + "ab" * 32)


async def test_download_blob_verifies_and_lands(backend: Backend, tmp_path: Path) -> None:
    store = backend.store
    data = os.urandom(5 * MiB + 7)
    digest = await store.put_blob(data)
    dst = tmp_path / "blob"
    await store.download_blob(digest, dst)
    assert dst.read_bytes() == data


# -- failures of a real S3 server -------------------------------------------------------


async def test_server_down_fails_after_bounded_retries(s3_faulty: MotoS3) -> None:
    store = s3_store(s3_faulty)
    await store.put("k", b"v")
    before = store.statistics()
    s3_faulty.stop()
    with trio.fail_after(5):
        with pytest.raises(StoreUnavailable) as err:
            await store.get("k")
    message = str(err.value)
    assert s3_faulty.endpoint in message and s3_faulty.bucket in message
    assert "get 'k'" in message and "3 attempts" in message
    stats = store.statistics()
    assert (stats.retries, stats.errors) == (2, 1)
    assert stats.requests - before.requests == 3
    # Back on the same port: the same store works again.
    s3_faulty.start()
    assert await store.get("k") == b"v"


async def test_server_killed_mid_upload(s3_faulty: MotoS3, tmp_path: Path) -> None:
    store = s3_store(s3_faulty, part_size=5 * MiB, part_concurrency=1)
    src = tmp_path / "big"
    data = random_file(src, 12 * MiB)
    s3_faulty.kill_after(2)  # create the multipart upload, one part, then the server dies
    with trio.fail_after(10), pytest.raises(StoreUnavailable, match="put 'big'"):
        await store.put("big", src)
    assert not s3_faulty.running
    s3_faulty.start()
    assert await store.head("big") is None  # nothing half-written is visible
    assert await store.put("big", src) is True
    assert await store.get("big") == data


async def test_server_back_during_backoff(s3_faulty: MotoS3) -> None:
    patient = RetryPolicy(attempts=50, base_delay=0.05, max_delay=0.1, transport_retries=0)
    store = s3_store(s3_faulty, retry=patient)
    await store.put("k", b"v")
    s3_faulty.stop()
    result: list[bytes] = []
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:

            async def reader() -> None:
                result.append(await store.get("k"))

            nursery.start_soon(reader)
            # The store has no event for "retrying"; poll its statistics.
            while store.statistics().retries < 2:  # noqa: ASYNC110
                await trio.sleep(0.01)
            await trio.to_thread.run_sync(s3_faulty.start)
    assert result == [b"v"]
    assert store.statistics().errors == 0


@pytest.mark.parametrize("status", [503, 500, 429])
async def test_error_statuses_are_retried(s3_faulty: MotoS3, status: int) -> None:
    store = s3_store(s3_faulty)
    await store.put("k", b"v")
    s3_faulty.fail_next(2, status=status)
    assert await store.get("k") == b"v"
    assert store.statistics().retries == 2
    s3_faulty.fail_next(3, status=status)
    with pytest.raises(StoreUnavailable, match=str(status)):
        await store.head("k")


async def test_client_errors_are_not_retried(s3_faulty: MotoS3) -> None:
    store = s3_store(s3_faulty)
    s3_faulty.fail_next(1, status=403)
    with pytest.raises(StoreError) as err:
        await store.get("k")
    assert not isinstance(err.value, StoreUnavailable)
    assert store.statistics().retries == 0


async def test_configured_from_environment(
    s3_server: MotoS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    store = open_object_store(s3_server.url(f"env/{secrets.token_hex(4)}"), retry=FAST)
    assert s3_server.endpoint in store.where
    await store.put("x", b"from env")
    assert await store.get("x") == b"from env"
    # Explicit client options keep what the environment set (AWS_ALLOW_HTTP).
    store = open_object_store(
        s3_server.url(f"env/{secrets.token_hex(4)}"), client_options={"timeout": "20s"}
    )
    await store.put("y", b"still http")
    assert await store.get("y") == b"still http"


# -- URLs ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "",
        "relative/dir",
        "ftp://host/x",
        "http://host/x",
        "file://otherhost/x",
        "file:relative",
        "file:///a/../b",
        "s3://",
        "s3:///prefix",
        "s3://bkt/a//b",
        "s3://bkt/a/../b",
        "s3://bkt/p?versionId=1",
    ],
)
def test_bad_urls(url: str) -> None:
    with pytest.raises(ValueError, match="store URL"):
        open_object_store(url)


def test_unknown_scheme_message_lists_forms() -> None:
    with pytest.raises(ValueError) as err:
        open_object_store("ftp://host/x")
    assert "'ftp'" in str(err.value) and "s3://bucket/prefix" in str(err.value)


def test_file_url_creates_directory(tmp_path: Path) -> None:
    root = tmp_path / "a" / "b"
    store = open_object_store(root.as_uri())
    assert root.is_dir()
    assert str(root) in store.where
    with pytest.raises(ValueError):
        open_object_store(root.as_uri(), config={"region": "x"})


def test_cloud_urls_construct_without_contacting_anything() -> None:
    gs = open_object_store("gs://bkt/some/prefix")
    assert gs.where == "gs://bkt/some/prefix"
    az = open_object_store("az://container/p", config={"account_name": "acct"})
    assert az.where.startswith("az://container/p")
    s3 = open_object_store(
        "s3://bkt/p", config={"region": "eu-west-1", "virtual_hosted_style_request": "true"}
    )
    assert s3.where.startswith("s3://bkt/p")
    with pytest.raises(ValueError, match="cannot configure"):
        open_object_store("s3://bkt/p", config={"no_such_option": "1"})


def test_parse_store_url() -> None:
    loc = parse_store_url("s3a://bkt/a/b/")
    assert (loc.scheme, loc.bucket, loc.prefix) == ("s3", "bkt", "a/b")
    loc = parse_store_url("file:///var/lib/aenv/store/")
    assert (loc.scheme, loc.prefix) == ("file", "/var/lib/aenv/store")
    assert parse_store_url("gs://b").prefix == ""


# -- pure helpers ------------------------------------------------------------------


def test_blob_key_rejects_non_sha256() -> None:
    for bad in ["sha256:abc", "sha512:" + "a" * 64, "a" * 64, "sha256:" + "A" * 64]:
        with pytest.raises(ValueError):
            blob_key(bad)


@given(st.lists(st.text(alphabet="ab.", max_size=3), min_size=1, max_size=4))
def test_check_key_accepts_only_clean_relative_paths(segments: list[str]) -> None:
    key = "/".join(segments)
    clean = all(s not in ("", ".", "..") for s in segments)
    if clean:
        assert check_key(key) == key
    else:
        with pytest.raises(ValueError):
            check_key(key)


def test_an_operation_waits_at_most_the_capped_backoff_then_gives_up() -> None:
    retries = RetryPolicy(attempts=7, base_delay=0.2, max_delay=1.0).retries()
    waits = [retries.failed() for _ in range(7)]
    assert waits[-1] is None  # the 7th failure is the last attempt
    for wait, cap in zip(waits[:-1], [0.2, 0.4, 0.8, 1.0, 1.0, 1.0], strict=True):
        assert wait is not None
        assert 0 <= wait <= cap


def test_error_classification() -> None:
    transient = [
        "Server returned non-2xx status code: 503 Service Unavailable",
        "inner: Status {\n status: 500,",
        "Server returned non-2xx status code: 429 Too Many Requests",
        "HTTP error: error sending request",
        "HttpError { kind: Timeout, source: ... }",
        "connection reset by peer",
    ]
    fatal = [
        "Server returned non-2xx status code: 403 Forbidden",
        "Server returned non-2xx status code: 416 Range Not Satisfiable",
        "Requested range was invalid",
        "No space left on device (os error 28)",
        "HTTP error: builder error ... retry_timeout: 60s, inner: Http(HttpError { kind: Unknown,"
        " source: reqwest::Error { kind: Builder, source: BadScheme } })",
    ]
    for text in transient:
        assert is_transient_message(text), text
    for text in fatal:
        assert not is_transient_message(text), text
    assert classify_error(FileNotFoundError("x")) is ErrorKind.NOT_FOUND
    assert classify_error(ConnectionRefusedError()) is ErrorKind.TRANSIENT
    assert classify_error(PermissionError("denied")) is ErrorKind.FATAL
    assert classify_error(RuntimeError("503 timeout")) is ErrorKind.FATAL  # not obstore's
