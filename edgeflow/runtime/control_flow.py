"""Running compiled nodes, and the subgraphs of control-flow nodes.

:func:`run_nodes` is the executor's loop — look up inputs, call the kernel,
store outputs, drop values whose last reader ran — shared by the numpy
backend (the top-level graph) and by every subgraph.

Control flow (If, Loop, Scan, SequenceMap) is wired at compile time
(:mod:`edgeflow.runtime.graph`):

- each graph attribute is compiled once, recursively, into a
  :class:`Subgraph` (bound kernels, its own schedule and lifetimes);
- the names a subgraph reads but does not define (*outer-scope* values,
  at any depth of nesting) become extra inputs of the control-flow node
  (``Node.outer_reads``), so lifetimes and the plain node loop see them as
  reads by that node — an outer value stays alive until every subgraph that
  reads it has run;
- the node's kernel is wrapped (:func:`bind_subgraphs`): per call it maps the
  extra inputs to their names and hands the kernel one callable per graph
  attribute, bound to those values. The kernels (``kernels/control_flow.py``)
  only call ``body(*inputs)``; they know nothing of scopes.

So the top-level loop has no control-flow branch at all: a control-flow node
is one more kernel call. A failure inside a subgraph is re-raised at each
level with the level's name, e.g.
``Loop 'decode' / body / If 'n12' / then_branch / node 'Add_3' (Add) failed ...``.
"""

from __future__ import annotations

import dataclasses
import operator
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import BackendError
from ..kernels import Kernel, KernelError
from .limits import current_budget

# What a kernel raises on bad data; the executor names the node and shapes.
KERNEL_ERRORS = (ValueError, IndexError, TypeError, FloatingPointError, ZeroDivisionError, KernelError)


def _describe(value: Any) -> Any:
    if isinstance(value, list):
        return f"sequence[{len(value)}]"
    return getattr(value, "shape", None)


def node_failure(node: Any, args: list, exc: BaseException) -> str:
    shapes = [None if a is None else _describe(a) for a in args]
    return f"node '{node.name}' ({node.op_type}) failed on input shapes {shapes}: {exc}"


def run_nodes(nodes: list, env: dict[str, Any]) -> dict[str, Any]:
    """Run ``nodes`` in order on ``env`` (updated in place; returned).

    Inside a limited run (:func:`edgeflow.runtime.limits.run_budget`, opened by
    ``Session.run``) the wall-time deadline is checked before each node."""
    budget = current_budget()
    deadline = budget.deadline if budget is not None else None
    for node in nodes:
        if deadline is not None and time.monotonic() > deadline:
            raise budget.time_error(f"node '{node.name}' ({node.op_type})")
        args = [env[x] if x else None for x in node.inputs]
        try:
            result = node.kernel.forward(*args, **node.attrs)
        except KERNEL_ERRORS as exc:
            raise BackendError(node_failure(node, args, exc)) from exc
        if isinstance(result, tuple):
            for name, value in zip(node.outputs, result):
                if name:
                    env[name] = value
        else:
            if node.fused_relu:
                np.maximum(result, 0, out=result)
            env[node.outputs[0]] = result
        for name in node.free_after:
            env.pop(name, None)
    return env


