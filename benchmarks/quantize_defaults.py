"""What the default `edgeflow quantize` writes for real models, judged on samples it never saw (issue 30).

    python benchmarks/quantize_defaults.py                      # the three models below, x86-gateway
    python benchmarks/quantize_defaults.py --profile raspberry-pi-4 --only ocr-rec-ppocrv4

Each model is quantized with the defaults a user gets (calibration only: the bench gate at --max-loss 1,
20% of the calibration held out), then the written model is compared with fp32 on other samples of the
suite's real inputs: for the PP-OCRv4 recognizer, the number of text lines decoded alike (greedy CTC);
for the others, the lowest cosine of the first output. Issue 30 measured 3 of 33 lines (the recognizer),
66.7% agreement (PP-LCNet) and int8 written at 0.53-0.69x of fp32 (MTCNN).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quantization as QB  # noqa: E402  (the suite's real-input builders)

MODELS = {"ocr-rec-ppocrv4": (40, 33), "orientation-pplcnet": (40, 30), "mtcnn-onet": (40, 30)}


def one(name: str, n_cal: int, n_eval: int, profile: str) -> dict:
    import edgeflow
    from edgeflow import model_suite as ms
    from edgeflow.quantization.gate import ctc_greedy
    from edgeflow.runtime.session import load

    cal, ev = QB._stack(name, range(n_cal)), QB._stack(name, range(n_cal, n_cal + n_eval))
    fp32 = ms.load(name)
    t0 = time.time()
    r = edgeflow.quantize(fp32, profile, calibration=cal, latency_runs=0, sensitivity=False)
    g = r.report.gate
    a = load(fp32, profile, backend="ort", allow_over_budget=True)
    b = load(r.model, profile, backend="ort", allow_over_budget=True)
    same, cos = 0, []
    for i in range(n_eval):
        x = {k: v[i:i + 1] for k, v in ev.items()}
        ya, yb = next(iter(a.run(x).values())), next(iter(b.run(x).values()))
        if name == "ocr-rec-ppocrv4":
            s = ya.shape[-1] - 1
            same += ctc_greedy(ya, strip=(s,)) == ctc_greedy(yb, strip=(s,))
        fa, fb = ya.reshape(-1).astype(np.float64), yb.reshape(-1).astype(np.float64)
        cos.append(float(fa @ fb / (np.linalg.norm(fa) * np.linalg.norm(fb) + 1e-30)))
    return {"model": name, "profile": profile, "choice": g.choice if g else None, "timed": g.timed if g else None,
            "reason": g.reason if g else None, "evidence": g.evidence.format() if g and g.evidence else None,
            "same_text": f"{same} of {n_eval}" if name == "ocr-rec-ppocrv4" else None,
            "min_cosine_unseen": round(min(cos), 5), "seconds": round(time.time() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="x86-gateway")
    ap.add_argument("--only", action="append", choices=sorted(MODELS))
    args = ap.parse_args(argv)
    for name in args.only or list(MODELS):
        print(json.dumps(one(name, *MODELS[name], args.profile)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
