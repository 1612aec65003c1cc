"""Model deltas on the downlink (``[rounds] downlink = "delta-int8"``, edgeflow/codecs/model_delta.py):
a device applies the gateway's delta to exactly its base and holds the gateway's model bit for bit;
every hostile delta is refused with its reason; a device that missed a version takes the full model."""

from __future__ import annotations

import time

import numpy as np
import pytest

from _brokers import mosquitto_factory, stays, transport_factory, wait_until  # noqa: F401  (fixtures)
from edgeflow.codecs import encode_update
from edgeflow.codecs.envelope import SectionInput, build_envelope, dtype_code
from edgeflow.errors import CodecError, ConfigError
from edgeflow.codecs.model_delta import apply_model_delta, encode_model_delta, max_delta_bytes, weights_digest
from edgeflow.signing import KeyRing, PrivateKey, Signer

EPOCH = 1_700_000_000_000
SHAPES = {"w": (8, 5), "b": (5,)}


def _weights(seed: int, scale: float = 1.0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: (rng.standard_normal(s) * scale).astype(np.float32) for k, s in SHAPES.items()}


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


@pytest.fixture(scope="module")
def gw():
    key = PrivateKey.generate()
    return Signer("gateway", key), KeyRing({"gateway": key.public_key}), key


def _delta(gw, base, new, *, base_version=3, version=4, epoch=EPOCH, codec="int8", seed=7):
    signer = gw[0]
    return encode_model_delta(base, new, codec=codec, base_version=base_version, version=version, epoch=epoch,
                              signer=signer, seed=seed)


def _apply(gw, payload, held, *, version=3, epoch=EPOCH):
    return apply_model_delta(payload, weights=held, version=version, epoch=epoch, keyring=gw[1])


@pytest.mark.parametrize("codec", ["int8", "fp16", "topk", "topk-packed", "dense"])
def test_device_applies_the_delta_to_the_gateway_model_bit_for_bit(gw, codec):
    base = _weights(0)
    new = {k: v + _weights(1, 0.01)[k] for k, v in base.items()}
    payload, result, digest = _delta(gw, base, new, codec=codec)
    got = _apply(gw, payload, {k: v.copy() for k, v in base.items()})
    assert (got.version, got.epoch, got.digest) == (4, EPOCH, digest) and digest == weights_digest(result)
    for k in base:
        np.testing.assert_array_equal(_bits(got.weights[k]), _bits(result[k]))
    # lossy codecs: the result is close to, not equal to, the aggregate; the gateway adopts ``result``
    err = max(float(np.abs(result[k] - new[k]).max()) for k in base)
    assert err == 0.0 if codec == "dense" else err < 0.05
    if codec == "int8":
        assert len(payload) < 0.5 * sum(4 * v.size for v in base.values()) + 400


def test_the_same_seed_gives_the_same_delta_and_the_digest_sees_every_bit(gw):
    base, new = _weights(0), _weights(1)
    assert _delta(gw, base, new)[0] == _delta(gw, base, new)[0]
    flipped = {k: v.copy() for k, v in base.items()}
    flipped["b"][0] = -flipped["b"][0] if flipped["b"][0] != 0 else np.float32(-0.0)
    assert weights_digest(flipped) != weights_digest(base)


def _signed_envelope(signer, tensors: dict[str, np.ndarray], meta: dict) -> bytes:
    """A gateway-signed dense envelope whose values are taken as they are (NaN included)."""
    import json

    sections = [SectionInput(k, dtype_code(np.dtype(np.float32)), tuple(v.shape), [np.ascontiguousarray(v, np.float32).tobytes()])
                for k, v in tensors.items()]
    return build_envelope(codec_id=1, round_id=meta["model_version"], seq=meta["model_version"], device_id="gateway",
                          metadata_json=json.dumps(meta, sort_keys=True, separators=(",", ":")).encode(),
                          sections=sections, signer=signer, version=1)


