"""max_tokens that cannot fit in the context is refused up front (INVALID_ARGUMENT), not run to the deadline."""
import pytest

from common.engine.default_model import default_model_dir
from common.errors import InvalidRequest
from common.pb.disagg.v1 import common_pb2, generation_pb2
from services.router.frontends.grpc_convert import request_from_proto
from services.router.generation import ServedModel
from services.router.prepare import RequestPreparer

MODEL = ServedModel(name="SmolLM2-135M-Instruct", max_model_len=64)


@pytest.fixture(scope="module")
def preparer() -> RequestPreparer:
    return RequestPreparer.from_model_dir(default_model_dir())


def _prepare(preparer, max_tokens: int | None):
    sampling = common_pb2.SamplingParams() if max_tokens is None else common_pb2.SamplingParams(max_tokens=max_tokens)
    request = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[1] * 10), sampling=sampling)
    return preparer.prepare(request_from_proto(request, "r"), MODEL)


def test_max_tokens_beyond_the_context_is_invalid_argument_naming_the_room_left(preparer):
    with pytest.raises(InvalidRequest, match=r"max_tokens=100000 with a 10-token prompt exceeds the model's "
                                             r"context of 64 tokens; ask for at most 54"):
        _prepare(preparer, 100000)
    with pytest.raises(InvalidRequest, match="at most 54"):
        _prepare(preparer, 55)


def test_max_tokens_that_fits_or_unset_is_accepted(preparer):
    assert _prepare(preparer, 54).params.max_tokens == 54
    assert _prepare(preparer, None).params.max_tokens is None  # up to the context, as before
