"""edgeflow.federated: the device side of federated learning.

:class:`Client` takes part in the gateway's rounds (see
:mod:`edgeflow.gateway.rounds` for the other side); :mod:`.messages` holds
the signed round announcement both sides share.
"""

from .client import Client, ClientStats
from .messages import RoundAnnouncement, TrainConfig, open_json, sign_json

__all__ = ["Client", "ClientStats", "RoundAnnouncement", "TrainConfig", "open_json", "sign_json"]
