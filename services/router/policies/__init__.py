"""How the router picks one worker of a role: a `Policy` per role, built by name from one registry.

The registry holds names and import paths only, so `--policy`'s choices (config.py, `disagg up`) load nothing
but this module; a policy's module is imported when the router builds it. A new policy is its module and one
`register` line here; a policy kept outside the project is a module that calls `register`, named in
DISAGG_ROUTER_POLICY_MODULES (comma separated), which the router and `disagg up` import before reading the names.
"""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

from common.errors import InvalidConfig

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

_REGISTRY: dict[str, str | type] = {}
_imported_modules: set[str] = set()


def register(name: str, factory: str | type) -> None:
    """`factory` is a PolicyFactory, or "module:Class" naming one (imported when the policy is first built)."""
    _REGISTRY[name] = factory


def names() -> tuple[str, ...]:
    _import_listed_modules()
    return tuple(_REGISTRY)


def factory_of(name: str) -> PolicyFactory:
    _import_listed_modules()
    target = _REGISTRY.get(name)
    if target is None:
        raise InvalidConfig(f"--policy: unknown policy {name!r}; registered: {list(_REGISTRY)}")
    if isinstance(target, str):
        module, _, attr = target.partition(":")
        target = _REGISTRY[name] = getattr(importlib.import_module(module), attr)
    return target


def _import_listed_modules() -> None:
    for module in os.environ.get(MODULES_ENV, "").split(","):
        if module.strip() and module.strip() not in _imported_modules:
            _imported_modules.add(module.strip())
            importlib.import_module(module.strip())


def build(name: str, role: "Role", context: PolicyContext) -> Policy:
    return factory_of(name).for_role(role, context)


register("round_robin", "services.router.policies.round_robin:RoundRobin")
register("least_loaded", "services.router.policies.least_loaded:LeastLoaded")
register("kv_aware", "services.router.policies.kv_aware:KvAware")
