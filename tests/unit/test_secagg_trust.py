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
