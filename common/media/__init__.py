"""Images for multimodal requests: decoded from bytes, a data URL, an allowed local path or (opt-in) a URL."""
from common.media.images import DecodedImage, MediaConfig, load_image

__all__ = ["DecodedImage", "MediaConfig", "load_image"]
