"""The NumPyClient seam without a broker: users' own fit/evaluate behind the real federated
Client and the real gateway RoundManager, over loopback transports (the same seam over
Mosquitto, with a PyTorch training loop: tests/test_numpy_client_mosquitto.py)."""

from __future__ import annotations

import numpy as np
import pytest
from _lbdevices import wait_until
from _lbfleet import LoopbackFleet

import edgeflow
from edgeflow.errors import EdgeflowError
from edgeflow.federated.numpy_client import NumPyClient, check_fit


class Shift(NumPyClient):
    """A training loop with a known answer: every weight moves by ``step``, ``n`` examples."""

    def __init__(self, step: float, n: int) -> None:
        self.step, self.n = step, n
        self.seen: list[dict[str, np.ndarray]] = []
        self.configs: list[dict] = []

    def fit(self, parameters, config):
        self.configs.append(dict(config))
        return {k: v + np.float32(self.step) for k, v in parameters.items()}, self.n, {"loss": self.step}

    def evaluate(self, parameters, config):
        self.seen.append({k: v.copy() for k, v in parameters.items()})
        return 0.5, self.n, {"accuracy": 0.25}


def test_two_rounds_carry_the_users_fit_and_evaluate_exactly():
    # moves within 1.5x of their median norm: FedAvg's default norm bound leaves them alone
    apps = [Shift(0.01, 10), Shift(0.012, 30), Shift(-0.014, 60)]
    fleet = LoopbackFleet(3, apps=apps, config={"rounds": 2, "min_clients": 3})
    w0 = {k: v.copy() for k, v in fleet.rounds.weights.items()}
    after: list[dict[str, np.ndarray]] = []
    fleet.rounds.on_round = lambda m: after.append({k: v.copy() for k, v in fleet.rounds.weights.items()})
    with fleet:
        history = fleet.rounds.run()
    assert [(m.participants, m.dropped) for m in history] == [(3, 0), (3, 0)]
    step = (10 * 0.01 + 30 * 0.012 + 60 * -0.014) / 100  # FedAvg of the moves, weighted by num_examples
    for r, want_base in ((0, w0), (1, after[0])):
        for name, w in want_base.items():
            np.testing.assert_allclose(after[r][name], w + step, rtol=0, atol=1e-6, err_msg=f"round {r + 1} {name}")
    for app in apps:  # evaluate saw exactly the global model of each round, before fit
        assert len(app.seen) == 2
        for seen, want in zip(app.seen, (w0, after[0])):
            for name in want:
                np.testing.assert_array_equal(seen[name], want[name])
        assert app.configs[0]["round_id"] == 1 and app.configs[1]["round_id"] == 2
        assert app.configs[0]["epochs"] == 1 and app.configs[0]["batch_size"] == 16
    c = fleet.clients[1]
    assert c.last_fit == {"round_id": 2, "num_examples": 30, "metrics": {"loss": pytest.approx(0.012)}}
    assert c.last_evaluate == {"round_id": 2, "loss": 0.5, "num_examples": 30, "metrics": {"accuracy": 0.25}}
    # the gateway got the fit losses (the metrics travel in the update's metadata)
    assert history[0].mean_client_loss == pytest.approx((0.01 + 0.012 - 0.014) / 3, abs=1e-6)


class FitOnly(NumPyClient):
    def fit(self, parameters, config):
        return parameters, 5, None


def test_an_app_without_evaluate_only_fits():
    apps = [FitOnly(), FitOnly()]
    assert not apps[0].evaluates and Shift(0.0, 1).evaluates
    fleet = LoopbackFleet(2, apps=apps)
    with fleet:
        (m,) = fleet.rounds.run()
    assert m.participants == 2 and all(c.last_evaluate is None for c in fleet.clients)


class WrongShape(Shift):
    def fit(self, parameters, config):
        out = {k: v for k, v in parameters.items()}
        out["fc0.bias"] = np.zeros(3, np.float32)
        return out, 5, {}


class Raises(Shift):
    def fit(self, parameters, config):
        raise RuntimeError("CUDA out of memory")


def test_a_broken_fit_fails_the_devices_round_with_a_clear_reason():
    fleet = LoopbackFleet(3, apps=[Shift(0.01, 5), WrongShape(0.0, 5), Raises(0.0, 5)],
                          config={"min_clients": 1, "deadline_s": 2.0, "quorum": 0.3})
    with fleet:
        (m,) = fleet.rounds.run()
    assert m.participants == 1
    assert any("WrongShape.fit returned 'fc0.bias' with shape (3,), it was given (64,)" in e
               for e in fleet.clients[1].stats.errors), fleet.clients[1].stats.errors
    assert any("Raises.fit raised RuntimeError: CUDA out of memory" in e for e in fleet.clients[2].stats.errors)
    assert fleet.clients[1].stats.updates_sent == 0 and fleet.clients[2].stats.updates_sent == 0


