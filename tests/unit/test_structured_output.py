"""Grammar-constrained decoding (structured output), each test on both backends (xgrammar, llguidance): greedy equals
Hugging Face greedy under the same library's mask, constrained and unconstrained requests share a batch (rows of both
backends in one), the grammar follows the first token through prefill→decode and through a preemption, `auto`
picks a backend by its rule, a spec one backend refuses compiles on the other, and one both refuse is InvalidRequest
while the engine serves on."""
from __future__ import annotations

import json
import re
import shutil

import llguidance
import llguidance.hf
import pytest
import torch
import xgrammar as xgr
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, LogitsProcessor, LogitsProcessorList

from common.engine.config import EngineConfig
from common.engine.default_model import default_model_dir
from common.engine.engine import LLMEngine
from common.engine.grammar_backend import GrammarState
from common.engine.grammar_mask import GrammarMasks
from common.engine.request import FinishReason, RequestType, SamplingParams
from common.engine.structured import StructuredOutput
from common.errors import HandoffMismatch, InvalidRequest
from tests.hf_reference import hf_model
from tests.tiny_models import _COMMON

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}},
          "required": ["id", "ok"]}
REGEX = r"[0-9]{3}-[a-z]{2}"
PROMPTS = [[5, 9, 31, 44, 7], [12, 80, 3, 250, 19, 6, 77], [40, 41, 42]]


VOCAB = 49152  # SmolLM2's tokenizer


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    """A tiny random llama with SmolLM2's tokenizer and a logit for each of its tokens (llguidance's masks allow a
    forced text's tokenizer tokenization, which a model of fewer logits may not hold)."""
    path = tmp_path_factory.mktemp("structured") / "tiny-with-tokenizer"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**_COMMON, "vocab_size": VOCAB}, num_key_value_heads=2,
                                 tie_word_embeddings=False)).save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir() / name, path / name)
    return str(path)


@pytest.fixture(params=["xgrammar", "guidance"])
def backend(request) -> str:
    return request.param


# The compile bound is its own test's (test_a_compile_past_its_time_limit_...); elsewhere a first compile, which makes
# both backends for a 49k-token vocabulary, once took the whole 10 s on a loaded 2-core machine and failed the test.
COMPILE_BOUND_S = 120.0


def _engine(model, backend="xgrammar", **overrides) -> LLMEngine:
    engine = LLMEngine(EngineConfig(model=model, structured_output_backend=backend,
                                    **{"block_size": 4, "num_kv_blocks": 64, **overrides}))
    engine.grammars.timeout_s = COMPILE_BOUND_S
    return engine


def _greedy(structured: StructuredOutput | None, max_tokens: int = 24, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured=structured, **kwargs)


class XgrammarMask(LogitsProcessor):
    """The reference: Hugging Face's greedy with xgrammar's mask, built here from xgrammar alone."""

    def __init__(self, compiled: xgr.CompiledGrammar, prompt_len: int):
        self.matcher, self.prompt_len = xgr.GrammarMatcher(compiled), prompt_len
        self.bitmask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] > self.prompt_len:
            assert self.matcher.accept_token(int(input_ids[0, -1]))
        self.matcher.fill_next_token_bitmask(self.bitmask)
        xgr.apply_token_bitmask_inplace(scores, self.bitmask)
        return scores


