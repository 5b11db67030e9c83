"""`disagg up`: router + prefill + decode workers on this machine, as child processes, until Ctrl-C.

Workers bind free ports; the router binds --router-port (50051, what `disagg generate` expects).
Engine flags (--model, --dtype, --device, --block-size, --num-kv-blocks, --gpu-memory-utilization,
--max-num-seqs, ...) go to every worker, merged here with --engine-config FILE.yaml and --engine-overrides JSON
(defaults < YAML < JSON < flags given), and --prefill-engine-overrides / --decode-engine-overrides JSON over
them for that role's workers alone (below its flags given). --model-name and the KV handoff flags (--kv-transports;
the decode workers' --kv-pull-timeout, --kv-load-failure-policy) go to the workers too.
With --device cuda the workers are laid out on the GPUs in order
(--gpus, default all visible; prefill first, each worker its tensor-parallel size of consecutive GPUs; more
ranks than GPUs needs --share-gpus), and with no --prefill/--decode the layout follows the GPUs: half of them
prefill, the rest decode (one GPU: the two share it). With --device cpu each worker's model runs on cores of
its own, a torch thread a core, and the router and the workers' other threads on a core left over where there is
one (services/cli/cpu_layout.py; --no-cpu-pinning turns it off). Each child's log lines are echoed with its name;
a child that dies is restarted on its port with a back-off, so the cluster keeps serving. Each child serves
Prometheus /metrics on a port of its own, kept across its restarts: free ones, or with --metrics-port-base N
router N, then prefill-0.. and decode-0.. on N+1, N+2, ... (a Prometheus scrape list stays right). Ctrl-C or
SIGTERM stops them all (SIGTERM, then SIGKILL after a grace period).

--api-key / --api-key-file (or DISAGG_API_KEY) go to the router: its OpenAI, disagg.v1 and KServe doors then require
the key (services/kit/auth.py). --tls-cert/--tls-key/--tls-ca (--tls-client-auth) go to every process, as
DISAGG_TLS_* do: gRPC between them is TLS, and the router's OpenAI door is HTTPS.

--shared-kv-cache gives every worker one node-wide disk KV tier; without it a --disk-kv-cache-dir DIR is split into
a directory a worker (services/cli/kv_tiers.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import time

from common import tls
from common.tls import TlsConfig
from common.cpu_cores import can_pin, usable_cores
from common.engine.config import gpu_memory_share
from common.engine.default_model import model_label
from common.engine.start import check_startable
from common.errors import InvalidConfig
from services.worker.engine_file import read_json
from services.worker.engine_flags import apply_engine_config, engine_argv, engine_config_from_args
from services.worker.handoff_flags import handoff_argv
from services.router.config import routing_argv
from services.cli import banner, kv_tiers
from services.cli.cpu_layout import CpuLayout, cpu_layout
from services.cli.derive import decode_rate, router_count
from services.cli.placement import (PlacementError, WorkerPlacement, check_gpus, default_counts, memory_share,
                                    place, shares_gpus)
from services.cli.ports import check_metrics_ports, check_port_free, metrics_ports
from services.cli import plan as planning
from services.cli.roles import PLANNER_WORKER_WAIT_S, Slot, reserve_slots, slot_addresses, start_planner
from services.cli.supervise import STOP_MARGIN_S, Child, log, stop_all, wait_ready, with_flag
from services.cli.up_flags import (ONE_GPU_MAX_LOCAL_PREFILL_TOKENS, SEPARATE_GPUS_MAX_LOCAL_PREFILL_TOKENS,
                                   build_parser)
from services.kit.auth import KEY_ENV, api_keys_from_args, grpc_metadata, keys_from_args

# Why `disagg up --device cpu` splits by default, even on two cores: there, prefill and decode on a core each (the
# router beside them) served more than one aggregated worker on a core with the router on the other
# (benchmarks/vllm_cpu.py; docs/benchmarks/vllm_cpu.md).
CPU_SPLIT_WHY = ("prefill-0 and decode-0 by default: on 2 cores, a core each served 1.10x the output tok/s of one "
                 "aggregated worker (--prefill 0) at concurrency 8 with 0.63x its TTFT, and as much at 1")


@dataclasses.dataclass(frozen=True)
class Plan:
    """What `disagg up` starts, settled (and checked) before any process starts."""

    model_name: str
    model_dir: str  # the resolved directory (the default model: under ~/.cache/disagg/models)
    workers: tuple[WorkerPlacement, ...]
    tp: dict[str, int]  # each role's tensor-parallel size
    max_local_prefill_tokens: int
    gpu_memory_utilization: float | None  # each GPU's share for its workers together; each gets memory_share of it
    cpu: CpuLayout | None = None  # --device cpu: each worker's model cores (None: pinning off)
    why: str = ""  # why this layout, where up chose it (the summary says it)
    tls: TlsConfig = TlsConfig()  # every process's (the flags, else DISAGG_TLS_*)
    routers: int = 1  # over the same workers, on the same ports (--routers; derived: 1 until the first is up)
    derive_routers: bool = False  # no --routers: the count follows what the workers and the first router measured
    router_why: str = ""  # why that many, once derived (the summary says it)
    tiers: str = ""  # --shared-kv-cache: where the node-wide KV tier is and its budget (the summary says it)
    slots: list[Slot] | None = None  # --planner: every worker's slot (its ports for both roles), once started

    @property
    def router_names(self) -> list[str]:
        """router, router-1, ...: the first keeps the plain name (and --router-port)."""
        return ["router", *(f"router-{i}" for i in range(1, self.routers))]

    @property
    def names(self) -> list[str]:
        """Every child, in the order metrics ports are handed out: the routers, then prefill-0.., decode-0.."""
        return [*self.router_names, *(w.name for w in self.workers)]


def on_cuda(device: str) -> bool:
    return device == "cuda" or device.startswith("cuda:")


def tp_sizes(args: argparse.Namespace) -> dict[str, int]:
    """Each worker role's tensor-parallel size: its own flag, else --tensor-parallel-size."""
    return {role: getattr(args, f"{role}_tensor_parallel_size") or args.tensor_parallel_size
            for role in ("prefill", "decode")}


