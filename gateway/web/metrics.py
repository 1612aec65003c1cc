"""Prometheus metrics of a gateway (``/metrics``), from what :class:`~.view.WebView` reads.

Conventions: every name starts with ``edgeflow_``, carries its unit (``_seconds``, ``_bytes``, ``_ratio``),
counters end in ``_total``; labels have bounded values (a state, a profile name from the built-in profiles
or "other", a reason code, a codec): never a device id. The list with meanings is docs/operations.md.

Round figures are counted as rounds close (the ``on_round`` callback, through the view); fleet and rollout
figures are read at scrape time (the registry, ``FleetManager.stats()``, the rollout reports), and so are the
bytes the gateway published (the view's :class:`~.view.PublishLog`) and the ingestion workers' refusals. Each server
has its own :class:`prometheus_client.CollectorRegistry`, so several gateways in one process (tests) do not
collide.
"""

from __future__ import annotations

from typing import Any, Iterator

from edgeflow.errors import ConfigError

from .view import WebView, bounded_label

ROUND_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800)
AGG_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
STORE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5)
MAX_VERSIONS = 8
"""Model versions shown as labels of edgeflow_devices (the newest; older ones are "older")."""


def require_prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError:
        raise ConfigError("--http / [http] needs prometheus_client: pip install 'edgeflow[web]' "
                          "(or pip install prometheus_client)") from None
    return prometheus_client


def _profiles() -> set[str]:
    try:
        from edgeflow.profiles import list_profiles

        return set(list_profiles())
    except Exception:  # noqa: BLE001 - no profile list: every profile label becomes "other"
        import logging

        logging.getLogger("edgeflow.gateway.web").warning("profile list unavailable; profiles shown as 'other'")
        return set()


class GatewayMetrics:
    """The registry behind ``/metrics`` for one :class:`WebView`."""

    def __init__(self, view: WebView) -> None:
        pc = require_prometheus()
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.pc = pc
        self.view = view
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.round_seconds = Histogram("edgeflow_round_duration_seconds", "Wall time of a round, announce to commit",
                                       buckets=ROUND_BUCKETS, registry=r)
        self.agg_seconds = Histogram("edgeflow_round_aggregation_seconds", "Time spent aggregating a round's updates",
                                     buckets=AGG_BUCKETS, registry=r)
        self.selected = Counter("edgeflow_round_selected_devices", "Devices selected, summed over rounds", registry=r)
        self.participants = Counter("edgeflow_round_participants", "Devices whose update was aggregated, summed "
                                    "over rounds", registry=r)
        self.dropped = Counter("edgeflow_round_dropped_devices", "Selected devices that never reported, summed",
                               registry=r)
        self.late = Counter("edgeflow_round_late_updates", "Updates that arrived after their round closed",
                            registry=r)
        self.rejected = Counter("edgeflow_round_rejected_updates", "Updates refused, by reason code",
                                ["reason"], registry=r)
        self.bytes_in = Counter("edgeflow_round_update_bytes", "Update bytes received, by codec", ["codec"],
                                registry=r)
        self.dense_bytes = Counter("edgeflow_round_dense_equivalent_bytes", "What the received updates would "
                                   "have been as dense fp32, by codec", ["codec"], registry=r)
        self.participants_last = Gauge("edgeflow_round_last_participants", "Participants of the last round",
                                       registry=r)
        self.accuracy = Gauge("edgeflow_round_last_accuracy_ratio", "Held-out accuracy of the last round's model "
                              "(NaN without eval data)", registry=r)
        self.eval_loss = Gauge("edgeflow_round_last_eval_loss", "Held-out loss of the last round's model", registry=r)
        self.client_loss = Gauge("edgeflow_round_last_client_loss", "Mean training loss the clients reported",
                                 registry=r)
        self.last_round = Gauge("edgeflow_round_last_id", "Id of the last closed round", registry=r)
        self.store_seconds = Histogram("edgeflow_store_read_duration_seconds", "Latency of the state-store reads "
                                       "the web view makes (registry, telemetry, rounds)", buckets=STORE_BUCKETS,
                                       registry=r)
        for g in (self.accuracy, self.eval_loss, self.client_loss):
            g.set(float("nan"))
        self.profiles = _profiles()
        r.register(_ScrapeCollector(self))
        for row in view.round_log.listen(self.observe):
            self.observe(row)

    def observe(self, row: dict[str, Any]) -> None:
        """One closed round (a row of the view's RoundLog)."""
        if row.get("failed"):
            return
        codec = row.get("codec") or "unknown"
        self.round_seconds.observe(float(row.get("round_s") or 0.0))
        self.agg_seconds.observe(float(row.get("aggregation_s") or 0.0))
        self.selected.inc(int(row.get("selected") or 0))
        self.participants.inc(int(row.get("participants") or 0))
        self.dropped.inc(int(row.get("dropped") or 0))
        self.late.inc(int(row.get("late") or 0))
        for reason, n in (row.get("rejected_by_reason") or {}).items():
            self.rejected.labels(bounded_label(reason)).inc(int(n))
        unexplained = int(row.get("rejected") or 0) - sum((row.get("rejected_by_reason") or {}).values())
        if unexplained > 0:  # rejected by the strategy (robust aggregation) or before the view attached
            self.rejected.labels("aggregator").inc(unexplained)
        self.bytes_in.labels(codec).inc(int(row.get("bytes_in") or 0))
        self.dense_bytes.labels(codec).inc(int(row.get("dense_bytes") or 0))
        self.participants_last.set(int(row.get("participants") or 0))
        self.last_round.set(int(row.get("round_id") or 0))
        for g, k in ((self.accuracy, "accuracy"), (self.eval_loss, "eval_loss"), (self.client_loss, "mean_client_loss")):
            v = row.get(k)
            g.set(float("nan") if v is None else float(v))

    def exposition(self) -> bytes:
        """The text format; the store reads made since the last scrape go into their histogram first (this
        scrape's own reads show in the next one)."""
        reads, self.view.store_reads[:] = list(self.view.store_reads), []
        for s in reads:
            self.store_seconds.observe(s)
        return self.pc.generate_latest(self.registry)


