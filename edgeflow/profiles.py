"""Device profiles: boards described as data (one TOML file per board).

A profile tells the runtime everything board-specific — architecture,
cores, the memory budget the runtime may use, CPU features, which execution
providers and backends to try (in order), how to quantize, how many threads,
whether the board trains — so that no code branches on board names.

Validation is strict: an unknown field, a missing required field or a bad
value is a :class:`~edgeflow.errors.ProfileError` naming the file and field.
"""

from __future__ import annotations

import os
import platform
import re
import sys
from dataclasses import asdict, dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from .errors import ProfileError

ARCHES = ("x86_64", "aarch64", "armv7l", "riscv64")
BACKENDS = ("ort", "numpy")
SCHEMES = ("int8", "fp16", "none")
ACTIVATION_TYPES = ("uint8", "int8")
WEIGHT_GRANULARITY = ("per-channel", "per-tensor")
FORMATS = ("qdq", "qoperator")

PROFILE_ENV = "EDGEFLOW_PROFILE"
"""``EDGEFLOW_PROFILE=raspberry-pi-4`` (or a .toml path): :func:`detect` returns that
profile outright. For emulated userlands (qemu hides the board) and for boards
whose model string no profile names."""
BOARD_MODEL_ENV = "EDGEFLOW_BOARD_MODEL"
"""``EDGEFLOW_BOARD_MODEL="Raspberry Pi 4 Model B Rev 1.4"``: stands in for the
device-tree model string (/proc/device-tree/model) that emulation does not have;
detection then matches it like the real one."""

PROFILE_NAME_RULE = "1-64 lowercase letters, digits, '_', '.' or '-', starting with a letter or digit (no '/', no '..')"
_PROFILE_NAME = re.compile(r"[a-z0-9][a-z0-9_.\-]{0,63}")


def check_profile_name(name: object, what: str = "profile") -> str:
    """``name`` if it is a valid profile name (:data:`PROFILE_NAME_RULE`), else one clear :class:`ProfileError`.

    The one check for every profile name that is not the operator's own path: the names devices claim in
    their births, the names an artifact is built for, and :func:`get_profile`'s names. A valid name is never
    a path, so looking it up can only find a built-in profile, never open a file.
    """
    if not isinstance(name, str) or not _PROFILE_NAME.fullmatch(name) or ".." in name:
        shown = repr(name[:80]) + ("..." if len(name) > 80 else "") if isinstance(name, str) else type(name).__name__
        raise ProfileError(f"{what} {shown} is not a valid profile name: use {PROFILE_NAME_RULE}, "
                           "e.g. 'raspberry-pi-4'")
    return name


_ARCH_ALIASES = {"amd64": "x86_64", "arm64": "aarch64", "armv7": "armv7l", "armv8l": "armv7l", "armhf": "armv7l"}


@dataclass(frozen=True)
class QuantizationScheme:
    """How a model is quantized for this board.

    int8 weights are always symmetric (zero point 0), per output channel by
    default; activations are asymmetric uint8 on x86 (VNNI's fast u8 x s8
    path) or int8 on Arm.
    """

    scheme: str = "int8"
    weights: str = "per-channel"
    activations: str = "uint8"
    format: str = "qdq"
    calibration: str = "minmax"


@dataclass(frozen=True)
class DeviceProfile:
    """One board. Memory is in MiB; ``threads`` <= ``cores``."""

    name: str
    description: str
    arch: str
    cores: int
    memory_mb: int
    memory_budget_mb: int
    threads: int
    backends: tuple[str, ...]
    execution_providers: tuple[str, ...] = ("CPUExecutionProvider",)
    cpu_features: tuple[str, ...] = ()
    can_train: bool = False
    train_memory_budget_mb: int = 0
    memory_arena: bool = True
    match: tuple[str, ...] = ()
    quantization: QuantizationScheme = field(default_factory=QuantizationScheme)
    source: str = ""
    # limits on untrusted models (docs/security.md, issue 31): per run, and per model at load
    max_loop_iterations: int = 1_000_000
    max_run_seconds: int = 60
    max_model_nodes: int = 100_000
    max_model_file_mb: int = 0  # 0: the board's memory_mb

    @property
    def memory_budget_bytes(self) -> int:
        return self.memory_budget_mb * 1024 * 1024

    @property
    def train_memory_budget_bytes(self) -> int:
        return (self.train_memory_budget_mb or self.memory_budget_mb) * 1024 * 1024

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("source", None)
        for k, v in list(d.items()):
            if isinstance(v, tuple):
                d[k] = list(v)
        return d


