"""Async scheduling: the next decode step, or mixed step (decode rows beside prompt chunks), is launched before this
one's tokens are read (engine.py `_launch_ahead`, `_launch_mixed_ahead`). On a GPU it runs where CUDA graphs do;
here it is forced on over the eager CPU path, which takes the same engine-side decisions (which rows go ahead,
blocks for them, rows dropped after a stop token or an abort), so every output must equal the synchronous engine's
and Hugging Face's, and every block must come back. With a CUDA GPU each test runs there too, over CUDA graphs
(tokens read back behind an event)."""
import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.request import RequestType, SamplingParams
from common.kv.layout import PlacedKv
from tests.hf_reference import hf_greedy
from tests.tiny_models import TINY_FAMILIES


def _prompts(lengths, seed=0, vocab=512):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"))]


@pytest.fixture(params=DEVICES)
def make_engine(request):
    """An engine factory on the test's device, counting the steps launched ahead (`engine.ahead_launches`)."""
    device = request.param

    def make(path, async_scheduling: bool, **overrides) -> LLMEngine:
        engine = LLMEngine(EngineConfig(model=path, async_scheduling=async_scheduling, device=device,
                                        **{"block_size": 4, "num_kv_blocks": 256, **overrides}))
        assert (engine.runner.graphs is not None) == (device == "cuda")
        engine.ahead_launches = 0
        launch_ahead = engine.runner.launch_ahead

        def counted(prev, rows, joined=()):
            engine.ahead_launches += 1
            return launch_ahead(prev, rows, joined)

        engine.runner.launch_ahead = counted
        engine.prompt_launches = 0  # prompt steps launched ahead (a prefill worker's)
        prompts_ahead = engine._launch_prompts_ahead

        def counted_prompts(prev):
            step = prompts_ahead(prev)
            engine.prompt_launches += step is not None
            return step

        engine._launch_prompts_ahead = counted_prompts
        engine.mixed_launches = 0  # mixed steps (decode rows beside prompt chunks) launched ahead
        mixed_ahead = engine.runner.launch_mixed_ahead

        def counted_mixed(prev, rows, batch):
            engine.mixed_launches += 1
            return mixed_ahead(prev, rows, batch)

        engine.runner.launch_mixed_ahead = counted_mixed
        return engine

    return make


def _run_all(engine: LLMEngine, tokens: dict[str, list[int]] | None = None) -> dict[str, list[int]]:
    tokens = {} if tokens is None else tokens
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def _all_blocks_free(engine: LLMEngine) -> bool:
    return engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("family", list(TINY_FAMILIES))
def test_greedy_equals_hf_with_steps_launched_ahead(make_engine, tiny_model_dirs, family):
    path = tiny_model_dirs[family]
    engine = make_engine(path, True)
    prompts = _prompts([5, 11, 17])
    lengths = [12, 5, 9]  # rows end by length at different steps: the ahead step leaves them out
    for i, (prompt, n) in enumerate(zip(prompts, lengths)):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    got = _run_all(engine)
    for i, (prompt, n) in enumerate(zip(prompts, lengths)):
        assert got[f"r{i}"] == hf_greedy(path, prompt, n)[0]
    assert engine.ahead_launches > 0
    assert _all_blocks_free(engine)


@pytest.mark.parametrize("family", ["llama-gqa", "qwen3-qknorm", "mistral"])
def test_mixed_steps_launched_ahead_match_hf(make_engine, tiny_model_dirs, family):
    """Prompts chunked 16 tokens a step beside running decodes, some arriving mid-pipeline: the mixed steps go
    ahead (the decode rows' tokens from the step before, on the device), and every output is Hugging Face's."""
    path = tiny_model_dirs[family]
    engine = make_engine(path, True, max_num_batched_tokens=16)
    prompts = _prompts([5, 40, 23, 9, 31], seed=5)
    lengths = [14, 6, 10, 12, 8]
    sampling = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    engine.add_request("r0", prompts[0], sampling[0])
    engine.add_request("r1", prompts[1], sampling[1])
    tokens: dict[str, list[int]] = {}
    for _ in range(4):  # r0 decodes beside r1's chunks when the others arrive
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    for i in range(2, 5):
        engine.add_request(f"r{i}", prompts[i], sampling[i])
    _run_all(engine, tokens)
    for i, (prompt, n) in enumerate(zip(prompts, lengths)):
        assert tokens[f"r{i}"] == hf_greedy(path, prompt, n)[0], i
    assert engine.mixed_launches > 0
    assert _all_blocks_free(engine)


