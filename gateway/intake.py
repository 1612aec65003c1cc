"""The one rulebook for a device's update: what must hold before the gateway stores or counts it.

Every path that takes an update in -- the round manager's own subscription, a
resumed round re-reading its stored envelopes, the fold at a round's close,
the ingestion workers that share the update stream (:mod:`edgeflow.gateway.ingest`)
-- runs the same two steps, so a trust rule exists once and cannot drift:

1. :func:`screen` (before decoding: cheap, on the envelope's unverified header):
   the round is open and this is its id, the header names the device whose topic
   carried it, the device was selected, it has not reported yet;
2. :func:`check_update` (the full check): signature, shapes, bounded finite
   values (the codecs), metadata types and ranges, sequence number range, the
   round's nonce (a replay of a round that reused its id), the persisted replay
   floor, the model version the update was trained from, and a pre-summed
   partial's client count. Returns a :class:`CheckedUpdate` with the tensors in
   the model's dtypes.

Refusals are :class:`~edgeflow.errors.CodecError` with a ``reason`` attribute
(``wrong_round``, ``replay``, ``wrong_version``, ``bad_metadata``, ...): the
counter a round reports is ``rejected_<reason>``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgeflow.codecs import decode_update
from edgeflow.errors import AggregationError, CodecError, SignatureError
from edgeflow.protocol.rounds import EvaluationReport, UpdateMeta, parse_update_meta
from edgeflow.signing import KeyRing, ReplayGuard

from .store import MAX_SEQ

__all__ = ["CheckedUpdate", "RoundView", "check_evaluation", "check_offer", "check_update", "partial_clients",
           "refusal", "screen"]

MAX_OFFERED_TENSORS = 4096
"""The most tensors a device's offer of first parameters may hold (gateway.global_model.MAX_PARAMETERS)."""


@dataclass(frozen=True)
class RoundView:
    """What the rules need to know about the round an update answers."""

    round_id: int
    model_version: int
    selected: frozenset[str] = frozenset()
    nonce: str = ""
    mode: str = "sync"
    open: bool = True


@dataclass(frozen=True)
class CheckedUpdate:
    """An update that passed every rule: safe to store and to fold."""

    device_id: str
    round_id: int
    seq: int
    tensors: dict[str, np.ndarray]
    meta: UpdateMeta
    payload: bytes
    num_clients: int = 1
    """Devices inside it: 1 for a device's update, the site's count for a pre-summed partial."""

    @property
    def base_version(self) -> int | None:
        return self.meta.base_version


def refusal(reason: str, message: str) -> CodecError:
    """A CodecError that names its reason (the round's ``rejected_<reason>`` counter)."""
    err = CodecError(message)
    err.reason = reason  # type: ignore[attr-defined]
    return err


def partial_clients(metadata: Mapping[str, Any], sender: str) -> int:
    """The device count a partial aggregate claims (``metadata["num_clients"]``)."""
    n = metadata.get("num_clients")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise AggregationError(f"{sender}: not a partial aggregate (metadata num_clients={n!r}, need an int >= 1)")
    return n


def screen(head: Any, sender: str | None, rnd: RoundView | None, reported: Callable[[str], bool]) -> str | None:
    """The cheap checks on an envelope's (unverified) header, in order; the counter to bump
    when the update is not taken further (``late``, ``rejected_spoofed``, ``not_selected``,
    ``duplicates``), or None. ``reported(device)``: has the device already reported this round."""
    if rnd is None or not rnd.open or head.round_id != rnd.round_id:
        return "late"
    if head.device_id != sender:
        return "rejected_spoofed"
    if rnd.mode == "sync" and rnd.selected and sender not in rnd.selected:
        return "not_selected"
    if rnd.mode == "sync" and reported(sender):
        return "duplicates"
    return None


