"""A long prefill shares its steps (scheduler.py): decodes first, then prefill chunks of at most
`long_prefill_token_threshold` tokens each, so a prompt that arrives behind a long one is admitted at once
and gets its tokens while the long one is still prefilling. Driven without a model: each step's bookkeeping
is the engine's (computed tokens advance; a request whose chunk reaches its end samples one token)."""
from common.engine.block_manager import BlockManager
from common.engine.config import CPU_LONG_PREFILL_TOKENS, EngineConfig
from common.engine.request import Request, RequestStatus
from common.engine.scheduler import ScheduledBatch, Scheduler

LONG = 7700


def _step(scheduler: Scheduler) -> ScheduledBatch:
    batch = scheduler.schedule()
    for request, n in zip(batch.requests, batch.num_new_tokens):
        request.num_computed_tokens += n
        if request.num_computed_tokens == request.num_tokens:
            request.output_token_ids.append(7)
    return batch


def _scheduled(batch: ScheduledBatch) -> dict[str, int]:
    return {r.request_id: n for r, n in zip(batch.requests, batch.num_new_tokens)}


def _scheduler(threshold, num_blocks=1024, budget=2048) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, 16), max_num_seqs=8, max_num_batched_tokens=budget,
                     long_prefill_token_threshold=threshold)


def test_short_prompt_behind_a_long_prefill_gets_tokens_while_it_still_prefills():
    scheduler = _scheduler(threshold=64)
    long = Request("long", list(range(LONG)))
    scheduler.add(long)
    assert _scheduled(_step(scheduler)) == {"long": 64}
    short = Request("short", [1, 2, 3])
    scheduler.add(short)
    assert _scheduled(_step(scheduler)) == {"long": 64, "short": 3}  # admitted in the very next step
    assert short.output_token_ids == [7] and long.num_computed_tokens == 128
    for _ in range(5):  # then it decodes, first in every step, beside the long prompt's chunks
        batch = _step(scheduler)
        assert [r.request_id for r in batch.requests] == ["short", "long"] and batch.num_new_tokens == [1, 64]
    assert len(short.output_token_ids) == 6 and not long.output_token_ids


def test_without_the_threshold_one_long_chunk_takes_the_whole_step():
    """The cause of the starvation (and still the CUDA default, where such a step takes milliseconds)."""
    scheduler = _scheduler(threshold=None)
    scheduler.add(Request("long", list(range(LONG))))
    _step(scheduler)
    short = Request("short", [1, 2, 3])
    scheduler.add(short)
    for _ in range(2):
        assert _scheduled(_step(scheduler)) == {"long": 2048}
    assert short.status is RequestStatus.WAITING


def test_decodes_come_before_prefill_chunks_when_the_budget_is_short():
    scheduler = _scheduler(threshold=64, budget=8)
    long = Request("long", list(range(200)))
    scheduler.add(long)
    _step(scheduler)  # the long prompt is admitted first, so it stands first in `running`
    streams = [Request(f"s{i}", [1, 2]) for i in range(3)]
    for request in streams:
        scheduler.running.append(request)  # running decodes: prompt computed, one token sampled
        request.status = RequestStatus.RUNNING
        assert scheduler.block_manager.allocate_slots(request, 2)
        request.num_computed_tokens = 2
        request.output_token_ids.append(7)
    assert _scheduled(_step(scheduler)) == {"s0": 1, "s1": 1, "s2": 1, "long": 5}


def test_a_decode_preempted_for_a_later_prefill_chunk_leaves_the_batch():
    """The prefill chunk is scheduled after the decodes, so the victim (the last admitted) may already be in
    the batch: it must leave it, give its budget back and free its blocks."""
    scheduler = _scheduler(threshold=16, num_blocks=4)
    long, decode = Request("long", list(range(60))), Request("decode", list(range(100, 116)))
    scheduler.add(long)
    _step(scheduler)  # long: block 1
    scheduler.add(decode)
    assert _scheduled(_step(scheduler)) == {"long": 16, "decode": 16}  # long: block 2; decode: block 3
    # decode's next token takes the last block, then long's chunk needs one: decode (last admitted) goes
    batch = _step(scheduler)
    assert _scheduled(batch) == {"long": 16} and batch.preempted == [decode]
    assert list(scheduler.waiting) == [decode] and decode.block_table == [] and decode.num_computed_tokens == 0
    assert len(long.block_table) == 3 and scheduler.block_manager.num_free_blocks == 1


def test_the_threshold_defaults_to_a_cpu_chunk_and_no_limit_on_cuda():
    assert EngineConfig(model="m").prefill_chunk_limit == CPU_LONG_PREFILL_TOKENS
    assert EngineConfig(model="m", device="cuda", max_num_batched_tokens=4096).prefill_chunk_limit == 4096
    assert EngineConfig(model="m", device="cuda", long_prefill_token_threshold=512).prefill_chunk_limit == 512


def test_a_prompt_the_leftover_budget_would_split_waits_to_start_whole():
    """A prefill worker's queue (the CUDA default: chunks as large as the budget): the second prompt does not start
    with the sliver of budget the first leaves, which would slow the first's step and still leave it a second
    step; it runs whole in the next one. One the threshold splits anyway (CPU) still shares the step."""
    scheduler = _scheduler(threshold=None)
    first, second = Request("first", list(range(1300))), Request("second", list(range(1500)))
    scheduler.add(first)
    scheduler.add(second)
    assert _scheduled(_step(scheduler)) == {"first": 1300}
    assert second.status is RequestStatus.WAITING and second.num_computed_tokens == 0 and not second.block_table
    assert _scheduled(_step(scheduler)) == {"first": 1, "second": 1500}
    longer = Request("longer", list(range(3000)))  # longer than a step: it is split whatever happens
    scheduler.add(longer)
    assert _scheduled(_step(scheduler)) == {"first": 1, "second": 1, "longer": 2046}

    shared = _scheduler(threshold=512)
    for request in (Request("a", list(range(1300))), Request("b", list(range(1500)))):
        shared.add(request)
    assert _scheduled(_step(shared)) == {"a": 512, "b": 512}


def test_a_step_scheduled_without_preemption_stops_where_blocks_run_out():
    """schedule(preempt=False), for a step launched while another runs (a victim's blocks may be in that one): a
    running prompt short of blocks ends the batch, nobody is preempted, and no newcomer takes blocks before it."""
    scheduler = _scheduler(threshold=64, num_blocks=10, budget=128)
    first, second = Request("first", list(range(80))), Request("second", list(range(100)))
    scheduler.add(first)
    scheduler.add(second)
    assert _scheduled(_step(scheduler)) == {"first": 64, "second": 64}  # 8 of the 10 blocks
    scheduler.add(Request("small", [1, 2, 3]))
    batch = scheduler.schedule(preempt=False)
    # "first" takes one more block; "second" needs 3, one is left: the batch ends there, and "small" (one block)
    # waits rather than take it
    assert _scheduled(batch) == {"first": 16} and not batch.preempted
    assert [r.request_id for r in scheduler.running] == ["first", "second"]
    assert [r.request_id for r in scheduler.waiting] == ["small"]
    assert scheduler.block_manager.num_free_blocks == 1
