"""TLS for the package's own network services (serving, the federation relay): SSL contexts from
PEM files, checked with one clear line before anything listens, and a throwaway certificate
authority for quick starts and tests.

Only the standard library's :mod:`ssl` is needed to use certificates; :func:`make_ca` and
:func:`issue` need the ``cryptography`` package (installed with Flower, i.e. the ``federated``
extra). The contexts speak TLS 1.2 or newer; a server given a CA requires every client to
present a certificate that CA signed (mutual TLS), which is how a federation node proves it
belongs. See docs/security.md.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
import stat
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "CertificateAuthority", "TLSFiles", "client_context", "issue", "make_ca", "quick_start", "server_context",
    "tls_files",
]

_DAYS = 365


def _readable(path: str | os.PathLike[str], flag: str) -> str:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{flag} {p}: no such file")
    return str(p)


def _load_chain(ctx: ssl.SSLContext, cert: str, key: str, *, cert_flag: str, key_flag: str) -> None:
    if Path(key).stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        warnings.warn(f"{key_flag} {key} is readable by other users (chmod 600 it)", stacklevel=3)
    try:
        ctx.load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        raise ValueError(
            f"{cert_flag} {cert} / {key_flag} {key}: not a PEM certificate and its matching "
            f"private key ({exc.reason or exc})"
        ) from None


def _load_ca(ctx: ssl.SSLContext, ca: str, flag: str) -> None:
    try:
        ctx.load_verify_locations(cafile=ca)
    except ssl.SSLError as exc:
        raise ValueError(f"{flag} {ca}: not a PEM CA certificate ({exc.reason or exc})") from None


def server_context(
    cert: str | os.PathLike[str],
    key: str | os.PathLike[str],
    *,
    ca: str | os.PathLike[str] | None = None,
    flags: tuple[str, str, str] = ("--tls-cert", "--tls-key", "--tls-ca"),
) -> ssl.SSLContext:
    """A server-side context presenting ``cert``/``key``.

    Args:
        cert: PEM certificate (chain) the server presents; clients check it against their CA.
        key: Its PEM private key (unencrypted; keep it ``chmod 600``: a warning otherwise).
        ca: With a CA, every client must present a certificate it signed (mutual TLS: a client
            without one is refused during the handshake); ``None`` = any client may connect.
        flags: The option names quoted in errors (cert, key, ca).

    Raises:
        FileNotFoundError: a file is missing.
        ValueError: a file is not PEM, or the key does not match the certificate.
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_chain(ctx, _readable(cert, flags[0]), _readable(key, flags[1]), cert_flag=flags[0], key_flag=flags[1])
    if ca is not None:
        _load_ca(ctx, _readable(ca, flags[2]), flags[2])
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(
    ca: str | os.PathLike[str],
    *,
    cert: str | os.PathLike[str] | None = None,
    key: str | os.PathLike[str] | None = None,
    flags: tuple[str, str, str] = ("--tls-cert", "--tls-key", "--tls-ca"),
) -> ssl.SSLContext:
    """A client-side context trusting only ``ca`` (hostnames checked), optionally presenting
    ``cert``/``key`` to a server that asks for a client certificate.

    Raises:
        FileNotFoundError, ValueError: as :func:`server_context`; ``cert`` without ``key``.
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verify_mode CERT_REQUIRED, check_hostname on
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_ca(ctx, _readable(ca, flags[2]), flags[2])
    if (cert is None) != (key is None):
        raise ValueError(f"give {flags[0]} and {flags[1]} together")
    if cert is not None and key is not None:
        _load_chain(ctx, _readable(cert, flags[0]), _readable(key, flags[1]), cert_flag=flags[0], key_flag=flags[1])
    return ctx


@dataclass(frozen=True, slots=True)
class CertificateAuthority:
    """A CA's PEM files, as written by :func:`make_ca`."""

    cert: Path
    """The CA certificate: the file to copy to every party (their ``--tls-ca``)."""
    key: Path
    """Its private key (``chmod 600``): whoever holds it can issue accepted certificates."""


def _write(path: Path, data: bytes, *, private: bool) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path


def _keypair() -> tuple[object, bytes]:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return key, pem


