"""The gateway federates what devices train, not every float initializer of the model.

Before: a float constant in a non-differentiable slot (here a Clip bound, in PP-OCR HardSigmoid/Clip scalars)
was sent in every global model; every device refused the model ("weight(s) the local model lacks") and no
round of such a model ever completed.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from edgeflow.gateway.global_model import model_weights, trained_weight_names
from edgeflow.gateway.rounds import RoundConfig, RoundManager
from edgeflow.gateway.store import GatewayStore
from edgeflow.signing import KeyRing, PrivateKey
from edgeflow.train import Trainer
from edgeflow.transport.loopback import LoopbackBroker


def _clipped_linear() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(size=(4, 3)).astype(np.float32), "w"),
             numpy_helper.from_array(np.zeros(3, np.float32), "b"),
             numpy_helper.from_array(np.array(-6.0, np.float32), "lo"),
             numpy_helper.from_array(np.array(6.0, np.float32), "hi")]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "b"], ["z"]),
             helper.make_node("Clip", ["z", "lo", "hi"], ["y"])]
    g = helper.make_graph(nodes, "clipped", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])


def test_the_gateway_federates_the_trainers_weights_not_the_clip_bounds(tmp_path):
    model = _clipped_linear()
    assert set(model_weights(model)) == {"w", "b", "lo", "hi"}
    assert set(trained_weight_names(model)) == {"w", "b"} == set(Trainer(model).weight_names)
    rm = RoundManager(LoopbackBroker().transport(client_id="lab-gateway"), GatewayStore(tmp_path / "gw.sqlite"),
                      fleet="lab", fleet_key=PrivateKey.generate(), keyring=KeyRing(), model=model,
                      config=RoundConfig(rounds=1), candidates=lambda: [])
    assert set(rm.weights) == {"w", "b"}
