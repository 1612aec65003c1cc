"""One gateway process: a transport, a store, the fleet registry and the rounds.

:class:`Gateway` composes the independent parts — :class:`~edgeflow.gateway.fleet.FleetManager`
(births, liveness, telemetry, commands, OTA), :class:`~edgeflow.gateway.rounds.RoundManager`
(federated rounds) — over one MQTT connection with a persistent session and
one state store (a SQLite file, or PostgreSQL with ``[store] url``), and publishes the gateway's own status retained on
``gateway/state`` (with a last will saying it went offline).

Configuration comes from ``gateway.toml`` (see :func:`load_config` and
docs/gateway.md) and the operator's fleet directory (fleet key, device key
ring, the ``gateway`` broker credentials, the broker URL).

``[gateway] role`` places the gateway in a hierarchy (docs/scaling.md):
"flat" (default) aggregates its devices and publishes the model; "site"
aggregates its devices and forwards the partial sum to the root
(``[hierarchy]`` says how); "root" aggregates the sites' partials.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import onnx

from edgeflow.errors import ConfigError
from edgeflow.signing import KeyRing, PrivateKey, PublicKey, Signer
from edgeflow.transport.base import Transport

from .fleet import FleetManager, FleetOptions
from .hierarchy import HierarchyOptions, SiteGateway, Uplink, root_manager, site_manager
from .rounds import RoundConfig, RoundManager, RoundMetrics
from .store import GatewayStore, StoreTarget, parse_store_url

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

log = logging.getLogger("edgeflow.gateway")


@dataclass
class GatewayConfig:
    """``gateway.toml``: ``[gateway]`` paths and ids, ``[fleet]`` registry options,
    ``[rounds]`` (+ ``[rounds.train]``) the federated rounds, ``[hierarchy]`` a
    site's uplink or a root's sites (with ``[gateway] role``)."""

    fleet_dir: str | None = None
    fleet: str | None = None
    state: str = "gateway.sqlite"
    model: str | None = None
    eval: str | None = None
    metrics: str | None = "metrics.jsonl"
    client_id: str | None = None
    broker: str | None = None
    max_payload: int | None = None  # bytes per MQTT message before chunking (4000 for wss:// fleets, see docs)
    role: str = "flat"  # "flat" | "site" | "root" (docs/scaling.md)
    fleet_options: FleetOptions = field(default_factory=FleetOptions)
    rounds: RoundConfig = field(default_factory=RoundConfig)
    hierarchy: HierarchyOptions = field(default_factory=HierarchyOptions)
    store_url: str | None = None  # [store] url: sqlite:///PATH or postgresql://... (instead of [gateway] state)
    telemetry_keep: int = 500  # [store] telemetry_keep: rows of telemetry history kept per device
    base_dir: Path = field(default_factory=Path.cwd)

    def store_target(self) -> StoreTarget:
        """Where the state lives: ``[store] url`` if given, else ``[gateway] state`` (a file)."""
        if self.store_url is not None:
            return parse_store_url(self.store_url, base_dir=self.base_dir)
        return parse_store_url(str(self.path(self.state)))

    def path(self, p: str | None) -> Path | None:
        if p is None:
            return None
        q = Path(p).expanduser()
        return q if q.is_absolute() else self.base_dir / q


_STORE_KEYS = {"url", "telemetry_keep"}


def _store_section(st: dict[str, Any], gw: dict[str, Any], where: str, base: Path) -> dict[str, Any]:
    """``[store]``: validated here, so a bad URL is one line naming the key before anything starts."""
    bad = sorted(set(st) - _STORE_KEYS)
    if bad:
        raise ConfigError(f"{where}: [store] unknown key(s) {bad}; known: {sorted(_STORE_KEYS)}")
    out: dict[str, Any] = {}
    if "url" in st:
        if "state" in gw:
            raise ConfigError(f"{where}: [gateway] state and [store] url both name the gateway's state; keep one "
                              "([store] url = \"sqlite:///gateway.sqlite\" is the same as state = \"gateway.sqlite\")")
        try:
            parse_store_url(st["url"], base_dir=base)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        out["store_url"] = st["url"]
    if "telemetry_keep" in st:
        keep = st["telemetry_keep"]
        if not isinstance(keep, int) or isinstance(keep, bool) or not 1 <= keep <= 1_000_000:
            raise ConfigError(f"{where}: [store] telemetry_keep must be an integer from 1 to 1000000, got {keep!r}")
        out["telemetry_keep"] = keep
    return out


_GATEWAY_KEYS = {"fleet_dir", "fleet", "state", "model", "eval", "metrics", "client_id", "broker", "max_payload", "role"}


def load_config(source: str | Path | Mapping[str, Any]) -> GatewayConfig:
    """Parse and validate ``gateway.toml`` (or an equivalent dict); errors name the key."""
    if isinstance(source, Mapping):
        data, base, where = dict(source), Path.cwd(), "<config>"
    else:
        p = Path(source)
        if not p.is_file():
            raise ConfigError(f"gateway config not found: {p}")
        try:
            data = tomllib.loads(p.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{p}: not valid TOML: {exc}") from exc
        base, where = p.resolve().parent, str(p)
    unknown = sorted(set(data) - {"gateway", "fleet", "rounds", "hierarchy", "store"})
    if unknown:
        raise ConfigError(f"{where}: unknown section(s) {unknown}; sections are [gateway], [fleet], [rounds], "
                          "[hierarchy], [store]")
    gw = dict(data.get("gateway", {}))
    bad = sorted(set(gw) - _GATEWAY_KEYS)
    if bad:
        raise ConfigError(f"{where}: [gateway] unknown key(s) {bad}; known: {sorted(_GATEWAY_KEYS)}")
    fo = dict(data.get("fleet", {}))
    known_fo = {f.name for f in fields(FleetOptions)}
    bad = sorted(set(fo) - known_fo)
    if bad:
        raise ConfigError(f"{where}: [fleet] unknown key(s) {bad}; known: {sorted(known_fo)}")
    try:
        rounds = RoundConfig.from_dict(dict(data.get("rounds", {})))
    except (ConfigError, TypeError) as exc:
        raise ConfigError(f"{where}: [rounds]: {exc}") from exc
    hi = dict(data.get("hierarchy", {}))
    known_hi = {f.name for f in fields(HierarchyOptions)}
    bad = sorted(set(hi) - known_hi)
    if bad:
        raise ConfigError(f"{where}: [hierarchy] unknown key(s) {bad}; known: {sorted(known_hi)}")
    hierarchy = HierarchyOptions(**hi)
    try:
        hierarchy.check(gw.get("role", "flat"))
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    if not isinstance(data.get("store", {}), dict):
        raise ConfigError(f"{where}: [store] must be a table, e.g. [store] url = \"postgresql://HOST/DB\"")
    store = _store_section(dict(data.get("store", {})), gw, where, base)
    return GatewayConfig(**gw, fleet_options=FleetOptions(**fo), rounds=rounds, hierarchy=hierarchy, base_dir=base,
                         **store)


def load_eval(path: Path | None) -> tuple[np.ndarray, np.ndarray] | None:
    if path is None:
        return None
    from edgeflow.data import load_npz

    ds = load_npz(path)
    return ds.x, ds.y


def _initial_model(config: GatewayConfig) -> onnx.ModelProto:
    mp = config.path(config.model)
    if mp is None:
        raise ConfigError("[gateway] model: the initial global model is needed on first start")
    from edgeflow.runtime.model import load_model

    return load_model(mp)


class Gateway:
    """The gateway service. ``start()``, then ``run_rounds()`` and/or ``serve()``; ``stop()``."""

    def __init__(
        self,
        transport: Transport,
        store: GatewayStore,
        *,
        fleet: str,
        fleet_key: PrivateKey,
        keyring: KeyRing,
        model: onnx.ModelProto,
        rounds: RoundConfig,
        fleet_options: FleetOptions | None = None,
        eval_data: tuple[np.ndarray, np.ndarray] | None = None,
        metrics_path: Path | None = None,
        on_round: Callable[[RoundMetrics], None] | None = None,
        role: str = "flat",
        hierarchy: HierarchyOptions | None = None,
        site_signer: Signer | None = None,
        root_key: PublicKey | None = None,
        uplink_transport: Transport | None = None,
        keyring_loader: Callable[[], KeyRing] | None = None,
    ) -> None:
        """``keyring_loader`` (``FleetDir.keyring`` from :meth:`from_config`) re-reads the provisioned keys
        while the gateway runs: new devices are picked up, revoked ones refused. ``role`` "site" needs ``site_signer`` and ``root_key`` (and ``uplink_transport`` for a
        direct uplink; None = through the site broker's bridge); "root" takes its sites
        from ``hierarchy.sites`` and their keys from ``keyring``."""
        hierarchy = hierarchy or HierarchyOptions()
        hierarchy.check(role)
        self.transport = transport
        self.store = store
        self.fleet_id = fleet
        self.metrics_path = metrics_path
        self.role = role
        self.uplink_transport = uplink_transport
        self._on_round_cb = on_round
        self.fleet = FleetManager(transport, store, fleet, fleet_key, fleet_options, keyring=keyring,
                                  keyring_loader=keyring_loader)
        if getattr(transport, "accept_transfer", False) is None:
            # chunked transfers only from provisioned ids (per-sender budgets bound the rest)
            transport.accept_transfer = self.fleet.accepts_transfer  # type: ignore[attr-defined]
        common: dict[str, Any] = dict(fleet=fleet, fleet_key=fleet_key, model=model, config=rounds,
                                      eval_data=eval_data, on_round=self._on_round)
        self.site: SiteGateway | None = None
        if role == "site":
            if site_signer is None or root_key is None:
                raise ConfigError("a site gateway needs site_signer (signs partials) and root_key (verifies the root)")
            uplink = Uplink(uplink_transport or transport, fleet, bridged=uplink_transport is None)
            self.rounds = site_manager(transport, store, keyring=self.fleet.keyring,
                                       candidates=self.fleet.round_candidates, uplink=uplink, signer=site_signer,
                                       **common)
            self.site = SiteGateway(self.rounds, uplink, site_id=site_signer.device_id, root_key=root_key,
                                    forward_margin_s=hierarchy.forward_margin_s)
        elif role == "root":
            self.rounds = root_manager(transport, store, site_keys=self.fleet.keyring, sites=list(hierarchy.sites),
                                       **common)
        else:
            self.rounds = RoundManager(transport, store, keyring=self.fleet.keyring,
                                       candidates=self.fleet.round_candidates, **common)
        self._stop = threading.Event()
        self._started = False

    # -- construction from files -----------------------------------------------
    @classmethod
    def from_config(cls, config: GatewayConfig, *, broker: str | None = None, fleet_dir: str | None = None,
                    on_round: Callable[[RoundMetrics], None] | None = None) -> "Gateway":
        from edgeflow.broker.mosquitto import FleetDir
        from edgeflow.transport import MqttTransport
        from edgeflow.transport.message import TlsConfig, Will
        from edgeflow.transport.topics import gateway_topic

        fd_path = fleet_dir or (str(config.path(config.fleet_dir)) if config.fleet_dir else None)
        if fd_path is None:
            raise ConfigError("no fleet directory: pass --dir or set [gateway] fleet_dir "
                              "(create one with `edgeflow broker-config --dir DIR --fleet NAME`)")
        fd = FleetDir(fd_path)
        fleet = config.fleet or fd.fleet
        if fleet != fd.fleet:
            raise ConfigError(f"[gateway] fleet {fleet!r} differs from the fleet directory's {fd.fleet!r}")
        url = broker or config.broker or fd.broker_url
        if not url:
            raise ConfigError("no broker URL: pass --broker, set [gateway] broker, or store one in the fleet directory")
        creds = fd.operator("gateway")
        ca = fd.ca_file()
        kwargs: dict[str, Any] = {}
        if url.startswith(("mqtts://", "wss://")) and ca is not None:
            kwargs["tls"] = TlsConfig(ca_file=str(ca))
        if config.max_payload:
            kwargs["max_payload"] = int(config.max_payload)
        transport = MqttTransport.from_url(
            url, client_id=config.client_id or f"{fleet}-gateway", username=creds["username"],
            password=creds["password"], clean_start=False, session_expiry_s=24 * 3600,
            will=Will(str(gateway_topic(fleet, "state")), json.dumps({"online": False}), qos=1, retain=True),
            **kwargs,
        )
        # The user's files are checked before the state is opened: a bad eval file or model creates no state.
        eval_data = load_eval(config.path(config.eval))
        target = config.store_target()
        initial = None
        if target.engine == "sqlite" and (target.path == ":memory:" or not Path(target.path).exists()):
            initial = _initial_model(config)  # a first start
        store = GatewayStore(target, telemetry_keep=config.telemetry_keep)
        if store.latest_model() is None:
            model = initial if initial is not None else _initial_model(config)
        else:
            model = onnx.load_model_from_string(store.latest_model()[1])
        site: dict[str, Any] = {}
        if config.role == "site":
            site = _site_material(config, fd, fleet, kwargs)
        return cls(
            transport, store, fleet=fleet, fleet_key=fd.fleet_key(), keyring=fd.keyring(), model=model,
            rounds=config.rounds, fleet_options=config.fleet_options,
            eval_data=eval_data, metrics_path=config.path(config.metrics),
            on_round=on_round, role=config.role, hierarchy=config.hierarchy, keyring_loader=fd.keyring, **site,
        )

    # -- lifecycle ---------------------------------------------------------------
    def start(self, timeout: float = 30.0) -> "Gateway":
        """Subscribe everything (before connecting: the persistent session's queue arrives at once)."""
        if not self._started:
            self.fleet.start()
            self.rounds.start()
            if self.site is not None:
                self.site.start()
            self.transport.connect(timeout=timeout)
            if self.uplink_transport is not None:
                self.uplink_transport.connect(timeout=timeout)
            self._publish_state(True)
            self._started = True
        return self

    def _publish_state(self, online: bool) -> None:
        """Best effort: a broker that does not acknowledge the status within 10 s is logged,
        never fatal (the message stays queued; the rounds wait for their own publishes)."""
        from edgeflow.errors import TransportError
        from edgeflow.transport.topics import gateway_topic

        body = {"online": online, "fleet": self.fleet_id, "model_version": self.rounds.version,
                "devices_online": len(self.fleet.online_devices()) if online else 0, "ts": time.time()}
        try:
            self.transport.publish(str(gateway_topic(self.fleet_id, "state")), json.dumps(body), qos=1,
                                   retain=True).wait(10)
        except TransportError as exc:
            log.warning("gateway state not acknowledged by the broker (%s); going on", exc)

    def _on_round(self, m: RoundMetrics) -> None:
        if self.metrics_path is not None:
            with open(self.metrics_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(m.to_dict()) + "\n")
        self._publish_state(True)
        if self._on_round_cb:
            self._on_round_cb(m)

    def run_rounds(self, rounds: int | None = None) -> list[RoundMetrics]:
        """Flat and root: run ``rounds`` (default: the job's remaining). Site: take part in
        ``rounds`` root rounds (default: until :meth:`stop`)."""
        self.start()
        if self.site is not None:
            return self.site.run(rounds)
        return self.rounds.run(rounds)

    def serve(self) -> None:
        """Keep the registry and command channel running until :meth:`stop`."""
        self.start()
        while not self._stop.wait(1.0):
            pass

    def stop(self) -> None:
        self._stop.set()
        self.rounds.stop()
        if self.site is not None:
            self.site.stop()
        if self.uplink_transport is not None:
            self.uplink_transport.close()
        if self._started:
            try:
                self._publish_state(False)
            except Exception:  # pragma: no cover - shutting down anyway
                log.debug("publishing the final state at stop failed", exc_info=True)
            self.fleet.stop()
            self.transport.close()
            self._started = False
        self.store.close()

    def __enter__(self) -> "Gateway":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _site_material(config: GatewayConfig, fd: Any, fleet: str, transport_kwargs: dict[str, Any]) -> dict[str, Any]:
    """A site's signer, the root's key and (direct uplink) the connection to the central broker."""
    h = config.hierarchy
    assert h.site_id is not None
    key_path = config.path(h.site_key) if h.site_key else fd.device_dir(h.site_id) / "device.key"
    if not Path(key_path).exists():
        raise ConfigError(f"[hierarchy] site_key {key_path} not found: provision the site in the central fleet "
                          f"directory (`edgeflow fleet provision {h.site_id}`) or set site_key")
    root_key = PublicKey.load(config.path(h.root_key)) if h.root_key else fd.fleet_public_key()
    out: dict[str, Any] = {"site_signer": Signer.load(h.site_id, key_path), "root_key": root_key}
    if h.uplink != "bridge":
        from edgeflow.transport import MqttTransport

        creds_path = fd.device_dir(h.site_id) / "device.json"
        creds = json.loads(creds_path.read_text(encoding="utf-8")) if creds_path.exists() else {}
        from edgeflow.transport.message import TlsConfig

        kw = {k: v for k, v in transport_kwargs.items() if k != "tls"}
        ca = fd.ca_file()
        if h.uplink.startswith(("mqtts://", "wss://")) and ca is not None:
            kw["tls"] = TlsConfig(ca_file=str(ca))
        out["uplink_transport"] = MqttTransport.from_url(
            h.uplink, client_id=creds.get("username", h.site_id), username=creds.get("username"),
            password=creds.get("password"), clean_start=False, session_expiry_s=24 * 3600, **kw)
    return out
