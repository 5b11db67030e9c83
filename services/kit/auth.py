"""API keys for a shared deployment: which the router accepts, how a client presents one, and the flags of both.

The router's public doors (OpenAI HTTP, disagg.v1 and KServe v2 over gRPC) require a key once one is set:

    --api-key KEY (repeatable) / DISAGG_API_KEY (one key, or several separated by commas)
    --api-key-file PATH / DISAGG_API_KEY_FILE   one key a line (blank lines and lines starting with # skipped)
    --api-key-protects-health                   health, readiness, /metrics and reflection need a key too

A client presents it as `Authorization: Bearer KEY` (an HTTP header, or gRPC metadata `authorization`), or as gRPC
metadata `x-api-key: KEY`. Keys are compared as SHA-256 digests with hmac.compare_digest, against every key, so
the time taken says nothing of a key's bytes or of which key matched. No key is ever logged or printed.
"""
from __future__ import annotations

import argparse
import hashlib
import hmac
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from common.errors import InvalidConfig

KEY_ENV = "DISAGG_API_KEY"
KEY_FILE_ENV = "DISAGG_API_KEY_FILE"
AUTHORIZATION = "authorization"
X_API_KEY = "x-api-key"
MISSING = ("this server requires an API key: send 'Authorization: Bearer <key>' (gRPC: metadata 'authorization: "
           "Bearer <key>' or 'x-api-key: <key>')")
WRONG = "the API key is not valid on this server"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


@dataclass(frozen=True)
class ApiKeys:
    """The keys a server accepts (none: every request is served); only their digests are kept."""

    digests: tuple[bytes, ...] = field(default=(), repr=False)
    protects_health: bool = False

    def __post_init__(self) -> None:
        if self.protects_health and not self.digests:
            raise InvalidConfig("--api-key-protects-health needs a key (--api-key, --api-key-file or DISAGG_API_KEY)")

    @classmethod
    def of(cls, keys: list[str], protects_health: bool = False) -> "ApiKeys":
        for key in keys:
            if not key or any(c.isspace() or c == "," for c in key):
                raise InvalidConfig("an API key must be non-empty, without spaces or commas")
        return cls(tuple(dict.fromkeys(_digest(key) for key in keys)), protects_health)

    @property
    def required(self) -> bool:
        return bool(self.digests)

    def guards(self, is_health: bool) -> bool:
        """Whether a request to an endpoint (health / readiness / metrics / reflection, or not) needs a key."""
        return self.required and (self.protects_health or not is_health)

    def refusal(self, presented: str | None) -> str | None:
        """None when `presented` is one of the keys (or none is required); else why it is refused (no key in it)."""
        if not self.required:
            return None
        if not presented:
            return MISSING
        digest = _digest(presented)
        matched = False
        for accepted in self.digests:  # every one, whatever matched first
            matched |= hmac.compare_digest(digest, accepted)
        return None if matched else WRONG


def presented_key(authorization: str | None, x_api_key: str | None = None) -> str | None:
    """The key a request carries: `Authorization: Bearer KEY` (the scheme in any case), else `x-api-key`."""
    if authorization:
        scheme, _, credential = authorization.strip().partition(" ")
        if scheme.lower() == "bearer" and credential.strip():
            return credential.strip()
        return None
    return x_api_key.strip() if x_api_key else None


def read_key_file(path: Path) -> list[str]:
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise InvalidConfig(f"--api-key-file {path}: {exc.strerror or exc}") from None
    keys = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
    if not keys:
        raise InvalidConfig(f"--api-key-file {path} holds no key (one a line)")
    return keys


def add_api_key_args(parser: argparse.ArgumentParser) -> None:
    """The server's flags (the router's, and `disagg up`'s, which hands them to its router)."""
    g = parser.add_argument_group(f"API keys (off unless set; env {KEY_ENV}, {KEY_FILE_ENV})")
    g.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="clients send 'Bearer KEY' (repeatable)")
    g.add_argument("--api-key-file", default=None, metavar="PATH", help="a file of keys, one a line")
    g.add_argument("--api-key-protects-health", action="store_true",
                   help="health and readiness (HTTP /health, grpc.health.v1, KServe ServerLive/Ready), /metrics "
                        "and gRPC reflection need a key too (default: open, for probes and scrapers)")


def keys_from_args(args: argparse.Namespace, env: Mapping[str, str] = os.environ) -> list[str]:
    """Every key the flags and the environment give: --api-key and the file; each flag's variable where it is
    not given."""
    keys = list(getattr(args, "api_key", None) or [k.strip() for k in env.get(KEY_ENV, "").split(",") if k.strip()])
    path = getattr(args, "api_key_file", None) or env.get(KEY_FILE_ENV)
    return keys + (read_key_file(Path(path)) if path else [])


def api_keys_from_args(args: argparse.Namespace, env: Mapping[str, str] = os.environ) -> ApiKeys:
    return ApiKeys.of(keys_from_args(args, env), bool(getattr(args, "api_key_protects_health", False)))


def add_client_api_key_arg(parser: argparse.ArgumentParser) -> None:
    """A client's flag (`disagg generate`, `wait`, `bench`)."""
    parser.add_argument("--api-key", default=None,
                        help=f"the router's API key, sent as 'Authorization: Bearer KEY' (default: the first key of "
                             f"{KEY_ENV} or {KEY_FILE_ENV})")


def client_key(args: argparse.Namespace, env: Mapping[str, str] = os.environ) -> str | None:
    """--api-key, else the first key the environment gives the server (DISAGG_API_KEY, DISAGG_API_KEY_FILE): a
    client run beside its router (a container's health check) presents the router's own key."""
    if getattr(args, "api_key", None):
        return args.api_key
    listed = keys_from_args(argparse.Namespace(), env)
    return listed[0] if listed else None


def grpc_metadata(key: str | None) -> tuple[tuple[str, str], ...]:
    return ((AUTHORIZATION, f"Bearer {key}"),) if key else ()


def http_headers(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}