def test_decode_rows_go_ahead_while_a_prompt_waits_for_a_free_row(make_engine, tiny_llama):
    """At the batch's row limit a waiting prompt cannot join: the running rows still go ahead (before, any waiting
    prompt stopped the pipeline until a row finished), and the prompt starts once one does."""
    engine = make_engine(tiny_llama, True, max_num_seqs=2)
    prompts = _prompts([6, 11, 8], seed=7)
    lengths = [9, 14, 6]
    for i, (prompt, n) in enumerate(zip(prompts, lengths)):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    ahead_while_waiting = 0
    while engine.has_unfinished_requests():
        launches = engine.ahead_launches
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        ahead_while_waiting += engine.ahead_launches > launches and bool(engine.scheduler.waiting)
    for i, (prompt, n) in enumerate(zip(prompts, lengths)):
        assert tokens[f"r{i}"] == hf_greedy(tiny_llama, prompt, n)[0]
    assert ahead_while_waiting > 0
    assert _all_blocks_free(engine)


def test_a_stop_token_or_an_abort_in_a_mixed_step_launched_ahead(make_engine, tiny_llama):
    """A row that ends on a stop token while a mixed step is computed ahead for it is dropped from that step, a
    request aborted while its chunk is in the step launched ahead gives back its blocks, and the rest match the
    synchronous engine."""
    prompts = _prompts([6, 35, 9, 28], seed=6)
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    reference = make_engine(tiny_llama, False, max_num_batched_tokens=16).generate(prompts, plain)
    stop_at = reference[0][3]

    def in_flight(engine: LLMEngine, request_id: str, chunk: bool) -> bool:
        """In a mixed step launched ahead (with a prompt chunk, or as a decode row)."""
        ahead = engine._ahead
        return ahead is not None and any(n > 1 for _, n in ahead.scheduled) and any(
            r.request_id == request_id and (n > 1) == chunk for r, n in ahead.scheduled)

    outputs = {}
    for async_scheduling in (False, True):
        engine = make_engine(tiny_llama, async_scheduling, max_num_batched_tokens=16)
        for i, prompt in enumerate(prompts):
            sampling = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at]) if i == 0 else plain
            engine.add_request(f"r{i}", prompt, sampling)
        tokens: dict[str, list[int]] = {}
        stopped_ahead = False  # r0 ended while the step launched ahead held a row for it
        for _ in range(3 if not async_scheduling else 30):
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                stopped_ahead |= out.request_id == "r0" and out.finished and in_flight(engine, "r0", chunk=False)
            if async_scheduling and in_flight(engine, "r3", chunk=True):
                break
        assert not async_scheduling or in_flight(engine, "r3", chunk=True)
        assert engine.abort_request("r3")  # mid-prompt: a chunk of it is being computed
        tokens.pop("r3", None)
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                stopped_ahead |= out.request_id == "r0" and out.finished and in_flight(engine, "r0", chunk=False)
        outputs[async_scheduling] = tokens
        assert _all_blocks_free(engine)
    assert engine.mixed_launches > 0 and stopped_ahead
    assert outputs[True] == outputs[False]
    assert outputs[True]["r0"][-1] == stop_at and len(outputs[True]["r0"]) <= 4
    assert outputs[True]["r1"] == reference[1] and outputs[True]["r2"] == reference[2]


def test_a_stop_token_mid_pipeline_drops_the_row_computed_ahead(make_engine, tiny_llama):
    prompts = _prompts([6, 9, 14], seed=3)
    plain = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    reference = make_engine(tiny_llama, False).generate(prompts, plain)
    stop_at = reference[1][4]  # the second request stops on its fifth token (or earlier, if it repeats)
    outputs = {}
    for async_scheduling in (False, True):
        engine = make_engine(tiny_llama, async_scheduling)
        for i, prompt in enumerate(prompts):
            sampling = SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_at]) if i == 1 else plain
            engine.add_request(f"r{i}", prompt, sampling)
        outputs[async_scheduling] = _run_all(engine)
        assert _all_blocks_free(engine)
    assert outputs[True] == outputs[False]
    assert outputs[True]["r1"][-1] == stop_at and len(outputs[True]["r1"]) <= 5
    assert outputs[True]["r0"] == reference[0] and outputs[True]["r2"] == reference[2]
    assert engine.ahead_launches > 0


