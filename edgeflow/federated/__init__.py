"""edgeflow.federated: the device side of federated learning.

:class:`Client` takes part in the gateway's rounds (see
:mod:`edgeflow.gateway.rounds` for the other side); :mod:`.numpy_client` is the
seam for your own training loop and :mod:`.app` loads Flower-style apps
(``--app FILE:client_fn``); :mod:`.secagg_client` is a device's side of secure aggregation. The messages both sides share are
:mod:`edgeflow.protocol` (:mod:`edgeflow.protocol.rounds`).
"""

from ..protocol.rounds import RoundAnnouncement, TrainConfig
from .client import Client, ClientStats

__all__ = ["Client", "ClientStats", "RoundAnnouncement", "TrainConfig"]
