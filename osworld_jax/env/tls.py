"""TLS for the remote backend: trust exactly the pinned CA bundle; say why a handshake failed.

``pinned_ssl_context`` trusts only the configured CA bundle (TLS >= 1.2, hostname checked).
``describe_tls_failure`` turns a failed handshake into one line naming the cause: an expired (or
not yet valid) certificate, a certificate for another host, a certificate not signed by the
pinned CA, or a protocol version the client refuses. Every one of those is permanent: retrying
cannot fix it, so callers never retry them. A server that speaks only TLS 1.0/1.1 may answer the
client's hello with an alert or by dropping the connection; ``legacy_tls_version`` tells the two
apart from a network failure by one handshake offering the old versions too (no request is sent
on it, and nothing is trusted).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ssl
import warnings
from pathlib import Path

__all__ = [
    "MIN_TLS",
    "CABundleError",
    "check_ca_bundle",
    "describe_tls_failure",
    "legacy_tls_version",
    "pinned_ssl_context",
    "version_refused",
]

#: The oldest TLS version the client speaks.
MIN_TLS = ssl.TLSVersion.TLSv1_2
_MIN_TLS_TEXT = "TLS 1.2"

# OpenSSL X509_V_ERR_* verify codes, grouped by what they mean to an operator.
_EXPIRED = {10}  # CERT_HAS_EXPIRED
_NOT_YET_VALID = {9}  # CERT_NOT_YET_VALID
_WRONG_HOST = {62, 63, 64}  # HOSTNAME_MISMATCH, EMAIL_MISMATCH, IP_ADDRESS_MISMATCH
_UNKNOWN_CA = {2, 18, 19, 20, 21}  # no issuer / self-signed / unable to verify the first cert
# OpenSSL reasons of a handshake refused over the protocol version.
_VERSION_REASONS = {
    "UNSUPPORTED_PROTOCOL",
    "TLSV1_ALERT_PROTOCOL_VERSION",
    "NO_PROTOCOLS_AVAILABLE",
    "VERSION_TOO_LOW",
    "WRONG_SSL_VERSION",
}


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
    ctx.minimum_version = MIN_TLS
    try:
        ctx.load_verify_locations(cafile=str(ca_bundle))
    except (ssl.SSLError, OSError) as e:
        raise CABundleError(f"CA bundle {ca_bundle} cannot be loaded: {e}") from None
    return ctx


def _ssl_error(exc: BaseException | None) -> ssl.SSLError | None:
    """The ``ssl.SSLError`` behind ``exc`` (aiohttp wraps it), or None."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        cert = getattr(exc, "certificate_error", None)  # aiohttp ClientConnectorCertificateError
        if isinstance(cert, ssl.SSLError):
            return cert
        if isinstance(exc, ssl.SSLError) and getattr(exc, "reason", None):
            return exc
        inner = getattr(exc, "os_error", None)  # aiohttp ClientConnectorError
        if isinstance(inner, ssl.SSLError):
            return inner
        exc = exc.__cause__ or exc.__context__
    return None


def version_refused(exc: BaseException) -> bool:
    """Whether ``exc`` is a handshake refused over the TLS protocol version."""
    err = _ssl_error(exc)
    return err is not None and getattr(err, "reason", None) in _VERSION_REASONS


def describe_tls_failure(
    exc: BaseException,
    *,
    host: str,
    ca_bundle: str | Path | None = None,
    server_version: str | None = None,
) -> str:
    """One line saying why the TLS handshake with ``host`` failed (``exc`` as aiohttp raised it).

    Args:
      exc: the exception of the failed connection.
      host: the host the client connected to.
      ca_bundle: the pinned CA bundle (named when the certificate is not signed by it).
      server_version: the TLS version the server speaks, when ``legacy_tls_version`` found one.
    """
    if server_version is not None:
        return (
            f"TLS protocol version: the service at {host} speaks only {server_version}; "
            f"this client requires {_MIN_TLS_TEXT} or newer (upgrade the service's TLS)"
        )
    err = _ssl_error(exc)
    if isinstance(err, ssl.SSLCertVerificationError):
        code, detail = err.verify_code, err.verify_message
        if code in _EXPIRED:
            return (
                f"TLS: certificate has expired: the certificate {host} presents is past its "
                f"validity end ({detail}); the service must renew it"
            )
        if code in _NOT_YET_VALID:
            return (
                f"TLS: certificate is not yet valid: the certificate {host} presents starts in "
                f"the future ({detail}); check this machine's clock"
            )
        if code in _WRONG_HOST:
            return (
                f"TLS: hostname mismatch: the certificate presented is not valid for {host} "
                f"({detail}); use the host name the certificate names"
            )
        if code in _UNKNOWN_CA:
            pinned = f" {ca_bundle}" if ca_bundle is not None else ""
            return (
                f"TLS: unknown CA: the certificate {host} presents is not signed by the pinned "
                f"CA{pinned} ({detail})"
            )
        return f"TLS: the certificate {host} presents is refused: {detail} (verify code {code})"
    reason = getattr(err, "reason", None) if err is not None else None
    if reason in _VERSION_REASONS:
        return (
            f"TLS protocol version: the service at {host} does not speak {_MIN_TLS_TEXT} or "
            f"newer ({reason})"
        )
    if reason == "WRONG_VERSION_NUMBER":
        return f"TLS: the service at {host} does not answer TLS (plain HTTP on an https address?)"
    return f"TLS handshake with {host} failed: {reason or err or exc}"


async def legacy_tls_version(host: str, port: int, *, timeout: float) -> str | None:
    """The TLS version ``host:port`` speaks if it is older than ``MIN_TLS``, else None.

    One handshake that also offers TLS 1.0/1.1 (and trusts nothing: it only reads the version);
    closed at once, no request sent. None when that handshake fails too (a network problem) or
    negotiates ``MIN_TLS`` or newer.
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # naming TLSv1 warns
        ctx.minimum_version = ssl.TLSVersion.TLSv1
    ctx.set_ciphers("DEFAULT:@SECLEVEL=0")  # the ciphers an old server offers
    writer = None
    try:
        async with asyncio.timeout(timeout):
            _, writer = await asyncio.open_connection(host, port, ssl=ctx, server_hostname=host)
        tls = writer.get_extra_info("ssl_object")
        version = tls.version() if tls is not None else None
    except (OSError, TimeoutError):
        return None
    finally:
        if writer is not None:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
    if version in (None, "TLSv1.2", "TLSv1.3"):
        return None
    return str(version)
