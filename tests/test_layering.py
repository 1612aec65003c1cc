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


# ---------------------------------------------------------------- the transport (issue 16)

TRANSPORT = ROOT / "edgeflow" / "transport"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """Import edges between the given modules (name -> (source, is_package)), in-function and
    TYPE_CHECKING imports included; ``from pkg import name`` counts as an edge to ``pkg.name``
    when that is one of the modules."""
    graph: dict[str, set[str]] = {}
    for name, (src, is_pkg) in sources.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(src)):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = base[: len(base) - node.level + 1]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
            edges.update(t for t in targets if t in sources and t != name)
        graph[name] = edges
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def _transport_graph() -> dict[str, set[str]]:
    return _import_graph({_module_name(f): (f.read_text(), f.name == "__init__.py")
                          for f in _files("edgeflow/transport")})


def test_only_the_mqtt_package_imports_paho():
    """Inside the transport too: the seam (base), the loopback and the helpers are paho-free."""
    for f in _files("edgeflow/transport"):
        if "paho" in {m.split(".")[0] for m in _imports(f)}:
            assert f.parent == TRANSPORT / "mqtt", f"{f.relative_to(ROOT)} imports paho"


def test_the_transport_imports_nothing_above_it():
    """edgeflow.transport may use the standard library, paho, amqtt (the embedded broker),
    edgeflow.errors and itself: never the gateway, device side, runtime or anything else."""
    allowed = {"paho", "amqtt"}
    for f in _files("edgeflow/transport"):
        for mod in _imports(f):
            top = mod.split(".")[0]
            if top in STDLIB or top in allowed:
                continue
            assert mod == "edgeflow.errors" or mod.startswith("edgeflow.transport"), (
                f"{f.relative_to(ROOT)} imports {mod}: the transport must not depend on what sits above it")


def test_no_import_cycles_inside_the_transport():
    graph = _transport_graph()
    assert "edgeflow.transport.mqtt.facade" in graph["edgeflow.transport.mqtt"]  # relative/absolute resolve alike
    assert "edgeflow.transport.mqtt.netloop" in graph["edgeflow.transport.mqtt.facade"]
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_check_sees_in_function_and_relative_imports():
    """The checker itself: a cycle closed by an import inside a function, or by a relative
    import, is found."""
    sources = {
        "pkg": ("", True),
        "pkg.a": ("from pkg import b\n", False),
        "pkg.b": ("def later():\n    from pkg.a import thing\n", False),
    }
    assert _find_cycle(_import_graph(sources)) == ["pkg.a", "pkg.b", "pkg.a"]
    sources["pkg.b"] = ("def later():\n    from . import a\n", False)
    assert _find_cycle(_import_graph(sources)) == ["pkg.a", "pkg.b", "pkg.a"]
    sources["pkg.b"] = ("import json\n", False)
    assert _find_cycle(_import_graph(sources)) is None
