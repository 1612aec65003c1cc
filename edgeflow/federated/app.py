"""Flower-style apps: ``--app FILE_OR_MODULE:client_fn`` loaded, called and adapted to edgeflow's client.

A Flower user's file keeps its shape::

    class FlowerClient:                      # or a subclass of Flower's / edgeflow's NumPyClient
        def get_parameters(self, config):    # -> list of np.ndarray
        def fit(self, parameters, config):   # parameters: list of np.ndarray -> (list, num_examples, metrics)
        def evaluate(self, parameters, config):  # -> (loss, num_examples, metrics)

    def client_fn(context):                  # context.node_id, context.node_config["partition-id"], ...
        return FlowerClient(...)

``edgeflow simulate --app client_app.py:client_fn`` and ``edgeflow device --app ...`` load it with
:func:`load_client_fn`, build each node's client with :func:`make_client` and wrap a list-shaped client in
:class:`ListClient`, which maps the list by position to the names the gateway's global model carries
(``p0``, ``p1``, ... when the first parameters came from a client's list; ordered naturally, so ``p10``
follows ``p9``). A client that subclasses :class:`edgeflow.NumPyClient` keeps name -> array dicts.
Every check names the tensor and fails at once, before anything is sent (docs/flower.md).
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError, EdgeflowError
from .numpy_client import Metrics, NumPyClient, Parameters

__all__ = ["Context", "ListClient", "load_client_fn", "load_reference", "make_client", "natural_order",
           "parse_config_text", "positional_names"]


@dataclass(frozen=True)
class Context:
    """What ``client_fn(context)`` gets, with Flower's names: ``node_id`` (an integer per node),
    ``node_config`` (``"partition-id"``, ``"num-partitions"``) and ``run_config`` (the run's settings)."""

    node_id: int
    node_config: Mapping[str, Any] = field(default_factory=dict)
    run_config: Mapping[str, Any] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)


def parse_config_text(text: str | None, flag: str) -> dict[str, Any]:
    """Flower's ``--node-config`` / ``--run-config`` text, ``'partition-id=0 num-partitions=2'``: space-separated
    KEY=VALUE, each value an integer, a number or text."""
    out: dict[str, Any] = {}
    for item in (text or "").split():
        k, sep, v = item.partition("=")
        if not sep or not k:
            example = "'partition-id=0 num-partitions=2'" if "node" in flag else "'local-epochs=2 lr=0.05'"
            raise ConfigError(f"{flag}: {item!r} is not KEY=VALUE; e.g. {flag} {example}")
        try:
            out[k] = int(v)
        except ValueError:
            try:
                out[k] = float(v)
            except ValueError:
                out[k] = v.strip("\"'")
    return out


def _import_file(path: Path, ref: str, what: str) -> Any:
    name = "edgeflow_app_" + re.sub(r"\W", "_", path.stem)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{what} {ref!r}: {path} is not a Python file; give FILE.py:NAME")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    folder = str(path.resolve().parent)
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)  # the user's file may import its neighbours (task.py in Flower's template)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # the user's module raising on import: one line, with where
        sys.modules.pop(name, None)
        raise ConfigError(f"{what} {ref!r}: importing {path} raised {type(exc).__name__}: {exc}") from exc
    return module


def _import_module(modname: str, ref: str, what: str) -> Any:
    try:
        return importlib.import_module(modname)
    except ModuleNotFoundError as exc:
        if exc.name and (modname == exc.name or modname.startswith(exc.name + ".")):
            raise ConfigError(f"{what} {ref!r}: no module named {exc.name!r}; give a file path (DIR/FILE.py:NAME) or "
                              "run from the folder that holds the module") from None
        raise ConfigError(f"{what} {ref!r}: importing {modname} failed: {exc} (pip install it)") from exc
    except Exception as exc:  # the user's module raising on import
        raise ConfigError(f"{what} {ref!r}: importing {modname} raised {type(exc).__name__}: {exc}") from exc


def load_reference(ref: str, what: str = "--app") -> Any:
    """The object ``ref`` names: ``path/to/file.py:NAME`` or ``package.module:NAME``. ``what`` names the
    setting in the one-line ConfigError (file missing, module not found, no such attribute)."""
    if not isinstance(ref, str) or ref.count(":") < 1:
        raise ConfigError(f"{what} {ref!r}: give FILE.py:NAME or module:NAME (e.g. client_app.py:client_fn)")
    target, _, attr = ref.rpartition(":")
    if not target or not attr.isidentifier():
        raise ConfigError(f"{what} {ref!r}: give FILE.py:NAME or module:NAME; {attr!r} is not a Python name")
    if target.endswith(".py") or "/" in target or "\\" in target:
        path = Path(target).expanduser()
        if not path.is_file():
            raise ConfigError(f"{what} {ref!r}: file {path} not found")
        module = _import_file(path, ref, what)
    else:
        module = _import_module(target, ref, what)
    if not hasattr(module, attr):
        names = sorted(n for n in vars(module) if not n.startswith("_"))[:8]
        raise ConfigError(f"{what} {ref!r}: {target} has no attribute {attr!r} (it has: {', '.join(names) or 'none'})")
    return getattr(module, attr)


