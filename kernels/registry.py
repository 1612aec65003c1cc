"""The kernel registry: op name (+ domain, opset version, dtype) -> kernel.

A kernel is a pure function of numpy arrays, in the style of ONNX's
reference ops: inputs arrive positionally (``None`` for an omitted optional
input), attributes as keyword arguments with the ONNX defaults written as
Python defaults. It returns one array or a tuple of arrays (one per output).

The backward of a trainable op is registered right beside its forward (as in
micrograd's ``_backward``)::

    @register("Relu")
    def relu(x):
        return np.maximum(x, 0).astype(x.dtype, copy=False)

    @relu.backward
    def _(grads, inputs, outputs, **attrs):
        (dy,), (x,) = grads, inputs
        return (dy * (x > 0),)

``backward(grads, inputs, outputs, **attrs)`` receives one gradient per
forward output (``None`` where the output is unused) and returns one
gradient per forward input (``None`` where it is not differentiable).

Three optional extras serve the trainer (``edgeflow.train``), all additive:

- ``@kernel.backward(uses="outputs")`` says which forward values the
  backward reads (``"inputs"``, ``"outputs"``, ``"all"`` — the default — or
  ``"none"``), so the trainer keeps only those alive until the backward pass
  (values it does not keep arrive as ``None``).
- A backward that declares the keyword ``needs_grad`` receives a tuple of
  booleans, one per input, and may skip the gradients nobody wants (the
  first layer's input gradient is a quarter of an MLP's backward cost).
- ``@kernel.saving`` registers a training forward ``fn(*inputs, **attrs) ->
  (outputs, saved)`` that also returns something the backward would
  otherwise recompute (Conv's im2col columns, MaxPool's argmax); the
  backward then receives it as the keyword ``saved`` (``None`` when the
  plain forward ran, so the backward must be able to recompute).

Several kernels may be registered under one op name: one per opset version
range (``since``) — the lookup takes the highest ``since`` that is <= the
model's opset, like onnx.reference's ``load_op`` — and per input dtype
(``dtypes``, the dtype of the first input; int8 variants register their own
dtypes).

This module imports only numpy: the kernel library is usable on its own.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import numpy as np

FLOAT_TYPES: frozenset[str] = frozenset({"float16", "float32", "float64"})
INT_TYPES: frozenset[str] = frozenset(
    {"int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64"}
)
NUMERIC_TYPES: frozenset[str] = FLOAT_TYPES | INT_TYPES
ANY_TYPE: frozenset[str] = frozenset({"*"})


class KernelError(Exception):
    """Base error of the kernel library (it cannot depend on edgeflow.errors)."""


class UnknownOpError(KernelError, KeyError):
    """No kernel is registered for an op, opset version or dtype."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


BackwardFn = Callable[..., tuple]


@dataclass
class Kernel:
    """One registered implementation of an ONNX op."""

    op_type: str
    forward: Callable[..., Any]
    domain: str = ""
    since: int = 1
    dtypes: frozenset[str] = FLOAT_TYPES
    backward_fn: BackwardFn | None = None
    attributes: tuple[str, ...] = field(default=())
    # Attribute names accepted by ``forward`` (keyword parameters); a model
    # attribute outside this set is an error found at load time.
    wants_n_outputs: bool = False
    workspace_fn: Callable[[list, dict], int] | None = None
    # Optional: bytes of scratch memory one call needs, from the input shapes
    # and attributes (e.g. Conv's im2col buffer); used by memory planning.
    backward_uses: str = "all"
    # Which forward values the backward reads: "inputs", "outputs", "all", "none".
    backward_wants_needs: bool = False
    # The backward declares ``needs_grad`` (tuple of bools, one per input).
    forward_train: Callable[..., tuple[Any, Any]] | None = None
    # Optional training forward returning (outputs, saved) for the backward.

    def __call__(self, *inputs: Any, **attrs: Any) -> Any:
        return self.forward(*inputs, **attrs)

    def backward(self, fn: BackwardFn | None = None, *, uses: str = "all"):
        """Decorator: register ``fn`` as this kernel's backward.

        Used bare (``@k.backward``) or with ``uses=`` naming the forward
        values the backward reads (``@k.backward(uses="outputs")``).
        """
        if uses not in _USES:
            raise KernelError(f"backward uses={uses!r}: expected one of {', '.join(_USES)}")

        def deco(f: BackwardFn) -> BackwardFn:
            self.backward_fn = f
            self.backward_uses = uses
            self.backward_wants_needs = "needs_grad" in inspect.signature(f).parameters
            return f

        return deco(fn) if fn is not None else deco

    def saving(self, fn: Callable[..., tuple[Any, Any]]) -> Callable[..., tuple[Any, Any]]:
        """Decorator: register a training forward returning ``(outputs, saved)``."""
        self.forward_train = fn
        return fn

    def workspace(self, fn: Callable[[list, dict], int]) -> Callable[[list, dict], int]:
        """Decorator: register ``fn(input_shapes, attrs) -> bytes`` of scratch memory."""
        self.workspace_fn = fn
        return fn

    @property
    def trainable(self) -> bool:
        return self.backward_fn is not None

    def accepts(self, dtype: np.dtype | str | None) -> bool:
        if dtype is None or "*" in self.dtypes:
            return True
        return np.dtype(dtype).name in self.dtypes


