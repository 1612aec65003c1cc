"""Secure aggregation cannot be steered by one client's weight or update (issue 29).

Before: one client of 5 masking weight -1024 through the stock client took accuracy from 0.918 to 0.102
(the gateway divided by max(1, total weight)); honest weights 2000/100/100 summed to 1224 (the fixed
point clipped every coordinate to +-1024). Now each client's weight is capped by the gateway and
declared in the clear, the unmasked weight total must equal the declared ones exactly, the sum is
checked against the session's norm bound, and an honest weighted value beyond the fixed point is
refused, never clipped. Each hostile case is fed as the hostile client would send it: an honest masked
input with a ring offset added (masks are additive, so this is exactly masking other values).
"""

from __future__ import annotations

import numpy as np
import pytest
from _lbfleet import LoopbackFleet

from edgeflow.federated.secagg_client import SecAggClient
from edgeflow.gateway.secagg import SecAggServer
from edgeflow.protocol.secagg import MaskedInput, SecAggConfig, SecAggError

LAYOUT = {"w": np.zeros((6, 4), np.float32), "b": np.zeros(4, np.float32)}


def _ups(ids, seed=0, scale=0.05):
    rng = np.random.default_rng(seed)
    return {c: {k: (scale * rng.standard_normal(v.shape)).astype(np.float32) for k, v in LAYOUT.items()} for c in ids}


def _offset(cfg: SecAggConfig, vector: np.ndarray, weight: float) -> np.ndarray:
    """The ring offset that turns an honest masked input into one that masked ``+vector`` more and
    ``+weight`` more in its weight coordinate (what a hostile encoder sends)."""
    return cfg.fixed_point.encode(np.concatenate([vector, [weight]]))


def _session(cfg, weights, *, hostile=None, declared=None):
    """All four phases; ``hostile(cid, msg) -> msg`` rewrites one client's masked input."""
    ids = sorted(weights)
    ups = _ups(ids)
    server = SecAggServer(cfg, LAYOUT, round_id=3)
    clients = {c: SecAggClient(c) for c in ids}
    for c in clients.values():
        server.receive_advertise(c.advertise())
    d = server.key_directory()
    for c in clients.values():
        server.receive_share_keys(c.share_keys(d))
    bundles = server.share_bundles()
    refused = []
    for cid, c in clients.items():
        msg = c.masked_input(bundles[cid], ups[cid], weight=weights[cid])
        if hostile is not None:
            msg = hostile(cid, msg)
        try:
            server.receive_masked_input(msg)
        except SecAggError as exc:
            refused.append((cid, str(exc)))
    req = server.unmask_request()
    for cid in req.survivors:
        server.receive_unmask(clients[cid].unmask(req))
    return server.finish, ups, refused


def _mean(ups, weights, ids):
    tot = sum(weights[c] for c in ids)
    return {k: sum(ups[c][k].astype(np.float64) * weights[c] for c in ids) / tot for k in LAYOUT}


def test_honest_large_weights_are_exact_not_clipped():
    weights = {"a": 2000.0, "b": 100.0, "c": 100.0}
    for cfg in (SecAggConfig.for_clients(3, 0.0, weight_cap=2000.0),
                SecAggConfig.for_clients(3, 0.0, weight_cap=2000.0, ring_bits=32, frac_bits=16, clip=4.0,
                                         max_clients=16)):  # the documented compact setting
        finish, ups, refused = _session(cfg, weights)
        res = finish()
        assert not refused and res.total_weight == 2200.0
        want = _mean(ups, weights, "abc")
        tol = 2.0 ** -cfg.frac_bits * 3 * 2000 / 2200 * 4
        for k in LAYOUT:
            np.testing.assert_allclose(res.sum[k] / res.total_weight, want[k], atol=tol)


def test_without_a_weight_cap_a_weight_beyond_the_fixed_point_is_refused_not_clipped():
    cfg = SecAggConfig.for_clients(3, 0.0)  # legacy encoding: w * x and w, clip 1024
    with pytest.raises(SecAggError, match="beyond the session's fixed-point range"):
        _session(cfg, {"a": 2000.0, "b": 100.0, "c": 100.0})


