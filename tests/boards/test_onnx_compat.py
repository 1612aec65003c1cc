"""edgeflow.onnx_compat on the host: the protobuf stand-in agrees with the real onnx, an old onnx
gets its backfills, a broken onnx falls back, and each missing part is named in one line.

The stand-in runs in subprocesses (EDGEFLOW_ONNX=compat) so that this process keeps the real
onnx to check what the stand-in writes and reads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgeflow import onnx_compat, zoo

ROOT = Path(__file__).resolve().parents[2]


def py(code: str, *, env: dict | None = None, cwd: Path | None = None, check: bool = True,
       path: list[str] | None = None) -> subprocess.CompletedProcess:
    e = {**os.environ, **(env or {})}
    if path:
        e["PYTHONPATH"] = os.pathsep.join([*path, e.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                         timeout=300, env=e, cwd=cwd)
    if check:
        assert out.returncode == 0, f"stdout:\n{out.stdout[-3000:]}\nstderr:\n{out.stderr[-3000:]}"
    return out


COMPAT = {"EDGEFLOW_ONNX": "compat"}


def test_embedded_schema_matches_the_installed_onnx() -> None:
    """Every message and field of the embedded onnx-ml.proto is the installed onnx's (number, type, label)."""
    import google.protobuf.descriptor_pb2 as d2

    import base64
    import zlib

    fdp = d2.FileDescriptorProto.FromString(zlib.decompress(base64.b64decode("".join(onnx_compat._SCHEMA))))
    real = onnx.onnx_ml_pb2.DESCRIPTOR

    def walk(msgs, prefix=""):
        for m in msgs:
            yield prefix + m.name, m
            yield from walk(m.nested_type, prefix + m.name + ".")

    real_fdp = d2.FileDescriptorProto()
    real.CopyToProto(real_fdp)
    have = dict(walk(real_fdp.message_type))
    for name, msg in walk(fdp.message_type):
        assert name in have, f"{name} is not in onnx {onnx.__version__}"
        fields = {f.name: (f.number, f.type, f.label) for f in have[name].field}
        for f in msg.field:
            assert fields.get(f.name) == (f.number, f.type, f.label), f"{name}.{f.name} differs"
    assert set(onnx_compat._MESSAGES) <= {m.name for m in fdp.message_type}


def test_stand_in_builds_models_the_real_checker_accepts(tmp_path: Path) -> None:
    py(f"""
        import edgeflow, onnx
        assert onnx.EDGEFLOW_COMPAT, onnx.__version__
        from edgeflow import zoo
        onnx.save(zoo.small_cnn(seed=3), {str(tmp_path / 'cnn.onnx')!r})
        onnx.save(zoo.digits_mlp(seed=1), {str(tmp_path / 'mlp.onnx')!r})
    """, env=COMPAT)
    for name, ref in (("cnn", zoo.small_cnn(seed=3)), ("mlp", zoo.digits_mlp(seed=1))):
        m = onnx.load(str(tmp_path / f"{name}.onnx"))
        onnx.checker.check_model(m, full_check=True)
        onnx.shape_inference.infer_shapes(m, strict_mode=True)
        assert m.SerializeToString() == ref.SerializeToString(), f"{name}: same bytes as the real helpers"


