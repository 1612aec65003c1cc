"""ONNX on every board: the installed ``onnx`` where it works, a protobuf-only stand-in where none exists.

edgeflow imports ``onnx`` in many places. Boards differ in what they have:

* x86_64 and aarch64: the onnx wheel from PyPI (1.15 or newer) - used as is;
* Debian bookworm armhf (armv7): only Debian's ``python3-onnx`` 1.12 (PyPI has no
  armv7 wheel). It is used, with the few helpers edgeflow calls that 1.12 lacks
  added to it (:data:`BACKFILLS`, e.g. ``helper.tensor_dtype_to_np_dtype``, new in 1.13);
* a board with no compiled onnx at all (or ``EDGEFLOW_ONNX=compat``): ``import onnx``
  gets the stand-in built here from the ``protobuf`` runtime (pure Python, on PyPI for
  every architecture) and the ONNX schema's descriptors (onnx-ml.proto, embedded
  below), plus the subset of ``onnx.helper``/``onnx.numpy_helper`` that edgeflow uses.

What the stand-in does NOT have (:data:`SKIPPED`): the C++ ``onnx.checker`` (replaced
by a structural check in Python: IR version, opset imports, every input defined before
use, single assignment, initializer sizes, subgraphs) and C++ shape inference
(``onnx.shape_inference.infer_shapes`` returns the model unchanged, so the memory plan
counts only the shapes the file declares). The gateway runs the full checker and shape
inference before it signs an OTA artifact, so a device only ever loads models a full
checker has passed; ``onnx.reference``, ``version_converter``, ``backend`` and
``parser`` are absent (``import onnx.reference`` fails).

The switch is an import hook (:func:`install`, called by ``import edgeflow``; it
imports nothing itself): it hands ``import onnx`` to the real package when one is
found and imports, else to the stand-in. ``EDGEFLOW_ONNX=compat`` forces the stand-in,
``EDGEFLOW_ONNX=onnx`` forbids it (a missing onnx is then an ImportError).
:func:`describe` says in one line which path this process takes.
"""

from __future__ import annotations

import base64
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys
import threading
import types
import zlib
from typing import Any

__all__ = ["BACKFILLS", "ENV", "SKIPPED", "describe", "install", "status"]

log = logging.getLogger(__name__)

ENV = "EDGEFLOW_ONNX"
SKIPPED = ("the C++ onnx.checker (a structural check in Python instead)",
           "shape inference (infer_shapes returns the model unchanged)")
BACKFILLS: list[str] = []
"""Names this module added to an installed onnx that lacked them (old Debian onnx)."""

