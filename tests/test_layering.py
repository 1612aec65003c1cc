"""Module boundaries, checked on the source with ast (loose coupling is a rule, not a hope)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STDLIB = set(sys.stdlib_module_names)


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the package
                pkg = path.relative_to(ROOT).with_suffix("").parts[: -node.level]
                base = ".".join(pkg)
                out.add(f"{base}.{node.module}" if node.module else base)
            elif node.module:
                out.add(node.module)
    return out


def _files(folder: str):
    return sorted((ROOT / folder).rglob("*.py"))


def test_kernels_import_only_numpy_and_stdlib():
    for f in _files("kernels"):
        for mod in _imports(f):
            top = mod.split(".")[0]
            assert top in STDLIB or top in ("numpy", "kernels"), f"{f.relative_to(ROOT)} imports {mod}"


def test_only_the_transport_imports_paho():
    for folder in ("edgeflow", "gateway", "kernels"):
        for f in _files(folder):
            if "paho" in {m.split(".")[0] for m in _imports(f)}:
                assert f.relative_to(ROOT).as_posix().startswith("edgeflow/transport/"), f


def test_runtime_and_training_never_import_the_transport():
    runtime_parts = ["edgeflow/runtime.py", "edgeflow/graph.py", "edgeflow/memory.py", "edgeflow/model.py",
                     "edgeflow/profiles.py"]
    files = [ROOT / p for p in runtime_parts] + _files("edgeflow/backends") + _files("edgeflow/train") \
        + _files("edgeflow/quantization")
    for f in files:
        if not f.exists():
            continue
        for mod in _imports(f):
            assert "transport" not in mod.split("."), f"{f.relative_to(ROOT)} imports {mod}"


def test_gateway_never_imports_kernels():
    for f in _files("gateway"):
        for mod in _imports(f):
            parts = mod.split(".")
            assert "kernels" not in parts, f"{f.relative_to(ROOT)} imports {mod}"
