"""--structured-output-backend auto: which grammar library compiles a grammar first (the other is its fallback)."""
from __future__ import annotations

import json
from typing import Any

from common.engine.structured import JSON_SCHEMA, SCHEMA_LISTS, SCHEMA_MAPS, SCHEMA_ONES, StructuredOutput

# An array bound from which a schema goes to llguidance (docs/benchmarks/structured_output_backends.md).
MANY_ITEMS = 16
_BOUNDED_STRING = ("maxLength", "minLength", "pattern")


def prefers_guidance(structured: StructuredOutput) -> bool:
    """The one rule of `auto`: a JSON schema with a string bounded in length (maxLength, minLength) or by a
    `pattern`, or an array bound (minItems, maxItems) of MANY_ITEMS or more, goes to llguidance; every other grammar
    stays on xgrammar, which alone has structural tags. Why: xgrammar fills each position of a bounded string token by
    token (mlc-ai/xgrammar#852), so a schema of short bounded strings generates at about half the unconstrained rate
    there while plain strings run at nearly the full one, and llguidance compiles every such schema faster. The
    figures of both libraries are in docs/benchmarks/."""
    if structured.kind != JSON_SCHEMA:
        return False
    return _bounded(json.loads(structured.spec))


def backend_order(setting: str, structured: StructuredOutput) -> tuple[str, str]:
    """The backends to try, in order, under `setting` (--structured-output-backend)."""
    first = setting if setting != "auto" else "guidance" if prefers_guidance(structured) else "xgrammar"
    return (first, "xgrammar" if first == "guidance" else "guidance")


def _bounded(node: Any) -> bool:
    if not isinstance(node, dict):
        return False
    if any(key in node for key in _BOUNDED_STRING):
        return True
    if any(isinstance(node.get(key), int) and node[key] >= MANY_ITEMS for key in ("minItems", "maxItems")):
        return True
    subs = [sub for key in SCHEMA_MAPS if isinstance(node.get(key), dict) for sub in node[key].values()]
    for key in SCHEMA_LISTS + SCHEMA_ONES:
        subs += node[key] if isinstance(node.get(key), list) else [node.get(key)]
    return any(_bounded(sub) for sub in subs)
