"""Hierarchical federated rounds: site gateways under one root gateway.

When a fleet outgrows one gateway, each *site* (a building, a cell, a
region) runs its own gateway on its own broker, and one *root* gateway
combines the sites. Nothing new travels between them but MQTT through the
brokers' own bridging (docs/scaling.md, :mod:`edgeflow.broker.bridge`):

- the **root** is an ordinary :class:`~edgeflow.gateway.rounds.RoundManager`
  whose clients are the sites: it announces rounds and publishes the global
  model on its (central) broker's ``gateway/round`` and ``gateway/model``,
  and folds each site's *partial aggregate* (``contributions="partials"``)
  with :meth:`FedAvg.add_partial <edgeflow.gateway.strategies.FedAvg.add_partial>`;
- each **site** is an ordinary RoundManager for its own devices, driven by
  the root's rounds (:class:`SiteGateway`): for root round ``r`` it adopts
  the root's model, selects and trains its devices in its own round ``r``,
  and instead of adopting the aggregate it forwards ``sum_i n_i d_i`` and
  ``sum_i n_i`` upward (:class:`ForwardPartial`); under secure aggregation
  that sum is the site's unmasked sum, so the root never sees one device.

Why sums and not means: the root then computes exactly
``sum_sites S_s / sum_sites W_s = sum_i n_i d_i / sum_i n_i``, flat FedAvg
over every device, whatever the split into sites (to float32 rounding of
the forwarded sums). Server optimizers (FedAvgM, FedAdam...) run at the root
only; strategies that need each update (median, Krum) cannot be split and
are refused at the root.

Topics. A site reaches the root through an :class:`Uplink`: through a
bridge (the default), the root's ``edgeflow/<fleet>/gateway/...`` appear on
the site broker under ``edgeflow/<fleet>/_uplink/gateway/...`` and the
site's partials, published on ``edgeflow/<fleet>/_uplink/<site>/update``,
reach the central broker as ``edgeflow/<fleet>/<site>/update`` - a site is a
device of the root, with the root's topic scheme and ACL unchanged. The
``_uplink`` level cannot be a device id, so no device topic collides with it
and the site's own update subscription never hears its own partials.
Direct (no bridge): the site opens a second connection to the central
broker and uses the root's topics as they are.

Versions. The site stores the root's model under the root's version number,
so its announcements, its devices' ``base_version`` and the partial it
forwards all name the root's version, and crash recovery (a reopened round
must match the latest stored model) holds at both levels.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import onnx

from edgeflow.broker.bridge import UPLINK_LEVEL
from edgeflow.codecs import decode_update, encode_update
from edgeflow.errors import AggregationError, CodecError, ConfigError, SignatureError
from edgeflow.protocol.rounds import RoundAnnouncement, TrainConfig
from edgeflow.signing import KeyRing, PrivateKey, PublicKey, Signer
from edgeflow.transport.base import Transport
from edgeflow.transport.topics import ROOT, validate_id

from .aggregation import AggregateResult, Schema
from .rounds import GATEWAY_ID, Candidate, RoundConfig, RoundManager, RoundMetrics, model_with_weights
from .store import GatewayStore
from .strategies import FedAvg, folds_partials, partial_folding_strategies

log = logging.getLogger("edgeflow.gateway.hierarchy")

__all__ = [
    "ROLES",
    "HierarchyOptions",
    "UPLINK_LEVEL",
    "ForwardPartial",
    "PartialSum",
    "SiteGateway",
    "Uplink",
    "adopt_root_model",
    "check_root_config",
    "check_site_config",
    "root_manager",
    "site_manager",
]

ROLES = ("flat", "site", "root")


@dataclass(frozen=True)
class Uplink:
    """Where a site gateway meets its root: a transport and the topic prefix of
    the root's namespace on it."""

    transport: Transport
    fleet: str
    bridged: bool = True

    @property
    def prefix(self) -> str:
        return f"{ROOT}/{self.fleet}/{UPLINK_LEVEL}/" if self.bridged else f"{ROOT}/{self.fleet}/"

    @property
    def round_topic(self) -> str:
        return self.prefix + f"{GATEWAY_ID}/round"

    @property
    def model_topic(self) -> str:
        return self.prefix + f"{GATEWAY_ID}/model"

    def partial_topic(self, site_id: str) -> str:
        return self.prefix + f"{validate_id(site_id, 'site id')}/update"


