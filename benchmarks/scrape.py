"""A service's metrics endpoint (from the line it announces it with) and one scrape of it."""
from __future__ import annotations

import re
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from benchmarks.processes import ServiceProcess

_METRICS_LINE = re.compile(r"disagg-[\w-]+ metrics on (http://\S+/metrics)")


def metrics_url(process: ServiceProcess) -> str:
    match = _METRICS_LINE.search(process.log())
    assert match, f"{process.name} did not announce its metrics endpoint:\n{process.log()}"
    return match[1]


def metrics_port(process: ServiceProcess) -> int:
    return int(metrics_url(process).rsplit(":", 1)[1].split("/")[0])


def scrape(process: ServiceProcess) -> dict[str, float]:
    """Every sample of one scrape of `process`, keyed `name{label="value",...}` (scrape_url)."""
    return scrape_url(metrics_url(process))


def scrape_url(url: str) -> dict[str, float]:
    """Every sample of one scrape (samples)."""
    with urllib.request.urlopen(url, timeout=5) as response:
        return samples(response.read().decode())


def samples(text: str) -> dict[str, float]:
    """Every sample of a Prometheus text exposition, keyed `name{label="value",...}` with labels sorted (model and
    role dropped)."""
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k not in ("model", "role")}
            key = sample.name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else "")
            samples[key] = sample.value
    return samples
