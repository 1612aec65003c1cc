"""ONNX ``ImageDecoder`` (opset 20) on the numpy backend, through Pillow.

Decoding JPEG/PNG/WebP/TIFF/... is not numpy work, so this kernel lives
outside the numpy-only kernel library and is registered only where Pillow
is importable (``pip install pillow``). Without Pillow the op stays
unsupported: a model using it is refused at load with the usual one-line
message, and the conformance selection records its cases as excluded.

Output: uint8 (H, W, 3) for RGB/BGR, (H, W, 1) for Grayscale, as in the
specification and onnx's reference implementation.
"""

from __future__ import annotations

import io

import numpy as np

from ..kernels import register

try:
    import PIL.Image as _Image
except ImportError:  # Pillow is optional: the op is then unsupported
    _Image = None

AVAILABLE = _Image is not None
MISSING_REASON = "ImageDecoder needs Pillow, which is not installed (pip install pillow)"


def _decode(encoded: np.ndarray, *, pixel_format: str = "RGB") -> np.ndarray:
    if pixel_format not in ("RGB", "BGR", "Grayscale"):
        raise ValueError(f"ImageDecoder pixel_format must be RGB, BGR or Grayscale, got {pixel_format!r}")
    data = np.ascontiguousarray(encoded, dtype=np.uint8).tobytes()
    try:
        img = _Image.open(io.BytesIO(data))
        img.load()
    except (OSError, SyntaxError, ValueError) as exc:  # Pillow's errors for undecodable data
        raise ValueError(f"ImageDecoder cannot decode the {len(data)}-byte input: {exc}") from exc
    if pixel_format == "Grayscale":
        return np.asarray(img.convert("L"), dtype=np.uint8)[:, :, np.newaxis]
    rgb = np.asarray(img if img.mode == "RGB" else img.convert("RGB"), dtype=np.uint8)
    return np.ascontiguousarray(rgb[:, :, ::-1]) if pixel_format == "BGR" else rgb


if AVAILABLE:
    image_decoder = register("ImageDecoder", since=20, dtypes={"uint8"})(_decode)
