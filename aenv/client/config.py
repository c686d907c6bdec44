"""Where the CLI finds its node: flags, then environment, then the credentials file.

`aenv auth` writes `$XDG_CONFIG_HOME/aenv/credentials` (default
`~/.config/aenv/credentials`), a JSON object `{"url", "api_key"}` created
with mode 0600 in a 0700 directory. `AENV_URL` / `AENV_API_KEY` override the
file, and `--url` / `--api-key` override both, each field on its own.
"""

from __future__ import annotations

import json
import os
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from aenv.client.errors import NotConfigured, UsageError

DEFAULT_URL = "http://127.0.0.1:8000"


@dataclass(frozen=True)
class Credentials:
    url: str
    api_key: str


def config_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or ""
    root = Path(base) if base and os.path.isabs(base) else Path.home() / ".config"
    return root / "aenv"


def credentials_path() -> Path:
    return config_dir() / "credentials"


def normalize_url(url: str) -> str:
    """`host:port` or a full http(s) URL, without a trailing slash (raises UsageError)."""
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UsageError(f"invalid node URL {url!r}: use http(s)://host:port")
    try:
        parts.port  # noqa: B018 - validates the port
    except ValueError:
        raise UsageError(f"invalid port in node URL {url!r}") from None
    return url.rstrip("/")


def read_file(path: Path | None = None) -> dict[str, str]:
    path = path or credentials_path()
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise NotConfigured(f"cannot read {path}: {e}; run `aenv auth` again") from None
    if not isinstance(raw, dict):
        raise NotConfigured(f"{path} is not a JSON object; run `aenv auth` again")
    return {k: v for k, v in raw.items() if isinstance(k, str) and isinstance(v, str)}


def save(creds: Credentials, path: Path | None = None) -> Path:
    """Write the credentials file atomically, 0600 in a 0700 directory."""
    path = path or credentials_path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"url": creds.url, "api_key": creds.api_key}, f)
        f.write("\n")
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)
    return path


def resolve(url: str | None = None, api_key: str | None = None) -> Credentials:
    """Credentials from flags, then AENV_URL/AENV_API_KEY, then the file."""
    stored: dict[str, str] | None = None

    def from_file(key: str) -> str | None:
        nonlocal stored
        if stored is None:
            stored = read_file()
        return stored.get(key)

    u = url or os.environ.get("AENV_URL") or from_file("url")
    k = api_key or os.environ.get("AENV_API_KEY") or from_file("api_key")
    if not u or not k:
        missing = " and ".join(n for n, v in (("URL", u), ("API key", k)) if not v)
        raise NotConfigured(
            f"no node {missing} configured: run `aenv auth`, or set AENV_URL and AENV_API_KEY"
        )
    return Credentials(normalize_url(u), k)
