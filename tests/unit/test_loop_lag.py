"""The router's event-loop lag probe (services/router/loop_lag.py): it observes how late its timer fires while a
request is in flight, and does not run while none is."""
import asyncio
import time

from services.router.loop_lag import LoopLagProbe


def test_a_busy_loop_shows_as_lag_and_an_idle_router_runs_no_probe():
    lags: list[float] = []
    in_flight = [0]

    async def main():
        probe = LoopLagProbe(lags.append, lambda: in_flight[0] > 0, interval_s=0.01)
        await asyncio.sleep(0.05)
        assert probe._task is None and lags == []  # nothing in flight: no timer at all
        in_flight[0] += 1
        probe.start()
        await asyncio.sleep(0.03)  # a few quiet rounds
        time.sleep(0.15)  # the loop held, as a router relaying too many tokens holds it
        await asyncio.sleep(0.03)
        in_flight[0] -= 1
        await asyncio.sleep(0.05)
        assert probe._task.done()  # stopped with the last request
        observed = len(lags)
        await asyncio.sleep(0.05)
        assert len(lags) == observed
        await probe.close()

    asyncio.run(main())
    assert max(lags) >= 0.1
    assert min(lags) < 0.05 and all(lag >= 0 for lag in lags)


def test_overlapping_requests_share_one_probe():
    lags: list[float] = []
    in_flight = [0]

    async def main():
        probe = LoopLagProbe(lags.append, lambda: in_flight[0] > 0, interval_s=0.01)
        in_flight[0] += 1
        probe.start()
        first = probe._task
        in_flight[0] += 1
        probe.start()
        assert probe._task is first
        await asyncio.sleep(0.03)
        in_flight[0] -= 1
        await asyncio.sleep(0.03)
        assert not first.done()  # the other request is still in flight
        await probe.close()
        assert first.done()

    asyncio.run(main())
    assert lags
