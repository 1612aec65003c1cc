"""``edgeflow profile list|show|detect``: the boards edgeflow knows."""

from __future__ import annotations

ORDER = 10


def register(sub) -> None:
    p = sub.add_parser(
        "profile",
        help="list, show or detect device profiles",
        description="Device profiles describe boards as data (device_profiles/*.toml): arch, cores, "
        "memory budget, execution providers, backends, quantization scheme, threads, training.",
    )
    ps = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    ls = ps.add_parser("list", help="every built-in profile")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.set_defaults(func=cmd_list)
    sh = ps.add_parser("show", help="one profile in full")
    sh.add_argument("name", help="profile name (see 'edgeflow profile list') or path to a .toml file")
    sh.add_argument("--json", action="store_true")
    sh.set_defaults(func=cmd_show)
    de = ps.add_parser(
        "detect", help="the built-in profile closest to this machine, and which runtime parts it has",
        description="Pick the built-in profile for this machine (device-tree model string, else architecture, "
        "cores and memory) and say which runtime parts are here and what stands in for a missing one. "
        "Override: EDGEFLOW_PROFILE=NAME|file.toml picks the profile outright; EDGEFLOW_BOARD_MODEL='Raspberry Pi 4 "
        "Model B' stands in for the device-tree model (emulated userlands have none).")
    de.add_argument("--json", action="store_true")
    de.set_defaults(func=cmd_detect)


def cmd_list(args) -> int:
    from ..profiles import builtin_profiles
    from ._common import console, emit_json, fit_table

    profs = builtin_profiles()
    if args.json:
        emit_json([p.to_dict() for p in profs.values()])
        return 0
    cols = [("name", 0, "left"), ("arch", 0, "left"), ("cores", 2, "right"), ("budget MiB", 1, "right"),
            ("backends", 0, "left"), ("quantization", 3, "left"), ("trains", 1, "left")]
    rows = [[p.name, p.arch, str(p.cores), str(p.memory_budget_mb), " > ".join(p.backends),
             f"{p.quantization.scheme}/{p.quantization.activations}", "yes" if p.can_train else "no"]
            for p in profs.values()]
    c = console()
    t = fit_table("device profiles", cols, rows, c.width)
    c.print(t)
    return 0


def _show(p, as_json: bool) -> int:
    from ._common import console, emit_json

    if as_json:
        emit_json(p.to_dict())
        return 0
    from rich.markup import escape

    c = console()
    c.print(f"[bold]{escape(p.name)}[/bold]: {escape(p.description)}")
    for k, v in p.to_dict().items():
        if k in ("name", "description"):
            continue
        if k == "train_memory_budget_mb" and not v:  # 0 = the inference budget (docs/profiles.md)
            v = f"0 (= memory_budget_mb: {p.train_memory_budget_bytes // 2**20} MiB for a training step)"
        if isinstance(v, dict):  # one line per key, so nothing wraps mid-value at 80 columns
            c.print(f"  {k}:", soft_wrap=True)
            for kk, vv in v.items():
                c.print(f"    {kk}: {escape(str(vv))}", soft_wrap=True)
            continue
        if isinstance(v, (list, tuple)):
            v = ", ".join(str(x) for x in v)
        c.print(f"  {k}: {escape(str(v))}", soft_wrap=True)
    return 0


def cmd_show(args) -> int:
    from ..profiles import get_profile

    return _show(get_profile(args.name), args.json)


def _origin(module) -> str:
    path = str(getattr(module, "__file__", "") or "")
    return "distro" if "/dist-packages/" in path and path.startswith("/usr/lib/") else "pip"


def runtime_parts() -> list[dict]:
    """What this host runs each part with: ``{"part", "ok", "using", "instead"}`` per part.

    ``ok`` is False for a part that is missing (or unusable) here; ``instead``
    then says what edgeflow uses in its place. Never raises for a missing part.
    """
    import importlib.metadata as md
    import os

    import numpy

    from .. import onnx_compat, signing
    from ..runtime.backends import available_backends

    parts = [{"part": "numpy", "ok": True, "using": f"numpy {numpy.__version__} ({_origin(numpy)})", "instead": ""}]
    try:
        st = onnx_compat.status()
    except ImportError as exc:  # neither onnx nor protobuf
        st = {"path": "none", "reason": str(exc)}
    compat = st["path"] != "onnx"
    if not compat:
        parts.append({"part": "onnx", "ok": True, "using": onnx_compat.describe(), "instead": ""})
    elif st["path"] == "none":
        parts.append({"part": "onnx", "ok": False, "using": f"not installed, and no protobuf ({st['reason']})",
                      "instead": "nothing: ONNX models cannot be loaded; pip install protobuf"})
    else:
        parts.append({"part": "onnx", "ok": False, "using": f"not used: {st['reason']}",
                      "instead": f"edgeflow.onnx_compat over protobuf {st['protobuf_version']}: "
                      "a structural check instead of the C++ checker, no shape inference"})
    backends = available_backends()
    if "ort" in backends:
        parts.append({"part": "onnxruntime", "ok": True, "using": f"onnxruntime {md.version('onnxruntime')}",
                      "instead": ""})
    else:
        parts.append({"part": "onnxruntime", "ok": False, "using": "not installed (no wheel for this board)",
                      "instead": "the numpy backend (edgeflow.kernels) runs every model"})
    if signing.BACKEND == "cryptography":
        import cryptography

        parts.append({"part": "cryptography", "ok": True,
                      "using": f"cryptography {cryptography.__version__} ({_origin(cryptography)}): Ed25519, "
                      "X25519/AES-GCM for secure aggregation", "instead": ""})
    else:
        forced = os.environ.get(signing.BACKEND_ENV, "")
        parts.append({"part": "cryptography", "ok": False,
                      "using": f"not used: {signing.BACKEND_ENV}={forced}" if forced else "not installed",
                      "instead": "pure-Python Ed25519 (RFC 8032) signs and verifies; secure aggregation and "
                      "broker-config need cryptography"})
    try:
        from google.protobuf import __version__ as pb
        from google.protobuf.internal import api_implementation

        parts.append({"part": "protobuf", "ok": True, "using": f"protobuf {pb} ({api_implementation.Type()})",
                      "instead": ""})
    except ImportError:
        parts.append({"part": "protobuf", "ok": not compat, "using": "not installed",
                      "instead": "nothing needed while onnx is installed" if not compat else "pip install protobuf"})
    return parts


def cmd_detect(args) -> int:
    from ..profiles import detect_with_reason
    from ._common import console, emit_json

    prof, how = detect_with_reason()
    parts = runtime_parts()
    if args.json:
        emit_json({**prof.to_dict(), "detected_by": how, "runtime": parts})
        return 0
    _show(prof, False)
    c = console()
    c.print(f"detected by: {how}", markup=False, soft_wrap=True)
    c.print("runtime parts here:")
    for p in parts:
        line = f"  {p['part']}: {p['using']}"
        if not p["ok"]:
            line += f" -> instead: {p['instead']}"
        c.print(line, markup=False, soft_wrap=True)
    return 0
