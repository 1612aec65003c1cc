"""Calibration from a real recording: the suite's speech .wav (pyannote.audio's 30 s
sample, 16 kHz mono) read as a folder by `quantize`, for a model that takes raw audio
(openWakeWord's mel-spectrogram front end: STFT as Conv, mel filterbank as MatMul)."""

from __future__ import annotations

import shutil
import wave

import numpy as np
import pytest

from edgeflow import model_suite
from edgeflow.data.preprocess import AudioPrep, folder_samples
from edgeflow.quantization import quantize


def _cached(*names: str) -> bool:
    try:
        return all(model_suite.cached(n) for n in names)
    except Exception:  # noqa: BLE001 - no manifest or cache: skip
        return False


pytestmark = pytest.mark.skipif(
    not _cached("oww-melspectrogram"),
    reason="the real-model cache lacks oww-melspectrogram or the speech-wav asset (edgeflow models fetch)")

PREP = AudioPrep(window=16000, hop=16000)


@pytest.fixture(scope="module")
def speech_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("speech")
    shutil.copy(model_suite.asset_path("speech-wav", download=False), d / "speech.wav")
    return d


@pytest.fixture(scope="module")
def tone_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tone")
    t = np.arange(16000 * 10) / 16000
    pcm = (0.3 * np.sin(2 * np.pi * 300 * t) * 32767).astype("<i2")
    with wave.open(str(d / "tone.wav"), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(pcm.tobytes())
    return d


def test_the_folder_reader_gives_the_recording_itself(speech_dir):
    x, notes = folder_samples(speech_dir, ["N", "samples"], PREP)
    ref = model_suite.speech()
    assert x.shape == (len(ref) // 16000, 16000) and x.dtype == np.float32
    np.testing.assert_allclose(x.reshape(-1), ref[: x.size], atol=1e-6)
    assert any("30 window(s) of 16000 samples at 16000 Hz from 1 .wav file(s)" in n for n in notes), notes


@pytest.mark.parametrize("engine", ["auto", "numpy"])
def test_quantize_calibrates_on_real_speech_and_keeps_the_spectrogram(speech_dir, engine):
    r = quantize(model_suite.load("oww-melspectrogram"), "x86-gateway", str(speech_dir), preprocess=PREP,
                 engine=engine, latency_runs=0, max_loss=None)
    rep = r.report
    assert rep.n_calibration + rep.n_eval == 30 and rep.n_eval == 6  # 20% of the windows held out
    assert any("from 1 .wav file(s)" in n for n in rep.notes)
    assert rep.quantized_nodes  # the mel filterbank (the STFT convs read 1 channel: kept fp32)
    assert rep.error.cosine > 0.95  # log-mel of held-out speech; measured 0.971


def test_calibrating_on_speech_beats_calibrating_on_a_tone(speech_dir, tone_dir):
    """The reason to calibrate on real data: ranges seen on a sine tone fit speech worse
    (cosine on the speech windows, measured 0.971 vs 0.961)."""
    m = model_suite.load("oww-melspectrogram")
    cos = {}
    for name, cal in (("speech", speech_dir), ("tone", tone_dir)):
        cos[name] = quantize(m, "x86-gateway", str(cal), eval_data=str(speech_dir), preprocess=PREP,
                             engine="numpy", latency_runs=0, max_loss=None).report.error.cosine
    assert cos["speech"] > cos["tone"] + 0.005, cos
