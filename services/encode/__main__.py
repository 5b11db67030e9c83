"""`python -m services.encode` / `disagg encode`: the encode worker process (images → embeddings)."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
from dataclasses import dataclass

from common.engine.default_model import model_label, resolve_model
from common.engine.image_encoder import ImageEncoder
from common.engine.models.llava import is_vision_language
from common.engine.models.loader import load_config
from common.errors import InvalidConfig
from common.kv.embeddings import EmbeddingTable
from common.media import MediaConfig
from common.tls import add_tls_args, tls_from_args
from common.tls import configure as configure_tls
from services.encode.server import SERVICE_NAMES, EmbeddingSource, EncodeState, add_servicers
from services.observability import Observability, add_observability_args
from services.serving import DEFAULT_MAX_MESSAGE_BYTES, setup_logging, start_server

log = logging.getLogger(__name__)
SHUTDOWN_GRACE_S = 5.0
_EXPIRE_EVERY_S = 0.25


@dataclass(frozen=True)
class EncodeConfig:
    model: str
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


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="disagg encode", description="The encode worker: images → embeddings.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free one")
    p.add_argument("--advertise-host", default=os.environ.get("DISAGG_ADVERTISE_HOST"),
                   help="host other processes use to reach this one (env DISAGG_ADVERTISE_HOST)")
    p.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES)
    p.add_argument("--model", default=os.environ.get("DISAGG_MODEL"),
                   help="LLaVA-style Hugging Face model directory (env DISAGG_MODEL)")
    p.add_argument("--model-name", default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--embedding-ttl", type=float, default=60.0, help="seconds an unpulled embedding is kept")
    p.add_argument("--max-stored-bytes", type=int, default=1 << 30, help="cap on unpulled embedding bytes")
    p.add_argument("--max-images-per-request", type=int, default=16)
    p.add_argument("--allowed-media-dir", default=None, help="Image.path must lie inside this directory")
    p.add_argument("--allow-url-fetch", action="store_true", help="let Image.path be an http(s) URL")
    p.add_argument("--max-image-bytes", type=int, default=MediaConfig.max_image_bytes)
    p.add_argument("--max-image-pixels", type=int, default=MediaConfig.max_image_pixels)
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    add_tls_args(p)
    add_observability_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    setup_logging("encode", args.log_level)
    try:
        _require_vision_model(args.model)
        config = EncodeConfig(model=str(resolve_model(args.model)), dtype=args.dtype, device=args.device,
                              embedding_ttl_s=args.embedding_ttl, max_stored_bytes=args.max_stored_bytes,
                              max_images_per_request=args.max_images_per_request)
        media = MediaConfig(max_image_bytes=args.max_image_bytes, max_image_pixels=args.max_image_pixels,
                            allowed_media_dir=args.allowed_media_dir, allow_url_fetch=args.allow_url_fetch)
        configure_tls(tls_from_args(args))
    except (InvalidConfig, ValueError, FileNotFoundError) as exc:
        parser.error(str(exc))
    try:
        asyncio.run(_serve(args, config, media))
    except Exception:
        log.exception("the encode worker failed")
        return 1
    return 0


def _require_vision_model(model: str | None) -> None:
    config = load_config(resolve_model(model))
    if not is_vision_language(config):
        raise InvalidConfig(f"--model {model or 'default'} is a {config.model_type} model with no vision tower; the "
                            "encode worker needs a LLaVA-style checkpoint (LlavaForConditionalGeneration)")


async def _serve(args: argparse.Namespace, config: EncodeConfig, media: MediaConfig) -> None:
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    table = EmbeddingTable(config.embedding_ttl_s, config.max_stored_bytes)
    state = EncodeState(args.model_name or model_label(args.model), table, media, config.max_images_per_request,
                        args.max_message_bytes)
    obs = Observability.from_args("encode", state.model_name, args)
    state.metrics = obs.metrics
    server = await start_server(lambda s: add_servicers(s, state), SERVICE_NAMES, args.host, args.port,
                                args.max_message_bytes)
    host = args.advertise_host or (socket.gethostname() if args.host in ("0.0.0.0", "::", "") else args.host)
    state.endpoint = f"{host}:{server.port}"
    expiring = None
    try:
        loop = asyncio.get_running_loop()
        state.encoder = await loop.run_in_executor(state.executor, ImageEncoder, config.model, config.dtype,
                                                   config.device)
        state.tensor_source = EmbeddingSource(table)
        await server.set_serving(True)
        print(f"disagg-encode serving on {state.endpoint}", flush=True)
        await obs.start(args.host, host, server.port, meta={"worker_id": state.worker_id})
        expiring = asyncio.ensure_future(_expire(table))
        await stop.wait()
    finally:
        state.shutting_down = True
        if expiring is not None:
            expiring.cancel()
        await obs.stop()
        await server.stop(SHUTDOWN_GRACE_S)
        dropped = table.clear()
        state.executor.shutdown(wait=False, cancel_futures=True)
        log.info("stopped: dropped %d unpulled embeddings", dropped)


async def _expire(table: EmbeddingTable) -> None:
    """Free expired embeddings even when nobody calls (GetLoad shows the memory going back)."""
    while True:
        table.expire()
        await asyncio.sleep(_EXPIRE_EVERY_S)


if __name__ == "__main__":
    sys.exit(main())
