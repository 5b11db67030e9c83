"""The docs: the site builds with `mkdocs build --strict` (a broken link, an anchor that is not there or a page
missing from the nav fails it), and the README stays a front page: short, undated, every command in it covered."""
from __future__ import annotations

import re

from tests.readme_blocks import README, REPO_ROOT, blocks, commands

MAX_README_LINES = 200
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
COMMIT = re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")
TEST_COMMAND = "python3 -m pytest -q"


# Every README command that tests/integration/test_readme.py does not run itself, and what runs it: a file under the
# repository (a glob) that holds the string.
COVERED_ELSEWHERE = {
    "bash deploy/install.sh": (".ci/run", "bash deploy/install.sh"),
    TEST_COMMAND: (".ci/run", TEST_COMMAND),
    "python3 -m pytest -q -m 'not slow'": ("pyproject.toml", '"slow: '),
    "disagg run": ("tests/**/*.py", '"services", "run"'),
    "disagg up": ("tests/**/*.py", '"services", "up"'),
    "cd deploy/compose": ("deploy/compose/docker-compose.yml", "services:"),
    "docker compose up --build -d --wait": ("tests/**/test_compose_docker.py", '"--wait"'),
    "docker compose up -d --scale decode=2": ("tests/**/test_compose_docker.py", '"--scale", "decode=2"'),
    "docker compose down": ("tests/**/test_compose_docker.py", '"down", "--remove-orphans"'),
}
RUN_BY_TEST_README = ("curl ", "grpcurl ")  # tests/integration/test_readme.py runs these, and every python block


def test_mkdocs_build_strict_passes(tmp_path, monkeypatch):
    monkeypatch.setenv("NO_MKDOCS_2_WARNING", "1")
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    # strict: a warning (a broken link, a missing anchor, a page out of the nav) aborts the build
    build(load_config(str(REPO_ROOT / "mkdocs.yml"), site_dir=str(tmp_path / "site"), strict=True))
    assert (tmp_path / "site" / "index.html").is_file()


def test_every_docs_page_is_in_the_nav():
    nav = (REPO_ROOT / "mkdocs.yml").read_text()
    pages = sorted(str(p.relative_to(REPO_ROOT / "docs")) for p in (REPO_ROOT / "docs").rglob("*.md"))
    assert [p for p in pages if p not in nav] == []


def test_readme_is_short_and_undated():
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_README_LINES
    assert DATE.findall(text) == []
    assert COMMIT.findall(text) == []


def test_readme_links_point_at_files_that_exist():
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    assert links
    assert [link for link in links if "://" not in link and not (REPO_ROOT / link).exists()] == []


def test_readme_test_command_is_the_one_ci_runs():
    assert TEST_COMMAND in README.read_text()
    assert TEST_COMMAND in (REPO_ROOT / ".ci" / "run").read_text().splitlines()


def test_every_readme_command_is_run_by_a_test():
    shell = [c for b in blocks() if b.language == "bash" for c in commands(b)]
    assert any(c.startswith("curl ") for c in shell) and any(c.startswith("grpcurl ") for c in shell)
    assert any(b.language == "python" for b in blocks())
    uncovered = []
    for command in shell:
        if command.startswith(RUN_BY_TEST_README):
            continue
        prefix = max((p for p in COVERED_ELSEWHERE if command == p or command.startswith(p + " ")), key=len,
                     default=None)
        if prefix is None:
            uncovered.append(command)
            continue
        pattern, needle = COVERED_ELSEWHERE[prefix]
        holders = [p for p in REPO_ROOT.glob(pattern) if needle in p.read_text(errors="replace")]
        assert holders, f"{command!r}: nothing in {pattern} holds {needle!r}"
    assert uncovered == [], "README commands no test runs: add them to tests/integration/test_readme.py"