def _hostile(kind: str, gw):
    """(payload, held weights, held version, held epoch) of each hostile case."""
    signer = gw[0]
    base = _weights(0)
    new = {k: v + 0.01 for k, v in base.items()}
    good = _delta(gw, base, new)[0]
    meta = {"kind": "model_delta", "model_version": 4, "epoch": EPOCH, "base_version": 3,
            "base_sha256": weights_digest(base), "model_sha256": weights_digest(new)}
    if kind == "wrong_base":  # built on v2; this device holds v3
        return _delta(gw, base, new, base_version=2, version=4)[0], base, 3, EPOCH
    if kind == "base_digest":  # right version number, other weights
        return good, _weights(5), 3, EPOCH
    if kind == "shape_mismatch":
        return good, {"w": base["w"][:, :4].copy(), "b": base["b"]}, 3, EPOCH
    if kind == "non_finite":
        nan = {k: np.full(v.shape, np.nan, np.float32) for k, v in base.items()}
        return _signed_envelope(signer, nan, meta), base, 3, EPOCH
    if kind == "out_of_range":  # each value is within the bound, the sum is not
        big = {k: np.full(v.shape, 9e8, np.float32) for k, v in base.items()}
        payload = _delta(gw, big, {k: v * 2 for k, v in big.items()}, codec="dense")[0]
        return payload, big, 3, EPOCH
    if kind == "oversized":
        return good + bytes(max_delta_bytes(base)), base, 3, EPOCH
    if kind == "replay":  # an old delta (v2 -> v3) sent to a device that holds v4
        return _delta(gw, base, new, base_version=2, version=3)[0], new, 4, EPOCH
    if kind == "unsigned":
        return encode_update({k: v - base[k] for k, v in new.items()}, "int8", round_id=4, device_id="gateway", seq=4,
                             metadata=meta, rng=0), base, 3, EPOCH
    if kind == "bad_signature":  # signed by a key that is not the fleet's
        return _delta((Signer("gateway", PrivateKey.generate()),), base, new)[0], base, 3, EPOCH
    if kind == "epoch":  # another gateway epoch's delta
        return _delta(gw, base, new, epoch=EPOCH - 1)[0], base, 3, EPOCH
    if kind == "digest_mismatch":  # signed, but the result is not the model it announces
        return _signed_envelope(signer, {k: v - base[k] for k, v in new.items()},
                                {**meta, "model_sha256": "0" * 64}), base, 3, EPOCH
    if kind == "not_delta":  # the full model sent on the delta topic
        return encode_update(new, "dense", round_id=4, device_id="gateway", seq=4, signer=signer,
                             metadata={"model_version": 4, "epoch": EPOCH}), base, 3, EPOCH
    raise AssertionError(kind)


HOSTILE = ["wrong_base", "base_digest", "shape_mismatch", "non_finite", "out_of_range", "oversized", "replay",
           "unsigned", "bad_signature", "epoch", "digest_mismatch", "not_delta"]


@pytest.mark.parametrize("kind", HOSTILE)
def test_a_hostile_delta_is_refused_with_its_reason(gw, kind):
    payload, held, version, epoch = _hostile(kind, gw)
    before = {k: v.copy() for k, v in held.items()}
    with pytest.raises(CodecError) as err:
        apply_model_delta(payload, weights=held, version=version, epoch=epoch, keyring=gw[1])
    want = {"bad_signature": ("bad_signature", "wrong_key")}.get(kind, (kind,))
    assert getattr(err.value, "reason", None) in want, (kind, err.value)
    for k in held:  # the model held is untouched
        np.testing.assert_array_equal(_bits(held[k]), _bits(before[k]))


def test_downlink_settings_are_checked():
    from edgeflow.gateway.round_config import RoundConfig

    assert RoundConfig(downlink="delta-int8").downlink == "delta-int8"
    with pytest.raises(ConfigError, match="downlink 'delta-int9' is unknown; choose full or one of delta-dense"):
        RoundConfig(downlink="delta-int9")


