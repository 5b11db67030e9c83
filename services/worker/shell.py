"""The process every worker (encode, prefill, decode) runs; a RoleSpec says what differs.

Lifecycle: parse flags (a bad setting is one line, `disagg <role>: error: ...`), start the gRPC server
(health NOT_SERVING), load the role's model off the event loop, flip to SERVING and print
`disagg-<role> serving on HOST:PORT`, register (metrics, Consul); on SIGTERM/SIGINT drain (services.kit.drain):
NOT_SERVING and out of Consul at once, new requests refused, those in flight and the pulls of what it holds
run on, up to --drain-timeout; then end what is left, stop the server and free what the role holds; exit 0.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from typing import Any, Protocol, Sequence

import grpc

from common.devices import bind_loop_executor
from common.engine.default_model import model_label
from common.engine.start import teardowns_finished
from common.errors import InvalidConfig
from common.pb.disagg.v1 import worker_pb2, worker_pb2_grpc
from common.tls import add_tls_args, tls_from_args
from common.tls import configure as configure_tls
from services.kit.drain import DEFAULT_DRAIN_TIMEOUT_S, until_idle
from common.heap import settle_heap
from services.kit.observability import Observability, add_observability_args
from services.kit.ports import ADVERTISE_HOST_ENV, GRPC_PORT_ENV, PortTaken, advertised_host
from services.kit.serving import DEFAULT_MAX_MESSAGE_BYTES, Server, setup_logging, start_server
from services.kit.wire import ParseRequests
from services.worker.service import ROLE_NAMES, WorkerRoleAnswers, WorkerServicer, WorkerState

log = logging.getLogger(__name__)
SHUTDOWN_GRACE_S = 5.0  # past --drain-timeout: for the ended requests to send their status
TP_TEARDOWN_WAIT_S = 3.0  # for rank 0's NCCL teardown at exit: the followers leave theirs after 2 s
_LAST_CALLS_GRACE_S = 1.0  # drained: for calls still open (a Release answering, a KV-event stream) to end
_WORKER_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name


class RoleSpec(WorkerRoleAnswers, Protocol):
    """One worker kind: its flags, what it loads, the services it adds besides Worker, and its teardown."""

    role: int
    description: str
    service_names: Sequence[str]  # besides Worker

    def add_args(self, parser: argparse.ArgumentParser) -> None: ...

    def configure(self, args: argparse.Namespace) -> Any:
        """The role's validated config; InvalidConfig / ValueError / FileNotFoundError name the bad flag."""

    def new_state(self, args: argparse.Namespace, config: Any, model_name: str) -> WorkerState: ...

    def add_servicers(self, server: grpc.aio.Server, state: WorkerState, args: argparse.Namespace) -> None: ...

    def load(self, state: WorkerState, config: Any) -> Any:
        """Load the model; runs in a thread, so it may block."""

    async def attach(self, state: WorkerState, loaded: Any) -> None:
        """Make what `load` returned the state's, ready to serve."""

    def registration_meta(self, state: WorkerState) -> dict[str, str]: ...

    async def background(self, state: WorkerState, stop: asyncio.Event) -> None:
        """Work kept up while serving (gauges, expiry); returns soon after `stop` is set."""

    async def held(self, state: WorkerState) -> int:
        """What other workers have still to pull from this one (the drain waits for it)."""

    async def abort(self, state: WorkerState) -> int:
        """End in-flight work (past --drain-timeout); how many requests ended."""

    async def close(self, state: WorkerState) -> str:
        """Free what the role holds once no RPC runs; a summary for the `stopped:` log line."""