def make_ca(directory: str | os.PathLike[str], *, name: str = "torsh-distributed CA", days: int = _DAYS) -> CertificateAuthority:
    """Write a new self-signed CA (``ca.pem``, ``ca.key``) into ``directory``.

    Raises:
        ImportError: ``cryptography`` is not installed (``pip install cryptography``).
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import NameOID

    key, key_pem = _keypair()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())  # type: ignore[attr-defined]
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                key_encipherment=False, data_encipherment=False, key_agreement=False,
                encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())  # type: ignore[arg-type]
    )
    out = Path(directory)
    return CertificateAuthority(
        cert=_write(out / "ca.pem", cert.public_bytes(serialization.Encoding.PEM), private=False),
        key=_write(out / "ca.key", key_pem, private=True),
    )


def issue(
    ca: CertificateAuthority,
    directory: str | os.PathLike[str],
    *,
    name: str,
    hosts: Sequence[str] = (),
    days: int = _DAYS,
) -> tuple[Path, Path]:
    """Issue a certificate signed by ``ca`` for both server and client use; writes
    ``<name>.pem`` and ``<name>.key`` into ``directory`` and returns their paths.

    Args:
        ca: The signing CA.
        directory: Where to write.
        name: The certificate's common name and file stem (a node's name, ``server``, ...).
        hosts: Host names and IP addresses it is valid for (subject alternative names): a
            client connecting to ``10.0.0.1`` checks that it is listed. Empty for a client-only
            certificate.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca_cert = x509.load_pem_x509_certificate(ca.cert.read_bytes())
    ca_key = serialization.load_pem_private_key(ca.key.read_bytes(), password=None)
    key, key_pem = _keypair()
    sans: list[x509.GeneralName] = []
    for host in dict.fromkeys(hosts):
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(host.strip("[]"))))
        except ValueError:
            sans.append(x509.DNSName(host))
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())  # type: ignore[attr-defined]
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    out = Path(directory)
    return (
        _write(out / f"{name}.pem", cert.public_bytes(serialization.Encoding.PEM), private=False),
        _write(out / f"{name}.key", key_pem, private=True),
    )


@dataclass(frozen=True, slots=True)
class TLSFiles:
    """One party's PEM files: the CA it trusts and the certificate and key it presents."""

    ca: Path
    """The CA certificate: peers must present certificates it signed."""
    cert: Path
    """This party's certificate (signed by ``ca``; a server's lists the addresses it is reached at)."""
    key: Path
    """Its private key (``chmod 600``)."""

    def server(self) -> ssl.SSLContext:
        """The server side: presents ``cert``, requires a client certificate ``ca`` signed."""
        return server_context(self.cert, self.key, ca=self.ca)

    def client(self) -> ssl.SSLContext:
        """The client side: trusts only ``ca`` (addresses checked), presents ``cert``."""
        return client_context(self.ca, cert=self.cert, key=self.key)


def tls_files(
    ca: str | os.PathLike[str] | None,
    cert: str | os.PathLike[str] | None,
    key: str | os.PathLike[str] | None,
    *,
    flags: tuple[str, str, str] = ("--tls-ca", "--tls-cert", "--tls-key"),
) -> TLSFiles | None:
    """The files of ``--tls-ca/--tls-cert/--tls-key`` (all three or none), each readable.

    Raises:
        ValueError: some given and not all; FileNotFoundError: a file is missing.
    """
    given = [v for v in (ca, cert, key) if v]
    if not given:
        return None
    if len(given) != 3:
        raise ValueError(f"give {', '.join(flags[:2])} and {flags[2]} together (the CA you trust, your "
                         "certificate and its key)")
    assert ca and cert and key
    return TLSFiles(ca=Path(_readable(ca, flags[0])), cert=Path(_readable(cert, flags[1])),
                    key=Path(_readable(key, flags[2])))  # fmt: skip


def quick_start(
    directory: str | os.PathLike[str], *, hosts: Sequence[str], parties: Sequence[str]
) -> tuple[TLSFiles, dict[str, TLSFiles]]:
    """A new CA in ``directory`` with a server certificate for ``hosts`` and one client
    certificate per name of ``parties``: the quick start of a federation over TLS (each
    party's ``ca.pem``, ``<name>.pem`` and ``<name>.key`` are copied to its host).

    Raises:
        ImportError: ``cryptography`` is not installed.
    """
    out = Path(directory)
    ca = make_ca(out, name=f"torsh-distributed federation CA ({out.resolve().name})")
    cert, key = issue(ca, out, name="server", hosts=hosts)
    server = TLSFiles(ca=ca.cert, cert=cert, key=key)
    clients = {}
    for name in parties:
        c_cert, c_key = issue(ca, out, name=name)
        clients[name] = TLSFiles(ca=ca.cert, cert=c_cert, key=c_key)
    return server, clients