# name -> (python type(s), required)
_FIELDS: dict[str, tuple[tuple[type, ...], bool]] = {
    "name": ((str,), True),
    "description": ((str,), True),
    "arch": ((str,), True),
    "cores": ((int,), True),
    "memory_mb": ((int,), True),
    "memory_budget_mb": ((int,), True),
    "threads": ((int,), True),
    "backends": ((list,), True),
    "execution_providers": ((list,), False),
    "cpu_features": ((list,), False),
    "can_train": ((bool,), False),
    "train_memory_budget_mb": ((int,), False),
    "memory_arena": ((bool,), False),
    "match": ((list,), False),
    "quantization": ((dict,), False),
    "max_loop_iterations": ((int,), False),
    "max_run_seconds": ((int,), False),
    "max_model_nodes": ((int,), False),
    "max_model_file_mb": ((int,), False),
}
_Q_FIELDS = {f.name for f in fields(QuantizationScheme)}


def _fail(src: str, fld: str, msg: str) -> ProfileError:
    return ProfileError(f"{src}: field '{fld}': {msg}")


def profile_from_dict(data: dict[str, Any], source: str = "<dict>") -> DeviceProfile:
    """Validate a parsed profile; every error names the source and field."""
    _check_types(data, source)
    arch = _ARCH_ALIASES.get(data["arch"], data["arch"])
    _check_board(data, arch, source)
    q = dict(data.get("quantization", {}))
    _check_quantization(q, arch, source)
    return DeviceProfile(
        name=data["name"],
        description=data["description"],
        arch=arch,
        cores=data["cores"],
        memory_mb=data["memory_mb"],
        memory_budget_mb=data["memory_budget_mb"],
        threads=data["threads"],
        backends=tuple(data["backends"]),
        execution_providers=tuple(data.get("execution_providers", ("CPUExecutionProvider",))),
        cpu_features=tuple(data.get("cpu_features", ())),
        can_train=data.get("can_train", False),
        train_memory_budget_mb=data.get("train_memory_budget_mb", 0),
        memory_arena=data.get("memory_arena", True),
        match=tuple(data.get("match", ())),
        quantization=QuantizationScheme(**q),
        source=source,
        **{k: data[k] for k in ("max_loop_iterations", "max_run_seconds", "max_model_nodes", "max_model_file_mb")
           if k in data},
    )


def _check_types(data: dict[str, Any], source: str) -> None:
    """Known fields only, the required ones present, each of its type."""
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise _fail(source, unknown[0], f"unknown field (known fields: {', '.join(_FIELDS)})")
    for name, (types, required) in _FIELDS.items():
        if name not in data:
            if required:
                raise _fail(source, name, "required field is missing")
            continue
        v = data[name]
        # bool is an int subclass in Python: do not accept true for a count
        if (int in types and isinstance(v, bool)) or not isinstance(v, types):
            raise _fail(source, name, f"expected {types[0].__name__}, got {type(v).__name__} {v!r}")
        if types == (list,) and not all(isinstance(x, str) for x in v):
            raise _fail(source, name, "expected a list of strings")


def _check_board(data: dict[str, Any], arch: str, source: str) -> None:
    """The name, architecture, counts and budgets in range and consistent, and known backends."""
    if not _PROFILE_NAME.fullmatch(data["name"]) or ".." in data["name"]:
        raise _fail(source, "name", f"{data['name'][:80]!r} is not a valid profile name: use {PROFILE_NAME_RULE}")
    if arch not in ARCHES:
        raise _fail(source, "arch", f"{data['arch']!r} is not one of {', '.join(ARCHES)}")
    for k in ("cores", "memory_mb", "memory_budget_mb", "threads"):
        if data[k] < 1:
            raise _fail(source, k, f"must be >= 1, got {data[k]}")
    if data["threads"] > data["cores"]:
        raise _fail(source, "threads", f"{data['threads']} threads on a {data['cores']}-core board")
    if data["memory_budget_mb"] > data["memory_mb"]:
        raise _fail(source, "memory_budget_mb", f"{data['memory_budget_mb']} MiB exceeds the board's {data['memory_mb']} MiB")
    for k in ("max_loop_iterations", "max_run_seconds", "max_model_nodes"):
        if data.get(k, 1) < 1:
            raise _fail(source, k, f"must be >= 1, got {data[k]}")
    if data.get("max_model_file_mb", 0) < 0:
        raise _fail(source, "max_model_file_mb", "must be >= 0 (0: the board's memory_mb)")
    if data.get("train_memory_budget_mb", 0) < 0:
        raise _fail(source, "train_memory_budget_mb", "must be >= 0")
    if not data["backends"]:
        raise _fail(source, "backends", "list at least one backend")
    bad = [b for b in data["backends"] if b not in BACKENDS]
    if bad:
        raise _fail(source, "backends", f"unknown backend(s) {bad}; known: {', '.join(BACKENDS)}")


