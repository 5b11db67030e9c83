"""Every DISAGG_* environment variable the processes read, or deploy/ sets or names, is declared here: the flag whose
default it sets, a path (a directory, Python modules to import, or an image deploy/ builds or runs), or a value
`disagg up` sets for its children. A new one fails this test until it is declared, so no variable is a knob of its
own (issue 57: "no DISAGG_* variable that is not also a flag, a path, or set by up itself")."""
from __future__ import annotations

import argparse
import re
import socket
from pathlib import Path

from services.kit.ports import advertised_host
from services.router.config import add_router_args

REPO_ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("common", "services")  # their Python files: what the processes read
DEPLOY = "deploy"  # every file: what compose and the Dockerfiles set in the containers, or name
NAME = re.compile(r"\bDISAGG_[A-Z0-9_]*[A-Z0-9](_\*)?")

FLAG, PATH, SET_BY_UP = "flag", "path", "set by up"
ENV = {  # name -> (kind, what: the flag it is the default of, the path it names, or what up puts there)
    "DISAGG_MODEL": (FLAG, "--model"),
    "DISAGG_ENGINE": (FLAG, "--engine"),
    "DISAGG_DTYPE": (FLAG, "--dtype"),
    "DISAGG_DEVICE": (FLAG, "--device"),
    "DISAGG_NUM_KV_BLOCKS": (FLAG, "--num-kv-blocks"),
    "DISAGG_TENSOR_PARALLEL_SIZE": (FLAG, "--tensor-parallel-size"),
    "DISAGG_SESSION_TTL": (FLAG, "--session-ttl"),
    "DISAGG_STRUCTURED_OUTPUT_BACKEND": (FLAG, "--structured-output-backend"),
    "DISAGG_ENGINE_CONFIG": (FLAG, "--engine-config"),
    "DISAGG_ENGINE_OVERRIDES": (FLAG, "--engine-overrides"),
    "DISAGG_KV_TRANSPORTS": (FLAG, "--kv-transports"),
    # the old name of DISAGG_KV_TRANSPORTS, for one release: it warns and sets --kv-transports (test_worker_cli.py)
    "DISAGG_KV_TRANSFER_BACKENDS": (FLAG, "--kv-transports"),
    "DISAGG_HOST": (FLAG, "--host"),
    "DISAGG_GRPC_PORT": (FLAG, "--port"),  # every server's; a container's healthcheck dials it
    "DISAGG_HTTP_PORT": (FLAG, "--http-port"),
    "DISAGG_METRICS_PORT": (FLAG, "--metrics-port"),
    "DISAGG_ADVERTISE_HOST": (FLAG, "--advertise-host"),  # every server's
    "DISAGG_PREFILL_WORKERS": (FLAG, "--prefill-workers"),
    "DISAGG_DECODE_WORKERS": (FLAG, "--decode-workers"),
    "DISAGG_ENCODE_WORKERS": (FLAG, "--encode-workers"),
    "DISAGG_CONSUL": (FLAG, "--consul"),
    "DISAGG_API_KEY": (FLAG, "--api-key"),
    "DISAGG_API_KEY_FILE": (FLAG, "--api-key-file"),
    "DISAGG_TLS_CERT": (FLAG, "--tls-cert"),
    "DISAGG_TLS_KEY": (FLAG, "--tls-key"),
    "DISAGG_TLS_CA": (FLAG, "--tls-ca"),
    "DISAGG_TLS_CLIENT_AUTH": (FLAG, "--tls-client-auth"),
    "DISAGG_ROUTER": (FLAG, "--router"),  # the clients': generate, wait, bench
    "DISAGG_HTTP": (FLAG, "--http"),  # disagg bench's
    "DISAGG_CACHE_DIR": (PATH, "the cache root: the default model, the built CPU kernels"),
    "DISAGG_KV_TRANSPORT_MODULES": (PATH, "modules that register KV transports"),
    "DISAGG_ROUTER_POLICY_MODULES": (PATH, "modules that register routing policies"),
    "DISAGG_ROUTER_FRONTEND_MODULES": (PATH, "modules that register front doors"),
    "DISAGG_TOOL_CALL_PARSER_MODULES": (PATH, "modules that register tool-call parsers"),
    "DISAGG_REASONING_PARSER_MODULES": (PATH, "modules that register reasoning parsers"),
    "DISAGG_ENCODE_MODEL": (PATH, "compose's: the encode worker's --model directory"),
    "DISAGG_IMAGE_TAG": (PATH, "compose's and offline-up.sh's: the image disagg:TAG they build and run"),
    "DISAGG_IMAGE": (PATH, "Dockerfile.stand-ins' build argument: the image it builds on"),
    "DISAGG_MODEL_CORES": (SET_BY_UP, "a CPU worker's model cores (services/cli/cpu_layout.py)"),
    "DISAGG_HELPER_CORES": (SET_BY_UP, "the idle cores a CPU worker's GEMMs may borrow"),
}