_SCHEMA_FROM = "1.23.2"  # the onnx release whose onnx-ml.proto is embedded below
_IR_VERSION = 14  # onnx.IR_VERSION of that release
_OPSET = 28  # onnx.defs.onnx_opset_version() of that release
# zlib(FileDescriptorProto of onnx/onnx-ml.proto), base64. Regenerate with
#   python -c "import onnx.onnx_ml_pb2 as m, zlib, base64; print(base64.b64encode(zlib.compress(m.DESCRIPTOR.serialized_pb, 9)).decode())"
# tests/boards/test_onnx_compat.py checks it against the installed onnx.
_SCHEMA = (
    "eNqlWFtv28gVjkTdeHTxmL7RjrtNlb1kA8RrUbKjLbYP8lpJVFiSIclBtihAMBbtECuRXJHKJn0q+tB927f+gG5/RP9IUaDon+mZ"
    "CylSou10FzAMzpkzZ879fCNQHNt+9wX992Q6OXBnju8oGbqs/jcLlZbvz6zXc988ZxslyNjG1FRTD1KPZGULyjPzSjeQR2fkLUZW"
    "AMbOpe7hSftaLTPaIWT8966pbuKqolUP6AUHceGL5Qg5FRlSV2oa2dP001Il/JTop6dm8LOk7EPKV7P4WdTWubyRaXvOjGt6H1LX"
    "ao7tEr77fGa4b/jmAZQ915h5pu6zI+o2Y9zhjEO2FReW9l21wpjWxF2oI9+sQO5q4hi+p+YfSKgt+siycVXAlaSsQZ47wlNlJJSU"
    "KuT5pZ4KSEhU/gHkrqm2nlpkLKsWfAGVmAWeusM4bzThYyjSAOgswJ66xriXban+JwXleBjKIF/0TtvPOr32KbmH/s8+O+u3RiSl"
    "5EHq9EYkjeHODUeDTu85kej3qN0b9gckQ3mfD1rnL0hWWYfy8Lw1GLZ1sVtEt8Hom/O2fj7oj/qkTE8yyUOSUwqQQdFDkleKkOey"
    "h6RAF/z4kMiUn0kfEsCMq8TED0kJHV9cyB+Syu8zhRIp439CNgept9UfUlB5aUzmZse+cpKy+1ciZdPJYY9nucSONKAyNX1jbPgG"
    "dbRLU5X6eV9EhfHy/23bn73nTv97GuSeMxZyy5C1bHfuoxYSisTscuY+XafZOtCRX4jZ5bg6UzPDCMg+dqaGZWMy0jWBgvPWnGF+"
    "jjEhKeUzkI0gwlg+VL3NpHJcMjB3g4Hy3QYqLdgam2+tS1O/dOwr63o+M3zLsYMCEN2AuuCUsX0d5eI+0mCzY/v4d2Z5fkR0EaRv"
    "zfcsYhJ13VsaUeYqqfrnFOzfJlRRgcQU0q2xiD1tEG+M2Rjt0D3XvGQSF9Ultoa4wyVtQ8W1XHNi2SY6zLjm8clW/5GC9VXuDaxF"
    "Vpp6JN1o5JiiXHvld7Br2WPzne47uvDe9cyZu/rUcFE6VWePq5PomMdQZBaYY31sTUUebkX0N8en1pQ79wLWlkg0zYx3licc24A1"
    "z5q6EzROGCMccl8IZJvLYv8IW4kbaL+MOuk8VuyGF/cCIjYuY8pqTkYi5qA9n/JbPT4CTrIgIWP13+ja0QwzHbVZlPAjqCDFt4yJ"
    "9ScWUyY/qYM+xDqYXDszy38zFTW+yvQVbMfF6a8xKLzg7857rJa5i7Vihqc+pB38JAF0MW0nYRlaMx1r2AuskTA9S1h7pq+je52Z"
    "z0ZNUVO52L5rYjo7s6Hpd8ZcBg5qrNbx/NIUKcf8S/M/JAcXSEttJBNM+ilVKWTLMj2SWsSvIctmF2tAST5d7SGVD/AlVqQvoq1b"
    "GG5EEpGKXE2ET0G+mtuXvM/sMt4NzvtMkDnfEZRjPUDdY7wfcd4b+1EX1BvbSnyMYLHTFOYl7DHPZyPFTvNIrjZg+wa7Iw1OjjY4"
    "XFa/BcJHfMu2HZ9pkNxbTmD/u7lh+7y6TB/jHWHyRDHfnpb/wrSMRBGno40ZwaZUOB0XUyzwAU+0T6EYlpE5E1MnAffUQRGoJsq+"
    "djuyiSchsAsfBkO0GB1wS+P+43C0lm7hegTAfM6zrnwL51PYYV4OWoURRkVk+HbU4kjMViuC3B0QRDISyeD/DMni/xyBQaRRDFYq"
    "e1AKKTigBqK+qz/lESdFvImBw+7qsbhKiNtkplUIhLI4WPKeeT01bZ/1iqK2uxLHgyFnwLEIDBrrVAhrfumTNEJHpCNErmucTtMh"
    "y+iYvDyMfCPHADNnPm5wGsXYEmMOUqyQ8OgoBeBnZnzPz8nszVCHsvkO0982Jpxc/oDWgy2COWHiXAbRpI+Yj1btPkW2M8Gl7EBx"
    "7Mxf49BkN1Gsk2KK48Y8YhFN0Qzb+Fl5sPcJQmThb+wPr81rKxgT2DtMe8ziJlV/lKBA9bsD1ePnBWLvJuJ6jsKbHNVTYu2Yo3r+"
    "mRWfdQ0RO/88biBkXzwHClTESb9/hnAdsTu7Ag8CZTntX5yctfEdIGSjlFLwjWLKVMWv+93zs/YrXFboc0Esa1qTrGH0CyeBQIKR"
    "LrFFs93o1p/1yDp9EkQpF38gCpUhaEddjWxEeHDNeDYD+xtkS9jfINvhwUZb69bITkRQs3tI1OCQRnbFIY3shUzHeKhO7kfWdbx9"
    "v/o5lGL5gh7CiLQuzkYYETSv/WrUHvRaZyRVfYMocqXv/QZyrDF5AuIk9FN8a1LgEcydRJ6g4CWGmf+WCmYKgrbgqfOEIS7R6h9E"
    "RSyYDhDdIQkN2RuAHC7+P6w3NsOOyXDISV4MvOo/syAv3l5PwiHHGhO3f3vphSZURMk1RPPmd3PTRgwdvpVCvLQ4MBRMeOQzKCDO"
    "5tz8N4aNZe6u4XLZjks1xo7CuOVk2X3BhEd+G065qBEFdm5/RadI3PEsWu64BqrJD+WTLe8zlhWfMoC2d4JPdCaOdndzYk4XTswq"
    "n0DWozEV+bKdHOy9AygEzsIkW5Ky+lje+wokdBdtyAhmovc9DKbrLU9telvgvg+67QWUom77BXY2Icd9GUHEHFLFAA6fxQMI4ZW3"
    "yNwjUBIQ+bI4fMgH0Jq3679KUI4j1TisDH8myCz9TJBl6/XoKz/HSE9gLSTxn4Hi6Gjp+R8AvHwywIvP24J4NcefJfIdz5KFE2Dl"
    "xwr+s2EcfN0G037WqwLjliaSiF7Zs2iDCOBSDt/x/tx7/BcJ8i85jQ4MfThqDUb6y/Zg2On3sFPvwlZnEKx17bD2VK8d4h/O0uSt"
    "+iHOVhU2V7Zqeh1n7crOl3pN1zScvAk7db3WxEGcsIOnvsS5vAMbsR3tUD/Smzill49oNf0pVa2weqSOR46IvHqkgfdrRzjPlw3V"
    "jvTDI72m4XhP2mrq2jFO+4Qt9MHhMQ5/nJWLLVJ5fACVMH9YWOjEb786bw863XZvhEPyHscdLQoqEGa9kP4Hmu5AfA=="
)

