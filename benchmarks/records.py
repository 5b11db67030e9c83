"""Build the benchmark pages from their run records: `python -m benchmarks.records`.

Each page `docs/benchmarks/<page>.md` is written from `docs/benchmarks/<page>.json`, which keeps every dated run of
that workload, oldest first (a new run is appended). The page gives the title, what it measures, the command, the
latest run's figures and then the earlier runs, newest first, each under its date and machine. A run's body is a
list of blocks: `text` (markdown), `table` (columns and rows, as the run reported them), `plot` (a PNG beside the
page) and `code`; its `logs` and `data` name the files beside the page that it wrote.

`--check` builds every page in memory and exits 1, naming the pages that differ from their record and every problem
found in a record (a missing field, a date that is not ISO, a row not as long as its columns, a file that is not
there), without writing anything.
"""
from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks"
INDEX = "index.md"
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
BLOCK_KINDS = ("text", "table", "plot", "code")


@dataclass(frozen=True)
class Run:
    date: str
    machine: str
    body: list[dict]
    time: str = ""
    label: str = ""
    build: str = ""
    logs: list[dict] = field(default_factory=list)
    data: list[str] = field(default_factory=list)

    @property
    def heading(self) -> str:
        when = f"{self.date} ({self.time})" if self.time else self.date
        return f"{when}, {self.machine}" + (f": {self.label}" if self.label else "")


@dataclass(frozen=True)
class Record:
    page: str
    title: str
    measures: str
    commands: list[dict]
    runs: list[Run]


def load(path: Path) -> Record:
    raw = json.loads(path.read_text())
    runs = [Run(**run) for run in raw["runs"]]
    return Record(path.stem, raw["title"], raw["measures"], raw["commands"], runs)


def record_paths(docs: Path = DOCS) -> list[Path]:
    """The record of every page but the index."""
    return [docs / f"{page.stem}.json" for page in sorted(docs.glob("*.md")) if page.name != INDEX]


def _table(table: dict) -> str:
    lines = [table["columns"], ["---"] * len(table["columns"]), *table["rows"]]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)


def _block(block: dict) -> str:
    if "text" in block:
        return block["text"]
    if "table" in block:
        return _table(block["table"])
    if "plot" in block:
        return f"![{block.get('alt', '')}]({block['plot']})"
    return f"```{block.get('lang', '')}\n{block['code']}\n```"


def _files(label: str, links: list[str]) -> str:
    return f"{label}: " + ", ".join(links) + "."


def _run(run: Run, level: str) -> str:
    parts = [f"{level} {run.heading}"]
    if run.build:
        parts.append(f"Build: {run.build}")
    parts += [_block(block) for block in run.body]
    if run.logs:
        parts.append(_files("Logs", [f"[{log['label']}]({log['file']})" for log in run.logs]))
    if run.data:
        parts.append(_files("Data", [f"[{name}]({name})" for name in run.data]))
    return "\n\n".join(parts)


def render(record: Record) -> str:
    parts = [f"# {record.title}",
             f"<!-- Built by `python -m benchmarks.records` from {record.page}.json: edit the record, not this page. -->",
             f"What it measures: {record.measures}"]
    for command in record.commands:
        parts.append(f"{command['intro']}:\n\n```bash\n" + "\n".join(command["lines"]) + "\n```")
    latest, *earlier = reversed(record.runs)
    parts.append(_run(latest, "## Latest run:"))
    if earlier:
        parts.append("## Earlier runs")
        parts += [_run(run, "###") for run in earlier]
    return "\n\n".join(parts) + "\n"


def _iso(date: str) -> bool:
    try:
        return datetime.date.fromisoformat(date).isoformat() == date
    except ValueError:
        return False


def files_of(run: Run) -> list[str]:
    """The files beside the page that a run names: its logs, its data, its plots and the files its text links."""
    links = [link for block in run.body for link in LINK.findall(_block(block))
             if "://" not in link and not link.startswith("../")]
    return [log["file"] for log in run.logs] + run.data + [b["plot"] for b in run.body if "plot" in b] + links


def _problems_of_run(run: Run, where: str, docs: Path) -> list[str]:
    problems = [] if _iso(run.date) else [f"{where}: date {run.date!r} is not YYYY-MM-DD"]
    if not run.machine or not run.body:
        problems.append(f"{where}: a run needs a machine and a body")
    for i, block in enumerate(run.body):
        kinds = [kind for kind in BLOCK_KINDS if kind in block]
        if len(kinds) != 1:
            problems.append(f"{where}, block {i}: one of {BLOCK_KINDS}, not {sorted(block)}")
            return problems
        if "table" in block:
            width = len(block["table"]["columns"])
            problems += [f"{where}, block {i}, row {j}: {len(row)} cells for {width} columns"
                         for j, row in enumerate(block["table"]["rows"]) if len(row) != width]
    return problems + [f"{where}: {name} is not in {docs.name}/" for name in files_of(run)
                       if not (docs / name).is_file()]


def problems(path: Path) -> list[str]:
    """What is wrong with one record: missing fields, dates, table shapes, files it names that are not there."""
    if not path.is_file():
        return [f"{path.name}: no record for {path.stem}.md"]
    try:
        record = load(path)
    except (ValueError, KeyError, TypeError) as error:
        return [f"{path.name}: {error!r}"]
    found = [f"{path.name}: {key} is empty" for key in ("title", "measures", "commands", "runs")
             if not getattr(record, key)]
    found += [f"{path.name}: a command needs an intro and lines" for command in record.commands
              if not command.get("intro") or not command.get("lines")]
    for i, run in enumerate(record.runs):
        found += _problems_of_run(run, f"{path.name}, run {i} ({run.date})", path.parent)
    dates = [run.date for run in record.runs]
    if dates != sorted(dates):
        found.append(f"{path.name}: runs are not oldest first: {dates}")
    return found


def stale(docs: Path = DOCS) -> list[str]:
    """The pages that differ from what their records build, and every problem of a record."""
    found = []
    for path in record_paths(docs):
        record_problems = problems(path)
        found += record_problems
        page = path.with_suffix(".md")
        if not record_problems and page.read_text() != render(load(path)):
            found.append(f"{page.name}: differs from what {path.name} builds")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="report stale pages and bad records, write nothing")
    args = parser.parse_args(argv)
    if args.check:
        found = stale()
        print("\n".join(found) or "every page matches its record")
        return 1 if found else 0
    bad = [problem for path in record_paths() for problem in problems(path)]
    if bad:
        print("\n".join(bad))
        return 1
    for path in record_paths():
        path.with_suffix(".md").write_text(render(load(path)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
