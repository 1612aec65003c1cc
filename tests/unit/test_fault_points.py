"""Fault points (edgeflow/faults.py) are the one deliberate crash hook in production code
(docs/architecture.md): they do nothing unless ``EDGEFLOW_FAULTS`` names them, and every point the
code marks is a documented one."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

from edgeflow.faults import EXIT_CODE, POINTS

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str, faults: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "EDGEFLOW_FAULTS"}
    if faults is not None:
        env["EDGEFLOW_FAULTS"] = faults
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)


_EVERY_POINT = ("from edgeflow.faults import POINTS, fault_point, _PLAN\n"
                "assert _PLAN == {}, _PLAN\n"
                "for name in POINTS:\n"
                "    for key in (None, 1, 2):\n"
                "        fault_point(name, key)\n"
                "print('alive')\n")


def test_without_the_variable_no_point_does_anything():
    r = _run(_EVERY_POINT, None)
    assert (r.returncode, r.stdout.strip()) == (0, "alive"), r.stderr
    r = _run(_EVERY_POINT, "")  # set but empty: the same
    assert (r.returncode, r.stdout.strip()) == (0, "alive"), r.stderr


def test_a_named_point_ends_the_process_at_its_nth_hit_for_its_key():
    code = ("from edgeflow.faults import fault_point\n"
            "for i in range(5):\n"
            "    fault_point('rounds.update_stored', i % 2)\n"
            "    print('hit', i, flush=True)\n")
    r = _run(code, "rounds.update_stored@1:2")  # the 2nd time with key 1: the 4th call (i = 3)
    assert r.returncode == EXIT_CODE
    assert r.stdout.split("\n")[:3] == ["hit 0", "hit 1", "hit 2"] and "hit 3" not in r.stdout
    assert "edgeflow fault point rounds.update_stored@1 reached: exiting" in r.stderr


def test_every_marked_point_is_a_documented_one():
    marked = set()
    for folder in ("edgeflow", "gateway"):
        for f in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(f.read_text(), filename=str(f))):
                if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "fault_point" and node.args):
                    arg = node.args[0]
                    if isinstance(arg, ast.Constant):
                        marked.add(arg.value)
                    elif isinstance(arg, ast.JoinedStr):  # f"ota.{step}": the OTA steps, one prefix
                        marked.add(str(arg.values[0].value) + "*")  # type: ignore[attr-defined]
    literal = {m for m in marked if not m.endswith("*")}
    assert literal and literal <= set(POINTS), literal - set(POINTS)
    for prefix in (m[:-1] for m in marked if m.endswith("*")):
        assert any(p.startswith(prefix) for p in POINTS), prefix