def test_an_abort_while_a_step_is_launched_ahead_frees_everything(make_engine, tiny_llama):
    prompts = _prompts([7, 12], seed=4)
    sampling = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    engine = make_engine(tiny_llama, True)
    engine.add_request("keep", prompts[0], sampling)
    engine.add_request("drop", prompts[1], sampling)
    tokens: dict[str, list[int]] = {}
    while engine.ahead_launches == 0 or engine._ahead is None:
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert engine.abort_request("drop")
    # The id is free again at once; the step computed ahead for the old request must not leak into the new one.
    engine.add_request("drop", prompts[1], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    tokens.pop("drop")
    _run_all(engine, tokens)
    assert tokens["keep"] == hf_greedy(tiny_llama, prompts[0], 14)[0]
    assert tokens["drop"] == hf_greedy(tiny_llama, prompts[1], 3)[0]
    assert _all_blocks_free(engine)


def test_requests_arriving_mid_pipeline_match_hf(make_engine, tiny_llama):
    engine = make_engine(tiny_llama, True)
    first, *late = _prompts([7, 3, 13], seed=1)
    sampling = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine.add_request("first", first, sampling)
    tokens: dict[str, list[int]] = {}
    for _ in range(5):  # "first" is decoding, with a step launched ahead, when the others arrive
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert engine._ahead is not None
    for i, prompt in enumerate(late):
        engine.add_request(f"late{i}", prompt, sampling)
    _run_all(engine, tokens)
    assert tokens["first"] == hf_greedy(tiny_llama, first, 12)[0]
    for i, prompt in enumerate(late):
        assert tokens[f"late{i}"] == hf_greedy(tiny_llama, prompt, 12)[0]
    assert _all_blocks_free(engine)


def _placed(exporter: LLMEngine, importer: LLMEngine, prompt: list[int]) -> tuple[PlacedKv, int]:
    """The prompt's KV in the importer's own blocks, as a cuda_ipc pull leaves it, and its first token."""
    exporter.add_request("p", prompt, SamplingParams(temperature=0, max_tokens=12), RequestType.CONTEXT_ONLY)
    _run_all(exporter)
    session = next(s for s in exporter.sessions.sessions.values() if s.request_id == "p")
    reserved = importer.block_manager.reserve(-(-(len(prompt) + 1) // importer.config.block_size))
    importer.runner.import_blocks(reserved[: len(session.block_ids)], exporter.export_session(session.session_id))
    exporter.release_session(session.session_id)
    return PlacedKv(importer.kv_layout, len(prompt), reserved, importer.block_manager.free), session.first_token


def _step(engine: LLMEngine, tokens: dict[str, list[int]]) -> None:
    for out in engine.step():
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)


def handed_off_mid_pipeline(exporter: LLMEngine, engine: LLMEngine, running: list[int], handed_off: list[int],
                            sampling: SamplingParams, steps: int) -> tuple[dict[str, list[int]], int]:
    """"running" decodes, with a step launched ahead, when "joined" arrives as a decode worker gets it (generation_only,
    its KV placed in the engine's blocks, its first token prefill's). The tokens so far, and that first token."""
    placed, first = _placed(exporter, engine, handed_off)
    engine.add_request("running", running, sampling)
    tokens: dict[str, list[int]] = {}
    for _ in range(steps):
        _step(engine, tokens)
    assert engine._ahead is not None
    engine.add_request("joined", handed_off, sampling, RequestType.GENERATION_ONLY, placed, first)
    return tokens, first


def test_a_handed_off_request_joins_the_step_launched_ahead(make_engine, tiny_llama):
    """A decode worker's new request (generation_only, its KV already in our blocks) joins the next step launched
    ahead as one more row, so the pipeline does not stop for it; its tokens and the running one's equal HF's."""
    running, handed_off = _prompts([6, 15], seed=6)
    sampling = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine = make_engine(tiny_llama, True)
    tokens, first = handed_off_mid_pipeline(make_engine(tiny_llama, False), engine, running, handed_off, sampling, 4)
    launches = engine.ahead_launches
    _step(engine, tokens)  # reads the step launched before; launches the next with the new row in it
    assert engine.ahead_launches == launches + 1 and not engine.scheduler.waiting
    assert [r.request_id for r in engine._ahead.sampled] == ["running", "joined"]
    _run_all(engine, tokens)
    assert tokens["running"] == hf_greedy(tiny_llama, running, 12)[0]
    assert [first] + tokens["joined"] == hf_greedy(tiny_llama, handed_off, 12)[0]
    assert _all_blocks_free(engine)


def test_a_joined_request_aborted_in_the_step_it_joined_frees_its_blocks(make_engine, tiny_llama):
    running, handed_off = _prompts([5, 11], seed=9)
    sampling = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    engine = make_engine(tiny_llama, True)
    tokens, _ = handed_off_mid_pipeline(make_engine(tiny_llama, False), engine, running, handed_off, sampling, 3)
    _step(engine, tokens)
    assert "joined" in [r.request_id for r in engine._ahead.sampled]
    assert engine.abort_request("joined")  # while the step it joined still runs
    _run_all(engine, tokens)
    assert tokens["running"] == hf_greedy(tiny_llama, running, 10)[0]
    assert _all_blocks_free(engine)


SAMPLED = {  # temperature > 0, each filter, seeded: the synchronous engine's draws are the reference
    "plain": SamplingParams(temperature=0.9, seed=3, max_tokens=11, ignore_eos=True),
    "top_p": SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=8, ignore_eos=True),
    "top_k": SamplingParams(temperature=1.3, top_k=20, seed=11, max_tokens=13, ignore_eos=True),
    "min_p": SamplingParams(temperature=1.0, min_p=0.05, seed=5, max_tokens=6, ignore_eos=True),
    "greedy": SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
}


@pytest.mark.parametrize("family", ["llama-gqa", "qwen3-qknorm"])
def test_sampled_rows_go_ahead_and_draw_what_the_synchronous_engine_draws(make_engine, tiny_model_dirs, family):
    """Rows with temperature > 0 (the OpenAI default) are drawn on the device too, each seeded draw by its output
    position, so decode and mixed steps go ahead with them, prompts arriving mid-pipeline and chunked beside them,
    and every token is the one the synchronous engine draws."""
    path = tiny_model_dirs[family]
    prompts = _prompts([7, 30, 12, 25, 9], seed=8)
    got = {}
    for async_scheduling in (False, True):
        engine = make_engine(path, async_scheduling, max_num_batched_tokens=16)
        items = list(SAMPLED.items())
        for (rid, sampling), prompt in zip(items[:2], prompts):
            engine.add_request(rid, prompt, sampling)
        tokens: dict[str, list[int]] = {}
        for _ in range(5):
            _step(engine, tokens)
        for (rid, sampling), prompt in zip(items[2:], prompts[2:]):
            engine.add_request(rid, prompt, sampling)
        got[async_scheduling] = _run_all(engine, tokens)
        assert _all_blocks_free(engine)
    assert engine.ahead_launches > 0 and engine.mixed_launches > 0
    assert got[True] == got[False]
    assert {rid: len(t) for rid, t in got[True].items()} == {rid: s.max_tokens for rid, s in SAMPLED.items()}
    assert got[True]["greedy"] == hf_greedy(path, prompts[4], 9)[0]


def test_unseeded_sampled_rows_go_ahead(make_engine, tiny_llama):
    """Unseeded rows draw from the engine's generator on the device: they go ahead as the seeded do."""
    engine = make_engine(tiny_llama, True)
    prompts = _prompts([6, 10], seed=4)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=1.0, top_p=0.95, max_tokens=10,
                                                           ignore_eos=True))
    got = _run_all(engine)
    assert engine.ahead_launches > 0
    assert [len(got[f"r{i}"]) for i in range(2)] == [10, 10]
    assert all(0 <= t < engine.vocab_size for tokens in got.values() for t in tokens)
    assert _all_blocks_free(engine)