_state: dict[str, Any] = {"path": None, "reason": ""}
_lock = threading.RLock()


# ---------------------------------------------------------------- the import hook


def _mode() -> str:
    return os.environ.get(ENV, "").strip().lower()


class _Finder(importlib.abc.MetaPathFinder):
    """Answers only ``import onnx``: the real package (backfilled), else the stand-in."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != "onnx":
            return None
        if _mode() == "compat":
            return importlib.util.spec_from_loader("onnx", _ShimLoader("EDGEFLOW_ONNX=compat"), is_package=True)
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _RealLoader(spec.loader)
                return spec
        if _mode() == "onnx":
            return None
        return importlib.util.spec_from_loader("onnx", _ShimLoader("no onnx package is installed"), is_package=True)


class _RealLoader(importlib.abc.Loader):
    """Runs the real onnx; adds what an old one lacks; if it does not import, the stand-in."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        try:
            self._loader.exec_module(module)
        except ImportError as exc:  # e.g. a distro onnx built against another numpy or protobuf
            if _mode() == "onnx":
                raise
            for name in [m for m in sys.modules if m.startswith("onnx.")]:
                del sys.modules[name]
            reason = f"the installed onnx does not import ({exc})"
            log.warning("edgeflow: %s; using edgeflow.onnx_compat", reason)
            _build_shim(module, reason)
            return
        _backfill(module)
        _state.update(path="onnx", reason="")

    def __getattr__(self, name: str) -> Any:  # is_package, get_resource_reader, ...
        return getattr(self._loader, name)


class _ShimLoader(importlib.abc.Loader):
    def __init__(self, reason: str) -> None:
        self.reason = reason

    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        _build_shim(module, self.reason)
        level = logging.INFO if self.reason.startswith(ENV) else logging.WARNING
        log.log(level, "%s: ONNX models load through edgeflow.onnx_compat (no C++ checker, no shape inference)",
                self.reason)


_FINDER = _Finder()


def install() -> None:
    """Put the hook first on ``sys.meta_path`` (idempotent). Imports nothing.

    An onnx that was imported before edgeflow (``import onnx, edgeflow``) gets its
    backfills here instead of at import.
    """
    with _lock:
        if _FINDER not in sys.meta_path:
            sys.meta_path.insert(0, _FINDER)
        early = sys.modules.get("onnx")
        if early is not None and not getattr(early, "EDGEFLOW_COMPAT", False) and _state["path"] is None:
            _backfill(early)
            _state.update(path="onnx", reason="")


def status() -> dict[str, Any]:
    """Which ONNX path this process takes (imports onnx to find out)."""
    import onnx

    compat = bool(getattr(onnx, "EDGEFLOW_COMPAT", False))
    out: dict[str, Any] = {
        "path": "edgeflow.onnx_compat" if compat else "onnx",
        "onnx_version": None if compat else getattr(onnx, "__version__", "?"),
        "backfilled": list(BACKFILLS),
        "skipped": list(SKIPPED) if compat else [],
        "reason": _state.get("reason", ""),
    }
    if compat:
        from google.protobuf import __version__ as pb_version

        out["protobuf_version"] = pb_version
        out["schema_from_onnx"] = _SCHEMA_FROM
    return out


def describe() -> str:
    """One line: ``onnx 1.23.2`` / ``onnx 1.12.0 (+ helper.tensor_dtype_to_np_dtype)`` / the stand-in and why."""
    try:
        s = status()
    except ImportError as exc:
        return f"no onnx and no protobuf: ONNX models cannot be loaded ({exc}); pip install protobuf"
    if s["path"] == "onnx":
        extra = f" (edgeflow added {', '.join(s['backfilled'])})" if s["backfilled"] else ""
        return f"onnx {s['onnx_version']}{extra}"
    return (f"edgeflow.onnx_compat over protobuf {s['protobuf_version']} ({s['reason']}); "
            f"skipped: {'; '.join(SKIPPED)}")


