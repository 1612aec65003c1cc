"""Secure aggregation: exact sums with dropouts, clear failure past the threshold,
masked inputs that reveal nothing recognisable, and Shamir sharing."""

from __future__ import annotations

import itertools
import secrets

import numpy as np
import pytest

from edgeflow.errors import AggregationError, ConfigError
from edgeflow.protocol.secagg import FixedPoint, MaskedInput, SecAggConfig, SecAggError, UnmaskRequest
from edgeflow.federated.secagg_client import SecAggClient
from edgeflow.gateway.secagg import SecAggServer
from edgeflow.protocol.shamir import Share, combine_shares, split_secret
from edgeflow.gateway.strategies import FedAvg

LAYOUT = {"conv.w": np.zeros((4, 3, 3), np.float32), "fc.w": np.zeros((36, 10), np.float32),
          "fc.b": np.zeros(10, np.float32)}


def _updates(n, seed=0):
    rng = np.random.default_rng(seed)
    return {f"dev-{i:02d}": {k: (0.05 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in LAYOUT.items()}
            for i in range(n)}


def _session(n, *, drop_before_masking=(), drop_during_unmask=(), weights=None, config=None, seed=0):
    """Run all four rounds; returns (server result, updates, server, masked inputs)."""
    ups = _updates(n, seed)
    cfg = config or SecAggConfig.for_clients(n, max_dropout_fraction=0.3)
    server = SecAggServer(cfg, LAYOUT, round_id=7)
    clients = {cid: SecAggClient(cid) for cid in ups}
    for c in clients.values():
        server.receive_advertise(c.advertise())
    directory = server.key_directory()
    for c in clients.values():
        server.receive_share_keys(c.share_keys(directory))
    bundles = server.share_bundles()
    masked = {}
    for cid, c in clients.items():
        if cid in drop_before_masking:
            continue
        msg = c.masked_input(bundles[cid], ups[cid], weight=(weights or {}).get(cid, 1.0))
        masked[cid] = msg.masked
        server.receive_masked_input(msg)
    request = server.unmask_request()
    for cid in request.survivors:
        if cid not in drop_during_unmask:
            server.receive_unmask(clients[cid].unmask(request))
    return server.finish(), ups, server, masked


def _plain_sum(ups, ids, weights=None):
    return {k: sum(ups[c][k].astype(np.float64) * (weights or {}).get(c, 1.0) for c in ids) for k in LAYOUT}


@pytest.mark.parametrize("dropped", [(), ("dev-03",), ("dev-01", "dev-06")])
def test_sum_is_exact_with_0_1_2_dropouts(dropped):
    n = 8  # tolerates 2 dropouts (threshold 6)
    res, ups, _, _ = _session(n, drop_before_masking=dropped)
    survivors = [c for c in ups if c not in dropped]
    assert res.survivors == tuple(survivors) and res.dropped == tuple(dropped)
    assert res.total_weight == len(survivors)
    ref = _plain_sum(ups, survivors)
    for k in LAYOUT:
        np.testing.assert_allclose(res.sum[k], ref[k], rtol=0, atol=len(survivors) * 2.0 ** -33)


def test_two_dropouts_gives_the_same_fedavg_as_plain_aggregation():
    weights = {f"dev-{i:02d}": float(10 + 7 * i) for i in range(8)}
    dropped = ("dev-02", "dev-05")
    res, ups, _, _ = _session(8, drop_before_masking=dropped, weights=weights)
    survivors = [c for c in ups if c not in dropped]
    plain = FedAvg(clip="off", sample_multiplier="off")  # a secagg sum is not bounded at the gateway
    plain.begin_round(LAYOUT, 0)
    for c in survivors:
        plain.add(ups[c], int(weights[c]), c)
    via_secagg = FedAvg()
    via_secagg.begin_round(LAYOUT, 0)
    via_secagg.add_partial({k: v.astype(np.float32) for k, v in res.sum.items()}, int(round(res.total_weight)),
                           num_clients=res.num_clients, client_id="secagg")
    a, b = plain.finish(), via_secagg.finish()
    assert b.total_samples == a.total_samples and b.num_clients == a.num_clients
    for k in LAYOUT:
        np.testing.assert_allclose(b.weights[k], a.weights[k], rtol=1e-6, atol=1e-8)
        np.testing.assert_allclose(res.mean()[k], a.delta[k], rtol=1e-5, atol=1e-8)


def test_dropouts_during_unmasking_are_tolerated_while_enough_answer():
    res, ups, _, _ = _session(8, drop_before_masking=("dev-00",), drop_during_unmask=("dev-04",))
    survivors = [c for c in ups if c != "dev-00"]  # dev-04's input counts: it was sent
    ref = _plain_sum(ups, survivors)
    for k in LAYOUT:
        np.testing.assert_allclose(res.sum[k], ref[k], atol=1e-8)


def test_too_many_dropouts_fail_clearly():
    with pytest.raises(SecAggError, match=r"only 5 of 8 clients sent masked input; at least 6 must survive .*"
                                          r"tolerates 2 dropouts"):
        _session(8, drop_before_masking=("dev-01", "dev-02", "dev-03"))
    with pytest.raises(SecAggError, match="only 5 unmask responses; 6 shares are needed"):
        _session(8, drop_before_masking=("dev-01",), drop_during_unmask=("dev-02", "dev-03"))
    assert issubclass(SecAggError, AggregationError)


def test_masked_inputs_look_uniform_and_hide_the_update():
    res, ups, _, masked = _session(8, drop_before_masking=("dev-07",))
    fp = SecAggConfig.for_clients(8).fixed_point

    def chi2(arr):
        counts = np.bincount(arr.view(np.uint8), minlength=256)
        expected = arr.nbytes / 256
        return float(((counts - expected) ** 2 / expected).sum())

    for cid, y in masked.items():
        plain = fp.encode(np.concatenate([ups[cid][k].ravel() for k in LAYOUT] + [np.ones(1)]))
        assert np.count_nonzero(y == plain) <= 1
        diff = y - plain  # the masks alone: they must look uniform too
        for arr in (y, diff):
            bits = np.unpackbits(arr.view(np.uint8))  # ~24k bits: std of the mean 0.0032
            assert abs(bits.mean() - 0.5) < 0.02
            assert chi2(arr) < 420  # 255 dof (std 22.6): a uniform stream fails with p < 1e-8
        assert chi2(plain) > 10_000  # the test has power: the clear encoding fails it badly
        # the top bits of a small update would be all 0 or all 1 in the clear
        top = (y >> np.uint64(56)).astype(np.uint8)
        assert 0.3 < np.mean(top >= 128) < 0.7
    # a partial sum (all survivors but one) is still masked
    partial = sum(list(masked.values())[:-1], np.zeros_like(next(iter(masked.values()))))
    assert abs(np.unpackbits(partial.view(np.uint8)).mean() - 0.5) < 0.02


def test_clients_refuse_requests_that_would_unmask_someone():
    ups = _updates(5)
    cfg = SecAggConfig.for_clients(5, max_dropout_fraction=0.2)  # threshold 4
    server = SecAggServer(cfg, LAYOUT)
    clients = {c: SecAggClient(c) for c in ups}
    for c in clients.values():
        server.receive_advertise(c.advertise())
    d = server.key_directory()
    for c in clients.values():
        server.receive_share_keys(c.share_keys(d))
    bundles = server.share_bundles()
    c0 = clients["dev-00"]
    for cid, c in clients.items():
        server.receive_masked_input(c.masked_input(bundles[cid], ups[cid]))
    ids = tuple(ups)
    with pytest.raises(SecAggError, match="both survived and dropped"):
        c0.unmask(UnmaskRequest(d.session_id, ids, ("dev-03",)))
    with pytest.raises(SecAggError, match="fewer than the threshold"):
        c0.unmask(UnmaskRequest(d.session_id, ids[:3], ids[3:]))
    with pytest.raises(SecAggError, match="does not partition"):
        c0.unmask(UnmaskRequest(d.session_id, ids[:4], ()))
    with pytest.raises(SecAggError, match="another session"):
        c0.unmask(UnmaskRequest(b"x" * 24, ids, ()))
    c0.unmask(UnmaskRequest(d.session_id, ids, ()))
    with pytest.raises(SecAggError, match="already answered"):  # a second, different request is refused
        c0.unmask(UnmaskRequest(d.session_id, ids[:4], ids[4:]))


def test_protocol_order_and_message_checks():
    ups = _updates(3)
    cfg = SecAggConfig(threshold=2, max_clients=3)
    server = SecAggServer(cfg, LAYOUT)
    clients = {c: SecAggClient(c) for c in ups}
    with pytest.raises(SecAggError, match="phase 'advertise', not 'share'"):
        server.share_bundles()
    for c in clients.values():
        server.receive_advertise(c.advertise())
    with pytest.raises(SecAggError, match="advertised twice"):
        server.receive_advertise(clients["dev-00"].advertise())
    d = server.key_directory()
    msgs = {cid: c.share_keys(d) for cid, c in clients.items()}
    with pytest.raises(SecAggError, match="already called"):
        clients["dev-00"].share_keys(d)
    for m in msgs.values():
        server.receive_share_keys(m)
    bundles = server.share_bundles()
    # a tampered ciphertext fails authentication at the recipient
    b = bundles["dev-01"]
    es = b.shares[0]
    bad = type(es)(es.sender, es.recipient, es.ciphertext[:-1] + bytes([es.ciphertext[-1] ^ 1]))
    with pytest.raises(SecAggError, match="fails authentication"):
        clients["dev-01"].masked_input(type(b)(b.recipient, b.session_id, (bad,) + b.shares[1:], b.share_holders),
                                       ups["dev-01"])
    wrong = dict(ups["dev-00"])
    wrong["fc.b"] = np.zeros(11, np.float32)
    with pytest.raises(SecAggError, match=r"'fc.b' has shape \(11,\)"):
        clients["dev-00"].masked_input(bundles["dev-00"], wrong)
    msg = clients["dev-00"].masked_input(bundles["dev-00"], ups["dev-00"])
    server.receive_masked_input(msg)
    with pytest.raises(SecAggError, match="twice"):
        server.receive_masked_input(msg)
    with pytest.raises(SecAggError, match="expected uint64"):
        server.receive_masked_input(type(msg)("dev-02", msg.session_id, msg.masked[:-1]))


def test_config_checks_overflow_and_threshold():
    with pytest.raises(ConfigError, match="fixed point overflows"):
        SecAggConfig(threshold=3, ring_bits=32, frac_bits=16, clip=1024.0, max_clients=100)
    with pytest.raises(ConfigError, match=r"\[0, 0.5\)"):
        SecAggConfig.for_clients(10, max_dropout_fraction=0.5)
    cfg = SecAggConfig.for_clients(10, 0.3)
    assert cfg.threshold == 7
    server = SecAggServer(SecAggConfig(threshold=2, max_clients=10), LAYOUT)
    for i in range(4):
        server.receive_advertise(SecAggClient(f"c{i}").advertise())
    with pytest.raises(SecAggError, match="must exceed n/2"):
        server.key_directory()


def test_32_bit_ring_works_with_a_smaller_range():
    cfg = SecAggConfig(threshold=4, ring_bits=32, frac_bits=16, clip=8.0, max_clients=6)
    res, ups, _, masked = _session(6, drop_before_masking=("dev-02",), config=cfg)
    assert next(iter(masked.values())).dtype == np.uint32
    ref = _plain_sum(ups, [c for c in ups if c != "dev-02"])
    for k in LAYOUT:
        np.testing.assert_allclose(res.sum[k], ref[k], atol=5 * 2.0 ** -17)


def test_fixed_point_roundtrip_and_clipping():
    fp = FixedPoint(64, 32, 4.0)
    x = np.array([-5.0, -4.0, -1e-10, 0.0, 1.5, 3.999, 100.0])
    np.testing.assert_allclose(fp.decode(fp.encode(x)), np.clip(x, -4, 4), atol=2.0 ** -33)


def test_shamir_any_threshold_subset_rebuilds_the_secret():
    secret = secrets.token_bytes(32)
    shares = split_secret(secret, 3, 5)
    for subset in itertools.combinations(shares, 3):
        assert combine_shares(list(subset), 3) == secret
    assert combine_shares(shares, 3) == secret  # extra shares are verified
    with pytest.raises(AggregationError, match="2 distinct shares cannot rebuild a secret shared 3-of-n"):
        combine_shares(shares[:2], 3)
    bad = shares[:3] + [Share(shares[3].x, (shares[3].y + 1))]
    with pytest.raises(AggregationError, match="inconsistent"):
        combine_shares(bad, 3)
    with pytest.raises(AggregationError, match="two different Shamir shares"):
        combine_shares([shares[0], Share(shares[0].x, shares[0].y + 1), shares[1]], 2)
    custom = split_secret(secret, 2, 3, xs=[5, 9, 11])
    assert [s.x for s in custom] == [5, 9, 11] and combine_shares(custom[1:], 2) == secret
    # fewer than threshold shares are information-theoretically useless: two
    # different secrets can give the same 2 shares of a 3-of-n split
    with pytest.raises(ConfigError):
        split_secret(secret, 4, 3)
    roundtrip = Share.from_y_bytes(shares[0].x, shares[0].y_bytes())
    assert roundtrip == shares[0]


def test_every_message_survives_the_wire_and_the_sum_is_still_exact():
    from edgeflow.protocol.secagg_wire import decode_message, encode_message

    def wire(msg):
        out = decode_message(encode_message(msg))
        assert type(out) is type(msg)
        return out

    ups = _updates(6, seed=3)
    cfg = SecAggConfig.for_clients(6, max_dropout_fraction=0.2)
    server = SecAggServer(cfg, LAYOUT, round_id=2)
    clients = {c: SecAggClient(c) for c in ups}
    for c in clients.values():
        server.receive_advertise(wire(c.advertise()))
    d = wire(server.key_directory())
    assert d == server._directory
    for c in clients.values():
        server.receive_share_keys(wire(c.share_keys(d)))
    bundles = {k: wire(v) for k, v in server.share_bundles().items()}
    for cid, c in clients.items():
        if cid != "dev-04":
            msg = wire(c.masked_input(bundles[cid], ups[cid], weight=2.0))
            assert msg.masked.dtype == np.uint64
            server.receive_masked_input(msg)
    req = wire(server.unmask_request())
    for cid in req.survivors:
        server.receive_unmask(wire(clients[cid].unmask(req)))
    res = server.finish()
    ref = _plain_sum(ups, [c for c in ups if c != "dev-04"], {c: 2.0 for c in ups})
    for k in LAYOUT:
        np.testing.assert_allclose(res.sum[k], ref[k], atol=1e-8)


def test_malformed_frames_raise_secagg_error():
    from edgeflow.protocol.secagg_wire import decode_message, encode_message

    good = encode_message(SecAggClient("dev-1").advertise())
    masked = encode_message(MaskedInput("d", b"s", np.arange(4, dtype=np.uint64)))

    def reframe(frame, edit):
        import json
        import struct

        n = struct.unpack_from(">I", frame, 6)[0]
        head = json.dumps(edit(json.loads(frame[10:10 + n]))).encode()
        return frame[:6] + struct.pack(">I", len(head)) + head + frame[10 + n:]
    cases = {
        "shorter than the frame header": good[:5],
        "bad magic": b"XXXX" + good[4:],
        "unsupported version": good[:4] + b"\x09" + good[5:],
        "unknown message kind": good[:5] + b"\x63" + good[6:],
        "header length exceeds": good[:6] + (10 ** 6).to_bytes(4, "big") + good[10:],
        "unexpected bytes after the header": good + b"x",
        "must be 32 bytes": reframe(good, lambda h: h | {"enc_public_key": "00" * 31}),
        "field 'client_id' must be a string": reframe(good, lambda h: h | {"client_id": 7}),
        "is not hex": reframe(good, lambda h: h | {"mask_public_key": "zz" * 32}),
        "payload is 31 bytes": masked[:-1],
        "not JSON": good[:10] + b"{" * (len(good) - 10),
    }
    for match, frame in cases.items():
        with pytest.raises(SecAggError, match=match):
            decode_message(frame)
    with pytest.raises(SecAggError, match="not a secure-aggregation message"):
        encode_message("hello")  # type: ignore[arg-type]
