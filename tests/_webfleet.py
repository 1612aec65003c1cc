"""A small running fleet for the web-view tests (no broker): real federated rounds, a real fleet registry with
device agents, one OTA rollout, and a hostile device record, all on one loopback hub.

    from _webfleet import web_fleet, HOSTILE_ID

``web_fleet(tmp_path)`` yields a :class:`WebFleet`: ``server`` (a started WebServer on 127.0.0.1, any port),
``rounds`` (2 closed rounds, with eval data so accuracy is reported), ``fm`` (the FleetManager, 2 agents
online with telemetry, one completed rollout of model v1), ``store`` (shared by both, as in a Gateway),
``heard`` (a :class:`Heard`: what a client of the hub received, live, on the topics the gateway writes, from
just after the server attached: the figure ``edgeflow_published_bytes`` must match).
``server_kw`` goes to the WebServer (``tls_cert``, ``tls_key``, ``operators``... for the dashboard's actions).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

sys.path.insert(0, str(Path(__file__).parent / "unit"))

from _lbdevices import FLEET, PROFILE, LoopbackFleetEnv, artifact, wait_until  # noqa: E402
from _lbfleet import LoopbackFleet, digits  # noqa: E402

HOSTILE_ID = '<img src=x onerror="window.__pwned=1">dev'
"""A device id as a hostile registry row could carry it (the broker's topics refuse it; the store does not)."""
HOSTILE_PROFILE = "<script>window.__pwned=2</script>"
HOSTILE_BACKEND = "</td><b id=injected>bold</b>"


class WebFleet(SimpleNamespace):
    pass


class Heard:
    """Payload bytes and messages heard live (not from the retained store) by channel, as a subscriber gets them."""

    def __init__(self) -> None:
        import threading

        self.bytes: dict[str, int] = {}
        self.messages: dict[str, int] = {}
        self._lock = threading.Lock()

    def __call__(self, msg: Any) -> None:
        if msg.retain:
            return  # sent before this subscriber came
        kind = msg.topic.split("/", 3)[3].replace("/", "_")
        with self._lock:
            self.bytes[kind] = self.bytes.get(kind, 0) + len(msg.payload)
            self.messages[kind] = self.messages.get(kind, 0) + 1

    def snapshot(self) -> tuple[dict[str, int], dict[str, int]]:
        with self._lock:
            return dict(self.bytes), dict(self.messages)


@contextlib.contextmanager
def web_fleet(tmp_path: Path, *, rounds: int = 2, agents: int = 2, listen: str = "127.0.0.1:0",
              **server_kw: Any) -> Iterator[Any]:
    from edgeflow.gateway.web import WebServer

    split = digits()
    lb = LoopbackFleet(3, fleet=FLEET, config={"rounds": rounds}, eval_data=(split.x_test, split.y_test))
    env = LoopbackFleetEnv(tmp_path, hub=lb.hub)
    store = lb.rounds.store
    server = ear = None
    try:
        lb.start()
        fm = env.gateway(store=store)
        ids = [env.agent().device_id for _ in range(agents)]
        assert fm.wait_online(ids, timeout=20), "the agents did not come online"
        store.upsert_birth(HOSTILE_ID, {"profile": HOSTILE_PROFILE, "backend": HOSTILE_BACKEND, "can_train": False},
                           profile=HOSTILE_PROFILE)
        store.set_online(HOSTILE_ID, False)
        target = SimpleNamespace(rounds=lb.rounds, fleet=fm, store=store, transport=lb.gateway_transport,
                                 fleet_id=FLEET)
        server = WebServer(target, listen, **server_kw).start()
        heard = Heard()
        ear = lb.hub.transport(f"{FLEET}-ear")
        ear.connect()
        for channel in ("gateway/#", "+/ota", "+/cmd"):
            ear.subscribe(f"edgeflow/{FLEET}/{channel}", heard)
        report = fm.deploy({PROFILE: artifact(env, 1)}, to="all")
        assert report.state == "completed", report.to_dict()
        lb.rounds.run(rounds)
        assert wait_until(lambda: all(fm.latest_telemetry(d) for d in ids), 20), "no telemetry from the agents"
        yield WebFleet(server=server, url=server.url, rounds=lb.rounds, fm=fm, store=store, agents=ids, lb=lb,
                       env=env, report=report, heard=heard)
    finally:
        if server is not None:
            server.stop()
        if ear is not None:
            ear.close(timeout=1)
        env.close()
        lb.close()
