"""Image and audio files -> model inputs, with the model's preprocessing as data.

Calibration (``edgeflow quantize -c photos/``), evaluation and on-device
fine-tuning read real samples, not only prepared ``.npz`` files. A
preprocessing recipe says what the model was trained on — resize, center
crop, scale, mean/std, channel order, layout — either from flags or from a
small TOML file::

    [image]                      # or [audio]
    resize = 256                 # shorter side (or [H, W] for an exact size)
    crop = 224                   # center crop (or [H, W])
    scale = 0.00392156862745098  # 1/255
    mean = [0.485, 0.456, 0.406]
    std = [0.229, 0.224, 0.225]
    channels = "RGB"             # "RGB", "BGR" or "L" (grey)
    layout = "NCHW"              # or "NHWC"

    [audio]
    sample_rate = 16000          # files are resampled to this rate
    window = 15600               # samples per input (default: the input's last dimension)
    hop = 15600                  # step between windows (default: window)

Unset fields default from the model's input shape (``[N, 3, 224, 224]``
means NCHW, RGB, 224x224). Images are decoded with Pillow (an optional
dependency: ``pip install pillow``); 8/16/24/32-bit PCM ``.wav`` files with
the standard library's ``wave`` module.
"""

from __future__ import annotations

import os
import sys
import wave
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..errors import InputError

IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm"})
AUDIO_SUFFIXES = frozenset({".wav"})
ARRAY_SUFFIXES = frozenset({".npz", ".npy"})


@dataclass(frozen=True)
class ImagePrep:
    """How an image becomes one input sample (fields None = from the model's input shape)."""

    resize: tuple[int, int] | int | None = None
    crop: tuple[int, int] | None = None
    scale: float = 1.0 / 255.0
    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)
    channels: str | None = None  # "RGB", "BGR", "L"
    layout: str | None = None  # "NCHW", "NHWC"

    def resolved(self, shape: Sequence[Any]) -> ImagePrep:
        """Fill the unset fields from a 4-D input shape ([N, C, H, W] or [N, H, W, C])."""
        layout, channels, hw = self.layout, self.channels, None
        if len(shape) == 4:
            c_first, c_last = shape[1], shape[3]
            if layout is None:
                layout = "NCHW" if c_first in (1, 3) or c_last not in (1, 3) else "NHWC"
            c = c_first if layout == "NCHW" else c_last
            h, w = (shape[2], shape[3]) if layout == "NCHW" else (shape[1], shape[2])
            if isinstance(h, int) and isinstance(w, int) and h > 0 and w > 0:
                hw = (h, w)
            if channels is None and isinstance(c, int):
                channels = "L" if c == 1 else "RGB"
        elif len(shape) == 3:  # [N, H, W]: grey images
            layout, channels = layout or "NHW", channels or "L"
            if all(isinstance(d, int) and d > 0 for d in shape[1:]):
                hw = (shape[1], shape[2])
        else:
            raise InputError(f"an image input needs a 3-D or 4-D shape, the model's input is {list(shape)}")
        crop = self.crop or (hw if self.resize is not None else None)
        resize = self.resize if self.resize is not None else hw
        if resize is None:
            raise InputError(
                f"the model's input {list(shape)} has no fixed height/width: give the image size "
                "(--resize H,W or [image] resize = [H, W]), or fix it with --shape"
            )
        return replace(self, resize=resize, crop=crop, layout=layout or "NCHW", channels=channels or "RGB")


@dataclass(frozen=True)
class AudioPrep:
    """How a sound file becomes input windows."""

    sample_rate: int = 16000
    window: int | None = None
    hop: int | None = None


