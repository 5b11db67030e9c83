"""`disagg up --device cpu`'s cores: each worker's model on cores of its own with a torch thread a core, the router
and the other threads on what is left; the 2-core default (prefill and decode, a core each) and why; the child's
affinity and environment; the engine thread pinning itself."""
import os
import threading

import pytest

from common.cpu_cores import HELPER_CORES_ENV, MODEL_CORES_ENV, parse_cores, pin_model_thread
from services.cli.cpu_layout import cpu_layout
from services.cli.supervise import Child, stop_all
from services.cli.up import CPU_SPLIT_WHY, parse_args, plan


def test_one_worker_gets_a_core_and_leaves_the_other_to_the_router():
    layout = cpu_layout((0, 1), ["decode-0"])
    assert layout.model_cores == {"decode-0": (0,)} and layout.other_cores == (1,)
    assert layout.env("decode-0") == {MODEL_CORES_ENV: "0", "OMP_NUM_THREADS": "1", HELPER_CORES_ENV: "1"}
    assert layout.describe() == ("CPU cores: models decode-0 on core 0 (a torch thread a core); router and other "
                                 "threads on core 1; with --dtype bfloat16 a prompt's GEMMs borrow the other cores while idle")


def test_more_cores_split_among_the_models_the_remainder_to_decode():
    layout = cpu_layout(tuple(range(8)), ["prefill-0", "decode-0"])
    assert layout.model_cores == {"prefill-0": (0, 1, 2), "decode-0": (3, 4, 5, 6)} and layout.other_cores == (7,)
    assert layout.env("decode-0")["OMP_NUM_THREADS"] == "4"
    assert HELPER_CORES_ENV not in layout.env("decode-0")  # its model's threads spread a GEMM over its own cores


def test_a_model_on_one_core_gets_the_others_as_helper_cores():
    """The 2-core default: prefill's prompts may borrow decode's core while it idles, and the reverse."""
    layout = cpu_layout((0, 1), ["prefill-0", "decode-0"])
    assert layout.env("prefill-0")[HELPER_CORES_ENV] == "1" and layout.env("decode-0")[HELPER_CORES_ENV] == "0"


def test_as_many_workers_as_cores_get_one_each_and_the_rest_runs_anywhere():
    assert cpu_layout((4, 5), ["prefill-0", "decode-0"]).model_cores == {"prefill-0": (4,), "decode-0": (5,)}
    assert cpu_layout((4, 5), ["prefill-0", "decode-0"]).other_cores == (4, 5)
    assert cpu_layout((3,), ["prefill-0", "decode-0"]).model_cores == {"prefill-0": (3,), "decode-0": (3,)}


def test_the_users_thread_count_is_kept():
    layout = cpu_layout((0, 1, 2), ["decode-0"], user_threads="4")
    assert layout.env("decode-0") == {MODEL_CORES_ENV: "0,1"} and "OMP_NUM_THREADS=4 (yours)" in layout.describe()


def test_parse_cores_reads_the_taskset_list_form():
    assert parse_cores("0,2-3, 5") == (0, 2, 3, 5)


def test_up_on_two_cores_splits_a_core_each_and_says_why():
    settled = plan(parse_args([]), cores=(0, 1))
    assert [w.name for w in settled.workers] == ["prefill-0", "decode-0"]
    assert settled.why == CPU_SPLIT_WHY and "aggregated worker (--prefill 0)" in settled.why
    assert settled.cpu.model_cores == {"prefill-0": (0,), "decode-0": (1,)} and settled.cpu.other_cores == (0, 1)
    aggregated = plan(parse_args(["--prefill", "0"]), cores=(0, 1))
    assert [w.name for w in aggregated.workers] == ["decode-0"] and aggregated.why == ""
    assert aggregated.cpu.model_cores == {"decode-0": (0,)} and aggregated.cpu.other_cores == (1,)


@pytest.mark.parametrize("flags", [["--no-cpu-pinning"], ["--tensor-parallel-size", "2"]])
def test_no_pinning_when_asked_or_for_tensor_parallel_cpu_workers(flags):
    assert plan(parse_args(flags), cores=(0, 1, 2, 3)).cpu is None


def test_a_child_starts_on_its_cores_with_its_environment():
    cores = tuple(sorted(os.sched_getaffinity(0)))[-1:]
    probe = "import os, time; time.sleep(0.5); print(sorted(os.sched_getaffinity(0)), os.environ['PROBE'], flush=True)"
    child = Child.start("probe", "timeit", ["-n", "1", "-r", "1", probe], echo=False, env={"PROBE": "yes"},
                        cores=cores)
    try:
        child.process.wait(30)
        child.last_line()  # its output read to the end
        assert f"{list(cores)} yes\n" in child.tail
    finally:
        stop_all([child])


def test_the_stepping_thread_pins_itself_where_up_said(monkeypatch):
    core = sorted(os.sched_getaffinity(0))[0]
    monkeypatch.setenv(MODEL_CORES_ENV, str(core))
    seen = {}

    def step() -> None:
        seen["pinned"] = pin_model_thread()
        seen["affinity"] = os.sched_getaffinity(0)

    thread = threading.Thread(target=step)
    thread.start()
    thread.join()
    assert seen == {"pinned": (core,), "affinity": {core}}
    assert len(os.sched_getaffinity(0)) >= 1  # this thread keeps its own
    monkeypatch.delenv(MODEL_CORES_ENV)
    assert pin_model_thread() is None


def test_up_summary_says_why_it_chose_the_layout_and_where_the_models_run():
    import dataclasses

    from services.cli.banner import summary

    settled = dataclasses.replace(plan(parse_args([]), cores=(0, 1)), model_dir="/models/tiny")
    children = [Child(name, "m", [], address=f"127.0.0.1:{5000 + i}") for i, name in enumerate(settled.names)]
    text = summary(children, settled, "127.0.0.1", 0)
    assert f"\n{CPU_SPLIT_WHY}\n" in text
    assert ("CPU cores: models prefill-0 on core 0, decode-0 on core 1 (a torch thread a core); router and other "
            "threads on cores 0,1; with --dtype bfloat16 a prompt's GEMMs borrow the other cores while idle\n") in text
