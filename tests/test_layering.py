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
    runtime_parts = ["edgeflow/runtime/session.py", "edgeflow/runtime/graph.py", "edgeflow/runtime/memory.py", "edgeflow/runtime/model.py",
                     "edgeflow/profiles.py"]
    files = [ROOT / p for p in runtime_parts] + _files("edgeflow/runtime/backends") + _files("edgeflow/train") \
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
    TYPE_CHECKING imports included. ``from pkg import name`` is an edge to ``pkg.name`` when that
    is one of the modules, else to ``pkg``; an import of something that is not one of the modules
    (``from pkg.mod import Class``) is an edge to the longest module prefix (``pkg.mod``)."""
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
                subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in sources]
                targets = subs if len(subs) == len(node.names) else subs + [mod]
            for target in targets:
                while target and target not in sources:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.add(target)
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


def test_only_the_nats_package_imports_nats():
    """nats-py stays in edgeflow/transport/nats/ (issue 35), as paho stays in mqtt/."""
    for f in _files("edgeflow"):
        if "nats" in {m.split(".")[0] for m in _imports(f)}:
            assert f.parent == TRANSPORT / "nats", f"{f.relative_to(ROOT)} imports nats"


def test_the_transport_imports_nothing_above_it():
    """edgeflow.transport may use the standard library, paho, nats-py, amqtt (the embedded broker),
    edgeflow.errors and itself: never the gateway, device side, runtime or anything else."""
    allowed = {"paho", "amqtt", "nats"}
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


# ---------------------------------------------------------------- the whole tree (issue 16, item 4)

TREE = {"edgeflow": ROOT / "edgeflow", "edgeflow.kernels": ROOT / "kernels", "edgeflow.gateway": ROOT / "gateway"}
"""Where each installed package's source lives (pyproject's package-dir)."""

GATEWAY_IMPORTERS = ("edgeflow.cli", "edgeflow.sim.demo", "edgeflow.sim.simulation")
"""The allow-list: the only edgeflow modules (besides the gateway itself and the lazy front
door ``edgeflow/__init__.py``) that may import ``edgeflow.gateway``: the operator's CLI, and
the demo and simulation, which run a gateway in-process. Device-side code (device, federated,
protocol, transport, runtime, train, quantization, codecs, ...) never does."""

PROTOCOL_MAY_IMPORT = ("edgeflow.errors", "edgeflow.signing", "edgeflow.codecs.untrusted", "edgeflow.protocol")


def _tree_sources(tree: dict[str, Path]) -> dict[str, tuple[str, bool]]:
    """Installed module name -> (source, is_package) for every .py file under the tree's folders."""
    out: dict[str, tuple[str, bool]] = {}
    for prefix, folder in tree.items():
        for f in sorted(folder.rglob("*.py")):
            rel = f.relative_to(folder).with_suffix("").parts
            is_pkg = rel[-1] == "__init__"
            name = ".".join(prefix.split(".") + list(rel[:-1] if is_pkg else rel))
            out[name] = (f.read_text(), is_pkg)
    return out


def _within(module: str, packages: tuple[str, ...] | str) -> bool:
    packages = (packages,) if isinstance(packages, str) else packages
    return any(module == p or module.startswith(p + ".") for p in packages)


def _room(module: str) -> str:
    """The room a module lives in: ``edgeflow.<first part>`` (``edgeflow.gateway.store.base`` ->
    ``edgeflow.gateway``, ``edgeflow.runtime`` -> itself)."""
    return ".".join(module.split(".")[:2])


