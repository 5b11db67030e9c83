"""RouterConfig: the router's flags, validated once at start (off the request path)."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from common.discovery import Role, StaticDiscovery
from common.engine.default_model import resolve_model
from common.errors import InvalidConfig
from services.kit.auth import ApiKeys, add_api_key_args, api_keys_from_args
from services.kit.drain import DEFAULT_DRAIN_TIMEOUT_S
from services.kit.ports import ADVERTISE_HOST_ENV, GRPC_PORT_ENV
from services.router import policies, reasoning_parsers, tool_parsers

DEFAULT_PORT = 50051
DEFAULT_HTTP_PORT = 8000  # vLLM's and SGLang's OpenAI server port, where OpenAI clients are usually pointed
DECODE_STREAMS = ("shared", "per-request")


@dataclass(frozen=True)
class RouterConfig:
    model: str
    """Model directory whose tokenizer (and config.json) the router uses; workers serve the weights."""
    host: str = "127.0.0.1"
    advertise_host: str | None = None
    """The host workers, Consul and the banner name this router by (None: --host, or the hostname for 0.0.0.0)."""
    port: int = DEFAULT_PORT
    http_port: int = DEFAULT_HTTP_PORT
    """OpenAI-compatible HTTP (frontends/openai.py); 0 turns it off."""
    time_relay: bool = False
    """At warm-up, time this router's CPU a relayed token and print it (`disagg up` sizes its routers by it)."""
    reuse_port: bool = False
    """--port and --http-port shared with other routers (SO_REUSEPORT: the kernel spreads new connections over
    them); `disagg up` starts its routers so."""
    model_name: str | None = None
    """The name clients put in GenerateRequest.model; by default what the decode workers announce."""
    policy: str = "round_robin"
    min_remote_prefill_tokens: int = 0
    """Prompts shorter than this run aggregated on a decode worker instead of on a prefill worker."""
    max_local_prefill_tokens: int = 0
    """Prompts with at most this many tokens uncached on the decode worker prefill there (disagg_decision)."""
    max_prefill_queue_tokens: int = 0
    """A prefill worker with this many queued prefill tokens is saturated (prefill goes local); 0: no limit."""
    max_inflight_requests: int = 256
    worker_wait_s: float = 60.0
    """How long a newly discovered worker may stay silent before the router serves without it."""
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    migration_limit: int = 0
    """How many times a request may move to another decode worker when its worker is lost mid-stream."""
    decode_streams: str = "shared"
    """"shared": one Decoder.DecodeMany stream per decode worker carries all of this router's requests there;
    "per-request": a Decoder.Decode stream each (one message per request per engine step: more CPU on both sides)."""
    kv_overlap_weight: float = 1.0
    """kv_aware: cost of one prompt block a prefill worker must compute (not cached there)."""
    kv_load_weight: float = 1.0
    """kv_aware: cost of one block of prefill this router already has queued on the worker."""
    api_keys: ApiKeys = ApiKeys()
    """Keys every front door requires (none: open); services/kit/auth.py."""
    tool_call_parser: str | None = None
    """How tool calls are read out of chat answers (tool_parsers/); None: the one that fits the model's template."""
    reasoning_parser: str | None = None
    """How reasoning is read out of chat answers (reasoning_parsers/); None: no reasoning is read."""

    def __post_init__(self) -> None:
        checks = [
            (0 <= self.port < 65536, f"--port must be in [0, 65535], got {self.port}"),
            (0 <= self.http_port < 65536, f"--http-port must be in [0, 65535] (0 turns HTTP off), got {self.http_port}"),
            (self.policy in policies.names(), f"--policy must be one of {list(policies.names())}, got {self.policy!r}"),
            (self.min_remote_prefill_tokens >= 0,
             f"--min-remote-prefill-tokens must be >= 0, got {self.min_remote_prefill_tokens}"),
            (self.max_local_prefill_tokens >= 0,
             f"--max-local-prefill-tokens must be >= 0, got {self.max_local_prefill_tokens}"),
            (self.max_prefill_queue_tokens >= 0,
             f"--max-prefill-queue-tokens must be >= 0, got {self.max_prefill_queue_tokens}"),
            (self.max_inflight_requests >= 1, f"--max-inflight-requests must be >= 1, got {self.max_inflight_requests}"),
            (self.worker_wait_s > 0, f"--worker-wait must be > 0, got {self.worker_wait_s}"),
            (self.drain_timeout_s >= 0, f"--drain-timeout must be >= 0, got {self.drain_timeout_s}"),
            (self.migration_limit >= 0, f"--migration-limit must be >= 0, got {self.migration_limit}"),
            (self.decode_streams in DECODE_STREAMS,
             f"--decode-streams must be one of {list(DECODE_STREAMS)}, got {self.decode_streams!r}"),
            (self.tool_call_parser in (None, *tool_parsers.names()),
             f"--tool-call-parser must be one of {list(tool_parsers.names())}, got {self.tool_call_parser!r}"),
            (self.reasoning_parser in (None, *reasoning_parsers.names()),
             f"--reasoning-parser must be one of {list(reasoning_parsers.names())}, got {self.reasoning_parser!r}"),
            (self.kv_overlap_weight >= 0 and self.kv_load_weight >= 0,
             f"--kv-overlap-weight and --kv-load-weight must be >= 0, got {self.kv_overlap_weight}, "
             f"{self.kv_load_weight}"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidConfig(message)


def add_router_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default=os.environ.get("DISAGG_HOST", "127.0.0.1"),
                        help="address to bind (env DISAGG_HOST)")
    parser.add_argument("--advertise-host", default=os.environ.get(ADVERTISE_HOST_ENV),
                        help=f"host others reach this router at (default: --host, or the hostname for 0.0.0.0; env "
                             f"{ADVERTISE_HOST_ENV})")
    parser.add_argument("--port", type=int, default=int(os.environ.get(GRPC_PORT_ENV, DEFAULT_PORT)),
                        help=f"0 picks a free port (env {GRPC_PORT_ENV})")
    parser.add_argument("--http-port", type=int, default=int(os.environ.get("DISAGG_HTTP_PORT", DEFAULT_HTTP_PORT)),
                        help=f"OpenAI-compatible HTTP (/v1/chat/completions, ...; default {DEFAULT_HTTP_PORT}); "
                             "0 turns it off (env DISAGG_HTTP_PORT)")
    parser.add_argument("--time-relay", action="store_true",
                        help="at warm-up, time this router's CPU a relayed token and print it (disagg up sizes its "
                             "routers by it)")
    parser.add_argument("--reuse-port", action="store_true",
                        help="share --port and --http-port with other routers started so (SO_REUSEPORT): the kernel "
                             "spreads new connections over them")
    parser.add_argument("--model", default=os.environ.get("DISAGG_MODEL"),
                        help="model directory or 'default' (SmolLM2-135M-Instruct), for the tokenizer (env DISAGG_MODEL)")
    parser.add_argument("--model-name", default=None, help="the model's name for clients (default: the workers')")
    parser.add_argument("--prefill-workers", default=None,
                        help="host:port,... of prefill workers (env DISAGG_PREFILL_WORKERS)")
    parser.add_argument("--decode-workers", default=None,
                        help="host:port,... of decode workers (env DISAGG_DECODE_WORKERS)")
    parser.add_argument("--encode-workers", default=None,
                        help="host:port,... of encode workers, for requests with images (env DISAGG_ENCODE_WORKERS)")
    parser.add_argument("--max-local-prefill-tokens", type=int, default=0,
                        help="prompts with at most this many tokens uncached on the decode worker prefill there")
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    add_routing_args(parser)
    add_api_key_args(parser)


def add_routing_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The router's routing and serving flags: `disagg up` takes them too and passes them on (routing_argv)."""
    parser.add_argument("--policy", choices=policies.names(), default="round_robin", metavar="NAME",
                        # the built-in ones: --help reads the same whatever a process has registered
                        help=f"{', '.join(policies.BUILT_IN)} or a registered one (default %(default)s)")
    parser.add_argument("--min-remote-prefill-tokens", type=int, default=0,
                        help="shorter prompts skip the prefill workers and run aggregated on a decode worker")
    parser.add_argument("--max-prefill-queue-tokens", type=int, default=0,
                        help="prefill tokens queued on a prefill worker at which new prompts prefill on the decode "
                             "worker instead, while it has room (0: no limit)")
    parser.add_argument("--max-inflight-requests", type=int, default=256,
                        help="requests in flight before new ones get RESOURCE_EXHAUSTED")
    parser.add_argument("--worker-wait", type=float, default=60.0,
                        help="seconds a listed worker may stay silent before the router serves without it")
    parser.add_argument("--drain-timeout", type=float, default=DEFAULT_DRAIN_TIMEOUT_S,
                        help="seconds requests in flight may take to finish after SIGTERM, before they are ended "
                             "with UNAVAILABLE")
    parser.add_argument("--kv-overlap-weight", type=float, default=1.0,
                        help="kv_aware: cost per prompt block a prefill worker does not hold in its prefix cache")
    parser.add_argument("--kv-load-weight", type=float, default=1.0,
                        help="kv_aware: cost per block of prefill already queued on a worker")
    parser.add_argument("--migration-limit", type=int, default=0,
                        help="times a request may move to another decode worker when its worker is lost mid-stream "
                             "(0: it ends with UNAVAILABLE)")
    parser.add_argument("--decode-streams", choices=DECODE_STREAMS, default="shared",
                        help="'shared': one DecodeMany stream per decode worker carries every request there (a "
                             "message per engine step); 'per-request': a Decode stream per request")
    # By default the format the model's chat template writes its calls in (hermes for a template without tools).
    tools, reasoning = tool_parsers.names(), reasoning_parsers.names()
    parser.add_argument("--tool-call-parser", type=_name_or_default(tools), default=None, metavar="NAME",
                        help=f"tool calls in chat answers: {', '.join(tools)} (default, or empty: the template's)")
    parser.add_argument("--reasoning-parser", type=_name_or_default(reasoning), default=None, metavar="NAME",
                        help=f"<think> into reasoning_content: {', '.join(reasoning)} (default, or empty: off)")


def _name_or_default(names: tuple[str, ...]):
    """A parser flag's value: one of `names`, or empty for its default, which compose passes for an unset variable
    (a compose command cannot leave a flag out)."""
    def parse(value: str) -> str | None:
        if value and value not in names:
            raise argparse.ArgumentTypeError(f"invalid choice: {value!r} (choose from {', '.join(names)}, or empty)")
        return value or None
    return parse


def routing_argv(args: argparse.Namespace) -> list[str]:
    """add_routing_args's flags as a router command line, with the values of `args` (unset ones left out)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_routing_args(parser)
    out: list[str] = []
    for action in parser._actions:
        value = getattr(args, action.dest)
        if value is not None:
            out.append(f"{action.option_strings[-1]}={value}")
    return out


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    return RouterConfig(
        model=str(resolve_model(args.model)), host=args.host, advertise_host=args.advertise_host, port=args.port,
        http_port=args.http_port, reuse_port=args.reuse_port, time_relay=args.time_relay,
        model_name=args.model_name, policy=args.policy,
        min_remote_prefill_tokens=args.min_remote_prefill_tokens, max_inflight_requests=args.max_inflight_requests,
        max_local_prefill_tokens=args.max_local_prefill_tokens, max_prefill_queue_tokens=args.max_prefill_queue_tokens,
        worker_wait_s=args.worker_wait, drain_timeout_s=args.drain_timeout, migration_limit=args.migration_limit,
        decode_streams=args.decode_streams,
        kv_overlap_weight=args.kv_overlap_weight, kv_load_weight=args.kv_load_weight,
        api_keys=api_keys_from_args(args),
        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
    )


def discovery_from_args(args: argparse.Namespace) -> StaticDiscovery:
    return StaticDiscovery.from_flags({Role.PREFILL: args.prefill_workers, Role.DECODE: args.decode_workers,
                                       Role.ENCODE: args.encode_workers})