def layout(args: argparse.Namespace, visible_gpus: int | None = None) -> list[WorkerPlacement]:
    """Every worker and its GPUs. On CUDA: --gpus (default: every GPU this process sees, torch.cuda.device_count()
    unless `visible_gpus` is given; --device cuda:K alone: K), and with neither --prefill nor --decode the default
    layout (placement.default_counts: half the GPUs prefill, the rest decode; on one GPU they share it)."""
    tp = tp_sizes(args)
    chosen = args.prefill is not None or args.decode is not None
    counts = {role: 1 if getattr(args, role) is None else getattr(args, role) for role in ("prefill", "decode")}
    if not on_cuda(args.device):
        if args.gpus or args.share_gpus:
            raise PlacementError(f"--gpus and --share-gpus place workers on CUDA GPUs; --device is {args.device!r}")
        return place(counts, tp, None)
    _, _, index = args.device.partition(":")
    if index and not index.isdigit():
        raise PlacementError(f"--device takes cuda or cuda:N, got {args.device!r}")
    if index and args.gpus:
        raise PlacementError(f"--device {args.device} names one GPU and --gpus others; give --device cuda with --gpus")
    if visible_gpus is None:
        import torch

        visible_gpus = torch.cuda.device_count()
    gpus = args.gpus or ((int(index),) if index else tuple(range(visible_gpus)))
    check_gpus(gpus, visible_gpus)
    if not chosen:
        counts = default_counts(len(gpus), tp)
    return place(counts, tp, gpus, share=args.share_gpus or not chosen)


def cpu_plan(args: argparse.Namespace, workers: list[WorkerPlacement], cores: tuple[int, ...]) -> CpuLayout | None:
    """Each CPU worker's model cores (services/cli/cpu_layout.py); None on CUDA, with --no-cpu-pinning, with a
    tensor-parallel CPU worker (its ranks are processes of their own that share the worker's cores), or on an OS
    without thread affinity."""
    if (on_cuda(args.device) or args.no_cpu_pinning or any(tp > 1 for tp in tp_sizes(args).values())
            or not can_pin()):
        return None
    return cpu_layout(cores, [w.name for w in workers], os.environ.get("OMP_NUM_THREADS"))


# Engine flags `up` lays the workers out by (or that every worker must share): not a role's to override.
_LAID_OUT = ("model", "device", "tensor-parallel-size", "gpu-memory-utilization")


