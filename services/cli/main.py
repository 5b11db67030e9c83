"""The `disagg` command: one subcommand per process or tool, each in its own module."""
from __future__ import annotations

import importlib
import sys

from services.kit.process_exit import exit_process

# subcommand -> (module with main(argv) -> int, one-line help)
SUBCOMMANDS = {
    "run": ("services.cli.run_local", "generate from a prompt with the engine in this process"),
    "prefill": ("services.prefill.__main__", "the prefill worker: context phase, exports KV sessions"),
    "encode": ("services.encode.__main__", "the encode worker: images → embeddings for a LLaVA-style model"),
    "decode": ("services.decode.__main__", "the decode worker: pulls KV, generates, streams tokens"),
    "router": ("services.router.__main__", "the router: tokenise, pick workers, orchestrate prefill → decode"),
    "up": ("services.cli.up", "start router + prefill + decode on this machine, until Ctrl-C"),
    "plan": ("services.cli.plan", "profile the model here and rank every layout for a workload and an SLO"),
    "wait": ("services.cli.wait", "wait until a router (and its workers) answer SERVING"),
    "generate": ("services.cli.client", "stream an answer from a running router"),
    "bench": ("services.cli.bench.main", "load-test a running router: TTFT, ITL, throughput, goodput"),
}
# Subcommands that shut down in order and then leave at once (services.kit.process_exit).
SERVICES = {"prefill", "encode", "decode", "router"}


def main(argv: list[str] | None = None) -> int:
    top_level = argv is None  # the `disagg` command itself, not a caller in this process
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        lines = [f"  {name:<10} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
        print("usage: disagg SUBCOMMAND [args]\n\nsubcommands:\n" + "\n".join(lines), file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module, _ = SUBCOMMANDS[argv[0]]
    code = importlib.import_module(module).main(argv[1:])
    if top_level and argv[0] in SERVICES:
        exit_process(code)
    return code
