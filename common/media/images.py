"""Decode an Image (bytes | data URL | path | URL) into a PIL image, refusing anything unsafe or oversized.

Every refusal is InvalidRequest with a message that says what was wrong and which limit applies,
so a bad image is INVALID_ARGUMENT for its request and never takes the worker down.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import urllib.request
import warnings
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from common.errors import InvalidConfig, InvalidRequest

_URL_SCHEMES = ("http://", "https://")


@dataclass(frozen=True)
class MediaConfig:
    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 32 * 1024 * 1024
    """Width × height cap, checked from the header before any pixel is decoded (decompression bombs)."""
    max_image_side: int = 16384
    allowed_media_dir: str | None = None
    """Image.path must resolve inside this directory (symlinks included); None refuses every path."""
    allow_url_fetch: bool = False
    url_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        checks = [
            (self.max_image_bytes >= 1, f"--max-image-bytes must be >= 1, got {self.max_image_bytes}"),
            (self.max_image_pixels >= 1, f"--max-image-pixels must be >= 1, got {self.max_image_pixels}"),
            (self.max_image_side >= 1, f"--max-image-side must be >= 1, got {self.max_image_side}"),
            (self.url_timeout_s > 0, f"--url-timeout must be > 0, got {self.url_timeout_s}"),
            (self.allowed_media_dir is None or Path(self.allowed_media_dir).is_dir(),
             f"--allowed-media-dir {self.allowed_media_dir!r} is not a directory"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidConfig(message)


@dataclass(frozen=True)
class DecodedImage:
    image: Image.Image  # RGB
    content_hash: str  # sha256 of the encoded bytes: equal images share prefix-cache blocks


def load_image(kind: str | None, value: bytes | str, config: MediaConfig) -> DecodedImage:
    """`kind` is the Image.source oneof case: "data", "data_url" or "path" (a path may be an http(s) URL)."""
    data = _read(kind, value, config)
    return DecodedImage(_decode(data, config), hashlib.sha256(data).hexdigest())


def _read(kind: str | None, value: bytes | str, config: MediaConfig) -> bytes:
    if kind == "data":
        data = bytes(value)
    elif kind == "data_url":
        data = _from_data_url(str(value), config)
    elif kind == "path" and str(value).startswith(_URL_SCHEMES):
        data = _fetch(str(value), config)
    elif kind == "path":
        data = _from_path(str(value), config)
    else:
        raise InvalidRequest("the image has no source; set one of data, data_url or path")
    if not data:
        raise InvalidRequest("the image is empty (0 bytes)")
    if len(data) > config.max_image_bytes:
        raise InvalidRequest(f"the image has {len(data)} bytes, more than the limit of {config.max_image_bytes}")
    return data


def _from_data_url(url: str, config: MediaConfig) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep or not head.startswith("data:") or not head.endswith(";base64"):
        raise InvalidRequest("data_url must look like 'data:image/<type>;base64,<data>'")
    if len(payload) > config.max_image_bytes * 4 // 3 + 4:
        raise InvalidRequest(f"the data_url image is larger than the limit of {config.max_image_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidRequest(f"data_url is not valid base64: {exc}") from None


def _from_path(path: str, config: MediaConfig) -> bytes:
    if config.allowed_media_dir is None:
        raise InvalidRequest("image paths are not allowed on this worker (start it with --allowed-media-dir)")
    root = Path(config.allowed_media_dir).resolve()
    # resolve() follows symlinks, so a link inside the directory that points outside is refused too.
    target = (root / path).resolve()
    if not target.is_relative_to(root):
        raise InvalidRequest(f"image path {path!r} is outside the allowed media directory")
    if not target.is_file():
        raise InvalidRequest(f"image path {path!r} is not a file in the allowed media directory")
    size = target.stat().st_size
    if size > config.max_image_bytes:
        raise InvalidRequest(f"image file {path!r} has {size} bytes, more than the limit of {config.max_image_bytes}")
    with open(target, "rb", opener=lambda p, flags: os.open(p, flags | os.O_NOFOLLOW)) as f:
        return f.read()


def _fetch(url: str, config: MediaConfig) -> bytes:
    if not config.allow_url_fetch:
        raise InvalidRequest("fetching images by URL is off on this worker (start it with --allow-url-fetch); "
                             "send the image bytes or a data_url instead")
    try:
        with urllib.request.urlopen(url, timeout=config.url_timeout_s) as response:
            data = response.read(config.max_image_bytes + 1)
    except (OSError, ValueError) as exc:
        raise InvalidRequest(f"could not fetch image {url!r}: {exc}") from None
    if len(data) > config.max_image_bytes:
        raise InvalidRequest(f"the image at {url!r} is larger than the limit of {config.max_image_bytes} bytes")
    return data


def _decode(data: bytes, config: MediaConfig) -> Image.Image:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            width, height = image.size  # from the header: nothing decoded yet
            _check_size(width, height, config)
            image.load()
    except InvalidRequest:
        raise
    except UnidentifiedImageError:
        raise InvalidRequest("the image data is not a recognised image format (PNG, JPEG, WebP, GIF, BMP, ...)") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise InvalidRequest(f"the image is too large to decode safely: {exc}") from None
    except (OSError, SyntaxError, ValueError) as exc:  # truncated or corrupt data
        raise InvalidRequest(f"the image could not be decoded (truncated or corrupt): {exc}") from None
    return image.convert("RGB")


def _check_size(width: int, height: int, config: MediaConfig) -> None:
    if width < 1 or height < 1:
        raise InvalidRequest(f"the image is {width}x{height}; it must have at least one pixel")
    if max(width, height) > config.max_image_side:
        raise InvalidRequest(f"the image is {width}x{height}; its sides may be at most {config.max_image_side} pixels")
    if width * height > config.max_image_pixels:
        raise InvalidRequest(f"the image is {width}x{height} = {width * height} pixels, more than the limit of "
                             f"{config.max_image_pixels}")
