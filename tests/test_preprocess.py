"""Real image and sound files -> model inputs (edgeflow.data.preprocess), and calibration from folders.

Images are the ones scikit-learn ships (its two sample photos, and its 8x8
digits written out as PNG files); nothing is random noise.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import wave
from pathlib import Path

import numpy as np
import onnx
import pytest

from edgeflow import zoo
from edgeflow.errors import InputError, QuantizationError
from edgeflow.data.preprocess import (
    AudioPrep,
    ImagePrep,
    folder_samples,
    image_to_array,
    load_prep,
    read_wav,
    resample,
)

PIL = pytest.importorskip("PIL.Image")
datasets = pytest.importorskip("sklearn.datasets")

IMAGENET = dict(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    """scikit-learn's sample photos (china.jpg, flower.jpg, 427x640), plus a stray text file."""
    d = tmp_path_factory.mktemp("photos")
    for name in ("china.jpg", "flower.jpg"):
        PIL.fromarray(datasets.load_sample_image(name)).save(d / name, quality=95)
    (d / "README.txt").write_text("not an image")
    return d


@pytest.fixture(scope="module")
def digit_pngs(tmp_path_factory):
    """The first 120 of scikit-learn's digits as 8x8 grey PNGs (pixels 0..16 stored as 0..240)."""
    d = tmp_path_factory.mktemp("digits")
    ds = datasets.load_digits()
    for i in range(120):
        PIL.fromarray((ds.images[i] * 15).astype(np.uint8), mode="L").save(d / f"{i:04d}.png")
    return d, ds.images[:120].astype(np.float32), ds.target[:120]


def test_imagenet_style_recipe_matches_a_hand_written_pipeline(photos):
    prep = ImagePrep(resize=256, crop=(224, 224), **IMAGENET).resolved(["N", 3, 224, 224])
    got = image_to_array(photos / "china.jpg", prep)
    assert got.shape == (3, 224, 224) and got.dtype == np.float32
    # by hand: shorter side 427 -> 256 (640 -> 384), center crop 224, /255, normalise, HWC -> CHW
    im = PIL.open(photos / "china.jpg").convert("RGB").resize((384, 256), PIL.BILINEAR)
    a = np.asarray(im, np.float32)[16:240, 80:304] / 255.0
    want = ((a - np.array(IMAGENET["mean"], np.float32)) / np.array(IMAGENET["std"], np.float32)).transpose(2, 0, 1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_bgr_and_nhwc(photos):
    rgb = image_to_array(photos / "flower.jpg", ImagePrep(resize=(32, 48), layout="NHWC").resolved(["N", 32, 48, 3]))
    bgr = image_to_array(photos / "flower.jpg",
                         ImagePrep(resize=(32, 48), layout="NHWC", channels="BGR").resolved(["N", 32, 48, 3]))
    assert rgb.shape == (32, 48, 3)
    np.testing.assert_array_equal(rgb[..., ::-1], bgr)


def test_a_folder_defaults_from_the_model_input_shape(photos):
    x, notes = folder_samples(photos, ["N", 3, 64, 64])
    assert x.shape == (2, 3, 64, 64)
    assert 0.0 <= x.min() and x.max() <= 1.0  # default scale 1/255, no mean/std
    assert any("1 file(s)" in n and "skipped" in n for n in notes)
    assert any("2 image(s)" in n and "64x64" in n for n in notes)


def test_digit_pngs_round_trip_to_the_arrays(digit_pngs):
    d, images, _ = digit_pngs
    x, _ = folder_samples(d, ["N", 1, 8, 8], ImagePrep(scale=1 / 15))
    np.testing.assert_allclose(x[:, 0], images, atol=1e-5)


def test_quantize_calibrates_from_a_folder_of_pngs(digit_pngs, tmp_path):
    """`edgeflow quantize -c folder/`: the same calibration as the .npz of the same digits."""
    from edgeflow.quantization import quantize

    d, images, labels = digit_pngs
    model = zoo.digits_cnn()
    via_folder = quantize(model, "x86-gateway", str(d), engine="numpy", preprocess=ImagePrep(scale=1 / 15),
                          latency_runs=0, holdout=0)
    via_arrays = quantize(model, "x86-gateway", images[:, None], engine="numpy", latency_runs=0, holdout=0)
    assert any("120 image(s)" in n for n in via_folder.report.notes)
    a = {t.name: onnx.numpy_helper.to_array(t) for t in via_folder.model.graph.initializer}
    b = {t.name: onnx.numpy_helper.to_array(t) for t in via_arrays.model.graph.initializer}
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-7, err_msg=k)


