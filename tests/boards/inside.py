"""Runs INSIDE a board userland (the board's python, the installed edgeflow wheel).

    python inside.py conformance CASES_DIR OUT.json   run the exported ONNX node cases on the numpy backend

It imports only what a device install has: edgeflow, numpy and whatever onnx
path the board takes (Debian's onnx, the PyPI wheel or edgeflow.onnx_compat).
The cases were exported on the host by tests/boards/run.py (``export_cases``):
one shape-inferred .onnx and one .npz (in_0.., out_0..) per case, and
manifest.json with names, tolerances and opsets, so no case generator (which
onnx 1.12 does not have) is needed here.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path


def conformance(cases_dir: Path, out: Path) -> int:
    import edgeflow  # noqa: F401 - first: its import hook decides what `import onnx` gets (EDGEFLOW_ONNX)
    import numpy as np
    import onnx

    from edgeflow import onnx_compat
    from edgeflow.runtime.backends.numpy_backend import execute
    from edgeflow.runtime.graph import compile_graph, unsupported_ops

    manifest = json.loads((cases_dir / "manifest.json").read_text())
    results = []
    t_all = time.perf_counter()
    for case in manifest["cases"]:
        t0 = time.perf_counter()
        status, detail = "pass", ""
        try:
            model = onnx.load(str(cases_dir / case["model"]))
            missing = unsupported_ops(model)
            if missing:  # the host's numpy backend claims it, this board's does not (e.g. Pillow absent)
                results.append({"name": case["name"], "ops": case["ops"], "status": "unclaimed",
                                "detail": f"no kernel here for {', '.join(missing)}",
                                "seconds": round(time.perf_counter() - t0, 3)})
                continue
            data = np.load(cases_dir / case["data"], allow_pickle=False)
            graph = compile_graph(model)
            feeds = {n: data[f"in_{i}"] for i, n in enumerate(case["inputs"]) if n}
            with np.errstate(all="ignore"):
                env = execute(graph, feeds)
            for i, name in enumerate(case["outputs"]):
                got, want = np.asarray(env[name]), data[f"out_{i}"]
                if got.shape != want.shape:
                    raise AssertionError(f"output {name} shape {got.shape} != {want.shape}")
                if want.dtype.kind in "fc":
                    if got.dtype != want.dtype:
                        raise AssertionError(f"output {name} dtype {got.dtype} != {want.dtype}")
                    np.testing.assert_allclose(got, want, rtol=case["rtol"], atol=case["atol"])
                else:
                    np.testing.assert_array_equal(got.astype(want.dtype), want)
        except AssertionError as exc:
            status, detail = "fail", str(exc).strip().splitlines()[0][:300] if str(exc).strip() else "mismatch"
        except Exception as exc:  # noqa: BLE001 - every case reports, none stops the run
            status, detail = "error", f"{type(exc).__name__}: {str(exc).strip()[:300]}"
        results.append({"name": case["name"], "ops": case["ops"], "status": status, "detail": detail,
                        "seconds": round(time.perf_counter() - t0, 3)})
    summary = {
        "machine": platform.machine(), "python": platform.python_version(), "numpy": np.__version__,
        "onnx": onnx_compat.describe(), "cases": sum(r["status"] != "unclaimed" for r in results),
        "passed": sum(r["status"] == "pass" for r in results),
        "unclaimed": sorted({r["detail"] for r in results if r["status"] == "unclaimed"}),
        "seconds": round(time.perf_counter() - t_all, 1), "results": results,
    }
    out.write_text(json.dumps(summary, indent=1))
    bad = [r for r in results if r["status"] not in ("pass", "unclaimed")]
    print(f"conformance subset on {summary['machine']}: {summary['passed']}/{summary['cases']} passed "
          f"in {summary['seconds']} s ({summary['onnx']})")
    for why in summary["unclaimed"]:
        print(f"  not claimed on this board: {why}")
    for r in bad:
        print(f"  {r['status']}: {r['name']}: {r['detail']}")
    return 0 if not bad else 1


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "conformance":
        return conformance(Path(argv[1]), Path(argv[2]))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