def load_client_fn(ref: str) -> Callable[[Context], Any]:
    """The user's ``client_fn`` from ``FILE_OR_MODULE:NAME``, checked to be callable."""
    fn = load_reference(ref, "--app")
    if not callable(fn):
        raise ConfigError(f"--app {ref!r}: {ref.rpartition(':')[2]} is an object of type {type(fn).__name__}, not a "
                          "function; name "
                          "the function that returns your client (client_fn(context))")
    return fn


def make_client(client_fn: Callable[[Context], Any], context: Context, ref: str = "client_fn") -> NumPyClient:
    """``client_fn(context)`` as an edgeflow client: an :class:`edgeflow.NumPyClient` as it is, a Flower-shaped
    object (``fit`` and ``get_parameters`` on lists) wrapped in :class:`ListClient`."""
    try:
        client = client_fn(context)
    except Exception as exc:  # user code: one line naming it, the cause chained for -v
        raise ConfigError(f"--app {ref}: client_fn raised {type(exc).__name__}: {exc} "
                          f"(node {context.node_id}, partition-id {context.node_config.get('partition-id')})") from exc
    if isinstance(client, NumPyClient):
        return client
    missing = [m for m in ("get_parameters", "fit") if not callable(getattr(client, m, None))]
    if missing:
        raise ConfigError(f"--app {ref}: client_fn returned an object of type {type(client).__name__}, which has no "
                          f"{' and no '.join(missing)}; return a client with get_parameters(config), "
                          "fit(parameters, config) and evaluate(parameters, config) (Flower's NumPyClient shape; "
                          "drop Flower's .to_client())")
    return ListClient(client)


_DIGITS = re.compile(r"(\d+)")


def natural_order(names: Sequence[str]) -> list[str]:
    """Names in natural order (``p2`` before ``p10``): the positions a list-shaped client's arrays take."""
    return sorted(names, key=lambda n: [int(t) if t.isdigit() else t for t in _DIGITS.split(n)])


def positional_names(n: int) -> list[str]:
    """The names the gateway gives a list of ``n`` parameters: ``p0`` ... ``p{n-1}``."""
    return [f"p{i}" for i in range(n)]


def _as_float_array(value: Any, who: str, name: str) -> np.ndarray:
    try:
        arr = np.asarray(value)
    except Exception as exc:  # ragged lists and the like: named
        raise EdgeflowError(f"{who}: parameter {name} is not an array ({type(exc).__name__}: {exc})") from exc
    if arr.dtype.kind not in "fiu" or arr.dtype == object:
        raise EdgeflowError(f"{who}: parameter {name} has dtype {arr.dtype}; parameters are float arrays")
    return arr


def arrays_as_named(arrays: Any, names: Sequence[str] | None, who: str) -> Parameters:
    """A list of arrays (Flower) or a name -> array dict (edgeflow) as a dict; a list is mapped by position to
    ``names`` (``None``: :func:`positional_names`), its length checked first."""
    if isinstance(arrays, Mapping):
        return {str(k): _as_float_array(v, who, repr(k)) for k, v in arrays.items()}
    if isinstance(arrays, np.ndarray) or not isinstance(arrays, (list, tuple)):
        raise EdgeflowError(f"{who} returned parameters of type {type(arrays).__name__}; return a list of numpy "
                            "arrays (or a dict name -> array)")
    names = list(names) if names is not None else positional_names(len(arrays))
    if len(arrays) != len(names):
        raise EdgeflowError(f"{who} returned {len(arrays)} arrays, the model has {len(names)} "
                            f"({', '.join(names[:4])}{', ...' if len(names) > 4 else ''}); return one array per "
                            "parameter, in the order get_parameters gives them")
    return {n: _as_float_array(a, who, f"{i} ({n})") for i, (n, a) in enumerate(zip(names, arrays))}


class ListClient(NumPyClient):
    """A Flower-shaped client (parameters as lists) as an :class:`edgeflow.NumPyClient` (name -> array).

    The list's positions are the global model's names in :func:`natural_order`; ``fit``'s list is checked
    against them (length, then each array's shape by :func:`~edgeflow.federated.numpy_client.check_fit`)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = type(inner).__name__

    @property
    def evaluates(self) -> bool:
        return callable(getattr(self.inner, "evaluate", None))

    def get_parameters(self, config: Mapping[str, Any]) -> Parameters | None:
        try:
            arrays = self.inner.get_parameters(dict(config))
        except Exception as exc:  # user code: named
            raise EdgeflowError(f"{self.name}.get_parameters raised {type(exc).__name__}: {exc}") from exc
        if arrays is None:
            return None
        return arrays_as_named(arrays, None, f"{self.name}.get_parameters")

    def _list(self, parameters: Mapping[str, np.ndarray]) -> tuple[list[str], list[np.ndarray]]:
        names = natural_order(list(parameters))
        return names, [parameters[n] for n in names]

    def fit(self, parameters: Parameters, config: Mapping[str, Any]) -> tuple[Parameters, int, Metrics]:
        names, arrays = self._list(parameters)
        result = self.inner.fit(arrays, config)
        if not isinstance(result, tuple) or len(result) != 3:
            return result  # check_fit names the shape problem
        params, n, metrics = result
        return arrays_as_named(params, names, f"{self.name}.fit"), n, metrics

    def evaluate(self, parameters: Parameters, config: Mapping[str, Any]) -> tuple[float, int, Metrics]:
        if not self.evaluates:
            return super().evaluate(parameters, config)
        return self.inner.evaluate(self._list(parameters)[1], config)
