"""codec 'auto': picks a real codec per update from the model's size and an optional byte budget."""

from __future__ import annotations

import numpy as np
import pytest

from edgeflow.codecs import ErrorFeedback, available_codecs, decode_update, encode_update, get_codec, peek_update
from edgeflow.codecs.auto import SMALL_MODEL
from edgeflow.errors import CodecError
from edgeflow.signing import Signer

SIGNER = Signer.generate("pi-7")


def tensors(*sizes: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {f"t{i}.weight": (rng.standard_normal(n) * 0.01).astype(np.float32) for i, n in enumerate(sizes)}


def send(t: dict[str, np.ndarray], state: ErrorFeedback | None = None, **opts) -> bytes:
    return encode_update(t, "auto", round_id=4, device_id="pi-7", seq=4, signer=SIGNER, state=state, rng=0,
                         metadata={"loss": 0.125, "base_version": 3, "round_nonce": "0123456789abcdef"},
                         num_samples=90, **opts)


def test_auto_is_a_name_not_a_wire_id() -> None:
    assert available_codecs()[-1] == "auto"
    assert get_codec("auto").selector
    with pytest.raises(CodecError, match="unknown codec id 0"):
        from edgeflow.codecs.registry import codec_by_id
        codec_by_id(0)


def test_a_small_model_goes_sparse_with_error_feedback() -> None:
    state = ErrorFeedback()
    t = tensors(4096, 64, 2048, 32, 320, 10)  # the digits MLP's shapes, flattened
    data = send(t, state)
    up = decode_update(data)
    assert up.codec == "topk-packed" and peek_update(data).version == 2
    assert len(data) < 0.03 * 4 * sum(x.size for x in t.values())
    assert state.norm() > 0  # what was not sent stays on the device
    for name, x in t.items():  # sent + kept == the update
        np.testing.assert_allclose(up.tensors[name] + state.get(name), x, atol=1e-6)


def test_a_large_model_without_budget_stays_int8() -> None:
    up = decode_update(send(tensors(SMALL_MODEL + 1)))
    assert up.codec == "int8"


def test_many_small_tensors_without_budget_stay_int8() -> None:
    # a fine-tune of biases: 37 tensors of ~112 values; 3% top-k of each lost accuracy there
    assert decode_update(send(tensors(*[112] * 37))).codec == "int8"
    assert decode_update(send(tensors(*[112] * 37), ErrorFeedback(), budget=1_500)).codec == "topk-packed"


@pytest.mark.parametrize("budget", [400, 600, 1_000, 3_000])
def test_a_budget_is_never_exceeded_and_mostly_used(budget: int) -> None:
    t = tensors(4096, 64, 2048, 32, 320, 10)
    data = send(t, ErrorFeedback(), budget=budget)
    assert len(data) <= budget
    assert len(data) >= 0.6 * budget, "the estimate wastes most of the budget"


def test_a_large_budget_picks_int8_and_a_large_model_goes_sparse_to_fit() -> None:
    t = tensors(6570)
    assert decode_update(send(t, budget=8_000)).codec == "int8"
    big = tensors(300_000, 1000)
    data = send(big, ErrorFeedback(), budget=30_000)
    assert decode_update(data).codec == "topk-packed" and 25_000 <= len(data) <= 30_000


def test_the_smallest_budget_the_error_names_works() -> None:
    t = tensors(4096, 64, 2048, 32, 320, 10)
    with pytest.raises(CodecError) as err:
        send(t, budget=128)
    floor = int(str(err.value).rsplit(" ", 1)[-1])
    assert len(send(t, ErrorFeedback(), budget=floor)) <= floor


@pytest.mark.parametrize(("opts", "match"), [
    ({"budget": 130}, r"a budget of 130 bytes cannot hold this update.*at least \d+"),
    ({"budget": 127}, "budget must be a whole number of bytes >= 128"),
    ({"budget": 0}, "budget must be a whole number of bytes >= 128"),
    ({"budget": 1.5}, "budget must be a whole number"),
    ({"budget": True}, "budget must be a whole number"),
    ({"ratio": 0.1}, "unknown option.*valid options: budget"),
])
def test_bad_budgets_say_what_would_work(opts, match: str) -> None:
    with pytest.raises(CodecError, match=match):
        send(tensors(4096, 64), **opts)
