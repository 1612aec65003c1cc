"""Issue 20's attack list against one live fleet (tests/chaos/arena.py): each attack must hold.

One arena (generated TLS + ACL Mosquitto, the gateway service from a gateway.toml, three honest agents
and a compromised one) is shared by all attacks, in the order of the list; ``benchmarks/chaos.py``
runs the same attacks and prints the table.
"""

from __future__ import annotations

import pytest

from arena import Arena
from attacks import ATTACKS, run

pytestmark = [pytest.mark.integration, pytest.mark.slow]

XFAIL: dict[str, str] = {}
"""Attacks known not to hold, with the reason (docs/security.md says the same)."""


@pytest.fixture(scope="module")
def arena(tmp_path_factory):
    a = Arena(tmp_path_factory.mktemp("chaos"))
    try:
        yield a
    finally:
        a.close()


@pytest.mark.parametrize("attack", ATTACKS, ids=[a.id if a.finding == "-" else f"{a.id}-{a.finding}" for a in ATTACKS])
def test_attack_holds(arena, attack):
    if attack.id in XFAIL:
        pytest.xfail(XFAIL[attack.id])
    verdict, detail, seconds = run(attack, arena)
    assert verdict == "held", f"{attack.id} {attack.title}: {verdict}: {detail}"
