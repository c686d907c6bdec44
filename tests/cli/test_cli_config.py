"""Credentials: file location and mode, and flags > environment > file."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from aenv.client import config
from aenv.client.errors import NotConfigured, UsageError


@pytest.fixture(autouse=True)
def isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("AENV_URL", raising=False)
    monkeypatch.delenv("AENV_API_KEY", raising=False)
    return tmp_path


def test_save_is_private_and_under_xdg(isolated: Path) -> None:
    path = config.save(config.Credentials("http://n:1", "k"))
    assert path == isolated / "xdg" / "aenv" / "credentials"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert json.loads(path.read_text()) == {"url": "http://n:1", "api_key": "k"}


def test_home_default_without_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("XDG_CONFIG_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert config.credentials_path() == tmp_path / ".config" / "aenv" / "credentials"


def test_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    config.save(config.Credentials("http://file:1", "file-key"))
    assert config.resolve() == config.Credentials("http://file:1", "file-key")
    monkeypatch.setenv("AENV_API_KEY", "env-key")
    assert config.resolve() == config.Credentials("http://file:1", "env-key")
    monkeypatch.setenv("AENV_URL", "env:2")
    assert config.resolve() == config.Credentials("http://env:2", "env-key")
    assert config.resolve("https://flag:3/", None) == config.Credentials(
        "https://flag:3", "env-key"
    )
    assert config.resolve(None, "flag-key").api_key == "flag-key"


def test_nothing_configured() -> None:
    with pytest.raises(NotConfigured, match="aenv auth"):
        config.resolve()


def test_broken_file(isolated: Path) -> None:
    path = isolated / "xdg" / "aenv" / "credentials"
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with pytest.raises(NotConfigured, match="aenv auth"):
        config.resolve()


@pytest.mark.parametrize("bad", ["ftp://x", "http://", "http://h:notaport"])
def test_bad_urls(bad: str) -> None:
    with pytest.raises(UsageError):
        config.normalize_url(bad)