def test_a_client_masking_a_negative_weight_fails_the_round_instead_of_steering_it():
    cfg = SecAggConfig.for_clients(5, 0.2, weight_cap=500.0)
    weights = {c: 100.0 for c in "abcde"}

    def hostile(cid, msg):  # declares 100 (as honest), masks -1024 instead
        if cid != "e":
            return msg
        delta = (-1024.0 - 100.0) / cfg.weight_cap
        off = _offset(cfg, np.zeros(msg.masked.size - 1), delta)
        return MaskedInput(msg.client_id, msg.session_id, msg.masked + off, msg.weight)

    finish, _, refused = _session(cfg, weights, hostile=hostile)
    assert not refused
    with pytest.raises(SecAggError, match="masked another weight than it declared"):
        finish()


@pytest.mark.parametrize("weight", [-1024.0, 501.0, float("nan"), float("inf"), None, True])
def test_a_declared_weight_out_of_range_leaves_that_client_out_and_the_rest_finish(weight):
    cfg = SecAggConfig.for_clients(5, 0.2, weight_cap=500.0)
    weights = {c: 10.0 * (i + 1) for i, c in enumerate("abcde")}

    def hostile(cid, msg):
        return MaskedInput(msg.client_id, msg.session_id, msg.masked, weight) if cid == "c" else msg

    finish, ups, refused = _session(cfg, weights, hostile=hostile)
    assert [r[0] for r in refused] == ["c"] and "weight cap" in refused[0][1]
    res = finish()
    assert res.dropped == ("c",) and res.total_weight == sum(weights[c] for c in "abde")
    want = _mean(ups, weights, "abde")
    for k in LAYOUT:
        np.testing.assert_allclose(res.sum[k] / res.total_weight, want[k], atol=1e-7)


def test_a_blown_up_update_is_refused_by_the_norm_bound():
    cfg = SecAggConfig.for_clients(5, 0.2, weight_cap=500.0, norm_bound=1.0)
    weights = {c: 100.0 for c in "abcde"}
    ups = _ups("abcde")
    size = sum(v.size for v in LAYOUT.values())

    def hostile(cid, msg):  # its real update times -1025: masks -1024x more than it should
        if cid != "a":
            return msg
        flat = np.concatenate([ups["a"][k].reshape(-1) for k in LAYOUT]).astype(np.float64)
        off = _offset(cfg, -1025.0 * flat * (100.0 / cfg.weight_cap), 0.0)
        assert off.size == size + 1
        return MaskedInput(msg.client_id, msg.session_id, msg.masked + off, msg.weight)

    finish, _, _ = _session(cfg, weights)
    finish()  # honest clients clip to the bound themselves: the check passes
    finish, _, _ = _session(cfg, weights, hostile=hostile)
    with pytest.raises(SecAggError, match="above the .* norm bound 1"):
        finish()


def test_a_hostile_weight_through_the_gateway_fails_the_round_and_keeps_the_model(monkeypatch):
    """End to end (RoundManager, real Clients, loopback transport): one of 5 devices masks weight -1024
    while declaring its real count; the round fails with the reason and no model is published."""
    real = SecAggClient.masked_input

    def masked_input(self, bundle, update, weight=1.0):
        msg = real(self, bundle, update, weight)
        if self.client_id != "d4":
            return msg
        cfg = self._directory.config
        off = _offset(cfg, np.zeros(msg.masked.size - 1), (-1024.0 - msg.weight) / cfg.weight_cap)
        return MaskedInput(msg.client_id, msg.session_id, msg.masked + off, msg.weight)

    monkeypatch.setattr(SecAggClient, "masked_input", masked_input)
    fleet = LoopbackFleet(5, config={"secagg": {"max_dropout_fraction": 0.2, "phase_timeout_s": 3.0},
                                     "deadline_s": 10.0})
    with fleet:
        before = {k: v.copy() for k, v in fleet.rounds.weights.items()}
        (m,) = fleet.rounds.run(1)
        rec = fleet.rounds.store.round(1)
        assert rec.state == "failed" and "masked another weight" in rec.metrics["reason"]
        assert fleet.rounds.version == 1
        for k, v in fleet.rounds.weights.items():
            np.testing.assert_array_equal(v, before[k])


