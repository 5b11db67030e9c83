"""The README's fenced code blocks and the shell commands in them (tests/unit/test_docs.py and
tests/integration/test_readme.py read them)."""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
README = REPO_ROOT / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)


@dataclass(frozen=True)
class Block:
    language: str  # what follows the opening fence: bash, python, or "" for a picture or output
    text: str


def blocks(path: Path = README) -> list[Block]:
    return [Block(language, text) for language, text in FENCE.findall(path.read_text())]


def commands(block: Block) -> list[str]:
    """A shell block's commands, one a string: continuation lines joined, a quote left open carried on to the
    lines that close it, comments dropped."""
    found, pending = [], ""
    for line in block.text.splitlines():
        pending = f"{pending}\n{line}" if pending else line
        if pending.endswith("\\"):
            pending = pending[:-1]
            continue
        try:
            words = shlex.split(pending, comments=True)
        except ValueError:  # an open quote: the command goes on
            continue
        while words:  # `a && b` is two commands
            cut = words.index("&&") if "&&" in words else len(words)
            found.append(shlex.join(words[:cut]))
            words = words[cut + 1:]
        pending = ""
    assert not pending, f"an unfinished command in the README: {pending!r}"
    return found