def _room_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Edges between rooms; the root package (the lazy front door, imported by everything) is left out."""
    rooms: dict[str, set[str]] = {}
    for src, targets in graph.items():
        if src == "edgeflow":
            continue
        edges = rooms.setdefault(_room(src), set())
        edges.update(_room(t) for t in targets if t != "edgeflow" and _room(t) != _room(src))
    for targets in list(rooms.values()):
        for t in targets:
            rooms.setdefault(t, set())
    return rooms


def _layering_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every rule the graph breaks, one line each (empty = the layering holds)."""
    out: list[str] = []
    cycle = _find_cycle(graph)
    if cycle:
        out.append("import cycle: " + " -> ".join(cycle))
    room_cycle = _find_cycle(_room_graph(graph))
    if room_cycle:
        out.append("cycle between rooms: " + " -> ".join(room_cycle))
    for src, targets in sorted(graph.items()):
        if src == "edgeflow" or _within(src, ("edgeflow.gateway",) + GATEWAY_IMPORTERS):
            continue
        for t in sorted(targets):
            if _within(t, "edgeflow.gateway"):
                out.append(f"{src} imports {t}: device-side code never imports the gateway")
            if _within(src, "edgeflow.protocol") and not _within(t, PROTOCOL_MAY_IMPORT):
                out.append(f"{src} imports {t}: the protocol uses only errors, signing and codecs.untrusted")
    return out


def test_the_whole_tree_keeps_its_layering():
    """No import cycle anywhere in edgeflow/, kernels/ and gateway/ (in-function and TYPE_CHECKING
    imports included), none between rooms, device side never -> gateway, protocol at the bottom."""
    graph = _import_graph(_tree_sources(TREE))
    assert len(graph) > 150 and "edgeflow.gateway.rounds" in graph and "edgeflow.kernels.conv" in graph
    assert "edgeflow.protocol.rounds" in graph["edgeflow.gateway.rounds"]  # absolute imports resolve
    assert "edgeflow.protocol.secagg_wire" in graph["edgeflow.federated.client"]  # in-function, relative
    assert _layering_violations(graph) == []


def _plant(tmp_path: Path, files: dict[str, str]) -> dict[str, set[str]]:
    for rel, src in files.items():
        f = tmp_path / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(src)
    tree = {"edgeflow": tmp_path / "edgeflow", "edgeflow.gateway": tmp_path / "gateway"}
    return _import_graph(_tree_sources(tree))


CLEAN_TREE = {
    "edgeflow/__init__.py": "def __getattr__(name):\n    from .federated.client import Client\n    return Client\n",
    "edgeflow/errors.py": "",
    "edgeflow/protocol/__init__.py": "",
    "edgeflow/protocol/rounds.py": "from ..errors import *\n",
    "edgeflow/federated/__init__.py": "",
    "edgeflow/federated/client.py": "from edgeflow.protocol.rounds import X\n",
    "edgeflow/cli/__init__.py": "",
    "edgeflow/cli/gateway.py": "from edgeflow.gateway.rounds import RoundManager\n",
    "gateway/__init__.py": "",
    "gateway/rounds.py": "from edgeflow.protocol.rounds import X\nfrom . import secagg\n",
    "gateway/secagg.py": "import numpy\n",
}


def test_the_checker_passes_a_clean_planted_tree(tmp_path):
    assert _layering_violations(_plant(tmp_path, CLEAN_TREE)) == []


def test_the_checker_catches_a_planted_cycle(tmp_path):
    """A cycle closed by an in-function relative import, across two rooms, on a tree of files."""
    tree = dict(CLEAN_TREE)
    tree["edgeflow/protocol/rounds.py"] = "def later():\n    from ..federated import client\n"
    found = _layering_violations(_plant(tmp_path, tree))
    assert "import cycle: edgeflow.federated.client -> edgeflow.protocol.rounds -> edgeflow.federated.client" in found
    rooms = [line for line in found if line.startswith("cycle between rooms: ")]
    assert len(rooms) == 1 and set(rooms[0].split(": ")[1].split(" -> ")) == {"edgeflow.federated", "edgeflow.protocol"}


def test_the_checker_catches_a_cycle_inside_the_gateway(tmp_path):
    tree = dict(CLEAN_TREE)
    tree["gateway/secagg.py"] = "if False:\n    from edgeflow.gateway.rounds import RoundManager\n"
    assert _layering_violations(_plant(tmp_path, tree)) == [
        "import cycle: edgeflow.gateway.rounds -> edgeflow.gateway.secagg -> edgeflow.gateway.rounds"]


