"""A NIXL exporter in a process of its own over caches of known values, for the NIXL bandwidth bench and the NIXL
data-plane tests."""
from __future__ import annotations

import multiprocessing
from multiprocessing.connection import Connection

import torch

from common.kv.transports.nixl.plane import NixlCacheInfo, NixlExporter

START_TIMEOUT_S = 120.0


def fill_cache(shape: tuple[int, ...], dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """The same known values in every process."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(device=device, dtype=dtype)


def _serve_caches(conn: Connection, shape: tuple[int, ...], dtypes: dict[str, torch.dtype], device: str) -> None:
    exporters = {name: NixlExporter(fill_cache(shape, dtype, device)) for name, dtype in dtypes.items()}
    conn.send({name: exporter.info().to_fields() for name, exporter in exporters.items()})
    conn.recv()  # until told to stop (or the parent goes away)
    for exporter in exporters.values():
        exporter.close()


class ExporterProcess:
    """A spawned process holding one NixlExporter per dtype over caches filled by fill_cache."""

    def __init__(self, shape: tuple[int, ...], dtypes: dict[str, torch.dtype], device: str = "cpu") -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self.process = context.Process(target=_serve_caches, args=(child_conn, shape, dtypes, device), daemon=True)
        self.process.start()
        child_conn.close()
        if not self._conn.poll(START_TIMEOUT_S):
            self.stop()
            raise RuntimeError(f"the exporter process did not publish its caches (exit code {self.process.exitcode})")
        self.infos = {name: NixlCacheInfo.from_fields(fields) for name, fields in self._conn.recv().items()}

    def kill(self) -> None:
        self.process.kill()
        self.process.join(10)

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                self._conn.send("stop")
            except OSError:
                pass
            self.process.join(10)
        if self.process.is_alive():
            self.kill()
