"""`trtllm`: TensorRT-LLM's own cache transceiver (`--engine trtllm`), a transport its engine drives. The context
worker's ref carries the context phase's DisaggregatedParams as `trtllm.*` attributes (common.engine.trtllm.
TrtLlmDisaggParams) and no block ids; the generation worker's engine turns them back into its generation_only
DisaggregatedParams and its transceiver fetches the KV. A data plane ref at a trtllm worker, or a trtllm ref at a
data plane worker, is FAILED_PRECONDITION naming both sides (KvPath.check)."""
from __future__ import annotations

from common.kv.paths import EngineTransport


class TrtLlmTransport(EngineTransport):
    name = "trtllm"
    moves = "through TensorRT-LLM's cache transceiver (TRANSFER_BACKEND_TRTLLM)"