def role_args(args: argparse.Namespace, role: str) -> argparse.Namespace:
    """The engine flags of `role`'s workers: up's (already merged with --engine-config and --engine-overrides) with
    --{role}-engine-overrides over them, under the flags given. What up lays workers out by stays up's."""
    flag = f"--{role}-engine-overrides"
    layer = read_json(getattr(args, f"{role}_engine_overrides") or "{}", flag)
    for key in layer:
        if str(key).replace("_", "-") in _LAID_OUT:
            raise InvalidConfig(f"{flag}: {key} is up's to lay the workers out by; set it with --{key} or in "
                                f"--engine-config (a role's TP size: --{role}-tensor-parallel-size)")
    merged = argparse.Namespace(**{**vars(args), "engine_config": None, "engine_overrides": None})  # not read again
    return apply_engine_config(merged, (flag, layer))


def worker_argv(args: argparse.Namespace, plan: Plan, worker: WorkerPlacement, metrics_port: int) -> list[str]:
    """A worker's command line: the engine flags (its role's overrides applied), with its own device, TP size and
    memory share, each once."""
    overrides: dict[str, object] = {"tensor_parallel_size": plan.tp[worker.role]}
    if worker.device is not None:
        overrides.update(device=worker.device,
                         gpu_memory_utilization=memory_share(plan.gpu_memory_utilization, worker))
    role = role_args(args, worker.role)
    tier_overrides, tier_switches = kv_tiers.worker_tier_flags(role, worker.name)
    engine = engine_argv(role, **overrides, **tier_overrides) + tier_switches
    named = ["--model-name", args.model_name] if args.model_name else []
    return ["--host", args.host, "--port", "0", "--drain-timeout", str(args.drain_timeout), "--log-level",
            args.log_level, *engine, *named, *handoff_argv(args, worker.role), "--metrics-port", str(metrics_port)]


def router_argv(args: argparse.Namespace, plan: Plan, addresses: dict[str, str], metrics_port: int,
                port: int | None = None, time_relay: bool = False) -> list[str]:
    """A router's command line. Every router binds --router-port and --http-port (SO_REUSEPORT: the kernel spreads
    new connections over them); `port`: the gRPC port the first one bound, for the others (--router-port 0: a free
    one). `time_relay`: it times its CPU a relayed token at warm-up (the first router, where up derives the count)."""
    flags = ["--host", args.host, "--port", str(args.router_port if port is None else port),
             "--http-port", str(args.http_port),
             "--reuse-port",
             "--model", args.model or "default", "--decode-workers", addresses["decode"],
             "--max-local-prefill-tokens", str(plan.max_local_prefill_tokens), "--log-level", args.log_level,
             "--metrics-port", str(metrics_port), *routing_argv(args)]
    keys = (["--api-key-file", os.path.abspath(args.api_key_file)] if args.api_key_file else [])
    keys += ["--api-key-protects-health"] if args.api_key_protects_health else []
    flags += ["--time-relay"] if time_relay else []
    flags += [f"--worker-wait={PLANNER_WORKER_WAIT_S}"] if args.planner else []  # (the silent ports: roles.py)
    return flags + keys + (["--prefill-workers", addresses["prefill"]] if addresses["prefill"] else [])


def router_env(args: argparse.Namespace) -> dict[str, str]:
    """--api-key values reach the router in its environment, not on its command line, which `ps` shows."""
    return {KEY_ENV: ",".join(args.api_key)} if args.api_key else {}