class GuidanceMask(LogitsProcessor):
    """The reference: Hugging Face's greedy with llguidance's mask, built here from llguidance alone (its bits read
    by hand: bit j of word i allows token 32·i + j)."""

    def __init__(self, matcher: llguidance.LLMatcher, prompt_len: int):
        self.matcher, self.prompt_len = matcher, prompt_len

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] > self.prompt_len:
            assert self.matcher.consume_token(int(input_ids[0, -1])), self.matcher.get_error()
        words = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.int32)
        allowed = ((words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[: scores.shape[1]]
        return scores.masked_fill(allowed == 0, float("-inf"))


def _reference(model, backend: str, kind: str, spec) -> object:
    """What the reference masks of `backend` are made from, for a spec of `kind` (json_schema: a dict; choice: a
    list), compiled with that library alone as our backend does (compact JSON, no properties but those named)."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    if backend == "xgrammar":
        compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB,
                                                                          stop_token_ids=[2]))
        return {"json_schema": lambda: compiler.compile_json_schema(json.dumps(spec), any_whitespace=False),
                "regex": lambda: compiler.compile_regex(spec),
                "choice": lambda: compiler.compile_grammar(" | ".join(json.dumps(c) for c in spec).join(
                    ["root ::= ", ""]))}[kind]()
    lark = {"json_schema": lambda: llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps({**spec, "additionalProperties": False}),
                overrides={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}),
            "regex": lambda: llguidance.grammar_from("regex", spec),
            "choice": lambda: llguidance.grammar_from("choice", json.dumps(spec))}[kind]()
    return lark, llguidance.hf.from_tokenizer(tokenizer, eos_token=[2])


@torch.inference_mode()
def _hf_masked_greedy(model, reference, prompt, max_new_tokens) -> list[int]:
    if isinstance(reference, tuple):  # llguidance's (grammar, tokenizer): a matcher for each generation
        mask = GuidanceMask(llguidance.LLMatcher(reference[1], reference[0]), len(prompt))
    else:
        mask = XgrammarMask(reference, len(prompt))
    out = hf_model(model).generate(
        torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=2, pad_token_id=0,
        logits_processor=LogitsProcessorList([mask]))
    return out[0, len(prompt):].tolist()


def _run(engine: LLMEngine) -> dict[str, tuple[list[int], FinishReason | None]]:
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, FinishReason | None] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            reasons[out.request_id] = out.finish_reason
    return {rid: (tokens[rid], reasons[rid]) for rid in tokens}


CHOICES = ["yes", "no", "maybe not"]


@pytest.mark.parametrize("kind", ["json_schema", "regex", "choice"])
def test_constrained_greedy_equals_hf_greedy_under_the_same_mask(model, backend, kind):
    spec, structured = {"json_schema": (SCHEMA, StructuredOutput.json_schema(SCHEMA)),
                        "regex": (REGEX, StructuredOutput("regex", REGEX)),
                        "choice": (CHOICES, StructuredOutput.choice(CHOICES))}[kind]
    reference = _reference(model, backend, kind, spec)
    engine = _engine(model, backend)
    assert engine.grammars.compile(structured).backend == backend
    for prompt in PROMPTS:
        expected = _hf_masked_greedy(model, reference, prompt, 24)
        assert engine.generate([prompt], _greedy(structured))[0] == expected
    assert engine.block_manager.num_free_blocks == 64


def test_constrained_and_unconstrained_requests_share_a_batch(model, backend):
    engine = _engine(model, backend)
    tokenizer = AutoTokenizer.from_pretrained(model)
    plain = _greedy(None, ignore_eos=True)
    regex, choice = _greedy(StructuredOutput("regex", REGEX)), _greedy(StructuredOutput.choice(["left", "right"]))
    alone = {name: engine.generate([PROMPTS[0]], sampling)[0]
             for name, sampling in (("plain", plain), ("regex", regex), ("choice", choice))}
    for name, sampling in (("plain", plain), ("regex", regex), ("choice", choice)):
        engine.add_request(name, PROMPTS[0], sampling)
    together = _run(engine)
    assert {name: tokens for name, (tokens, _) in together.items()} == alone
    assert together["regex"][1] is FinishReason.STOP and together["choice"][1] is FinishReason.STOP
    assert re.fullmatch(REGEX, tokenizer.decode(alone["regex"], skip_special_tokens=True))
    assert tokenizer.decode(alone["choice"], skip_special_tokens=True) in ("left", "right")
    assert len(alone["plain"]) == 24  # unconstrained: its row was not masked (it would have stopped)


def test_rows_of_both_backends_and_an_unconstrained_row_share_a_batch(model):
    """A schema compiled by llguidance (a grammar xgrammar refused falls back there), a regex by xgrammar: in one
    batch with a plain row, each draws what it draws alone, and the grammar rows match HF's greedy under their own
    library's mask."""
    bounded = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5}}, "required": ["name"]}
    samplings = {"guidance": _greedy(StructuredOutput.json_schema(bounded)),
                 "xgrammar": _greedy(StructuredOutput("regex", REGEX)), "plain": _greedy(None, ignore_eos=True)}
    engine = _engine(model, "auto")
    alone = {}
    for rid, sampling in samplings.items():  # each compiled (and cached) first on its own backend
        engine.grammars.backend = "guidance" if rid == "guidance" else "xgrammar"
        alone[rid] = engine.generate([PROMPTS[1]], sampling)[0]
        if sampling.structured:
            assert engine.grammars.compile(sampling.structured).backend == rid
    for rid, sampling in samplings.items():
        engine.grammars.backend = "guidance" if rid == "guidance" else "xgrammar"
        engine.add_request(rid, PROMPTS[1], sampling)
    together = _run(engine)
    assert {rid: tokens for rid, (tokens, _) in together.items()} == alone
    assert alone["guidance"] == _hf_masked_greedy(model, _reference(model, "guidance", "json_schema", bounded),
                                                  PROMPTS[1], 24)
    assert alone["xgrammar"] == _hf_masked_greedy(model, _reference(model, "xgrammar", "regex", REGEX),
                                                  PROMPTS[1], 24)
    assert len(alone["plain"]) == 24
    assert engine.block_manager.num_free_blocks == 64


