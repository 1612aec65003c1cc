"""Federated rounds without a broker: the real RoundManager and federated Clients over
loopback transports (tests/test_federated_rounds.py runs the same logic on Mosquitto)."""

from __future__ import annotations

import numpy as np
from _lbfleet import LoopbackFleet, flat_fedavg

from edgeflow.gateway.rounds import model_weights
from edgeflow.transport.topics import device_topic, gateway_topic


def test_two_rounds_are_exactly_fedavg_and_every_device_gets_the_model():
    fleet = LoopbackFleet(4, config={"rounds": 2})
    expected, befores = [], [dict(fleet.rounds.weights)]

    def on_round(m):  # before the next round is announced: the deltas are this round's
        expected.append(flat_fedavg(befores[-1], fleet.clients))
        befores.append(dict(fleet.rounds.weights))

    fleet.rounds.on_round = on_round
    with fleet:
        history = fleet.rounds.run()
        fleet.hub.settle()
        assert [(m.round_id, m.participants, m.selected, m.dropped) for m in history] == [(1, 4, 4, 0), (2, 4, 4, 0)]
        assert fleet.rounds.version == 3 and [m.model_version for m in history] == [2, 3]
        for got, want in zip(befores[1:], expected):
            for name in want:
                np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)
        # the new model is retained at the hub and reached every device
        assert set(fleet.hub.retained()) == {str(gateway_topic("lb", "model")), str(gateway_topic("lb", "round"))}
        for c in fleet.clients:
            assert c._version == 3 and c.stats.updates_sent == 2
            for name, w in fleet.rounds.weights.items():
                np.testing.assert_array_equal(c._weights[name], w)
        assert sum(m.bytes_in for m in history) == sum(c.stats.bytes_sent for c in fleet.clients)
        assert fleet.rounds.store.round(2).state == "closed"


def test_a_straggler_misses_the_deadline_and_the_round_closes_with_its_quorum():
    fleet = LoopbackFleet(4, config={"deadline_s": 1.0, "quorum": 0.6})
    slow = fleet.clients[3].device_id
    # the straggler's update reaches the broker after the deadline (a slow uplink)
    fleet.hub.delay(str(device_topic("lb", slow, "update")), 1.5)
    with fleet:
        start = model_weights(fleet.model)
        (m,) = fleet.rounds.run(1)
        assert (m.selected, m.participants, m.dropped) == (4, 3, 1)
        assert m.round_s >= 0.9  # it waited for the deadline, then closed with the quorum
        on_time = fleet.clients[:3]
        want = flat_fedavg(start, on_time)
        for name in want:
            np.testing.assert_allclose(fleet.rounds.weights[name], want[name], rtol=1e-5, atol=1e-6)
        fleet.hub.settle()  # the delayed update arrives: counted late, not folded in
        assert fleet.rounds.counters_total.get("late") == 1
        for name in want:
            np.testing.assert_allclose(fleet.rounds.weights[name], want[name], rtol=1e-5, atol=1e-6)


def test_a_device_that_vanishes_mid_round_is_dropped_and_not_selected_again():
    holder: list[LoopbackFleet] = []

    def vanish(delta, round_id):  # device 1 loses power right after training, before sending
        holder[0].vanish(1)
        return None

    fleet = LoopbackFleet(5, config={"rounds": 2, "deadline_s": 1.0, "quorum": 0.6}, transform={1: vanish})
    holder.append(fleet)
    with fleet:
        first, second = fleet.rounds.run()
        assert (first.selected, first.participants, first.dropped) == (5, 4, 1)
        assert (second.selected, second.participants, second.dropped) == (4, 4, 0)
        assert second.round_s < first.round_s  # nobody to wait for in the second round
        assert fleet.hub.connected() == sorted(f"lb-d{i}" for i in (0, 2, 3, 4)) + ["lb-gateway"]


def test_below_quorum_the_round_is_extended_then_fails_and_the_model_stays():
    def silent(delta, round_id):
        return None

    fleet = LoopbackFleet(4, config={"deadline_s": 0.5, "quorum": 0.75, "max_extensions": 1, "min_clients": 2},
                          transform={i: silent for i in range(3)})
    with fleet:
        before = {k: v.copy() for k, v in fleet.rounds.weights.items()}
        (m,) = fleet.rounds.run(1)
        assert m.participants == 0 and m.extra.get("failed") == 1.0
        assert fleet.rounds.store.round(1).state == "failed" and fleet.rounds.version == 1
        for k, v in fleet.rounds.weights.items():
            np.testing.assert_array_equal(v, before[k])


def test_redelivered_updates_count_once():
    """QoS 1 is at least once: the hub delivers every update twice; the gateway's
    (round, device) bookkeeping makes each count once."""
    from edgeflow.transport.loopback import LoopbackBroker

    hub = LoopbackBroker(duplicate_qos1=lambda m: m.topic.endswith("/update"))
    fleet = LoopbackFleet(3, hub=hub)
    start = model_weights(fleet.model)
    with fleet:
        (m,) = fleet.rounds.run(1)
        hub.settle()
        assert (m.participants, m.dropped) == (3, 0)
        assert hub.stats["duplicated"] == 3
        want = flat_fedavg(start, fleet.clients)
        for name in want:
            np.testing.assert_allclose(fleet.rounds.weights[name], want[name], rtol=1e-5, atol=1e-6)


