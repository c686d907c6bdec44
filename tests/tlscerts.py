"""Certificates for TLS tests: a throwaway CA and server certificates it signs.

`TestCA(dir)` makes a CA (EC P-256, one day) and writes `ca.pem`;
`ca.issue(name, dns=..., ips=...)` writes `{name}.pem` (the leaf, then the
CA: a chain as a server presents it) and `{name}.key` (unencrypted PKCS#8)
and returns their paths. Nothing is trusted outside the test that made it.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


class TestCA:
    __test__ = False  # not a test class

    def __init__(self, directory: Path, name: str = "aenv test CA") -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        now = datetime.datetime.now(datetime.UTC)
        self._key = ec.generate_private_key(ec.SECP256R1())
        self._name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(self._name)
            .issuer_name(self._name)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    crl_sign=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(self._key.public_key()), critical=False
            )
            .sign(self._key, hashes.SHA256())
        )
        self.pem = self.dir / "ca.pem"
        self.pem.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(
        self, name: str, *, dns: Sequence[str] = (), ips: Sequence[str] = ()
    ) -> tuple[Path, Path]:
        """A server certificate for `dns` names (wildcards allowed) and `ips`."""
        now = datetime.datetime.now(datetime.UTC)
        key = ec.generate_private_key(ec.SECP256R1())
        sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
        sans += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
        leaf = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(self._name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()),
                critical=False,
            )
            .sign(self._key, hashes.SHA256())
        )
        cert_path, key_path = self.dir / f"{name}.pem", self.dir / f"{name}.key"
        cert_path.write_bytes(
            leaf.public_bytes(serialization.Encoding.PEM)
            + self.cert.public_bytes(serialization.Encoding.PEM)
        )
        key_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        key_path.chmod(0o600)
        return cert_path, key_path


def common_name(der: bytes) -> str:
    """The CN of a DER certificate (what `SSLObject.getpeercert(True)` returns)."""
    cert = x509.load_der_x509_certificate(der)
    return str(cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value)
