"""The real Prometheus server (Debian package `prometheus`, installed by deploy/install.sh) scrapes router,
prefill and decode; after some requests the TTFT histogram count and the KV pull bytes read back through
Prometheus' HTTP query API match what was sent and what the decode worker counted. The same server loads
deploy/prometheus/alerts.yml, and every query of deploy/grafana's dashboard and every alert rule returns series."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.parse
import urllib.request
from typing import Iterator

import grpc
import pytest

from common.pb.disagg.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.integration.observed import metrics_url, scrape, wait_for
from tests.integration.processes import ServiceProcess, free_port, start_service, start_services, stop_in_waves
from tests.integration.test_router import make_text_model
from tests.unit.test_grafana import ALERTS, THRESHOLD, alert_rules, dashboard, dashboard_exprs

PROMETHEUS = shutil.which("prometheus")
NUM_REQUESTS = 4
MAX_TOKENS = 4

pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="the prometheus server is not installed "
                                                           "(deploy/install.sh installs the Debian package)")


@pytest.fixture(scope="module")
def services(tmp_path_factory) -> Iterator[list[ServiceProcess]]:
    model = str(make_text_model(tmp_path_factory.mktemp("models") / "tiny-text"))
    env = {"OMP_NUM_THREADS": "1"}
    processes = start_services([("prefill", ("--model", model)), ("decode", ("--model", model))], env=env)
    try:
        prefill, decode = processes
        processes.append(start_service("router", "--model", model, "--prefill-workers", prefill.address,
                                       "--decode-workers", decode.address, env=env))
        yield processes
    finally:
        codes = stop_in_waves(processes)
        assert codes == [0] * len(codes), [p.log() for p in processes]


@pytest.fixture(scope="module")
def prometheus(services, tmp_path_factory) -> Iterator[str]:
    """A Prometheus server scraping every service each 0.5 s; yields its base URL. A scrape may take up to the whole
    interval: on a loaded 2-core machine a worker's /metrics answer took over 0.4 s and the target counted as down."""
    root = tmp_path_factory.mktemp("prometheus")
    targets = [urllib.parse.urlparse(metrics_url(p)).netloc for p in services]
    config = {"global": {"scrape_interval": "500ms", "scrape_timeout": "500ms", "evaluation_interval": "500ms"},
              "rule_files": [str(ALERTS)],
              "scrape_configs": [{"job_name": "disagg", "static_configs": [{"targets": targets}]}]}
    (root / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    port = free_port()
    process = subprocess.Popen(
        [PROMETHEUS, f"--config.file={root / 'prometheus.yml'}", f"--storage.tsdb.path={root / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _ready(url) or process.poll() is not None, 30, "prometheus to be ready")
        assert process.poll() is None, process.stderr.read().decode()
        yield url
    finally:
        process.terminate()
        process.wait(15)
        process.stderr.close()


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _query(url: str, promql: str) -> list[dict]:
    with urllib.request.urlopen(f"{url}/api/v1/query?{urllib.parse.urlencode({'query': promql})}",
                                timeout=5) as response:
        body = json.load(response)
    assert body["status"] == "success", body
    return body["data"]["result"]


def _scalar(url: str, promql: str) -> float | None:
    result = _query(url, promql)
    return float(result[0]["value"][1]) if result else None


def _generate(router: ServiceProcess, prompt: str, temperature: float = 0) -> None:
    request = generation_pb2.GenerateRequest(
        prompt=prompt, sampling=common_pb2.SamplingParams(temperature=temperature, max_tokens=MAX_TOKENS),
        stop=common_pb2.StopConditions(ignore_eos=True))
    with grpc.insecure_channel(router.address) as channel:
        responses = list(generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=30))
    assert responses[-1].finished.usage.completion_tokens == MAX_TOKENS


def test_prometheus_reads_ttft_and_kv_pull_bytes(services, prometheus):
    prefill, decode, router = services
    wait_for(lambda: _scalar(prometheus, 'count(up{job="disagg"} == 1)') == 3, 30, "every target to be up")
    warm_up_pulls = sum(v for k, v in scrape(decode).items() if k.startswith("disagg_kv_pull_seconds_count{"))
    assert warm_up_pulls >= 1  # the router warmed the handoff path before it said SERVING (router/warm_up.py)
    for i in range(NUM_REQUESTS):
        _generate(router, f"Request number {i} asks about the sea and")

    ttft = 'disagg_time_to_first_token_seconds_count{role="router",model="tiny-text"}'
    wait_for(lambda: _scalar(prometheus, ttft) == NUM_REQUESTS, 20, "the TTFT count to reach Prometheus")
    pulled = sum(v for k, v in scrape(decode).items() if k.startswith("disagg_kv_pull_bytes_total{backend="))
    assert pulled > 0
    wait_for(lambda: _scalar(prometheus, 'sum(disagg_kv_pull_bytes_total{role="decode"})') == pulled, 20,
             "the KV pull bytes to reach Prometheus")
    assert _scalar(prometheus, 'sum(disagg_kv_pull_seconds_count{role="decode"})') == NUM_REQUESTS + warm_up_pulls
    # A request is counted once its stream has ended, just after the client read its last message: a scrape that
    # saw the last TTFT may come before that count.
    wait_for(lambda: (_scalar(prometheus, 'disagg_requests_total{role="router",status="OK"}'),
                      _scalar(prometheus, 'disagg_generation_tokens_total{role="router"}'))
             == (NUM_REQUESTS, NUM_REQUESTS * MAX_TOKENS), 20, "the router's request and token counts to reach Prometheus")
    # The prefill worker is scraped on its own schedule: wait for its scrape after the requests too.
    wait_for(lambda: [_scalar(prometheus, f'disagg_kv_sessions_{what}_total{{role="prefill"}}')
                      for what in ("exported", "pulled")] == [NUM_REQUESTS + warm_up_pulls] * 2, 20,
             "the exported and pulled sessions to reach Prometheus")
    median = _scalar(prometheus, f"histogram_quantile(0.5, {ttft.replace('_count', '_bucket')})")
    assert median is not None and 0 < median < 30
    # the workers' engine gauges, refreshed from GetLoad: idle again after the requests
    wait_for(lambda: _scalar(prometheus, 'disagg_kv_cache_usage_ratio{role="decode"}') == 0, 20, "an idle KV cache")
    assert _scalar(prometheus, 'disagg_kv_cache_free_blocks{role="decode"}') > 0
    # every process times its garbage collections (its start-up heap frozen out of them): router, prefill and decode
    assert _scalar(prometheus, 'count(disagg_gc_pause_seconds_count{generation="2"})') == 3
    # both workers time how long their engine's outputs waited for their event loop: a step or more a request
    assert _scalar(prometheus, 'count(disagg_engine_output_wait_seconds_count > 0)') == 2
    # the router timed its event loop while the requests were in flight
    wait_for(lambda: (_scalar(prometheus, 'disagg_event_loop_lag_seconds_count{role="router"}') or 0) > 0, 20,
             "the router's event-loop lag to reach Prometheus")


def test_every_dashboard_query_and_alert_rule_returns_series(services, prometheus):
    """Each PromQL of deploy/grafana/dashboards/disagg.json and deploy/prometheus/alerts.yml, run by the real
    Prometheus after requests (its own: this test may run alone), returns at least one series: its metric names,
    labels and aggregations match what the services export. A rule is queried without its threshold: a healthy
    cluster's alert expressions return nothing by design (the comparison filters every series out), and what is
    checked is the value the comparison reads. The rare-event counters (failures, fallbacks) have no series until
    they count; the dashboard and the rules turn their absence into 0 (`or on (...) 0 * ...`), and that is what
    returns here."""
    prefill, decode, router = services
    wait_for(lambda: _scalar(prometheus, 'count(up{job="disagg"} == 1)') == 3, 30, "every target to be up")
    for i in range(2):
        _generate(router, f"Dashboards ask question {i} about the sea and")
    with pytest.raises(grpc.RpcError) as refused:  # an error status for the error panels to show
        _generate(router, "A refused request", temperature=-1)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # counted before the requests' answers were sent (a request's outcome is counted just after): stable now
    ttft = scrape(router)["disagg_time_to_first_token_seconds_count"]
    exported = scrape(prefill)["disagg_kv_sessions_exported_total"]
    wait_for(lambda: _scalar(prometheus, 'disagg_time_to_first_token_seconds_count{role="router"}') == ttft
             and _scalar(prometheus, 'disagg_kv_sessions_exported_total{role="prefill"}') == exported
             # a new series' rate needs two samples of it
             and (_scalar(prometheus, 'count_over_time(disagg_requests_total{role="router",status="INVALID_ARGUMENT"}'
                                      '[1m])') or 0) >= 2, 20, "the requests to reach Prometheus")

    # Grafana's variables as the dashboard's defaults expand them: every model, and a rate window of a minute
    # (the requests above are in it)
    queries = {where: expr.replace("$model", ".+").replace("$__rate_interval", "1m")
               for where, expr in dashboard_exprs().items()}
    for rule in alert_rules():
        value = THRESHOLD.sub("", rule["expr"])
        assert value != rule["expr"], rule["alert"]
        queries[rule["alert"]] = value
    empty = [where for where, expr in queries.items() if not _query(prometheus, expr)]
    assert not empty, {where: queries[where] for where in empty}
    for variable in dashboard()["templating"]["list"]:  # label_values(METRIC, LABEL), as Grafana asks for it
        metric, label = re.fullmatch(r"label_values\((\w+), (\w+)\)", variable["query"]).groups()
        assert "tiny-text" in _get(f"{prometheus}/api/v1/label/{label}/values?"
                                   f"{urllib.parse.urlencode({'match[]': metric})}")["data"]

    def rules_health() -> dict[str, str]:
        groups = _get(f"{prometheus}/api/v1/rules")["data"]["groups"]
        return {rule["name"]: rule["health"] for group in groups for rule in group["rules"]}

    # every rule loaded and evaluated without error ("unknown" until its first evaluation)
    expected = {rule["alert"]: "ok" for rule in alert_rules()}
    wait_for(lambda: rules_health() == expected, 20, "every alert rule to be evaluated")


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as response:
        body = json.load(response)
    assert body["status"] == "success", body
    return body