def check_update(payload: bytes, rnd: RoundView, *, keyring: KeyRing, like: Mapping[str, np.ndarray] | None,
                 seq_floor: int | None, replay_guard: ReplayGuard | None = None, partials: bool = False,
                 source: str = "") -> CheckedUpdate:
    """Every rule an update must pass before it is stored or folded (module docstring);
    :class:`CodecError`/:class:`~edgeflow.errors.SignatureError` with a ``reason`` otherwise.

    ``like``: the round's tensors (the global weights: names, shapes and dtypes an update must match)
    or None when the model is unknown here (the tensors are then returned as decoded). ``seq_floor``: the highest
    sequence number the state accepted from this device before (None: none). ``replay_guard``: the
    in-memory guard of a live process (a stored update being re-read passes None). ``partials``: the
    update is a site gateway's pre-summed partial (its metadata names its client count)."""
    upd = decode_update(payload, verifier=keyring, replay_guard=replay_guard, require_signature=True,
                        expected_shapes=None if like is None else {k: v.shape for k, v in like.items()},
                        source=source)
    meta = parse_update_meta(upd.metadata, upd.device_id)
    if upd.seq > MAX_SEQ:
        raise refusal("bad_seq", f"update from {upd.device_id!r} has seq {upd.seq}, above {MAX_SEQ}")
    num_clients = 1
    if partials:
        try:
            num_clients = partial_clients(upd.metadata, upd.device_id)
        except AggregationError as exc:
            raise refusal("bad_metadata", str(exc)) from None
    if rnd.nonce and meta.nonce is not None and meta.nonce != rnd.nonce:
        raise refusal("wrong_round", f"update from {upd.device_id!r} answers another round {upd.round_id} "
                                     f"(nonce {meta.nonce[:16]}, this round's is {rnd.nonce[:16]}): "
                                     "a replay of a round that reused the id")
    if seq_floor is not None and upd.seq <= seq_floor:
        raise refusal("replay", f"update from {upd.device_id!r} has seq {upd.seq}, not above the {seq_floor} "
                                "accepted from it before (kept in the state across restarts): a replay")
    base = meta.base_version if meta.base_version is not None else rnd.model_version
    if rnd.mode == "sync" and base != rnd.model_version:
        raise refusal("wrong_version", f"update from {upd.device_id!r} for round {rnd.round_id} was trained from "
                                       f"v{base}, the round trains v{rnd.model_version}")
    tensors = {}
    for k, v in upd.tensors.items():
        want = None if like is None else like[k].dtype
        tensors[k] = v if want is None or v.dtype == want else v.astype(want)
    return CheckedUpdate(upd.device_id, upd.round_id, upd.seq, tensors, meta, bytes(payload), num_clients)


def check_evaluation(payload: bytes, rnd: RoundView | None, sender: str | None, *, keyring: KeyRing,
                     reported: Callable[[str], bool]) -> EvaluationReport:
    """The rules for a device's report in a federated evaluate round (``rnd.mode`` "evaluate"), in order:
    the round is open, the topic names a device that was selected and has not reported, the report is
    signed by that device's key, every field is in range, and it names this round (id, nonce) and the model
    version it was asked to evaluate. Refusals are CodecError/SignatureError with a ``reason`` (the round's
    ``rejected_<reason>`` / ``late`` / ``not_selected`` / ``duplicates`` counters)."""
    if rnd is None or not rnd.open or rnd.mode != "evaluate":
        raise refusal("late", "no evaluate round is open")
    if sender is None or sender not in rnd.selected:
        raise refusal("not_selected", f"{sender!r} was not selected for evaluate round {rnd.round_id}")
    if reported(sender):
        raise refusal("duplicates", f"{sender!r} already reported in evaluate round {rnd.round_id}")
    key = keyring.get(sender)
    if key is None:
        err = SignatureError(f"no key registered for {sender!r}")
        err.reason = "unknown_device"  # type: ignore[attr-defined]
        raise err
    rep = EvaluationReport.verify(payload, key)
    if rep.round_id != rnd.round_id or rep.nonce != rnd.nonce:
        raise refusal("wrong_round", f"the report answers round {rep.round_id} ({rep.nonce[:16]!r}), not evaluate "
                                     f"round {rnd.round_id}")
    if rep.model_version != rnd.model_version:
        raise refusal("wrong_version", f"the report evaluates v{rep.model_version}, the round asked for "
                                       f"v{rnd.model_version}")
    return rep


def check_offer(payload: bytes, *, keyring: KeyRing, device: str, nonce: str, source: str = "") -> dict[str, np.ndarray]:
    """A device's offer of the first global parameters (Flower's "ask one client for get_parameters"), answering
    the gateway's signed request (announcement mode "parameters") to exactly this ``device`` with this ``nonce``:
    signed by that device, bounded finite float tensors (the codecs), at most :data:`MAX_OFFERED_TENSORS`.
    Refusals are CodecError with a ``reason``, as every update's."""
    upd = decode_update(payload, verifier=keyring, require_signature=True, source=source)
    if upd.device_id != device:
        raise refusal("not_selected", f"parameters offered by {upd.device_id!r}; {device!r} was asked")
    meta = upd.metadata if isinstance(upd.metadata, dict) else {}
    if meta.get("round_nonce") != nonce or meta.get("offer") is not True:
        raise refusal("wrong_round", f"parameters from {device!r} do not answer this request (nonce "
                                     f"{str(meta.get('round_nonce'))[:16]}, asked {nonce[:16]})")
    if not upd.tensors or len(upd.tensors) > MAX_OFFERED_TENSORS:
        raise refusal("bad_metadata", f"{device!r} offered {len(upd.tensors)} tensors; 1 to {MAX_OFFERED_TENSORS}")
    out = {}
    for name, arr in upd.tensors.items():
        a = np.asarray(arr)
        if a.dtype.kind != "f" or not np.isfinite(a).all():
            raise refusal("non_finite", f"{device!r} offered {name!r} with non-float or non-finite values")
        out[name] = a.astype(np.float32)
    return out
