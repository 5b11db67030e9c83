"""The served model as a KServe v2 model: the LLM tensors Triton's vLLM / TensorRT-LLM backends and Dynamo use.

One model, version "1", decoupled (a request may get many responses), no batching dimension: `text_input`
(BYTES [1]) is the prompt; `stream` (or Dynamo's `streaming`) asks for text deltas; `sampling_parameters` is a
JSON object (vLLM's backend); the optional scalar inputs are the TensorRT-LLM backend's. Outputs: `text_output`
and `finish_reason` ("stop" or "length").
"""
from __future__ import annotations

from dataclasses import dataclass

from common.errors import NotFound
from common.pb.inference import grpc_service_pb2 as pb
from common.pb.inference import model_config_pb2 as config_pb
from services.router.frontends.kserve_tensors import bytes_output
from services.router.generation import ServedModel

VERSION = "1"
PLATFORM = "disagg"
INTS = frozenset({"INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64"})
FLOATS = frozenset({"FP16", "FP32", "FP64"})


@dataclass(frozen=True)
class InputSpec:
    name: str
    datatype: str  # what ModelMetadata / ModelConfig declare
    accepts: frozenset[str]  # what a request may send (any integer width for an integer, ...)
    is_list: bool = False  # a 1-D list ([-1]) rather than one value ([1])
    field: str | None = None  # the SamplingParams field it sets
    optional: bool = True


def _spec(name: str, datatype: str, field: str | None = None, is_list: bool = False,
          optional: bool = True) -> InputSpec:
    accepts = INTS if datatype in INTS else FLOATS if datatype in FLOATS else frozenset({datatype})
    return InputSpec(name, datatype, accepts, is_list, field, optional)


INPUTS: dict[str, InputSpec] = {spec.name: spec for spec in (
    _spec("text_input", "BYTES", optional=False),
    _spec("stream", "BOOL"),
    _spec("streaming", "BOOL"),  # Dynamo's name for it
    _spec("sampling_parameters", "BYTES"),
    _spec("max_tokens", "INT32", "max_tokens"),
    _spec("temperature", "FP32", "temperature"),
    _spec("top_p", "FP32", "top_p"),
    _spec("top_k", "INT32", "top_k"),
    _spec("min_p", "FP32", "min_p"),
    _spec("repetition_penalty", "FP32", "repetition_penalty"),
    _spec("seed", "UINT64", "seed"),
    _spec("random_seed", "UINT64", "seed"),  # TensorRT-LLM's name for it
    _spec("stop", "BYTES", "stop", is_list=True),
    _spec("stop_words", "BYTES", "stop", is_list=True),  # TensorRT-LLM's name for it
    _spec("stop_token_ids", "INT32", "stop_token_ids", is_list=True),
    _spec("ignore_eos", "BOOL", "ignore_eos"),
)}
TEXT_OUTPUT = "text_output"
FINISH_REASON = "finish_reason"
OUTPUTS = (TEXT_OUTPUT, FINISH_REASON)


def check_model(name: str, version: str, model: ServedModel) -> None:
    """NotFound unless `name` (and `version`, if given) is the served model."""
    if name != model.name:
        raise NotFound(f"model '{name}' is not served here; this server serves '{model.name}'")
    if version not in ("", VERSION):
        raise NotFound(f"model '{name}' has no version '{version}'; its one version is '{VERSION}'")


def _dims(spec: InputSpec) -> list[int]:
    return [-1] if spec.is_list else [1]


def _data_type(datatype: str) -> int:
    return config_pb.DataType.Value("TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}")


def model_metadata(model: ServedModel) -> pb.ModelMetadataResponse:
    tensor = pb.ModelMetadataResponse.TensorMetadata
    return pb.ModelMetadataResponse(
        name=model.name, versions=[VERSION], platform=PLATFORM,
        inputs=[tensor(name=s.name, datatype=s.datatype, shape=_dims(s)) for s in INPUTS.values()],
        outputs=[tensor(name=name, datatype="BYTES", shape=[-1]) for name in OUTPUTS])


def model_config(model: ServedModel) -> pb.ModelConfigResponse:
    """A decoupled model without a batching dimension, as Triton's vLLM backend configures itself."""
    config = config_pb.ModelConfig(
        name=model.name, platform=PLATFORM, backend=PLATFORM, max_batch_size=0,
        input=[config_pb.ModelInput(name=s.name, data_type=_data_type(s.datatype), dims=_dims(s),
                                    optional=s.optional) for s in INPUTS.values()],
        output=[config_pb.ModelOutput(name=name, data_type=config_pb.TYPE_STRING, dims=[-1]) for name in OUTPUTS],
        model_transaction_policy=config_pb.ModelTransactionPolicy(decoupled=True))
    return pb.ModelConfigResponse(config=config)


@dataclass(frozen=True)
class Reply:
    """Builds one request's ModelInferResponses: its id echoed, only the outputs it asked for."""

    model_name: str
    request_id: str  # the client's id ("" when it gave none)
    outputs: tuple[str, ...] = OUTPUTS

    def response(self, text: str | None, finish_reason: str | None = None) -> pb.ModelInferResponse:
        """`text` / `finish_reason` None: that output is left out (a delta has no finish reason yet)."""
        response = pb.ModelInferResponse(model_name=self.model_name, model_version=VERSION, id=self.request_id)
        for name, value in ((TEXT_OUTPUT, text), (FINISH_REASON, finish_reason)):
            if value is not None and name in self.outputs:
                tensor, raw = bytes_output(name, [value.encode()])
                response.outputs.append(tensor)
                response.raw_output_contents.append(raw)
        return response

    def stream_response(self, response: pb.ModelInferResponse, final: bool) -> pb.ModelStreamInferResponse:
        response.parameters["triton_final_response"].bool_param = final
        return pb.ModelStreamInferResponse(infer_response=response)

    def empty_final(self) -> pb.ModelStreamInferResponse:
        """The flags-only last response a client asks for with `triton_enable_empty_final_response`."""
        response = pb.ModelInferResponse(model_name=self.model_name, model_version=VERSION, id=self.request_id)
        return self.stream_response(response, final=True)

    def error(self, message: str) -> pb.ModelStreamInferResponse:
        response = pb.ModelInferResponse(model_name=self.model_name, model_version=VERSION, id=self.request_id)
        return pb.ModelStreamInferResponse(error_message=message, infer_response=response)
