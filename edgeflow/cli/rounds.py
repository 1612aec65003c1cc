"""``edgeflow rounds``: the federated rounds a gateway ran, as its state stored them.

Read-only, from the gateway's state (``--state gateway.sqlite``, a ``postgresql://`` URL, or
``--config gateway.toml``): one row per round with the global model version it trained from and
the one it produced, how many of the selected devices' updates were aggregated, the accuracy and
loss of the new model on the gateway's eval set, the bytes uploaded, how long it took, and why a
round failed.

Three version counters, named apart everywhere: the **global model** (``model vN``) is the
gateway's, one more per round that produces a model; an **OTA artifact** (``artifact vN``) is
what ``edgeflow fleet deploy`` ships and each device runs; a device's running version is the
artifact it runs. ``edgeflow fleet rollouts`` maps an artifact to the global model it was built
from when that model came from this state.
"""

from __future__ import annotations

import time
from typing import Any

ORDER = 72

DESCRIPTION = """\
The federated rounds a gateway ran, read from its state (read-only): per round the global model
version it trained from and the one it produced, how many of the selected devices' updates were
aggregated, the new model's accuracy and loss, the bytes uploaded, how long it took, and why a
round failed.

Three version counters are named apart: "model vN" is the gateway's global model (one more per
round that produces a model); "artifact vN" is what `edgeflow fleet deploy` ships and a device
runs (`edgeflow fleet status`); `edgeflow fleet rollouts` shows which model an artifact was built
from ("artifact v2 (= model v4)").
"""

EPILOG = """\
examples:
  edgeflow rounds --state gateway.sqlite              every round: model versions, devices, accuracy, bytes, time
  edgeflow rounds --config gateway.toml --last 5      the newest five, the state named in gateway.toml
  edgeflow rounds --state gateway.sqlite --json       the same as JSON (figures rounded), for scripts
  edgeflow rounds --state 'postgresql://gw@db:5432/fleet?schema=edgeflow'

columns:
  model     the global model version the round trained from -> the version it produced
            ("-" when it produced none: failed, or still open)
  devices   updates aggregated / devices selected
  accuracy  the new model on the gateway's eval set ([gateway] eval; "-" without one)
  loss      that eval set's loss, else the devices' mean training loss (marked "~")
  bytes     update bytes the devices uploaded in the round
"""


def register(sub) -> None:
    import argparse

    p = sub.add_parser("rounds", help="the federated rounds stored in the gateway's state (history)",
                       description=DESCRIPTION,
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_state_args(p)
    p.add_argument("--last", type=int, metavar="N", help="only the newest N rounds")
    p.add_argument("--json", action="store_true", help="print only JSON on stdout")
    p.set_defaults(func=cmd_rounds)


def add_state_args(p) -> None:
    """``--state`` / ``--config``: which gateway's state to read (read-only)."""
    p.add_argument("--state", help="the gateway's state: its SQLite file ([gateway] state, e.g. gateway.sqlite) or "
                   "its [store] url (postgresql://USER@HOST:PORT/DB?schema=NAME); opened read-only, never created")
    p.add_argument("--config", "-c", metavar="GATEWAY_TOML",
                   help="read the state that gateway.toml names ([gateway] state or [store] url) instead of --state")


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)


def _round(v: Any, nd: int) -> float | None:
    x = _num(v)
    return None if x is None else round(x, nd)