# -- one client corrupting its key shares -----------------------------------------------------------


def _checked_session(n, *, corrupt=None, false_accuser=None, silent=()):
    """All phases with the share-check round. ``corrupt``: a client whose shares to the others are garbage;
    ``false_accuser``: a client that accuses an honest sender; ``silent``: clients that send no check."""
    from edgeflow.protocol.secagg import EncryptedShare, ShareCheck, ShareKeys

    ids = [f"c{i}" for i in range(n)]
    weights = {c: 10.0 for c in ids}
    ups = _ups(ids)
    cfg = SecAggConfig.for_clients(n, 0.4, weight_cap=100.0)
    server = SecAggServer(cfg, LAYOUT, round_id=4)
    clients = {c: SecAggClient(c) for c in ids}
    for c in clients.values():
        server.receive_advertise(c.advertise())
    d = server.key_directory()
    for cid, c in clients.items():
        sk = c.share_keys(d)
        if cid == corrupt:  # flip one byte of every ciphertext it sends: authentication fails at each recipient
            sk = ShareKeys(sk.client_id, sk.session_id, tuple(
                EncryptedShare(e.sender, e.recipient, e.ciphertext[:-1] + bytes([e.ciphertext[-1] ^ 1]))
                for e in sk.shares))
        server.receive_share_keys(sk)
    bundles = server.share_bundles()
    for cid, c in clients.items():
        if cid in silent:
            continue
        chk = c.check_bundle(bundles[cid])
        if cid == false_accuser:
            from edgeflow.protocol.secagg import priv_bytes

            chk = ShareCheck(cid, chk.session_id, ("c0",), priv_bytes(c._enc_key))
        server.receive_share_check(chk)
    final = server.final_holders()
    masked_by = [c for c in ids if c in final.holders]
    for cid in masked_by:
        server.receive_masked_input(clients[cid].masked_input(final, ups[cid], weight=weights[cid]))
    req = server.unmask_request()
    for cid in req.survivors:
        server.receive_unmask(clients[cid].unmask(req))
    return server.finish(), ups, final, server


def test_a_client_with_corrupted_shares_is_found_out_and_the_others_finish():
    res, ups, final, server = _checked_session(6, corrupt="c3")
    assert final.excluded == ("c3",) and "c3" not in final.holders
    assert "fails authentication" in server.guilty["c3"] and set(server.guilty) == {"c3"}
    want = _mean(ups, {c: 10.0 for c in ups}, [c for c in ups if c != "c3"])
    for k in LAYOUT:
        np.testing.assert_allclose(res.sum[k] / res.total_weight, want[k], atol=1e-7)


def test_a_false_accusation_excludes_the_accuser_not_the_accused():
    res, ups, final, server = _checked_session(6, false_accuser="c2")
    assert final.excluded == ("c2",) and "sound" in server.guilty["c2"] and "c0" in final.holders
    assert res.survivors == tuple(c for c in sorted(ups) if c != "c2")


def test_a_client_that_sends_no_check_is_left_out():
    _, _, final, _ = _checked_session(6, silent=("c5",))
    assert final.excluded == ("c5",)


def test_without_the_check_round_a_bad_share_still_stops_the_client():
    ids = ["a", "b", "c"]
    cfg = SecAggConfig.for_clients(3, 0.0)
    server = SecAggServer(cfg, LAYOUT, round_id=1)
    clients = {c: SecAggClient(c) for c in ids}
    for c in clients.values():
        server.receive_advertise(c.advertise())
    d = server.key_directory()
    from edgeflow.protocol.secagg import EncryptedShare, ShareKeys

    for cid, c in clients.items():
        sk = c.share_keys(d)
        if cid == "a":
            sk = ShareKeys(sk.client_id, sk.session_id, tuple(
                EncryptedShare(e.sender, e.recipient, bytes(len(e.ciphertext))) for e in sk.shares))
        server.receive_share_keys(sk)
    bundles = server.share_bundles()
    with pytest.raises(SecAggError, match="share from 'a' fails authentication"):
        clients["b"].masked_input(bundles["b"], _ups(["b"])["b"])


