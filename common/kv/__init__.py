"""KV caches between engines, in three layers, each importing only those below it (tests/unit/test_import_graph.py):

- the vocabulary (VOCABULARY): what a paged cache, its blocks, their layout and epochs, a session and the transports'
  errors are. The engine (common.engine) imports from common.kv only these, and they import nothing else of ours.
- the transports (common.kv.transport: the protocol and the registry; one package each under common.kv.transports)
  and the data plane they share (wire, offer, pull, sharing, probe, gather, ...).
- the seam (common.kv.paths.KvPath): the only thing a worker's services call, exporter and importer.
"""

VOCABULARY = (
    "common.kv.block_hash",  # a block's prefix-cache hash
    "common.kv.blocks",  # KvBlocks (an engine's cache and pool), block ids read out of a cache
    "common.kv.buffers",  # host buffers in huge pages, written once by a pull or a gather
    "common.kv.chunks",  # dtypes on the wire, tensors as bytes and chunks
    "common.kv.errors",  # TransportUnavailable: a transport that cannot serve a pair of workers
    "common.kv.events",  # the prefix cache's stored / removed events
    "common.kv.fence",  # BlockEpochs: the fence of one-sided reads
    "common.kv.host",  # which running host a process is on
    "common.kv.ipc_share",  # a cache shared with another process through CUDA IPC (tensor-parallel ranks too)
    "common.kv.layout",  # KvLayout, KvExport, PlacedKv
    "common.kv.session",  # KvSession, the exporter's table of pinned sessions
    "common.kv.shards",  # KvShards: a tensor-parallel engine's cache on several GPUs
    "common.kv.shm_files",  # files of this user under /dev/shm
    "common.kv.words",  # FP8 blocks copied as the same bytes viewed as integers
    # The KV cache tiers below an engine's pool (host memory, disk), which its block manager drives.
    "common.kv.tiers",
    "common.kv.tiers.disk",
    "common.kv.tiers.hit_cost",
    "common.kv.tiers.host",
    "common.kv.tiers.identity",
    "common.kv.tiers.metrics",
    "common.kv.tiers.mover",
    "common.kv.tiers.payoff",
    "common.kv.tiers.record",
    "common.kv.tiers.stack",
    "common.kv.tiers.staging",
    "common.kv.tiers.stores",
)
