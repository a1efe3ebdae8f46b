"""How a client reaches a server: the gRPC channel for its connection settings (TLS, the bearer token and the client's
id on every call), one try of an RPC under a deadline, and the data channel's TLS from the same files."""

from __future__ import annotations

import ssl
import time
from typing import Callable, TypeVar

import grpc

from tiercache.client.settings import ConnectionSettings
from tiercache.config import read_file
from tiercache.errors import InvalidArgument
from tiercache.protocol.client_id import METADATA_KEY as client_id_key
from tiercache.protocol.wire import AUTHORIZATION, error_of

T = TypeVar("T")


def open_channel(settings: ConnectionSettings, options: list[tuple[str, int | str]], client_id: str) -> grpc.Channel:
    """`client_id`: what the client calls itself on every call (tiercache.protocol.client_id)."""
    if settings.uses_tls:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=_pem(settings.tls_ca_file), private_key=_pem(settings.tls_key_file),
            certificate_chain=_pem(settings.tls_cert_file))
        if settings.tls_server_name:
            options = [*options, ("grpc.ssl_target_name_override", settings.tls_server_name)]
        channel = grpc.secure_channel(settings.target, credentials, options=options)
    else:
        channel = grpc.insecure_channel(settings.target, options=options)
    headers = [(client_id_key, client_id)]
    if settings.token:
        # Sent on plaintext channels too (a unix socket, a trusted network); TLS is what keeps it private.
        headers.append((AUTHORIZATION, f"Bearer {settings.token}"))
    return grpc.intercept_channel(channel, _Metadata(headers))


def data_tls_context(settings: ConnectionSettings) -> ssl.SSLContext:
    """TLS for the data channel (tiercache.client.data_channel), from the same files as the gRPC channel's: the CA
    that signed the server's certificate (default: the system's roots) and the client certificate for mutual TLS."""
    context = ssl.create_default_context(cafile=settings.tls_ca_file)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if settings.tls_cert_file:
        context.load_cert_chain(settings.tls_cert_file, settings.tls_key_file)
    return context


def call(method: Callable[..., T], request, deadline: float) -> T:
    """One try of an RPC (`method`: a stub's) with what is left of the caller's deadline (time.monotonic()); a failure
    raises its tiercache error (protocol.wire.error_of), never grpc.RpcError."""
    try:
        return method(request, timeout=time_left(deadline))
    except grpc.RpcError as exc:
        raise error_of(exc) from None


def time_left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.001)


def _pem(path: str | None) -> bytes | None:
    return read_file(path, "TLS file", InvalidArgument) if path else None


class _Metadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds `headers` (the client's id, `authorization: Bearer <token>`) to every call."""

    def __init__(self, headers: list[tuple[str, str]]) -> None:
        self._headers = headers

    def _details(self, details):
        return _Details(details, [*(details.metadata or ()), *self._headers])

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