def round_rows(reader: Any, last: int | None = None) -> list[dict[str, Any]]:
    """One dict per stored round (oldest first; the newest ``last``), figures rounded."""
    made: dict[int, int] = {}
    for m in reader.models():
        if m["round_id"] is not None:
            made[m["round_id"]] = max(m["version"], made.get(m["round_id"], 0))
    records = reader.rounds()
    if last is not None:
        records = records[-last:]
    now = time.time()
    rows = []
    for r in records:
        m = r.metrics if isinstance(r.metrics, dict) else {}
        produced = made.get(r.round_id)
        reason = m.get("reason") if r.state != "closed" else None
        if r.state == "failed" and not reason:
            reason = "abandoned after a restart" if m.get("abandoned") else "no reason stored"
        note = None
        if m.get("recovered"):
            note = "finished by a restarted gateway (its figures were not kept)"
        elif (r.config.get("mode") if isinstance(r.config, dict) else None) == "async" or "versions" in m:
            note = f"FedBuff session: {m.get('versions', 0)} model version(s)"
        duration = _num(m.get("round_s"))
        if r.state == "open":
            duration = max(0.0, now - r.created)
        acc = _num(m.get("accuracy"))
        loss, loss_kind = _num(m.get("eval_loss")), "eval"
        if loss is None and _num(m.get("mean_client_loss")) is not None:
            loss, loss_kind = _num(m.get("mean_client_loss")), "client_mean"
        rows.append({
            "round": r.round_id, "state": r.state, "started": round(r.created, 3),
            "deadline": round(r.deadline, 3) if r.state == "open" else None,
            "base_model_version": r.model_version, "model_version": produced,
            "selected": len(r.selected) if isinstance(r.selected, list) else None,
            "participants": m.get("participants") if isinstance(m.get("participants"), int) else None,
            "dropped": m.get("dropped"), "late": m.get("late"), "rejected": m.get("rejected"),
            "accuracy": None if acc is None else round(acc, 4),
            "loss": None if loss is None else round(loss, 4), "loss_kind": None if loss is None else loss_kind,
            "bytes_in": m.get("bytes_in") if isinstance(m.get("bytes_in"), int) else None,
            "dense_bytes": m.get("dense_bytes") if isinstance(m.get("dense_bytes"), int) else None,
            "duration_s": None if duration is None else round(duration, 3),
            "aggregation_s": _round(m.get("aggregation_s"), 4),
            "failure_reason": reason, "note": note,
        })
    return rows


def _cells(r: dict[str, Any]) -> list[str]:
    from ._common import human_bytes
    from ._history import when
    from .fleet import _shown

    made = "-" if r["model_version"] is None else f"v{r['model_version']}"
    devices = "-" if r["selected"] is None else f"{'-' if r['participants'] is None else r['participants']}/{r['selected']}"
    loss = "-" if r["loss"] is None else ("~" if r["loss_kind"] == "client_mean" else "") + f"{r['loss']:.4f}"
    return [str(r["round"]), _shown(r["state"]), f"v{r['base_model_version']} -> {made}", devices,
            "-" if r["accuracy"] is None else f"{r['accuracy']:.4f}", loss,
            "-" if r["bytes_in"] is None else human_bytes(r["bytes_in"]),
            "-" if r["duration_s"] is None else f"{r['duration_s']:.1f} s", when(r["started"])]


def cmd_rounds(args) -> int:
    from ._common import console, emit_json, fit_table
    from ._history import check_last, global_model_line
    from .fleet import _shown, state_reader

    check_last(args.last)
    reader = state_reader(args)
    try:
        rows = round_rows(reader, args.last)
        models = reader.models()
        total = len(reader.rounds()) if args.last is not None else len(rows)
        path = reader.path
    finally:
        reader.close()
    latest = models[-1] if models else None
    if args.json:
        emit_json({"state": path, "rounds_stored": total,
                   "global_model": None if latest is None else {"model_version": latest["version"],
                                                                "round": latest["round_id"],
                                                                "sha256": latest["sha256"]},
                   "rounds": rows})
        return 0
    c = console()
    head = global_model_line(models)
    c.print(f"gateway state {_shown(path)}: global {head}" if head else
            f"gateway state {_shown(path)}: no global model yet (the gateway stores model v1 when it first starts)")
    if not rows:
        c.print("no rounds stored yet: `edgeflow gateway --config gateway.toml` runs them ([rounds] in gateway.toml)")
        return 0
    cols = [("round", 0, "right"), ("state", 0, "left"), ("model", 0, "left"), ("devices", 1, "right"),
            ("accuracy", 1, "right"), ("loss", 3, "right"), ("bytes", 2, "right"), ("time", 2, "right"),
            ("started", 4, "left")]
    shown = f"the newest {len(rows)} of {total} round(s)" if total > len(rows) else f"{len(rows)} round(s)"
    c.print(fit_table(shown, cols, [_cells(r) for r in rows], c.width))
    for r in rows:
        if r["failure_reason"]:
            c.print(f"round {r['round']} {_shown(r['state'])}: {_shown(r['failure_reason'])}")
        elif r["note"]:
            c.print(f"round {r['round']}: {_shown(r['note'])}")
    return 0
