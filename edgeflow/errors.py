"""One exception hierarchy for all of edgeflow.

Every error a user can hit derives from :class:`EdgeflowError`, so an
application can catch one type. Each message says what went wrong *and* what
to do about it; callers should never have to read a traceback to find the
file, field or op at fault.

The kernel library (``edgeflow.kernels``) is usable without the rest of
edgeflow and so defines its own small ``KernelError``; the runtime re-raises
those as :class:`UnsupportedOpError` / :class:`ShapeError` where it matters.
"""

from __future__ import annotations


class EdgeflowError(Exception):
    """Base class of every error edgeflow raises on purpose."""


class ProfileError(EdgeflowError, ValueError):
    """A device profile file is missing, malformed or has a bad field."""


class ModelError(EdgeflowError, ValueError):
    """An ONNX model cannot be loaded, checked or served."""


class UnsupportedOpError(ModelError):
    """The model uses ops that the chosen backend cannot run.

    ``ops`` lists every missing ``domain::OpType`` at once, so the user sees
    the whole problem on load rather than one op per failed run.
    """

    def __init__(self, message: str, ops: list[str] | None = None) -> None:
        super().__init__(message)
        self.ops = list(ops or [])


class InputError(EdgeflowError, ValueError):
    """Inputs given to a model or API are missing, misnamed or malformed."""


class ShapeError(InputError):
    """An array has the wrong shape or dtype for where it is used."""


class BackendError(EdgeflowError, RuntimeError):
    """A backend is unavailable or failed while running a model."""


class MemoryBudgetError(EdgeflowError, MemoryError):
    """Planned peak memory exceeds the device profile's budget."""

    def __init__(self, message: str, planned_bytes: int = 0, budget_bytes: int = 0) -> None:
        super().__init__(message)
        self.planned_bytes = planned_bytes
        self.budget_bytes = budget_bytes


class QuantizationError(EdgeflowError, ValueError):
    """A model or calibration set cannot be quantized as asked."""


class TrainingError(EdgeflowError, RuntimeError):
    """Training cannot start or had to stop (NaN loss, op without backward...)."""


class TransportError(EdgeflowError, ConnectionError):
    """The MQTT transport failed: connect, auth, publish, subscribe or timeout."""


class CodecError(EdgeflowError, ValueError):
    """An update envelope cannot be encoded or decoded (corrupt, unknown codec...)."""


class SignatureError(CodecError):
    """A signature is missing, wrong, or from an unknown key; or a replay."""


class AggregationError(EdgeflowError, RuntimeError):
    """A federated round cannot aggregate (no updates, mismatched tensors...)."""


class FleetError(EdgeflowError, RuntimeError):
    """A fleet operation failed (deployment, command, registry)."""


class ConfigError(EdgeflowError, ValueError):
    """A configuration file or command-line setting is invalid."""


class StateError(EdgeflowError, RuntimeError):
    """Durable state (the gateway's SQLite file) is damaged or inconsistent; the message says how to recover."""


class ResourceLimitError(EdgeflowError, RuntimeError):
    """An untrusted model or file goes past a limit: loop iterations or wall time of a run, node count or
    file size of a model, declared size of an array file. The message names the limit and how to raise it."""

    def __init__(self, message: str, limit: str = "") -> None:
        super().__init__(message)
        self.limit = limit


class StateInUseError(StateError):
    """Another gateway process holds the lease on this state (one gateway per state); the message
    names the holder (host, pid, since) and what to do."""


class ClientIdTakenError(TransportError):
    """The broker handed this client id's session to another connection (MQTT 5 DISCONNECT 0x8E,
    "session taken over") again and again: the same device (or gateway) runs twice."""
