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
    stays on xgrammar, which alone has structural tags. What sets it: issue #56's structured_output bench on one H200
    (3B shape, xgrammar 0.2.8), where strings under maxLength 24 ran at 0.526x the unconstrained tok/s against 0.989x
    for plain strings, xgrammar filling each position of a bounded string token by token (mlc-ai/xgrammar#852); and
    llguidance compiling every such schema faster. Both libraries' compile and fill times on the CPU are in
    docs/benchmarks/structured_output_backends.md."""
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
