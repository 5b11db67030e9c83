"""The router's event-loop lag probe (services/router/loop_lag.py): it observes how late its timer fires while a
request is in flight, and does not run while none is."""
import asyncio
import time

from services.router.loop_lag import LoopLagProbe


def test_a_busy_loop_shows_as_lag_and_an_idle_router_runs_no_probe():
    lags: list[float] = []

    async def main():
        probe = LoopLagProbe(lags.append, interval_s=0.01)
        await asyncio.sleep(0.05)
        assert probe._task is None and lags == []  # nothing in flight: no timer at all
        with probe.busy():
            await asyncio.sleep(0.03)  # a few quiet rounds
            time.sleep(0.15)  # the loop held, as a router relaying too many tokens holds it
            await asyncio.sleep(0.03)
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

    async def main():
        probe = LoopLagProbe(lags.append, interval_s=0.01)
        with probe.busy():
            first = probe._task
            with probe.busy():
                assert probe._task is first
                await asyncio.sleep(0.03)
            await asyncio.sleep(0.03)
            assert not first.done()  # the outer request is still in flight
        await probe.close()
        assert first.done()

    asyncio.run(main())
    assert lags