class Local(Shift):
    def __init__(self, shapes):
        super().__init__(0.0, 1)
        self.shapes = shapes

    def get_parameters(self, config):
        return {k: np.zeros(s, np.float32) for k, s in self.shapes.items()}


def test_a_global_model_that_does_not_fit_the_apps_parameters_is_refused():
    apps = [Local({"fc0.weight": (64, 64)}), Local({})]
    fleet = LoopbackFleet(2, apps=apps)
    apps[1].shapes = {**{k: v.shape for k, v in fleet.rounds.weights.items()}, "fc0.weight": (2, 2)}
    with fleet:
        assert fleet.rounds.publish_model()
        assert wait_until(lambda: fleet.clients[1].state == "model_mismatch", 5)
        assert wait_until(lambda: fleet.clients[0].state == "model_mismatch", 5)
    assert "it has weight(s) ['fc0.bias', 'fc1.bias', 'fc1.weight']" in fleet.clients[0].state_detail
    assert "weight 'fc0.weight' is (64, 64) there and (2, 2) here" in fleet.clients[1].state_detail


def test_check_fit_and_the_client_refuse_bad_input_with_one_line():
    given = {"w": np.zeros(2, np.float32)}
    with pytest.raises(EdgeflowError, match=r"must return \(parameters, num_examples, metrics\)"):
        check_fit([given, 1, {}], given, "A.fit")
    with pytest.raises(EdgeflowError, match="num_examples=0"):
        check_fit((given, 0, {}), given, "A.fit")
    with pytest.raises(EdgeflowError, match="metric 'acc' = nan"):
        check_fit((given, 1, {"acc": float("nan")}), given, "A.fit")
    with pytest.raises(EdgeflowError, match="non-finite"):
        check_fit(({"w": np.array([np.inf, 0], np.float32)}, 1, {}), given, "A.fit")
    from edgeflow.signing import PrivateKey, Signer
    from edgeflow.transport.loopback import LoopbackBroker

    t = LoopbackBroker().transport("x")
    s = Signer.generate("d0")
    with pytest.raises(EdgeflowError, match="either app="):
        edgeflow.Client(t, fleet="f", device_id="d0", signer=s, fleet_key=PrivateKey.generate().public_key,
                        app=Shift(0, 1), model=object(), data=(np.zeros(1), np.zeros(1)))
    with pytest.raises(EdgeflowError, match="must be an edgeflow.NumPyClient"):
        edgeflow.Client(t, fleet="f", device_id="d0", signer=s, fleet_key=PrivateKey.generate().public_key,
                        app=object())


class Reporting(Shift):
    """Fit and evaluate metrics that differ per client, to check how the gateway aggregates them."""

    def __init__(self, step: float, n: int, acc: float, loss: float) -> None:
        super().__init__(step, n)
        self.acc, self.eval_loss = acc, loss

    def fit(self, parameters, config):
        params, n, _ = super().fit(parameters, config)
        return params, n, {"loss": self.step, "lr_used": 0.1 * n}

    def evaluate(self, parameters, config):
        super().evaluate(parameters, config)
        return self.eval_loss, 2 * self.n, {"accuracy": self.acc}


def test_the_clients_fit_and_evaluate_metrics_are_kept_with_the_round():
    """Issue 29: the gateway read only `loss`; every numeric fit metric and each client's evaluation of the
    model it trained from are now aggregated by example count and stored with the round."""
    apps = [Reporting(0.01, 10, 0.5, 1.0), Reporting(0.012, 30, 0.9, 0.2)]
    fleet = LoopbackFleet(2, apps=apps, config={"rounds": 1, "min_clients": 2})
    with fleet:
        (m,) = fleet.rounds.run()
        stored = fleet.rounds.store.round(1).metrics
    assert m.extra["fit_lr_used"] == pytest.approx((10 * 1.0 + 30 * 3.0) / 40)
    assert m.extra["fit_loss"] == pytest.approx((10 * 0.01 + 30 * 0.012) / 40)
    assert m.extra["fed_eval_clients"] == 2 and m.extra["fed_eval_examples"] == 80
    assert m.extra["fed_eval_loss"] == pytest.approx((20 * 1.0 + 60 * 0.2) / 80)
    assert m.extra["fed_eval_accuracy"] == pytest.approx((20 * 0.5 + 60 * 0.9) / 80)
    assert stored["fed_eval_accuracy"] == pytest.approx(m.extra["fed_eval_accuracy"])  # in the state too


def test_a_users_metrics_aggregation_function_is_used():
    apps = [Reporting(0.01, 10, 0.5, 1.0), Reporting(0.012, 30, 0.9, 0.2)]
    seen = []

    def worst(results):
        seen.append(results)
        return {"accuracy_min": min(m["accuracy"] for _, m in results)}

    fleet = LoopbackFleet(2, apps=apps, config={"rounds": 1, "min_clients": 2}, evaluate_metrics_fn=worst)
    with fleet:
        (m,) = fleet.rounds.run()
    assert m.extra["fed_eval_accuracy_min"] == 0.5 and sorted(n for n, _ in seen[0]) == [20, 60]
