"""The device agent and its services (device/ota.py, training.py, telemetry.py, inference.py) over a
loopback hub: the wiring, and a stop that does not retry a connection its broker took away."""

from __future__ import annotations

import threading

from _lbdevices import lb_env, wait_until  # noqa: F401

from edgeflow.device.agent import DeviceAgent
from edgeflow.device.inference import InferenceService
from edgeflow.device.ota import OtaService
from edgeflow.device.telemetry import TelemetryService
from edgeflow.device.training import TrainingService
from edgeflow.transport.loopback import LinkState


class _Participant:
    """Stands in for edgeflow.federated.Client; ``stop`` can be held (a training thread finishing its round)."""

    def __init__(self, agent: DeviceAgent, hold: threading.Event | None = None) -> None:
        self.agent = agent
        self.hold = hold
        self.stopping = threading.Event()
        self.transport_state_at_stop: LinkState | None = None

    def start(self) -> None:
        pass

    def stop(self) -> None:
        self.transport_state_at_stop = self.agent.transport.state
        self.stopping.set()
        if self.hold is not None:
            self.hold.wait(10)

    def status(self) -> dict:
        return {"rounds_trained": 0}


def _training_agent(env, hold: threading.Event | None = None) -> tuple[DeviceAgent, list[_Participant]]:
    """A started agent that runs a participant (no model deployed: the service is told it may train)."""
    made: list[_Participant] = []
    a = env.agent(start=False)
    a.make_participant = lambda agent: made.append(_Participant(agent, hold)) or made[-1]
    a.training_service.blocker = lambda: None
    a.start()
    assert a.training and a.participant is made[0]
    return a, made


def test_the_agent_wires_its_services(lb_env):
    a = lb_env.agent()
    assert isinstance(a.ota, OtaService) and isinstance(a.training_service, TrainingService)
    assert isinstance(a.inference, InferenceService) and isinstance(a.telemetry, TelemetryService)
    assert a.train_status() == a.training_service.status() == a.training_service.blocker()
    assert a.train_status()[0] == "no_data" and not a.training and a.participant is None
    body = a.telemetry_body()
    assert (body["device"], body["train"], body["training"]) == (a.device_id, "no_data", False)
    assert body["queue_depth"] == 0


def test_set_config_reaches_the_telemetry_service(lb_env, tmp_path):
    a = lb_env.agent()
    battery = tmp_path / "battery"
    battery.write_text("42\n")
    a.set_config({"battery_file": str(battery)})
    assert a.telemetry.collector.battery_file == str(battery)
    assert a.telemetry_body()["battery"] == 0.42


def test_telemetry_seq_restarts_with_every_birth(lb_env):
    a = lb_env.agent(start=False)  # no telemetry thread to take numbers meanwhile
    first = a.telemetry_body()["seq"]
    assert a.telemetry_body()["seq"] == first + 1
    a.publish_birth()
    assert a.telemetry_body()["seq"] == 1


def test_a_board_without_its_broker_closes_the_transport_before_stopping_the_rest(lb_env):
    """The broker is gone when the stop begins: the transport is closed first, so it makes no
    reconnect attempt (each one a warning on a real broker) while the participant stops."""
    a, made = _training_agent(lb_env)
    lb_env.hub.disconnect(a.device_id, reconnect_after=2.0)
    a.stop(timeout=2.0)
    assert made[0].transport_state_at_stop is LinkState.CLOSED
    assert a.transport.stats().get("reconnects", 0) == 0


def test_a_connection_lost_while_stopping_is_not_retried(lb_env):
    """The broker dies while the board stops (``kill $(jobs -p)`` stops both): the transport is closed
    as soon as the loss is heard, not retried until the participant and the threads are done."""
    hold = threading.Event()
    a, made = _training_agent(lb_env, hold)
    stopper = threading.Thread(target=a.stop, kwargs={"timeout": 2.0})
    stopper.start()
    try:
        assert made[0].stopping.wait(5)
        assert made[0].transport_state_at_stop is LinkState.CONNECTED  # a live broker: the usual order
        lb_env.hub.disconnect(a.device_id, reconnect_after=2.0)
        closed = wait_until(lambda: a.transport.state is LinkState.CLOSED, 5)
    finally:
        hold.set()
        stopper.join(10)
    assert closed, "the transport kept its connection alive (reconnecting) while the agent stopped"
    assert a.transport.stats().get("reconnects", 0) == 0
    assert not stopper.is_alive()
