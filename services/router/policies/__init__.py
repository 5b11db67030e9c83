"""How the router picks one worker of a role: a `Policy` per role, built by name from one registry.

The registry (services/router/registry.py) holds names and import paths only, so `--policy`'s choices (config.py,
`disagg up`) load nothing but this module and the registry; a policy's module is imported when the router builds it.
A new policy is its module and one `register` line here; a policy kept outside the project is a module that calls
`register`, named in DISAGG_ROUTER_POLICY_MODULES (comma separated), which the router and `disagg up` import before
reading the names.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

from common.errors import InvalidConfig
from services.router.registry import Registry

if TYPE_CHECKING:
    from common.discovery import Role
    from services.router.kv_index import KvIndex
    from services.router.workers import WorkerClient


@dataclass(frozen=True)
class PolicyContext:
    """What a policy may be built from: the KV index (when its factory asks for one) and the router's weights."""
    kv_index: "KvIndex | None" = None
    kv_overlap_weight: float = 1.0
    kv_load_weight: float = 1.0


class Policy(Protocol):
    async def pick(self, workers: "list[WorkerClient]", prompt: list[int] | None = None) -> "WorkerClient":
        """One of `workers` (never empty); `prompt` is the request's token ids, for policies that use it."""

    def cached_tokens(self, worker: "WorkerClient", prompt: list[int]) -> int | None:
        """The prompt tokens the worker's prefix cache holds as far as this policy knows; None: it does not
        predict (the router then assumes none are cached)."""


class PolicyFactory(Protocol):
    needs_kv_index: ClassVar[bool]
    """The router follows every worker's KV events (a KvIndex in PolicyContext) only for a policy that says so."""

    @classmethod
    def for_role(cls, role: "Role", context: PolicyContext) -> Policy:
        """The policy that picks workers of `role` (a policy may hand roles it does not route to another)."""


MODULES_ENV = "DISAGG_ROUTER_POLICY_MODULES"

_REGISTRY: Registry[PolicyFactory] = Registry(MODULES_ENV)


def register(name: str, factory: str | type) -> None:
    """`factory` is a PolicyFactory, or "module:Class" naming one (imported when the policy is first built)."""
    _REGISTRY.register(name, factory)


def names() -> tuple[str, ...]:
    return _REGISTRY.names()


def factory_of(name: str) -> PolicyFactory:
    factory = _REGISTRY.get(name)
    if factory is None:
        raise InvalidConfig(f"--policy: unknown policy {name!r}; registered: {list(_REGISTRY.names())}")
    return factory


def build(name: str, role: "Role", context: PolicyContext) -> Policy:
    return factory_of(name).for_role(role, context)


BUILT_IN = {"round_robin": "services.router.policies.round_robin:RoundRobin",
            "least_loaded": "services.router.policies.least_loaded:LeastLoaded",
            "kv_aware": "services.router.policies.kv_aware:KvAware"}
for _name, _factory in BUILT_IN.items():
    register(_name, _factory)
