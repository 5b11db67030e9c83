"""deploy/grafana's dashboard and deploy/prometheus's alert rules, without a server: promtool accepts the rules, every
panel and query names the data source Grafana's provisioning creates, and every metric they read is one disagg
exports. tests/integration/test_prometheus.py runs each query against a real Prometheus scraping a real cluster."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from common.telemetry.metrics import METRICS

REPO_ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = REPO_ROOT / "deploy/grafana/dashboards/disagg.json"
DATASOURCES = REPO_ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml"
ALERTS = REPO_ROOT / "deploy/prometheus/alerts.yml"
GRAFANA_BUILT_INS = {"__rate_interval", "__interval", "__range"}
# An alert's expression ends in the comparison that makes it fire: `VALUE > 0.95`.
THRESHOLD = re.compile(r"\s*(==|!=|>=|<=|>|<)\s*-?[0-9.]+\s*$")


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(board: dict) -> list[dict]:
    """Every panel that queries, rows' nested panels included."""
    found = []
    for panel in board["panels"]:
        found += [p for p in panel.get("panels", []) if p.get("type") != "row"]
        if panel["type"] != "row":
            found.append(panel)
    return found


def dashboard_exprs() -> dict[str, str]:
    """'panel title/refId' → its PromQL, Grafana variables still in it."""
    return {f"{p['title']}/{t['refId']}": t["expr"] for p in panels(dashboard()) for t in p["targets"]}


def alert_rules() -> list[dict]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def exported_names() -> set[str]:
    names = {"up", "scrape_duration_seconds"}
    for name, (kind, _, _) in METRICS.items():
        names |= {f"{name}{suffix}" for suffix in ("_bucket", "_count", "_sum")} if kind == "histogram" else {name}
    return names


def test_promtool_accepts_the_alert_rules():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian package prometheus)")
    result = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_waits_says_what_is_wrong_and_fires_on_a_threshold():
    rules = alert_rules()
    assert {"DisaggTargetDown", "DisaggTTFTHigh", "DisaggErrorRatioHigh", "DisaggKVCacheNearlyFull",
            "DisaggKVPullFailures"} <= {r["alert"] for r in rules}
    for rule in rules:
        assert rule["for"] and rule["labels"]["severity"] in ("critical", "warning", "info"), rule["alert"]
        assert {"summary", "description"} <= set(rule["annotations"]), rule["alert"]
        assert THRESHOLD.search(rule["expr"]), rule["alert"]


def test_every_panel_and_query_uses_the_provisioned_data_source():
    [source] = yaml.safe_load(DATASOURCES.read_text())["datasources"]
    board = dashboard()
    assert source["type"] == "prometheus" and source["uid"] and "${" not in DASHBOARD.read_text()
    found = panels(board)
    assert len(found) >= 20
    for panel in found:
        assert panel["datasource"] == {"type": "prometheus", "uid": source["uid"]}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip() and target["datasource"]["uid"] == source["uid"], panel["title"]
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"]), panel["title"]
    for variable in board["templating"]["list"]:
        assert variable["datasource"]["uid"] == source["uid"], variable["name"]
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])


def test_panels_fit_the_grid_without_overlapping():
    cells = {}
    for panel in dashboard()["panels"]:
        box = panel["gridPos"]
        assert box["x"] >= 0 and box["x"] + box["w"] <= 24, panel["title"]
        for x in range(box["x"], box["x"] + box["w"]):
            for y in range(box["y"], box["y"] + box["h"]):
                assert (x, y) not in cells, (panel["title"], cells.get((x, y)))
                cells[x, y] = panel["title"]


def test_every_query_reads_metrics_disagg_exports_and_only_defined_variables():
    board = dashboard()
    variables = {v["name"] for v in board["templating"]["list"]} | GRAFANA_BUILT_INS
    queries = {**dashboard_exprs(), **{r["alert"]: r["expr"] for r in alert_rules()},
               **{f"${v['name']}": v["query"] for v in board["templating"]["list"]}}
    exported = exported_names()
    for where, expr in queries.items():
        names = set(re.findall(r"\b(disagg_\w+|up|scrape_duration_seconds)\s*[{\[(,)]", expr))
        assert names and names <= exported, (where, names - exported)
        used = set(re.findall(r"\$(\w+)", expr))
        assert used <= variables, (where, used - variables)