# ------------------------------------------------------------------ a device on a real Mosquitto


def _publisher(gw, transport, fleet):
    from edgeflow.transport.topics import gateway_topic

    signer = gw[0]
    model_topic, delta_topic = str(gateway_topic(fleet, "model")), str(gateway_topic(fleet, "model_delta"))

    def full(version, weights):
        payload = encode_update(weights, "dense", round_id=version, device_id="gateway", seq=version, signer=signer,
                                metadata={"model_version": version, "epoch": EPOCH})
        transport.publish(model_topic, payload, qos=1, retain=True).wait(10)

    def delta(base_version, base, new):
        payload, result, _ = _delta(gw, base, new, base_version=base_version, version=base_version + 1)
        transport.publish(delta_topic, payload, qos=1, retain=True).wait(10)
        return result

    return full, delta


@pytest.mark.integration
def test_a_device_follows_deltas_and_takes_the_full_model_after_a_missed_version(mosquitto_factory, transport_factory,  # noqa: F811
                                                                              gw):
    from edgeflow.federated.client import Client
    from edgeflow.gateway.global_model import model_weights
    from edgeflow.protocol.rounds import RoundAnnouncement, TrainConfig
    from edgeflow.sim.simulation import build_model
    from edgeflow.transport.topics import gateway_topic

    broker = mosquitto_factory()
    fleet = "dl"
    gw_t, dev_t = transport_factory(broker, client_id="gw"), transport_factory(broker, client_id="dev-1")
    model = build_model("mlp", 0)
    w1 = model_weights(model)
    step = {k: np.full(v.shape, 0.01, np.float32) for k, v in w1.items()}
    full, delta = _publisher(gw, gw_t, fleet)
    full(1, w1)
    client = Client(dev_t, fleet=fleet, device_id="dev-1", signer=Signer.generate("dev-1"),
                    fleet_key=gw[1].get("gateway"), model=model,
                    data=(np.zeros((2, 64), np.float32), np.zeros(2, np.int64))).start()
    try:
        assert wait_until(lambda: client._version == 1), client.status()
        w2 = delta(1, w1, {k: v + step[k] for k, v in w1.items()})
        full(2, w2)
        assert wait_until(lambda: client._version == 2 and client.stats.deltas_applied == 1), client.status()
        assert client._full_sub is None  # following deltas: the broker no longer sends it the full model
        full_before = client.stats.full_models

        # v3 reaches this device only as a full model (it missed v3's delta): it does not hear it ...
        w3 = {k: v + step[k] for k, v in w2.items()}
        full(3, w3)
        stays(lambda: client._version, for_s=0.5, reason="a device following deltas took a full model")
        # ... until a round names v3: it takes the retained full model
        ann = RoundAnnouncement(round_id=3, model_version=3, deadline=time.time() + 60, selected=("other",),
                                config=TrainConfig(), issued=time.time(), epoch=EPOCH, nonce="ab" * 8)
        gw_t.publish(str(gateway_topic(fleet, "round")), ann.sign(gw[2]), qos=1, retain=True).wait(10)
        assert wait_until(lambda: client._version == 3), client.status()
        assert client.stats.full_models == full_before + 1

        # the next delta applies again, and the device leaves the full model's topic
        w4 = delta(3, w3, {k: v + step[k] for k, v in w3.items()})
        full(4, w4)
        assert wait_until(lambda: client._version == 4 and client._full_sub is None), client.status()

        # a delta whose base it does not hold (v5 missed): refused, the full model taken instead
        w5 = {k: v + step[k] for k, v in w4.items()}
        full(5, w5)
        w6 = delta(5, w5, {k: v + step[k] for k, v in w5.items()})
        full(6, w6)
        assert wait_until(lambda: client._version == 6), client.status()
        assert client.delta_refusals == {"wrong_base": 1}, client.delta_refusals
        for k in w6:
            np.testing.assert_array_equal(_bits(client._weights[k]), _bits(w6[k]))
    finally:
        client.stop()



