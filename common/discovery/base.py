"""Where the workers are: a role → endpoints view that can change while the router runs."""
from __future__ import annotations

import abc
import enum
from typing import AsyncIterator


class Role(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    ENCODE = "encode"


class Discovery(abc.ABC):
    """A source of worker endpoints (host:port) per role.

    `endpoints` is the current view; `watch` yields the current view first and then every
    changed view, until the caller stops iterating (Consul's blocking queries fit this shape).
    """

    @abc.abstractmethod
    async def endpoints(self, role: Role) -> list[str]:
        ...

    @abc.abstractmethod
    def watch(self, role: Role) -> AsyncIterator[list[str]]:
        ...

    async def close(self) -> None:
        """Release connections to the discovery backend, if any."""
