"""Update codecs on a 1M-parameter update: bytes on the wire, speed, reconstruction error.

The update is gradient-like (normal, sigma 0.01) in three tensors totalling
exactly 1,000,000 float32 parameters (4 MB). For each codec: the envelope
size and its ratio to dense, median encode and decode throughput in MB/s of
fp32 *input* (4 MB / time), the same for encode+decode together, and the
relative L2 error ||x - decode(encode(x))|| / ||x|| of one round (top-k
codecs at 1% density, without error feedback: the error is what one round
drops). A second table times the signed path (Ed25519 over the envelope's
SHA-256) for the targets' codecs.

Targets (issue 5): int8 <= 0.26x dense bytes; topk-int8 (1%) <= 0.02x;
encode+decode >= 200 MB/s for dense and int8.

    python benchmarks/codecs.py [--repeats 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import numpy as np

from edgeflow.codecs import available_codecs, decode_update, encode_update
from edgeflow.signing import KeyRing, Signer

TARGET_RATIO = {"int8": 0.26, "topk-int8": 0.02}
TARGET_MBPS = {"dense": 200.0, "int8": 200.0}
SHAPES = {"fc1.weight": (1000, 900), "fc2.weight": (100, 990), "fc1.bias": (1000,)}
OPTIONS = {"topk": {"ratio": 0.01}, "topk-int8": {"ratio": 0.01}, "topk-packed": {"ratio": 0.01, "bits": 4}}


def make_update(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    tensors = {n: (rng.standard_normal(s) * 0.01).astype(np.float32) for n, s in SHAPES.items()}
    assert sum(t.size for t in tensors.values()) == 1_000_000
    return tensors


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3


def bench(repeats: int, *, signed: bool = False, codecs: list[str] | None = None) -> list[dict]:
    tensors = make_update()
    mb = sum(t.nbytes for t in tensors.values()) / 1e6
    signer = Signer.generate("bench-device") if signed else None
    ring = KeyRing({"bench-device": signer.public_key}) if signer else None
    rows = []
    dense_bytes = None
    for codec in codecs or [c for c in available_codecs() if c != "auto"]:  # auto: int8 at this size
        opts = OPTIONS.get(codec, {})
        rng = np.random.default_rng(1)

        def enc() -> bytes:
            return encode_update(tensors, codec, round_id=1, device_id="bench-device", seq=1, signer=signer,
                                 rng=rng, **opts)

        data = enc()
        enc_ms = _median_ms(enc, repeats)
        dec_ms = _median_ms(lambda: decode_update(data, verifier=ring), repeats)
        decoded = decode_update(data, verifier=ring).tensors
        num = sum(float(np.sum((decoded[n] - t) ** 2)) for n, t in tensors.items())
        den = sum(float(np.sum(t**2)) for t in tensors.values())
        if codec == "dense":
            dense_bytes = len(data)
        rows.append({
            "codec": codec,
            "bytes": len(data),
            "ratio": len(data) / dense_bytes if dense_bytes else float("nan"),
            "encode_MBps": mb / (enc_ms / 1e3),
            "decode_MBps": mb / (dec_ms / 1e3),
            "roundtrip_MBps": mb / ((enc_ms + dec_ms) / 1e3),
            "rel_l2_error": (num / den) ** 0.5,
            "signed": signed,
        })
    return rows


def feedback_error(codec: str = "topk-int8", rounds: int = 20) -> float:
    """Relative error of the *sum* of ``rounds`` decoded updates of a fixed update, with error feedback."""
    from edgeflow.codecs import ErrorFeedback

    tensors = make_update()
    state = ErrorFeedback()
    total = {n: np.zeros_like(t) for n, t in tensors.items()}
    for r in range(rounds):
        data = encode_update(tensors, codec, round_id=r, device_id="d", seq=r, state=state, rng=r, **OPTIONS[codec])
        for n, t in decode_update(data).tensors.items():
            total[n] += t
    num = sum(float(np.sum((total[n] - rounds * t) ** 2)) for n, t in tensors.items())
    den = sum(float(np.sum((rounds * t) ** 2)) for t in tensors.values())
    return (num / den) ** 0.5


def _table(rows: list[dict], title: str) -> str:
    head = f"{'codec':<11} {'bytes':>10} {'x dense':>8} {'enc MB/s':>9} {'dec MB/s':>9} {'enc+dec MB/s':>13} {'rel L2 err':>11}"
    lines = [title, head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['codec']:<11} {r['bytes']:>10,} {r['ratio']:>8.4f} {r['encode_MBps']:>9.0f} {r['decode_MBps']:>9.0f} "
            f"{r['roundtrip_MBps']:>13.0f} {r['rel_l2_error']:>11.2e}"
        )
    return "\n".join(lines)


def check_targets(rows: list[dict]) -> list[str]:
    by = {r["codec"]: r for r in rows}
    out = []
    for codec, limit in TARGET_RATIO.items():
        ok = by[codec]["ratio"] <= limit
        out.append(f"{'PASS' if ok else 'FAIL'}  {codec} bytes {by[codec]['ratio']:.4f}x dense (target <= {limit}x)")
    for codec, limit in TARGET_MBPS.items():
        v = by[codec]["roundtrip_MBps"]
        out.append(f"{'PASS' if v >= limit else 'FAIL'}  {codec} encode+decode {v:.0f} MB/s (target >= {limit:.0f})")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--json", help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    print(f"1,000,000 float32 parameters (4.0 MB); {platform.processor() or platform.machine()}, "
          f"Python {sys.version.split()[0]}, numpy {np.__version__}; median of {args.repeats}")
    rows = bench(args.repeats)
    print(_table(rows, "\nunsigned envelopes (topk codecs: 1% density, one round, no error feedback)"))
    signed = bench(args.repeats, signed=True, codecs=["dense", "int8", "topk-int8", "topk-packed"])
    print(_table(signed, "\nsigned (Ed25519) and verified"))
    rounds = 20
    print(f"\nwith error feedback, the sum of {rounds} rounds of topk-int8 (1%) is off by "
          f"{feedback_error('topk-int8', rounds):.2e} (relative L2), against "
          f"{next(r for r in rows if r['codec'] == 'topk-int8')['rel_l2_error']:.2e} for one round alone")
    print()
    verdicts = check_targets(rows)
    print("\n".join(verdicts))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"unsigned": rows, "signed": signed}, fh, indent=2)
    return 0 if all(v.startswith("PASS") for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
