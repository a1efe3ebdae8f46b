"""How a client reaches a server: the gRPC channel for a URL, with TLS and the caller's bearer token.

URLs: `grpc://host:port` (plaintext), `grpcs://host:port` (TLS; mutual TLS when a client certificate is given), and
`grpc+unix:///path` (a unix socket). Secrets never come from the command line: the token is passed in code or read
from $TIERCACHE_TOKEN or the file named by $TIERCACHE_TOKEN_FILE; certificate paths may come from
$TIERCACHE_TLS_CA_FILE, $TIERCACHE_TLS_CERT_FILE and $TIERCACHE_TLS_KEY_FILE.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from urllib.parse import urlparse

import grpc

from tiercache.config import read_file
from tiercache.errors import InvalidArgument
from tiercache.protocol.wire import AUTHORIZATION


@dataclass(frozen=True)
class Security:
    """What a client presents: a bearer token and TLS files (all optional)."""

    token: str | None = None
    tls_ca_file: str | None = None  # CA that signed the server's certificate (default: the system's roots)
    tls_cert_file: str | None = None  # client certificate, for servers that require mutual TLS
    tls_key_file: str | None = None
    tls_server_name: str | None = None  # the name to verify in the server's certificate, when not the URL's host

    def __repr__(self) -> str:  # the token must not reach logs through a repr
        return f"Security(token={'***' if self.token else None}, tls_ca_file={self.tls_ca_file!r})"

    @classmethod
    def from_env(cls, **given) -> "Security":
        """Fill what the caller did not give from the environment."""
        env = os.environ
        token = given.pop("token", None) or env.get("TIERCACHE_TOKEN") or _read_token(env.get("TIERCACHE_TOKEN_FILE"))
        return cls(token=token,
                   tls_ca_file=given.pop("tls_ca_file", None) or env.get("TIERCACHE_TLS_CA_FILE"),
                   tls_cert_file=given.pop("tls_cert_file", None) or env.get("TIERCACHE_TLS_CERT_FILE"),
                   tls_key_file=given.pop("tls_key_file", None) or env.get("TIERCACHE_TLS_KEY_FILE"),
                   **given)


def _read_token(path: str | None) -> str | None:
    if not path:
        return None
    return read_file(path, "token file", InvalidArgument).decode().strip() or None


def parse_url(url: str) -> tuple[str, bool]:
    """(gRPC target, whether it uses TLS) for a tiercache URL."""
    if url.startswith("grpc+unix://"):
        path = url.removeprefix("grpc+unix://")
        if not path.startswith("/"):
            raise InvalidArgument(f"expected grpc+unix:///absolute/path, got {url!r}")
        return f"unix:{path}", False
    parsed = urlparse(url if "://" in url else f"grpc://{url}")
    if parsed.scheme not in ("grpc", "grpcs") or not parsed.hostname or not parsed.port:
        raise InvalidArgument(f"expected a URL like grpc://host:port, grpcs://host:port or grpc+unix:///path, "
                              f"got {url!r}")
    host = f"[{parsed.hostname}]" if ":" in parsed.hostname else parsed.hostname
    return f"{host}:{parsed.port}", parsed.scheme == "grpcs"


def open_channel(target: str, *, tls: bool, security: Security, options: list[tuple[str, int | str]]) -> grpc.Channel:
    if tls:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=_pem(security.tls_ca_file), private_key=_pem(security.tls_key_file),
            certificate_chain=_pem(security.tls_cert_file))
        if security.tls_server_name:
            options = [*options, ("grpc.ssl_target_name_override", security.tls_server_name)]
        channel = grpc.secure_channel(target, credentials, options=options)
    else:
        channel = grpc.insecure_channel(target, options=options)
    if security.token:
        # Sent on plaintext channels too (a unix socket, a trusted network); TLS is what keeps it private.
        channel = grpc.intercept_channel(channel, _BearerToken(security.token))
    return channel


def data_tls_context(security: Security) -> ssl.SSLContext:
    """TLS for the data channel (tiercache.client.data_channel), from the same files as the gRPC channel's: the CA
    that signed the server's certificate (default: the system's roots) and the client certificate for mutual TLS."""
    context = ssl.create_default_context(cafile=security.tls_ca_file)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if security.tls_cert_file:
        context.load_cert_chain(security.tls_cert_file, security.tls_key_file)
    return context


def _pem(path: str | None) -> bytes | None:
    return read_file(path, "TLS file", InvalidArgument) if path else None


class _BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                   grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds `authorization: Bearer <token>` to every call."""

    def __init__(self, token: str) -> None:
        self._header = (AUTHORIZATION, f"Bearer {token}")

    def _details(self, details):
        return _Details(details, [*(details.metadata or ()), self._header])

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


class _Details(grpc.ClientCallDetails):
    """grpc's call details with metadata added (grpc hands the interceptor an object it must not mutate)."""

    def __init__(self, details, metadata) -> None:
        self.method = details.method
        self.timeout = details.timeout
        self.metadata = metadata
        self.credentials = details.credentials
        self.wait_for_ready = getattr(details, "wait_for_ready", None)
        self.compression = getattr(details, "compression", None)
