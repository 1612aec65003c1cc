"""Test hosts: Linux network namespaces on a private subnet, and a throwaway PostgreSQL.

    from _netns import testnet, pg_cluster  # noqa: F401  (fixtures)

- :class:`TestNet` makes a bridge in the root namespace (``10.231.K.1/24``, K
  picked free) and, per :meth:`TestNet.host`, a namespace joined to it by a veth
  pair (``10.231.K.2``, ``.3``, ...): each is one machine with its own network
  stack, loopback and address. Processes started with :meth:`Host.popen` run
  inside it and reach the services in the root namespace only over their veth
  link, at :attr:`TestNet.gateway_ip`. :meth:`Host.kill` SIGKILLs everything in
  the namespace (a host losing power). Teardown kills what is left, deletes
  the namespaces and the bridge; nothing outside ``10.231.K.0/24`` is touched
  and nothing leaves the machine.
- :class:`PgCluster` is a PostgreSQL of the test's own (``initdb`` in a temp
  dir, trust auth) listening on the bridge address and a free port only — the
  machine's own server on 127.0.0.1:5432 is left alone.

Needs root and ``ip netns``; the fixtures skip with the reason otherwise.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

__all__ = ["Host", "PgCluster", "TestNet", "Wire", "netns_unavailable", "pg_cluster", "testnet"]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (ip) is not installed"
    name = f"efprobe{os.getpid() % 100000}"
    p = _ip("netns", "add", name, check=False)
    if p.returncode != 0:
        return f"ip netns add failed: {p.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


def _free_subnet() -> int:
    used = _ip("-4", "addr").stdout
    start = os.getpid() % 200
    for i in range(200):
        k = (start + i) % 200 + 20
        if f"10.231.{k}." not in used:
            return k
    raise RuntimeError("no free 10.231.K.0/24 subnet")


class Host:
    """One test host: a namespace with one veth link to the test network."""

    def __init__(self, net: "TestNet", name: str, ns: str, ip: str) -> None:
        self.net, self.name, self.ns, self.ip = net, name, ns, ip
        self.procs: list[subprocess.Popen] = []

    def popen(self, argv: list[str], **kw: Any) -> subprocess.Popen:
        """Start ``argv`` inside this host (its own process group)."""
        p = subprocess.Popen(["ip", "netns", "exec", self.ns, *argv], start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def run(self, argv: list[str], **kw: Any) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.ns, *argv], capture_output=True, text=True, **kw)

    def pids(self) -> list[int]:
        out = _ip("netns", "pids", self.ns, check=False).stdout.split()
        return [int(p) for p in out if p.isdigit()]

    def kill(self) -> list[int]:
        """SIGKILL every process in the namespace (the host dies); returns the pids."""
        pids = self.pids()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        return pids

    def stop(self, timeout: float = 10.0) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        end = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self.kill()


class TestNet:
    """A bridge and the hosts on it (see the module docstring)."""

    __test__ = False  # not a pytest class

    def __init__(self) -> None:
        # random, not pid + milliseconds % 1000: that repeats within one test process (1 in 1,000 for any two
        # nets), and a repeated tag met a link of the same name: CI failed once on "ip link add efv...: File exists"
        self.tag = secrets.token_hex(4)
        self.k = _free_subnet()
        self.bridge = f"efb{self.tag}"
        self.gateway_ip = f"10.231.{self.k}.1"
        self.hosts: dict[str, Host] = {}
        _ip("link", "add", self.bridge, "type", "bridge")
        try:
            _ip("addr", "add", f"{self.gateway_ip}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
        except subprocess.CalledProcessError:
            _ip("link", "del", self.bridge, check=False)
            raise

    def host(self, name: str) -> Host:
        i = len(self.hosts) + 2
        ns = f"ef{self.tag}{name}"[:30]
        ip = f"10.231.{self.k}.{i}"
        veth_root, veth_ns = f"efv{self.tag}{i}"[:15], f"efn{self.tag}{i}"[:15]
        _ip("netns", "add", ns)
        h = Host(self, name, ns, ip)
        self.hosts[name] = h
        _ip("link", "add", veth_root, "type", "veth", "peer", "name", veth_ns)
        _ip("link", "set", veth_ns, "netns", ns)
        _ip("link", "set", veth_root, "master", self.bridge)
        _ip("link", "set", veth_root, "up")
        _ip("netns", "exec", ns, "ip", "addr", "add", f"{ip}/24", "dev", veth_ns)
        _ip("netns", "exec", ns, "ip", "link", "set", veth_ns, "up")
        _ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
        return h

    def wire(self, a: Host, b: Host) -> "Wire":
        """A direct veth link between two hosts, apart from the bridge (``10.232.K.1`` on ``a``,
        ``.2`` on ``b``): a WAN link a test can cut (:meth:`Wire.set_up`) while both hosts stay
        reachable over the bridge. It goes with the namespaces."""
        ends = (f"efw{self.tag}a"[:15], f"efw{self.tag}b"[:15])
        ips = (f"10.232.{self.k}.1", f"10.232.{self.k}.2")
        _ip("link", "add", ends[0], "type", "veth", "peer", "name", ends[1])
        for host, end, ip in zip((a, b), ends, ips):
            _ip("link", "set", end, "netns", host.ns)
            _ip("netns", "exec", host.ns, "ip", "addr", "add", f"{ip}/24", "dev", end)
            _ip("netns", "exec", host.ns, "ip", "link", "set", end, "up")
        return Wire(a, b, ips[0], ips[1], ends)

    def close(self) -> None:
        """Kill every host's processes, delete the namespaces and the bridge (idempotent)."""
        hosts, self.hosts = list(self.hosts.values()), {}
        for h in hosts:
            h.stop(timeout=5)
        for h in hosts:
            _ip("netns", "del", h.ns, check=False)  # its veth end goes with it, and the pair with that
        if self.bridge:
            _ip("link", "del", self.bridge, check=False)
            self.bridge = ""