def test_logprob_rows_go_ahead_with_the_synchronous_engine_s_logprobs(make_engine, tiny_llama):
    """Logprobs (and the top ones) are computed on the device beside the tokens and read back with them: a batch
    with logprob rows, greedy and sampled, goes ahead, and every token and logprob is the synchronous engine's."""
    prompts = _prompts([5, 8, 6], seed=12)
    samplings = {"greedy": SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logprobs=True),
                 "top": SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, logprobs=True, top_logprobs=3),
                 "sampled": SamplingParams(temperature=0.9, seed=4, max_tokens=8, ignore_eos=True, logprobs=True,
                                           top_logprobs=2)}
    got = {}
    for async_scheduling in (False, True):
        engine = make_engine(tiny_llama, async_scheduling)
        for (rid, sampling), prompt in zip(samplings.items(), prompts):
            engine.add_request(rid, prompt, sampling)
        outputs: dict[str, list] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs.setdefault(out.request_id, []).extend(
                    (t, lp.token_id, round(lp.logprob, 4), [(i, round(v, 4)) for i, v in lp.top])
                    for t, lp in zip(out.new_token_ids, out.new_logprobs))
        got[async_scheduling] = outputs
        assert _all_blocks_free(engine)
    assert engine.ahead_launches > 0
    assert got[True] == got[False]
    assert [t for t, *_ in got[True]["greedy"]] == hf_greedy(tiny_llama, prompts[0], 9)[0]
    assert all(len(top) == 3 for *_, top in got[True]["top"]) and all(t == lp for t, lp, *_ in got[True]["sampled"])