class Plan:
    """Compiled nodes as an execution plan: every value has a slot in a list.

    Built once (at load for the top-level graph, on the first run for a
    subgraph), it holds per node what :func:`run_nodes` looks up on every
    call: the kernel's bound ``forward``, its decoded attributes, the slots
    of its inputs and outputs, and the slots to clear after it (values whose
    last reader it is). Slot 0 is always None (an omitted optional input).
    Constants (initializers) sit in ``template``, which each run copies, so
    they are read when the plan is built, not on every run.
    """

    __slots__ = ("slots", "template", "steps", "nodes", "constants")

    def __init__(self, nodes: list, constants: dict[str, Any], names: tuple[str, ...] = ()) -> None:
        slots: dict[str, int] = {"": 0}

        def slot(name: str) -> int:
            i = slots.get(name)
            if i is None:
                i = slots[name] = len(slots)
            return i

        for name in names:  # fed values first: their slots are stable and known to the caller
            slot(name)
        for name in constants:
            slot(name)
        steps = []
        for node in nodes:
            ins = tuple(slot(x) for x in node.inputs)
            outs = tuple(slot(x) if x else -1 for x in node.outputs)
            frees = tuple(slot(x) for x in node.free_after)
            attrs = node.attrs or None
            steps.append((node.kernel.forward, _gather(ins), attrs, outs, outs[0] if outs else -1,
                          bool(node.fused_relu), frees, node))
        template: list[Any] = [None] * len(slots)
        for name, value in constants.items():
            template[slots[name]] = value
        self.slots = slots
        self.template = template
        self.steps = tuple(steps)
        self.nodes = nodes  # what it was built from (a subgraph rebuilds when the optimizer replaced them)
        self.constants = constants

    def run(self, vals: list[Any]) -> list[Any]:
        """Run every step on ``vals`` (a copy of ``template`` with the fed slots filled); returns it."""
        budget = current_budget()
        deadline = budget.deadline if budget is not None else None
        now = time.monotonic
        for forward, gather, attrs, outs, out0, relu, frees, node in self.steps:
            if deadline is not None and now() > deadline:
                raise budget.time_error(f"node '{node.name}' ({node.op_type})")
            args = gather(vals)
            try:
                result = forward(*args, **attrs) if attrs is not None else forward(*args)
            except KERNEL_ERRORS as exc:
                raise BackendError(node_failure(node, args, exc)) from exc
            if isinstance(result, tuple):
                for i, value in zip(outs, result):
                    if i > 0:
                        vals[i] = value
            else:
                if relu:
                    np.maximum(result, 0, out=result)
                vals[out0] = result
            for i in frees:
                vals[i] = None
        return vals


def _gather(ins: tuple[int, ...]):
    """``vals -> tuple(vals[i] for i in ins)`` as one C call (operator.itemgetter): a node's
    arguments without a Python-level comprehension per node per run."""
    if len(ins) >= 2:
        return operator.itemgetter(*ins)
    if len(ins) == 1:
        i = ins[0]
        return lambda vals: (vals[i],)
    return lambda vals: ()


@dataclass
class Subgraph:
    """A graph attribute compiled for the executor."""

    label: str  # this level of the error path, e.g. "If 'n12' / then_branch"
    nodes: list  # graph.Node, in schedule order, lifetimes assigned
    initializers: dict[str, np.ndarray]
    input_names: list[str]
    output_names: list[str]
    outer_names: tuple[str, ...]  # values it reads from enclosing graphs (any depth)
    output_info: list[tuple[Any, Any]] = field(default_factory=list)
    # (numpy dtype or None, shape tuple or None) per output: zero-trip scan outputs
    graph: Any = None  # the onnx.GraphProto (memory planning reads its value_info)
    _plan: Any = field(default=None, init=False, repr=False, compare=False)
    _input_slots: tuple = field(default=(), init=False, repr=False, compare=False)
    _outer_slots: tuple = field(default=(), init=False, repr=False, compare=False)
    _output_slots: tuple = field(default=(), init=False, repr=False, compare=False)

    def run(self, outer: dict[str, Any], *inputs: Any) -> list[Any]:
        if len(inputs) != len(self.input_names):
            raise BackendError(
                f"{self.label}: the subgraph declares {len(self.input_names)} input(s) but was given {len(inputs)}"
            )
        plan = self._plan
        if plan is None or plan.nodes is not self.nodes or plan.constants is not self.initializers:
            plan = self._build_plan()
        vals = plan.template.copy()
        # precedence as a scope: outer values, shadowed by the subgraph's initializers, then its inputs
        for name, i in self._outer_slots:
            vals[i] = outer[name]
        for i, value in zip(self._input_slots, inputs):
            vals[i] = value
        try:
            plan.run(vals)
        except BackendError as exc:
            raise BackendError(f"{self.label} / {exc}") from exc
        return [vals[i] for i in self._output_slots]

    def _build_plan(self) -> Plan:
        inits = self.initializers
        plan = Plan(self.nodes, inits, tuple(self.input_names) + tuple(self.outer_names))
        slots = plan.slots
        self._input_slots = tuple(slots[n] for n in self.input_names)
        self._outer_slots = tuple((n, slots[n]) for n in self.outer_names
                                  if n not in inits and n not in self.input_names)
        self._output_slots = tuple(slots[n] for n in self.output_names)  # each is defined (compile_graph)
        self._plan = plan
        return plan


