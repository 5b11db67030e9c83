"""tritonclient against a router that requires an API key and serves TLS, run by
tests/integration/test_shared_deployment.py as `.venv-tritonclient/bin/python triton_keyed_script.py JSON` (imports
only its neighbour triton_client_script). Prints one JSON object: liveness without a key, an infer without a key and
with a wrong one (status and message), then one with `headers={"authorization": "Bearer KEY"}` (its text)."""
from __future__ import annotations

import json
import sys

import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

from triton_client_script import error_of, inputs, text_of  # its neighbour (the script's directory is on sys.path)


def infer(client: triton.InferenceServerClient, plan: dict, headers: dict | None) -> dict:
    try:
        result = client.infer(plan["model"], inputs(plan["prompt"], plan["max_tokens"], stream=False), headers=headers)
    except InferenceServerException as exc:
        return error_of(exc)
    return {"text": text_of(result)}


def main(plan: dict) -> dict:
    client = triton.InferenceServerClient(plan["url"], ssl=True, root_certificates=plan["ca"])  # a path
    return {"live_without_key": client.is_server_live(),
            "without_key": infer(client, plan, None),
            "wrong_key": infer(client, plan, {"authorization": "Bearer sk-guess"}),
            "with_key": infer(client, plan, {"authorization": f"Bearer {plan['key']}"})}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
