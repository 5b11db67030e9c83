"""`disagg up`'s supervision: a dead child is restarted on its port after a back-off that doubles, then resets."""
import time

from services.supervise import Child, stop_all


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
