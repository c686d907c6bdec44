"""Extra CA certificates the node asks a sandbox to trust (its egress CA for `network.rules`).

`install(pem)` adds the certificates to the system bundle
(`/etc/ssl/certs/ca-certificates.crt`, what OpenSSL, curl and most
distributions read by default), writes them alone to `CA_FILE` and the
system bundle plus them to `BUNDLE_FILE`, and returns the environment that
points Python (`SSL_CERT_FILE`, `REQUESTS_CA_BUNDLE`), curl
(`CURL_CA_BUNDLE`) and Node (`NODE_EXTRA_CA_CERTS`) at them. Only public
certificates pass here; the CA's key stays on the node.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

SYSTEM_BUNDLE: Final = Path("/etc/ssl/certs/ca-certificates.crt")
DIR: Final = Path("/usr/local/share/aenv")
CA_FILE: Final = DIR / "egress-ca.pem"
BUNDLE_FILE: Final = DIR / "ca-bundle.pem"


def install(pem: str, *, root: Path = Path("/")) -> dict[str, str]:
    """Trust `pem` (PEM certificates) in the sandbox under `root`; the env vars to set."""
    pem = pem.strip() + "\n"
    system = root / SYSTEM_BUNDLE.relative_to("/")
    here = root / DIR.relative_to("/")
    here.mkdir(parents=True, exist_ok=True)
    current = system.read_text(errors="replace") if system.exists() else ""
    if pem not in current:
        system.parent.mkdir(parents=True, exist_ok=True)
        sep = "" if not current or current.endswith("\n") else "\n"
        with open(system, "a") as f:
            f.write(sep + pem)
        current += sep + pem
    _write(root / CA_FILE.relative_to("/"), pem)
    _write(root / BUNDLE_FILE.relative_to("/"), current)
    return {
        "SSL_CERT_FILE": str(BUNDLE_FILE),
        "REQUESTS_CA_BUNDLE": str(BUNDLE_FILE),
        "CURL_CA_BUNDLE": str(BUNDLE_FILE),
        "NODE_EXTRA_CA_CERTS": str(CA_FILE),
    }


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
