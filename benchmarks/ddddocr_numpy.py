"""ddddocr's default captcha OCR (common_old.onnx: ConvInteger, MatMulInteger and a
com.microsoft::DynamicQuantizeLSTM) on the numpy backend against onnxruntime: CPU time of one
captcha, batch 1, one thread, interleaved runs; and the text each backend reads.

    python benchmarks/ddddocr_numpy.py [--runs 7]

Fetches the pinned ddddocr wheel into the model cache on first use (tests/_ddddocr.py)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=7)
    args = p.parse_args()
    import numpy as np
    import onnx
    import onnxruntime as ort

    from _ddddocr import captcha, charset_old, ctc_text, fetch
    from edgeflow.runtime.backends import SessionOptions, get_backend

    model = onnx.load(str(fetch("ddddocr-ocr-old")))
    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    so.log_severity_level = 3
    ref = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    ours = get_backend("numpy").load(model, SessionOptions(threads=1))
    out = ref.get_outputs()[0].name
    x = captcha("a3k9x")
    charset = charset_old()
    r, g = ref.run(None, {"input1": x})[0], ours.run({"input1": x})[out]
    ratios = []
    for _ in range(args.runs):
        t0 = time.process_time()
        ref.run(None, {"input1": x})
        t1 = time.process_time()
        ours.run({"input1": x})
        t2 = time.process_time()
        ratios.append((t2 - t1) / (t1 - t0))
    print(f"text: onnxruntime {ctc_text(r, charset)!r}, numpy {ctc_text(g, charset)!r}")
    print(f"numpy/onnxruntime CPU time: median {np.median(ratios):.2f}x over {args.runs} interleaved runs "
          f"(load average {os.getloadavg()[0]:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
