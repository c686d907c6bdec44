"""The node's API key: generated once into secrets/api-key (0600), or taken from config."""

from __future__ import annotations

import stat
from pathlib import Path

from aenv.config import Config
from aenv.node.node import ensure_api_key


def test_generated_once_with_private_mode(tmp_path: Path) -> None:
    cfg = Config(home=tmp_path)
    key = ensure_api_key(cfg)
    path = tmp_path / "secrets" / "api-key"
    assert path.read_text().strip() == key and len(key) > 30
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "secrets").stat().st_mode) == 0o700
    assert ensure_api_key(cfg) == key


def test_configured_key_wins_and_writes_nothing(tmp_path: Path) -> None:
    cfg = Config.from_env({"AENV_HOME": str(tmp_path), "AENV_API_KEY": "mine"})
    assert ensure_api_key(cfg) == "mine"
    assert not (tmp_path / "secrets").exists()


def test_env_parsing(tmp_path: Path) -> None:
    cfg = Config.from_env(
        {
            "AENV_HOME": str(tmp_path),
            "AENV_LISTEN": "0.0.0.0:9",
            "AENV_EGRESS_CAP": "198.51.100.0/24, 203.0.113.0/24",
        }
    )
    assert cfg.listen == "0.0.0.0:9"
    assert cfg.egress_cap == ("198.51.100.0/24", "203.0.113.0/24")
    assert cfg.bundle_dir == tmp_path / "bundle"


def test_on_off_and_lazy_restore_settings(tmp_path: Path) -> None:
    home = {"AENV_HOME": str(tmp_path)}
    assert Config.from_env(home).lazy_restore is True
    for off in ("0", "false", "No", " off "):
        cfg = Config.from_env({**home, "AENV_LAZY_RESTORE": off, "AENV_WARM_TEMPLATES": off})
        assert cfg.lazy_restore is False and cfg.warm_templates is False
    cfg = Config.from_env({**home, "AENV_LAZY_RESTORE": "1", "AENV_LAZY_MATERIALISE_AFTER": "2.5"})
    assert cfg.lazy_restore is True and cfg.lazy_materialise_after_s == 2.5
