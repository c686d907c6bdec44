"""Hibernated memory images as their difference from their base (`aenv.runtimes.pagepack`).

On real page files the shape runsc writes (`pages.img`: whole pages); a
sandbox hibernated and resumed through it under runsc is in
tests/e2e/test_pause.py.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from aenv.runtimes import pagepack
from aenv.runtimes.pagepack import PAGE, PackError

PAGES = 64


def page_file(path: Path, seed: int, pages: int = PAGES) -> bytes:
    rng = random.Random(seed)
    data = b"".join(
        bytes(PAGE) if i % 7 == 0 else rng.randbytes(PAGE)  # zero pages, as in a guest
        for i in range(pages)
    )
    path.write_bytes(data)
    return data


def image(tmp_path: Path, data: bytes) -> Path:
    d = tmp_path / "image"
    d.mkdir()
    (d / "pages.img").write_bytes(data)
    (d / "checkpoint.img").write_bytes(b"kernel state")
    return d


def test_an_image_packs_to_its_own_pages_and_unpacks_to_itself(tmp_path: Path) -> None:
    base = tmp_path / "base.img"
    base_data = page_file(base, 1)
    data = bytearray(base_data)
    data[5 * PAGE + 17] ^= 0xFF  # a page the guest wrote
    data[9 * PAGE : 10 * PAGE] = base_data[20 * PAGE : 21 * PAGE]  # moved pages
    data += random.Random(2).randbytes(3 * PAGE)  # more memory than its base had
    d = image(tmp_path, bytes(data))

    packed = pagepack.pack(d, base)

    assert packed is not None
    assert (packed.pages, packed.pages - packed.shared) == (PAGES + 3, 1 + 3)
    assert sorted(p.name for p in d.iterdir()) == ["checkpoint.img", "pages.base", "pages.pack"]
    assert (d / "pages.pack").stat().st_size < 5 * PAGE + 4 * len(data) // PAGE + 100
    assert os.path.samefile(d / "pages.base", base)  # a link, no copy
    assert pagepack.is_packed(d)
    base.unlink()  # its snapshot deleted: the link keeps it
    for n in range(2):  # (restores of one image: each unpacks into its own directory)
        pagepack.unpack(d, tmp_path / f"restore{n}")
        assert (tmp_path / f"restore{n}" / "pages.img").read_bytes() == bytes(data)
        assert sorted(p.name for p in (tmp_path / f"restore{n}").iterdir()) == [
            "checkpoint.img",
            "pages.img",
        ]
    assert pagepack.is_packed(d)  # unchanged


def test_a_pack_is_made_against_the_first_base_never_a_pack(tmp_path: Path) -> None:
    base = tmp_path / "base.img"
    page_file(base, 1)
    first = image(tmp_path, base.read_bytes())
    assert pagepack.pack(first, base) is not None
    # a sandbox restored from `first` packs its next image against the same base
    assert pagepack.base_of(first) == first / "pages.base"
    assert pagepack.base_of(tmp_path) is None
    second = tmp_path / "second"
    second.mkdir()
    (second / "pages.img").write_bytes(base.read_bytes())
    assert pagepack.base_of(second) == second / "pages.img"


@pytest.mark.parametrize("case", ["not whole pages", "no pages", "no base"])
def test_what_cannot_be_packed_stays_whole(tmp_path: Path, case: str) -> None:
    base = tmp_path / "base.img"
    data = page_file(base, 1)
    d = image(tmp_path, data + (b"x" if case == "not whole pages" else b""))
    if case == "no pages":
        (d / "pages.img").unlink()
    if case == "no base":
        base.unlink()
    assert pagepack.pack(d, base) is None
    assert not pagepack.is_packed(d)
    assert not (d / "pages.base").exists() and not (d / "pages.pack").exists()


def test_a_pack_on_the_wrong_base_or_damaged_is_refused(tmp_path: Path) -> None:
    base = tmp_path / "base.img"
    page_file(base, 1)
    data = bytearray(base.read_bytes())
    data[3 * PAGE] ^= 1
    d = image(tmp_path, bytes(data))
    assert pagepack.pack(d, base) is not None
    pack = (d / "pages.pack").read_bytes()
    # another base under the name
    (d / "pages.base").unlink()
    page_file(d / "pages.base", 3)
    with pytest.raises(PackError, match="CRC"):
        pagepack.unpack(d, tmp_path / "restore")
    assert not (tmp_path / "restore" / "pages.img").exists()
    (d / "pages.base").unlink()
    os.link(base, d / "pages.base")
    for damaged in (b"garbage" + pack, pack[:-10]):
        (d / "pages.pack").write_bytes(damaged)
        with pytest.raises(PackError):
            pagepack.unpack(d, tmp_path / "restore")
    (d / "pages.pack").write_bytes(pack)
    pagepack.unpack(d, tmp_path / "restore")
    assert (tmp_path / "restore" / "pages.img").read_bytes() == bytes(data)
