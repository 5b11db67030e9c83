"""EngineConfig: every knob of the engine, validated once."""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.errors import InvalidConfig

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    import torch

    from common.engine.spec.config import SpeculativeConfig

# --engine's choices → "module:class" under common.engine that common.engine.start loads (one line per engine).
ENGINES = {"torch": "async_engine:AsyncLLMEngine", "trtllm": "trtllm:TrtLlmEngine"}
# Grammar libraries for structured output → "module:class" under common.engine (common.engine.grammar_backend's
# GrammarBackend); --structured-output-backend picks the first to try, "auto" common.engine.grammar_choice's.
GRAMMAR_BACKENDS = {"xgrammar": "grammar_xgrammar:XgrammarBackend", "guidance": "grammar_guidance:GuidanceBackend"}
STRUCTURED_OUTPUT_BACKENDS = ("auto", *GRAMMAR_BACKENDS)
# --load-format's choices: the model directory's safetensors, or random weights made from its config.json alone.
LOAD_FORMATS = ("auto", "dummy")
# --quantization's and --kv-cache-dtype's choices (common/engine/quantization).
QUANTIZATIONS = ("fp8",)
KV_CACHE_DTYPES = ("auto", "fp8")
# A CPU prefill chunk of this many tokens runs in a few tenths of a second on one core (the default model), so a
# request arriving behind a long prompt gets its first token within about a second. Smaller chunks prefill slower
# (each step re-reads the weights for fewer tokens) and serve a lower TTFT and output rate; 256 prefills no faster
# and holds the others up twice as long; 512 is slower.
CPU_LONG_PREFILL_TOKENS = 128
# A step's token budget (--max-num-batched-tokens) unless set. On a GPU, vLLM's: prompts that arrive together
# prefill in one step and start decoding together, where smaller steps split them over several, each stalling the
# first ones' decodes (the ITL tail, docs/benchmarks/vllm_gpu.md), and bigger steps run the GEMMs nearer the peak
# (a served prefill GPU takes more requests a second, benchmarks/multi_gpu.py --prefill-budget). Every step up to it
# replays a CUDA graph (prefill_graphs.py). On the CPU a step's time grows with its tokens: 2048.
DEFAULT_STEP_TOKENS = 2048
GPU_STEP_TOKENS = 8192
# The KV cache unless sized otherwise: on the CPU this many blocks; on a GPU what fits in this fraction of it, shared
# by the workers on it (vLLM's default), each worker counting its own weights only (common/engine/kv_memory.py).
CPU_KV_BLOCKS = 1024
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


def gpu_memory_share(device: str, gpu_memory_utilization: float | None, num_kv_blocks: int | None) -> float | None:
    """The share of the GPU a KV cache is sized from (the flag, else DEFAULT_GPU_MEMORY_UTILIZATION on CUDA unless a
    block count is given), or None where a block count sizes it (the CPU, or --num-kv-blocks alone)."""
    if not device.startswith("cuda"):
        return None
    if gpu_memory_utilization is not None:
        return gpu_memory_utilization
    return DEFAULT_GPU_MEMORY_UTILIZATION if num_kv_blocks is None else None


def default_step_tokens(device: str) -> int:
    return GPU_STEP_TOKENS if device.startswith("cuda") else DEFAULT_STEP_TOKENS


# Requests a step runs at most (--max-num-seqs) unless set. A GPU decode step is bound by reading the weights, so more
# rows cost little, and a decode GPU serving a prefill GPU at its full rate runs more than 32 requests at once: with
# 32 slots new requests queue for one (tens of ms more to their first decode step), with 128 they do not.
DEFAULT_MAX_NUM_SEQS = 32
GPU_MAX_NUM_SEQS = 128


def default_max_num_seqs(device: str) -> int:
    return GPU_MAX_NUM_SEQS if device.startswith("cuda") else DEFAULT_MAX_NUM_SEQS


DTYPES = ("float32", "float16", "bfloat16")  # EngineConfig.dtype's values, each torch's dtype of that name
# --dtype's default: resolved per device by auto_dtype.
AUTO_DTYPE = "auto"
HALF_DTYPES = ("float16", "bfloat16")