_USES = ("all", "inputs", "outputs", "none")

_REGISTRY: dict[tuple[str, str], list[Kernel]] = {}


def _keyword_params(fn: Callable[..., Any]) -> tuple[str, ...]:
    # Convention: inputs are positional (optional ones default to None),
    # attributes are keyword-only (after ``*``).
    sig = inspect.signature(fn)
    # ``n_outputs`` is reserved: the executor passes how many outputs the node
    # uses, so a kernel can skip work on optional outputs nobody reads.
    return tuple(
        name
        for name, p in sig.parameters.items()
        if p.kind == p.KEYWORD_ONLY and name != "n_outputs"
    )


def register(
    op_type: str,
    *,
    domain: str = "",
    since: int = 1,
    dtypes: Iterable[str] = FLOAT_TYPES,
) -> Callable[[Callable[..., Any]], Kernel]:
    """Decorator registering a forward function as the kernel of ``op_type``.

    Returns the :class:`Kernel` so that ``@kernel.backward`` can follow.
    """

    def deco(fn: Callable[..., Any]) -> Kernel:
        k = Kernel(
            op_type=op_type,
            forward=fn,
            domain=domain,
            since=since,
            dtypes=frozenset(dtypes),
            attributes=_keyword_params(fn),
            wants_n_outputs="n_outputs" in inspect.signature(fn).parameters,
        )
        lst = _REGISTRY.setdefault((domain, op_type), [])
        for other in lst:
            if other.since == since and other.dtypes & k.dtypes:
                raise KernelError(
                    f"kernel {domain or 'ai.onnx'}::{op_type} since opset {since} "
                    f"registered twice for dtypes {sorted(other.dtypes & k.dtypes)}"
                )
        lst.append(k)
        lst.sort(key=lambda x: x.since)
        return k

    return deco


def _domain_name(domain: str) -> str:
    return domain or "ai.onnx"


def get_kernel(
    op_type: str,
    domain: str = "",
    opset: int | None = None,
    dtype: np.dtype | str | None = None,
) -> Kernel:
    """Find the kernel for ``op_type`` at ``opset`` accepting ``dtype``.

    The error names what exists, so a user can tell "op unknown" from
    "op known, but not at this opset / for this dtype".
    """
    lst = _REGISTRY.get((domain, op_type))
    if not lst:
        raise UnknownOpError(
            f"no kernel for op {_domain_name(domain)}::{op_type}; "
            f"the numpy kernel library has {len(_REGISTRY)} ops "
            f"(see edgeflow.kernels.supported_ops())"
        )
    candidates = [k for k in lst if opset is None or k.since <= opset]
    if not candidates:
        raise UnknownOpError(
            f"op {_domain_name(domain)}::{op_type} is implemented from opset "
            f"{lst[0].since}, but the model uses opset {opset}"
        )
    best_since = max(k.since for k in candidates)
    for k in reversed(candidates):
        if k.since == best_since and k.accepts(dtype):
            return k
    have = sorted({t for k in candidates if k.since == best_since for t in k.dtypes})
    raise UnknownOpError(
        f"op {_domain_name(domain)}::{op_type} (opset {opset}) has no kernel for "
        f"dtype {np.dtype(dtype).name}; implemented for: {', '.join(have)}"
    )


def has_kernel(op_type: str, domain: str = "", opset: int | None = None) -> bool:
    try:
        get_kernel(op_type, domain, opset)
    except UnknownOpError:
        return False
    return True


def supported_ops(domain: str | None = None) -> list[str]:
    """Sorted op names with at least one kernel (optionally in one domain)."""
    return sorted(op for (d, op) in _REGISTRY if domain is None or d == domain)


def kernels_for(op_type: str, domain: str = "") -> list[Kernel]:
    """Every kernel registered under an op name (all opsets and dtypes)."""
    return list(_REGISTRY.get((domain, op_type), []))