def test_evaluation_is_a_hook_any_metric_any_backend():
    """The gateway's evaluation is the caller's: RoundManager(evaluator=...) gets each new global model."""
    from edgeflow.runtime.session import load

    split = __import__("_lbfleet").digits()
    seen = []

    def evaluator(model, data):  # e.g. per-class recall on the numpy backend of a board profile
        x, y = data
        pred = load(model, "raspberry-pi-4", backend="numpy", batch_size=len(x), allow_over_budget=True)(x).argmax(1)
        seen.append(model)
        return {"accuracy": float((pred == y).mean()), "recall_0": float((pred[y == 0] == 0).mean())}

    fleet = LoopbackFleet(3, config={"rounds": 1}, eval_data=(split.x_test[:200], split.y_test[:200]),
                          evaluator=evaluator)
    with fleet:
        (m,) = fleet.rounds.run()
    assert len(seen) == 1 and m.accuracy is not None and m.eval_loss is None
    assert 0.0 <= m.extra["eval_recall_0"] <= 1.0
    x, y = split.x_test[:200], split.y_test[:200]
    want = float((load(fleet.rounds.current_model(), "x86-gateway")(x).argmax(1) == y).mean())
    assert m.accuracy == want  # the hook's figure is the model's, not a default's


def test_the_default_evaluator_is_top1_accuracy_and_cross_entropy():
    from edgeflow.gateway.rounds import classification_metrics

    split = __import__("_lbfleet").digits()
    fleet = LoopbackFleet(2, eval_data=(split.x_test[:100], split.y_test[:100]))
    out = classification_metrics(fleet.model, (split.x_test[:100], split.y_test[:100]))
    assert set(out) == {"accuracy", "loss"} and 0 <= out["accuracy"] <= 1 and out["loss"] > 0
    assert fleet.rounds.evaluate() == (out["accuracy"], out["loss"])


def test_client_selection_is_a_hook():
    """RoundManager(selector=...) picks which eligible devices a round takes (e.g. the freshest batteries)."""
    picked = []

    def selector(eligible, n, rng):
        picked.append((sorted(c.device_id for c in eligible), n))
        return sorted(c.device_id for c in eligible)[-2:]  # the last two, always

    fleet = LoopbackFleet(4, config={"rounds": 1, "fraction": 0.5, "min_clients": 2}, selector=selector)
    with fleet:
        (m,) = fleet.rounds.run()
        assert fleet.rounds.store.round(1).selected == ["d2", "d3"]
    assert picked == [(["d0", "d1", "d2", "d3"], 2)]
    assert (m.selected, m.participants) == (2, 2)


def test_a_selector_that_picks_an_ineligible_device_is_one_clear_error():
    import pytest

    from edgeflow.errors import ConfigError
    from edgeflow.gateway.rounds import Candidate

    fleet = LoopbackFleet(2, selector=lambda eligible, n, rng: ["nobody"])
    with pytest.raises(ConfigError, match="not eligible"):
        fleet.rounds.select([Candidate("d0"), Candidate("d1")])


def _run_keeping(keep_bytes: int) -> tuple[dict[str, np.ndarray], int, list[int]]:
    """Two rounds of 6 devices whose open round keeps at most ``keep_bytes`` of checked updates; the
    model, the most the round held at once and the size of each checked update (tensors + envelope)."""
    fleet = LoopbackFleet(6, config={"rounds": 2})
    held, sizes = [0], []
    keep = fleet.rounds.open.keep

    def spy(upd):  # the round keeps an update, or not; what it holds after is what we watch
        keep(upd)
        sizes.append(sum(v.nbytes for v in upd.tensors.values()) + len(upd.payload))
        held[0] = max(held[0], fleet.rounds.open.kept_bytes)

    fleet.rounds.open.keep_bytes = keep_bytes
    fleet.rounds.open.keep = spy  # type: ignore[method-assign]
    with fleet:
        fleet.rounds.run()
        assert fleet.rounds.open.kept_bytes == 0  # released at the close
        return dict(fleet.rounds.weights), held[0], sizes


def test_the_open_round_keeps_decoded_updates_only_within_its_budget_and_the_model_is_the_same():
    """A round of 1,000 devices held every decoded update (256 MiB budget: the gateway grew 40.7 MB in
    benchmarks/round_scaling.py); what is not kept is re-read from the state at the close, and the
    model does not depend on which were kept."""
    everything, held_all, sizes = _run_keeping(1 << 30)
    assert len(sizes) == 12 and held_all == max(sum(sizes[:6]), sum(sizes[6:]))  # every update kept
    budget = 2 * max(sizes) + min(sizes) // 2
    two, held_two, _ = _run_keeping(budget)
    assert 2 * min(sizes) <= held_two <= budget  # two of six
    none, held_none, _ = _run_keeping(0)
    assert held_none == 0
    for name, w in everything.items():
        np.testing.assert_array_equal(two[name], w)
        np.testing.assert_array_equal(none[name], w)
    from edgeflow.gateway.open_round import KEEP_BYTES

    assert KEEP_BYTES <= 16 << 20  # the default bound is a few MB, whatever the fleet size
