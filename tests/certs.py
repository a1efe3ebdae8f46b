"""A throwaway PKI for the TLS tests: one CA, a server certificate for localhost/127.0.0.1, client certificates."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pki:
    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key, path: Path) -> str:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    return str(path)


def _issue(common_name: str, issuer_name: x509.Name, issuer_key, key, *, ca: bool = False,
           server: bool = False) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(issuer_name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    if not ca:
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write_cert(cert: x509.Certificate, path: Path) -> str:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(path)


def make_pki(directory: Path, prefix: str = "") -> Pki:
    """Write a CA, a server pair and a client pair as PEM files under `directory`."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name(f"{prefix}tiercache test CA")
    ca_cert = _issue(f"{prefix}tiercache test CA", ca_name, ca_key, ca_key, ca=True)
    server_key, client_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    server_cert = _issue("localhost", ca_name, ca_key, server_key, server=True)
    client_cert = _issue(f"{prefix}client", ca_name, ca_key, client_key)
    return Pki(ca=_write_cert(ca_cert, directory / f"{prefix}ca.pem"),
               server_cert=_write_cert(server_cert, directory / f"{prefix}server.pem"),
               server_key=_write_key(server_key, directory / f"{prefix}server.key"),
               client_cert=_write_cert(client_cert, directory / f"{prefix}client.pem"),
               client_key=_write_key(client_key, directory / f"{prefix}client.key"))