def test_tensors_round_trip_between_stand_in_and_onnx(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    arrays = {
        "f32": rng.standard_normal((2, 3)).astype(np.float32), "f64": rng.standard_normal(4),
        "f16": rng.standard_normal((3,)).astype(np.float16), "i8": np.array([-128, 0, 127], np.int8),
        "u8": np.array([0, 255], np.uint8), "i16": np.array([-3, 4], np.int16), "u16": np.array([65535], np.uint16),
        "i32": np.array([[1, -2]], np.int32), "i64": np.array([2**40, -1], np.int64),
        "u32": np.array([2**32 - 1], np.uint32), "u64": np.array([2**63], np.uint64),
        "b": np.array([True, False, True]), "scalar": np.array(1.5, np.float32), "empty": np.zeros((0, 3), np.float32),
    }
    # typed fields (not raw_data), as some exporters write them
    typed = [helper.make_tensor(f"t_{k}", helper.np_dtype_to_tensor_dtype(v.dtype), v.shape, v.flatten().tolist())
             for k, v in arrays.items() if k not in ("empty",)]
    raw = [numpy_helper.from_array(v, f"r_{k}") for k, v in arrays.items()]
    strings = numpy_helper.from_array(np.array([b"a", b"bc"], dtype=object), "s")
    graph = helper.make_graph([], "g", [], [], initializer=typed + raw + [strings])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    onnx.save(model, str(tmp_path / "t.onnx"))
    out = tmp_path / "arrays.npz"
    py(f"""
        import edgeflow, onnx, numpy as np
        from onnx import numpy_helper
        m = onnx.load({str(tmp_path / 't.onnx')!r})
        got = {{t.name: numpy_helper.to_array(t) for t in m.graph.initializer if t.name != "s"}}
        s = [t for t in m.graph.initializer if t.name == "s"][0]
        assert list(numpy_helper.to_array(s)) == [b"a", b"bc"]
        again = {{k: numpy_helper.from_array(v, k) for k, v in got.items()}}
        onnx.save(onnx.helper.make_model(onnx.helper.make_graph([], "g", [], [], initializer=list(again.values()))),
                  {str(tmp_path / 'again.onnx')!r})
        np.savez({str(out)!r}, **got)
    """, env=COMPAT)
    got = dict(np.load(out))
    for k, v in arrays.items():
        for prefix in ("r_", "t_"):
            if prefix + k in got:
                np.testing.assert_array_equal(got[prefix + k], v)
                assert got[prefix + k].dtype == v.dtype and got[prefix + k].shape == v.shape, prefix + k
    back = onnx.load(str(tmp_path / "again.onnx"))
    for t in back.graph.initializer:
        np.testing.assert_array_equal(numpy_helper.to_array(t), got[t.name])


def test_attributes_decode_like_onnx(tmp_path: Path) -> None:
    node = helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[3, 3], alpha=0.5, mode="same", group=2,
                            value=numpy_helper.from_array(np.ones(2, np.float32)), scales=[1.0, 2.5],
                            names=["a", "b"])
    want = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    (tmp_path / "node.pb").write_bytes(node.SerializeToString())
    out = py(f"""
        import edgeflow, onnx, json
        from onnx import helper, numpy_helper
        n = onnx.NodeProto.FromString(open({str(tmp_path / 'node.pb')!r}, "rb").read())
        vals = {{a.name: helper.get_attribute_value(a) for a in n.attribute}}
        vals["value"] = numpy_helper.to_array(vals["value"]).tolist()
        vals = {{k: ([x.decode() if isinstance(x, bytes) else x for x in v] if isinstance(v, list)
                     else v.decode() if isinstance(v, bytes) else v) for k, v in vals.items()}}
        again = helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[3, 3], alpha=0.5, mode="same", group=2,
                                 value=numpy_helper.from_array(__import__("numpy").ones(2, "float32")),
                                 scales=[1.0, 2.5], names=["a", "b"])
        print(json.dumps([vals, again.SerializeToString().hex()]))
    """, env=COMPAT)
    vals, again_hex = json.loads(out.stdout)
    assert bytes.fromhex(again_hex) == node.SerializeToString()
    assert vals["kernel_shape"] == want["kernel_shape"] and vals["alpha"] == want["alpha"]
    assert vals["mode"] == "same" and vals["names"] == ["a", "b"] and vals["value"] == [1.0, 1.0]


def _bad_models() -> dict[str, onnx.ModelProto]:
    base = zoo.digits_mlp(seed=0)
    out = {}
    m = onnx.ModelProto()
    m.CopyFrom(base)
    m.graph.node[0].input[0] = "nowhere"
    out["is not a graph input"] = m
    m = onnx.ModelProto()
    m.CopyFrom(base)
    m.graph.node[1].output[0] = m.graph.node[0].output[0]
    out["assigned twice"] = m
    m = onnx.ModelProto()
    m.CopyFrom(base)
    m.graph.initializer[0].raw_data = m.graph.initializer[0].raw_data[:-4]
    out["bytes of data"] = m
    m = onnx.ModelProto()
    m.CopyFrom(base)
    m.ir_version = 99
    out["newer than this checker"] = m
    m = onnx.ModelProto()
    m.CopyFrom(base)
    m.graph.output[0].name = "ghost"
    out["produced by no node"] = m
    return out


def test_structural_check_refuses_broken_models_in_one_line(tmp_path: Path) -> None:
    bad = _bad_models()
    for i, (why, m) in enumerate(bad.items()):
        (tmp_path / f"bad{i}.onnx").write_bytes(m.SerializeToString())
        with pytest.raises(onnx.checker.ValidationError):  # the real checker refuses each one too
            onnx.checker.check_model(m)
    onnx.save(zoo.digits_mlp(seed=0), str(tmp_path / "good.onnx"))
    out = py(f"""
        import edgeflow, json
        from edgeflow.errors import ModelError
        from edgeflow.runtime.model import load_model
        load_model({str(tmp_path / 'good.onnx')!r})
        msgs = []
        for i in range({len(bad)}):
            try:
                load_model({str(tmp_path)!r} + f"/bad{{i}}.onnx")
                msgs.append("accepted")
            except ModelError as exc:
                msgs.append(str(exc))
        print(json.dumps(msgs))
    """, env=COMPAT)
    msgs = json.loads(out.stdout)
    for (why, _), msg in zip(bad.items(), msgs):
        assert why in msg and "\n" not in msg, (why, msg)


