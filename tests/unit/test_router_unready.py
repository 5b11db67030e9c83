"""While no decode worker is ready, the router's UNAVAILABLE says which worker is down and since when."""
import asyncio
import re

import pytest

from common.discovery import Role, StaticDiscovery
from common.errors import Unavailable
from services.router.workers import WorkerPool


def test_unready_message_names_each_decode_worker_and_since_when():
    async def scenario() -> tuple[str, str, str]:
        pool = WorkerPool(StaticDiscovery({Role.DECODE: ["127.0.0.1:1"]}), retry_s=0.05)
        await pool.start()
        try:
            await asyncio.sleep(0.2)
            with pytest.raises(Unavailable) as never:
                pool.model()
            client = pool._clients[Role.DECODE]["127.0.0.1:1"]
            client.healthy = client.serving = True  # as if it had answered, then a request found it gone
            pool.mark_down(client, "connection refused")
            with pytest.raises(Unavailable) as down:
                pool.model()
            empty = WorkerPool(StaticDiscovery({}))
            with pytest.raises(Unavailable) as none:
                empty.model()
            return str(never.value), str(down.value), str(none.value)
        finally:
            await pool.close()

    never, down, none = asyncio.run(scenario())
    since = r"since \d\d:\d\d:\d\d \(\d+s ago\)"
    assert re.search(r"cannot serve yet: decode worker 127\.0\.0\.1:1 has not answered GetInfo yet " + since, never)
    assert re.search(r"decode worker 127\.0\.0\.1:1 is down \(connection refused\) " + since, down), down
    assert none.endswith("discovery lists no decode worker")