class Wire:
    """A direct veth link between two hosts (:meth:`TestNet.wire`)."""

    def __init__(self, a: Host, b: Host, a_ip: str, b_ip: str, ends: tuple[str, str]) -> None:
        self.a, self.b, self.a_ip, self.b_ip, self.ends = a, b, a_ip, b_ip, ends

    def set_up(self, up: bool) -> None:
        """Bring both ends up or down (down: nothing passes, like a cut cable; TCP connections stay
        open on both sides until their own timers give up)."""
        for host, end in ((self.a, self.ends[0]), (self.b, self.ends[1])):
            _ip("netns", "exec", host.ns, "ip", "link", "set", end, "up" if up else "down")


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class PgCluster:
    """A throwaway PostgreSQL (``initdb`` in a temp dir) on ``host``:``port``, trust auth."""

    def __init__(self, host: str, *, allow: str) -> None:
        bindir = Path(subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True).stdout.strip()
                      or "/usr/lib/postgresql/15/bin")
        if not (bindir / "initdb").exists():
            found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
            if not found:
                raise FileNotFoundError("initdb not found")
            bindir = found[-1].parent
        self.bindir = bindir
        self.host = host
        self.port = free_port(host)
        self.dir = Path(tempfile.mkdtemp(prefix="ef-pg-"))
        shutil.chown(self.dir, "postgres", "postgres")
        self.data = self.dir / "data"
        self._as_pg([str(bindir / "initdb"), "-D", str(self.data), "--auth=trust", "-U", "postgres",
                     "--no-sync", "-E", "UTF8"])
        with open(self.data / "pg_hba.conf", "a", encoding="utf-8") as f:
            f.write(f"host all all {allow} trust\n")
        opts = (f"-c listen_addresses={host} -p {self.port} -k {self.dir} -c fsync=off "
                "-c max_connections=200 -c shared_buffers=64MB")
        self._as_pg([str(bindir / "pg_ctl"), "-D", str(self.data), "-l", str(self.dir / "log"), "-w", "-t", "60",
                     "-o", opts, "start"])

    @staticmethod
    def _as_pg(argv: list[str]) -> None:
        p = subprocess.run(["runuser", "-u", "postgres", "--", *argv], capture_output=True, text=True, timeout=120)
        if p.returncode != 0:
            raise RuntimeError(f"{argv[0]} failed: {p.stderr.strip()[-500:]}")

    @property
    def url(self) -> str:
        return f"postgresql://postgres@{self.host}:{self.port}/postgres"

    def stop(self) -> None:
        try:
            self._as_pg([str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop"])
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def testnet() -> Iterator[TestNet]:
    why = netns_unavailable()
    if why is not None:
        pytest.skip(why)
    net = TestNet()
    try:
        yield net
    finally:
        net.close()


@pytest.fixture
def pg_cluster(testnet: TestNet) -> Iterator[PgCluster]:
    """A PostgreSQL of this test, reachable only on the test network (from every test host)."""
    if shutil.which("runuser") is None:
        pytest.skip("runuser is not installed (PostgreSQL cannot run as root)")
    try:
        pg = PgCluster(testnet.gateway_ip, allow=f"10.231.{testnet.k}.0/24")
    except (OSError, RuntimeError, KeyError) as exc:
        pytest.skip(f"cannot start a PostgreSQL of the test's own: {exc}")
    try:
        yield pg
    finally:
        pg.stop()
