"""Soak: load against router → prefill → decode processes for a set time; RSS, errors and leaked blocks.

    python -m benchmarks.soak --minutes 10                 # SmolLM2-135M-Instruct (the default model)
    python -m benchmarks.soak --minutes 2 --tiny           # a tiny random model with SmolLM2's tokenizer

Starts the three processes itself (float32, OMP_NUM_THREADS=1 each), then keeps --concurrency requests
in flight: mixed prompt lengths (a few words to a few hundred tokens), mixed max_tokens, greedy or seeded
sampling, a share of them cancelled at a random point (right away, after a delay, or after k tokens),
half on Generate and half on GenerateStream. Prints the RSS of every process at the start (after a
warm-up), every minute and at the end, request and error counts, and what every worker still holds
once the load has stopped (leaked KV blocks, sessions, stored tensors, running/waiting requests).
Greedy requests are also checked for consistency: the same prompt must give the same tokens every time.
Exit status 1 if there was any error, leak or inconsistency. Not a CI test.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from common.engine.default_model import default_model_dir
from common.pb.disagg.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from benchmarks.worker_load import leaks, load_of
from benchmarks.processes import ServiceProcess, start_services

_CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}
_WORDS = ["river", "stone", "lamp", "harbour", "winter", "orchard", "copper", "signal", "garden", "thunder", "paper", "violin", "maple", "tide", "lantern", "meadow", "glass", "falcon", "ember", "canyon"]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def make_prompts(rng: random.Random, count: int, longest: int) -> list[str]:
    """Short, medium and long prompts (a few words to `longest`)."""
    lengths = [rng.choice([3, 8, 20, longest // 4, longest // 2, longest]) for _ in range(count)]
    return [" ".join(rng.choice(_WORDS) for _ in range(n)) for n in lengths]


@dataclass
class Tally:
    started: int = 0
    outcomes: collections.Counter = field(default_factory=collections.Counter)
    tokens: int = 0
    greedy_seen: dict = field(default_factory=dict)  # (prompt, max_tokens) → tokens of the first full answer
    inconsistent: int = 0
    error_samples: list = field(default_factory=list)

    def error(self, what: str, detail: str) -> None:
        self.outcomes[f"error {what}"] += 1
        if len(self.error_samples) < 10:
            self.error_samples.append(f"{what}: {detail}")


class Load:
    def __init__(self, address: str, prompts: list[str], args: argparse.Namespace):
        self.address = address
        self.prompts = prompts
        self.args = args
        self.rng = random.Random(args.seed)
        self.tally = Tally()
        self.stop_at = 0.0
        self._next_id = 0

    def _request(self) -> tuple[generation_pb2.GenerateRequest, str | None, float, int]:
        """A request, how it is to be cancelled (None, 'now', 'delay', 'tokens'), the delay and the token count."""
        self._next_id += 1
        prompt = self.rng.choice(self.prompts)
        greedy = self.rng.random() < 0.7
        sampling = common_pb2.SamplingParams(temperature=0, max_tokens=self.rng.choice([1, 8, 32, 64, 128]))
        if not greedy:
            sampling.temperature, sampling.top_p, sampling.seed = 0.8, 0.95, self.rng.randrange(2**31)
        cancel = self.rng.choice(["now", "delay", "tokens"]) if self.rng.random() < self.args.cancel_fraction else None
        request = generation_pb2.GenerateRequest(request_id=f"soak-{self._next_id}", prompt=prompt, sampling=sampling)
        return request, cancel, self.rng.uniform(0, 0.5), self.rng.randint(1, 16)

    def _record(self, request, tokens: list[int], finished: common_pb2.Finished | None, cancelled: bool) -> None:
        tally = self.tally
        tally.tokens += len(tokens)
        if finished is not None and finished.reason == common_pb2.FINISH_REASON_ERROR:
            tally.error(_CODE_NAMES.get(finished.error.code, str(finished.error.code)), finished.error.message)
            return
        if cancelled and (finished is None or finished.reason == common_pb2.FINISH_REASON_CANCELLED):
            tally.outcomes["cancelled"] += 1
            return
        tally.outcomes["completed"] += 1
        if request.sampling.temperature == 0:
            key = (request.prompt, request.sampling.max_tokens)
            first = tally.greedy_seen.setdefault(key, tokens)
            if first != tokens:
                tally.inconsistent += 1

    async def _unary(self, stub) -> None:
        request, cancel, delay, after = self._request()
        call = stub.Generate(request, timeout=300)
        tokens, finished, cancelled = [], None, False
        try:
            if cancel == "now":
                cancelled = call.cancel()
            elif cancel == "delay":
                asyncio.get_running_loop().call_later(delay, call.cancel)
                cancelled = True
            async for response in call:
                if response.HasField("delta"):
                    tokens += response.delta.token_ids
                    if cancel == "tokens" and len(tokens) >= after and not cancelled:
                        cancelled = call.cancel()
                else:
                    finished = response.finished
        except asyncio.CancelledError:
            if not cancelled:
                raise
        except grpc.aio.AioRpcError as error:
            if not (cancelled and error.code() == grpc.StatusCode.CANCELLED):
                self.tally.error(error.code().name, error.details())
                return
        self._record(request, tokens, finished, cancelled)

    async def _stream(self, stub, size: int) -> None:
        call = stub.GenerateStream(timeout=300)
        plans = [self._request() for _ in range(size)]
        by_id = {p[0].request_id: p for p in plans}
        tokens = collections.defaultdict(list)
        cancelled: set[str] = set()
        writing = asyncio.Lock()

        async def cancel(request_id: str) -> None:
            cancelled.add(request_id)
            async with writing:
                await call.write(generation_pb2.GenerateStreamRequest(cancel=common_pb2.Cancel(request_id=request_id)))

        async def start(request, how, delay) -> None:
            async with writing:
                await call.write(generation_pb2.GenerateStreamRequest(start=request))
            if how == "now":
                await cancel(request.request_id)
            elif how == "delay":
                await asyncio.sleep(delay)
                await cancel(request.request_id)

        starts = [asyncio.create_task(start(r, how, delay)) for r, how, delay, _ in plans]
        open_ids = set(by_id)
        try:
            async for response in call:
                rid = response.request_id
                request, how, _, after = by_id[rid]
                if response.HasField("delta"):
                    tokens[rid] += response.delta.token_ids
                    if how == "tokens" and len(tokens[rid]) >= after and rid not in cancelled:
                        await cancel(rid)
                    continue
                open_ids.discard(rid)
                self._record(request, tokens[rid], response.finished, rid in cancelled)
                if not open_ids:
                    await asyncio.gather(*starts)
                    async with writing:
                        await call.done_writing()
        except grpc.aio.AioRpcError as error:
            self.tally.error(f"stream {error.code().name}", error.details())
        finally:
            for task in starts:
                task.cancel()

    async def _worker(self, stub) -> None:
        while time.monotonic() < self.stop_at:
            if self.rng.random() < 0.5:
                self.tally.started += 1
                await self._unary(stub)
            else:
                size = self.rng.randint(2, 4)
                self.tally.started += size
                await self._stream(stub, size)

    async def run(self, seconds: float, on_minute) -> None:
        self.stop_at = time.monotonic() + seconds
        async with grpc.aio.insecure_channel(self.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            reporter = asyncio.create_task(_every_minute(on_minute))
            try:
                await asyncio.gather(*(self._worker(stub) for _ in range(self.args.concurrency)))
            finally:
                reporter.cancel()


async def _every_minute(callback) -> None:
    minute = 0
    while True:
        await asyncio.sleep(60)
        minute += 1
        callback(minute)


def _rss_line(processes: list[ServiceProcess]) -> str:
    return ", ".join(f"{p.role} {rss_mib(p.popen.pid):.0f} MiB" for p in processes)


def _wait_idle(workers: list[ServiceProcess], timeout_s: float) -> list:
    deadline = time.monotonic() + timeout_s
    while True:
        loads = [load_of(p) for p in workers]
        if not any(leaks(load) for load in loads) or time.monotonic() > deadline:
            return loads
        time.sleep(0.2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--tiny", action="store_true", help="a tiny random model instead of SmolLM2-135M")
    parser.add_argument("--model", default=None, help="a model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--concurrency", type=int, default=8, help="requests kept in flight (a stream counts once)")
    parser.add_argument("--cancel-fraction", type=float, default=0.2)
    parser.add_argument("--num-kv-blocks", type=int, default=512)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    temp = tempfile.TemporaryDirectory(prefix="soak-")
    if args.tiny:
        from benchmarks.text_model import make_text_model
        model = str(make_text_model(Path(temp.name)))
    else:
        model = args.model or str(default_model_dir())
    env = {"OMP_NUM_THREADS": "1"}
    worker_args = ("--model", model, "--num-kv-blocks", str(args.num_kv_blocks))
    workers = start_services([("prefill", worker_args), ("decode", worker_args)], env=env)
    processes = list(workers)
    failed = True
    try:
        processes += start_services([("router", ("--model", model, "--prefill-workers", workers[0].address,
                                                 "--decode-workers", workers[1].address))], env=env)
        rng = random.Random(args.seed)
        load = Load(processes[-1].address, make_prompts(rng, 24, 100 if args.tiny else 300), args)
        print(f"soak: model {model}, {args.minutes:g} min, concurrency {args.concurrency}, "
              f"cancel fraction {args.cancel_fraction}", flush=True)
        asyncio.run(load.run(min(20.0, args.minutes * 60), lambda m: None))  # warm-up, not counted below
        warm = load.tally
        load.tally = Tally(greedy_seen=warm.greedy_seen)
        start_rss = {p.role: rss_mib(p.popen.pid) for p in processes}
        print(f"RSS at start (after a {min(20.0, args.minutes * 60):.0f}s warm-up): {_rss_line(processes)}", flush=True)
        started = time.monotonic()

        def on_minute(minute: int) -> None:
            t = load.tally
            print(f"  minute {minute}: {t.started} requests started, {dict(t.outcomes)}, {t.tokens} tokens; "
                  f"RSS {_rss_line(processes)}", flush=True)

        asyncio.run(load.run(args.minutes * 60, on_minute))
        elapsed = time.monotonic() - started
        tally = load.tally
        end_rss = {p.role: rss_mib(p.popen.pid) for p in processes}
        print(f"RSS at end: {_rss_line(processes)}")
        print("RSS growth: " + ", ".join(f"{role} {end_rss[role] - start_rss[role]:+.1f} MiB" for role in end_rss))
        errors = sum(n for t in (warm, tally) for what, n in t.outcomes.items() if what.startswith("error"))
        print(f"requests: {tally.started} started in {elapsed:.0f}s ({tally.started / elapsed:.1f}/s), "
              f"{dict(tally.outcomes)}; {tally.tokens} tokens delivered ({tally.tokens / elapsed:.1f}/s); "
              f"warm-up: {warm.started} requests, {dict(warm.outcomes)}")
        print(f"errors (warm-up included): {errors}"
              + "".join(f"\n  {sample}" for sample in warm.error_samples + tally.error_samples))
        print(f"greedy consistency: {len(tally.greedy_seen)} distinct greedy requests, {tally.inconsistent} "
              "repeats that differed from the first answer")
        loads = _wait_idle(workers, 15.0)
        leaked = 0
        for process, worker_load in zip(workers, loads):
            held = worker_load.kv_blocks_total - worker_load.kv_blocks_free
            leaked += held + len(leaks(worker_load))
            print(f"{process.role}: leaked KV blocks {held} of {worker_load.kv_blocks_total}, "
                  f"sessions {worker_load.active_kv_sessions}, stored tensors {worker_load.stored_tensors}, "
                  f"running {worker_load.running_requests}, waiting {worker_load.waiting_requests}, "
                  f"expired sessions {worker_load.expired_kv_sessions}")
        failed = bool(errors or leaked or tally.inconsistent)
    finally:
        codes = [p.stop() for p in processes]
        print("exit codes: " + ", ".join(f"{p.role} {code}" for p, code in zip(processes, codes)))
        tracebacks = [p.role for p in processes if "Traceback" in p.log()]
        if tracebacks:
            print(f"tracebacks in the logs of: {tracebacks}")
            failed = True
        temp.cleanup()
    print("SOAK FAILED" if failed else "SOAK OK")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
