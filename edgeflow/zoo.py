"""Reference model builders: an MLP and a small CNN as ONNX graphs.

Used by the tests, benchmarks, the demo and as starting points for on-device
training. Weights are He-initialised from a seeded generator, so the same
seed builds the same model. Every model has one input ``input`` with a
dynamic batch dimension ``N`` and one output ``logits``.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

DEFAULT_OPSET = 17


def _he(rng: np.random.Generator, shape: tuple[int, ...], fan_in: int) -> np.ndarray:
    return (rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)).astype(np.float32)


def _model(nodes, inits, in_shape, n_classes: int, name: str, opset: int) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", *in_shape])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", n_classes])],
        [numpy_helper.from_array(a, n) for n, a in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="edgeflow.zoo")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def mlp(sizes: Sequence[int] = (784, 512, 512, 10), *, seed: int = 0, opset: int = DEFAULT_OPSET) -> onnx.ModelProto:
    """Fully connected net: Gemm + Relu per hidden layer (``fc{i}.weight`` stored (out, in))."""
    rng = np.random.default_rng(seed)
    nodes, inits = [], {}
    x = "input"
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        inits[f"fc{i}.weight"] = _he(rng, (fan_out, fan_in), fan_in)
        inits[f"fc{i}.bias"] = np.zeros(fan_out, np.float32)
        last = i == len(sizes) - 2
        out = "logits" if last else f"fc{i}"
        nodes.append(helper.make_node("Gemm", [x, f"fc{i}.weight", f"fc{i}.bias"], [out], transB=1, name=f"fc{i}"))
        if not last:
            nodes.append(helper.make_node("Relu", [out], [f"relu{i}"], name=f"relu{i}"))
            x = f"relu{i}"
    return _model(nodes, inits, (sizes[0],), sizes[-1], "mlp", opset)


def small_cnn(
    input_shape: tuple[int, int, int] = (1, 28, 28),
    channels: Sequence[int] = (32, 64),
    hidden: int = 128,
    n_classes: int = 10,
    *,
    seed: int = 0,
    batch_norm: bool = False,
    opset: int = DEFAULT_OPSET,
) -> onnx.ModelProto:
    """[Conv3x3 (pad 1) -> (BatchNorm) -> Relu -> MaxPool2] per channel count, then
    Flatten -> Gemm(hidden) -> Relu -> Gemm(n_classes)."""
    rng = np.random.default_rng(seed)
    c, h, w = input_shape
    nodes, inits = [], {}
    x = "input"
    for i, ch in enumerate(channels):
        inits[f"conv{i}.weight"] = _he(rng, (ch, c, 3, 3), c * 9)
        inits[f"conv{i}.bias"] = np.zeros(ch, np.float32)
        nodes.append(helper.make_node(
            "Conv", [x, f"conv{i}.weight", f"conv{i}.bias"], [f"conv{i}"],
            kernel_shape=[3, 3], pads=[1, 1, 1, 1], name=f"conv{i}",
        ))
        y = f"conv{i}"
        if batch_norm:
            for k, v in (("scale", 1.0), ("bias", 0.0), ("mean", 0.0), ("var", 1.0)):
                inits[f"bn{i}.{k}"] = np.full(ch, v, np.float32)
            nodes.append(helper.make_node(
                "BatchNormalization", [y, f"bn{i}.scale", f"bn{i}.bias", f"bn{i}.mean", f"bn{i}.var"],
                [f"bn{i}"], name=f"bn{i}",
            ))
            y = f"bn{i}"
        nodes.append(helper.make_node("Relu", [y], [f"crelu{i}"], name=f"crelu{i}"))
        nodes.append(helper.make_node(
            "MaxPool", [f"crelu{i}"], [f"pool{i}"], kernel_shape=[2, 2], strides=[2, 2], name=f"pool{i}"
        ))
        x, c, h, w = f"pool{i}", ch, h // 2, w // 2
    nodes.append(helper.make_node("Flatten", [x], ["flat"], axis=1, name="flatten"))
    flat = c * h * w
    inits["fc0.weight"] = _he(rng, (hidden, flat), flat)
    inits["fc0.bias"] = np.zeros(hidden, np.float32)
    inits["fc1.weight"] = _he(rng, (n_classes, hidden), hidden)
    inits["fc1.bias"] = np.zeros(n_classes, np.float32)
    nodes += [
        helper.make_node("Gemm", ["flat", "fc0.weight", "fc0.bias"], ["fc0"], transB=1, name="fc0"),
        helper.make_node("Relu", ["fc0"], ["relu_fc0"], name="relu_fc0"),
        helper.make_node("Gemm", ["relu_fc0", "fc1.weight", "fc1.bias"], ["logits"], transB=1, name="fc1"),
    ]
    return _model(nodes, inits, input_shape, n_classes, "small_cnn", opset)


def digits_mlp(*, seed: int = 0) -> onnx.ModelProto:
    """MLP sized for scikit-learn's 8x8 digits (64 -> 64 -> 32 -> 10)."""
    return mlp((64, 64, 32, 10), seed=seed)


def digits_cnn(*, seed: int = 0, batch_norm: bool = False) -> onnx.ModelProto:
    """Small CNN sized for scikit-learn's 8x8 digits (1x8x8 input)."""
    return small_cnn((1, 8, 8), channels=(16, 32), hidden=64, seed=seed, batch_norm=batch_norm)
