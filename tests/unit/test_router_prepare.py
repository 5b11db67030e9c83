"""Request validation before any worker is touched: clear INVALID_ARGUMENT / NOT_FOUND messages."""
import pytest

from common.engine.default_model import default_model_dir
from common.errors import InvalidRequest, NotFound
from common.pb.disagg.v1 import common_pb2, generation_pb2
from common.model_facts import ModelFacts
from services.router.frontends.grpc_convert import request_from_proto
from services.router.generation import GenerationRequest, ServedModel
from services.router.prepare import RequestPreparer

MODEL = ServedModel(name="SmolLM2-135M-Instruct", max_model_len=64)


@pytest.fixture(scope="module")
def preparer() -> RequestPreparer:
    return RequestPreparer.from_model_dir(default_model_dir())


def _request(request_id: str = "r", **kwargs) -> GenerationRequest:
    """The core's request for a disagg.v1 GenerateRequest, as the gRPC front door hands it over."""
    return request_from_proto(generation_pb2.GenerateRequest(**kwargs), request_id)


def test_prompt_chat_and_token_ids_become_token_ids(preparer):
    tok = preparer.tokenizer
    assert preparer.prepare(_request(prompt="The sea"), MODEL).prompt == tok.encode("The sea")
    chat = generation_pb2.Chat(messages=[generation_pb2.ChatMessage(role="user", content="hi")])
    assert preparer.prepare(_request(chat=chat), MODEL).prompt == tok.apply_chat_template(
        [{"role": "user", "content": "hi"}])
    ids = generation_pb2.TokenIds(ids=[1, 2, 3])
    assert preparer.prepare(_request(token_ids=ids), MODEL).prompt == [1, 2, 3]


def test_worker_request_ids_are_unique_per_call(preparer):
    a = preparer.prepare(_request("r1", prompt="x"), MODEL)
    b = preparer.prepare(_request("r1", prompt="x"), MODEL)
    assert a.request_id == b.request_id == "r1" and a.worker_request_id != b.worker_request_id


def test_model_facts_read_eos_and_vocab(preparer):
    assert (preparer.facts.vocab_size, preparer.facts.eos_token_ids) == (49152, frozenset({2}))
    assert preparer.image_tokens is None


@pytest.mark.parametrize("request_kwargs, match", [
    (dict(), "set one of prompt, token_ids or chat"),
    (dict(prompt=""), "prompt is empty"),
    (dict(token_ids=generation_pb2.TokenIds()), "token_ids is empty"),
    (dict(token_ids=generation_pb2.TokenIds(ids=[5, 49152])), r"outside the vocabulary \[0, 49152\)"),
    (dict(prompt="word " * 80), "the model's context is 64 tokens"),
    (dict(chat=generation_pb2.Chat()), "messages is empty"),
    (dict(prompt="x", sampling=common_pb2.SamplingParams(max_tokens=0)), "max_tokens must be >= 1, got 0"),
    (dict(prompt="x", sampling=common_pb2.SamplingParams(temperature=-1)), "temperature must be >= 0"),
    (dict(prompt="x", sampling=common_pb2.SamplingParams(top_p=0)), r"top_p must be in \(0, 1\]"),
    (dict(prompt="x", sampling=common_pb2.SamplingParams(top_p=1.5)), r"top_p must be in \(0, 1\], got 1.5"),
    (dict(prompt="x", stop=common_pb2.StopConditions(stop=[""])), "stop strings must not be empty"),
    (dict(prompt="x", images=[common_pb2.Image(data=b"png")]), "does not accept images"),
])
def test_bad_requests_are_invalid_argument_with_a_clear_message(preparer, request_kwargs, match):
    with pytest.raises(InvalidRequest, match=match):
        preparer.prepare(_request(**request_kwargs), MODEL)


def test_unknown_model_is_not_found_and_names_the_served_one(preparer):
    with pytest.raises(NotFound, match="unknown model 'gpt-9'; this router serves 'SmolLM2-135M-Instruct'"):
        preparer.prepare(_request(model="gpt-9", prompt="x"), MODEL)
    assert preparer.prepare(_request(model=MODEL.name, prompt="x"), MODEL).prompt


def test_text_input_without_a_tokenizer_asks_for_token_ids():
    facts = ModelFacts(model_type="llama", architectures=("LlamaForCausalLM",), vocab_size=512,
                       max_position_embeddings=512, eos_token_ids=frozenset({2}))
    preparer = RequestPreparer(None, facts)
    with pytest.raises(InvalidRequest, match="no tokenizer.*send token_ids"):
        preparer.prepare(_request(prompt="x"), MODEL)
    assert preparer.prepare(_request(token_ids=generation_pb2.TokenIds(ids=[7])), MODEL).prompt == [7]


def test_a_prompt_too_large_for_any_tokenisation_is_refused_before_it_is_tokenised(preparer, monkeypatch):
    def never(*args):
        raise AssertionError("tokenised a prompt that cannot fit")

    monkeypatch.setattr(preparer.tokenizer, "encode", never)
    monkeypatch.setattr(preparer.tokenizer, "apply_chat_template", never)
    huge = "word " * 3_000_000  # 15 MB
    with pytest.raises(InvalidRequest, match=r"the prompt has 15000000 characters, at least \d+ tokens; the model's "
                                             r"context is 64 tokens"):
        preparer.prepare(_request(prompt=huge), MODEL)
    chat = generation_pb2.Chat(messages=[generation_pb2.ChatMessage(role="user", content=huge)])
    with pytest.raises(InvalidRequest, match="at least"):
        preparer.prepare(_request(chat=chat), MODEL)


def test_the_token_bound_never_exceeds_the_real_count(preparer):
    tok = preparer.tokenizer
    for text in ("The sea is blue.", "x" * 500, "日本語のテキスト" * 40, "a\u0301" * 100, " " * 300):
        assert tok.fewest_tokens(text) <= len(tok.encode(text)), text
