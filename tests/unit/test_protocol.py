"""edgeflow.protocol: one signed-JSON implementation, the same checks for every message kind."""

from __future__ import annotations

import json

import pytest

from edgeflow.errors import CodecError, SignatureError
from edgeflow.protocol import signed_json
from edgeflow.protocol.fleet import Command, Death
from edgeflow.protocol.rounds import RoundAnnouncement, TrainConfig
from edgeflow.signing import PrivateKey

FLEET = PrivateKey.from_bytes(bytes(range(32)))
OTHER = PrivateKey.from_bytes(bytes(range(1, 33)))


def _announcement() -> RoundAnnouncement:
    return RoundAnnouncement(round_id=3, model_version=1, deadline=10.0, selected=("d1",), config=TrainConfig())


def _kinds():
    """(sign with a key, verify with a public key) for a round announcement, a command and a death."""
    cmd = Command.make("status", "d1", "lab")
    death = Death("d1", 5)
    return [
        ("round", lambda k: _announcement().sign(k), RoundAnnouncement.verify),
        ("command", cmd.sign, Command.verify),
        ("death", death.sign, Death.verify),
    ]


@pytest.mark.parametrize("kind,sign,verify", _kinds(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_kind_refuses_a_key_id_that_is_not_the_expected_key(kind, sign, verify) -> None:
    data = sign(FLEET)
    verify(data, FLEET.public_key)  # the right key opens it
    with pytest.raises(SignatureError) as err:
        verify(sign(OTHER), FLEET.public_key)
    assert err.value.reason == "wrong_key"
    # the signature is valid, only the key_id claims another key: still refused before the signature check
    wrapper = json.loads(data)
    wrapper["key_id"] = OTHER.public_key.key_id_hex
    with pytest.raises(SignatureError) as err:
        verify(json.dumps(wrapper).encode(), FLEET.public_key)
    assert err.value.reason == "wrong_key"


@pytest.mark.parametrize("kind,sign,verify", _kinds(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_kind_refuses_another_context_and_a_tampered_body(kind, sign, verify) -> None:
    wrapper = json.loads(sign(FLEET))
    bad_ctx = dict(wrapper, ctx="probe/v1")
    with pytest.raises(SignatureError) as err:
        verify(json.dumps(bad_ctx).encode(), FLEET.public_key)
    assert err.value.reason == "bad_signature"
    body = json.loads(wrapper["body"])
    body[sorted(body)[0]] = body[sorted(body)[0]]  # same content, re-serialised with spaces
    tampered = dict(wrapper, body=json.dumps(body, indent=1))
    with pytest.raises(SignatureError) as err:
        verify(json.dumps(tampered).encode(), FLEET.public_key)
    assert err.value.reason == "bad_signature"


def test_hostile_json_is_a_codec_error_with_a_reason() -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    for data in (deep, b"\xff\xfe", b"1e400", b'{"v": 1}'):
        with pytest.raises(CodecError) as err:
            signed_json.open_signed(data, FLEET.public_key, "round/v1")
        assert err.value.reason in ("bad_message", "unsigned")
    with pytest.raises(CodecError) as err:
        RoundAnnouncement.verify(b"x" * (signed_json.MAX_CONTROL_BYTES + 1), FLEET.public_key)
    assert err.value.reason == "bad_message"


def test_the_round_announcement_round_trips() -> None:
    ann = _announcement()
    assert RoundAnnouncement.verify(ann.sign(FLEET), FLEET.public_key) == ann


@pytest.mark.parametrize("metadata, field", [
    ({"metrics": [1, 2]}, "metrics must be an object"),
    ({"metrics": {"acc": "x" * 257}}, "metrics['acc'] is text"),  # text and true/false are kept, bounded
    ({"metrics": {"acc": "\x1b[2J"}}, "metrics['acc'] is text"),
    ({"metrics": {"acc": 1e400}}, "metrics['acc'] must be finite"),
    ({"metrics": {"": 1.0}}, "bad name"),
    ({"metrics": {"x" * 65: 1.0}}, "bad name"),
    ({"metrics": {"a\x1b[31m": 1.0}}, "bad name"),
    ({"metrics": {f"m{i}": 1.0 for i in range(65)}}, "at most 64"),
    ({"eval": 0.3}, "eval must be an object"),
    ({"eval": {"loss": 0.1, "num_examples": 0}}, "eval.num_examples"),
    ({"eval": {"loss": 0.1, "num_examples": 2.5}}, "eval.num_examples"),
    ({"eval": {"loss": float("nan"), "num_examples": 3}}, "eval.loss"),
    ({"eval": {"loss": 0.1, "num_examples": 3, "metrics": {"acc": None}}}, "eval.metrics['acc']"),
])
def test_hostile_client_metrics_refuse_the_update_naming_the_field(metadata, field):
    from edgeflow.errors import CodecError
    from edgeflow.protocol.rounds import parse_update_meta

    with pytest.raises(CodecError, match="bad metadata") as e:
        parse_update_meta({"num_samples": 5, **metadata}, "evil")
    assert field in str(e.value) and getattr(e.value, "reason", "") == "bad_metadata"


def test_client_metrics_are_kept():
    from edgeflow.protocol.rounds import parse_update_meta

    meta = parse_update_meta({"num_samples": 5, "metrics": {"acc": 0.5, "n_steps": 3},
                              "eval": {"loss": 0.25, "num_examples": 7, "metrics": {"acc": 0.75}}})
    assert meta.metrics == {"acc": 0.5, "n_steps": 3.0} and meta.evaluation == (0.25, 7, {"acc": 0.75})
