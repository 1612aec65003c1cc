"""Federated evaluate rounds (Flower's ``fraction_evaluate``, issue 29): after each round, a drawn share of
the fleet evaluates the published model on its own data; the signed reports pass one rule
(gateway/intake.py ``check_evaluation``) and their weighted mean joins the round's metrics, in the store
and in the history. Real RoundManager and Clients on a loopback hub; hostile reports sent as they would
arrive."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
from _lbfleet import LoopbackFleet

from edgeflow.errors import CodecError, ConfigError, SignatureError
from edgeflow.gateway.evaluate_rounds import aggregate_evaluations
from edgeflow.gateway.intake import RoundView, check_evaluation
from edgeflow.gateway.rounds import Candidate, RoundConfig
from edgeflow.protocol.rounds import EvaluationReport
from edgeflow.protocol.signed_json import sign_body
from edgeflow.signing import KeyRing, Signer


def test_each_round_is_evaluated_by_a_drawn_share_and_the_figures_are_the_weighted_mean():
    cfg = {"rounds": 2, "min_clients": 4, "fraction_evaluate": 0.5, "min_evaluate_clients": 2,
           "evaluate_deadline_s": 20}
    with LoopbackFleet(4, config=cfg) as fleet:
        history = fleet.rounds.run()
        final = {k: np.array(v) for k, v in fleet.rounds.weights.items()}
        chosen, eligible = fleet.rounds.evaluate_rounds.select(history[-1].round_id)
        stored = {r.round_id: r.metrics for r in fleet.rounds.store.rounds()}
        by_id = {c.device_id: c for c in fleet.clients}
        expected = []
        for d in chosen:  # the selected devices' own evaluation of the final model, recomputed here
            c = by_id[d]
            c.trainer.set_weights(final)
            loss, acc = c.trainer.evaluate(c.x, c.y)
            expected.append((len(c.y), loss, acc))
    assert len(history) == 2 and eligible == 4 and len(chosen) == 2
    for m in history:
        e = m.extra
        assert e["dist_eval_selected"] == 2 and e["dist_eval_clients"] == 2 and e["dist_eval_rejected"] == 0
        assert math.isfinite(e["dist_eval_loss"]) and 0 <= e["dist_eval_accuracy"] <= 1
        for k in ("dist_eval_loss", "dist_eval_accuracy", "dist_eval_examples"):  # stored with the round
            assert stored[m.round_id][k] == pytest.approx(e[k])
        assert json.dumps(m.to_dict())  # the metrics.jsonl line carries them too
    n = sum(x[0] for x in expected)
    last = history[-1].extra
    assert last["dist_eval_examples"] == n
    assert last["dist_eval_loss"] == pytest.approx(sum(k * loss for k, loss, _ in expected) / n, rel=1e-6)
    assert last["dist_eval_accuracy"] == pytest.approx(sum(k * a for k, _, a in expected) / n, rel=1e-6)
    assert sum(c.stats.evaluations_sent for c in fleet.clients) == 4


def test_too_few_devices_skip_the_evaluate_round_and_say_so():
    cfg = {"rounds": 1, "min_clients": 2, "fraction_evaluate": 1.0, "min_evaluate_clients": 3}
    with LoopbackFleet(2, config=cfg) as fleet:
        (m,) = fleet.rounds.run()
    assert m.extra["dist_eval_skipped"] == 1.0 and "dist_eval_loss" not in m.extra


@pytest.mark.parametrize("bad, line", [
    ({"fraction_evaluate": 1.5}, "fraction_evaluate must be in [0, 1]"),
    ({"fraction_evaluate": "half"}, "fraction_evaluate must be a number"),
    ({"min_evaluate_clients": 0}, "min_evaluate_clients must be >= 1"),
    ({"evaluate_deadline_s": -1.0}, "evaluate_deadline_s must be > 0"),
    ({"fraction_evaluate": 0.5, "mode": "async"}, "fraction_evaluate needs mode 'sync'"),
])
def test_bad_evaluate_settings_are_one_line(bad, line):
    with pytest.raises(ConfigError, match=line.replace("[", r"\[").replace("]", r"\]")):
        RoundConfig(**bad)


# --- the rule, with the hostile reports ------------------------------------------------------------

D = Signer.generate("d1")
OTHER = Signer.generate("d2")
RING = KeyRing()
RING.register(D.device_id, D.public_key)
RING.register(OTHER.device_id, OTHER.public_key)
RND = RoundView(5, 7, frozenset({"d1", "d2"}), "abcd", "evaluate", True)


def _report(**kw) -> dict:
    return {"round_id": 5, "nonce": "abcd", "model_version": 7, "loss": 0.5, "num_examples": 10,
            "metrics": {"accuracy": 0.9}, **kw}


def _check(payload: bytes, sender: str = "d1", rnd: RoundView | None = RND, reported=lambda d: False):
    return check_evaluation(payload, rnd, sender, keyring=RING, reported=reported)


def test_an_honest_report_passes():
    rep = _check(EvaluationReport(**_report()).sign(D.key))
    assert (rep.loss, rep.num_examples, rep.metrics) == (0.5, 10, {"accuracy": 0.9})


@pytest.mark.parametrize("payload, kw, reason", [
    (lambda: EvaluationReport(**_report()).sign(OTHER.key), {}, "wrong_key"),  # d2's key on d1's topic
    (lambda: EvaluationReport(**_report(nonce="ffff")).sign(D.key), {}, "wrong_round"),  # a replay of another round
    (lambda: EvaluationReport(**_report(round_id=4)).sign(D.key), {}, "wrong_round"),
    (lambda: EvaluationReport(**_report(model_version=6)).sign(D.key), {}, "wrong_version"),
    (lambda: sign_body(_report(loss=float("nan")), D.key, "evaluate/v1"), {}, "bad_metadata"),
    (lambda: sign_body(_report(num_examples=0), D.key, "evaluate/v1"), {}, "bad_metadata"),
    (lambda: sign_body(_report(num_examples=2**40), D.key, "evaluate/v1"), {}, "bad_metadata"),
    (lambda: sign_body(_report(metrics={"x" * 65: 1.0}), D.key, "evaluate/v1"), {}, "bad_metadata"),
    (lambda: sign_body(_report(metrics={"acc": "h" * 257}), D.key, "evaluate/v1"), {}, "bad_metadata"),  # text is kept, bounded
    (lambda: sign_body(_report(), D.key, "round/v1"), {}, "bad_signature"),  # signed for another purpose
    (lambda: b"\xff" * 40, {}, "bad_message"),
    (lambda: EvaluationReport(**_report()).sign(D.key), {"sender": "d9"}, "not_selected"),
    (lambda: EvaluationReport(**_report()).sign(D.key), {"reported": lambda d: True}, "duplicates"),
    (lambda: EvaluationReport(**_report()).sign(D.key), {"rnd": None}, "late"),
    (lambda: EvaluationReport(**_report()).sign(D.key), {"rnd": RoundView(5, 7, frozenset({"d1"}), "abcd",
                                                                          "evaluate", False)}, "late"),
])
def test_hostile_reports_are_refused_with_their_reason(payload, kw, reason):
    with pytest.raises((CodecError, SignatureError)) as e:
        _check(payload(), **kw)
    assert getattr(e.value, "reason", None) == reason, e.value


def test_hostile_reports_on_the_wire_are_counted_and_never_averaged():
    """Through the gateway's subscription handler while an evaluate round is open: only the honest
    report counts; the forged and the replayed ones are counted as rejected."""
    cfg = {"rounds": 1, "min_clients": 2, "fraction_evaluate": 1.0, "min_evaluate_clients": 2,
           "evaluate_deadline_s": 3.0}
    fleet = LoopbackFleet(2, config=cfg)
    ev = fleet.rounds.evaluate_rounds
    d0 = fleet.clients[0].signer
    sent: list = []

    def publish_round(ann):  # the moment the evaluate round opens, the attacker and one honest device answer
        if ann.mode == "evaluate" and ann.state == "open":
            base = dict(round_id=ann.round_id, nonce=ann.nonce, model_version=ann.model_version, num_examples=5,
                        metrics={"accuracy": 1.0})
            for topic_dev, payload in [
                ("d1", EvaluationReport(**base, loss=-1e9).sign(d0.key)),  # d0 signs in d1's name
                ("d0", EvaluationReport(**{**base, "nonce": "0" * 16}, loss=0.0).sign(d0.key)),  # replayed round
                ("d0", EvaluationReport(**base, loss=0.25).sign(d0.key)),  # honest
                ("d0", EvaluationReport(**base, loss=0.0).sign(d0.key)),  # twice
            ]:
                ev.on_report(SimpleNamespace(topic=f"edgeflow/lb/{topic_dev}/evaluate", payload=payload))
                sent.append(topic_dev)
        return True

    fleet.rounds.publish_round = publish_round  # the devices never hear the round: only the messages above
    fleet.rounds.candidates = lambda: [Candidate("d0"), Candidate("d1")]
    fleet.rounds.version = 3
    out = ev.run(round_id=1)
    fleet.rounds.store.close()
    assert len(sent) == 4
    assert out["dist_eval_clients"] == 1 and out["dist_eval_loss"] == 0.25
    assert out["dist_eval_rejected"] == 2 and out["dist_eval_selected"] == 2


def test_the_aggregation_is_flowers_weighted_average_or_the_users_function():
    reps = [EvaluationReport(1, "n", 1, 1.0, 10, {"acc": 0.5}), EvaluationReport(1, "n", 1, 4.0, 30, {"acc": 0.9})]
    out = aggregate_evaluations(reps)
    assert out["dist_eval_loss"] == pytest.approx((10 * 1.0 + 30 * 4.0) / 40)
    assert out["dist_eval_acc"] == pytest.approx((10 * 0.5 + 30 * 0.9) / 40)
    mine = aggregate_evaluations(reps, lambda rs: {"best": max(m["acc"] for _, m in rs)})
    assert mine["dist_eval_best"] == 0.9 and "dist_eval_acc" not in mine
