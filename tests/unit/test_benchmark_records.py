"""The benchmark pages are built from their run records (docs/benchmarks/<page>.json, `python -m benchmarks.records`):
a page edited by hand, or a record changed without rebuilding its page, fails here as stale generated code does."""
from __future__ import annotations

import json
import re

from benchmarks import records

DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
COMMIT = re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def test_every_benchmark_page_is_what_its_record_builds():
    assert records.stale() == [], "edit the record and run `python -m benchmarks.records`"


def test_every_file_beside_the_pages_belongs_to_a_run():
    pages = {path.with_suffix(".md").name for path in records.record_paths()} | {records.INDEX}
    own = {path.name for path in records.record_paths()} | pages
    named = {name for path in records.record_paths() for run in records.load(path).runs
             for name in records.files_of(run)}
    beside = {path.name for path in records.DOCS.iterdir() if path.is_file()}
    assert sorted(beside - own - named) == []


def test_the_docs_outside_the_run_records_carry_no_date_or_commit():
    """History lives in the records and in git: a page's prose states what is, not when it was measured (code blocks,
    which show what a command prints, are left out)."""
    found = []
    for page in sorted((records.DOCS.parent).glob("*.md")):
        prose = FENCE.sub("", page.read_text())
        found += [f"{page.name}: {match}" for match in DATE.findall(prose) + COMMIT.findall(prose)]
    assert found == []


def _record(**run_fields) -> dict:
    run = {"date": "2026-01-02", "machine": "one CPU", "body": [{"text": "figures"}], **run_fields}
    return {"title": "T", "measures": "m", "commands": [{"intro": "Command", "lines": ["python -m x"]}], "runs": [run]}


def test_the_check_names_a_bad_date_a_short_row_and_a_missing_file(tmp_path):
    body = [{"table": {"columns": ["a", "b"], "rows": [["1"]]}}, {"plot": "gone.png", "alt": ""}]
    (tmp_path / "page.json").write_text(json.dumps(_record(date="2026-1-2", body=body)))
    (tmp_path / "page.md").write_text("")
    found = "\n".join(records.stale(tmp_path))
    assert "'2026-1-2' is not YYYY-MM-DD" in found
    assert "row 0: 1 cells for 2 columns" in found
    assert "gone.png is not in" in found


def test_a_page_that_differs_from_its_record_is_named_and_a_missing_field_too(tmp_path):
    (tmp_path / "good.json").write_text(json.dumps(_record()))
    (tmp_path / "good.md").write_text(records.render(records.load(tmp_path / "good.json")) + "edited by hand\n")
    broken = _record()
    del broken["measures"]
    (tmp_path / "broken.json").write_text(json.dumps(broken))
    (tmp_path / "broken.md").write_text("")
    assert [problem.split(":")[0] for problem in records.stale(tmp_path)] == ["broken.json", "good.md"]


def test_the_latest_run_comes_first_and_the_earlier_ones_below_it(tmp_path):
    record = _record()
    record["runs"].append({"date": "2026-01-03", "time": "later", "machine": "one GPU", "body": [{"text": "newer"}],
                           "logs": [{"label": "run", "file": "run.log"}]})
    (tmp_path / "page.json").write_text(json.dumps(record))
    page = records.render(records.load(tmp_path / "page.json"))
    assert page.index("## Latest run: 2026-01-03 (later), one GPU") < page.index("newer") \
        < page.index("## Earlier runs") < page.index("### 2026-01-02, one CPU") < page.index("figures")
    assert "Logs: [run](run.log)." in page
