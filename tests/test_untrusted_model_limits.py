"""Issue 31 (runtime side): limits on untrusted models and array files, each tested with the hostile input itself.

1. a Loop with trip count 2**62 stops at the profile's loop-iteration / wall-time limit: public API (numpy and
   onnxruntime), ``edgeflow run``, ``edgeflow bench``, the golden run of ``fleet deploy`` and the health check;
2. a zip bomb and a .npy header declaring 10**12 elements are refused before anything is inflated or allocated;
3. a model past the node-count or file-size limit is refused before any per-node work / before parsing;
4. a model that allocates past the memory budget at run time fails the health check, the caller lives on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
import tracemalloc
import zipfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h

from edgeflow.artifact import make_golden
from edgeflow.data.loaders import read_arrays
from edgeflow.device.health import check_model
from edgeflow.errors import InputError, ResourceLimitError
from edgeflow.profiles import get_profile
from edgeflow.runtime.model import load_model
from edgeflow.runtime.session import load

from _cli import one_clear_line

BASE = "raspberry-pi-4"  # 1024 MiB budget, backends ort then numpy
REPO = Path(__file__).resolve().parents[1]

try:
    import onnxruntime  # noqa: F401
    HAVE_ORT = True
except ImportError:  # pragma: no cover - the numpy-only boards
    HAVE_ORT = False
needs_ort = pytest.mark.skipif(not HAVE_ORT, reason="onnxruntime is not installed")


# ----------------------------------------------------------------- hostile inputs


def loop_model(trip: int = 2**62) -> onnx.ModelProto:
    """``for i in range(trip): v += 1`` with a body that never says stop: 2**62 iterations."""
    body = h.make_graph(
        [h.make_node("Identity", ["cond_in"], ["cond_out"]), h.make_node("Add", ["v_in", "one"], ["v_out"])],
        "body",
        [h.make_tensor_value_info("i", T.INT64, []), h.make_tensor_value_info("cond_in", T.BOOL, []),
         h.make_tensor_value_info("v_in", T.FLOAT, [1])],
        [h.make_tensor_value_info("cond_out", T.BOOL, []), h.make_tensor_value_info("v_out", T.FLOAT, [1])],
        [h.make_tensor("one", T.FLOAT, [1], [1.0])])
    g = h.make_graph([h.make_node("Loop", ["M", "c", "x"], ["y"], body=body)], "hostile_loop",
                     [h.make_tensor_value_info("x", T.FLOAT, [1])], [h.make_tensor_value_info("y", T.FLOAT, [1])],
                     [h.make_tensor("M", T.INT64, [], [trip]), h.make_tensor("c", T.BOOL, [], [True])])
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    onnx.checker.check_model(m)
    return m


def chain_model(n: int, *, in_loop_body: bool = False) -> onnx.ModelProto:
    """``n`` Identity nodes in a row (in the main graph, or in a Loop body that runs once)."""
    def chain(src: str, dst: str, prefix: str) -> list:
        names = [src] + [f"{prefix}{i}" for i in range(n - 1)] + [dst]
        return [h.make_node("Identity", [a], [b]) for a, b in zip(names, names[1:])]

    x, y = h.make_tensor_value_info("x", T.FLOAT, [1]), h.make_tensor_value_info("y", T.FLOAT, [1])
    if not in_loop_body:
        return h.make_model(h.make_graph(chain("x", "y", "t"), "chain", [x], [y]),
                            opset_imports=[h.make_opsetid("", 17)])
    body = h.make_graph(
        [h.make_node("Identity", ["ci"], ["co"])] + chain("v", "w", "b"), "body",
        [h.make_tensor_value_info("i", T.INT64, []), h.make_tensor_value_info("ci", T.BOOL, []),
         h.make_tensor_value_info("v", T.FLOAT, [1])],
        [h.make_tensor_value_info("co", T.BOOL, []), h.make_tensor_value_info("w", T.FLOAT, [1])])
    g = h.make_graph([h.make_node("Loop", ["M", "", "x"], ["y"], body=body)], "loop_chain", [x], [y],
                     [h.make_tensor("M", T.INT64, [], [1])])
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])


def alloc_model(elements: int = 400_000_000) -> onnx.ModelProto:
    """A 1-element input grows to ``elements`` float32 (1.6 GB) at run time: the shape is computed from the
    input's value, so the static memory plan cannot size it."""
    nodes = [h.make_node("Mul", ["x", "zero"], ["x0"]), h.make_node("Add", ["x0", "n"], ["xn"]),
             h.make_node("Cast", ["xn"], ["shape"], to=T.INT64),
             h.make_node("ConstantOfShape", ["shape"], ["big"], value=h.make_tensor("v", T.FLOAT, [1], [1.0])),
             h.make_node("ReduceSum", ["big"], ["y"], keepdims=1)]
    g = h.make_graph(nodes, "grow", [h.make_tensor_value_info("x", T.FLOAT, [1])],
                     [h.make_tensor_value_info("y", T.FLOAT, [1])],
                     [h.make_tensor("zero", T.FLOAT, [], [0.0]), h.make_tensor("n", T.FLOAT, [], [float(elements)])])
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])