def auto_dtype(device: str, model_dir: str) -> str:
    """--dtype auto. On a GPU, the checkpoint's own half precision (config.json's `dtype`, or `torch_dtype` in older
    files), bfloat16 for a float32 or unnamed one: a GPU decode step reads every weight, so float32 streams half as
    fast, and its GEMMs run off the tensor cores (an 8B shape served at a tenth of bfloat16's rate). vLLM's "auto"
    casts float32 checkpoints down as well. On the CPU, float32: the precision every greedy answer is checked in
    against Hugging Face transformers; `--dtype bfloat16` there is the faster choice on cores with AVX-512 BF16."""
    if not device.startswith("cuda"):
        return "float32"
    from common.model_facts import load_model_facts

    named = load_model_facts(model_dir).checkpoint_dtype
    return named if named in HALF_DTYPES else "bfloat16"


def resolve_dtype(dtype: str, device: str, model_dir: str) -> str:
    """`dtype` as given, or auto_dtype's choice for `auto`."""
    return auto_dtype(device, model_dir) if dtype == AUTO_DTYPE else dtype


def __getattr__(name: str):
    """_DTYPES (name -> torch dtype), built on first use: torch is imported only where a dtype is needed, not by
    every importer of the config (`disagg up` reads it and never loads a model: ~1 s of its start)."""
    if name == "_DTYPES":
        import torch

        return {dtype: getattr(torch, dtype) for dtype in DTYPES}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class EngineConfig:
    model: str
    """Hugging Face model directory (config.json, *.safetensors, tokenizer files)."""
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 16
    num_kv_blocks: int | None = None
    """KV cache blocks. None: CPU_KV_BLOCKS on the CPU; on CUDA, sized by memory (gpu_memory_utilization)."""
    gpu_memory_utilization: float | None = None
    """CUDA only: the share of the GPU this worker's weights, activations and KV cache may take; the cache gets what
    is left of it (kv_memory.py). None: DEFAULT_GPU_MEMORY_UTILIZATION unless num_kv_blocks is given. With both
    given this applies (`kv_sizing`)."""
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int | None = None
    """Most prompt tokens of one request in a step, so a long prompt shares its steps with decodes and new
    prompts. None: CPU_LONG_PREFILL_TOKENS on the CPU, no limit on CUDA (see `prefill_chunk_limit`)."""
    max_model_len: int | None = None
    """Defaults to the model's max_position_embeddings."""
    enable_prefix_caching: bool = True
    session_ttl_s: float = 60.0
    """How long an exported (context_only) KV session stays pinned waiting for its pull."""
    max_waiting: int = 1024
    """Bound on queued requests; past it add_request raises ResourceExhausted."""
    kv_growth_reserve: int = 256
    """Tokens of growth a new request leaves free in the KV pool for each running one (at most what that one may
    still generate: its max_tokens): a prompt, or a handed-off KV, waits for room instead of taking blocks the
    running rows are about to need, which would preempt the newest of them (recomputed: on a decode worker, its
    imported prompt prefilled again). 0: admit while blocks last, preempting when short (vLLM's rule)."""
    enforce_eager: bool = False
    """On a GPU, run decode steps without CUDA graphs (for debugging and comparison)."""
    async_scheduling: bool | None = None
    """Launch each decode step before the previous one's tokens are read, so host work overlaps the GPU
    (rows greedy or sampled, with logprobs or not, greedy grammar rows included; not penalties). None: on where
    decode steps run as CUDA graphs."""
    engine: str = "torch"
    """Which engine runs the model: "torch" (ours) or "trtllm" (TensorRT-LLM's LLM API; common.engine.trtllm)."""
    tensor_parallel_size: int = 1
    """Ranks the model is sharded over (one process each, common/engine/parallel.py); must divide its heads."""
    load_format: str = "auto"
    """"auto": the weights of the model directory's safetensors; "dummy": random ones made on the device from its
    config.json alone (common/engine/models/dummy.py), to run a shape without writing its checkpoint."""
    dummy_seed: int = 0
    """The dummy weights' seed: the same seed gives the same weights, on every rank and every worker."""
    quantization: str | None = None
    """"fp8": an unquantised checkpoint's linear layers quantised to FP8 at load, one scale per output row. An FP8
    checkpoint (its config's quantization_config) loads as FP8 without it (common/engine/quantization)."""
    kv_cache_dtype: str = "auto"
    """What the KV cache stores: "auto", the model's dtype; "fp8", float8_e4m3fn with a scale of 1.0 (half the
    bytes of bf16 in memory and in every handoff)."""
    structured_output_backend: str = "auto"
    """Which grammar library compiles structured output first: "xgrammar", "guidance" (llguidance), or "auto"
    (common.engine.grammar_choice: xgrammar). A grammar the first refuses is tried on the other."""
    host_kv_cache_gb: float = 0.0
    """GB of host memory (pinned on CUDA) for KV blocks evicted from the device pool (common.kv.tiers); 0: none. Not
    on the CPU, whose device pool is host memory already."""
    disk_kv_cache_dir: str | None = None
    """A directory for KV blocks evicted from the device (or host) tier, one file a block; None: no disk tier."""
    disk_kv_cache_gb: float = 0.0
    """The disk tier's budget in GB (the whole directory's: the least recently used files go first)."""
    kv_cache_write_through: bool = False
    """Store a finished request's full blocks in the disk tier at once, not only when the device evicts them: the
    node-wide tier (`disagg up --shared-kv-cache`), where the next turn's prefill on another worker looks for them."""
    speculative_config: SpeculativeConfig | None = None
    """Speculative decoding (common/engine/spec, vLLM's keys: --speculative-config '{"method": "ngram",
    "num_speculative_tokens": 4}'); None: off."""

    def __post_init__(self) -> None:
        checks = [
            (self.dtype in DTYPES, f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}"),
            (self.block_size in (1, 2, 4, 8, 16, 32, 64, 128), f"block_size must be a power of two in [1, 128], got {self.block_size}"),
            (self.num_kv_blocks is None or self.num_kv_blocks >= 1,
             f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}"),
            (self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}"),
            (self.max_num_batched_tokens >= 1, f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"),
            (self.long_prefill_token_threshold is None or self.long_prefill_token_threshold >= 1,
             f"long_prefill_token_threshold must be >= 1, got {self.long_prefill_token_threshold}"),
            (self.max_model_len is None or self.max_model_len >= 2, f"max_model_len must be >= 2, got {self.max_model_len}"),
            (self.session_ttl_s > 0, f"session_ttl_s must be > 0, got {self.session_ttl_s}"),
            (self.max_waiting >= 1, f"max_waiting must be >= 1, got {self.max_waiting}"),
            (self.kv_growth_reserve >= 0, f"--kv-growth-reserve must be >= 0 tokens, got {self.kv_growth_reserve}"),
            (self.engine in ENGINES, f"--engine must be one of {list(ENGINES)}, got {self.engine!r}"),
            (self.gpu_memory_utilization is None or 0 < self.gpu_memory_utilization <= 1,
             f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}"),
            (self.tensor_parallel_size >= 1, f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}"),
            (self.tensor_parallel_size == 1 or self.device.split(":")[0] in ("cpu", "cuda"),
             f"--tensor-parallel-size {self.tensor_parallel_size} runs on --device cpu (gloo) or cuda (NCCL, a GPU "
             f"a rank), not {self.device!r}"),
            (self.load_format in LOAD_FORMATS, f"--load-format must be one of {list(LOAD_FORMATS)}, got "
                                               f"{self.load_format!r}"),
            (self.load_format == "auto" or self.engine == "torch",
             f"--load-format {self.load_format} makes its weights in our engine; run it with --engine torch"),
            (self.quantization in (None, *QUANTIZATIONS),
             f"--quantization must be one of {list(QUANTIZATIONS)}, got {self.quantization!r}"),
            (self.kv_cache_dtype in KV_CACHE_DTYPES,
             f"--kv-cache-dtype must be one of {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"),
            (self.engine == "torch" or (self.quantization is None and self.kv_cache_dtype == "auto"),
             "--quantization and --kv-cache-dtype fp8 are our engine's; run them with --engine torch"),
            (self.structured_output_backend in STRUCTURED_OUTPUT_BACKENDS,
             f"--structured-output-backend must be one of {list(STRUCTURED_OUTPUT_BACKENDS)}, got "
             f"{self.structured_output_backend!r}"),
            (self.host_kv_cache_gb >= 0, f"--host-kv-cache-gb must be >= 0, got {self.host_kv_cache_gb}"),
            ((self.disk_kv_cache_dir is None) == (self.disk_kv_cache_gb == 0) and self.disk_kv_cache_gb >= 0,
             f"--disk-kv-cache-dir and --disk-kv-cache-gb go together (a directory and a budget > 0), got "
             f"{self.disk_kv_cache_dir!r} and {self.disk_kv_cache_gb}"),
            (self.disk_kv_cache_dir is not None or not self.kv_cache_write_through,
             "--kv-cache-write-through stores finished requests' blocks in the disk tier; give it "
             "--disk-kv-cache-dir and --disk-kv-cache-gb"),
            (self.enable_prefix_caching or not self.kv_tiers_asked,
             "the KV cache tiers (--host-kv-cache-gb, --disk-kv-cache-dir) keep prefix-cache blocks; they need the "
             "prefix cache (drop --no-prefix-caching)"),
            (self.engine == "torch" or not self.kv_tiers_asked,
             "the KV cache tiers (--host-kv-cache-gb, --disk-kv-cache-dir) are our engine's; run them with --engine "
             "torch"),
            (self.gpu_memory_utilization is None or self.device.startswith("cuda"),
             f"--gpu-memory-utilization sizes the KV cache on a CUDA device; --device is {self.device!r} "
             "(use --num-kv-blocks there)"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidConfig(message)
        if self.speculative_config is not None:
            from common.engine.spec.config import require_supported

            require_supported(self.speculative_config)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    @property
    def prefill_chunk_limit(self) -> int:
        """long_prefill_token_threshold, or the device's default: a CPU step of thousands of prompt tokens
        takes seconds, which every other request would wait; a GPU runs it in milliseconds, at full throughput."""
        if self.long_prefill_token_threshold is not None:
            return self.long_prefill_token_threshold
        return self.max_num_batched_tokens if self.device.startswith("cuda") else CPU_LONG_PREFILL_TOKENS

    @property
    def kv_tiers_asked(self) -> bool:
        """Whether a KV cache tier below the device pool is asked for (--host-kv-cache-gb, --disk-kv-cache-dir)."""
        return bool(self.host_kv_cache_gb or self.disk_kv_cache_dir)

    @property
    def memory_share(self) -> float | None:
        """The share of the GPU the KV cache is sized from, or None where a block count sizes it."""
        return gpu_memory_share(self.device, self.gpu_memory_utilization, self.num_kv_blocks)

    def kv_sizing(self) -> str:
        """The line said at start where both --num-kv-blocks and --gpu-memory-utilization are given: which applies."""
        return (f"KV cache sized by --gpu-memory-utilization {self.memory_share:g}; --num-kv-blocks "
                f"{self.num_kv_blocks} does not apply")

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)


def resolve_max_model_len(config: EngineConfig, model_max_positions: int) -> int:
    """The context length the engine enforces: the flag if set, capped by what the model supports."""
    if config.max_model_len is None:
        return model_max_positions
    if config.max_model_len > model_max_positions:
        raise InvalidConfig(
            f"max_model_len={config.max_model_len} exceeds the model's max_position_embeddings={model_max_positions}"
        )
    return config.max_model_len


def kv_cache_blocks(config: EngineConfig, hf_config, block_bytes: int, proposer=None) -> int:
    """The block count, or on a GPU sized by memory (`memory_share`) what fits in the worker's share once its own
    weights are loaded (call it after loading them), less a reserve for one step: its MLP activations and logits.
    `proposer`: the speculative proposer's spec.memory.ProposerMemory, counted in the same share."""
    if config.memory_share is None:
        return config.num_kv_blocks or CPU_KV_BLOCKS
    import torch

    from common.engine.kv_memory import read_device_memory

    blocks, line = kv_blocks_in_share(config, hf_config, block_bytes, read_device_memory(torch.device(config.device)),
                                      proposer)
    if config.num_kv_blocks is not None:
        log.warning("%s", config.kv_sizing())
    log.info("%s", line)
    return blocks


def kv_blocks_in_share(config: EngineConfig, hf_config, block_bytes: int, memory, proposer=None) -> tuple[int, str]:
    """kv_cache_blocks' count and its log line for the device memory `memory` (kv_memory.DeviceMemory) read after
    the weights loaded. A speculative proposer that will load beside the target (a draft model, an EAGLE-3 head:
    `proposer`, its spec.memory.ProposerMemory) is counted too: its weights with the step's reserve, its KV beside
    each of the target's blocks, so that it fits in the same share."""
    from common.engine.kv_memory import kv_blocks_for_share

    text = getattr(hf_config, "text_config", None) or hf_config
    reserve = (config.max_num_batched_tokens * (4 * text.hidden_size + 3 * text.intermediate_size)
               * config.torch_dtype.itemsize + config.max_num_seqs * text.vocab_size * 4)
    block_extra, fixed, weights = ((proposer.block_bytes, proposer.fixed_bytes, proposer.weight_bytes)
                                   if proposer is not None else (0, 0, 0))
    blocks, line = kv_blocks_for_share(config.memory_share, memory, block_bytes + block_extra, reserve + fixed)
    if weights:
        line += (f", with the {config.speculative_config.method} proposer's {weights / (1 << 30):.1f} GiB of weights "
                 f"and its KV ({block_extra} bytes a block) beside it")
    return blocks, line
