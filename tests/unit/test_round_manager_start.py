"""What a RoundManager starts from: the state's latest model, else the model it is given, else none yet;
and which of its weights the rounds federate. Each wrong start is one clear error before anything runs."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from edgeflow import zoo
from edgeflow.errors import ConfigError, StateError
from edgeflow.gateway.global_model import model_weights
from edgeflow.gateway.round_config import RoundConfig
from edgeflow.gateway.rounds import RoundManager
from edgeflow.gateway.store import GatewayStore
from edgeflow.signing import KeyRing, PrivateKey
from edgeflow.transport.loopback import LoopbackBroker


def _manager(store: GatewayStore, model=None, **kw) -> RoundManager:
    t = LoopbackBroker(name="start").transport("start-gateway")
    return RoundManager(t, store, fleet="start", fleet_key=PrivateKey.generate(), keyring=KeyRing(), model=model,
                        config=RoundConfig(rounds=1, strategy="fedavg"), candidates=list, **kw)


def test_a_fresh_state_stores_the_given_model_as_version_1_and_federates_its_float_weights():
    model = zoo.digits_mlp(seed=0)
    store = GatewayStore()
    rm = _manager(store, model)
    assert rm.version == 1 and store.latest_model()[0] == 1
    want = model_weights(model)
    assert list(rm.weights) == list(want)
    for name, w in want.items():
        np.testing.assert_array_equal(rm.weights[name], w)


def test_a_restart_without_a_model_starts_from_the_states_latest():
    model = zoo.digits_mlp(seed=0)
    store = GatewayStore()
    _manager(store, model)
    rm = _manager(store, None)
    assert rm.version == 1 and rm.base_model is not None and set(rm.weights) == set(model_weights(model))


def test_weight_names_pick_what_the_rounds_federate_and_unknown_names_are_one_error():
    model = zoo.digits_mlp(seed=0)
    first = list(model_weights(model))[:2]
    rm = _manager(GatewayStore(), model, weight_names=first + first[:1])  # a repeat is one name
    assert list(rm.weights) == first
    with pytest.raises(ConfigError, match="are not float weights of the model"):
        _manager(GatewayStore(), model, weight_names=["no_such_weight"])
    with pytest.raises(ConfigError, match="are not float weights of the model"):
        _manager(GatewayStore(), model, weight_names=[])


def test_without_any_model_there_is_nothing_yet_and_weight_names_are_refused():
    rm = _manager(GatewayStore(), None)
    assert (rm.version, rm.weights) == (0, {})
    with pytest.raises(ConfigError, match="weight_names need a model"):
        _manager(GatewayStore(), None, weight_names=["w"])


def test_a_damaged_stored_model_is_one_state_error_naming_the_fix():
    store = GatewayStore()
    blob = b"\x08\x07not an onnx model at all"
    store.add_model(blob, hashlib.sha256(blob).hexdigest())
    with pytest.raises(StateError, match=r"model v1 cannot be loaded .*restore a backup"):
        _manager(store, zoo.digits_mlp(seed=0))
