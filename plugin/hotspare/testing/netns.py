"""Hosts on one machine: each a Linux network namespace with its own address, joined by a switch,
so that a job's control, mirror and collective traffic crosses a real network stack, and a link
can be cut (a partition, not a crash) or slowed (``tc``: a token-bucket rate limit, and a delay
with ``netem`` where the kernel has it) under it.

Layout: a switch namespace holding a bridge, and per host a namespace whose ``eth0`` (a veth
pair's end; the other end is a port of the bridge) has ``10.231.0.<i+1>/24``. Nothing is added
to the machine's own namespace: every address, route and interface lives in the namespaces
this creates, and all of them are deleted on exit (traffic goes only to those addresses).

    with Hosts(2) as hosts:
        subprocess.Popen(hosts.run(0, [sys.executable, "-m", "hotspare.launch", ...]))
        hosts.cut(1)            # host 1's link down: a partition
        hosts.slow(1, 50)       # 50 Mbit/s (plus a delay where the kernel has netem)

Needs root (CAP_NET_ADMIN) and iproute2; :func:`available` says why not, for a skip message.
"""
from __future__ import annotations

import os
import shutil
import subprocess

SUBNET = "10.231.0"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def available() -> tuple[bool, str]:
    """Whether network namespaces can be made here, and if not, why."""
    if shutil.which("ip") is None:
        return False, "iproute2's `ip` is not installed"
    name = f"hsprobe{os.getpid()}"
    try:
        made = _ip("netns", "add", name, check=False)
        if made.returncode != 0:
            return False, f"`ip netns add` failed: {made.stderr.strip() or made.returncode} (needs root/CAP_NET_ADMIN)"
        return True, ""
    finally:
        _ip("netns", "del", name, check=False)


class Hosts:
    """``n`` hosts (network namespaces) on one switch; a context manager that removes them all."""

    def __init__(self, n: int, tag: str | None = None):
        if not 1 <= n <= 250:
            raise ValueError(f"Hosts(n={n}): 1..250 hosts")
        self.n = n
        self.tag = tag or f"hs{os.getpid() % 100000}"
        self.switch = f"{self.tag}sw"
        self.names = [f"{self.tag}h{i}" for i in range(n)]

    def addr(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def run(self, i: int, argv: list[str]) -> list[str]:
        """``argv`` run inside host ``i``."""
        return ["ip", "netns", "exec", self.names[i], *argv]

    def __enter__(self) -> Hosts:
        try:
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for i, ns in enumerate(self.names):
                _ip("netns", "add", ns)
                _ip("-n", ns, "link", "set", "lo", "up")
                # The pair is made inside the host, then its far end moves to the switch.
                _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"p{i}")
                _ip("-n", ns, "link", "set", f"p{i}", "netns", self.switch)
                _ip("-n", self.switch, "link", "set", f"p{i}", "master", "br0")
                _ip("-n", self.switch, "link", "set", f"p{i}", "up")
                _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        for ns in [*self.names, self.switch]:
            for pid in self.pids(ns):
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
            _ip("netns", "del", ns, check=False)  # its interfaces go with it

    @staticmethod
    def pids(ns: str) -> list[int]:
        out = _ip("netns", "pids", ns, check=False)
        return [int(p) for p in out.stdout.split()] if out.returncode == 0 else []

    def host_pids(self, i: int) -> list[int]:
        return self.pids(self.names[i])

    def cut(self, i: int) -> None:
        """Host ``i``'s switch port down: its packets go nowhere, nobody gets a reset."""
        _ip("-n", self.switch, "link", "set", f"p{i}", "down")

    def heal(self, i: int) -> None:
        _ip("-n", self.switch, "link", "set", f"p{i}", "up")

    def slow(self, i: int, rate_mbit: float, delay_ms: float = 0.0) -> str:
        """Rate-limit host ``i``'s traffic both ways (its eth0 and its switch port), and delay it
        when ``delay_ms`` and the kernel has ``netem``; returns the qdisc used ('netem' or 'tbf':
        kernels without sch_netem, like this project's machine, get the rate limit alone)."""
        kind = "tbf"
        for ns, dev in ((self.names[i], "eth0"), (self.switch, f"p{i}")):
            tc = ["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root"]
            if delay_ms > 0:
                done = subprocess.run([*tc, "netem", "delay", f"{delay_ms}ms", "rate", f"{rate_mbit}mbit"],
                                      capture_output=True, text=True, timeout=30)
                if done.returncode == 0:
                    kind = "netem"
                    continue
            # A token bucket: rate_mbit sustained, 64 KiB bursts, packets queue up to 2 s.
            subprocess.run([*tc, "tbf", "rate", f"{rate_mbit}mbit", "burst", "64kb", "latency", "2000ms"],
                           check=True, capture_output=True, text=True, timeout=30)
        return kind

    def unslow(self, i: int) -> None:
        """Host ``i``'s link back to full speed."""
        for ns, dev in ((self.names[i], "eth0"), (self.switch, f"p{i}")):
            subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], capture_output=True, text=True,
                           timeout=30)
