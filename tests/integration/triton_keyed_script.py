"""tritonclient against a router that requires an API key and serves TLS, run by
tests/integration/test_shared_deployment.py as `.venv-tritonclient/bin/python triton_keyed_script.py JSON` (imports
nothing of this repo). Prints one JSON object: liveness without a key, an infer without a key and with a wrong one
(status and message), then one with `headers={"authorization": "Bearer KEY"}` (its text)."""
from __future__ import annotations

import json
import sys

import numpy as np
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException


def inputs(prompt: str, max_tokens: int) -> list:
    values = {"text_input": ("BYTES", np.array([prompt.encode()], dtype=np.object_)),
              "sampling_parameters": ("BYTES", np.array([json.dumps(
                  {"temperature": 0, "max_tokens": max_tokens}).encode()], dtype=np.object_))}
    tensors = []
    for name, (datatype, array) in values.items():
        tensor = triton.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors


def infer(client: triton.InferenceServerClient, plan: dict, headers: dict | None) -> dict:
    try:
        result = client.infer(plan["model"], inputs(plan["prompt"], plan["max_tokens"]), headers=headers)
    except InferenceServerException as exc:
        return {"status": exc.status(), "message": exc.message()}
    return {"text": b"".join(result.as_numpy("text_output").reshape(-1)).decode()}


def main(plan: dict) -> dict:
    client = triton.InferenceServerClient(plan["url"], ssl=True, root_certificates=plan["ca"])  # a path
    return {"live_without_key": client.is_server_live(),
            "without_key": infer(client, plan, None),
            "wrong_key": infer(client, plan, {"authorization": "Bearer sk-guess"}),
            "with_key": infer(client, plan, {"authorization": f"Bearer {plan['key']}"})}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
