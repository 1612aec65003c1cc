"""The device agent's command table: one entry per protocol command, each with a handler."""

from edgeflow.device.agent import DeviceAgent
from edgeflow.protocol.fleet import COMMANDS


def test_the_table_and_the_protocol_name_the_same_commands():
    assert set(DeviceAgent._COMMAND_TABLE) == set(COMMANDS)


def test_every_entry_has_a_lane_and_a_handler():
    for name, (lane, handler) in DeviceAgent._COMMAND_TABLE.items():
        assert lane in ("quick", "ops"), name
        assert callable(getattr(DeviceAgent, handler, None)), (name, handler)
    # what swaps slots waits behind deployments; what only reads or sets flags answers at once
    assert {n for n, (lane, _) in DeviceAgent._COMMAND_TABLE.items() if lane == "ops"} == {"rollback", "reboot"}
