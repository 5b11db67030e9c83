"""Every channel one disagg process opens to another: TLS as configured (common.tls), tracing
interceptors when tracing is on (common.telemetry.tracing), the caller's message-size options."""
from __future__ import annotations

from typing import Sequence

import grpc

from common import tls
from common.telemetry import tracing


def aio_channel(target: str, options: Sequence[tuple[str, int]] = ()) -> grpc.aio.Channel:
    settings = tls.current()
    interceptors = list(tracing.client_interceptors()) or None
    if settings.dials_tls:
        return grpc.aio.secure_channel(target, settings.channel_credentials(), options=list(options),
                                       interceptors=interceptors)
    return grpc.aio.insecure_channel(target, options=list(options), interceptors=interceptors)


def sync_channel(target: str, options: Sequence[tuple[str, int]] = ()) -> grpc.Channel:
    """For command-line clients (`disagg generate`, `disagg up`'s health checks)."""
    settings = tls.current()
    if settings.dials_tls:
        return grpc.secure_channel(target, settings.channel_credentials(), options=list(options))
    return grpc.insecure_channel(target, options=list(options))
