"""The router's front doors: one adapter module per client protocol onto the same core (generation.Core), each
registered here by name (services/router/registry.py) and served by the router, which names none of them.

grpc.py serves disagg.v1.Generation, kserve.py KServe v2 / Triton's inference.GRPCInferenceService (both on the
router's gRPC port), openai.py OpenAI-compatible HTTP on --http-port. A new front door is its module, defining a
`FrontDoor`, and one `register` line here; one kept outside the project is a module that calls `register`, named in
DISAGG_ROUTER_FRONTEND_MODULES (comma separated), which the router imports before reading the names.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Awaitable, Callable, Protocol

from services.router.registry import Registry

if TYPE_CHECKING:
    import grpc

    from common.telemetry.metrics import Metrics
    from services.router.config import RouterConfig
    from services.router.generation import Core


class Listener(Protocol):
    """A front door's own server (not the router's gRPC port), started by FrontDoor.start."""

    def banner(self, host: str) -> str:
        """What the router prints once it serves, after `disagg-router `: the protocol and its address on `host`."""

    async def stop(self) -> None: ...


@dataclass(frozen=True)
class FrontDoor:
    """What a front door serves: gRPC services on the router's port (added by `add_to_server`; their full names,
    for health and reflection, in `grpc_services`), a listener of its own (`start`, given the process's metrics, None
    where there are none; it returns None when the config turns it off), or both, and a `warm_up` of its own.
    `health_methods`: its gRPC methods ("/package.Service/Method") that report health, which an API key guards only
    with --api-key-protects-health."""

    grpc_services: tuple[str, ...] = ()
    add_to_server: "Callable[[grpc.aio.Server, Core], None] | None" = None
    start: "Callable[[Core, RouterConfig, Metrics | None], Awaitable[Listener | None]] | None" = None
    health_methods: tuple[str, ...] = ()
    # Requests the door sends through itself before the router says SERVING, on the core given (the router's
    # warm-up core: no metrics), so the first client request finds its protocol's code paths warm.
    warm_up: "Callable[[Core, RouterConfig], Awaitable[None]] | None" = None


MODULES_ENV = "DISAGG_ROUTER_FRONTEND_MODULES"

_REGISTRY: Registry[FrontDoor] = Registry(MODULES_ENV)


def register(name: str, door: str | FrontDoor) -> None:
    """`door` is a FrontDoor, or "module:attr" naming one (imported when the router starts)."""
    _REGISTRY.register(name, door)


def names() -> tuple[str, ...]:
    return _REGISTRY.names()


def doors() -> list[FrontDoor]:
    """Every registered front door, in the order registered."""
    return [_REGISTRY.get(name) for name in names()]


register("generation", "services.router.frontends.grpc:FRONT_DOOR")
register("kserve", "services.router.frontends.kserve:FRONT_DOOR")
register("openai", "services.router.frontends.openai:FRONT_DOOR")