# ---------------------------------------------------------------- backfills for old onnx


def _backfill(onnx: types.ModuleType) -> None:
    """Add to an old onnx the helpers edgeflow calls that it lacks (only where missing)."""
    helper = getattr(onnx, "helper", None)
    if helper is None:
        return
    mapping = getattr(onnx, "mapping", None)
    if not hasattr(helper, "tensor_dtype_to_np_dtype") and mapping is not None:
        table = mapping.TENSOR_TYPE_TO_NP_TYPE

        def tensor_dtype_to_np_dtype(tensor_dtype: int) -> Any:
            return table[tensor_dtype]

        helper.tensor_dtype_to_np_dtype = tensor_dtype_to_np_dtype
        BACKFILLS.append("helper.tensor_dtype_to_np_dtype")
    if not hasattr(helper, "np_dtype_to_tensor_dtype") and mapping is not None:
        rev = mapping.NP_TYPE_TO_TENSOR_TYPE

        def np_dtype_to_tensor_dtype(np_dtype: Any) -> int:
            import numpy as np

            return rev[np.dtype(np_dtype)]

        helper.np_dtype_to_tensor_dtype = np_dtype_to_tensor_dtype
        BACKFILLS.append("helper.np_dtype_to_tensor_dtype")


# ---------------------------------------------------------------- the stand-in


_MESSAGES = ("AttributeProto", "ValueInfoProto", "NodeProto", "TrainingInfoProto", "ModelProto",
             "StringStringEntryProto", "TensorAnnotation", "GraphProto", "TensorProto", "SparseTensorProto",
             "TensorShapeProto", "TypeProto", "OperatorSetIdProto", "FunctionProto")


def _message_classes() -> dict[str, type]:
    from google.protobuf import descriptor_pb2, descriptor_pool

    fdp = descriptor_pb2.FileDescriptorProto.FromString(zlib.decompress(base64.b64decode("".join(_SCHEMA))))
    pool = descriptor_pool.DescriptorPool()  # private: never clashes with a real onnx's registrations
    pool.Add(fdp)
    try:
        from google.protobuf.message_factory import GetMessageClass  # protobuf >= 4.22
    except ImportError:  # protobuf 3.x (Debian bookworm: 3.21)
        from google.protobuf import message_factory

        factory = message_factory.MessageFactory(pool)
        GetMessageClass = factory.GetPrototype  # noqa: N806
    out = {}
    for name in _MESSAGES:
        desc = pool.FindMessageTypeByName(f"onnx.{name}")
        out[name] = GetMessageClass(desc)
    return out


def _submodule(parent: types.ModuleType, name: str, doc: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(f"onnx.{name}", doc)
    mod.__dict__.update(attrs)
    sys.modules[mod.__name__] = mod
    setattr(parent, name, mod)
    return mod


def _build_shim(module: types.ModuleType, reason: str) -> None:
    classes = _message_classes()
    ns = module.__dict__
    ns.update(classes)
    ns.update(
        __doc__="edgeflow.onnx_compat: ONNX protobuf classes and a helper subset, without the onnx package.",
        __version__="0+edgeflow.compat",
        __path__=[],
        EDGEFLOW_COMPAT=True,
        IR_VERSION=_IR_VERSION,
    )
    proto = types.SimpleNamespace(**classes)
    helper = _submodule(module, "helper", "onnx.helper subset (edgeflow.onnx_compat)")
    _fill_helper(helper, proto)
    numpy_helper = _submodule(module, "numpy_helper", "onnx.numpy_helper subset (edgeflow.onnx_compat)")
    numpy_helper.to_array = _to_array
    numpy_helper.from_array = lambda arr, name=None: _from_array(proto, arr, name)
    checker = _submodule(module, "checker", "a structural model check in Python (edgeflow.onnx_compat); "
                         "the C++ onnx.checker is not available")
    checker.ValidationError = type("ValidationError", (Exception,), {"__module__": "onnx.checker"})
    checker.check_model = lambda model, full_check=False, **kw: _check_model(proto, checker.ValidationError, model)
    _submodule(module, "shape_inference", "no shape inference without the onnx package (edgeflow.onnx_compat)",
               infer_shapes=_infer_shapes, InferenceError=type("InferenceError", (Exception,), {}))
    _submodule(module, "defs", "opset numbers only (edgeflow.onnx_compat)",
               onnx_opset_version=lambda: _OPSET, ONNX_DOMAIN="", ONNX_ML_DOMAIN="ai.onnx.ml")
    ns["load"] = ns["load_model"] = lambda f, load_external_data=True, **kw: _load(proto, f, load_external_data)
    ns["load_from_string"] = ns["load_model_from_string"] = lambda s, **kw: proto.ModelProto.FromString(bytes(s))
    ns["save"] = ns["save_model"] = _save
    with _lock:
        _state.update(path="edgeflow.onnx_compat", reason=reason)


# ------------------------------------------------ files


def _load(proto: Any, f: Any, load_external_data: bool) -> Any:
    if hasattr(f, "read"):
        data, base = f.read(), None
    else:
        with open(os.fspath(f), "rb") as fh:
            data = fh.read()
        base = os.path.dirname(os.path.abspath(os.fspath(f)))
    model = proto.ModelProto.FromString(data)
    if load_external_data:
        _load_external(proto, model, base)
    return model


def _tensors(graph: Any):
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("g"):
                yield from _tensors(attr.g)
            for g in attr.graphs:
                yield from _tensors(g)


def _load_external(proto: Any, model: Any, base: str | None) -> None:
    for t in _tensors(model.graph):
        if t.data_location != proto.TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in t.external_data}
        if base is None or "location" not in info:
            msg = f"tensor {t.name!r} keeps its data in an external file; load the model from its path"
            raise ValueError(msg)
        path = os.path.normpath(os.path.join(base, info["location"]))
        if os.path.isabs(info["location"]) or not path.startswith(base + os.sep):
            msg = f"tensor {t.name!r}: external data location {info['location']!r} leaves the model's folder"
            raise ValueError(msg)
        with open(path, "rb") as fh:
            fh.seek(int(info.get("offset", 0)))
            length = int(info["length"]) if "length" in info else -1
            t.raw_data = fh.read(length)
        del t.external_data[:]
        t.data_location = proto.TensorProto.DEFAULT