def router_health_metadata(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    """What up's health checks of the router send: a key, where the router's health asks one."""
    return grpc_metadata(keys_from_args(args)[0]) if args.api_key_protects_health else ()


def start_cluster(args: argparse.Namespace, plan: Plan) -> tuple[list[Child], Plan]:
    """Workers first (their addresses go to the routers' flags), then the first router, then the others on its
    ports: --routers of them, or as many as derive.router_count finds in what the workers and the first router
    measured. All SERVING on return, with the plan's router count settled."""
    ports = metrics_ports(plan.names, args.metrics_port_base)
    cpu = plan.cpu
    tls_env = plan.tls.environment()
    slots = reserve_slots(plan.workers, args.host) if args.planner else None
    workers = [Child.start(w.name, f"services.{w.role}", _slot_port(worker_argv(args, plan, w, ports[w.name]), slots, i,
                                                                   w.role),
                           env={**tls_env, **(cpu.env(w.name) if cpu else {})}, cores=cpu.other_cores if cpu else None)
               for i, w in enumerate(plan.workers)]
    for slot, child in zip(slots or [], workers):
        slot.child = child
    children = list(workers)

    def router(index: int, port: int | None = None, time_relay: bool = False) -> Child:
        name = plan.router_names[index]
        metrics = ports[name] if name in ports else _extra_metrics_port(args.metrics_port_base, len(ports), index)
        return Child.start(name, "services.router", router_argv(args, plan, addresses, metrics, port, time_relay),
                           env={**tls_env, **router_env(args)}, cores=cpu.other_cores if cpu else None,
                           health_metadata=router_health_metadata(args))

    try:
        wait_ready(workers, args.start_timeout)
        addresses = (slot_addresses(slots, args.host) if slots else
                     {role: ",".join(c.address for c in workers if c.name.startswith(role))
                      for role in ("prefill", "decode")})
        decode_notes = [c.note for c in workers if c.name.startswith("decode")]
        first = router(0, time_relay=plan.derive_routers and all(decode_rate(n) for n in decode_notes))
        children.insert(0, first)
        wait_ready([first], args.start_timeout)
        if plan.derive_routers:
            spare = max(1, len(usable_cores()) - len(workers))
            count = router_count(decode_notes, first.note, spare)
            plan = dataclasses.replace(plan, routers=count.routers, router_why=count.why)
        bound = int(first.address.rsplit(":", 1)[1])
        replicas = [router(i, bound) for i in range(1, plan.routers)]
        children[1:1] = replicas
        wait_ready(replicas, args.start_timeout)
    except BaseException:
        stop_all(children)
        raise
    return children, dataclasses.replace(plan, slots=slots)


def _slot_port(argv: list[str], slots: list[Slot] | None, index: int, role: str) -> list[str]:
    """--planner: the worker binds its slot's port for its role (the router knows both of every slot's)."""
    return with_flag(argv, "--port", str(slots[index].ports[role])) if slots else argv


def _extra_metrics_port(base: int, taken: int, index: int) -> int:
    """Derived router `index`'s --metrics-port: after the others' with --metrics-port-base (base + taken + index - 1),
    else as theirs (0 free, -1 off)."""
    return base + taken + index - 1 if base > 0 else base


def _interrupt(signum: int, frame: object) -> None:
    # The first one stops everything (SIGTERM as Ctrl-C); one more arriving at once (`timeout` forwarding the SIGTERM
    # it got to its child, a second Ctrl-C) must not raise again in the middle of `stopping...`.
    _ignore_more_interrupts()
    raise KeyboardInterrupt


def _stop_on_interrupts() -> None:
    """Ctrl-C and SIGTERM stop everything, however `up` was started: bash starts a background job (`disagg up &` in
    a script) with SIGINT ignored, and Python then installs no handler of its own, so `up` installs one. (The
    children, spawned after, start with SIGINT at its default again: exec resets a handled signal.)"""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)


