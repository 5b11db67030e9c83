"""Static discovery: endpoints given by flags or env, fixed for the life of the process."""
from __future__ import annotations

import asyncio
import os
from typing import AsyncIterator, Mapping

from common.discovery.base import Discovery, Role
from common.errors import InvalidConfig

ENV_VARS = {Role.PREFILL: "DISAGG_PREFILL_WORKERS", Role.DECODE: "DISAGG_DECODE_WORKERS",
            Role.ENCODE: "DISAGG_ENCODE_WORKERS"}


def parse_endpoints(value: str | None, source: str) -> list[str]:
    """'host:port,host:port' → ['host:port', ...]; `source` names the flag or env var in errors."""
    endpoints: list[str] = []
    for item in (value or "").split(","):
        item = item.strip()
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidConfig(f"{source}: expected host:port with a port in [1, 65535], got {item!r}")
        if item not in endpoints:
            endpoints.append(item)
    return endpoints


class StaticDiscovery(Discovery):
    def __init__(self, endpoints: Mapping[Role, list[str]]):
        self._endpoints = {role: list(endpoints.get(role, [])) for role in Role}

    @classmethod
    def from_flags(cls, flags: Mapping[Role, str | None], env: Mapping[str, str] = os.environ) -> "StaticDiscovery":
        """A flag wins over its env var (DISAGG_PREFILL_WORKERS, DISAGG_DECODE_WORKERS, ...)."""
        endpoints = {}
        for role, var in ENV_VARS.items():
            flag = flags.get(role)
            flag_name = f"--{role.value}-workers"
            endpoints[role] = (parse_endpoints(flag, flag_name) if flag is not None
                               else parse_endpoints(env.get(var), f"env {var}"))
        return cls(endpoints)

    async def endpoints(self, role: Role) -> list[str]:
        return list(self._endpoints[role])

    async def watch(self, role: Role) -> AsyncIterator[list[str]]:
        yield list(self._endpoints[role])
        await asyncio.Event().wait()  # a static view never changes