@pytest.mark.integration
def test_a_fleet_on_delta_int8_holds_the_gateways_model_bit_for_bit(mosquitto_factory):  # noqa: F811
    """The gateway adopts what devices reconstruct: after each round every device, having received only the
    first full model and then deltas, holds the gateway's weights bit for bit."""
    from edgeflow.sim.simulation import SimConfig, SimulatedFleet

    broker = mosquitto_factory()
    cfg = SimConfig(devices=3, rounds=3, downlink="delta-int8", quorum=1.0, min_clients=3, deadline_s=60)
    with SimulatedFleet(cfg, broker.url) as fleet:
        metrics = fleet.run()
        rm = fleet.rounds
        assert [m.model_version for m in metrics] == [rm.version - 2, rm.version - 1, rm.version]
        assert rm.downlink.deltas_published == 3
        assert wait_until(lambda: all(d.client._version == rm.version for d in fleet.devices)), \
            [d.client.status() for d in fleet.devices]
        for d in fleet.devices:
            st = d.client.stats
            assert (st.deltas_applied, st.deltas_refused, st.full_models) == (3, 0, 1), d.client.status()
            for k, v in rm.weights.items():
                np.testing.assert_array_equal(_bits(d.client._weights[k]), _bits(v), err_msg=k)
        # the stored model (what a restarted gateway resumes from) is the adopted one too
        from edgeflow.gateway.global_model import model_weights
        import onnx

        stored = model_weights(onnx.load_model_from_string(rm.store.latest_model()[1]))
        for k, v in rm.weights.items():
            np.testing.assert_array_equal(_bits(stored[k]), _bits(v), err_msg=k)


@pytest.mark.integration
def test_after_a_gateway_restart_devices_following_deltas_take_the_new_epochs_full_model(mosquitto_factory,  # noqa: F811
                                                                                          tmp_path):
    """A restarted gateway (new epoch) publishes its model whole and no delta (the retained one is cleared):
    devices that had left the full model's topic take it again from the announcement, then follow deltas."""
    from edgeflow.gateway.rounds import RoundManager
    from edgeflow.sim.simulation import SimConfig, SimulatedFleet
    from edgeflow.transport.factory import transport_from_url

    broker = mosquitto_factory()
    cfg = SimConfig(devices=3, rounds=3, downlink="delta-int8", quorum=1.0, min_clients=3, deadline_s=60)
    with SimulatedFleet(cfg, broker.url, state_path=str(tmp_path / "state.db")) as fleet:
        fleet.run(2)
        old = fleet.rounds
        assert all(d.client._full_sub is None for d in fleet.devices)
        old.stop()
        fleet.gateway_transport.close(timeout=5)
        fleet.gateway_transport = transport_from_url(broker.url, client_id=f"{cfg.fleet}-gateway2")
        rm = fleet.rounds = RoundManager(fleet.gateway_transport, fleet.store, fleet=cfg.fleet,
                                         fleet_key=fleet.fleet_key, keyring=fleet.keyring, model=fleet.model,
                                         config=cfg.round_config(wait_for_devices_s=10.0),
                                         candidates=fleet.candidates)
        assert rm.epoch > old.epoch and rm.version == old.version
        rm.start()
        fleet.gateway_transport.connect(timeout=30)
        (m,) = rm.run(1)
        assert m.participants == 3 and rm.downlink.deltas_published == 1
        assert wait_until(lambda: all(d.client._version == rm.version for d in fleet.devices)), \
            [d.client.status() for d in fleet.devices]
        for d in fleet.devices:
            st = d.client.stats
            assert (st.deltas_applied, st.full_models) == (3, 2), d.client.status()
            assert d.client.delta_refusals == {}, d.client.delta_refusals
            for k, v in rm.weights.items():
                np.testing.assert_array_equal(_bits(d.client._weights[k]), _bits(v), err_msg=k)
