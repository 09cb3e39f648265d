"""A throw-away certificate authority for TLS tests: ``make_test_pki`` -> ``TestPKI``.

A CA and a server certificate (EC P-256) signed by it, generated with ``cryptography``: the fake
sandbox service (``sandbox_service``) serves with it and the ``remote`` backend pins its CA.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import ssl
import uuid
from pathlib import Path
from typing import Any

__all__ = ["TestPKI", "make_test_pki"]


@dataclasses.dataclass(frozen=True)
class TestPKI:
    """A throw-away CA and a server certificate signed by it (see ``make_test_pki``).

    Attributes:
      ca_path: the CA certificate (PEM): the bundle a client pins.
      cert_path: the server certificate (PEM).
      key_path: the server's private key (PEM, unencrypted).
    """

    __test__ = False  # not a pytest test class

    ca_path: Path
    cert_path: Path
    key_path: Path

    def server_context(self, *, only_version: ssl.TLSVersion | None = None) -> ssl.SSLContext:
        """A server-side TLS context presenting the server certificate.

        Args:
          only_version: speak only this TLS version (e.g. ``TLSv1`` to play an outdated
            service; OpenSSL's security level is lowered so that it can).
        """
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(str(self.cert_path), str(self.key_path))
        if only_version is not None:
            ctx.set_ciphers("DEFAULT:@SECLEVEL=0")
            ctx.minimum_version = ctx.maximum_version = only_version
        return ctx


def make_test_pki(
    directory: str | Path,
    *,
    name: str = "osworld_jax test CA",
    hosts: tuple[str, ...] = ("localhost", "127.0.0.1"),
    expired: bool = False,
) -> TestPKI:
    """Generates a CA and a server certificate (EC P-256) signed by it into ``directory``.

    Args:
      directory: where ``ca.pem``, ``server.pem`` and ``server.key`` go.
      name: the CA's common name (a random suffix keeps CAs apart).
      hosts: the names and IP addresses the server certificate is valid for.
      expired: the server certificate expired yesterday (else it is valid for a day).
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    valid = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=1))
    day = datetime.timedelta(days=1)
    server_valid = (now - 2 * day, now - day) if expired else valid

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} {uuid.uuid4().hex[:8]}")])
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(valid[0])
        .not_valid_after(valid[1])
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(ca_ski, critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(server_valid[0])
        .not_valid_after(server_valid[1])
        .add_extension(x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    pki = TestPKI(out / "ca.pem", out / "server.pem", out / "server.key")
    pki.ca_path.write_bytes(ca.public_bytes(pem))
    pki.cert_path.write_bytes(cert.public_bytes(pem))
    pki.key_path.write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    pki.key_path.chmod(0o600)
    return pki


def _san(host: str) -> Any:
    from cryptography import x509

    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)
