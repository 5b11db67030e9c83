"""Qwen3-30B-A3B's shape (MoE) next to a dense model of its active size, on dummy weights: the decode step, output
tok/s, the step against the roofline of the bytes it reads, and the MoE layers' share of the step.

    python -m benchmarks.moe --device cuda --batch 1 64 --rounds 3    # 30B-A3B (61 GB bf16) and llama-3.2-3b
    python -m benchmarks.moe --device cuda --moe-impl torch triton auto --skip-dense  # the MoE paths side by side
    python -m benchmarks.moe --device cpu --tiny                      # a tiny pair: checks the bench runs

Configs are written once under --models (config.json alone; the engine makes the weights on the device). The dense
model is --dense (default the llama-3.2-3b shape of gpu_engine_vs_hf: 3.2B parameters, 30B-A3B has 3.3B active).
Each model runs alone (the first is freed before the second loads), prompts of 128 tokens, the median decode step
over rounds (engine_steps.decode_step_ms). Bytes a step reads: every weight but an untied input embedding (a step
reads only its rows), of the MoE's experts only those its tokens were routed to (measured), plus the KV it attends
over.
--moe-impl runs the MoE model once per path of its sparse blocks on CUDA (kernels/fused_moe.IMPL): the torch path
(routing, torch's grouped GEMMs), the fused Triton kernels, or auto (each token-count bucket takes whichever timed
faster at first use; the choices made are printed). The CPU runs the torch reference whatever it says.
The MoE share: the sparse blocks' busy time, run alone over the inputs they got in a decode step, over the busy
time of a whole (eager) decode forward; busy time is the sum of GPU kernel times (torch.profiler) on CUDA, wall
time on the CPU.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PretrainedConfig, Qwen3Config, Qwen3MoeConfig

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.kernels import fused_moe
from common.engine.models.moe import SparseMoeBlock, route
from common.engine.request import SamplingParams
from benchmarks.engine_steps import DECODE_STEPS, PROMPT, decode_step_ms, decoding, sync, tokens
from benchmarks.gpu_engine_vs_hf import emit, hbm_bandwidth, shape_arg, shape_config

PROFILE_STEPS = 4


def qwen3_30b_a3b() -> Qwen3MoeConfig:
    """Qwen/Qwen3-30B-A3B's config.json: 48 layers, each a sparse block of 128 experts, 8 a token."""
    return Qwen3MoeConfig(
        architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False, use_sliding_window=False,
        sliding_window=None, bos_token_id=151643, eos_token_id=151645)


_TINY = dict(vocab_size=2048, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
             bos_token_id=1, eos_token_id=2)
TINY_EXPERTS, TINY_TOP_K, TINY_EXPERT_INTERMEDIATE = 16, 4, 64


def tiny_moe() -> Qwen3MoeConfig:
    return Qwen3MoeConfig(architectures=["Qwen3MoeForCausalLM"], num_experts=TINY_EXPERTS,
                          num_experts_per_tok=TINY_TOP_K, moe_intermediate_size=TINY_EXPERT_INTERMEDIATE,
                          norm_topk_prob=True, **_TINY)


def tiny_dense() -> Qwen3Config:
    """tiny_moe's attention with one MLP as wide as the experts a token runs: the same active size."""
    return Qwen3Config(architectures=["Qwen3ForCausalLM"], intermediate_size=TINY_TOP_K * TINY_EXPERT_INTERMEDIATE,
                       **_TINY)


def write_config(models: Path, name: str, config: PretrainedConfig) -> str:
    directory = models / name
    config.save_pretrained(directory)  # the same config gives the same file: rewriting it is harmless
    return str(directory)