ITERATING_OPS = frozenset({"Loop", "Scan", "SequenceMap"})
"""Control-flow ops that run their body once per iteration (counted against ``max_loop_iterations``)."""


class BoundSubgraph:
    """A subgraph bound to the outer-scope values of one control-flow call.

    ``iterates``: the body of a Loop, Scan or SequenceMap, whose every call
    counts against the run's ``max_loop_iterations`` (an If branch does not)."""

    __slots__ = ("sub", "outer", "iterates")

    def __init__(self, sub: Subgraph, outer: dict[str, Any], iterates: bool = False) -> None:
        self.sub = sub
        self.outer = outer
        self.iterates = iterates

    def __call__(self, *inputs: Any) -> list[Any]:
        if self.iterates:
            budget = current_budget()
            if budget is not None:
                budget.iteration(self.sub.label)
        return self.sub.run(self.outer, *inputs)

    @property
    def output_info(self) -> list[tuple[Any, Any]]:
        return self.sub.output_info


def bind_subgraphs(kernel: Kernel, n_explicit: int, subgraphs: dict[str, Subgraph],
                   outer_reads: tuple[str, ...]) -> Kernel:
    """A copy of ``kernel`` whose forward takes the node's inputs followed by
    the values of ``outer_reads`` and calls the original with one bound
    callable per graph attribute."""
    forward = kernel.forward
    items = tuple(subgraphs.items())
    iterates = kernel.op_type in ITERATING_OPS

    def run_control_flow(*args: Any, **attrs: Any) -> Any:
        outer = dict(zip(outer_reads, args[n_explicit:]))
        for name, sub in items:
            attrs[name] = BoundSubgraph(sub, outer, iterates)
        return forward(*args[:n_explicit], **attrs)

    return dataclasses.replace(kernel, forward=run_control_flow)


def check_arity(op: str, opset: int, inputs: list[str], outputs: list[str],
                subgraphs: dict[str, Subgraph], attrs: dict[str, Any]) -> str | None:
    """Why a control-flow node's subgraphs do not fit its inputs/outputs (None if they do)."""
    n_in, n_out = len(inputs), len(outputs)
    if op == "If":
        for name in ("then_branch", "else_branch"):
            sub = subgraphs.get(name)
            if sub is None:
                return f"If needs the graph attribute {name!r}"
            if len(sub.output_names) != n_out:
                return f"{name} returns {len(sub.output_names)} value(s) but the node has {n_out} output(s)"
    elif op == "Loop":
        body = subgraphs.get("body")
        if body is None:
            return "Loop needs the graph attribute 'body'"
        carried = n_in - 2
        if carried < 0:
            return "Loop needs inputs (M, cond, ...); write '' for an omitted one"
        if len(body.input_names) != 2 + carried:
            return (f"the body takes {len(body.input_names)} input(s); a Loop with {carried} carried value(s) "
                    f"gives it {2 + carried} (iteration, condition, carried...)")
        if len(body.output_names) < 1 + carried or len(body.output_names) - 1 != n_out:
            return (f"the body returns {len(body.output_names)} value(s); a Loop with {carried} carried value(s) "
                    f"and {n_out} output(s) needs {1 + n_out} (condition, carried..., scan outputs...)")
    elif op == "Scan":
        body = subgraphs.get("body")
        if body is None:
            return "Scan needs the graph attribute 'body'"
        m = int(attrs.get("num_scan_inputs", 0))
        states = (n_in - 1 if opset < 9 else n_in) - m
        if m <= 0 or states < 0:
            return f"num_scan_inputs={m} does not fit the node's {n_in} input(s)"
        if len(body.input_names) != states + m:
            return f"the body takes {len(body.input_names)} input(s) but the Scan gives it {states + m}"
        if len(body.output_names) != n_out or n_out < states:
            return f"the body returns {len(body.output_names)} value(s) but the node has {n_out} output(s)"
    elif op == "SequenceMap":
        body = subgraphs.get("body")
        if body is None:
            return "SequenceMap needs the graph attribute 'body'"
        if len(body.input_names) != n_in:
            return f"the body takes {len(body.input_names)} input(s) but the node has {n_in}"
        if len(body.output_names) != n_out:
            return f"the body returns {len(body.output_names)} value(s) but the node has {n_out} output(s)"
    return None
