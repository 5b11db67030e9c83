"""--structured-output-backend: the grammar libraries to try for a grammar, in order (the second is the fallback)."""
from __future__ import annotations

# `auto`'s order. xgrammar first: from 0.2.9 it fills every mask measured (plain and length-bounded strings, large
# arrays) at the full output rate on a GPU, where llguidance's bounded strings cost a third of it, and it alone has
# structural tags; llguidance compiles what xgrammar refuses (docs/benchmarks/structured_output_backends.md).
AUTO_ORDER = ("xgrammar", "guidance")


def backend_order(setting: str) -> tuple[str, str]:
    """The backends to try, in order, under `setting`: the one named, then the other; `auto`: AUTO_ORDER."""
    if setting == "auto":
        return AUTO_ORDER
    return (setting, next(name for name in AUTO_ORDER if name != setting))