@dataclass(frozen=True)
class WeightCounts:
    """The model's weights, from the engine's own parameters (a tied embedding counted once)."""

    total_params: int
    total_bytes: int
    expert_params: int  # every expert of every sparse layer
    expert_bytes: int
    num_experts: int  # per sparse layer; 0 for a dense model
    top_k: int
    unread_bytes: int  # an untied input embedding: a decode step reads only its batch's rows

    @classmethod
    def of(cls, engine: LLMEngine) -> "WeightCounts":
        model = engine.runner.model
        params = dict(model.named_parameters())  # tied tensors appear once
        experts = {n: p for n, p in params.items() if ".experts." in n}
        blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
        spec = blocks[0].spec if blocks else None
        embed = model.model.embed_tokens.weight
        tied = model.lm_head.weight is embed  # named_parameters lists it once, as the embedding
        return cls(total_params=sum(p.numel() for p in params.values()),
                   total_bytes=sum(p.numel() * p.element_size() for p in params.values()),
                   expert_params=sum(p.numel() for p in experts.values()),
                   expert_bytes=sum(p.numel() * p.element_size() for p in experts.values()),
                   num_experts=spec.num_experts if spec else 0, top_k=spec.top_k if spec else 0,
                   unread_bytes=0 if tied else embed.numel() * embed.element_size())

    @property
    def active_params(self) -> int:
        """What one token runs through (the usual "active" count: its top-k experts, the embeddings included)."""
        if not self.num_experts:
            return self.total_params
        return self.total_params - self.expert_params + self.expert_params * self.top_k // self.num_experts

    def bytes_read(self, experts_hit: float | None) -> float:
        """Weight bytes a decode step reads when a sparse layer's tokens go to `experts_hit` distinct experts."""
        dense = self.total_bytes - self.unread_bytes
        if not self.num_experts:
            return dense
        return dense - self.expert_bytes * (1 - experts_hit / self.num_experts)


@dataclass(frozen=True)
class StepProfile:
    forward_ms: float  # busy time of one eager decode forward
    moe_ms: float  # the sparse blocks' busy time over that forward's inputs (0 for a dense model)
    experts_hit: float | None  # distinct experts a sparse layer's tokens went to, mean over layers
    moe_kernels: str  # the sparse blocks' top kernels (CUDA), else ""


def _busy_ms(fn, cuda: bool) -> tuple[float, str]:
    """(busy ms of one call of fn, its top kernels): on CUDA the sum of its kernels' times, on the CPU wall time."""
    if not cuda:
        start = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - start), ""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()  # kernels launched before stay out
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernel_us = sum(e.device_time_total for e in prof.events()
                    if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False))
    table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60)
    return kernel_us / 1e3, table


def _start_decoding(engine: LLMEngine, batch: int, max_tokens: int) -> None:
    sampling = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"prof{time.monotonic_ns()}-{i}", tokens(engine, PROMPT, i), sampling)
    while not decoding(engine):
        engine.step()
    engine.step()