def _save(proto_obj: Any, f: Any, *args: Any, **kw: Any) -> None:
    data = proto_obj.SerializeToString()
    if hasattr(f, "write"):
        f.write(data)
        return
    with open(os.fspath(f), "wb") as fh:
        fh.write(data)


def _infer_shapes(model: Any, check_type: bool = False, strict_mode: bool = False, data_prop: bool = False) -> Any:
    """No shape inference without onnx: the model comes back unchanged (its declared shapes only)."""
    if isinstance(model, (bytes, bytearray)):
        import onnx

        return onnx.load_model_from_string(bytes(model))
    return model


# ------------------------------------------------ dtypes and tensors

_NP_OF = {1: "float32", 2: "uint8", 3: "int8", 4: "uint16", 5: "int16", 6: "int32", 7: "int64", 8: "object",
          9: "bool", 10: "float16", 11: "float64", 12: "uint32", 13: "uint64", 14: "complex64", 15: "complex128"}
_NAMES = {16: "BFLOAT16", 17: "FLOAT8E4M3FN", 18: "FLOAT8E4M3FNUZ", 19: "FLOAT8E5M2", 20: "FLOAT8E5M2FNUZ",
          21: "UINT4", 22: "INT4", 23: "FLOAT4E2M1"}


def _np_dtype(tensor_dtype: int) -> Any:
    import numpy as np

    name = _NP_OF.get(int(tensor_dtype))
    if name is None:
        what = _NAMES.get(int(tensor_dtype), str(tensor_dtype))
        msg = f"ONNX element type {what} has no numpy dtype without the onnx package (edgeflow.onnx_compat)"
        raise TypeError(msg)
    return np.dtype(name)


def _tensor_dtype(np_dtype: Any) -> int:
    import numpy as np

    dt = np.dtype(np_dtype)
    if dt.kind in "USO":
        return 8
    for k, v in _NP_OF.items():
        if v == dt.name:
            return k
    msg = f"numpy dtype {dt} has no ONNX element type"
    raise TypeError(msg)


def _to_array(tensor: Any, base_dir: str = "") -> Any:
    import numpy as np

    if tensor.data_location == 1:  # EXTERNAL
        msg = f"tensor {tensor.name!r} still refers to external data; load the model with onnx.load(path)"
        raise ValueError(msg)
    dt = _np_dtype(tensor.data_type)
    dims = tuple(int(d) for d in tensor.dims)
    if tensor.data_type == 8:  # STRING
        return np.array(list(tensor.string_data), dtype=object).reshape(dims)
    if tensor.HasField("raw_data"):
        storage = np.dtype(np.uint8) if dt == np.bool_ else dt.newbyteorder("<")
        arr = np.frombuffer(tensor.raw_data, dtype=storage)
        return arr.astype(dt).reshape(dims) if storage != dt else arr.copy().reshape(dims)
    code = int(tensor.data_type)
    if code == 1:
        arr = np.asarray(tensor.float_data, dtype=np.float32)
    elif code == 11:
        arr = np.asarray(tensor.double_data, dtype=np.float64)
    elif code == 7:
        arr = np.asarray(tensor.int64_data, dtype=np.int64)
    elif code in (12, 13):
        arr = np.asarray(tensor.uint64_data, dtype=np.uint64).astype(dt)
    elif code == 10:  # float16 bits in int32_data
        arr = np.asarray(tensor.int32_data, dtype=np.int32).astype(np.uint16).view(np.float16)
    elif code in (14, 15):
        src = tensor.float_data if code == 14 else tensor.double_data
        pairs = np.asarray(src, dtype=np.float64).reshape(-1, 2)
        arr = (pairs[:, 0] + 1j * pairs[:, 1]).astype(dt)
    else:  # (u)int8/16, int32, bool in int32_data
        arr = np.asarray(tensor.int32_data, dtype=np.int32).astype(dt)
    return arr.reshape(dims)


