"""Optional TLS for every server and every channel between our processes, mutual TLS as an option.

One TlsConfig per process, set once at start-up (`configure`), so that every channel the process
opens (common.channels: router → workers, decode → prefill's TensorStore, clients) uses the same
credentials without passing them through each call site. Without a config everything is plaintext, which is
what loopback development and the tests use.

    --tls-cert / DISAGG_TLS_CERT    this process's certificate chain (PEM); with --tls-key, servers use TLS (the
                                    router's OpenAI-compatible HTTP door too: HTTPS)
    --tls-key  / DISAGG_TLS_KEY     its private key (PEM)
    --tls-ca   / DISAGG_TLS_CA      CA bundle that verifies peers; channels use TLS when it is set
    --tls-client-auth / DISAGG_TLS_CLIENT_AUTH=1   servers require a client certificate signed by the CA (mTLS)
"""
from __future__ import annotations

import argparse
import os
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import grpc

from common.errors import InvalidConfig

_ENV = {"cert": "DISAGG_TLS_CERT", "key": "DISAGG_TLS_KEY", "ca": "DISAGG_TLS_CA",
        "client_auth": "DISAGG_TLS_CLIENT_AUTH"}


@dataclass(frozen=True)
class TlsConfig:
    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None
    client_auth: bool = False

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise InvalidConfig("--tls-cert and --tls-key go together")
        if self.client_auth and (self.ca is None or self.cert is None):
            raise InvalidConfig("--tls-client-auth needs --tls-ca (to verify clients) and --tls-cert/--tls-key")
        for name in ("cert", "key", "ca"):
            path = getattr(self, name)
            if path is not None and not path.is_file():
                raise InvalidConfig(f"--tls-{name}: no such file {path}")

    @property
    def serves_tls(self) -> bool:
        return self.cert is not None

    @property
    def dials_tls(self) -> bool:
        return self.ca is not None

    def environment(self) -> dict[str, str]:
        """DISAGG_TLS_* for a child process (`disagg up`'s), so that it uses these settings."""
        values = {"cert": self.cert, "key": self.key, "ca": self.ca, "client_auth": "1" if self.client_auth else None}
        return {_ENV[name]: str(value) for name, value in values.items() if value is not None}

    def server_credentials(self) -> grpc.ServerCredentials:
        root = self.ca.read_bytes() if self.client_auth else None
        return grpc.ssl_server_credentials([(self.key.read_bytes(), self.cert.read_bytes())],
                                           root_certificates=root, require_client_auth=self.client_auth)

    def server_ssl_context(self) -> ssl.SSLContext:
        """The same certificate, and client-certificate rule, for an HTTP server (the router's OpenAI door)."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.cert, self.key)
        if self.client_auth:
            context.load_verify_locations(cafile=self.ca)
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def client_ssl_context(self) -> ssl.SSLContext:
        """For HTTPS clients (disagg bench, the health check): the CA verifies the server (the system's roots
        without one); our certificate is presented, for servers that require one."""
        context = ssl.create_default_context(cafile=self.ca)
        if self.cert is not None:
            context.load_cert_chain(self.cert, self.key)
        return context

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Verifies the server against the CA; presents our certificate too, for servers that require it."""
        own = (self.key.read_bytes(), self.cert.read_bytes()) if self.cert is not None else (None, None)
        return grpc.ssl_channel_credentials(root_certificates=self.ca.read_bytes(), private_key=own[0],
                                            certificate_chain=own[1])


_process_tls = TlsConfig()


def configure(config: TlsConfig) -> None:
    """Set this process's TLS settings (call once, before opening servers or channels)."""
    global _process_tls
    _process_tls = config


def current() -> TlsConfig:
    return _process_tls


def add_tls_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("TLS (off unless set; env DISAGG_TLS_*)")
    g.add_argument("--tls-cert", default=None, help="certificate chain (PEM) this process presents")
    g.add_argument("--tls-key", default=None, help="private key (PEM) of --tls-cert")
    g.add_argument("--tls-ca", default=None, help="CA bundle (PEM) that verifies the others")
    g.add_argument("--tls-client-auth", action="store_true", default=None,
                   help="servers require client certificates signed by --tls-ca (mutual TLS)")


def tls_from_args(args: argparse.Namespace, env: Mapping[str, str] = os.environ) -> TlsConfig:
    """Flags win over DISAGG_TLS_* variables."""
    def pick(name: str) -> str | None:
        value = getattr(args, f"tls_{name}", None)
        return value if value is not None else env.get(_ENV[name]) or None

    client_auth = pick("client_auth")
    return TlsConfig(
        cert=Path(pick("cert")) if pick("cert") else None, key=Path(pick("key")) if pick("key") else None,
        ca=Path(pick("ca")) if pick("ca") else None,
        client_auth=client_auth is True or str(client_auth).lower() in ("1", "true", "yes"),
    )