DEPLOY_ONLY = {"DISAGG_ENCODE_MODEL", "DISAGG_IMAGE_TAG", "DISAGG_IMAGE"}  # no process reads them


def _names_in_source(deploy: bool = True) -> dict[str, set[str]]:
    paths = [p for top in SOURCES for p in (REPO_ROOT / top).rglob("*.py")]
    paths += [p for p in (REPO_ROOT / DEPLOY).rglob("*") if deploy and p.is_file()]
    found: dict[str, set[str]] = {}
    for path in sorted(paths):
        for match in NAME.finditer(path.read_text(errors="replace")):
            found.setdefault(match.group(0), set()).add(str(path.relative_to(REPO_ROOT)))
    return found


def test_every_disagg_variable_in_the_source_is_declared():
    found = _names_in_source()
    undeclared = {}
    for name, files in found.items():
        if name.endswith("_*"):  # a family, as in "DISAGG_TLS_*": some declared name must belong to it
            if not any(known.startswith(name[:-1]) for known in ENV):
                undeclared[name] = files
        elif name not in ENV:
            undeclared[name] = files
    assert not undeclared, f"declare each in ENV (a flag, a path, or set by up), or drop it: {undeclared}"


def test_every_declared_variable_is_still_read_and_its_flag_exists():
    found = _names_in_source()
    assert not set(ENV) - set(found), f"no longer in the source: {sorted(set(ENV) - set(found))}"
    source = "\n".join(p.read_text() for top in SOURCES for p in (REPO_ROOT / top).rglob("*.py"))
    missing = [flag for kind, flag in ENV.values() if kind == FLAG and f'"{flag}"' not in source]
    assert not missing, missing


def test_deploys_own_names_are_read_by_no_process():
    read = set(_names_in_source(deploy=False))
    assert not DEPLOY_ONLY & read, sorted(DEPLOY_ONLY & read)


def test_the_router_takes_advertise_host_as_a_flag_whose_default_is_the_variable(monkeypatch):
    monkeypatch.setenv("DISAGG_ADVERTISE_HOST", "router.example")
    parser = argparse.ArgumentParser()
    add_router_args(parser)
    assert parser.parse_args([]).advertise_host == "router.example"
    assert parser.parse_args(["--advertise-host", "10.0.0.5"]).advertise_host == "10.0.0.5"
    assert advertised_host("0.0.0.0", None) == socket.gethostname() and advertised_host("127.0.0.1", None) == "127.0.0.1"


def test_the_bench_switches_and_the_second_port_name_are_gone():
    found = _names_in_source()
    for name in ("DISAGG_PEER_COPY", "DISAGG_CPU_GEMV", "DISAGG_CPU_KERNELS", "DISAGG_GRAMMAR_FILL_THREADS",
                 "DISAGG_ROUTER_PORT"):
        assert name not in found, (name, found.get(name))
