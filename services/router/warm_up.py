"""Before the request path opens: requests a router runs through its own core before it says SERVING, so that the first
client request finds warm what every request takes beyond the engine (which warms itself, common/engine/warm_up.py): the
tokenizer and chat template, the Python of the request path on both sides of each worker's gRPC stream, a KV handoff
from each prefill worker (docs/benchmarks/first_request.md: with it a fresh `up`'s first gRPC request is as fast as the
next), and each front door's own paths (FrontDoor.warm_up: the OpenAI door's HTTP server).

They are short (a few tokens, below a KV block, so no worker caches or reports a block of theirs), count in no
router metric, and a failure is logged, never kept from serving: the same fault would show in the first request."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from common.discovery import Role
from common.engine.request import SamplingParams
from services.router import frontends
from services.router.generation import ChatMessage, GenerationRequest
from services.router.orchestrator import Orchestrator
from services.router.prepare import RequestPreparer
from services.router.workers import WorkerPool
from services.router.config import RouterConfig

log = logging.getLogger(__name__)

PROMPT = "Hi"
OUTPUT_TOKENS = 2
# The timed requests: RELAY_ROWS at once of RELAY_TOKENS each, so that a decode step's message carries many rows'
# tokens as under load (one row alone pays a whole message a token) and the tokens outweigh a request's own cost.
RELAY_ROWS = 32
RELAY_TOKENS = 32
TIMEOUT_MS = 30_000  # each request's deadline: a worker that does not answer in this is left to the first request


@dataclasses.dataclass(frozen=True)
class WarmUp:
    seconds: float
    cpu_s_per_token: float | None  # this process's CPU a token relayed, measured warm (None: not measured)

    def note(self) -> str:
        """What the router's serving line says of it (`disagg up` sizes --routers by the CPU: cli/derive.py)."""
        relay = (f", {1e6 * self.cpu_s_per_token:.0f} us of CPU a relayed token"
                 if self.cpu_s_per_token is not None else "")
        return f"warm-up {self.seconds:.1f} s{relay}"


async def warm_up(pool: WorkerPool, preparer: RequestPreparer, config: RouterConfig) -> WarmUp:
    """Run the warm-up requests. Through a core of their own (round robin over the workers, no metrics): one
    aggregated request a decode worker, then, with prefill workers, one with a remote prefill a worker of the larger
    role, so every prefill worker hands off and every decode worker takes a handoff; each front door's own; last,
    with --time-relay, a batch of longer aggregated requests whose tokens time the router's CPU a relayed token (the
    process's CPU over the streams, its whole loop and gRPC threads: what more routers would share)."""
    start = time.monotonic()
    cpu_s_per_token = None
    decode, prefill = len(pool.ready(Role.DECODE)), len(pool.ready(Role.PREFILL))
    local = _core(pool, preparer, config, remote=False)
    remote = _core(pool, preparer, config, remote=True)
    chat = GenerationRequest("warm-up-chat", messages=(ChatMessage("user", PROMPT),))
    try:
        await asyncio.to_thread(preparer.prepare, chat, local.served_model())  # the chat template, compiled
        for i in range(decode):
            await _run(local, f"warm-up-local-{i}")
        for i in range(max(decode, prefill) if prefill else 0):
            await _run(remote, f"warm-up-remote-{i}")
        for door in frontends.doors():  # each protocol's own paths (the OpenAI door: an HTTP round trip)
            if door.warm_up is not None:
                await door.warm_up(local, config)
        cpu_s_per_token = await _relay_cost(local) if config.time_relay else None
    except Exception as exc:  # noqa: BLE001 (a worker's RpcError too): serving goes on, cold
        log.warning("router warm-up failed (%s: %s); serving without it", type(exc).__name__, exc)
    finally:
        await local.close()
        await remote.close()
    done = WarmUp(time.monotonic() - start, cpu_s_per_token)
    log.info("warm-up: %d decode and %d prefill workers; %s", decode, prefill, done.note())
    return done


def _core(pool: WorkerPool, preparer: RequestPreparer, config: RouterConfig, remote: bool) -> Orchestrator:
    """A core over the router's pool whose placement sends every prompt to a prefill worker (`remote`) or keeps
    it on the decode worker."""
    placement = dict(min_remote_prefill_tokens=0, max_local_prefill_tokens=0, max_prefill_queue_tokens=0) if remote \
        else dict(min_remote_prefill_tokens=2 ** 31 - 1)
    return Orchestrator(pool, preparer, dataclasses.replace(config, policy="round_robin", **placement))


async def _run(core: Orchestrator, request_id: str, tokens: int = OUTPUT_TOKENS) -> None:
    request = GenerationRequest(request_id, prompt=PROMPT, timeout_ms=TIMEOUT_MS, params=SamplingParams(
        temperature=0, max_tokens=tokens, ignore_eos=True))
    async for _ in core.stream(request):
        pass


async def _relay_cost(core: Orchestrator) -> float:
    """CPU seconds this process spent a token over RELAY_ROWS requests of RELAY_TOKENS tokens run together."""
    cpu = time.process_time()
    await asyncio.gather(*(_run(core, f"warm-up-relay-{i}", RELAY_TOKENS) for i in range(RELAY_ROWS)))
    return (time.process_time() - cpu) / (RELAY_ROWS * RELAY_TOKENS)