def test_penalty_rows_run_synchronously(make_engine, tiny_llama):
    """A row with penalties samples on the host at once (they count the tokens before it, which a step launched
    ahead has not read): a batch with one never goes ahead, and draws what the synchronous engine draws."""
    prompts = _prompts([5, 8, 6], seed=2)
    samplings = {"greedy": SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                 "sampled": SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=8, ignore_eos=True),
                 "penalty": SamplingParams(temperature=0.7, presence_penalty=0.5, seed=2, max_tokens=8,
                                           ignore_eos=True)}
    got = {}
    for async_scheduling in (False, True):
        engine = make_engine(tiny_llama, async_scheduling)
        for (rid, sampling), prompt in zip(samplings.items(), prompts):
            engine.add_request(rid, prompt, sampling)
        got[async_scheduling] = _run_all(engine)
        assert engine.ahead_launches == 0
        assert _all_blocks_free(engine)
    assert got[True] == got[False]
    assert got[True]["greedy"] == hf_greedy(tiny_llama, prompts[0], 8)[0]


def test_context_only_sessions_are_never_written_ahead(make_engine, tiny_llama):
    """A one-token context_only prompt runs as a decode-shaped step; its blocks become a session, which no
    step launched ahead may write: the session's blocks equal the synchronous engine's, byte for byte."""
    exported = {}
    for async_scheduling in (False, True):
        engine = make_engine(tiny_llama, async_scheduling)
        engine.add_request("ctx", [42], SamplingParams(temperature=0, max_tokens=4), RequestType.CONTEXT_ONLY)
        engine.add_request("gen", _prompts([1], seed=5)[0],
                           SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        outputs = []
        while engine.has_unfinished_requests():
            outputs.extend(engine.step())
        (ctx,) = [o for o in outputs if o.request_id == "ctx"]
        exported[async_scheduling] = engine.runner.export_blocks(engine.sessions.get(ctx.session_id).block_ids)
        engine.release_session(ctx.session_id)
        assert _all_blocks_free(engine)
    assert engine.ahead_launches > 0  # "gen" went on ahead, alone
    assert torch.equal(exported[True], exported[False])


# --- a prefill worker's prompt steps launched ahead (engine.py `_launch_prompts_ahead`) ---

def _prefill_all(engine: LLMEngine, prompts: dict[str, list[int]], sampling: SamplingParams,
                 abort: str | None = None) -> dict[str, tuple[int, torch.Tensor]]:
    """Queue context_only prompts and step until every one has its session: each prompt's first token and its
    session's KV (then released). `abort`: that request is aborted while a prompt step launched ahead computes it."""
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, sampling, RequestType.CONTEXT_ONLY)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.session_id is not None:
                kv = engine.runner.export_blocks(engine.sessions.get(out.session_id).block_ids)
                kv = kv.flatten(2, 3)[:, :, :len(prompts[out.request_id])]  # its tokens (not a last block's rest)
                done[out.request_id] = (out.new_token_ids[0], kv)
                engine.release_session(out.session_id)
        if abort is not None and engine._ahead is not None \
                and abort in [r.request_id for r, _ in engine._ahead.scheduled]:
            assert engine.abort_request(abort)
            abort = None
    assert abort is None, f"{abort} was never in a step launched ahead"
    return done


