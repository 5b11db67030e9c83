"""Limits on what grows a request's cost (stop strings, stop token ids, chat messages): one rule for every front door,
refused up front with INVALID_ARGUMENT / 400 naming the field and its limit."""
import pytest

from common.engine.request import SamplingParams
from common.errors import InvalidRequest
from common.pb.disagg.v1 import common_pb2, generation_pb2
from services.kit.serving import status_of
from services.router.frontends.grpc_convert import request_from_proto
from services.router.generation import MAX_MESSAGES, ChatMessage, GenerationRequest

LARGEST_STOPS = tuple(f"{i:02d}" + "x" * 62 for i in range(SamplingParams.MAX_STOP_STRINGS))  # 64 × 64 characters


def test_the_largest_allowed_stops_and_stop_token_ids_are_accepted():
    assert sum(map(len, LARGEST_STOPS)) == SamplingParams.MAX_STOP_CHARS
    params = SamplingParams(stop=LARGEST_STOPS, stop_token_ids=tuple(range(SamplingParams.MAX_STOP_TOKEN_IDS)))
    assert params.stop == LARGEST_STOPS


@pytest.mark.parametrize("params, message", [
    ({"stop": ("x",) * 1_300_000}, "stop has 1300000 strings; at most 64 are accepted"),
    ({"stop": ("x" * 4000, "y" * 97)}, "stop has 4097 characters in all; at most 4096 are accepted"),
    ({"stop_token_ids": (2,) * 1025}, "stop_token_ids has 1025 ids; at most 1024 are accepted"),
])
def test_sampling_params_past_a_limit_are_refused_naming_it(params, message):
    with pytest.raises(InvalidRequest) as refused:
        SamplingParams(**params)
    assert str(refused.value) == message


def test_the_grpc_door_refuses_them_as_invalid_argument():
    stop = common_pb2.StopConditions(stop=["x"] * 65)
    with pytest.raises(InvalidRequest, match="stop has 65 strings; at most 64") as refused:
        request_from_proto(generation_pb2.GenerateRequest(prompt="Hi", stop=stop), "r")
    assert status_of(refused.value).name == "INVALID_ARGUMENT"
    chat = generation_pb2.Chat(messages=[generation_pb2.ChatMessage(role="user", content="")] * (MAX_MESSAGES + 1))
    with pytest.raises(InvalidRequest, match=f"messages has {MAX_MESSAGES + 1} messages; at most {MAX_MESSAGES}"):
        request_from_proto(generation_pb2.GenerateRequest(chat=chat), "r")


def test_a_generation_request_checks_its_messages_whichever_door_made_it():
    GenerationRequest("r", messages=(ChatMessage("user", "Hi"),) * MAX_MESSAGES)
    with pytest.raises(InvalidRequest, match=f"at most {MAX_MESSAGES} are accepted"):
        GenerationRequest("r", messages=(ChatMessage("user", "Hi"),) * (MAX_MESSAGES + 1))
