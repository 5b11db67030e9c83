"""`python -m services.encode` / `disagg encode`: the encode worker process (images → embeddings), run by the
worker shell (services.worker.shell) from the role spec here: its flags, an ImageEncoder, GetInfo / GetLoad."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
from dataclasses import dataclass, field

import grpc

from common.engine.config import AUTO_DTYPE, DTYPES, resolve_dtype
from common.engine.default_model import resolve_model
from common.engine.image_encoder import ImageEncoder
from common.errors import InvalidConfig
from common.kv.embeddings import EmbeddingTable
from common.media import MediaConfig
from common.model_facts import load_model_facts
from common.pb.disagg.v1 import worker_pb2
from services.encode.server import SERVICE_NAMES, EmbeddingSource, EncodeState, add_servicers
from services.kit.process_exit import exit_process
from services.worker.shell import run_worker

_EXPIRE_EVERY_S = 0.25


@dataclass(frozen=True)
class EncodeConfig:
    model: str
    media: MediaConfig = field(default_factory=MediaConfig)
    dtype: str = "float32"
    device: str = "cpu"
    embedding_ttl_s: float = 60.0
    max_stored_bytes: int = 1 << 30
    max_images_per_request: int = 16

    def __post_init__(self) -> None:
        checks = [
            (self.embedding_ttl_s > 0, f"--embedding-ttl must be > 0, got {self.embedding_ttl_s}"),
            (self.max_stored_bytes >= 1, f"--max-stored-bytes must be >= 1, got {self.max_stored_bytes}"),
            (self.max_images_per_request >= 1,
             f"--max-images-per-request must be >= 1, got {self.max_images_per_request}"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidConfig(message)


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=os.environ.get("DISAGG_MODEL"),
                   help="LLaVA-style Hugging Face model directory (env DISAGG_MODEL)")
    p.add_argument("--dtype", default=AUTO_DTYPE, choices=[AUTO_DTYPE, *DTYPES],
                   help="the vision tower's dtype; auto: as the workers' --dtype auto")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N: where the vision tower runs")
    p.add_argument("--embedding-ttl", type=float, default=60.0, help="seconds an unpulled embedding is kept")
    p.add_argument("--max-stored-bytes", type=int, default=1 << 30, help="cap on unpulled embedding bytes")
    p.add_argument("--max-images-per-request", type=int, default=16)
    p.add_argument("--allowed-media-dir", default=None, help="Image.path must lie inside this directory")
    p.add_argument("--allow-url-fetch", action="store_true", help="let Image.path be an http(s) URL")
    p.add_argument("--max-image-bytes", type=int, default=MediaConfig.max_image_bytes)
    p.add_argument("--max-image-pixels", type=int, default=MediaConfig.max_image_pixels)


def _configure(args: argparse.Namespace) -> EncodeConfig:
    _require_vision_model(args.model)
    media = MediaConfig(max_image_bytes=args.max_image_bytes, max_image_pixels=args.max_image_pixels,
                        allowed_media_dir=args.allowed_media_dir, allow_url_fetch=args.allow_url_fetch)
    model = str(resolve_model(args.model))
    return EncodeConfig(model=model, media=media, dtype=resolve_dtype(args.dtype, args.device, model),
                        device=args.device,
                        embedding_ttl_s=args.embedding_ttl, max_stored_bytes=args.max_stored_bytes,
                        max_images_per_request=args.max_images_per_request)


def _require_vision_model(model: str | None) -> None:
    facts = load_model_facts(resolve_model(model))
    if not facts.accepts_images:
        raise InvalidConfig(f"--model {model or 'default'} is a {facts.model_type} model with no vision tower; the "
                            "encode worker needs a LLaVA-style checkpoint (LlavaForConditionalGeneration)")


@dataclass(frozen=True)
class EncodeRole:
    """The encode worker's role spec for services.worker.shell: an ImageEncoder and its embedding table."""

    role: int = worker_pb2.WORKER_ROLE_ENCODE
    description: str = "The encode worker: images → embeddings."
    service_names: tuple[str, ...] = tuple(SERVICE_NAMES)
    no_kv_events: str = "an encode worker has no prefix cache, so no KV events"

    def add_args(self, parser: argparse.ArgumentParser) -> None:
        _add_args(parser)

    def configure(self, args: argparse.Namespace) -> EncodeConfig:
        return _configure(args)

    def new_state(self, args: argparse.Namespace, config: EncodeConfig, model_name: str) -> EncodeState:
        table = EmbeddingTable(config.embedding_ttl_s, config.max_stored_bytes)
        return EncodeState(model_name=model_name, max_message_bytes=args.max_message_bytes, table=table,
                           media=config.media, max_images_per_request=config.max_images_per_request)

    def add_servicers(self, server: grpc.aio.Server, state: EncodeState, args: argparse.Namespace) -> None:
        add_servicers(server, state, args)

    def load(self, state: EncodeState, config: EncodeConfig) -> ImageEncoder:
        return ImageEncoder(config.model, config.dtype, config.device)

    async def attach(self, state: EncodeState, encoder: ImageEncoder) -> None:
        state.encoder, state.tensor_source = encoder, EmbeddingSource(state.table)

    def registration_meta(self, state: EncodeState) -> dict[str, str]:
        return {"worker_id": state.worker_id}

    async def background(self, state: EncodeState, stop: asyncio.Event) -> None:
        """Free expired embeddings even when nobody calls (GetLoad shows the memory going back)."""
        while not stop.is_set():
            state.table.expire()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), _EXPIRE_EVERY_S)

    async def info(self, state: EncodeState) -> worker_pb2.WorkerInfo:
        encoder = state.require_encoder()
        return worker_pb2.WorkerInfo(
            dtype=str(encoder.dtype).split(".")[-1], max_model_len=encoder.config.text_config.max_position_embeddings,
            limits=worker_pb2.WorkerLimits(session_ttl_ms=int(state.table.ttl_s * 1000)), engine="torch",
            supports_images=True,
        )

    async def load_report(self, state: EncodeState) -> worker_pb2.Load:
        stored, num_bytes = state.table.stored()
        return worker_pb2.Load(stored_tensors=stored, stored_tensor_bytes=num_bytes)

    async def held(self, state: EncodeState) -> int:
        """Stored embeddings a prefill (or decode) worker has still to pull."""
        return state.table.stored()[0]

    async def abort(self, state: EncodeState) -> int:
        return 0  # an Encode call ends with its batch; the grace period covers it

    async def close(self, state: EncodeState) -> str:
        dropped = state.table.clear()
        state.executor.shutdown(wait=False, cancel_futures=True)
        return f"dropped {dropped} unpulled embeddings"


SPEC = EncodeRole()


def main(argv: list[str] | None = None) -> int:
    return run_worker(SPEC, argv)


if __name__ == "__main__":
    exit_process(main())
