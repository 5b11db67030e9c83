"""Static discovery: endpoints from flags or env, validated, and a watch that yields the fixed view."""
import asyncio

import pytest

from common.discovery import Role, StaticDiscovery, parse_endpoints
from common.errors import InvalidConfig


def test_parse_endpoints_splits_trims_and_dedupes():
    assert parse_endpoints(" a:1, b:2,,a:1 ", "--x") == ["a:1", "b:2"]
    assert parse_endpoints(None, "--x") == []
    assert parse_endpoints("[::1]:50051", "--x") == ["[::1]:50051"]


@pytest.mark.parametrize("bad", ["host", "host:", ":80", "host:0", "host:70000", "host:http"])
def test_parse_endpoints_rejects_bad_items_naming_the_source(bad):
    with pytest.raises(InvalidConfig, match=r"--decode-workers: expected host:port"):
        parse_endpoints(bad, "--decode-workers")


def test_flag_wins_over_env_and_env_fills_the_rest():
    env = {"DISAGG_PREFILL_WORKERS": "p:1", "DISAGG_DECODE_WORKERS": "d:1,d:2"}
    discovery = StaticDiscovery.from_flags({Role.PREFILL: "p:9", Role.DECODE: None}, env)
    assert asyncio.run(discovery.endpoints(Role.PREFILL)) == ["p:9"]
    assert asyncio.run(discovery.endpoints(Role.DECODE)) == ["d:1", "d:2"]


def test_bad_env_value_names_the_variable():
    with pytest.raises(InvalidConfig, match="env DISAGG_DECODE_WORKERS"):
        StaticDiscovery.from_flags({}, {"DISAGG_DECODE_WORKERS": "nope"})


def test_watch_yields_the_view_then_waits():
    discovery = StaticDiscovery({Role.DECODE: ["d:1"]})

    async def first_two():
        watch = discovery.watch(Role.DECODE)
        first = await anext(watch)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(anext(watch), 0.05)
        return first

    assert asyncio.run(first_two()) == ["d:1"]
