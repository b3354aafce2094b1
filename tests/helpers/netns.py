"""Machines on a LAN made of Linux network namespaces, for the multi-machine tests (root only).

Each host is a namespace with `lo` and one `eth0`, whose veth peer is a port of a bridge in a namespace of
its own: the root namespace gets no interface, address, route or sysctl from it, so test traffic stays
between the hosts and the machine's own firewall settings are never touched.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import secrets
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import pytest
from jetshard_bus.procs import spawn

from helpers.harness import wait_for

PREFIX_LENGTH = 24
BRIDGE = "br0"
HOST_INTERFACE = "eth0"
# Hosts of a lan are numbered from .1 of 10.77.<random>.0/24 (no clash is possible, as every lan is its own
# set of namespaces; the random octet tells the runs apart in logs).
FIRST_HOST_NUMBER = 1
MAX_HOSTS = 250
CLONE_NEWNET = 0x40000000
T = TypeVar("T")


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")


def _sysctls(namespace: str, settings: dict[str, str]) -> None:
    """Set the sysctls of `namespace` that exist there (bridge-nf-call-* only with br_netfilter loaded)."""
    for key, value in settings.items():
        path = "/proc/sys/" + key.replace(".", "/")
        subprocess.run(
            ["ip", "netns", "exec", namespace, "sh", "-c", f"[ ! -e {path} ] || echo {value} > {path}"],
            check=True,
            capture_output=True,
        )


@dataclass
class Host:
    name: str  # the namespace's name
    address: str  # its IPv4 address on the lan (a /24), without the prefix length
    veth: str  # the bridge's end of its link, in the switch namespace
    switch: str  # the namespace of the bridge

    def command(self, args: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *args]

    def popen(self, args: list[str], log_file: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """Start `args` inside this host, in a process group of its own, output to `log_file`."""
        return spawn(self.command(args), log_file, env)

    def run(
        self, args: list[str], timeout_s: float = 60, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.command(args), capture_output=True, text=True, timeout=timeout_s, env=env)

    def inside(self, make: Callable[[], T]) -> T:
        """`make()` run by a thread of this process that has entered this host's namespace: a socket it opens (a
        test's server, counting what the hosts ask of it in this process) belongs to this host. Other threads stay
        where they are (a namespace is a thread's own)."""
        made: list[T] = []
        failed: list[BaseException] = []

        def enter_and_make() -> None:
            try:
                with open(f"/var/run/netns/{self.name}") as namespace:
                    if ctypes.CDLL(None, use_errno=True).setns(namespace.fileno(), CLONE_NEWNET) != 0:
                        raise OSError(ctypes.get_errno(), f"setns into {self.name}")
                made.append(make())
            except BaseException as error:
                failed.append(error)

        thread = threading.Thread(target=enter_and_make, name=f"in {self.name}")
        thread.start()
        thread.join()
        if failed:
            raise failed[0]
        return made[0]

    def link_down(self) -> None:
        """Unplug this host's cable: it keeps its address and processes but reaches no one."""
        _ip("-n", self.switch, "link", "set", self.veth, "down")

    def link_up(self) -> None:
        _ip("-n", self.switch, "link", "set", self.veth, "up")


@dataclass
class Lan:
    run_name: str  # prefix and random token that every namespace name of this lan starts with
    subnet_octet: int
    hosts: list[Host] = field(default_factory=list)

    @property
    def switch(self) -> str:
        return f"{self.run_name}-sw"

    def add_host(self) -> Host:
        """A new host plugged into the bridge, with the next address of the subnet."""
        number = FIRST_HOST_NUMBER + len(self.hosts)
        if number > MAX_HOSTS:
            raise ValueError(f"a lan holds at most {MAX_HOSTS} hosts")
        host = Host(
            name=f"{self.run_name}-h{number}",
            address=f"10.77.{self.subnet_octet}.{number}",
            veth=f"h{number}",
            switch=self.switch,
        )
        _ip("netns", "add", host.name)
        self.hosts.append(host)  # before the rest, so that a failure half way still gets it removed
        _sysctls(host.name, {"net.ipv4.conf.all.rp_filter": "0", "net.ipv4.conf.default.rp_filter": "0"})
        _ip("-n", host.name, "link", "set", "lo", "up")
        _ip("link", "add", HOST_INTERFACE, "netns", host.name, "type", "veth", "peer", host.veth, "netns", self.switch)
        _ip("-n", self.switch, "link", "set", host.veth, "master", BRIDGE, "up")
        _ip("-n", host.name, "addr", "add", f"{host.address}/{PREFIX_LENGTH}", "dev", HOST_INTERFACE)
        _ip("-n", host.name, "link", "set", HOST_INTERFACE, "up")
        _ip("-n", host.name, "route", "add", "224.0.0.0/4", "dev", HOST_INTERFACE)
        return host


def _remove_namespace(name: str) -> None:
    """Kill what still runs inside `name` (a namespace outlives its deletion while a process holds it), then
    delete it."""

    def pids() -> list[str]:
        return subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()

    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), sig)
        wait_for(lambda: not pids(), timeout=3, interval=0.05)
    subprocess.run(["ip", "netns", "del", name], capture_output=True)


@contextlib.contextmanager
def lan(count: int, prefix: str = "js") -> Iterator[Lan]:
    """`count` hosts on one bridge (more with `add_host`), all removed afterwards; skips without root."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (ip netns)")
    network = Lan(run_name=f"{prefix}-{secrets.token_hex(3)}", subnet_octet=random.randrange(256))
    added = subprocess.run(["ip", "netns", "add", network.switch], capture_output=True, text=True)
    if added.returncode != 0:
        pytest.skip(f"cannot create a network namespace here: {added.stderr.strip()}")
    try:
        # The bridge floods multicast (mDNS) to every port instead of waiting for IGMP joins, and does not hand
        # bridged frames to iptables (in its own namespace, whose tables are empty anyway).
        _sysctls(
            network.switch,
            {f"net.bridge.bridge-nf-call-{table}": "0" for table in ("iptables", "ip6tables", "arptables")},
        )
        _ip("-n", network.switch, "link", "add", BRIDGE, "type", "bridge", "mcast_snooping", "0")
        _ip("-n", network.switch, "link", "set", BRIDGE, "up")
        for _ in range(count):
            network.add_host()
        yield network
    finally:
        for host in network.hosts:
            _remove_namespace(host.name)
        _remove_namespace(network.switch)
