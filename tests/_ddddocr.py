"""ddddocr's models (PyPI ``ddddocr==1.6.1``, MIT), fetched the way the real-model suite fetches
its own: ``pip download`` of the pinned wheel, every file checked by sha256, into the suite's cache.

They are not suite models (the suite's manifest is edgeflow/model_suite.toml); the tests that need
them build a small manifest here and hand it to ``model_suite.fetch``:

- ``ddddocr-ocr-old``: ddddocr's default captcha OCR (``DdddOcr()`` loads common_old.onnx), a CNN +
  bidirectional LSTM that onnxruntime's dynamic quantizer wrote: ConvInteger, MatMulInteger and one
  ``com.microsoft::DynamicQuantizeLSTM``; input (1, 1, 64, W) gray in 0..1, output CTC logits
  (T, 1, 8210) over ``CHARSET_OLD`` of the wheel's charsets.py.
- ``ddddocr-det``: ddddocr's text detector (``DdddOcr(det=True)``), a YOLOX-s-style net at 416x416:
  output (1, 3549, 6) = per anchor (cx, cy, w, h) on the 8/16/32-stride grids (before the grid decode),
  objectness, one class score.
"""

from __future__ import annotations

import ast
import zipfile

import numpy as np
import pytest

from edgeflow import model_suite as ms

DIST = ms.Dist(
    key="ddddocr", package="ddddocr", version="1.6.1", file="ddddocr-1.6.1-py3-none-any.whl",
    sha256="c7c70f4ae2d0335440ae8b272eea48c9f6888ecef46785fe2311f0c97a133935", bytes=75983593,
    license="MIT")
MODELS = {
    "ddddocr-ocr-old": ms.SuiteModel(
        name="ddddocr-ocr-old", dist=DIST, member="ddddocr/common_old.onnx",
        sha256="b8f2ad9cbc1f2e3922a6cb9459e30824e7e2467f3fb4fd61420640e34ea0bf68", bytes=13606051,
        family="ocr", task="captcha OCR, CNN + BiLSTM, dynamically quantized (DynamicQuantizeLSTM)"),
    "ddddocr-det": ms.SuiteModel(
        name="ddddocr-det", dist=DIST, member="ddddocr/common_det.onnx",
        sha256="6faa8ea85a8c1a634e5050c4a138fca10f30194e0d7abbe9ade1fcd423af6ed6", bytes=20127694,
        family="detection", task="text-box detection, YOLOX-style, 416x416"),
}
MANIFEST = ms.Manifest(dists={"ddddocr": DIST}, models=MODELS, assets={})


def fetch(name: str):
    """Path of the model file, downloaded and verified on first use; skips where PyPI is unreachable."""
    try:
        return ms.fetch([name], manifest_=MANIFEST).paths[name]
    except ms.ModelDownloadError as exc:
        pytest.skip(f"ddddocr's wheel is not cached and cannot be downloaded: {exc}")


def charset_old() -> list[str]:
    """``CHARSET_OLD`` from the wheel's charsets.py, read with ast (the package is never imported)."""
    with zipfile.ZipFile(ms.cache_dir() / "dists" / DIST.file) as z:
        tree = ast.parse(z.read("ddddocr/charsets.py").decode("utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "CHARSET_OLD":
            return list(ast.literal_eval(node.value))
    raise AssertionError("ddddocr/charsets.py has no CHARSET_OLD")


def captcha(text: str) -> np.ndarray:
    """``text`` drawn black on white, prepared as ddddocr's OCR prepares an image: height 64, width
    in proportion, gray, /255, (1, 1, 64, W)."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (30 + 26 * len(text), 64), (255, 255, 255))
    ImageDraw.Draw(img).text((10, 8), text, fill=(0, 0, 0), font=ms._font(40))
    gray = img.convert("L")
    return (np.asarray(gray, np.float32) / 255.0)[None, None]


def ctc_text(logits: np.ndarray, charset: list[str]) -> str:
    """Greedy CTC: argmax per step, repeats collapsed, blank (index 0) dropped."""
    out, prev = [], 0
    for i in logits.reshape(logits.shape[0], -1).argmax(-1):
        if i != prev and i != 0:
            out.append(charset[i])
        prev = i
    return "".join(out)


def digits_page(sample: int) -> tuple[np.ndarray, np.ndarray]:
    """Five digits 50-70 px high drawn dark on a light 416x416 page, as ddddocr's detector takes it
    (BGR, 0..255 float, (1, 3, 416, 416)), and the digits' boxes (5, 4) x1, y1, x2, y2."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(sample)
    img = Image.new("RGB", (416, 416), (235, 235, 225))
    draw = ImageDraw.Draw(img)
    boxes = []
    for k in range(5):
        x, y = 15 + 80 * k + int(rng.integers(0, 20)), int(rng.integers(30, 330))
        font = ms._font(int(rng.integers(50, 70)))
        ch = "0123456789"[int(rng.integers(10))]
        boxes.append(draw.textbbox((x, y), ch, font=font))
        draw.text((x, y), ch, fill=(20, 20, 20), font=font)
    x = np.asarray(img, np.float32)[..., ::-1].transpose(2, 0, 1)[None].copy()
    return x, np.array(boxes, np.float64)