def test_corrupted_shares_through_the_gateway_leave_only_that_device_out(monkeypatch, caplog):
    """End to end: one of 5 devices sends garbage key shares. Before, every honest client aborted and the
    gateway's log blamed them; now the 4 honest ones finish the round and the log names the sender."""
    from edgeflow.protocol.secagg import EncryptedShare, ShareKeys

    real = SecAggClient.share_keys

    def share_keys(self, directory):
        sk = real(self, directory)
        if self.client_id != "d1":
            return sk
        return ShareKeys(sk.client_id, sk.session_id,
                         tuple(EncryptedShare(e.sender, e.recipient, bytes(len(e.ciphertext))) for e in sk.shares))

    monkeypatch.setattr(SecAggClient, "share_keys", share_keys)
    fleet = LoopbackFleet(5, config={"secagg": {"max_dropout_fraction": 0.2, "phase_timeout_s": 3.0},
                                     "deadline_s": 10.0})
    with fleet, caplog.at_level("WARNING", logger="edgeflow.gateway.rounds"):
        (m,) = fleet.rounds.run(1)
        assert fleet.rounds.store.round(1).state == "closed" and fleet.rounds.version == 2
    assert m.participants == 4 and m.extra["secagg_excluded"] == 1
    assert fleet.rounds.counters_total["rejected_secagg_shares"] == 1
    blamed = [r.getMessage() for r in caplog.records if "left out of the round" in r.getMessage()]
    assert len(blamed) == 1 and "d1 is left out" in blamed[0] and "fails authentication" in blamed[0]


def test_the_new_messages_round_trip_and_hostile_frames_are_refused():
    import json
    import struct

    from edgeflow.protocol.secagg import FinalHolders, ShareCheck
    from edgeflow.protocol.secagg_wire import decode_message, encode_message

    for msg in (ShareCheck("a", b"\x01" * 16), ShareCheck("a", b"\x01" * 16, ("b", "c"), b"\x07" * 32),
                FinalHolders(b"\x02" * 16, ("a", "b"), ("c",)), MaskedInput("a", b"s", np.arange(3, dtype=np.uint64),
                                                                           12.5)):
        back = decode_message(encode_message(msg))
        assert type(back) is type(msg) and back.__dict__.keys() == msg.__dict__.keys()

    def frame(kind, head):
        body = json.dumps(head).encode()
        return struct.pack(">4sBBI", b"EFSA", 1, kind, len(body)) + body

    bad = [
        frame(8, {"client_id": "a", "session_id": "00", "accused": ["b"], "enc_private_key": ""}),  # no evidence
        frame(8, {"client_id": "a", "session_id": "00", "accused": ["b"], "enc_private_key": "00" * 31}),
        frame(8, {"client_id": "a", "session_id": "00", "accused": ["b", "b"], "enc_private_key": "00" * 32}),
        frame(8, {"client_id": "a", "session_id": "00", "accused": [1], "enc_private_key": "00" * 32}),
        frame(9, {"session_id": "00", "holders": "ab", "excluded": []}),
        frame(5, {"client_id": "a", "session_id": "00", "bits": 64, "length": 0, "weight": "heavy"}),
        frame(2, {"session_id": "00", "round_id": 1, "config": {"threshold": 2, "ring_bits": 64, "frac_bits": 32,
                                                               "clip": 1.0, "max_clients": 4, "weight_cap": -5},
                  "participants": [], "layout": []}),
    ]
    for b in bad:
        with pytest.raises(SecAggError, match="malformed"):
            decode_message(b)