class PartialSum(FedAvg):
    """A site's aggregator: ``sum_i n_i d_i`` and ``sum_i n_i``, never divided.

    Folds exactly in float64 (``stage=0``); ``finish()`` returns the sum as
    ``delta`` (cast once to the model's dtype) and the weight as
    ``total_samples``. ``add_partial`` (a secure-aggregation sum) adds in.
    The ``weights`` of its result mean nothing and are not used.
    """

    name = "partial-sum"

    def __init__(self) -> None:
        super().__init__(stage=0)

    def _reduce(self) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        assert self._acc is not None
        self._flush()
        return self._acc, {"weight_sum": self._weight_sum}


class ForwardPartial:
    """A site's :class:`~edgeflow.gateway.rounds.AggregateSink`: sign the round's
    sum and weight as a dense update of the site and publish it upward. The
    site's global model stays as it is until the root publishes the next one."""

    def __init__(self, uplink: Uplink, signer: Signer, *, timeout_s: float = 60.0) -> None:
        self.uplink = uplink
        self.signer = signer
        self.timeout_s = timeout_s
        self._seq = time.time_ns() // 1000
        self.forwarded: list[int] = []

    def deliver(self, rounds: RoundManager, result: AggregateResult, ann: RoundAnnouncement) -> None:
        self._seq += 1
        losses = list(rounds.open.snapshot().losses)
        meta: dict[str, Any] = {"partial": True, "num_clients": int(result.num_clients),
                                "base_version": int(ann.model_version)}
        if ann.nonce:  # the site's round carries the root round's nonce (SiteGateway.run)
            meta["round_nonce"] = ann.nonce
        if losses:
            meta["loss"] = float(np.mean(losses))
        payload = encode_update(result.delta, "dense", round_id=ann.round_id, device_id=self.signer.device_id,
                                seq=self._seq, signer=self.signer, num_samples=int(result.total_samples),
                                metadata=meta)
        acked = rounds.publish_reliably(self.uplink.partial_topic(self.signer.device_id), payload,
                                        f"round {ann.round_id} partial to the root", retain=False,
                                        until=time.time() + self.timeout_s, transport=self.uplink.transport)
        if not acked:  # still queued: the transport sends it when the uplink recovers
            log.warning("site %s: round %d partial not acknowledged within %.0f s; it stays queued",
                        self.signer.device_id, ann.round_id, self.timeout_s)
        self.forwarded.append(ann.round_id)
        log.info("site %s: round %d partial of %d device(s), weight %d forwarded", self.signer.device_id,
                 ann.round_id, result.num_clients, result.total_samples)


def check_root_config(config: RoundConfig) -> None:
    """A root folds sums: mean-type strategies only, sync, no secagg/central DP at the root."""
    problems = []
    if config.mode != "sync":
        problems.append("hierarchical rounds need mode 'sync'")
    if not folds_partials(config.strategy):
        problems.append(f"strategy {config.strategy!r} needs each device update; a root only receives site sums "
                        f"(use one of {', '.join(partial_folding_strategies())})")
    if config.dp:
        problems.append("central DP clips each device update: it cannot run at the root")
    if config.secagg is not None:
        problems.append("secure aggregation runs at the sites ([rounds] secagg in each site's gateway.toml)")
    if problems:
        raise ConfigError("root gateway: " + "; ".join(problems))


def check_site_config(config: RoundConfig) -> None:
    """A site sums plainly; the strategy runs at the root."""
    problems = []
    if config.mode != "sync":
        problems.append("hierarchical rounds need mode 'sync'")
    if config.dp:
        problems.append("central DP is not supported in hierarchical rounds")
    if not folds_partials(config.strategy):
        problems.append(f"strategy {config.strategy!r} cannot be split across sites")
    if problems:
        raise ConfigError("site gateway: " + "; ".join(problems))


def root_manager(transport: Transport, store: GatewayStore, *, fleet: str, fleet_key: PrivateKey, site_keys: KeyRing,
                 model: onnx.ModelProto, config: RoundConfig, sites: list[str] | Callable[[], list[Candidate]],
                 **kwargs: Any) -> RoundManager:
    """The root: a RoundManager whose clients are the sites and whose updates are their partials."""
    check_root_config(config)
    if callable(sites):
        candidates = sites
    else:
        names = [validate_id(s, "site id") for s in sites]
        if not names:
            raise ConfigError("root gateway: [hierarchy] sites is empty")
        missing = [s for s in names if site_keys.get(s) is None]
        if missing:
            raise ConfigError(f"root gateway: no public key for site(s) {missing} (provision them like devices)")

        def candidates() -> list[Candidate]:
            return [Candidate(s) for s in names]

    return RoundManager(transport, store, fleet=fleet, fleet_key=fleet_key, keyring=site_keys, model=model,
                        config=config, candidates=candidates, contributions="partials", **kwargs)