def _check_quantization(q: dict[str, Any], arch: str, source: str) -> None:
    """The [quantization] table: known fields, allowed values, no combination known to be slow."""
    unknown_q = sorted(set(q) - _Q_FIELDS)
    if unknown_q:
        raise _fail(source, f"quantization.{unknown_q[0]}", f"unknown field (known: {', '.join(sorted(_Q_FIELDS))})")
    for k, allowed in (
        ("scheme", SCHEMES), ("activations", ACTIVATION_TYPES),
        ("weights", WEIGHT_GRANULARITY), ("format", FORMATS),
        ("calibration", ("minmax", "percentile", "entropy")),
    ):
        if k in q and q[k] not in allowed:
            raise _fail(source, f"quantization.{k}", f"{q[k]!r} is not one of {', '.join(allowed)}")
    if arch == "x86_64" and q.get("format") == "qoperator" and q.get("activations") == "int8":
        raise _fail(
            source, "quantization.activations",
            "int8 activations in QOperator format are 20-30x slower than uint8 on x86 onnxruntime; use uint8",
        )


def load_profile_file(path: str | os.PathLike) -> DeviceProfile:
    p = Path(path)
    if not p.is_file():
        raise ProfileError(f"profile file not found: {p}")
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{p}: not valid TOML: {exc}") from exc
    prof = profile_from_dict(data, str(p))
    if prof.name != p.stem:
        raise _fail(str(p), "name", f"{prof.name!r} must match the file name {p.stem!r}")
    return prof


def _builtin_dir():
    return resources.files("edgeflow.device_profiles")


def builtin_profiles() -> dict[str, DeviceProfile]:
    """Every profile shipped with edgeflow, by name."""
    out: dict[str, DeviceProfile] = {}
    for entry in sorted(_builtin_dir().iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".toml"):
            with resources.as_file(entry) as path:
                prof = load_profile_file(path)
            out[prof.name] = prof
    return out


def list_profiles() -> list[str]:
    return sorted(builtin_profiles())


def builtin_profile(name: object, what: str = "device profile") -> DeviceProfile:
    """The built-in profile ``name``: checked with :func:`check_profile_name` first, never a path.

    For names that come from elsewhere (a device's birth, an artifact's manifest): an invalid or
    unknown name is a :class:`ProfileError` naming it, and no file is opened for it.
    """
    check_profile_name(name, what)
    profiles = builtin_profiles()
    if name not in profiles:
        raise ProfileError(f"unknown {what} {name!r}; built-in profiles: {', '.join(sorted(profiles))}")
    return profiles[name]  # type: ignore[index]


def get_profile(name_or_path: str | os.PathLike | DeviceProfile) -> DeviceProfile:
    """A built-in profile by name, or a profile TOML file by path (the operator's own argument).

    A path is a :class:`os.PathLike`, or a string ending in ``.toml`` or holding a path separator;
    anything else must be a valid profile name (:func:`check_profile_name`). Names another party
    supplied go through :func:`builtin_profile`, which never takes a path.
    """
    if isinstance(name_or_path, DeviceProfile):
        return name_or_path
    if isinstance(name_or_path, os.PathLike):
        return load_profile_file(name_or_path)
    s = str(name_or_path)
    if s.endswith(".toml") or "/" in s or os.sep in s:
        return load_profile_file(s)
    return builtin_profile(s)


@dataclass(frozen=True)
class HostFacts:
    arch: str
    cores: int
    memory_mb: int
    cpu_features: tuple[str, ...]
    board_model: str