def load_prep(path: str | os.PathLike) -> ImagePrep | AudioPrep:
    """A recipe from a TOML file with an ``[image]`` or ``[audio]`` table."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise InputError(f"cannot read preprocessing file {p}: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"{p}: not valid TOML: {exc}") from exc
    tables = [k for k in ("image", "audio") if k in data]
    if len(tables) != 1 or set(data) - {"image", "audio"}:
        raise InputError(f"{p}: expected exactly one table, [image] or [audio]; found {sorted(data)}")
    cls = ImagePrep if tables[0] == "image" else AudioPrep
    return prep_from_dict(cls, data[tables[0]], source=str(p))


def prep_from_dict(cls: type, d: dict[str, Any], *, source: str = "preprocessing") -> Any:
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise InputError(f"{source}: unknown key(s) {unknown}; known: {sorted(known)}")
    kw: dict[str, Any] = {}
    for k, v in d.items():
        try:
            kw[k] = _coerce(k, v)
        except (TypeError, ValueError) as exc:
            raise InputError(f"{source}: {k} = {v!r}: {exc}") from exc
    prep = cls(**kw)
    _validate(prep, source)
    return prep


def _coerce(key: str, v: Any) -> Any:
    if key in ("resize", "crop"):
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return int(v) if key == "resize" else (int(v), int(v))
        v = [int(x) for x in (v.split(",") if isinstance(v, str) else v)]
        if len(v) == 1:
            return int(v[0]) if key == "resize" else (v[0], v[0])
        if len(v) != 2:
            raise ValueError("give one size or [height, width]")
        return (v[0], v[1])
    if key in ("mean", "std"):
        vals = v.split(",") if isinstance(v, str) else (v if isinstance(v, (list, tuple)) else [v])
        return tuple(float(x) for x in vals)
    if key == "scale":
        return float(v)
    if key in ("channels", "layout"):
        return str(v).upper()
    if key in ("sample_rate", "window", "hop"):
        return int(v)
    return v


def _validate(prep: ImagePrep | AudioPrep, source: str) -> None:
    problems = []
    if isinstance(prep, ImagePrep):
        if prep.channels not in (None, "RGB", "BGR", "L"):
            problems.append(f"channels must be RGB, BGR or L, got {prep.channels!r}")
        if prep.layout not in (None, "NCHW", "NHWC", "NHW"):
            problems.append(f"layout must be NCHW or NHWC, got {prep.layout!r}")
        if any(s == 0 for s in prep.std):
            problems.append("std must not contain 0")
        sizes = [prep.resize] if isinstance(prep.resize, int) else list(prep.resize or ())
        if any(s < 1 for s in sizes + list(prep.crop or ())):
            problems.append("resize and crop sizes must be >= 1")
    else:
        if prep.sample_rate < 1000:
            problems.append(f"sample_rate {prep.sample_rate} is too low")
        if (prep.window is not None and prep.window < 1) or (prep.hop is not None and prep.hop < 1):
            problems.append("window and hop must be >= 1 samples")
    if problems:
        raise InputError(f"{source}: " + "; ".join(problems))


# ---------------------------------------------------------------- images


def _pillow():
    try:
        from PIL import Image
    except ImportError as exc:
        raise InputError("reading images needs Pillow: pip install pillow (or give a .npz of prepared arrays)") from exc
    return Image


def image_to_array(path: str | os.PathLike, prep: ImagePrep) -> np.ndarray:
    """One image file -> one sample (without the batch axis), per a *resolved* recipe."""
    Image = _pillow()
    try:
        with Image.open(path) as im:
            im = im.convert("L" if prep.channels == "L" else "RGB")
            im = _resize(im, prep.resize, Image)
            if prep.crop:
                im = _center_crop(im, prep.crop)
            a = np.asarray(im, dtype=np.float32)
    except (OSError, ValueError) as exc:  # PIL.UnidentifiedImageError is an OSError
        raise InputError(f"{path}: cannot read as an image ({exc})") from exc
    if prep.channels == "BGR":
        a = a[..., ::-1]
    a = a * np.float32(prep.scale)
    mean = np.asarray(prep.mean, np.float32)
    std = np.asarray(prep.std, np.float32)
    a = (a - mean) / std
    if prep.layout == "NCHW":
        a = a[None] if a.ndim == 2 else np.transpose(a, (2, 0, 1))
    elif prep.layout == "NHWC" and a.ndim == 2:
        a = a[..., None]
    return np.ascontiguousarray(a, dtype=np.float32)


def _resize(im: Any, size: tuple[int, int] | int, Image: Any) -> Any:
    w, h = im.size
    if isinstance(size, int):  # shorter side -> size, keep the aspect ratio (torchvision Resize(int))
        if w <= h:
            new = (size, max(1, round(h * size / w)))
        else:
            new = (max(1, round(w * size / h)), size)
    else:
        new = (size[1], size[0])  # PIL wants (width, height)
    return im if new == (w, h) else im.resize(new, Image.BILINEAR)


def _center_crop(im: Any, crop: tuple[int, int]) -> Any:
    ch, cw = crop
    w, h = im.size
    if ch > h or cw > w:
        raise InputError(f"center crop {ch}x{cw} is larger than the resized image {h}x{w}: resize to at least the crop")
    left, top = (w - cw) // 2, (h - ch) // 2
    return im.crop((left, top, left + cw, top + ch))


# ----------------------------------------------------------------- audio


def read_wav(path: str | os.PathLike) -> tuple[np.ndarray, int]:
    """(mono float32 samples in [-1, 1], sample rate) of a PCM .wav file."""
    try:
        with wave.open(str(path), "rb") as w:
            n, width, rate, channels = w.getnframes(), w.getsampwidth(), w.getframerate(), w.getnchannels()
            raw = w.readframes(n)
    except (OSError, EOFError, wave.Error) as exc:
        raise InputError(f"{path}: cannot read as a PCM .wav file ({exc}); convert it, e.g. "
                         "`sox in.flac -b 16 out.wav`") from exc
    if width == 1:
        x = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width == 2:
        x = np.frombuffer(raw, "<i2").astype(np.float32) / 32768.0
    elif width == 3:
        b = np.frombuffer(raw, np.uint8).reshape(-1, 3).astype(np.int32)
        v = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        x = (np.where(v >= 1 << 23, v - (1 << 24), v)).astype(np.float32) / float(1 << 23)
    elif width == 4:
        x = np.frombuffer(raw, "<i4").astype(np.float32) / float(1 << 31)
    else:  # pragma: no cover - wave refuses other widths
        raise InputError(f"{path}: {8 * width}-bit samples are not supported")
    if channels > 1:
        x = x.reshape(-1, channels).mean(axis=1)
    return np.ascontiguousarray(x, np.float32), rate


def resample(x: np.ndarray, rate: int, target: int) -> np.ndarray:
    """Band-limited resampling by the FFT (exact for signals below both Nyquist rates)."""
    if rate == target or len(x) == 0:
        return x.astype(np.float32, copy=False)
    n_out = max(1, int(round(len(x) * target / rate)))
    spec = np.fft.rfft(x.astype(np.float64))
    keep = min(len(spec), n_out // 2 + 1)
    out = np.zeros(n_out // 2 + 1, np.complex128)
    out[:keep] = spec[:keep]
    y = np.fft.irfft(out, n_out) * (n_out / len(x))
    return y.astype(np.float32)


def audio_windows(path: str | os.PathLike, prep: AudioPrep, window: int) -> np.ndarray:
    """(k, window) float32 windows of a sound file at ``prep.sample_rate`` (the last one zero-padded)."""
    x, rate = read_wav(path)
    x = resample(x, rate, prep.sample_rate)
    hop = prep.hop or window
    if len(x) <= window:
        return np.pad(x, (0, window - len(x)))[None]
    starts = range(0, len(x) - window + hop, hop)
    out = np.zeros((len(starts), window), np.float32)
    for i, s in enumerate(starts):
        seg = x[s:s + window]
        out[i, :len(seg)] = seg
    return out


# ---------------------------------------------------------------- folders


def folder_samples(
    path: str | os.PathLike,
    input_shape: Sequence[Any],
    prep: ImagePrep | AudioPrep | None = None,
    *,
    limit: int | None = None,
) -> tuple[np.ndarray, list[str]]:
    """Every image or sound file of a folder (sorted by name) as one batch of samples.

    Returns (samples, notes). The folder holds images or .wav files, not both;
    other files are skipped and counted in a note.
    """
    root = Path(path)
    if not root.is_dir():
        raise InputError(f"{root}: not a folder")
    files = sorted(p for p in root.rglob("*") if p.is_file())
    images = [p for p in files if p.suffix.lower() in IMAGE_SUFFIXES]
    sounds = [p for p in files if p.suffix.lower() in AUDIO_SUFFIXES]
    if images and sounds:
        raise InputError(f"{root}: holds both images ({len(images)}) and .wav files ({len(sounds)}); use one kind")
    if not images and not sounds:
        raise InputError(f"{root}: no image ({', '.join(sorted(IMAGE_SUFFIXES))}) or .wav file found")
    notes = []
    skipped = len(files) - len(images) - len(sounds)
    if skipped:
        notes.append(f"{skipped} file(s) in {root} are neither images nor .wav and were skipped")
    if images:
        if isinstance(prep, AudioPrep):
            raise InputError(f"{root} holds images but the preprocessing recipe is for audio")
        ip = (prep or ImagePrep()).resolved(input_shape)
        chosen = images[:limit] if limit else images
        arr = np.stack([image_to_array(p, ip) for p in chosen])
        notes.append(f"{len(chosen)} image(s) from {root}: {describe(ip)}")
        return arr, notes
    if isinstance(prep, ImagePrep):
        raise InputError(f"{root} holds .wav files but the preprocessing recipe is for images")
    ap = prep or AudioPrep()
    window = ap.window or (input_shape[-1] if input_shape and isinstance(input_shape[-1], int) else None)
    if not window or window < 1:
        raise InputError(f"the model's input {list(input_shape)} has no fixed length: give [audio] window = N")
    chunks = [audio_windows(p, ap, window) for p in sounds]
    arr = np.concatenate(chunks)
    if limit:
        arr = arr[:limit]
    if len(input_shape) == 3:  # [N, 1, T]
        arr = arr[:, None, :]
    notes.append(f"{len(arr)} window(s) of {window} samples at {ap.sample_rate} Hz from {len(sounds)} .wav file(s)")
    return arr, notes


def describe(p: ImagePrep) -> str:
    size = f"shorter side {p.resize}" if isinstance(p.resize, int) else f"{p.resize[0]}x{p.resize[1]}"
    crop = f", center crop {p.crop[0]}x{p.crop[1]}" if p.crop else ""
    return (f"resize {size}{crop}, x{p.scale:.6g}, mean {list(p.mean)}, std {list(p.std)}, "
            f"{p.channels}, {p.layout}")