def test_quantize_cli_with_a_folder_and_flags(photos, tmp_path):
    model = tmp_path / "cnn.onnx"
    onnx.save(zoo.small_cnn((3, 32, 32), channels=(8, 16), hidden=16), model)
    out = subprocess.run([sys.executable, "-m", "edgeflow", "quantize", str(model), "--profile", "x86-gateway",
                          "-c", str(photos), "--resize", "40", "--crop", "32", "--mean", "0.485,0.456,0.406",
                          "--std", "0.229,0.224,0.225", "--method", "minmax", "--engine", "numpy",
                          "-o", str(tmp_path / "q.onnx"), "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert rep["n_calibration"] == 2
    assert any("center crop 32x32" in n for n in rep["notes"]), rep["notes"]
    onnx.checker.check_model(onnx.load(tmp_path / "q.onnx"))


def test_recipe_file_and_its_errors(tmp_path, photos):
    good = tmp_path / "prep.toml"
    good.write_text('[image]\nresize = 72\ncrop = [64, 64]\nmean = [0.5, 0.5, 0.5]\nstd = [0.5, 0.5, 0.5]\n')
    prep = load_prep(good)
    assert isinstance(prep, ImagePrep) and prep.crop == (64, 64) and prep.mean == (0.5, 0.5, 0.5)
    x, _ = folder_samples(photos, ["N", 3, 64, 64], prep)
    assert x.shape == (2, 3, 64, 64) and x.min() < 0  # normalised to about [-1, 1]
    for text, needle in (('[image]\ncolour = 3\n', "unknown key(s) ['colour']"),
                         ('[image]\nstd = [0, 1, 1]\n', "std must not contain 0"),
                         ('[video]\nfps = 3\n', "exactly one table"),
                         ('[image\n', "not valid TOML")):
        bad = tmp_path / "bad.toml"
        bad.write_text(text)
        with pytest.raises(InputError, match=re.escape(needle)):
            load_prep(bad)


def test_folder_errors_are_one_line(tmp_path, photos):
    from edgeflow.quantization import quantize

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("x")
    with pytest.raises(QuantizationError, match="no image"):
        quantize(zoo.small_cnn((3, 32, 32)), "x86-gateway", str(empty), engine="numpy", latency_runs=0)
    with pytest.raises(QuantizationError, match="crop 64x64 is larger"):
        quantize(zoo.small_cnn((3, 32, 32)), "x86-gateway", str(photos), engine="numpy", latency_runs=0,
                 preprocess=ImagePrep(resize=32, crop=(64, 64)))
    two_inputs = zoo.mlp((4, 2))
    two_inputs.graph.input.append(onnx.helper.make_tensor_value_info("extra", onnx.TensorProto.FLOAT, ["N", 4]))
    with pytest.raises(QuantizationError, match="feeds one input"):
        quantize(two_inputs, "x86-gateway", str(photos), engine="numpy", latency_runs=0)


def _write_wav(path: Path, x: np.ndarray, rate: int, width: int) -> None:
    scale = {1: 127, 2: 32767, 3: (1 << 23) - 1, 4: (1 << 31) - 1}[width]
    q = np.round(x * scale).astype(np.int64)
    if width == 1:
        raw = (q + 128).astype(np.uint8).tobytes()
    elif width == 3:
        u = q & 0xFFFFFF
        raw = np.stack([u & 0xFF, (u >> 8) & 0xFF, (u >> 16) & 0xFF], axis=1).astype(np.uint8).tobytes()
    else:
        raw = q.astype({2: "<i2", 4: "<i4"}[width]).tobytes()
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(raw)


@pytest.mark.parametrize("width", [1, 2, 3, 4])
def test_wav_reader_decodes_every_pcm_width(tmp_path, width):
    t = np.arange(4410) / 44100
    x = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    _write_wav(tmp_path / "a.wav", x, 44100, width)
    got, rate = read_wav(tmp_path / "a.wav")
    assert rate == 44100 and len(got) == len(x)
    np.testing.assert_allclose(got, x, atol={1: 1e-2, 2: 1e-4, 3: 1e-6, 4: 1e-6}[width])


def test_resampling_keeps_a_tone_and_its_length():
    rate, target = 44100, 16000
    t = np.arange(rate) / rate  # 1 s
    x = np.sin(2 * np.pi * 440 * t).astype(np.float32)
    y = resample(x, rate, target)
    assert len(y) == target
    want = np.sin(2 * np.pi * 440 * np.arange(target) / target)
    assert np.max(np.abs(y[200:-200] - want[200:-200])) < 1e-3  # edges ring: FFT resampling is periodic


def test_audio_folder_becomes_windows(tmp_path):
    d = tmp_path / "wav"
    d.mkdir()
    t = np.arange(22050 * 2) / 22050
    _write_wav(d / "a.wav", (0.3 * np.sin(2 * np.pi * 300 * t)).astype(np.float32), 22050, 2)
    x, notes = folder_samples(d, ["N", 16000], AudioPrep(sample_rate=16000))
    assert x.shape == (2, 16000)  # 2 s at 16 kHz, 1 s windows
    x3, _ = folder_samples(d, ["N", 1, 8000], AudioPrep(hop=4000))
    assert x3.shape[1:] == (1, 8000) and len(x3) == 7
    assert any("16000 Hz" in n for n in notes)