def site_manager(transport: Transport, store: GatewayStore, *, fleet: str, fleet_key: PrivateKey, keyring: KeyRing,
                 model: onnx.ModelProto, config: RoundConfig, candidates: Callable[[], list[Candidate]],
                 uplink: Uplink, signer: Signer, **kwargs: Any) -> RoundManager:
    """A site: a RoundManager for its devices that sums and forwards instead of adopting."""
    check_site_config(config)
    return RoundManager(transport, store, fleet=fleet, fleet_key=fleet_key, keyring=keyring, model=model,
                        config=config, candidates=candidates, sink=ForwardPartial(uplink, signer),
                        aggregator=PartialSum(), **kwargs)


def adopt_root_model(rounds: RoundManager, version: int, weights: dict[str, np.ndarray]) -> bool:
    """Make the root's model version ``version`` the site's global model (stored under
    the same version number) and publish it to the site's devices. False if it was
    already the site's model; raises if the site's state disagrees with the root."""
    schema = Schema.of(rounds.weights)
    schema.check({k: np.asarray(v, dtype=schema.specs[k].dtype) if k in schema.specs else v
                  for k, v in weights.items()}, "root")
    new = {k: np.asarray(weights[k], dtype=np.float32) for k in rounds.weights}
    if version == rounds.version:
        if all(np.array_equal(new[k], rounds.weights[k]) for k in new):
            return False
        raise AggregationError(
            f"the root's model v{version} differs from this site's v{version}: start the site from the root's "
            "initial model, or with a fresh state file"
        )
    if version < rounds.version:
        raise AggregationError(f"the root published v{version} but this site already has v{rounds.version}: "
                               "the site's state file belongs to another hierarchy")
    onnx_bytes = model_with_weights(rounds.base_model, new).SerializeToString()
    rounds.store.add_model(onnx_bytes, hashlib.sha256(onnx_bytes).hexdigest(), version=version,
                           metrics={"from_root": True})
    rounds.weights, rounds.version = new, version
    rounds.publish_model()
    return True


