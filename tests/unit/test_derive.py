"""`disagg up`'s derived router count (services/cli/derive.py), from the lines its processes print when they serve:
the decode workers' measured decode rate, the first router's CPU a relayed token."""
from services.cli.derive import ROUTER_BUSY, decode_rate, relay_cost_s, router_count

GPU_WORKER = "ready in 31.2 s, warm-up 6.1 s, decodes 20000 tokens/s at a full batch; KV cache 1048576 tokens"
CPU_WORKER = "ready in 3.0 s; KV cache 16384 tokens"
ROUTER = "warm-up 0.9 s, 95 us of CPU a relayed token"


def test_the_ready_lines_are_read_back():
    assert decode_rate(GPU_WORKER) == 20000 and decode_rate(CPU_WORKER) is None
    assert relay_cost_s(ROUTER) == 95e-6 and relay_cost_s("warm-up 0.2 s") is None


def test_routers_keep_each_loop_under_its_share_of_a_core():
    count = router_count([GPU_WORKER], ROUTER, spare_cores=14)
    assert count.routers == 2  # 20 000 tokens/s x 95 us = 1.9 cores, at most ROUTER_BUSY of one each
    assert 20000 * 95e-6 / count.routers <= ROUTER_BUSY
    assert count.why.startswith("2 routers on one port: the decode workers decode 20,000 tokens/s at a full batch "
                                "and a router spends 95 us of CPU a token, 1.90 cores in all, at most 1 a router")
    four = [GPU_WORKER] * 4  # 7.6 cores
    assert router_count(four, ROUTER, spare_cores=5).routers == 5  # wanted 8: the cores cap it
    assert "capped at the 5 cores" in router_count(four, ROUTER, spare_cores=5).why
    slow = "ready in 2 s, warm-up 1 s, decodes 900 tokens/s at a full batch"
    assert router_count([slow], ROUTER, spare_cores=14).routers == 1


def test_without_a_measurement_one_router():
    assert router_count([CPU_WORKER], ROUTER, spare_cores=1).routers == 1
    assert "the decode workers measured no rate" in router_count([CPU_WORKER], ROUTER, 1).why
    assert "the decode workers measured no rate" in router_count([CPU_WORKER], "warm-up 0.2 s", 1).why  # the CPU
    assert "the router measured no CPU a token" in router_count([GPU_WORKER], "warm-up 0.2 s", 14).why
