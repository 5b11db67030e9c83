"""`python -m tests.integration.compose_stand_ins consul|otlp`: the Consul double on 0.0.0.0:8500 or the OTLP
receiver on 0.0.0.0:4317, until killed. The entry point of the images that stand in for `hashicorp/consul` and
`jaeger` in tests/integration/test_compose_docker.py, where no registry can be reached to pull those."""
from __future__ import annotations

import signal
import sys
import threading

from tests.consul_double import ConsulDouble
from tests.integration.otlp_receiver import OtlpReceiver


def main(argv: list[str]) -> int:
    if argv != ["consul"] and argv != ["otlp"]:
        print("usage: python -m tests.integration.compose_stand_ins consul|otlp", file=sys.stderr)
        return 2
    stand_in = ConsulDouble("0.0.0.0", 8500) if argv == ["consul"] else OtlpReceiver("0.0.0.0", 4317)
    stand_in.start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(f"{argv[0]} stand-in serving", flush=True)
    stop.wait()
    stand_in.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
