"""--new-head finds the classifier head by walking back from the output, and a model with several
outputs must name the one the labels train (issue 30: a ResNet's inner 1x1 conv was replaced; head mode
on MTCNN's O-Net silently trained output 0, the box regressor)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgeflow.errors import TrainingError
from edgeflow.train import Trainer
from edgeflow.train.transfer import find_head, new_head

RNG = np.random.default_rng(0)


def _init(name, *shape):
    return numpy_helper.from_array((RNG.standard_normal(shape) * 0.1).astype(np.float32), name)


def _net(head: str = "gemm", outputs: int = 1):
    """conv 3x3 -> inner 1x1 conv -> relu -> GAP -> flatten -> head (-> softmax); a box output when asked."""
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1], name="conv3x3"),
             helper.make_node("Conv", ["c1", "w2"], ["c2"], name="inner1x1"),
             helper.make_node("Relu", ["c2"], ["r"]),
             helper.make_node("GlobalAveragePool", ["r"], ["g"]),
             helper.make_node("Flatten", ["g"], ["f"])]
    inits = [_init("w1", 8, 3, 3, 3), _init("w2", 8, 8, 1, 1), _init("fc_b", 5)]
    if head == "gemm":
        nodes += [helper.make_node("Gemm", ["f", "fc_w", "fc_b"], ["logits"], transB=1, name="fc")]
        inits.append(_init("fc_w", 5, 8))
    elif head == "transposed":  # the FC weight reaches the MatMul through a Transpose: no weight of its own
        nodes += [helper.make_node("Transpose", ["fc_wt"], ["fc_w"], perm=[1, 0]),
                  helper.make_node("MatMul", ["f", "fc_w"], ["mm"]), helper.make_node("Add", ["mm", "fc_b"], ["logits"])]
        inits.append(_init("fc_wt", 5, 8))
    elif head == "residual":  # the output is a sum of two computed values: no head
        nodes += [helper.make_node("Add", ["f", "f"], ["logits"])]
    nodes.append(helper.make_node("Softmax", ["logits"], ["prob"], axis=1))
    outs = [helper.make_tensor_value_info("prob", TensorProto.FLOAT, ["N", 8 if head == "residual" else 5])]
    if outputs == 2:
        nodes.append(helper.make_node("Gemm", ["f", "box_w"], ["box"], transB=1, name="box_fc"))
        inits.append(_init("box_w", 4, 8))
        outs.insert(0, helper.make_tensor_value_info("box", TensorProto.FLOAT, ["N", 4]))
    g = helper.make_graph(nodes, "net", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 6, 6])],
                          outs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m


def test_the_head_is_the_layer_that_produces_the_output_not_the_last_1x1_conv():
    m = new_head(_net(), 3, seed=1)
    w = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
    assert w["fc_w"].shape == (3, 8) and w["fc_b"].shape == (3,) and not w["fc_b"].any()
    assert w["w2"].shape == (8, 8, 1, 1)  # the inner 1x1 conv is untouched
    assert m.graph.output[0].type.tensor_type.shape.dim[1].dim_value == 3
    x = RNG.standard_normal((2, 3, 6, 6)).astype(np.float32)
    assert Trainer(m, mode="head").predict(x).shape == (2, 3)


@pytest.mark.parametrize("head, line", [
    ("transposed", "MatMul 'mm' produces 'prob' but its weight is not a tensor of its own"),
    ("residual", "'prob' comes from Add of 2 computed values"),
])
def test_a_model_without_a_replaceable_head_is_refused_naming_why(head, line):
    with pytest.raises(TrainingError) as e:
        new_head(_net(head), 3)
    assert line in str(e.value) and "give the model a new head yourself" in str(e.value)


def test_several_outputs_must_be_named_for_training_and_for_a_new_head():
    m = _net(outputs=2)
    with pytest.raises(TrainingError, match=r"the model has 2 outputs \(box \['N', 4\], prob \['N', 5\]\): name"):
        Trainer(m, mode="head")
    with pytest.raises(TrainingError, match="name the one the new head replaces with --target NAME"):
        new_head(m, 3)
    assert find_head(m, "prob").name == "fc" and find_head(m, "box").name == "box_fc"
    t = Trainer(new_head(m, 3, output="prob"), mode="head", output="prob")
    assert t.output_name == "logits"  # cross-entropy reads the logits before the Softmax
    assert set(t.trainable_names) == {"fc_w", "fc_b"}
