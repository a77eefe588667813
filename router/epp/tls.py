"""The endpoint picker's TLS, served like the Gateway API Inference Extension's reference picker.

Gateways dial an endpoint picker over TLS without verifying it (kgateway's and Envoy AI Gateway's clusters carry an
``UpstreamTlsContext`` with no validation context; GIE's chart gives Istio a ``DestinationRule`` with ``tls.mode:
SIMPLE`` and ``insecureSkipVerify``), so by default the picker makes a self-signed certificate at start, in memory
(``self_signed``). A certificate and key mounted from a Secret (``epp_tls_cert_file`` / ``epp_tls_key_file``) are
served instead and read again when the files change: every new connection's handshake asks ``_MountedPair`` first
(two ``stat`` calls), so a rotated Secret is served without a restart. ``epp_grpc_insecure`` serves plaintext h2c.

Units: seconds, days.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

log = logging.getLogger("kvroute.epp")

#: lifetime of the self-signed certificate (GIE's reference picker: 10 years; it is made anew at every start)
SELF_SIGNED_DAYS = 3650
#: subject of the self-signed certificate
SELF_SIGNED_NAME = "kvroute-epp"


@dataclass(frozen=True)
class KeyPair:
    """A PEM certificate (chain) and its PEM private key."""

    cert_pem: bytes
    key_pem: bytes


def default_hosts() -> list[str]:
    """Names the self-signed certificate covers: loopback and this host's name (the pod name in Kubernetes)."""
    hosts = ["localhost", "127.0.0.1", "::1"]
    name = socket.gethostname()
    if name and name not in hosts:
        hosts.append(name)
    return hosts


def self_signed(hosts: Sequence[str] = (), days: int = SELF_SIGNED_DAYS) -> KeyPair:
    """A new P-256 key and a self-signed server certificate for ``hosts`` (DNS names or IP addresses in the
    subject alternative names; default ``default_hosts()``), valid from an hour ago for ``days`` days."""
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for host in hosts or default_hosts():
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, SELF_SIGNED_NAME)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), key_pem)


def load_pair(cert_file: str, key_file: str) -> KeyPair:
    """The certificate and key in two PEM files, checked to belong together.

    Raises:
        ValueError: a file is missing or unreadable, not PEM, or the key is not the certificate's.
    """
    try:
        cert_pem, key_pem = Path(cert_file).read_bytes(), Path(key_file).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read the endpoint picker's certificate or key: {exc}") from None
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as exc:
        raise ValueError(
            f"{cert_file} / {key_file}: not a PEM certificate and unencrypted key: {exc}"
        ) from None
    spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if cert.public_key().public_bytes(*spki) != key.public_key().public_bytes(*spki):
        raise ValueError(f"{key_file} is not the private key of the certificate in {cert_file}")
    return KeyPair(cert_pem, key_pem)


def write_pair(pair: KeyPair, directory: Path) -> tuple[Path, Path]:
    """Write ``pair`` as ``epp-tls.crt`` / ``epp-tls.key`` (owner-only) in ``directory``: one certificate shared by
    a pod's worker processes. Returns (certificate path, key path)."""
    cert, key = directory / "epp-tls.crt", directory / "epp-tls.key"
    for path, data in ((cert, pair.cert_pem), (key, pair.key_pem)):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    return cert, key


class _MountedPair:
    """The certificate configuration of mounted files, read again when either file changes (checked at every new
    connection; a pair that fails to load keeps the previous one, logged)."""

    def __init__(self, cert_file: str, key_file: str) -> None:
        self.cert_file, self.key_file = cert_file, key_file
        self.stamp = self._stamp()
        self.pair = load_pair(cert_file, key_file)

    def _stamp(self) -> tuple[int, int, int, int]:
        a, b = os.stat(self.cert_file), os.stat(self.key_file)
        return a.st_mtime_ns, a.st_size, b.st_mtime_ns, b.st_size

    def initial(self) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration([(self.pair.key_pem, self.pair.cert_pem)])

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's per-handshake callback: a new configuration when the files changed, else None (keep)."""
        try:
            stamp = self._stamp()
            if stamp == self.stamp:
                return None
            pair = load_pair(self.cert_file, self.key_file)
        except (OSError, ValueError) as exc:
            log.warning("endpoint picker: keeping the previous certificate", extra={"error": str(exc)})
            return None
        self.stamp, self.pair = stamp, pair
        log.info("endpoint picker: serving the rotated certificate", extra={"file": self.cert_file})
        return grpc.ssl_server_certificate_configuration([(pair.key_pem, pair.cert_pem)])


def server_credentials(insecure: bool, cert_file: str, key_file: str) -> grpc.ServerCredentials | None:
    """The picker's gRPC server credentials: None (plaintext) when ``insecure``; the mounted pair when both files
    are given (reloaded on change); else a self-signed certificate made now.

    Raises:
        ValueError: only one of the two files is given, or they do not load (see ``load_pair``).
    """
    if insecure:
        return None
    if bool(cert_file) != bool(key_file):
        raise ValueError("epp_tls_cert_file and epp_tls_key_file go together: set both, or neither")
    if cert_file:
        mounted = _MountedPair(cert_file, key_file)
        # (the stubs say the callback returns a configuration; gRPC documents None as "keep the current one")
        return grpc.dynamic_ssl_server_credentials(mounted.initial(), mounted.fetch)  # type: ignore[arg-type]
    pair = self_signed()
    return grpc.ssl_server_credentials([(pair.key_pem, pair.cert_pem)])