class SiteGateway:
    """Drives a site's RoundManager from the root's rounds (see the module docstring).

    ``start()`` subscribes to the root's round and model on the uplink (call
    before connecting a persistent session); ``run(n)`` takes part in ``n``
    root rounds (None: until :meth:`stop`). The site's own round ``r``
    closes ``forward_margin_s`` before the root's deadline (or at the site's
    own ``deadline_s``, whichever is sooner), so its partial arrives in time.
    """

    def __init__(self, rounds: RoundManager, uplink: Uplink, *, site_id: str, root_key: PublicKey,
                 forward_margin_s: float = 2.0) -> None:
        if not isinstance(rounds.sink, ForwardPartial):
            raise ConfigError("a SiteGateway needs a RoundManager built by site_manager() (ForwardPartial sink)")
        self.rounds = rounds
        self.uplink = uplink
        self.site_id = validate_id(site_id, "site id")
        self.root_keys = KeyRing({GATEWAY_ID: root_key})
        self.root_key = root_key
        self.forward_margin_s = float(forward_margin_s)
        self._cv = threading.Condition()
        self._stop = threading.Event()
        self._ann: RoundAnnouncement | None = None
        self._models: dict[int, dict[str, np.ndarray]] = {}
        self._subs: list[Any] = []
        self._last_round = rounds.store.last_round_id()
        self.history: list[RoundMetrics] = []
        self.rejected = 0

    def start(self) -> "SiteGateway":
        if not self._subs:
            self._subs = [self.uplink.transport.subscribe(self.uplink.model_topic, self._on_model),
                          self.uplink.transport.subscribe(self.uplink.round_topic, self._on_round)]
        return self

    def stop(self) -> None:
        self._stop.set()
        self.rounds.stop()
        with self._cv:
            self._cv.notify_all()

    # -- uplink handlers (transport worker thread) --------------------------------
    def _on_model(self, msg: Any) -> None:
        try:
            upd = decode_update(msg.payload, verifier=self.root_keys, require_signature=True,
                                source=f"site {self.site_id}<-root/model")
        except (CodecError, SignatureError) as exc:
            self.rejected += 1
            log.warning("site %s: root model refused: %s", self.site_id, exc)
            return
        if upd.device_id != GATEWAY_ID:
            self.rejected += 1
            return
        version = int(upd.metadata.get("model_version", upd.round_id))
        with self._cv:
            self._models = {v: w for v, w in self._models.items() if v > version - 2}
            self._models[version] = upd.tensors
            self._cv.notify_all()

    def _on_round(self, msg: Any) -> None:
        if not msg.payload:
            return
        try:
            ann = RoundAnnouncement.verify(msg.payload, self.root_key)
        except (CodecError, SignatureError) as exc:
            self.rejected += 1
            log.warning("site %s: root round refused: %s", self.site_id, exc)
            return
        with self._cv:
            self._ann = ann
            self._cv.notify_all()

    # -- the loop ---------------------------------------------------------------
    def _next_order(self, wait_s: float) -> tuple[RoundAnnouncement, dict[str, np.ndarray]] | None:
        """An open root round this site is in, newer than the last it ran, whose model
        arrived; None if there is none within ``wait_s``, or as soon as a root model newer
        than the site's arrives (the caller adopts it first)."""
        end = time.time() + wait_s
        with self._cv:
            while not self._stop.is_set():
                ann = self._ann
                if (ann is not None and ann.state == "open" and ann.mode == "sync"
                        and ann.round_id > self._last_round
                        and (not ann.selected or self.site_id in ann.selected)
                        and ann.model_version in self._models):
                    if ann.deadline - self.forward_margin_s > time.time():
                        return ann, self._models[ann.model_version]
                    log.warning("site %s: root round %d announced too close to its deadline; skipped",
                                self.site_id, ann.round_id)
                    self._last_round = ann.round_id
                if self._models and max(self._models) > self.rounds.version:
                    return None  # a newer root model: adopt it now, so the devices have it before the next round
                left = end - time.time()
                if left <= 0:
                    return None
                self._cv.wait(min(left, 0.1))
        return None

    def _adopt_newest(self) -> None:
        """Between rounds, follow the root's newest model so the devices get it at once."""
        with self._cv:
            newest = max(self._models) if self._models else None
            weights = self._models.get(newest) if newest is not None else None
        if newest is not None and newest > self.rounds.version and weights is not None:
            adopt_root_model(self.rounds, newest, weights)

    def _train_config(self, root: TrainConfig) -> TrainConfig:
        return dataclasses.replace(root, secagg=self.rounds.config.secagg is not None)

    def run(self, rounds: int | None = None) -> list[RoundMetrics]:
        """Take part in ``rounds`` root rounds (None: until :meth:`stop`), adopting and
        republishing every root model as it arrives."""
        self.start()
        rm = self.rounds
        done: list[RoundMetrics] = []
        rm.start()
        rm.publish_model()
        if rm.resuming:  # a round this site left open: finish and forward it first
            done += rm.run(0)
            self._last_round = max(self._last_round, rm.store.last_round_id())
        while (rounds is None or len(done) < rounds) and not self._stop.is_set():
            self._adopt_newest()
            order = self._next_order(0.5)
            if order is None:
                continue
            ann, weights = order
            adopt_root_model(rm, ann.model_version, weights)
            deadline = min(ann.deadline - self.forward_margin_s, time.time() + rm.config.deadline_s)
            self._last_round = ann.round_id
            m = rm.run_round(round_id=ann.round_id, deadline=deadline, train=self._train_config(ann.config),
                             nonce=ann.nonce or None)
            if m is not None:
                done.append(m)
                self.history.append(m)
        return done


@dataclass
class HierarchyOptions:
    """``gateway.toml`` ``[hierarchy]``: how a site reaches its root, and a root's sites.

    Site: ``site_id`` (the site's id as the root's client, provisioned in the
    central fleet directory like a device), ``uplink`` ("bridge": the root's
    topics arrive through the site broker's bridge, see
    :mod:`edgeflow.broker.bridge`; or the central broker's URL for a direct
    second connection), ``site_key`` (signs the partials; default
    ``<fleet_dir>/devices/<site_id>/device.key``), ``root_key`` (verifies the
    root's rounds and models; default the fleet's ``fleet.pub``),
    ``forward_margin_s``. Root: ``sites``, whose public keys come from the
    fleet directory's key ring.
    """

    site_id: str | None = None
    uplink: str = "bridge"
    site_key: str | None = None
    root_key: str | None = None
    forward_margin_s: float = 2.0
    sites: list[str] = dataclasses.field(default_factory=list)

    def check(self, role: str) -> None:
        if role not in ROLES:
            raise ConfigError(f"[gateway] role must be one of {', '.join(ROLES)}, got {role!r}")
        if role == "site":
            if not self.site_id:
                raise ConfigError("[hierarchy] site_id is required for role 'site'")
            validate_id(self.site_id, "[hierarchy] site_id")
            if self.forward_margin_s < 0:
                raise ConfigError("[hierarchy] forward_margin_s must be >= 0")
        if role == "root":
            if not self.sites:
                raise ConfigError("[hierarchy] sites (the root's site gateways) is required for role 'root'")
            for s in self.sites:
                validate_id(s, "[hierarchy] sites entry")