class _OneLineParser(argparse.ArgumentParser):
    """A bad flag or setting is one line on stderr, not the whole usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def run_worker(spec: RoleSpec, argv: list[str] | None) -> int:
    name = ROLE_NAMES[spec.role]
    parser = _OneLineParser(prog=f"disagg {name}", description=spec.description)
    _add_process_args(parser)
    spec.add_args(parser)
    add_tls_args(parser)
    add_observability_args(parser)
    args = parser.parse_args(argv)
    setup_logging(name, args.log_level)
    try:
        if args.drain_timeout < 0:
            raise InvalidConfig(f"--drain-timeout must be >= 0, got {args.drain_timeout:g}")
        config = spec.configure(args)
        configure_tls(tls_from_args(args))
    except (InvalidConfig, ValueError, FileNotFoundError) as exc:
        parser.error(str(exc))
    try:
        asyncio.run(_serve(spec, args, config))
        code = 0
    except PortTaken as exc:  # one line, no traceback
        print(f"disagg {name}: {exc}", file=sys.stderr, flush=True)
        code = 2
    except Exception:
        log.exception("the %s worker failed", name)
        code = 1
    return _leave_tensor_parallel(code)


def _leave_tensor_parallel(code: int) -> int:
    """`code`, once any NCCL teardown has finished; one still running after a while (its peers have gone) means
    leaving at once, as a follower rank does: finalising the interpreter beside it aborts the process."""
    if teardowns_finished(TP_TEARDOWN_WAIT_S):
        return code
    log.info("an NCCL communicator is still tearing down after %.0f s; exiting without waiting for it",
             TP_TEARDOWN_WAIT_S)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _add_process_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind")
    g.add_argument("--port", type=int, default=int(os.environ.get(GRPC_PORT_ENV, 0)),
                   help=f"port to bind; 0 picks a free one (env {GRPC_PORT_ENV})")
    g.add_argument("--advertise-host", default=os.environ.get(ADVERTISE_HOST_ENV),
                   help="host others reach this worker at (default: --host, or the hostname for 0.0.0.0; env "
                        f"{ADVERTISE_HOST_ENV})")
    g.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES, metavar="BYTES",
                   help=f"largest gRPC message this worker sends or takes (default {DEFAULT_MAX_MESSAGE_BYTES})")
    g.add_argument("--model-name", default=None, help="model name reported to the router (default: from --model)")
    g.add_argument("--drain-timeout", type=float, default=DEFAULT_DRAIN_TIMEOUT_S,
                   help="seconds requests in flight (and the pulls of what this worker holds) may take after "
                        "SIGTERM before they are ended")
    g.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])


async def _serve(spec: RoleSpec, args: argparse.Namespace, config: Any) -> None:
    stop = asyncio.Event()
    bind_loop_executor(asyncio.get_running_loop(), getattr(config, "device", None))  # --device cuda:N everywhere
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    state = spec.new_state(args, config, args.model_name or model_label(args.model))
    obs = Observability.from_args(state.role_name, state.model_name, args)  # before the server: tracing
    state.metrics = obs.metrics

    def add_servicers(server: grpc.aio.Server) -> None:
        worker_pb2_grpc.add_WorkerServicer_to_server(WorkerServicer(state, spec), server)
        spec.add_servicers(server, state, args)

    server = await start_server(add_servicers, [*spec.service_names, _WORKER_SERVICE], args.host, args.port,
                                args.max_message_bytes, interceptors=[ParseRequests()])
    host = advertised_host(args.host, args.advertise_host)
    state.endpoint = f"{host}:{server.port}"
    started = time.monotonic()
    try:
        if await _load(spec, state, config, stop):
            settle_heap(state.metrics)  # before the first request: one collection over the start-up heap, then none
            await server.set_serving(True)
            note = await _ready_note(spec, state, time.monotonic() - started)
            print(f"disagg-{state.role_name} serving on {state.endpoint} ({note})", flush=True)
            log.info("serving %s as worker %s", state.model_name, state.worker_id)
            await obs.start(args.host, host, server.port, meta=spec.registration_meta(state))
            state.spawn(spec.background(state, stop))
            await stop.wait()
    finally:
        await _shutdown(spec, server, state, obs, args.drain_timeout)


async def _ready_note(spec: RoleSpec, state: WorkerState, load_s: float) -> str:
    """What the ready line says beside the address: how long loading (and warming up) took, the decode rate measured
    after the warm-up, and the KV cache's capacity in tokens where the role has one (`disagg up`'s summary shows it
    and sizes the routers by the rate: services/cli/derive.py)."""
    warm_up_s = getattr(state.engine, "warm_up_s", None)
    rate = getattr(state.engine, "decode_tokens_per_s", None)
    parts = [f"ready in {load_s:.1f} s" + (f", warm-up {warm_up_s:.1f} s" if warm_up_s is not None else "")
             + (f", decodes {rate:.0f} tokens/s at a full batch" if rate is not None else "")]
    if state.kv_layout is not None:
        load = await spec.load_report(state)
        parts.append(f"KV cache {load.kv_blocks_total * state.kv_layout.block_size} tokens")
    speculation = _speculation(state.engine)
    if speculation is not None:
        parts.append(f"speculative decoding {speculation.method}, up to {speculation.num_speculative_tokens} drafts "
                     "a step" + (f" from {speculation.model}" if speculation.model else ""))
    return "; ".join(parts)


def _speculation(engine: Any):
    """The speculative config an AsyncLLMEngine's engine runs with (a prefill worker's has none), else None."""
    config = getattr(getattr(engine, "engine", None), "config", None)
    return getattr(config, "speculative_config", None)


async def _load(spec: RoleSpec, state: WorkerState, config: Any, stop: asyncio.Event) -> bool:
    """Load the model in a thread; False if a signal came first (the load finishes, unused)."""
    loading = asyncio.ensure_future(asyncio.to_thread(spec.load, state, config))
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if not loading.done():
        return False
    await spec.attach(state, loading.result())
    return True


async def _shutdown(spec: RoleSpec, server: Server, state: WorkerState, obs: Observability,
                    drain_timeout_s: float) -> None:
    """Drain, then stop: see the module doc."""
    await server.set_serving(False)  # the router watches health: it stops picking this worker at once
    who = f"{state.role_name} worker {state.endpoint}"
    state.admission.close(f"{who} is draining and takes no new requests; send this one to another "
                          f"{state.role_name} worker")
    await obs.deregister()
    log.info("draining: NOT_SERVING; %d requests in flight, %d held for pulls (up to --drain-timeout %gs)",
             state.admission.inflight, await spec.held(state), drain_timeout_s)
    aborted = 0
    if not await until_idle(state.admission, drain_timeout_s, lambda: spec.held(state)):
        state.stopped = f"{who} draining: --drain-timeout {drain_timeout_s:g}s passed; retry the request"
        log.warning("--drain-timeout %gs passed with %d requests in flight and %d held for pulls; ending them",
                    drain_timeout_s, state.admission.inflight, await spec.held(state))
        aborted = await spec.abort(state)
        await until_idle(state.admission, SHUTDOWN_GRACE_S)  # the ended requests send their status
    drained_s = time.monotonic() - state.admission.closed_at
    state.stopped = state.stopped or f"{who} has stopped"
    await server.stop(_LAST_CALLS_GRACE_S)
    await state.drain(SHUTDOWN_GRACE_S)
    for close in state.closers:
        await close()
    log.info("stopped: drained in %.2fs (%s); aborted %d requests, %s", drained_s, state.admission.summary(),
             aborted, await spec.close(state))
    await obs.stop()

