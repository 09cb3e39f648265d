"""Pinned-CA TLS for the remote backend: trust exactly the configured CA bundle, nothing else."""

from __future__ import annotations

import datetime
import ssl
from pathlib import Path

__all__ = ["CABundleError", "check_ca_bundle", "pinned_ssl_context"]


class CABundleError(ValueError):
    """The CA bundle cannot be read or is not a usable PEM CA bundle (one-line message)."""


def check_ca_bundle(path: str | Path) -> int:
    """Validates a PEM CA bundle; returns how many CA certificates it holds.

    Checks: the file is readable, every PEM block parses as an X.509 certificate, at least one is
    a CA (``BasicConstraints ca=true``) that is valid now.

    Raises:
      CABundleError: naming the file and the problem.
    """
    from cryptography import x509

    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise CABundleError(f"CA bundle {p} cannot be read: {e.strerror or e}") from None
    if b"-----BEGIN CERTIFICATE-----" not in data:
        raise CABundleError(f"CA bundle {p} holds no PEM certificate")
    try:
        certs = x509.load_pem_x509_certificates(data)
    except ValueError as e:
        raise CABundleError(f"CA bundle {p} is not valid PEM: {e}") from None
    now = datetime.datetime.now(datetime.UTC)
    cas, expired = 0, []
    for cert in certs:
        try:
            bc = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
        except x509.ExtensionNotFound:
            continue
        if not bc.ca:
            continue
        if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
            expired.append(f"{cert.subject.rfc4514_string()} (until {cert.not_valid_after_utc})")
            continue
        cas += 1
    if cas == 0:
        if expired:
            raise CABundleError(f"CA bundle {p}: every CA certificate is expired: {expired[0]}")
        raise CABundleError(f"CA bundle {p} holds no CA certificate (BasicConstraints ca=true)")
    return cas


def pinned_ssl_context(ca_bundle: str | Path) -> ssl.SSLContext:
    """A client TLS context that trusts ONLY the CAs of ``ca_bundle`` (no system CAs).

    Hostname checking and certificate verification are on, TLS >= 1.2. Any server certificate
    that does not chain to the bundle is refused during the handshake, before a request (and
    its token) is sent.

    Raises:
      CABundleError: the bundle is unreadable or not a usable CA bundle.
    """
    check_ca_bundle(ca_bundle)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # check_hostname + CERT_REQUIRED, no CAs
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_verify_locations(cafile=str(ca_bundle))
    except (ssl.SSLError, OSError) as e:
        raise CABundleError(f"CA bundle {ca_bundle} cannot be loaded: {e}") from None
    return ctx