def test_cli_runs_a_model_through_the_stand_in_like_onnxruntime(tmp_path: Path) -> None:
    ort = pytest.importorskip("onnxruntime")
    model = zoo.small_cnn(seed=2)
    onnx.save(model, str(tmp_path / "cnn.onnx"))
    x = np.random.default_rng(1).random((3, 1, 28, 28), dtype=np.float32)
    np.save(tmp_path / "x.npy", x)
    r = subprocess.run([sys.executable, "-m", "edgeflow", "run", str(tmp_path / "cnn.onnx"), "-i",
                        str(tmp_path / "x.npy"), "-o", str(tmp_path / "y.npz"), "--profile", "visionfive-2"],
                       capture_output=True, text=True, timeout=300, env={**os.environ, **COMPAT})
    assert r.returncode == 0, r.stderr
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"input": x})
    np.testing.assert_allclose(np.load(tmp_path / "y.npz")["logits"], want[0], rtol=1e-4, atol=1e-5)


def test_training_through_the_stand_in_writes_a_model_onnx_accepts(tmp_path: Path) -> None:
    from edgeflow.data.datasets import load_digits

    split = load_digits(seed=0).flat()
    np.savez(tmp_path / "d.npz", x=split.x_train[:256], y=split.y_train[:256])
    onnx.save(zoo.digits_mlp(seed=0), str(tmp_path / "m.onnx"))
    r = subprocess.run([sys.executable, "-m", "edgeflow", "train", str(tmp_path / "m.onnx"), "--data",
                        str(tmp_path / "d.npz"), "--epochs", "2", "-o", str(tmp_path / "t.onnx"), "--profile",
                        "raspberry-pi-zero-2w"], capture_output=True, text=True, timeout=300,
                       env={**os.environ, **COMPAT})
    assert r.returncode == 0, r.stderr[-2000:]
    trained = onnx.load(str(tmp_path / "t.onnx"))
    onnx.checker.check_model(trained, full_check=True)
    before = {t.name: numpy_helper.to_array(t) for t in zoo.digits_mlp(seed=0).graph.initializer}
    after = {t.name: numpy_helper.to_array(t) for t in trained.graph.initializer}
    assert any(not np.array_equal(before[k], after[k]) for k in before), "training changed the weights"


def test_backfill_adds_what_onnx_1_12_lacks() -> None:
    helper_mod = types.ModuleType("onnx.helper")
    mapping = types.SimpleNamespace(TENSOR_TYPE_TO_NP_TYPE={1: np.dtype("float32"), 7: np.dtype("int64")},
                                    NP_TYPE_TO_TENSOR_TYPE={np.dtype("float32"): 1, np.dtype("int64"): 7})
    old = types.SimpleNamespace(helper=helper_mod, mapping=mapping, __version__="1.12.0")
    before = list(onnx_compat.BACKFILLS)
    try:
        onnx_compat._backfill(old)  # type: ignore[arg-type]
        assert old.helper.tensor_dtype_to_np_dtype(7) == np.dtype("int64")
        assert old.helper.np_dtype_to_tensor_dtype(np.float32) == 1
        assert "helper.tensor_dtype_to_np_dtype" in onnx_compat.BACKFILLS
        real = helper.tensor_dtype_to_np_dtype
        onnx_compat._backfill(onnx)  # a new onnx is left alone
        assert helper.tensor_dtype_to_np_dtype is real
    finally:
        onnx_compat.BACKFILLS[:] = before


def test_a_broken_onnx_falls_back_and_says_why(tmp_path: Path) -> None:
    fake = tmp_path / "onnx"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('onnx_cpp2py_export: undefined symbol (test)')\n")
    out = py("""
        import edgeflow, onnx
        from edgeflow import onnx_compat
        assert onnx.EDGEFLOW_COMPAT
        print(onnx_compat.describe())
    """, path=[str(tmp_path)])
    assert "does not import" in out.stdout and "undefined symbol" in out.stdout
    assert "using edgeflow.onnx_compat" in out.stderr  # one warning line at start
    strict = py("import edgeflow, onnx", path=[str(tmp_path)], env={"EDGEFLOW_ONNX": "onnx"}, check=False)
    assert strict.returncode != 0 and "undefined symbol" in strict.stderr


def test_onnx_imported_before_edgeflow_is_used_as_is() -> None:
    out = py("""
        import onnx, edgeflow
        from edgeflow import onnx_compat
        assert not getattr(onnx, "EDGEFLOW_COMPAT", False)
        print(onnx_compat.describe())
    """)
    assert out.stdout.strip() == f"onnx {onnx.__version__}"


def test_import_edgeflow_stays_light() -> None:
    out = py("""
        import sys, edgeflow, edgeflow.profiles, edgeflow.signing
        heavy = sorted(m for m in ("onnx", "onnxruntime", "google.protobuf", "sklearn", "amqtt") if m in sys.modules)
        print(heavy)
    """)
    assert out.stdout.strip() == "[]"
