"""Upload bytes of a secure-aggregation round against a plain one, per client, on the demo model.

    python benchmarks/secagg_bytes.py                      # 5 and 20 devices, the gateway's defaults
    python benchmarks/secagg_bytes.py --devices 20 --secagg ring_bits=64 frac_bits=32 clip=1024
    python benchmarks/secagg_bytes.py --json out.json

Two measurements per fleet size, same run:

* **wire** (the figure): a real RoundManager and real federated Clients (digits MLP, 26 KB of fp32
  parameters) over the loopback transport run one plain round (codec ``dense``, the fp32 update) and
  then one secure round (``[rounds] secagg``); each device counts the bytes it publishes
  (``Client.stats.bytes_sent``: every signed frame it sends, payload bytes, no MQTT framing).
  Reported: the mean per device of each round, and secure / plain.
* **where the bytes go**: the same protocol in-process (SecAggClient/SecAggServer with the same
  config the gateway chose) with each message sealed as the orchestrators seal it; per device and
  message kind (key advert, encrypted shares, share check, masked vector, unmask response).

``--secagg K=V``: settings of ``[rounds] secagg`` (e.g. ``ring_bits=64 frac_bits=32 clip=1024``, the
encoding before issue 34) so before/after figures come from the same command.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _loopback_fleet import loopback_fleet, shut_down  # noqa: E402


def _settings(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for p in pairs:
        k, _, v = p.partition("=")
        out[k] = float(v) if "." in v else int(v)
    return out


def _one_round(devices: int, secagg: dict[str, Any] | None, seed: int) -> tuple[Any, list[int], Any]:
    """One round on a fresh fleet: (its metrics, bytes each device published, the SecAggConfig used)."""
    config: dict[str, Any] = {"min_clients": devices, "seed": seed}
    if secagg is not None:
        config["secagg"] = {"max_dropout_fraction": 0.3, **secagg}
    with tempfile.TemporaryDirectory() as tmp:
        fl = loopback_fleet(str(Path(tmp) / "gw.sqlite"), config, 1, seed, devices=devices)
        rm, gt = fl["manager"]()
        try:
            (metrics,) = rm.run(1)
            sent = [c.stats.bytes_sent for c in fl["clients"]]
            chosen = None
            if secagg is not None:
                from edgeflow.gateway.secure_rounds import session_config

                chosen = session_config(devices, rm.config.secagg, rm.config.train.max_samples,
                                        rm.config.strategy_params.get("clip"))
        finally:
            shut_down(fl, rm, gt)
    return metrics, sent, chosen


def wire_bytes(devices: int, secagg: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    """A plain round and a secure round on the same devices and data; bytes each device published."""
    plain_round, plain, _ = _one_round(devices, None, seed)
    secure_round, secure, chosen = _one_round(devices, secagg, seed)
    plain_mean, secure_mean = float(np.mean(plain)), float(np.mean(secure))
    return {"devices": devices, "plain_participants": plain_round.participants,
            "secure_participants": secure_round.participants, "plain_accuracy": plain_round.accuracy,
            "secure_accuracy": secure_round.accuracy, "plain_bytes_per_device": round(plain_mean),
            "secure_bytes_per_device": round(secure_mean), "ratio": round(secure_mean / plain_mean, 3),
            "config": None if chosen is None else {k: getattr(chosen, k) for k in
                                                   ("threshold", "ring_bits", "frac_bits", "clip", "max_clients",
                                                    "weight_cap", "norm_bound")}}


def breakdown(devices: int, config: Any) -> dict[str, float]:
    """Mean sealed bytes per device and message kind, the protocol run in-process with ``config``."""
    from edgeflow import zoo
    from edgeflow.federated.secagg_client import SecAggClient
    from edgeflow.gateway.global_model import model_weights
    from edgeflow.gateway.secagg import SecAggServer
    from edgeflow.protocol import secagg_wire as wire
    from edgeflow.signing import Signer

    layout = model_weights(zoo.digits_mlp(seed=0))
    rng = np.random.default_rng(0)
    server = SecAggServer(config, layout, round_id=1)
    clients = {f"d{i}": SecAggClient(f"d{i}") for i in range(devices)}
    signer = Signer.generate("bench")
    sizes: dict[str, int] = {}

    def sent(kind: str, msg: Any) -> Any:
        sizes[kind] = sizes.get(kind, 0) + len(wire.seal(wire.encode(msg), signer))
        return wire.decode(wire.encode(msg))

    for c in clients.values():
        server.receive_advertise(sent("key advert", c.advertise()))
    directory = server.key_directory()
    for c in clients.values():
        server.receive_share_keys(sent("encrypted shares", c.share_keys(directory)))
    bundles = server.share_bundles()
    for cid, c in clients.items():
        server.receive_share_check(sent("share check", c.check_bundle(bundles[cid])))
    final = server.final_holders()
    for c in clients.values():
        update = {k: (0.01 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in layout.items()}
        server.receive_masked_input(sent("masked vector", c.masked_input(final, update, weight=60.0)))
    request = server.unmask_request()
    for c in clients.values():
        server.receive_unmask(sent("unmask response", c.unmask(request)))
    server.finish()
    return {k: round(v / devices) for k, v in sizes.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, nargs="+", default=[5, 20])
    ap.add_argument("--secagg", nargs="*", default=[], metavar="K=V", help="[rounds] secagg settings")
    ap.add_argument("--json", help="write the rows as JSON to this path")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    settings = _settings(args.secagg)
    rows = []
    for n in args.devices:
        row = wire_bytes(n, settings)
        if row["config"] is not None:
            from edgeflow.protocol.secagg import SecAggConfig

            row["breakdown"] = breakdown(n, SecAggConfig(**row["config"]))
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