def _from_array(proto: Any, arr: Any, name: str | None = None) -> Any:
    import numpy as np

    arr = np.asarray(arr)
    t = proto.TensorProto()
    t.dims.extend(int(d) for d in arr.shape)
    if name:
        t.name = name
    t.data_type = _tensor_dtype(arr.dtype)
    if t.data_type == 8:
        t.string_data.extend(x if isinstance(x, bytes) else str(x).encode("utf-8") for x in arr.flat)
        return t
    if arr.dtype == np.bool_:
        t.raw_data = arr.astype(np.uint8).tobytes()
    else:
        t.raw_data = arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
    return t


# ------------------------------------------------ onnx.helper subset


def _fill_helper(helper: types.ModuleType, proto: Any) -> None:
    """Put the ``onnx.helper`` subset, made over ``proto``'s message classes, into ``helper``."""
    h = _Helper(proto)
    helper.__dict__.update(
        make_attribute=h.make_attribute, get_attribute_value=h.get_attribute_value, make_node=h.make_node,
        make_opsetid=h.make_opsetid, make_tensor_type_proto=h.make_tensor_type_proto,
        make_tensor_value_info=h.make_tensor_value_info, make_tensor=h.make_tensor, make_graph=h.make_graph,
        make_model=h.make_model, tensor_dtype_to_np_dtype=_np_dtype, np_dtype_to_tensor_dtype=_tensor_dtype,
    )


