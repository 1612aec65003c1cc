"""No silent failures (issue 16, item 8): a broad ``except`` re-raises or logs why it goes on,
and a failed memory estimate is a logged gap in the plan, never a silent 0 bytes."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BROAD = {"Exception", "BaseException"}
LOG_CALLS = {"debug", "info", "warning", "warn", "error", "exception", "critical", "log"}


def _broad(t: ast.expr | None) -> bool:
    if t is None:  # a bare except
        return True
    if isinstance(t, ast.Name):
        return t.id in BROAD
    if isinstance(t, ast.Attribute):
        return t.attr in BROAD
    if isinstance(t, ast.Tuple):
        return any(_broad(e) for e in t.elts)
    return False


def _raises_or_logs(handler: ast.ExceptHandler) -> bool:
    for node in ast.walk(ast.Module(body=handler.body, type_ignores=[])):
        if isinstance(node, ast.Raise):
            return True
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in LOG_CALLS:
            return True
    return False


def silent_handlers(folder: Path) -> list[str]:
    """``path:line`` of every bare or broad except under ``folder`` whose body neither raises nor logs."""
    out = []
    for f in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(), filename=str(f))):
            if isinstance(node, ast.ExceptHandler) and _broad(node.type) and not _raises_or_logs(node):
                out.append(f"{f.relative_to(folder).as_posix()}:{node.lineno}")
    return out


def test_no_broad_except_in_the_tree_swallows_an_error():
    found = [f"{d}/{s}" for d in ("edgeflow", "kernels", "gateway") for s in silent_handlers(ROOT / d)]
    assert found == [], "broad except without a log line or a raise:\n" + "\n".join(found)


def test_the_scan_finds_planted_silent_handlers(tmp_path):
    (tmp_path / "m.py").write_text(
        "import logging\nlog = logging.getLogger()\n"
        "def a():\n    try:\n        f()\n    except Exception:\n        pass\n"                   # 6: silent
        "def b():\n    try:\n        f()\n    except:\n        return 0\n"                      # 11: bare, silent
        "def c():\n    try:\n        f()\n    except (ValueError, BaseException) as e:\n        x = e\n"  # 16
        "def d():\n    try:\n        f()\n    except Exception:\n        log.warning('why', exc_info=True)\n"
        "def e():\n    try:\n        f()\n    except Exception as exc:\n        raise RuntimeError('x') from exc\n"
        "def g():\n    try:\n        f()\n    except ValueError:\n        pass\n")                  # narrow: fine
    assert silent_handlers(tmp_path) == ["m.py:6", "m.py:11", "m.py:16"]


def _failing_workspace(monkeypatch, kernel) -> None:
    def broken(shapes, attrs):
        raise TypeError("unsupported operand type(s) for *: 'NoneType' and 'int'")

    monkeypatch.setattr(kernel, "workspace_fn", broken)


def test_a_failed_workspace_estimate_is_a_logged_gap_in_the_inference_plan(monkeypatch, caplog):
    from edgeflow import zoo
    from edgeflow.runtime.graph import compile_graph
    from edgeflow.runtime.memory import plan_memory

    graph = compile_graph(zoo.small_cnn())
    conv = next(n for n in graph.nodes if n.kernel.workspace_fn is not None)
    assert plan_memory(graph, 8).workspace_bytes > 0 and plan_memory(graph, 8).unknown == ()
    _failing_workspace(monkeypatch, conv.kernel)
    with caplog.at_level(logging.WARNING, logger="edgeflow.runtime.memory"):
        plan = plan_memory(graph, 8)
    gaps = [u for u in plan.unknown if u.startswith("workspace of")]
    assert gaps and all(g.startswith(f"workspace of {conv.op_type} node ") for g in gaps)
    assert "is not estimated (TypeError" in caplog.text


def test_a_failed_workspace_estimate_is_a_logged_gap_in_the_training_plan(monkeypatch, caplog):
    from edgeflow import zoo
    from edgeflow.train import Trainer

    tr = Trainer(zoo.small_cnn())
    good = tr.plan_memory(8)
    assert good.unknown == ()
    step = next(st for st in tr.tape.steps if st.kernel.workspace_fn is not None)
    _failing_workspace(monkeypatch, step.kernel)
    with caplog.at_level(logging.WARNING, logger="edgeflow.train"):
        plan = tr.plan_memory(8)
    assert any(u.startswith(f"workspace of {step.node.op_type} node ") for u in plan.unknown), plan.unknown
    assert "training memory plan: the workspace of" in caplog.text
