"""Comments and docstrings under services/ and common/ say why the code is so, not when it was measured: no
YYYY-MM-DD date in any of them (the dated figures are docs/benchmarks/' run records)."""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
GENERATED = REPO_ROOT / "common" / "pb"


def _prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring of a Python file."""
    found = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                found.append((body[0].lineno, body[0].value.value))
    return found


def test_no_comment_or_docstring_in_the_source_carries_a_date():
    dated = []
    for top in ("services", "common"):
        for path in sorted((REPO_ROOT / top).rglob("*.py")):
            if GENERATED in path.parents:
                continue
            for line, text in _prose(path.read_text()):
                dated += [f"{path.relative_to(REPO_ROOT)}:{line}: {m.group(0)}" for m in DATE.finditer(text)]
    assert not dated, "say why, not when (the run records keep the dates):\n" + "\n".join(dated)


def test_the_check_finds_a_date_in_a_comment_and_a_docstring():
    source = 'def f():\n    """Faster (2026-11-28)."""\n    return 1  # measured 2026-12-01\n'
    assert [DATE.search(text).group(0) for _, text in sorted(_prose(source))] == ["2026-11-28", "2026-12-01"]