class _Helper:
    """The ``onnx.helper`` functions edgeflow calls, over one set of message classes (``proto``)."""

    def __init__(self, proto: Any) -> None:
        self.proto = proto
        self.attr_t = proto.AttributeProto

    def make_attribute(self, key: str, value: Any, doc_string: str | None = None,
                       attr_type: int | None = None) -> Any:
        """An AttributeProto named ``key``; its type told from ``value`` (checked against ``attr_type``)."""
        import numpy as np

        a = self.attr_t()
        a.name = key
        if doc_string:
            a.doc_string = doc_string
        if isinstance(value, np.ndarray) and value.ndim == 0:
            value = value.item()
        if not self._set_single(a, value):
            self._set_list(a, key, value, attr_type)
        if attr_type is not None and a.type != attr_type:
            msg = f"attribute {key!r}: value {value!r} does not match attr_type {attr_type}"
            raise TypeError(msg)
        return a

    def _set_single(self, a: Any, value: Any) -> bool:
        """Set ``a`` from a number, string, tensor or graph; False when ``value`` is none of these."""
        import numpy as np

        attr_t = self.attr_t
        if isinstance(value, (bool, np.bool_)) or isinstance(value, (int, np.integer)):
            a.i, a.type = int(value), attr_t.INT
        elif isinstance(value, (float, np.floating)):
            a.f, a.type = float(value), attr_t.FLOAT
        elif isinstance(value, (str, bytes)):
            a.s, a.type = value.encode("utf-8") if isinstance(value, str) else value, attr_t.STRING
        elif isinstance(value, self.proto.TensorProto):
            a.t.CopyFrom(value)
            a.type = attr_t.TENSOR
        elif isinstance(value, self.proto.GraphProto):
            a.g.CopyFrom(value)
            a.type = attr_t.GRAPH
        else:
            return False
        return True

    def _set_list(self, a: Any, key: str, value: Any, attr_type: int | None) -> None:
        """Set ``a`` from an iterable: ints, floats, strings, tensors or graphs (an empty one needs attr_type)."""
        import numpy as np

        attr_t, proto = self.attr_t, self.proto
        items = list(value)
        if not items and attr_type is None:
            msg = f"attribute {key!r}: an empty list needs attr_type"
            raise ValueError(msg)
        if attr_type == attr_t.INTS or (attr_type is None and all(isinstance(x, (int, np.integer)) for x in items)):
            a.ints.extend(int(x) for x in items)
            a.type = attr_t.INTS
        elif attr_type == attr_t.FLOATS or (
            attr_type is None and all(isinstance(x, (int, float, np.integer, np.floating)) for x in items)
        ):
            a.floats.extend(float(x) for x in items)
            a.type = attr_t.FLOATS
        elif attr_type == attr_t.STRINGS or all(isinstance(x, (str, bytes)) for x in items):
            a.strings.extend(x.encode("utf-8") if isinstance(x, str) else x for x in items)
            a.type = attr_t.STRINGS
        elif all(isinstance(x, proto.TensorProto) for x in items):
            a.tensors.extend(items)
            a.type = attr_t.TENSORS
        elif all(isinstance(x, proto.GraphProto) for x in items):
            a.graphs.extend(items)
            a.type = attr_t.GRAPHS
        else:
            msg = f"attribute {key!r}: cannot tell the ONNX type of {value!r}"
            raise ValueError(msg)

    def get_attribute_value(self, attr: Any) -> Any:
        """The value of an AttributeProto, by its type (repeated fields as lists)."""
        attr_t = self.attr_t
        kinds = {
            attr_t.FLOAT: lambda: attr.f, attr_t.INT: lambda: attr.i, attr_t.STRING: lambda: attr.s,
            attr_t.TENSOR: lambda: attr.t, attr_t.GRAPH: lambda: attr.g,
            attr_t.SPARSE_TENSOR: lambda: attr.sparse_tensor, attr_t.TYPE_PROTO: lambda: attr.tp,
            attr_t.FLOATS: lambda: list(attr.floats), attr_t.INTS: lambda: list(attr.ints),
            attr_t.STRINGS: lambda: list(attr.strings), attr_t.TENSORS: lambda: list(attr.tensors),
            attr_t.GRAPHS: lambda: list(attr.graphs), attr_t.SPARSE_TENSORS: lambda: list(attr.sparse_tensors),
            attr_t.TYPE_PROTOS: lambda: list(attr.type_protos),
        }
        if attr.type not in kinds:
            msg = f"attribute {attr.name!r} has no value type set"
            raise ValueError(msg)
        return kinds[attr.type]()

    def make_node(self, op_type: str, inputs: Any, outputs: Any, name: str | None = None,
                  doc_string: str | None = None, domain: str | None = None, **kwargs: Any) -> Any:
        """A NodeProto; keyword arguments other than None become its attributes, sorted by name."""
        node = self.proto.NodeProto()
        node.op_type = op_type
        node.input.extend(inputs)
        node.output.extend(outputs)
        if name:
            node.name = name
        if doc_string:
            node.doc_string = doc_string
        if domain is not None:
            node.domain = domain
        node.attribute.extend(self.make_attribute(k, v) for k, v in sorted(kwargs.items()) if v is not None)
        return node

    def make_opsetid(self, domain: str, version: int) -> Any:
        """An OperatorSetIdProto."""
        o = self.proto.OperatorSetIdProto()
        o.domain, o.version = domain, int(version)
        return o

    def make_tensor_type_proto(self, elem_type: int, shape: Any, shape_denotation: Any = None) -> Any:
        """A tensor TypeProto; a str dim is symbolic, None unknown (shape None: no shape at all)."""
        tp = self.proto.TypeProto()
        tt = tp.tensor_type
        tt.elem_type = int(elem_type)
        if shape is not None:
            tt.shape.SetInParent()
            for i, d in enumerate(shape):
                dim = tt.shape.dim.add()
                if isinstance(d, str):
                    dim.dim_param = d
                elif d is not None:
                    dim.dim_value = int(d)
                if shape_denotation:
                    dim.denotation = shape_denotation[i]
        return tp

    def make_tensor_value_info(self, name: str, elem_type: int, shape: Any, doc_string: str = "",
                               shape_denotation: Any = None) -> Any:
        """A ValueInfoProto of a tensor."""
        vi = self.proto.ValueInfoProto()
        vi.name = name
        if doc_string:
            vi.doc_string = doc_string
        vi.type.CopyFrom(self.make_tensor_type_proto(elem_type, shape, shape_denotation))
        return vi

    def make_tensor(self, name: str, data_type: int, dims: Any, vals: Any, raw: bool = False) -> Any:
        """A TensorProto from values (stored as raw_data) or, with ``raw``, from bytes as they are."""
        import numpy as np

        proto = self.proto
        if raw:
            t = proto.TensorProto()
            t.name, t.data_type = name, int(data_type)
            t.dims.extend(int(d) for d in dims)
            t.raw_data = bytes(vals)
            return t
        arr = np.asarray(vals, dtype=_np_dtype(data_type)).reshape(tuple(int(d) for d in dims))
        return _from_array(proto, arr, name)

    def make_graph(self, nodes: Any, name: str, inputs: Any, outputs: Any, initializer: Any = None,
                   doc_string: str | None = None, value_info: Any = (), sparse_initializer: Any = None) -> Any:
        """A GraphProto."""
        g = self.proto.GraphProto()
        g.node.extend(nodes)
        g.name = name
        g.input.extend(inputs)
        g.output.extend(outputs)
        g.initializer.extend(initializer or [])
        g.sparse_initializer.extend(sparse_initializer or [])
        g.value_info.extend(value_info or [])
        if doc_string:
            g.doc_string = doc_string
        return g

    def make_model(self, graph: Any, **kwargs: Any) -> Any:
        """A ModelProto at the embedded schema's IR version (default opset: its ai.onnx opset)."""
        m = self.proto.ModelProto()
        m.ir_version = _IR_VERSION
        m.graph.CopyFrom(graph)
        opsets = kwargs.pop("opset_imports", None)
        m.opset_import.extend(opsets if opsets is not None else [self.make_opsetid("", _OPSET)])
        functions = kwargs.pop("functions", None)
        if functions:
            m.functions.extend(functions)
        for k, v in kwargs.items():
            setattr(m, k, v)
        return m


