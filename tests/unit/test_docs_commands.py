"""Every `disagg ...` and `python -m services.* / benchmarks.*` command in the docs' shell blocks is one its program
takes: each is handed to its own command line parser (the real one: the module's main, with argparse stopped the
moment it has parsed), so a renamed or removed flag, a bad value or a module that moved fails here instead of in a
reader's terminal. Running them is for the tests that start processes; most need a GPU, a cluster or minutes."""
from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import inspect
import io
import shlex
from pathlib import Path

import pytest

from services.cli.main import SUBCOMMANDS
from tests.readme_blocks import REPO_ROOT, blocks, commands

DOCS = sorted((REPO_ROOT / "docs").glob("**/*.md")) + [REPO_ROOT / "README.md"]
# Placeholders the docs use for what a reader fills in (a value, never a flag).
SHELL_NOISE = {"&", "\\"}


class Parsed(Exception):
    """Raised in place of returning from parse_args: the command line was taken; nothing runs."""


def doc_commands() -> list[tuple[str, list[str]]]:
    """(where, argv) of every command in the docs that names one of ours: `disagg SUB ...` as the module SUB runs,
    `python -m MODULE ...` for our packages."""
    found = []
    for page in DOCS:
        for block in blocks(page):
            if block.language not in ("bash", "sh", "console", "shell"):
                continue
            for command in commands(block):
                words = [w for w in shlex.split(command) if w not in SHELL_NOISE]
                for cut in ("|", ">", "2>&1"):  # what a shell does with the output is not the command's
                    words = words[:words.index(cut)] if cut in words else words
                where = f"{page.relative_to(REPO_ROOT)}: {command[:80]}"
                if len(words) >= 2 and words[0] == "disagg" and words[1] in SUBCOMMANDS:
                    found.append((where, [SUBCOMMANDS[words[1]][0], *words[2:]]))
                elif len(words) >= 3 and words[0] in ("python", "python3") and words[1] == "-m" and \
                        words[2].split(".")[0] in ("services", "benchmarks"):
                    found.append((where, [words[2], *words[3:]]))
    return found


COMMANDS = doc_commands()


def test_the_docs_hold_commands_of_ours():
    assert len(COMMANDS) >= 20 and any(argv[0] == "services.cli.up" for _, argv in COMMANDS)


@pytest.mark.parametrize("where, argv", COMMANDS, ids=[where for where, _ in COMMANDS])
def test_a_docs_command_is_one_its_program_takes(where, argv, monkeypatch):
    refusal = refused(argv, monkeypatch)
    assert refusal is None, f"{where}: {refusal}"


def test_a_flag_its_program_does_not_have_is_refused(monkeypatch):
    assert "unrecognized arguments: --no-such-flag" in refused(["services.cli.up", "--no-such-flag"], monkeypatch)
    assert "invalid int value" in refused(["services.router.__main__", "--port", "many"], monkeypatch)
    assert refused(["benchmarks.no_such_bench"], monkeypatch) == "no module benchmarks.no_such_bench"
    assert refused(["services.cli.up", "--prefill", "0"], monkeypatch) is None


def refused(argv: list[str], monkeypatch) -> str | None:
    """Why the program `argv` names (module, then its arguments) refuses them, or None once its parser took them."""
    module_name, *args = argv
    spec = importlib.util.find_spec(module_name)
    if spec is None:
        return f"no module {module_name}"
    if spec.submodule_search_locations is not None:  # a package: `python -m` runs its __main__
        module_name += ".__main__"
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise Parsed(original(self, args, namespace))

    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
        patch.setattr("sys.argv", [module_name, *args])
        main = getattr(importlib.import_module(module_name), "main", None)
        if main is None:
            return f"{module_name} has no main()"
        errors = io.StringIO()
        try:
            with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
                main(args) if inspect.signature(main).parameters else main()
        except Parsed:
            return None
        except SystemExit as exit_:  # argparse refused them (its message on stderr)
            return errors.getvalue().strip() or f"exited {exit_.code}"
    return "its main() returned without parsing a command line"