class _ScrapeCollector:
    """Figures read at scrape time: the fleet, rollouts, the transport, the store's round states."""

    def __init__(self, owner: GatewayMetrics) -> None:
        self.owner = owner

    def describe(self) -> list[Any]:
        return []  # built at scrape time; nothing to check at registration

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        view = self.owner.view
        attached = view.resolve()
        up = GaugeMetricFamily("edgeflow_gateway_attached", "1 once the gateway whose figures these are exists")
        up.add_metric([], 1.0 if attached else 0.0)
        yield up
        if not attached:
            return
        version = getattr(view.rounds, "version", None)
        if version is not None:
            g = GaugeMetricFamily("edgeflow_model_version", "The gateway's current global model version")
            g.add_metric([], float(version))
            yield g
        states = view.round_states_counts()
        c = CounterMetricFamily("edgeflow_rounds", "Rounds ended, by final state (from the state store)",
                                labels=["state"])
        for st in ("closed", "failed"):
            c.add_metric([st], float(states.get(st, 0)))
        yield c
        yield from self._devices(view)
        yield from self._fleet(view)
        yield from self._rollouts(view)
        yield from self._published(view)
        yield from self._ingest(view)
        yield from self._transport(view)

    def _devices(self, view: WebView) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        rows = view.devices()
        versions = sorted({d["model_version"] for d in rows if d["model_version"] is not None}, reverse=True)
        shown = set(versions[:MAX_VERSIONS])
        counts: dict[tuple[str, str, str], int] = {}
        training = 0
        for d in rows:
            v = d["model_version"]
            vl = "none" if v is None else (str(v) if v in shown else "older")
            key = ("online" if d["online"] else "offline", bounded_label(d["profile"], self.owner.profiles), vl)
            counts[key] = counts.get(key, 0) + 1
            training += bool(d["trains"] and d["online"])
        g = GaugeMetricFamily("edgeflow_devices", "Known devices by state, profile and running model version",
                              labels=["state", "profile", "model_version"])
        for key, n in sorted(counts.items()):
            g.add_metric(list(key), float(n))
        yield g
        t = GaugeMetricFamily("edgeflow_devices_training", "Online devices that take part in rounds now")
        t.add_metric([], float(training))
        yield t

    def _fleet(self, view: WebView) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats = view.fleet_stats()
        if not stats:
            return
        ev = CounterMetricFamily("edgeflow_fleet_events", "Fleet manager counters (births, deaths, telemetry, "
                                 "refusals...) by event", labels=["event"])
        for k, v in sorted(stats.items()):
            if isinstance(v, int) and not isinstance(v, bool) and k not in ("online", "known", "telemetry_backlog"):
                ev.add_metric([bounded_label(k)], float(v))
        yield ev
        b = GaugeMetricFamily("edgeflow_telemetry_backlog_messages", "Telemetry messages waiting to be stored")
        b.add_metric([], float(stats.get("telemetry_backlog", 0)))
        yield b
        lag = stats.get("telemetry_lag_ms")
        g = GaugeMetricFamily("edgeflow_telemetry_lag_seconds", "Device timestamp to store commit, over the "
                              "recent window", labels=["quantile"])
        if isinstance(lag, dict):
            g.add_metric(["0.5"], float(lag["p50"]) / 1000)
            g.add_metric(["0.95"], float(lag["p95"]) / 1000)
            g.add_metric(["1"], float(lag["max"]) / 1000)
        yield g

    def _rollouts(self, view: WebView) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        c = CounterMetricFamily("edgeflow_rollouts", "Rollouts finished since start, by final state",
                                labels=["state"])
        for st, n in sorted(view.rollout_log.finished.items()):
            c.add_metric([st], float(n))
        yield c
        items = view.rollout_log.list()
        if not items:
            return
        last = items[-1]
        g = GaugeMetricFamily("edgeflow_rollout_devices", "Devices of the newest rollout by state",
                              labels=["state"])
        for st, n in sorted(last["counts"].items()):
            g.add_metric([bounded_label(st)], float(n))
        yield g
        for name, doc, value in (
            ("edgeflow_rollout_target_devices", "Devices the newest rollout targets", last["targets"]),
            ("edgeflow_rollout_done_devices", "Devices of the newest rollout past pending", last["done"]),
            ("edgeflow_rollout_failure_ratio", "Failure rate of the newest rollout", last["failure_rate"]),
            ("edgeflow_rollout_model_version", "Model version the newest rollout deploys", last["version"]),
            ("edgeflow_rollout_rolled_back_devices", "Devices the newest rollout rolled back", last["rolled_back"]),
            ("edgeflow_rollout_running", "1 while the newest rollout runs", 1.0 if last["state"] == "running" else 0.0),
        ):
            m = GaugeMetricFamily(name, doc)
            m.add_metric([], float(value))
            yield m

    def _published(self, view: WebView) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        sent, count = view.publish_log.snapshot()
        b = CounterMetricFamily("edgeflow_published_bytes", "Payload bytes the gateway published (chunk headers "
                                "included), by channel: model, round, state, secagg, ota, cmd, update",
                                labels=["kind"])
        for kind, n in sorted(sent.items()):
            b.add_metric([kind], float(n))
        yield b
        m = CounterMetricFamily("edgeflow_published_payloads", "Payloads the gateway published, by channel",
                                labels=["kind"])
        for kind, n in sorted(count.items()):
            m.add_metric([kind], float(n))
        yield m

    def _ingest(self, view: WebView) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        refused = view.ingest_refusals()
        c = CounterMetricFamily("edgeflow_ingest_refused_updates", "Updates the ingestion workers refused before "
                                "the round manager saw them, by reason code (late, not_selected included)",
                                labels=["reason"])
        for reason, n in sorted((refused or {}).items()):
            c.add_metric([reason], float(n))
        yield c

    def _transport(self, view: WebView) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        st = view.transport_stats()
        if not st:
            return
        r = CounterMetricFamily("edgeflow_transport_reconnects", "Times the gateway's broker connection came back")
        r.add_metric([], float(st.get("reconnects", 0)))
        yield r
        p = CounterMetricFamily("edgeflow_transport_published_messages", "Messages the gateway published")
        p.add_metric([], float(st.get("published_messages", 0)))
        yield p
        q = GaugeMetricFamily("edgeflow_transport_queued_bytes", "Bytes waiting to be sent to the broker")
        q.add_metric([], float(st.get("queued_bytes", 0)))
        yield q
