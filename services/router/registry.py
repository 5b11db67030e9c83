"""Off the request path: named variants of one kind (routing policies, front doors), registered by name in one table
each.

An entry is the variant itself or "module:attr" naming it, imported when it is first looked up, so listing the names
(a flag's choices) loads nothing but the registry. A variant kept outside the project is a module that registers it,
named in the kind's environment variable (comma separated), which is imported before the names are read.
"""
from __future__ import annotations

import importlib
import os
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, modules_env: str):
        self.modules_env = modules_env
        self._entries: dict[str, str | T] = {}
        self._imported_modules: set[str] = set()

    def register(self, name: str, target: str | T) -> None:
        """`target` is the variant, or "module:attr" naming it."""
        self._entries[name] = target

    def names(self) -> tuple[str, ...]:
        self._import_listed_modules()
        return tuple(self._entries)

    def get(self, name: str) -> T | None:
        """The variant registered as `name` (imported now if named by path); None when there is none."""
        self._import_listed_modules()
        target = self._entries.get(name)
        if isinstance(target, str):
            module, _, attr = target.partition(":")
            target = self._entries[name] = getattr(importlib.import_module(module), attr)
        return target

    def _import_listed_modules(self) -> None:
        for module in os.environ.get(self.modules_env, "").split(","):
            if module.strip() and module.strip() not in self._imported_modules:
                self._imported_modules.add(module.strip())
                importlib.import_module(module.strip())
