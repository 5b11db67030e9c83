"""`disagg up`'s supervision: a dead child is restarted on its gRPC and metrics ports after a back-off that
doubles, then resets; the restart line says how it ended; a child that dies while starting is one line."""
import signal
import time

import pytest

from services.cli.supervise import Child, stop_all, wait_ready


def _dead(child: Child) -> Child:
    child.process.wait(30)
    return child


def test_a_dead_child_restarts_on_its_port_with_doubling_back_off(capsys):
    child = _dead(Child.start("demo", "this", ["--port", "0"], echo=False))  # `python -m this` prints and exits
    child.address = "127.0.0.1:5555"  # as if it had announced it
    try:
        now = time.monotonic()
        child.supervise(now)
        assert child.restart_at == now + 1.0 and "demo exited with code 0" in capsys.readouterr().err
        child.supervise(now + 0.5)
        assert child.restarts == 0  # not yet
        child.supervise(now + 1.0)
        assert child.restarts == 1 and child.args == ["--port", "5555"]
        _dead(child)
        child.supervise(now + 2.0)
        assert child.restart_at == now + 4.0 and "restarting it in 2s" in capsys.readouterr().err
        child.supervise(now + 4.0)
        _dead(child)
        child.started_at = now - 120  # it had run for two minutes: the back-off starts afresh
        child.supervise(now + 5.0)
        assert child.restart_at == now + 6.0
    finally:
        stop_all([child])
    assert child.restart_at is None


def _exits(code: int, output: str = "") -> list[str]:
    """`python -m timeit` arguments that print `output` (if any) and exit with `code`."""
    say = f"print({output!r}, flush=True); " if output else ""
    return ["-n", "1", "-r", "1", f"{say}import os; os._exit({code})"]


def test_the_restart_line_gives_the_exit_code_and_puts_the_last_output_apart(capsys):
    child = _dead(Child.start("demo", "timeit", _exits(3, "bye from demo"), echo=False))
    try:
        child.supervise(time.monotonic())
        lines = capsys.readouterr().err.splitlines()
        assert lines == ["disagg up: demo exited with code 3; restarting it in 1s",
                         "disagg up: demo's last output: bye from demo"]
    finally:
        stop_all([child])


def test_the_restart_line_names_the_signal_that_killed_the_child(capsys):
    child = Child.start("demo", "timeit", ["-n", "1", "-r", "1", "import time; time.sleep(60)"], echo=False)
    try:
        child.process.send_signal(signal.SIGKILL)
        child.process.wait(30)
        child.supervise(time.monotonic())
        lines = capsys.readouterr().err.splitlines()
        assert lines == ["disagg up: demo was killed by SIGKILL; restarting it in 1s"]  # it wrote nothing
    finally:
        stop_all([child])


def test_a_restarted_child_keeps_the_metrics_port_it_announced():
    child = _dead(Child.start("demo", "this", ["--port", "0", "--metrics-port", "0"], echo=False))
    child.address = "127.0.0.1:5555"
    assert child._note("disagg-decode metrics on http://127.0.0.1:9555/metrics\n", child.ready, child.metrics_ready)
    assert child.metrics_url == "http://127.0.0.1:9555/metrics" and child.serves_metrics
    try:
        now = time.monotonic()
        child.supervise(now)
        child.supervise(now + 1.0)
        assert child.args == ["--port", "5555", "--metrics-port", "9555"]  # the free port it got, asked for again
    finally:
        stop_all([child])


def test_a_child_that_dies_while_starting_is_one_line_not_an_rpc_error():
    # it announces an address where nothing answers, then exits: the health check's RPC error is not the story
    child = Child.start("demo", "timeit", _exits(1, "disagg-demo serving on 127.0.0.1:1"), echo=False)
    try:
        with pytest.raises(RuntimeError) as failure:
            wait_ready([child], timeout_s=30)
        assert str(failure.value) == "demo exited with code 1; its last output: disagg-demo serving on 127.0.0.1:1"
    finally:
        stop_all([child])


def test_stop_all_lets_the_router_drain_before_the_workers_stop(monkeypatch):
    import services.cli.supervise as supervise

    waves = []
    monkeypatch.setattr(supervise, "_stop_together", lambda children, grace_s: waves.append([c.name for c in children]))
    stop_all([Child(name, f"services.{name.split('-')[0]}", []) for name in ("router", "prefill-0", "decode-0")])
    # a stream the router is draining still finds a decode worker that takes it
    assert waves == [["router"], ["prefill-0", "decode-0"]]
