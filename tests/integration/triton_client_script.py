"""tritonclient against the router's KServe v2 front door, run by tests/integration/test_kserve.py as
`.venv-tritonclient/bin/python triton_client_script.py MODE JSON` (tritonclient pins protobuf < 7, so it lives in
a virtualenv of its own and imports nothing of this repo). Prints one JSON object on stdout.

    generate   metadata and health as tritonclient reads them; each prompt through `infer` and through
               `start_stream` + `async_stream_infer` (all prompts in flight on one stream); then a bad request
               each way (its status and message) and one more `infer` that must be served.
    walk_away  starts a long stream, reads a few deltas, then stops the stream cancelling its request.
    sampled    one `infer` per sampling_parameters object of the plan: its text and finish reason, or its error.
"""
from __future__ import annotations

import json
import queue
import sys
import time

import numpy as np
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException


def inputs(prompt: str, max_tokens: int, stream: bool, sampling: dict | None = None) -> list:
    values = {"text_input": ("BYTES", np.array([prompt.encode()], dtype=np.object_)),
              "stream": ("BOOL", np.array([stream], dtype=bool)),
              "sampling_parameters": ("BYTES", np.array([json.dumps(
                  sampling or {"temperature": 0, "max_tokens": max_tokens}).encode()], dtype=np.object_))}
    tensors = []
    for name, (datatype, array) in values.items():
        tensor = triton.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors


def text_of(result, name: str = "text_output") -> str | None:
    array = result.as_numpy(name)
    return None if array is None else b"".join(array.reshape(-1)).decode()


def error_of(exc: InferenceServerException) -> dict:
    return {"status": exc.status(), "message": exc.message()}


def metadata(client: triton.InferenceServerClient, model: str) -> dict:
    meta = client.get_model_metadata(model, as_json=True)
    config = client.get_model_config(model, as_json=True)["config"]
    return {"live": client.is_server_live(), "ready": client.is_server_ready(),
            "model_ready": client.is_model_ready(model), "server": client.get_server_metadata(as_json=True),
            "inputs": {t["name"]: [t["datatype"], t["shape"]] for t in meta["inputs"]},
            "outputs": {t["name"]: [t["datatype"], t["shape"]] for t in meta["outputs"]},
            "decoupled": config.get("model_transaction_policy", {}).get("decoupled", False)}


def infer(client: triton.InferenceServerClient, model: str, prompt: str, max_tokens: int) -> dict:
    result = client.infer(model, inputs(prompt, max_tokens, stream=False), request_id="unary")
    return {"text": text_of(result), "finish_reason": text_of(result, "finish_reason"),
            "id": result.get_response().id}


def stream_all(client: triton.InferenceServerClient, model: str, prompts: list[str], max_tokens: int) -> list:
    """Every prompt in flight at once on one stream; each ends at its empty final response."""
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        for index, prompt in enumerate(prompts):
            client.async_stream_infer(model, inputs(prompt, max_tokens, stream=True), request_id=str(index),
                                      enable_empty_final_response=True)
        streams = [{"deltas": [], "finish_reason": None, "finals": 0} for _ in prompts]
        while sum(s["finals"] for s in streams) < len(prompts):
            result, error = responses.get(timeout=60)
            if error is not None:
                raise error
            response = result.get_response()
            entry = streams[int(response.id)]
            if response.parameters["triton_final_response"].bool_param:
                entry["finals"] += 1
                continue
            reason = text_of(result, "finish_reason")
            entry["finish_reason"] = reason or entry["finish_reason"]
            if reason is None:
                entry["deltas"].append(text_of(result))
        return streams
    finally:
        client.stop_stream()


def bad_requests(client: triton.InferenceServerClient, model: str) -> dict:
    """An unknown model through `infer`, a bad sampling value through a stream (its callback's error)."""
    found = {}
    try:
        client.infer("no-such-model", inputs("Hi", 4, stream=False))
    except InferenceServerException as exc:
        found["infer_unknown_model"] = error_of(exc)
    errors: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: errors.put(error))
    try:
        client.async_stream_infer(model, inputs("Hi", 4, stream=True, sampling={"temperature": -2}), request_id="bad")
        found["stream_bad_temperature"] = error_of(errors.get(timeout=60))
    finally:
        client.stop_stream()
    return found


def generate(plan: dict) -> dict:
    client = triton.InferenceServerClient(plan["url"])
    model, max_tokens = plan["model"], plan["max_tokens"]
    return {"metadata": metadata(client, model),
            "infer": [infer(client, model, prompt, max_tokens) for prompt in plan["prompts"]],
            "stream": stream_all(client, model, plan["prompts"], max_tokens),
            "errors": bad_requests(client, model),
            "after_errors": infer(client, model, plan["prompts"][0], max_tokens)}


def walk_away(plan: dict) -> dict:
    """Reads `deltas` responses of a long greedy stream, then leaves: stop_stream(cancel_requests=True)."""
    client = triton.InferenceServerClient(plan["url"])
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    sampling = {"temperature": 0, "max_tokens": plan["max_tokens"], "ignore_eos": True}
    client.async_stream_infer(plan["model"], inputs(plan["prompt"], 0, stream=True, sampling=sampling))
    texts, started = [], None
    while len(texts) < plan["deltas"]:
        result, error = responses.get(timeout=60)
        if error is not None:
            raise error
        if text_of(result, "finish_reason") is not None:
            break  # finished before we left: the test says so
        texts.append(text_of(result))
        started = started or time.monotonic()
    seconds = time.monotonic() - started
    client.stop_stream(cancel_requests=True)
    return {"deltas": len(texts), "finished": len(texts) < plan["deltas"], "seconds": seconds}


def sampled(plan: dict) -> list[dict]:
    client = triton.InferenceServerClient(plan["url"])
    answers = []
    for sampling in plan["samplings"]:
        try:
            result = client.infer(plan["model"], inputs(plan["prompt"], 0, stream=False, sampling=sampling))
            answers.append({"text": text_of(result), "finish_reason": text_of(result, "finish_reason")})
        except InferenceServerException as exc:
            answers.append(error_of(exc))
    return answers


if __name__ == "__main__":
    mode, plan = sys.argv[1], json.loads(sys.argv[2])
    print(json.dumps({"generate": generate, "walk_away": walk_away, "sampled": sampled}[mode](plan)))