def test_the_checker_catches_device_side_code_importing_the_gateway(tmp_path):
    tree = dict(CLEAN_TREE)
    tree["edgeflow/federated/client.py"] = "def f():\n    from ..gateway.secagg import SecAggClient\n"
    assert _layering_violations(_plant(tmp_path, tree)) == [
        "edgeflow.federated.client imports edgeflow.gateway.secagg: device-side code never imports the gateway"]


def test_the_checker_catches_the_protocol_importing_upwards(tmp_path):
    tree = dict(CLEAN_TREE)
    tree["edgeflow/transport/__init__.py"] = ""
    tree["edgeflow/protocol/rounds.py"] = "import edgeflow.transport\n"
    assert _layering_violations(_plant(tmp_path, tree)) == [
        "edgeflow.protocol.rounds imports edgeflow.transport: the protocol uses only errors, signing and "
        "codecs.untrusted"]


if __name__ == "__main__":  # python tests/test_layering.py: the room graph docs/architecture.md shows
    _rooms = _room_graph(_import_graph(_tree_sources(TREE)))
    _level: dict[str, int] = {}

    def _depth(room: str) -> int:
        if room not in _level:
            _level[room] = 1 + max((_depth(t) for t in _rooms[room]), default=-1)
        return _level[room]

    for _r in sorted(_rooms, key=lambda r: (_depth(r), r)):
        print(f"L{_depth(_r)}  {_r.removeprefix('edgeflow.'):14} -> "
              + ", ".join(sorted(t.removeprefix("edgeflow.") for t in _rooms[_r])))


SERVICES = ("ota.py", "training.py", "telemetry.py", "inference.py", "health.py")


def _private_reads(path: Path, names: tuple[str, ...]) -> list[str]:
    """``x._y`` / ``self.x._y`` for x in ``names``: a read of another object's private state."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id in names) or (
                    isinstance(owner, ast.Attribute) and owner.attr in names):
                found.append(f"{path.name}:{node.lineno} .{node.attr}")
    return found


def _private_reads_of_the_agent(path: Path) -> list[str]:
    """``agent._x`` / ``a._x`` / ``self.agent._x`` in a device service: a read of the agent's private state."""
    return _private_reads(path, ("a", "agent"))


def test_the_device_services_use_only_the_agents_public_core(tmp_path):
    """The services of edgeflow/device receive the agent as an AgentCore (device/core.py) and read none of
    its private fields (they used to read about 40); the check itself catches a planted read."""
    reads = [r for name in SERVICES for r in _private_reads_of_the_agent(ROOT / "edgeflow" / "device" / name)]
    assert reads == []
    planted = tmp_path / "ota.py"
    planted.write_text("def f(self, a):\n    return a._model, self.agent._stop, a.model_version\n")
    assert _private_reads_of_the_agent(planted) == ["ota.py:2 ._model", "ota.py:2 ._stop"]


LINKS = (("mqtt", "netloop.py"), ("nats", "link.py"))


def test_the_transport_loops_use_only_their_owners_public_members(tmp_path):
    """The MQTT network loop and the NATS link hold their transport as ``self.t`` (an ``Owner`` Protocol) and
    call only its public members (``make_client``, ``notify_connection``, ``ssl_context``; they used to call
    ``_make_client``, ``_notify`` and ``_ssl_context``); the check itself catches a planted call."""
    reads = [r for pkg, name in LINKS
             for r in _private_reads(ROOT / "edgeflow" / "transport" / pkg / name, ("t", "owner"))]
    assert reads == []
    planted = tmp_path / "link.py"
    planted.write_text("def f(self, t):\n    self.t._notify(1)\n    return t._ssl_context(), t.name\n")
    assert _private_reads(planted, ("t", "owner")) == ["link.py:2 ._notify", "link.py:3 ._ssl_context"]
