"""The gateway's compact secure-aggregation encoding (issue 34): a 32-bit ring with as many fractional bits
as the sum of the session's clients leaves, so a secure round uploads at most 1.5x a plain one on the demo
model, and hostile fixed-point settings are refused with one line."""

from __future__ import annotations

import math

import numpy as np
import pytest
from _lbfleet import LoopbackFleet

from edgeflow.errors import ConfigError
from edgeflow.gateway.secure_rounds import DEFAULT_COMPACT_CLIP, session_config
from edgeflow.protocol.secagg import SecAggConfig


@pytest.mark.parametrize("n, clip", [(2, 4.0), (5, 4.0), (20, 4.0), (1000, 1.5), (65536, 1.0), (7, 1e-3)])
def test_compact_takes_every_fractional_bit_the_sum_leaves(n, clip):
    cfg = SecAggConfig.compact(n, 0.3, clip=clip)
    assert cfg.ring_bits == 32 and cfg.max_clients == max(n, 2)
    assert max(n, 2) * clip * 2.0 ** cfg.frac_bits < 2.0 ** 31  # no honest sum wraps
    if cfg.frac_bits == 30:  # the most a 32-bit ring has (sign bit and one integer bit)
        return
    with pytest.raises(ConfigError, match="overflows"):  # one more bit would
        SecAggConfig.for_clients(n, 0.3, ring_bits=32, frac_bits=cfg.frac_bits + 1, clip=clip)


@pytest.mark.parametrize("clip", [0.0, -4.0, math.inf, math.nan, True, "4"])
def test_compact_refuses_a_hostile_clip(clip):
    with pytest.raises(ConfigError, match="clip must be a number > 0"):
        SecAggConfig.compact(5, 0.3, clip=clip)


def test_compact_refuses_a_fleet_the_32_bit_ring_cannot_hold():
    with pytest.raises(ConfigError, match="do not fit a 32-bit ring; use ring_bits=64"):
        SecAggConfig.compact(1 << 20, 0.3, clip=4096.0)


def test_the_gateway_default_is_compact_and_explicit_settings_keep_the_old_encoding():
    cfg = session_config(20, {"max_dropout_fraction": 0.3})
    assert (cfg.ring_bits, cfg.clip, cfg.weight_cap, cfg.threshold) == (32, DEFAULT_COMPACT_CLIP, 10_000.0, 14)
    # a norm bound makes the clip exact: no honest weighted coordinate exceeds max(1, bound)
    assert session_config(20, {"norm_bound": 2.5}).clip == 2.5
    assert session_config(20, {}, strategy_clip=0.5).clip == 1.0
    legacy = session_config(20, {"ring_bits": 64})
    assert (legacy.ring_bits, legacy.frac_bits, legacy.clip) == (64, 32, 1024.0)
    assert session_config(20, {"clip": 8.0}).ring_bits == 64


def test_a_delta_beyond_the_compact_clip_is_refused_by_its_client_not_wrapped():
    """A hostile-sized honest delta (coordinate 1e4 at the full weight cap) cannot wrap the ring: its client
    refuses to mask it, the round finishes with the others."""
    def huge(delta, round_id):
        return {k: np.full_like(v, 1e4) for k, v in delta.items()}

    fleet = LoopbackFleet(5, config={"secagg": {"max_dropout_fraction": 0.4, "weight_cap": 120.0},
                                     "deadline_s": 3.0}, transform={0: huge})
    with fleet:
        (m,) = fleet.rounds.run(1)
        assert m.participants == 4 and m.extra["secagg_dropped"] == 1


def test_a_secure_round_uploads_at_most_1_5x_a_plain_round():
    """Same devices, same data, dense fp32 updates: the bytes each device publishes in a plain round and in a
    secure one (key advert, encrypted shares, share check, masked vector, unmask response; all signed)."""
    sent = {}
    for mode, extra in (("plain", {}), ("secure", {"secagg": {"max_dropout_fraction": 0.3}})):
        fleet = LoopbackFleet(5, config={"deadline_s": 10.0, "min_clients": 5, **extra})
        with fleet:
            (m,) = fleet.rounds.run(1)
            assert m.participants == 5
            sent[mode] = sum(c.stats.bytes_sent for c in fleet.clients) / 5
    assert sent["secure"] <= 1.5 * sent["plain"], sent


# ---- Shamir shares over GF(2^256 + 297): 33 bytes each ----------------------------------------


def test_shares_are_33_bytes_and_hostile_ones_are_refused():
    from edgeflow.errors import AggregationError
    from edgeflow.protocol.shamir import PRIME, SHARE_BYTES, Share, combine_shares, split_secret

    secret = bytes(range(32))
    shares = split_secret(b"\xff" * 32, 3, 5)  # the largest secret is a field element
    assert combine_shares(shares[1:4], 3) == b"\xff" * 32
    assert SHARE_BYTES == 33 and all(len(s.y_bytes()) == 33 for s in split_secret(secret, 3, 5))
    with pytest.raises(AggregationError, match="not a field element"):
        Share.from_y_bytes(1, (PRIME).to_bytes(33, "big"))  # y = p: outside the field
    with pytest.raises(AggregationError, match="not a field element"):
        Share.from_y_bytes(1, b"\xff" * 33)
    with pytest.raises(AggregationError, match="a Shamir share is 33 bytes, got 66"):
        Share.from_y_bytes(1, b"\x00" * 66)  # a share of the old GF(2^521 - 1) format
    with pytest.raises(ConfigError, match="at most 32 bytes"):
        split_secret(b"\x01" * 33, 2, 3)


def test_a_20_client_session_uploads_at_most_1_3x_the_dense_update_per_client():
    """Every message a client sends in a 20-client session (key advert, 19 encrypted share pairs, share check,
    masked vector, unmask response with 20 shares), sealed as the orchestrators seal them, against 4 bytes per
    parameter of the demo model. Before issue 34: 2.4x (64-bit ring, 66-byte shares); 32-bit ring alone: 1.40x."""
    from edgeflow import zoo
    from edgeflow.federated.secagg_client import SecAggClient
    from edgeflow.gateway.global_model import model_weights
    from edgeflow.gateway.secagg import SecAggServer
    from edgeflow.protocol import secagg_wire as wire
    from edgeflow.signing import Signer

    layout = model_weights(zoo.digits_mlp(seed=0))
    dense = 4 * sum(v.size for v in layout.values())
    server = SecAggServer(session_config(20, {}), layout, round_id=1)
    clients = [SecAggClient(f"dev{i:03d}") for i in range(20)]
    signer = Signer.generate("t")
    sent = {c.client_id: 0 for c in clients}

    def send(msg):
        sent[msg.client_id] += len(wire.seal(wire.encode(msg), signer))
        return wire.decode(wire.encode(msg))

    for c in clients:
        server.receive_advertise(send(c.advertise()))
    directory = server.key_directory()
    for c in clients:
        server.receive_share_keys(send(c.share_keys(directory)))
    bundles = server.share_bundles()
    for c in clients:
        server.receive_share_check(send(c.check_bundle(bundles[c.client_id])))
    final = server.final_holders()
    rng = np.random.default_rng(0)
    for c in clients:
        update = {k: (0.01 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in layout.items()}
        server.receive_masked_input(send(c.masked_input(final, update, weight=60.0)))
    request = server.unmask_request()
    for c in clients:
        server.receive_unmask(send(c.unmask(request)))
    assert server.finish().num_clients == 20
    assert max(sent.values()) <= 1.3 * dense, (max(sent.values()), dense)
