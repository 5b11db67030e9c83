"""KV cache tiers below an engine's device pool: host memory (pinned on CUDA) and local disk, per worker, the disk
optionally node-wide (one directory for the workers of a host, finished requests written through to it).

- identity: TierLayout, what a stored block was computed by (model, weights, dtype, block size, shape, shard)
- record: a stored block (its key in the hash chain, its bytes, their checksum) and its file format
- host, disk: the tiers, LRU each; the disk tier safe for several processes on one directory
- mover: the threads that store blocks down and prefetch them up
- payoff: whether a hit pays (onboarding against computing its tokens), and how long a prefetch may hold a request
- stack: KvTiers, what the block manager calls; staging: the prefetches waiting for admission; stores: what the
  store thread does with the blocks copied out
- metrics: their counts, bound to a worker's Prometheus metrics
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from common.kv.layout import KvLayout
from common.kv.tiers.disk import DiskTier
from common.kv.tiers.host import HostTier
from common.kv.tiers.identity import TierLayout, weights_identity
from common.kv.tiers.metrics import TierMetrics
from common.kv.tiers.stack import KvTiers

log = logging.getLogger(__name__)
GB = 1 << 30


def open_tiers(cache, layout: KvLayout, weights: str, num_device_blocks: int, host_gb: float = 0.0,
               disk_dir: str | None = None, disk_gb: float = 0.0, write_through: bool = False) -> KvTiers | None:
    """The tiers these sizes ask for under a paged `cache` (None: none asked for, or a cache they cannot serve)."""
    if not host_gb and not disk_dir:
        return None
    if not isinstance(cache, torch.Tensor):  # a tensor-parallel cache spread over GPUs (KvShards)
        log.warning("KV cache tiers are not supported for a cache sharded over GPUs; running without them")
        return None
    if host_gb and cache.device.type == "cpu":
        log.warning("--host-kv-cache-gb does not apply on the CPU, whose device pool is host memory already: size "
                    "that with --num-kv-blocks; the disk tier still applies")
        host_gb = 0.0
    tier_layout = TierLayout.of(layout, weights)
    metrics = TierMetrics()
    block_bytes = cache.view(torch.uint8)[:, :, 0].numel()
    host = HostTier(int(host_gb * GB), block_bytes, pin=cache.device.type == "cuda") if host_gb else None
    disk = DiskTier(Path(disk_dir), int(disk_gb * GB), tier_layout, metrics) if disk_dir else None
    if host is None and disk is None:
        return None
    tiers = KvTiers(cache, tier_layout, host, disk, metrics, max_prefetch_blocks=num_device_blocks,
                    write_through=write_through)
    said = ([f"host {host_gb:g} GB ({host.num_slots} blocks)"] if host is not None else []) + \
        ([f"disk {disk_gb:g} GB under {disk.dir}" + (", finished requests written through" if write_through else "")]
         if disk is not None else [])
    log.info("KV cache tiers: %s", ", ".join(said))
    return tiers


__all__ = ["KvTiers", "TierLayout", "TierMetrics", "open_tiers", "weights_identity"]
