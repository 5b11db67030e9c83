"""Helpers for the observability tests: a service's metrics endpoint and one scrape of it."""
from __future__ import annotations

import re
import time
import urllib.request
from typing import Callable

from prometheus_client.parser import text_string_to_metric_families

from tests.integration.processes import ServiceProcess

_METRICS_LINE = re.compile(r"disagg-[\w-]+ metrics on (http://\S+/metrics)")


def metrics_url(process: ServiceProcess) -> str:
    match = _METRICS_LINE.search(process.log())
    assert match, f"{process.name} did not announce its metrics endpoint:\n{process.log()}"
    return match[1]


def metrics_port(process: ServiceProcess) -> int:
    return int(metrics_url(process).rsplit(":", 1)[1].split("/")[0])


def scrape(process: ServiceProcess) -> dict[str, float]:
    """Every sample of one scrape, keyed `name{label="value",...}` with labels sorted (model/role dropped)."""
    with urllib.request.urlopen(metrics_url(process), timeout=5) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k not in ("model", "role")}
            key = sample.name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else "")
            samples[key] = sample.value
    return samples


def wait_for(condition: Callable[[], object], timeout_s: float, what: str, every_s: float = 0.1):
    """Poll until `condition()` is truthy; its value, or AssertionError naming `what`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")
        time.sleep(every_s)
