"""Image decoding: every accepted source, and a clear InvalidRequest for everything unsafe or broken."""
from __future__ import annotations

import base64
import hashlib
import io
import os

import numpy as np
import pytest
from PIL import Image

from common.errors import InvalidConfig, InvalidRequest
from common.media import MediaConfig, load_image
from benchmarks.tiny_llava import png_bytes


def _encoded(array: np.ndarray, fmt: str) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format=fmt)
    return buffer.getvalue()


@pytest.fixture
def media(tmp_path) -> MediaConfig:
    root = tmp_path / "media"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "a.png").write_bytes(png_bytes(1))
    (tmp_path / "secret.png").write_bytes(png_bytes(2))
    os.symlink(tmp_path / "secret.png", root / "escape.png")
    os.symlink(root / "sub" / "a.png", root / "inside-link.png")
    return MediaConfig(allowed_media_dir=str(root), max_image_pixels=1_000_000)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "BMP", "GIF", "WEBP"])
def test_common_formats_decode_to_rgb_with_a_content_hash(fmt):
    data = _encoded((np.random.RandomState(0).rand(12, 20, 3) * 255).astype(np.uint8), fmt)
    decoded = load_image("data", data, MediaConfig())
    assert decoded.image.size == (20, 12) and decoded.image.mode == "RGB"
    assert decoded.content_hash == hashlib.sha256(data).hexdigest()


def test_data_url_and_allowed_paths_give_the_same_image(media):
    data = png_bytes(1)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    hashes = {load_image(kind, value, media).content_hash
              for kind, value in [("data", data), ("data_url", url), ("path", "sub/a.png"),
                                  ("path", "inside-link.png")]}
    assert hashes == {hashlib.sha256(data).hexdigest()}


@pytest.mark.parametrize("kind, value, message", [
    ("data", b"hello, not an image", "not a recognised image format"),
    ("data", png_bytes(3)[:60], "truncated or corrupt"),
    ("data", b"", "0 bytes"),
    ("data_url", "data:image/png,abc", "must look like"),
    ("data_url", "data:image/png;base64,***", "not valid base64"),
    ("path", "../secret.png", "outside the allowed media directory"),
    ("path", "sub/../../secret.png", "outside the allowed media directory"),
    ("path", "escape.png", "outside the allowed media directory"),
    ("path", "missing.png", "not a file"),
    ("path", "https://example.com/cat.png", "fetching images by URL is off"),
    (None, b"", "no source"),
])
def test_bad_images_are_invalid_requests_that_say_why(media, kind, value, message):
    with pytest.raises(InvalidRequest, match=message):
        load_image(kind, value, media)


def test_size_caps_are_checked_before_decoding(media):
    wide = _encoded(np.zeros((1, 20000, 3), dtype=np.uint8), "PNG")
    with pytest.raises(InvalidRequest, match="1x.*at most 16384 pixels|20000x1.*at most 16384"):
        load_image("data", wide, media)
    big = _encoded(np.zeros((1100, 1000, 3), dtype=np.uint8), "PNG")
    with pytest.raises(InvalidRequest, match="1100000 pixels, more than the limit of 1000000"):
        load_image("data", big, media)
    with pytest.raises(InvalidRequest, match="more than the limit of 100"):
        load_image("data", png_bytes(1), MediaConfig(max_image_bytes=100))


def test_paths_are_refused_without_a_media_dir_and_the_config_is_validated(tmp_path):
    with pytest.raises(InvalidRequest, match="--allowed-media-dir"):
        load_image("path", "a.png", MediaConfig())
    with pytest.raises(InvalidConfig, match="not a directory"):
        MediaConfig(allowed_media_dir=str(tmp_path / "nope"))