def test_both_backends_fill_the_same_bitmask_layout(model):
    """For the same grammar at the same place, each backend's row of the shared bitmask allows the same tokens where
    both read the grammar alike (a regex of single characters)."""
    engines = {b: _engine(model, b) for b in ("xgrammar", "guidance")}
    structured = StructuredOutput("regex", "[a-c][0-9]")
    states = [e.grammars.compile(structured).state() for e in engines.values()]
    bitmask = torch.zeros(2, VOCAB // 32, dtype=torch.int32)
    GrammarMasks().fill(states, bitmask)
    assert torch.equal(bitmask[0], bitmask[1]) and bitmask.any()
    assert [type(s).__name__ for s in states] == ["XgrammarState", "GuidanceState"]


def _next_mask(state: GrammarState) -> torch.Tensor:
    bitmask = torch.zeros(1, VOCAB // 32, dtype=torch.int32)
    GrammarMasks().fill([state], bitmask)
    return bitmask


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA GPU"))])
def test_grammar_rows_go_ahead_and_mask_after_the_tokens_before_are_booked(model, backend, device):
    """Async scheduling keeps grammar rows in the pipeline: a step launched ahead runs its forward before the step
    before's tokens are read, and samples once they are booked, under masks of grammars that took them. A batch of
    grammar and plain rows, one ending early on its grammar, draws the synchronous engine's tokens (on a GPU the
    step launched ahead is a CUDA graph, masked by xgrammar's kernel)."""
    samplings = {"json": _greedy(StructuredOutput.json_schema(SCHEMA)), "choice": _greedy(StructuredOutput.choice(
        ["no", "yes"])), "regex": _greedy(StructuredOutput("regex", REGEX)), "plain": _greedy(None)}
    got, checked = {}, []
    for async_scheduling in (False, True):
        engine = _engine(model, backend, async_scheduling=async_scheduling, device=device)
        compiled = {rid: engine.grammars.compile(s.structured) for rid, s in samplings.items() if s.structured}
        sample_masked = engine.runner.sample_masked

        def checking(launch, grammars):
            for request, grammar in zip(launch.sampled, grammars):
                if grammar is not None:  # its input is the last token booked, which its grammar took
                    assert request.num_computed_tokens == request.num_tokens - 1
                    fresh = compiled[request.request_id].after(request.output_token_ids)
                    assert torch.equal(_next_mask(grammar), _next_mask(fresh))
                    checked.append(request.request_id)
            sample_masked(launch, grammars)

        engine.runner.sample_masked = checking
        for (rid, sampling), prompt in zip(samplings.items(), PROMPTS + PROMPTS[:1]):
            engine.add_request(rid, prompt, sampling)
        got[async_scheduling] = _run(engine)
        assert engine.block_manager.num_free_blocks == 64
    assert got[True] == got[False]
    assert set(checked) == set(compiled)  # only with async scheduling, every grammar row went ahead
    assert len(got[True]["choice"][0]) < len(got[True]["regex"][0]) < len(got[True]["plain"][0])
    assert got[True]["json"][0] == _hf_masked_greedy(model, _reference(model, backend, "json_schema", SCHEMA),
                                                     PROMPTS[0], 24)


def test_greedy_rows_check_their_argmax_and_fill_only_the_refused(model, backend):
    """Greedy grammar rows read their unmasked argmax first (always on the CPU, where no forward overlaps a fill), and
    only the rows whose grammar refuses it are filled and masked: the tokens equal the synchronous engine's and HF's
    greedy under the mask, with fewer rows filled than sampled (a string under maxLength: xgrammar's slow fills)."""
    schema = {"type": "array", "items": {"type": "string", "maxLength": 40}, "minItems": 3}
    sampling = _greedy(StructuredOutput.json_schema(schema), max_tokens=20)
    got = {}
    for async_scheduling in (False, True):
        filled, sampled = [], []  # grammar rows each fill masked; grammar rows of each step gone ahead
        engine = _engine(model, backend, async_scheduling=async_scheduling)
        masks = engine.runner.sampler.masks
        apply, greedy = masks.apply, masks.greedy

        def counting_apply(logits, grammars, apply=apply):
            filled.append(sum(g is not None for g in grammars))
            apply(logits, grammars)

        def counting_greedy(logits, grammars, greedy=greedy):
            sampled.append(sum(g is not None for g in grammars))
            return greedy(logits, grammars)

        masks.apply, masks.greedy = counting_apply, counting_greedy
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", prompt, sampling)
        got[async_scheduling] = _run(engine)
        assert engine.block_manager.num_free_blocks == 64
    assert got[True] == got[False]
    assert sampled and 0 < sum(filled) < sum(sampled)  # some rows took their argmax without a fill, some were masked
    reference = _reference(model, backend, "json_schema", schema)
    for i, prompt in enumerate(PROMPTS):
        assert got[True][f"r{i}"][0] == _hf_masked_greedy(model, reference, prompt, 20)


def test_sampling_and_logprobs_keep_to_the_grammar(model, backend):
    engine = _engine(model, backend)
    tokenizer = AutoTokenizer.from_pretrained(model)
    structured = StructuredOutput("regex", REGEX)
    for seed in range(4):
        sampling = SamplingParams(temperature=1.0, seed=seed, max_tokens=24, structured=structured)
        tokens = engine.generate([PROMPTS[1]], sampling)[0]
        assert re.fullmatch(REGEX, tokenizer.decode(tokens, skip_special_tokens=True))
    greedy = engine.generate([PROMPTS[1]], _greedy(structured))[0]
    engine.add_request("lp", PROMPTS[1], _greedy(structured, logprobs=True, top_logprobs=3))
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    assert [t for o in outputs for t in o.new_token_ids] == greedy  # the mask works on a copy; tokens are the same
    raw = [lp for o in outputs for lp in o.new_logprobs]
    assert all(lp.logprob <= 0 for lp in raw)
    # Logprobs are of the raw distribution: its top tokens are not held to the grammar.
    assert any(lp.top[0][0] != lp.token_id for lp in raw)


def test_prefill_then_decode_follows_the_grammar_from_the_first_token(model, backend):
    structured = _greedy(StructuredOutput.json_schema(SCHEMA), max_tokens=20)
    prompt = PROMPTS[1]
    aggregated = _engine(model, backend).generate([prompt], structured)[0]
    prefill, decode = _engine(model, backend), _engine(model, backend)
    prefill.add_request("p", prompt, structured, RequestType.CONTEXT_ONLY)
    outputs = []
    while prefill.has_unfinished_requests():
        outputs.extend(prefill.step())
    (out,) = outputs
    assert out.finish_reason is FinishReason.CONTEXT_DONE
    first = out.new_token_ids[0]
    kv = prefill.export_session(out.session_id)
    prefill.release_session(out.session_id)
    decode.add_request("d", prompt, structured, RequestType.GENERATION_ONLY, kv_import=kv, first_token=first)
    assert [first] + _run(decode)["d"][0] == aggregated
    assert decode.block_manager.num_free_blocks == 64
    with pytest.raises(HandoffMismatch, match="does not fit"):  # a first token the grammar never allows: "x" first
        decode.add_request("bad", prompt, structured, RequestType.GENERATION_ONLY, kv_import=kv,
                           first_token=AutoTokenizer.from_pretrained(model).convert_tokens_to_ids("x"))
    assert not decode.has_unfinished_requests()


def test_a_preempted_request_keeps_its_grammar_state(model, backend):
    # 10 blocks of 4 tokens cannot hold three requests growing past 24 tokens (a digit is a token): someone is
    # preempted and recomputed.
    structured = _greedy(StructuredOutput("regex", "[0-9]{16,40}"), max_tokens=16)
    expected = _engine(model, backend).generate(PROMPTS, structured)
    engine = _engine(model, backend, num_kv_blocks=10, enable_prefix_caching=False, kv_growth_reserve=0)
    assert engine.generate(PROMPTS, structured) == expected
    assert engine.num_preemptions > 0
    assert engine.block_manager.num_free_blocks == 10


@pytest.mark.parametrize("structured, message", [
    (("json_schema", '{"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}'),
     "json_schema cannot be compiled: {first}: .*missing.*; {second}: .*missing"),
    (("regex", "a(b"), "regex cannot be compiled: {first}: .*(parenthesis|unclosed group).*; {second}: "),
    (("grammar", 'root ::= "a" ('), "grammar cannot be compiled: {first}: .*; {second}: "),
])
def test_a_spec_both_backends_refuse_is_invalid_and_the_engine_serves_on(model, backend, structured, message):
    engine = _engine(model, backend)
    other = {"xgrammar": "guidance", "guidance": "xgrammar"}[backend]
    with pytest.raises(InvalidRequest, match=message.format(first=backend, second=other)):
        engine.add_request("bad", PROMPTS[0], _greedy(StructuredOutput(*structured)))
    assert not engine.has_unfinished_requests()
    assert engine.generate([PROMPTS[0]], _greedy(StructuredOutput.choice(["fine"])))[0]


STRUCTURAL_TAG = json.dumps({"type": "structural_tag", "format": {"type": "const_string", "value": "ok"}})


@pytest.mark.parametrize("backend_set, structured, compiled_by", [
    ("xgrammar", ("grammar", 'root ::= "ab" |'), "guidance"),  # an empty alternative: llguidance's Lark takes it
    ("guidance", ("structural_tag", STRUCTURAL_TAG), "xgrammar"),  # xgrammar's form alone
    ("auto", ("structural_tag", STRUCTURAL_TAG), "xgrammar"),
])
def test_a_spec_one_backend_refuses_compiles_on_the_other(model, backend_set, structured, compiled_by):
    engine = _engine(model, backend_set)
    seen = []  # what the worker's metrics count (Grammars.observe): backend and outcome of each compile
    engine.grammars.observe = lambda backend, outcome, seconds: seen.append((backend, outcome))
    structured = StructuredOutput(*structured)
    assert engine.grammars.compile(structured).backend == compiled_by
    assert seen[-1] == (compiled_by, "compiled") and seen[:-1] in ([], [("xgrammar", "refused")])
    tokens = engine.generate([PROMPTS[0]], _greedy(structured))[0]
    _fits(engine, structured, tokens, FinishReason.STOP)


@pytest.mark.parametrize("kind, spec, message", [
    ("yaml", "", "kind must be one of json_schema, json_object, regex, choice, grammar, structural_tag"),
    ("json_schema", "{not json", "json_schema is not valid JSON"),
    ("json_schema", "[1, 2]", "json_schema must be a JSON object"),
    ("json_schema", '{"properties": {"a": {"type": "strin"}}}', "at '/properties/a': type must be one of"),
    ("json_schema", "[" * 70 + "]" * 70, "nests deeper than 64"),
    ("json_object", "{}", "json_object takes no spec"),
    ("regex", " ", "regex is empty"),
    ("choice", '["a", ""]', "choice must be a non-empty array of non-empty strings"),
    ("choice", "[]", "choice must be a non-empty array"),
    ("grammar", "x" * 70000, "grammar has 70000 characters; at most 65536"),
    ("structural_tag", "{}", 'structural_tag must be a JSON object with a "format"'),
])
def test_structured_output_is_checked_when_built(kind, spec, message):
    with pytest.raises(InvalidRequest, match=re.escape(message)):
        StructuredOutput(kind, spec)


def test_a_property_named_type_is_not_a_type():
    schema = {"type": "object", "properties": {"type": {"type": "string"}}, "default": {"type": "anything"}}
    assert StructuredOutput.json_schema(schema).kind == "json_schema"


def test_each_of_n_choices_keeps_to_the_grammar_on_its_own(model, backend):
    engine = _engine(model, backend)
    tokenizer = AutoTokenizer.from_pretrained(model)
    sampling = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=24, structured=StructuredOutput("regex", REGEX))
    engine.add_request("n", PROMPTS[2], sampling)
    choices: dict[int, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            choices.setdefault(out.index, []).extend(out.new_token_ids)
    texts = [tokenizer.decode(choices[i], skip_special_tokens=True) for i in range(3)]
    assert all(re.fullmatch(REGEX, text) for text in texts) and len(set(texts)) > 1, texts
    assert engine.block_manager.num_free_blocks == 64


def test_a_compile_past_its_time_limit_or_without_a_tokenizer_is_refused(model, backend, tiny_llama):
    from common.engine.grammar import Grammars
    from common.errors import FailedPrecondition

    slow = Grammars(model, VOCAB, [2], backend, timeout_s=1e-9)
    with pytest.raises(InvalidRequest, match=rf"compiling the regex \(3 characters\) \({backend}\) took more than "
                                             r"1e-09 s"):
        slow.compile(StructuredOutput("regex", "a+b"))
    slow.close()
    engine = _engine(tiny_llama, backend)  # a weights-only directory: no tokenizer to compile for
    with pytest.raises(FailedPrecondition, match="structured output needs the model's tokenizer"):
        engine.add_request("r", PROMPTS[0], _greedy(StructuredOutput("regex", "a+")))
    assert not engine.has_unfinished_requests()


# Each kind with a spec a random-weight model must finish within max_tokens.
EVERY_KIND = {
    "json_schema": StructuredOutput.json_schema({"type": "object", "properties": {
        "ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["ok", "n"],
        "additionalProperties": False}),
    "json_object": StructuredOutput("json_object"),
    "regex": StructuredOutput("regex", REGEX),
    "choice": StructuredOutput.choice(["yes", "no", "maybe not"]),
    "grammar": StructuredOutput("grammar", 'root ::= "ab" [0-9] [0-9]?'),
}


def _fits(engine: LLMEngine, structured: StructuredOutput, tokens: list[int], finish: FinishReason | None) -> None:
    """Every token taken by the grammar in order; a request that stopped (not cut by length) left it complete."""
    state = engine.grammars.compile(structured).state()
    for token in tokens:
        assert state.accept(token), (structured.kind, tokens)
    if finish is FinishReason.STOP:
        assert state.terminated, (structured.kind, tokens)


@pytest.fixture(scope="module", params=["xgrammar", "guidance"])
def three_engines(model, request) -> tuple[LLMEngine, LLMEngine, LLMEngine]:
    """An aggregated engine, a context phase's and a generation phase's of each backend, shared by the sweep
    below."""
    return _engine(model, request.param), _engine(model, request.param), _engine(model, request.param)


@pytest.mark.parametrize("kind", list(EVERY_KIND))
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_every_choice_s_first_token_is_drawn_under_its_grammar_wherever_it_is_drawn(three_engines, kind, n,
                                                                                     temperature):
    """Aggregated, and context_only → generation_only (each choice's first token from the context phase): the same
    tokens (seeded), every one allowed by the grammar, from the first on; the context phase's pools end empty."""
    structured = EVERY_KIND[kind]
    sampling = SamplingParams(temperature=temperature, seed=7, n=n, max_tokens=24, structured=structured)
    aggregated, prefill, decode = three_engines
    aggregated.add_request("a", PROMPTS[1], sampling)
    whole: dict[int, list[int]] = {}
    finish: dict[int, FinishReason | None] = {}
    while aggregated.has_unfinished_requests():
        for out in aggregated.step():
            whole.setdefault(out.index, []).extend(out.new_token_ids)
            finish[out.index] = out.finish_reason
    prefill.add_request("p", PROMPTS[1], sampling, RequestType.CONTEXT_ONLY)
    outputs = []
    while prefill.has_unfinished_requests():
        outputs += prefill.step()
    firsts = {o.index: o.new_token_ids[0] for o in outputs}
    assert firsts == {i: t[0] for i, t in whole.items()}
    for i in range(n):
        _fits(prefill, structured, [firsts[i]], None)
    ended = [i for i in range(n) if finish[i] is not None and len(whole[i]) == 1]  # the first token ended it
    (session,) = [o.session_id for o in outputs if o.session_id]
    kv = prefill.export_session(session)
    prefill.release_session(session)
    assert prefill.block_manager.num_free_blocks == 64
    if ended:  # (a one-token answer: the router ends it without a decode worker)
        return
    decode.add_request("d", PROMPTS[1], sampling, RequestType.GENERATION_ONLY, kv_import=kv, first_token=firsts[0],
                       more_first_tokens=[firsts[i] for i in range(1, n)], choices=list(range(n)))
    rest: dict[int, list[int]] = {}
    while decode.has_unfinished_requests():
        for out in decode.step():
            rest.setdefault(out.index, []).extend(out.new_token_ids)
            assert out.index not in finish or out.finish_reason in (None, finish[out.index])
    for i in range(n):
        assert [firsts[i]] + rest[i] == whole[i]
        _fits(decode, structured, whole[i], finish[i])
    assert decode.block_manager.num_free_blocks == 64


def test_sampled_grammar_rows_keep_their_state_through_preemption(model, backend):
    """Three sampled regex requests in a pool too small for all of them: someone is preempted and recomputed, and
    each still draws what it draws alone (seeded) and fits its grammar."""
    structured = StructuredOutput("regex", "[0-9]{16,40}")
    sampling = SamplingParams(temperature=0.8, seed=11, max_tokens=16, structured=structured)
    alone = [_engine(model, backend).generate([p], sampling)[0] for p in PROMPTS]
    engine = _engine(model, backend, num_kv_blocks=10, enable_prefix_caching=False, kv_growth_reserve=0)
    assert engine.generate(PROMPTS, sampling) == alone
    assert engine.num_preemptions > 0
    for tokens in alone:
        _fits(engine, structured, tokens, None)
    assert engine.block_manager.num_free_blocks == 10


def test_auto_tries_xgrammar_first_and_a_named_backend_before_the_other():
    from common.engine.grammar_choice import backend_order

    assert backend_order("auto") == ("xgrammar", "guidance")
    assert backend_order("xgrammar") == ("xgrammar", "guidance")
    assert backend_order("guidance") == ("guidance", "xgrammar")


def test_a_tool_call_forced_by_its_grammar_is_a_valid_call_on_either_backend(model, backend):
    """A required call's constraint as the router builds it (Hermes' structural tag, which only xgrammar compiles:
    under guidance it falls back) gives a call the router parses, with arguments valid against the tool's schema."""
    import jsonschema

    from services.router.generation import Tool
    from services.router.tool_parsers import get

    parameters = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                  "required": ["city"], "additionalProperties": False}
    tool = Tool("get_weather", parameters=json.dumps(parameters))
    parser = get("hermes")
    structured = StructuredOutput("structural_tag", parser.constraint((tool,), parallel=False))
    engine = _engine(model, backend)
    assert engine.grammars.compile(structured).backend == "xgrammar"
    tokens = engine.generate([PROMPTS[2]], _greedy(structured, max_tokens=48))[0]
    text = AutoTokenizer.from_pretrained(model).decode(tokens, skip_special_tokens=True)
    content, calls = parser.parse(text, frozenset({"get_weather"}))
    assert [c.name for c in calls] == ["get_weather"], text
    jsonschema.validate(json.loads(calls[0].arguments), parameters)