def profile_step(engine: LLMEngine, batch: int) -> StepProfile:
    """Busy time of a decode forward at `batch` and of its sparse blocks alone. CUDA graphs are off meanwhile, so
    each kernel runs (and is counted) as an eager one: the same kernels a graph replays. The first eager step
    records the sparse blocks' inputs; the next PROFILE_STEPS are measured, per forward they ran."""
    runner, cuda = engine.runner, engine.runner.device.type == "cuda"
    _start_decoding(engine, batch, PROFILE_STEPS + 8)
    inputs: list[tuple[SparseMoeBlock, torch.Tensor]] = []
    forwards = 0
    run_step, forward = runner.run_step, SparseMoeBlock.forward

    def recorded(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
        inputs.append((block, x.clone()))
        return forward(block, x)

    def counted(*args, **kwargs):
        nonlocal forwards
        forwards += 1
        return run_step(*args, **kwargs)

    def steps() -> None:
        for _ in range(PROFILE_STEPS):
            engine.step()
        sync(engine)

    # Both kinds of graph off: a decode step replayed from a prefill graph (common/engine/prefill_graphs.py, on where
    # it fits) would run no Python forward either, and record nothing.
    graphs, runner.graphs = runner.graphs, None
    prefill_graphs, runner.prefill_graphs = runner.prefill_graphs, None
    try:
        SparseMoeBlock.forward = recorded
        engine.step()
        SparseMoeBlock.forward = forward
        runner.run_step = counted  # launch and launch_ahead both run a forward through it
        busy, _ = _busy_ms(steps, cuda)
    finally:
        SparseMoeBlock.forward = forward
        runner.__dict__.pop("run_step", None)
        runner.graphs, runner.prefill_graphs = graphs, prefill_graphs
    while engine.has_unfinished_requests():
        engine.step()
    forward_ms = busy / forwards
    sparse = sum(isinstance(m, SparseMoeBlock) for m in runner.model.modules())
    if not sparse:
        return StepProfile(forward_ms, 0.0, None, "")
    last = inputs[-sparse:]  # one forward's: the last one recorded
    if len(last) < sparse:
        raise RuntimeError(f"the recorded step ran {len(last)} of the model's {sparse} sparse blocks in Python; "
                           "a graph replayed the rest")

    @torch.inference_mode()
    def blocks(repeats: int) -> None:
        for _ in range(repeats):
            for block, x in last:
                block(x)
        sync(engine)

    blocks(1)  # warm
    moe_ms, table = _busy_ms(lambda: blocks(PROFILE_STEPS), cuda)
    with torch.inference_mode():
        hit = statistics.mean(route(b.gate(x), b.spec.top_k, b.spec.renormalize)[1].unique().numel()
                              for b, x in last)
    return StepProfile(forward_ms, moe_ms / PROFILE_STEPS, hit, table)


MAX_LEN = 256  # a prompt, decode_step_ms's decode steps and the profile's, in every request's block table


def _engine(args: argparse.Namespace, directory: str) -> LLMEngine:
    most = max(args.batch)
    return LLMEngine(EngineConfig(model=directory, dtype="bfloat16", device=args.device, load_format="dummy",
                                  enable_prefix_caching=False,  # every round computes
                                  max_num_seqs=most, max_model_len=MAX_LEN,
                                  max_num_batched_tokens=max(2048, PROMPT * most),  # one prefill step
                                  num_kv_blocks=args.num_kv_blocks or most * -(-MAX_LEN // 16) + 16))


def bench_model(args: argparse.Namespace, role: str, name: str, directory: str, bandwidth: float | None,
                impl: str = "auto") -> dict:
    """The model's figures (emitted as they come): its weights, then each batch's decode step and MoE share, its
    sparse blocks on the `impl` path (fused_moe.IMPLS)."""
    fused_moe.IMPL = impl
    fused_moe.choices.clear()  # auto: each engine times its own
    engine = _engine(args, directory)
    runner = engine.runner
    counts = WeightCounts.of(engine)
    kv_per_token = 2 * runner.num_layers * runner.num_kv_heads * runner.head_dim * runner.kv_dtype.itemsize
    model = emit("model", role=role, model=name, total_params=counts.total_params,
                 active_params=counts.active_params, weight_bytes=counts.total_bytes,
                 batch1_weight_bytes_read=counts.bytes_read(counts.top_k), kv_bytes_per_token=kv_per_token)
    for batch in args.batch:
        decode_step_ms(engine, batch)  # warm: prefill shapes, the allocator
    rounds: dict[int, list[float]] = {b: [] for b in args.batch}
    for _ in range(args.rounds):
        for batch in args.batch:
            rounds[batch].append(decode_step_ms(engine, batch))
    model["batches"] = []
    for batch in args.batch:
        prof = profile_step(engine, batch)
        step_ms = statistics.median(rounds[batch])
        read = counts.bytes_read(prof.experts_hit) + batch * (PROMPT + DECODE_STEPS / 2) * kv_per_token
        roofline_ms = 1e3 * read / bandwidth if bandwidth else None
        figures = emit("decode_step", role=role, model=name, batch=batch, step_ms=step_ms, rounds_ms=rounds[batch],
                       tok_per_s=1e3 * batch / step_ms, experts_hit_per_layer=prof.experts_hit, bytes_read=read,
                       roofline_ms=roofline_ms, step_vs_roofline=roofline_ms and step_ms / roofline_ms)
        figures.update(emit("moe_share", role=role, model=name, batch=batch, forward_busy_ms=prof.forward_ms,
                            moe_busy_ms=prof.moe_ms, share_of_forward=prof.moe_ms / prof.forward_ms,
                            share_of_step=prof.moe_ms / step_ms))
        if prof.moe_kernels:
            print(f"{name}: the sparse blocks' kernels, batch {batch} ({PROFILE_STEPS} forwards' worth):\n"
                  + "\n".join(prof.moe_kernels.splitlines()[:16]), flush=True)
        model["batches"].append(figures)
    if role == "moe" and impl == "auto" and fused_moe.choices:
        model["moe_choices"] = [emit("moe_choice", model=name, tokens_up_to=key[0], triton_us=c.fused_us,
                                     torch_us=c.torch_us, uses="triton" if c.uses_fused else "torch")
                                for key, c in sorted(fused_moe.choices.items(), key=lambda kv: kv[0][0])]
    engine.close()
    del engine, runner
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
        emit("freed", model=name, cuda_bytes_still_allocated=torch.cuda.memory_allocated())  # ~0: room for the next
    return model


def summary(models: list[dict]) -> None:
    print("\n| model | parameters | active | weights GB | a batch-1 step reads GB |")
    print("| --- | --- | --- | --- | --- |")
    for m in models:
        print(f"| {m['model']} ({m['role']}) | {m['total_params'] / 1e9:.3g} B | {m['active_params'] / 1e9:.3g} B | "
              f"{m['weight_bytes'] / 1e9:.3g} | {m['batch1_weight_bytes_read'] / 1e9:.3g} |")
    print("\n| model | batch | step ms | output tok/s | experts hit / layer | GB read | roofline ms | step / roofline "
          "| forward busy ms | MoE busy ms | MoE share of forward | of step |")
    print("| --- " * 12 + "|")
    for m in models:
        for f in m["batches"]:
            roof = "—" if f["roofline_ms"] is None else f"{f['roofline_ms']:.3f}"
            ratio = "—" if f["roofline_ms"] is None else f"{f['step_vs_roofline']:.2f}×"
            hit = "—" if f["experts_hit_per_layer"] is None else f"{f['experts_hit_per_layer']:.1f}"
            moe = ("— | — | —" if m["role"] == "dense" else
                   f"{f['moe_busy_ms']:.3f} | {f['share_of_forward']:.0%} | {f['share_of_step']:.0%}")
            print(f"| {m['model']} | {f['batch']} | {f['step_ms']:.3f} | {f['tok_per_s']:.0f} | {hit} | "
                  f"{f['bytes_read'] / 1e9:.3g} | {roof} | {ratio} | {f['forward_busy_ms']:.3f} | {moe} |")
    for m in models:
        if m.get("moe_choices"):
            print(f"\n{m['model']}: the sparse block's path per token count (µs a block, in a CUDA graph): "
                  + ", ".join(f"≤{c['tokens_up_to']}: {c['uses']} ({c['triton_us']:.0f} vs torch {c['torch_us']:.0f})"
                              for c in m["moe_choices"]))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", default="/tmp/disagg-bench-models", help="where the configs are written")
    parser.add_argument("--dense", type=shape_arg, default="llama-3.2-3b",
                        help="the dense model: a shape of gpu_engine_vs_hf, or a directory with a config.json")
    parser.add_argument("--tiny", action="store_true", help="a tiny MoE and dense pair (the CPU)")
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="default: what the largest batch needs")
    parser.add_argument("--moe-impl", nargs="+", choices=fused_moe.IMPLS, default=["auto"],
                        help="the sparse blocks' path on CUDA, the MoE model run once per path given")
    parser.add_argument("--skip-dense", action="store_true", help="the MoE model alone")
    return parser


def main() -> None:
    parser = _parser()
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    if not cuda and not args.tiny:
        parser.error("the Qwen3-30B-A3B shape is 61 GB of bf16: run it with --device cuda, or --tiny on the CPU")
    if not cuda:
        torch.set_num_threads(1)  # as `disagg up` runs a CPU worker
    bandwidth = None
    if cuda:
        bandwidth = hbm_bandwidth()
        torch.cuda.empty_cache()
        emit("hbm_copy_bandwidth", bytes_per_s=bandwidth, device=torch.cuda.get_device_name())
    models = Path(args.models)
    if args.tiny:
        pair = [("moe", "tiny-qwen3-moe", write_config(models, "tiny-qwen3-moe", tiny_moe())),
                ("dense", "tiny-qwen3-dense", write_config(models, "tiny-qwen3-dense", tiny_dense()))]
    else:
        dense = args.dense if (Path(args.dense) / "config.json").is_file() else \
            write_config(models, args.dense, shape_config(args.dense))
        pair = [("moe", "qwen3-30b-a3b", write_config(models, "qwen3-30b-a3b", qwen3_30b_a3b())),
                ("dense", args.dense, dense)]
    print(f"MoE: {pair[0][2]}; dense model of about its active size: {pair[1][1]} ({pair[1][2]})", flush=True)
    (_, moe_name, moe_dir), dense = pair
    runs = [("moe", f"{moe_name} [{impl}]", moe_dir, impl) for impl in args.moe_impl]
    runs += [] if args.skip_dense else [(*dense, "auto")]
    summary([bench_model(args, role, name, directory, bandwidth, impl) for role, name, directory, impl in runs])


if __name__ == "__main__":
    main()