def profile_toml(tmp_path: Path, name: str, **limits: int) -> Path:
    """The base board's profile with these limit keys (top-level keys go before the [quantization] table)."""
    text = (REPO / "device_profiles" / f"{BASE}.toml").read_text(encoding="utf-8")
    text = text.replace(f'name = "{BASE}"', f'name = "{name}"', 1)
    text = "".join(line for line in text.splitlines(keepends=True) if line.split("=")[0].strip() not in limits)
    keys = "".join(f"{k} = {v}\n" for k, v in limits.items())
    text = text.replace("[quantization]", keys + "\n[quantization]", 1)
    p = tmp_path / f"{name}.toml"
    p.write_text(text, encoding="utf-8")
    return p


@contextlib.contextmanager
def must_finish_within(seconds: int):
    """Fail (instead of hanging the suite) when a pure-Python run does not stop: SIGALRM interrupts it."""
    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds} s: the run is not bounded")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def edgeflow(*args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    """The CLI in a child process; a run that does not stop fails the test at ``timeout``."""
    env = dict(os.environ, COLUMNS="200")
    return subprocess.run([sys.executable, "-m", "edgeflow", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


X = np.zeros(1, np.float32)


# ----------------------------------------------------------------- 1. loops and wall time


def test_loop_2_62_stops_at_the_default_iteration_limit_numpy() -> None:
    rt = load(loop_model(), BASE, backend="numpy")
    t0 = time.monotonic()
    with must_finish_within(120), pytest.raises(ResourceLimitError) as err:
        rt.run(X)
    msg = str(err.value)
    assert "1,000,000 loop iterations" in msg and "max_loop_iterations" in msg and f"'{BASE}'" in msg, msg
    assert "\n" not in msg and err.value.limit == "max_loop_iterations"
    assert time.monotonic() - t0 < 60


def test_loop_limit_comes_from_the_profile_and_counts_nested_loops(tmp_path) -> None:
    prof = profile_toml(tmp_path, "tight-loops", max_loop_iterations=5000)
    rt = load(loop_model(), str(prof), backend="numpy")
    with must_finish_within(60), pytest.raises(ResourceLimitError, match=r"5,000 loop iterations.*tight-loops"):
        rt.run(X)
    ok = load(loop_model(4000), str(prof), backend="numpy")  # a bounded loop under the limit still runs
    assert ok.run(X)["y"][0] == 4000.0
    assert ok.run(X)["y"][0] == 4000.0  # the count is per run, not per session


def test_wall_time_limit_between_nodes_numpy(tmp_path) -> None:
    prof = profile_toml(tmp_path, "tight-time", max_run_seconds=1, max_loop_iterations=10**9)
    rt = load(loop_model(), str(prof), backend="numpy")
    t0 = time.monotonic()
    with must_finish_within(60), pytest.raises(ResourceLimitError, match="longer than 1 s.*max_run_seconds"):
        rt.run(X)
    assert time.monotonic() - t0 < 15


@needs_ort
def test_wall_time_limit_stops_onnxruntime_api(tmp_path) -> None:
    # onnxruntime loops in C++, where no alarm reaches: a child process with a timeout stands for the hang
    prof = profile_toml(tmp_path, "ort-time", max_run_seconds=1)
    code = ("import numpy as np, onnx, time, sys\n"
            "from edgeflow.runtime.session import load\nfrom edgeflow.errors import ResourceLimitError\n"
            f"rt = load(onnx.load(sys.argv[1]), sys.argv[2], backend='ort')\nt0 = time.monotonic()\n"
            "try:\n    rt.run(np.zeros(1, np.float32))\nexcept ResourceLimitError as e:\n"
            "    print('STOPPED', round(time.monotonic() - t0, 1), e.limit)\n")
    model = tmp_path / "loop.onnx"
    onnx.save(loop_model(), model)
    out = subprocess.run([sys.executable, "-c", code, str(model), str(prof)], capture_output=True, text=True,
                         timeout=60, cwd=REPO)
    assert "STOPPED" in out.stdout and "max_run_seconds" in out.stdout, (out.stdout, out.stderr)
    assert float(out.stdout.split()[1]) < 10
    assert "onnxruntime" not in out.stderr.lower(), out.stderr  # no second report in onnxruntime's own log


@pytest.mark.parametrize("backend", ["numpy", pytest.param("ort", marks=needs_ort)])
def test_edgeflow_run_cli_refuses_the_hostile_loop_in_one_line(tmp_path, backend) -> None:
    model = tmp_path / "loop.onnx"
    onnx.save(loop_model(), model)
    np.save(tmp_path / "x.npy", X)
    prof = profile_toml(tmp_path, "cli-limits", max_loop_iterations=20_000, max_run_seconds=2)
    t0 = time.monotonic()
    out = edgeflow("run", str(model), "-i", str(tmp_path / "x.npy"), "--profile", str(prof), "--backend", backend)
    line = one_clear_line(out, "edgeflow run: error:", "in the profile")
    assert "internal error" not in line
    assert ("max_loop_iterations" if backend == "numpy" else "max_run_seconds") in line
    assert time.monotonic() - t0 < 60


@needs_ort
def test_edgeflow_bench_cli_stops_the_hostile_loop(tmp_path) -> None:
    model = tmp_path / "loop.onnx"
    onnx.save(loop_model(), model)
    prof = profile_toml(tmp_path, "bench-limits", max_run_seconds=1)
    out = edgeflow("bench", str(model), "--profile", str(prof), "--runs", "3", "--warmup", "1")
    one_clear_line(out, "edgeflow bench: error:", "max_run_seconds")


def test_fleet_deploy_golden_run_stops_the_hostile_loop(tmp_path) -> None:
    prof = profile_toml(tmp_path, "golden-limits", max_run_seconds=1, max_loop_iterations=20_000)
    with must_finish_within(60), pytest.raises(ResourceLimitError):
        make_golden(loop_model().SerializeToString(), str(prof), X, backend="numpy")


@pytest.mark.parametrize("backend", ["numpy", pytest.param("ort", marks=needs_ort)])
def test_health_check_fails_the_hostile_loop_and_returns(tmp_path, backend) -> None:
    prof = get_profile(profile_toml(tmp_path, "health-limits", max_run_seconds=1, max_loop_iterations=20_000))
    t0 = time.monotonic()
    with must_finish_within(120):
        rep = check_model(loop_model().SerializeToString(), prof, None, backend=backend, runs=1)
    assert not rep.ok and rep.stage == "golden", rep
    assert "max_loop_iterations" in rep.reason or "max_run_seconds" in rep.reason, rep.reason
    assert time.monotonic() - t0 < 60


# ----------------------------------------------------------------- 2. zip bombs and forged .npy headers


def _npy_header(shape: tuple[int, ...], descr: str = "<f4") -> bytes:
    import io

    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": descr, "fortran_order": False, "shape": shape})
    return buf.getvalue()


def _zip_bomb(path: Path, gib: float = 1.0) -> None:
    """One .npz entry of ``gib`` GiB of float32 zeros, deflated to about a thousandth; written streaming."""
    n = int(gib * 2**30) // 4
    chunk = bytes(2**20)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=1) as z:
        with z.open("x.npy", "w", force_zip64=True) as f:
            f.write(_npy_header((n,)))
            for _ in range(n * 4 // len(chunk)):
                f.write(chunk)


@pytest.fixture(scope="module")
def zip_bomb(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("bomb") / "bomb.npz"
    _zip_bomb(p)
    assert p.stat().st_size < 8 * 2**20  # 1 GiB of data in a few MiB
    return p


def _peak_while(fn) -> tuple[Exception | None, int]:
    tracemalloc.start()
    try:
        fn()
        err = None
    except Exception as exc:  # noqa: BLE001 - returned for the assertions
        err = exc
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return err, peak


def test_zip_bomb_is_refused_before_inflating(zip_bomb) -> None:
    err, peak = _peak_while(lambda: read_arrays(zip_bomb))
    assert isinstance(err, InputError), repr(err)
    msg = str(err)
    assert "zip bomb" in msg and "'x.npy'" in msg and "\n" not in msg, msg
    assert peak < 32 * 2**20, f"peak {peak / 2**20:.0f} MiB while refusing"


def test_npy_header_declaring_10_12_elements_is_refused_before_allocating(tmp_path) -> None:
    p = tmp_path / "huge.npy"
    p.write_bytes(_npy_header((10**12,)) + bytes(64))
    err, peak = _peak_while(lambda: read_arrays(p))
    assert isinstance(err, InputError), repr(err)
    assert "(1000000000000,)" in str(err) and "\n" not in str(err), str(err)
    assert peak < 8 * 2**20


def test_npz_entry_header_larger_than_the_entry_and_object_dtype_are_refused(tmp_path) -> None:
    lying = tmp_path / "lying.npz"
    with zipfile.ZipFile(lying, "w") as z:  # stored: the header claims 4 GB, the entry holds 16 bytes
        z.writestr("x.npy", _npy_header((2**30,)) + bytes(16))
    err, peak = _peak_while(lambda: read_arrays(lying))
    assert isinstance(err, InputError) and "truncated or forged" in str(err), repr(err)
    assert peak < 8 * 2**20
    objs = tmp_path / "objs.npy"
    objs.write_bytes(_npy_header((3,), "|O") + bytes(24))
    with pytest.raises(InputError, match="Python objects"):
        read_arrays(objs)


def test_plain_and_compressed_npz_still_load(tmp_path) -> None:
    np.savez(tmp_path / "a.npz", x=np.ones((3, 4), np.float32), y=np.arange(3))
    np.savez_compressed(tmp_path / "b.npz", x=np.zeros((1000, 1000)))  # 8 MB of zeros: under the ratio floor
    np.save(tmp_path / "c.npy", np.arange(5))
    assert read_arrays(tmp_path / "a.npz")["x"].shape == (3, 4)
    assert read_arrays(tmp_path / "b.npz")["x"].shape == (1000, 1000)
    assert read_arrays(tmp_path / "c.npy").tolist() == [0, 1, 2, 3, 4]


def test_edgeflow_run_cli_refuses_hostile_array_files_in_one_line(tmp_path, zip_bomb) -> None:
    model = tmp_path / "id.onnx"
    onnx.save(chain_model(1), model)
    huge = tmp_path / "huge.npy"
    huge.write_bytes(_npy_header((10**12,)) + bytes(64))
    for bad, needle in ((huge, "(1000000000000,)"), (zip_bomb, "zip bomb")):
        out = edgeflow("run", str(model), "-i", str(bad), "--profile", BASE, "--backend", "numpy")
        line = one_clear_line(out, "edgeflow run: error:", needle)
        assert "internal error" not in line


# ----------------------------------------------------------------- 3. node count and file size


def test_node_count_over_the_profile_limit_is_refused_before_any_per_node_work(tmp_path, monkeypatch) -> None:
    prof = profile_toml(tmp_path, "few-nodes", max_model_nodes=1000)
    checked = []
    monkeypatch.setattr(onnx.checker, "check_model", lambda *a, **k: checked.append(1))
    for m in (chain_model(3000), chain_model(3000, in_loop_body=True)):
        with pytest.raises(ResourceLimitError) as err:
            load(m, str(prof), backend="numpy")
        assert "max_model_nodes" in str(err.value) and "1,000" in str(err.value) and "few-nodes" in str(err.value)
    assert not checked  # refused before onnx.checker, shape inference or compiling
    load(chain_model(900), str(prof), backend="numpy")  # under the limit: fine (the checker stub ran)
    assert checked


def test_default_node_limit_refuses_a_100k_node_model_in_inspect(tmp_path) -> None:
    model = tmp_path / "wide.onnx"
    onnx.save(chain_model(100_001), model)
    t0 = time.monotonic()
    with pytest.raises(ResourceLimitError, match="100,001 nodes"):
        load_model(model)
    assert time.monotonic() - t0 < 10
    out = edgeflow("inspect", str(model))
    one_clear_line(out, "edgeflow inspect: error:", "max_model_nodes")


def test_model_file_over_the_size_limit_is_refused_before_parsing(tmp_path, monkeypatch) -> None:
    prof = profile_toml(tmp_path, "small-files", max_model_file_mb=1)
    m = chain_model(1)
    m.graph.initializer.append(onnx.numpy_helper.from_array(np.zeros(600_000, np.float32), "pad"))
    path = tmp_path / "big.onnx"
    onnx.save(m, path)
    assert path.stat().st_size > 2**20
    parsed = []
    real_load = onnx.load
    monkeypatch.setattr(onnx, "load", lambda *a, **k: parsed.append(1) or real_load(*a, **k))
    with pytest.raises(ResourceLimitError, match=r"big.onnx is 2\.3 MiB, over the limit of 1 MiB.*max_model_file_mb"):
        load(path, str(prof), backend="numpy")
    with pytest.raises(ResourceLimitError, match="max_model_file_mb"):
        load(path.read_bytes(), str(prof), backend="numpy")
    assert not parsed


def test_limit_keys_are_validated_in_profiles(tmp_path) -> None:
    from edgeflow.errors import ProfileError

    with pytest.raises(ProfileError, match="max_loop_iterations.*>= 1"):
        get_profile(profile_toml(tmp_path, "bad-limit", max_loop_iterations=0))
    p = get_profile(profile_toml(tmp_path, "good-limit", max_model_nodes=7))
    assert p.max_model_nodes == 7 and p.max_loop_iterations == 1_000_000


# ----------------------------------------------------------------- 4. memory at run time


@pytest.mark.parametrize("backend", ["numpy", pytest.param("ort", marks=needs_ort)])
def test_health_check_fails_a_model_allocating_past_the_budget_at_run_time(backend) -> None:
    prof = get_profile(BASE)  # 1024 MiB budget; the model allocates 1.6 GB once it runs
    model = alloc_model().SerializeToString()
    rt = load(model, prof, backend="numpy")
    # the static plan cannot size it (and passes it): only a run-time limit catches it
    assert rt.plan is not None and "big" in rt.plan.unknown and rt.plan.peak_bytes < prof.memory_budget_bytes
    rep = check_model(model, prof, None, backend=backend, runs=1)
    assert not rep.ok and rep.stage == "golden", rep
    assert "more memory at run time than the budget of 1024 MiB" in rep.reason and "\n" not in rep.reason, rep.reason
    small = check_model(alloc_model(1000).SerializeToString(), prof, None, backend=backend, runs=1)
    assert small.ok, small.reason  # the same graph within the budget passes
    assert dataclasses.asdict(small)["stage"] == "done"