def host_facts() -> HostFacts:
    """What this machine is, read from the OS (Linux /proc and device tree)."""
    arch = _ARCH_ALIASES.get(platform.machine().lower(), platform.machine().lower())
    cores = os.cpu_count() or 1
    mem = 0
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem = int(line.split()[1]) // 1024
                    break
    except OSError:
        pass
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key = line.split(":", 1)[0].strip().lower()
                if key in ("flags", "features", "isa"):
                    flags.update(line.split(":", 1)[1].split())
    except OSError:
        pass
    model = os.environ.get(BOARD_MODEL_ENV, "").strip()
    for path in () if model else ("/proc/device-tree/model", "/sys/firmware/devicetree/base/model"):
        try:
            model = Path(path).read_bytes().rstrip(b"\0").decode("utf-8", "replace")
            break
        except OSError:
            continue
    return HostFacts(arch, cores, mem, tuple(sorted(flags)), model)


def host_differs(profile: DeviceProfile, facts: HostFacts | None = None) -> str | None:
    """How this host differs from ``profile``'s board where it matters for speed (None: it does not).

    Timings taken here (the quantizer's bench gate) describe this host: another
    architecture, or missing CPU features the profile names (``avx512_vnni``,
    ``asimddp``...), run other kernels than the board does.
    """
    facts = facts or host_facts()
    flags = {f.lower() for f in facts.cpu_features}
    if facts.arch != profile.arch:
        return f"this host is {facts.arch}, the profile {profile.name!r} is {profile.arch}"
    missing = [f for f in profile.cpu_features if flags and f.lower() not in flags]
    if missing:
        return f"this host lacks {', '.join(missing)}, which the profile {profile.name!r} names"
    return None


VNNI_FEATURES = ("avx512_vnni", "avx_vnni", "amx_int8")
"""x86 features with which onnxruntime's u8 x s8 kernels sum products exactly (no int16 pair sums)."""


def saturates_where_board_does_not(profile: DeviceProfile, facts: HostFacts | None = None) -> bool:
    """True when this x86 host lacks VNNI but the x86 ``profile`` names it.

    onnxruntime's u8 x s8 kernels without VNNI (AVX2, AVX-512F) add pairs of
    products in int16, which saturates; with VNNI they do not. Outputs of an
    int8 model computed here then differ from the board's, unless onnxruntime's
    exact path (``session.x64quantprecision``) computes them.
    """
    facts = facts or host_facts()
    flags = {f.lower() for f in facts.cpu_features}
    wants = {f.lower() for f in profile.cpu_features} & set(VNNI_FEATURES)
    return (profile.arch == facts.arch == "x86_64" and bool(flags) and bool(wants)
            and not flags & set(VNNI_FEATURES))


def detect(facts: HostFacts | None = None) -> DeviceProfile:
    """The built-in profile closest to this host (see :func:`detect_with_reason`)."""
    return detect_with_reason(facts)[0]


def detect_with_reason(facts: HostFacts | None = None) -> tuple[DeviceProfile, str]:
    """The built-in profile closest to this host, and how it was chosen.

    With no ``facts``, ``EDGEFLOW_PROFILE`` (a profile name or .toml path) wins
    outright. Otherwise a device-tree model string (or ``EDGEFLOW_BOARD_MODEL``)
    that a profile's ``match`` list names wins; failing that, the profile of
    the same architecture that is closest in cores and memory and whose CPU
    features the host has.
    """
    if facts is None:
        forced = os.environ.get(PROFILE_ENV, "").strip()
        if forced:
            return get_profile(forced), f"{PROFILE_ENV}={forced}"
    facts = facts or host_facts()
    profiles = list(builtin_profiles().values())
    for p in profiles:
        if facts.board_model and any(m.lower() in facts.board_model.lower() for m in p.match):
            return p, f"board model {facts.board_model!r}"
    same_arch = [p for p in profiles if p.arch == facts.arch]
    if not same_arch:
        raise ProfileError(
            f"no built-in profile for architecture {facts.arch!r}; write one "
            "(see docs/profiles.md) and pass it with --profile path/to/board.toml"
        )
    host_flags = {f.lower() for f in facts.cpu_features}

    def score(p: DeviceProfile) -> tuple:
        missing = sum(1 for f in p.cpu_features if f.lower() not in host_flags) if host_flags else 0
        return (missing, abs(p.cores - facts.cores), abs(p.memory_mb - facts.memory_mb) if facts.memory_mb else 0)

    how = f"closest {facts.arch} profile to {facts.cores} cores, {facts.memory_mb} MiB"
    if not facts.board_model:
        how += f" (no device-tree model; set {PROFILE_ENV} or {BOARD_MODEL_ENV} to name the board)"
    return min(same_arch, key=score), how
