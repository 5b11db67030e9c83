"""The summary `disagg up` prints once everything is SERVING: every address, the model's directory, each worker's
GPUs, the metrics endpoints and commands to try."""
from __future__ import annotations

import collections
from typing import TYPE_CHECKING

from services.cli.placement import WorkerPlacement, memory_share, shares_gpus
from services.cli.supervise import Child

if TYPE_CHECKING:
    from services.cli.up import Plan


def summary(children: list[Child], plan: "Plan", host: str, http_port: int, keyed: bool = False) -> str:
    """`keyed`: the router requires an API key (the commands send $DISAGG_API_KEY; the key itself is never shown)."""
    router = children[0].address
    placed = {w.name: w for w in plan.workers}
    replicas = "".join(f"  {c.name:<10} {c.address}" + (f", HTTP on port {http_port}" if http_port else "")
                       + "  (a replica on the same ports: new connections are spread over the routers)\n"
                       for c in children[1:plan.routers])
    workers = "\n".join(f"  {c.name:<10} {c.address}  (gRPC: Worker, Prefiller/Decoder, TensorStore)"
                        + (f"  on {placed[c.name].gpus_text()}" if placed[c.name].devices else "")
                        + (f"; {c.note}" if c.note else "")
                        for c in children[plan.routers:])
    metrics = "\n".join(f"  {c.name:<10} {c.metrics_url}" for c in children if c.metrics_url)
    ca = plan.tls.ca if plan.tls.serves_tls else None
    http = f"{'https' if ca else 'http'}://{host}:{http_port}" if http_port else None
    curl_flags = (f" --cacert {ca}" if ca else "") + (' -H "Authorization: Bearer $DISAGG_API_KEY"' if keyed else "")
    grpcurl_flags = (f"-cacert {ca}" if ca else "-plaintext") + (
        ' -H "authorization: Bearer $DISAGG_API_KEY"' if keyed else "")
    http_lines = (f"""  curl -N{curl_flags} {http}/v1/chat/completions -H 'Content-Type: application/json' \\
      -d '{{"messages": [{{"role": "user", "content": "Hi!"}}], "stream": true}}'
""" if http else "")
    # The key is never printed; a user who gave it as --api-key has no $DISAGG_API_KEY in their shell yet.
    key_line = "  export DISAGG_API_KEY=...   # the router's key: the commands below send it\n" if keyed else ""
    return f"""
disagg is up: router on {router} (gRPC: disagg.v1.Generation, KServe v2 inference.GRPCInferenceService)
{f"  OpenAI-compatible HTTP on {http}/v1" if http else "  OpenAI-compatible HTTP off (--http-port 0)"}
  model {plan.model_name}: {plan.model_dir}  (the --tokenizer of aiperf, guidellm, vLLM's bench)
{replicas}{workers}
{sharing(plan.workers, plan.gpu_memory_utilization)}\
{placement_notes(plan)}\
{router_note(plan)}\
{f"Prometheus /metrics (kept across restarts):{chr(10)}{metrics}" if metrics else "Prometheus /metrics off"}

{key_line}  disagg generate "Tell me about the sea" --router {router}{f" --tls-ca {ca}" if ca else ""}
  grpcurl {grpcurl_flags} {router} list
  grpcurl {grpcurl_flags} -d '{{"prompt": "The sea is", "sampling": {{"max_tokens": 32, "temperature": 0}}}}' \\
      {router} disagg.v1.Generation/Generate
{http_lines}
A process that dies is restarted. Ctrl-C stops everything.
"""


def placement_notes(plan: "Plan") -> str:
    """Why `up` chose this layout, where the CPU workers' models run and where the node-wide KV tier is: a line
    each, where there is one."""
    lines = [plan.why, plan.cpu.describe() if plan.cpu else "", plan.tiers]
    return "".join(f"{line}\n" for line in lines if line)


def router_note(plan: "Plan") -> str:
    """Why this many routers, where up derived the count (services/cli/derive.py): one line."""
    return f"{plan.router_why}\n" if plan.router_why else ""


def sharing(workers: tuple[WorkerPlacement, ...], utilization: float | None) -> str:
    """One line when GPUs hold several workers: which, and each one's share of the memory; else nothing."""
    if not shares_gpus(workers):
        return ""
    load = collections.Counter(d for w in workers for d in w.devices)
    where = ", ".join(f"{n} on cuda:{d}" for d, n in sorted(load.items()) if n > 1)
    if utilization is None:
        memory = "each sizes its KV cache from --num-kv-blocks"
    else:
        shares = ", ".join(f"{w.name} {memory_share(utilization, w):g}" for w in workers)
        memory = f"--gpu-memory-utilization {utilization:g} is divided by the workers on each GPU: {shares}"
    return f"GPUs shared by several workers ({where}): {memory}\n"
