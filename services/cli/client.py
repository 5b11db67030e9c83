"""`disagg generate "prompt"`: stream an answer from a running router to the terminal.

It first waits (up to --wait seconds) for the router's health to say SERVING, so that it can be run right after
the router is started: a router that is still starting refuses the connection, or has no decode worker yet.
--api-key (default: DISAGG_API_KEY) is sent as `authorization: Bearer KEY` metadata, for a router that asks one."""
from __future__ import annotations

import argparse
import os
import sys

import grpc

from common import channels, tls
from common.errors import InvalidConfig
from common.pb.disagg.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from services.router.config import DEFAULT_PORT
from services.cli.sampling_flags import add_sampling_args, sampling_from_args
from services.cli.wait import wait_serving
from services.kit.auth import add_client_api_key_arg, client_key, grpc_metadata

DEFAULT_ROUTER = os.environ.get("DISAGG_ROUTER", f"127.0.0.1:{DEFAULT_PORT}")


def build_request(args: argparse.Namespace) -> generation_pb2.GenerateRequest:
    sampling = sampling_from_args(args)
    request = generation_pb2.GenerateRequest(
        model=args.model,
        sampling=common_pb2.SamplingParams(max_tokens=sampling.max_tokens, temperature=sampling.temperature,
                                           top_p=sampling.top_p, repetition_penalty=sampling.repetition_penalty),
        stop=common_pb2.StopConditions(stop=args.stop),
    )
    if sampling.seed is not None:
        request.sampling.seed = sampling.seed
    if args.raw:
        request.prompt = args.prompt
    else:
        if args.system:
            request.chat.messages.add(role="system", content=args.system)
        request.chat.messages.add(role="user", content=args.prompt)
    return request


def _summary(finished: common_pb2.Finished) -> str:
    usage = finished.usage
    reason = common_pb2.FinishReason.Name(finished.reason).removeprefix("FINISH_REASON_").lower()
    rate = usage.completion_tokens / (usage.e2e_ms / 1000) if usage.e2e_ms else 0.0
    return (f"[{reason}: {usage.prompt_tokens} prompt + {usage.completion_tokens} completion tokens, "
            f"ttft {usage.ttft_ms:.0f} ms, {usage.e2e_ms / 1000:.2f} s, {rate:.1f} tokens/s]")


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="disagg generate", description=__doc__)
    parser.add_argument("prompt")
    parser.add_argument("--router", default=DEFAULT_ROUTER, help="host:port of the router (env DISAGG_ROUTER)")
    parser.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    parser.add_argument("--system", default=None, help="a system message (chat only)")
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    parser.add_argument("--model", default="", help="model name (default: the router's)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds before giving up")
    parser.add_argument("--wait", type=float, default=10.0,
                        help="seconds to wait for the router to answer health SERVING before sending (default 10; "
                             "0: send at once)")
    add_sampling_args(parser)
    add_client_api_key_arg(parser)
    tls.add_tls_args(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        tls.configure(tls.tls_from_args(args))
    except InvalidConfig as exc:
        parser.error(str(exc))
    try:
        return _generate(args)
    except KeyboardInterrupt:
        return 130


def _generate(args: argparse.Namespace) -> int:
    metadata = grpc_metadata(client_key(args))
    not_ready = wait_serving(args.router, args.wait, metadata) if args.wait > 0 else None
    with channels.sync_channel(args.router) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        try:
            for response in stub.Generate(build_request(args), timeout=args.timeout, wait_for_ready=False,
                                          metadata=metadata):
                if response.HasField("delta"):
                    sys.stdout.write(response.delta.text)
                    sys.stdout.flush()
                else:
                    print("\n" + _summary(response.finished), file=sys.stderr)
        except grpc.RpcError as exc:
            waited = f" (not SERVING after waiting {args.wait:g}s: {not_ready})" if not_ready else ""
            print(f"\nerror from {args.router}: {exc.code().name}: {exc.details()}{waited}", file=sys.stderr)
            return 1
    return 0