# ------------------------------------------------ a structural check in Python


def _check_model(proto: Any, error: type, model: Any) -> None:
    """What the stand-in checks (the C++ checker checks far more: op schemas, types, attributes)."""
    if isinstance(model, (bytes, bytearray)):
        model = proto.ModelProto.FromString(bytes(model))
    elif isinstance(model, (str, os.PathLike)):
        model = _load(proto, model, True)
    if not model.ir_version:
        raise error("the model does not set ir_version")
    if model.ir_version > _IR_VERSION:
        raise error(f"model ir_version {model.ir_version} is newer than this checker knows ({_IR_VERSION})")
    if model.ir_version >= 3 and not model.opset_import:
        raise error("model with IR version >= 3 must specify opset_import for ONNX")
    seen_domains: set[str] = set()
    for imp in model.opset_import:
        if imp.domain in seen_domains:
            raise error(f"opset domain {imp.domain!r} is imported twice")
        seen_domains.add(imp.domain)
    _check_graph(proto, error, model.graph, set(), "graph")


def _check_tensor(proto: Any, error: type, t: Any, where: str) -> None:
    import numpy as np

    if t.data_location == proto.TensorProto.EXTERNAL or t.data_type in (0, 8) or t.data_type in _NAMES:
        return
    n = int(np.prod([int(d) for d in t.dims], dtype=np.int64))
    if t.HasField("raw_data"):
        size = _np_dtype(t.data_type).itemsize
        if len(t.raw_data) != n * size:
            raise error(f"{where}: tensor {t.name!r} has {len(t.raw_data)} bytes of data for dims "
                        f"{list(t.dims)} ({n * size} expected)")
        return
    got = len(t.float_data) + len(t.int32_data) + len(t.int64_data) + len(t.double_data) + len(t.uint64_data)
    if t.data_type in (14, 15):
        got //= 2
    if got != n:
        raise error(f"{where}: tensor {t.name!r} has {got} values for dims {list(t.dims)} ({n} expected)")


def _check_graph(proto: Any, error: type, g: Any, outer: set[str], where: str) -> None:
    defined = set(outer)
    for i in g.input:
        if not i.name:
            raise error(f"{where}: a graph input has no name")
        defined.add(i.name)
    own: set[str] = set()
    for t in g.initializer:
        if t.name in own:
            raise error(f"{where}: initializer {t.name!r} is defined twice")
        own.add(t.name)
        _check_tensor(proto, error, t, where)
    for s in g.sparse_initializer:
        own.add(s.values.name)
    defined |= own
    produced: set[str] = set()
    for k, node in enumerate(g.node):
        label = f"{where}: node {k} ({node.op_type} {node.name!r})"
        if not node.op_type:
            raise error(f"{where}: node {k} has no op_type")
        for x in node.input:
            if x and x not in defined:
                raise error(f"{label}: input {x!r} is not a graph input, an initializer or the output of an "
                            "earlier node (the graph must be topologically sorted)")
        names = set()
        for a in node.attribute:
            if not a.name:
                raise error(f"{label}: an attribute has no name")
            if a.name in names:
                raise error(f"{label}: attribute {a.name!r} is given twice")
            names.add(a.name)
            if a.HasField("t"):
                _check_tensor(proto, error, a.t, label)
            subgraphs = ([a.g] if a.HasField("g") else []) + list(a.graphs)
            for sub in subgraphs:
                _check_graph(proto, error, sub, defined, f"{label} attribute {a.name!r}")
        for y in node.output:
            if not y:
                continue
            if y in produced or y in defined - set(outer):
                raise error(f"{label}: output {y!r} is assigned twice (the graph must be in single static "
                            "assignment form)")
            produced.add(y)
            defined.add(y)
    for o in g.output:
        if o.name not in defined:
            raise error(f"{where}: graph output {o.name!r} is produced by no node")