def _ignore_more_interrupts() -> None:
    """While the children stop: a second Ctrl-C or SIGTERM (a supervisor's, a shell's) must not cut the stop short
    and leave them running; stop_all's own deadlines bound it."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.decode is not None and args.decode < 1) or (args.prefill is not None and args.prefill < 0):
        parser.error("--decode must be >= 1 and --prefill >= 0")
    try:  # the layout follows the merged values (--device, --tensor-parallel-size from a file too)
        apply_engine_config(args)
        for role in ("prefill", "decode"):
            role_args(args, role)
        kv_tiers.settle(args)  # (its default budget once, for every worker)
        planning.check_up_planning(args)
        if args.plan:
            layout = planning.load_plan(args.plan)
            planning.apply_layout(args, layout, f"{layout.describe()} from --plan {args.plan}")
    except InvalidConfig as exc:
        parser.exit(2, f"disagg up: error: {exc}\n")
    return args


def local_prefill_why(tokens: int, shared: bool) -> str:
    """One line on where prompts prefill by default on GPUs, and why (the summary's)."""
    if shared:
        return (f"prompts of up to {tokens} uncached tokens prefill on the decode worker, longer ones on a prefill "
                "worker: on a shared GPU a remote prefill costs throughput and pays in ITL only past about that "
                "length (docs/benchmarks/disagg_one_gpu.md; --max-local-prefill-tokens to choose)")
    return ("every prompt prefills on a prefill worker: their GPUs are their own, and a prompt prefilled on a decode "
            "GPU would stall its decode steps (--max-local-prefill-tokens to choose)")


def plan(args: argparse.Namespace, visible_gpus: int | None = None, cores: tuple[int, ...] | None = None) -> Plan:
    """The workers' layout, their CPU cores and the router's local-prefill default (no model needed; see
    `preflight`). `cores`: the CPU cores to lay out (default: this process's)."""
    cores = usable_cores() if cores is None else cores
    workers = tuple(layout(args, visible_gpus))
    local = args.max_local_prefill_tokens
    if local is None:
        local = (0 if not on_cuda(args.device) else ONE_GPU_MAX_LOCAL_PREFILL_TOKENS if shares_gpus(workers)
                 else SEPARATE_GPUS_MAX_LOCAL_PREFILL_TOKENS)
    chose = args.prefill is not None or args.decode is not None
    why = CPU_SPLIT_WHY if not on_cuda(args.device) and not chose and len(workers) == 2 else ""
    if on_cuda(args.device) and args.max_local_prefill_tokens is None and any(w.role == "prefill" for w in workers):
        why = local_prefill_why(local, shares_gpus(workers))
    why = getattr(args, "planned_why", None) or why
    return Plan(args.model_name or model_label(args.model), "", workers, tp_sizes(args), local,
                gpu_memory_share(args.device, args.gpu_memory_utilization, args.num_kv_blocks),
                cpu_plan(args, list(workers), cores), why, routers=args.routers or 1,
                derive_routers=args.routers is None, tiers=kv_tiers.summary(args))


def routers_ports(args: argparse.Namespace) -> dict[str, int]:
    """The routers' gRPC and HTTP port by the flag that sets it."""
    return {"--router-port": args.router_port, "--http-port": args.http_port}


def router_ports_busy(args: argparse.Namespace) -> str | None:
    """The routers' gRPC and HTTP port free, else one line."""
    return (check_port_free(args.host, args.router_port, "--router-port")
            or check_port_free(args.host, args.http_port, "--http-port"))


def preflight(args: argparse.Namespace) -> Plan:
    """What would stop the cluster, found before any process loads a model: InvalidConfig (one line) if anything."""
    if args.routers is not None and args.routers < 1:
        raise InvalidConfig(f"--routers must be at least 1, got {args.routers}")
    settled = plan(args)
    busy = (router_ports_busy(args)
            or check_metrics_ports(settled.names, args.metrics_port_base, args.host, routers_ports(args)))
    if busy:
        raise InvalidConfig(busy)
    settings = tls.tls_from_args(args)  # the flags, else DISAGG_TLS_*: every child gets them
    if settings.serves_tls and not settings.dials_tls:
        raise InvalidConfig("--tls-cert needs --tls-ca: every process serves TLS, and the router and up dial them "
                            "with the CA that signed it")
    tls.configure(settings)
    api_keys_from_args(args)  # a key file that cannot be read, said before anything starts
    try:
        config = engine_config_from_args(args)  # the model resolves (the default one is converted once, here)
        for worker in settled.workers:  # and every worker's flags hold, before any process loads the model
            role_config = engine_config_from_args(role_args(args, worker.role))
            check_startable(role_config.replace(device=worker.device or config.device,
                                                tensor_parallel_size=settled.tp[worker.role]))
    except (ValueError, FileNotFoundError) as exc:
        raise InvalidConfig(str(exc)) from None
    return dataclasses.replace(settled, model_dir=config.model, tls=settings)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.workload:  # the best layout for it, measured here (a cached profile, or one taken now)
            planning.apply_layout(args, *planning.best_layout(args, log))
        settled = preflight(args)
    except InvalidConfig as exc:
        log(str(exc))
        return 2
    for merged in ("DISAGG_ENGINE_CONFIG", "DISAGG_ENGINE_OVERRIDES"):  # the workers get the merged values as flags:
        os.environ.pop(merged, None)  # a file read again under them would set what they leave unset (None, false)
    _stop_on_interrupts()
    children: list[Child] = []
    planner = None
    try:
        children, settled = start_cluster(args, settled)
        print(banner.summary(children, settled, args.host, args.http_port, keyed=bool(keys_from_args(args))),
              flush=True)
        if args.planner:
            planner = start_planner(args, settled.slots, settled.router_names, children,
                                    lambda placement, port: worker_argv(args, settled, placement, port))
        while True:
            now = time.monotonic()
            for child in list(children):  # (the planner's moves change the list)
                child.supervise(now)
            time.sleep(0.2)
    except KeyboardInterrupt:
        print("\nstopping...", file=sys.stderr)
        return 0
    except RuntimeError as exc:
        log(f"failed: {exc}")
        return 1
    finally:
        _ignore_more_interrupts()
        if planner is not None:
            planner.stopped.set()
        stop_all(children, args.drain_timeout + STOP_MARGIN_S)
