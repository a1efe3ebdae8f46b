"""Where a client finds its server and what it presents there: the connection keys every connector takes, and the only
place that reads them from the environment.

URLs: `grpc://host:port` (plaintext), `grpcs://host:port` (TLS; mutual TLS when a client certificate is given), and
`grpc+unix:///path` (a unix socket). Secrets never come from the command line: the token is given in code or a
connector's config, or read from $TIERCACHE_TOKEN or the file named by $TIERCACHE_TOKEN_FILE. Each key left out (or
empty) comes from its variable: $TIERCACHE_URL, $TIERCACHE_TLS_CA_FILE, $TIERCACHE_TLS_CERT_FILE,
$TIERCACHE_TLS_KEY_FILE.

Before this module the vLLM and SGLang connectors each had their own copy of these keys and of $TIERCACHE_URL, and
they drifted: vLLM's had no client certificate, so a vLLM engine could not reach a server requiring mutual TLS. A
connector now takes these keys from here and adds only its engine's own (tests/client/test_settings.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any, Mapping
from urllib.parse import urlparse

from tiercache.config import read_file, refuse_unknown
from tiercache.errors import InvalidArgument

DEFAULT_URL = "grpc://127.0.0.1:50051"
_ENVIRONMENT = {"url": "TIERCACHE_URL", "token": "TIERCACHE_TOKEN", "tls_ca_file": "TIERCACHE_TLS_CA_FILE",
                "tls_cert_file": "TIERCACHE_TLS_CERT_FILE", "tls_key_file": "TIERCACHE_TLS_KEY_FILE"}


@dataclass(frozen=True)
class ConnectionSettings:
    url: str = DEFAULT_URL
    token: str | None = field(default=None, repr=False)  # the tenant's bearer token: never in a repr or a log line
    tls_ca_file: str | None = None  # CA that signed the server's certificate (default: the system's roots)
    tls_cert_file: str | None = None  # client certificate and key, for servers that require mutual TLS
    tls_key_file: str | None = None
    tls_server_name: str | None = None  # the name to verify in the server's certificate, when not the URL's host

    def __post_init__(self) -> None:
        parse_url(self.url)
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise InvalidArgument("tls_cert_file and tls_key_file must be given together")

    @classmethod
    def keys(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_env(cls, **given: str | None) -> "ConnectionSettings":
        """The settings given, and each one left out or empty from its environment variable (module docstring)."""
        refuse_unknown(given, cls.keys(), "unknown connection settings:", InvalidArgument)
        values = {name: given.get(name) or _from_environment(name) for name in cls.keys()}
        return cls(**{name: value for name, value in values.items() if value})  # defaults for the rest

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> tuple["ConnectionSettings", dict[str, Any]]:
        """A connector's settings split in two: the connection's keys (the environment filling the rest), and the
        other keys as given, for the connector to take as its engine's own (and to refuse what it does not know)."""
        ours = set(cls.keys())
        connection = cls.from_env(**{k: v for k, v in config.items() if k in ours})
        return connection, {k: v for k, v in config.items() if k not in ours}

    @property
    def target(self) -> str:
        """The gRPC target: host:port, [v6]:port, or unix:/path."""
        return parse_url(self.url)[0]

    @property
    def uses_tls(self) -> bool:
        return parse_url(self.url)[1]

    @property
    def unix_socket(self) -> bool:
        return self.target.startswith("unix:")

    @property
    def host(self) -> str:
        """The server's host (what the data channel connects to, beside the gRPC port)."""
        return self.target.rsplit(":", 1)[0].strip("[]")


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


def _from_environment(name: str) -> str | None:
    if name == "token":
        return os.environ.get("TIERCACHE_TOKEN") or _read_token(os.environ.get("TIERCACHE_TOKEN_FILE"))
    return os.environ.get(_ENVIRONMENT[name]) if name in _ENVIRONMENT else None


def _read_token(path: str | None) -> str | None:
    if not path:
        return None
    return read_file(path, "token file", InvalidArgument).decode().strip() or None
