"""--structured-output-backend auto: which grammar library compiles a grammar first (the other is its fallback)."""
from __future__ import annotations

import json
from typing import Any

from common.engine.structured import JSON_SCHEMA, SCHEMA_LISTS, SCHEMA_MAPS, SCHEMA_ONES, StructuredOutput

# An array bound from which a schema goes to llguidance (docs/benchmarks/structured_output_backends.md).
MANY_ITEMS = 16


def prefers_guidance(structured: StructuredOutput) -> bool:
    """The one rule of `auto`: a JSON schema with an array bound (minItems, maxItems) of MANY_ITEMS or more goes to
    llguidance, which compiles and fills it faster; every other grammar stays on xgrammar, which alone has
    structural tags. Bounded strings stay there too: xgrammar from 0.2.9 fills their masks at the full rate on a GPU
    while llguidance's, though faster than 0.2.8's (mlc-ai/xgrammar#852), cost a third of the output rate; a
    `pattern` fills faster on xgrammar as well. The figures are in docs/benchmarks/structured_output_backends.md."""
    if structured.kind != JSON_SCHEMA:
        return False
    return _large_array(json.loads(structured.spec))


def backend_order(setting: str, structured: StructuredOutput) -> tuple[str, str]:
    """The backends to try, in order, under `setting` (--structured-output-backend)."""
    first = setting if setting != "auto" else "guidance" if prefers_guidance(structured) else "xgrammar"
    return (first, "xgrammar" if first == "guidance" else "guidance")


def _large_array(node: Any) -> bool:
    if not isinstance(node, dict):
        return False
    if any(isinstance(node.get(key), int) and node[key] >= MANY_ITEMS for key in ("minItems", "maxItems")):
        return True
    subs = [sub for key in SCHEMA_MAPS if isinstance(node.get(key), dict) for sub in node[key].values()]
    for key in SCHEMA_LISTS + SCHEMA_ONES:
        subs += node[key] if isinstance(node.get(key), list) else [node.get(key)]
    return any(_large_array(sub) for sub in subs)