def _equal_sessions(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for rid, (token, kv) in want.items():
        assert got[rid][0] == token, rid
        assert torch.equal(got[rid][1], kv), rid


# chunks: prompts span steps and share them
PREFILL = {"max_num_batched_tokens": 24, "long_prefill_token_threshold": 16}


def test_prompt_steps_launched_ahead_make_the_synchronous_sessions(make_engine, tiny_llama):
    """A full queue of context_only prompts: each next prompt step goes ahead of the last one's first tokens, and
    every first token and every session's KV equal the synchronous engine's (and the first tokens HF's)."""
    prompts = dict(zip([f"p{i}" for i in range(8)], _prompts([9, 30, 5, 17, 40, 12, 26, 8], seed=11)))
    sampling = SamplingParams(temperature=0, max_tokens=8)
    want = _prefill_all(make_engine(tiny_llama, False, **PREFILL), prompts, sampling)
    engine = make_engine(tiny_llama, True, **PREFILL)
    got = _prefill_all(engine, prompts, sampling)
    assert engine.prompt_launches > 0 and engine.ahead_launches == 0
    _equal_sessions(got, want)
    for rid in ("p0", "p4"):
        assert got[rid][0] == hf_greedy(tiny_llama, prompts[rid], 1)[0][0]
    assert _all_blocks_free(engine)


def test_prompt_steps_go_ahead_only_while_the_queue_fills_them(make_engine, tiny_llama):
    """Fewer queued prompt tokens than a step holds: a prompt arriving during the step would have joined the next
    one, so nothing goes ahead of it."""
    engine = make_engine(tiny_llama, True, **PREFILL)
    # the first step takes 16 of "a" and all of "b"; the 14 tokens of "a" left wait, but fill no step of 24
    _prefill_all(engine, dict(zip(["a", "b"], _prompts([30, 5], seed=2))), SamplingParams(temperature=0, max_tokens=4))
    assert engine.prompt_launches == 0


def test_an_abort_while_a_prompt_step_runs_ahead_frees_everything(make_engine, tiny_llama):
    prompts = dict(zip([f"p{i}" for i in range(6)], _prompts([20, 33, 14, 27, 9, 21], seed=12)))
    sampling = SamplingParams(temperature=0, max_tokens=4)
    want = _prefill_all(make_engine(tiny_llama, False, **PREFILL), prompts, sampling)
    engine = make_engine(tiny_llama, True, **PREFILL)
    got = _prefill_all(engine, prompts, sampling, abort="p1")  # while a step launched ahead computes it
    assert engine.prompt_launches > 0
    _equal_sessions(got, {k: v for k, v in want.items() if k != "p1"})
    assert _all_blocks_free(engine)


def test_a_prompt_step_ahead_preempts_no_one(make_engine, tiny_llama):
    """Two prompts outgrow the pool mid-prompt: the synchronous engine preempts one; a step launched ahead stops
    where blocks run out instead (the rows in flight keep theirs), and the sessions are the same."""
    prompts = dict(zip([f"p{i}" for i in range(4)], _prompts([40, 38, 30, 36], seed=14)))
    sampling = SamplingParams(temperature=0, max_tokens=4)
    small = {"max_num_batched_tokens": 24, "long_prefill_token_threshold": 12, "num_kv_blocks": 16,
             "kv_growth_reserve": 0}  # (admitted while blocks last)
    synchronous = make_engine(tiny_llama, False, **small)
    want = _prefill_all(synchronous, prompts, sampling)
    assert synchronous.num_preemptions > 0
    engine = make_engine(tiny_llama, True, **small)
    got = _prefill_all(engine, prompts, sampling)
    assert engine.prompt_launches > 0
    _equal_sessions(got, want)
    assert _all_blocks_free(engine)
