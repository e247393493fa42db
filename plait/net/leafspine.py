"""A small leaf/spine of network namespaces where the kernel hashes (issue 35, item 4; root only).

Namespaces ``h0 - l0 - {s0..s(k-1)} - l1 - h1``: host h0 sends to host h1 through leaf l0,
which has one multipath route over the ``k`` spines. The kernel picks a spine per flow by its
L4 hash (``net.ipv4.fib_multipath_hash_policy=1``: addresses, protocol and ports) salted by
``net.ipv4.fib_multipath_hash_seed``; each leaf-to-spine link is shaped with ``tc tbf`` to
`rate`, so the spine uplinks are the contended cables, as on a fabric. Two placements:

* **hashed**: the kernel's choice for each flow's real source port, read back from the
  uplinks' byte counters (``ip route get ... sport P`` on the leaf does not report the spine the
  forwarded packets take under policy 1, so it is not used);
* **planned**: flows spread evenly over the spines by policy routes on the leaf (``ip rule ...
  sport P table T``, one table per spine): the stock-NCCL form of a plan, per 5-tuple.

Every flow sends the same bytes at once; the step ends at the last byte. Beside each
measurement, the simulator's engine (`plait.sim.engine` via the caller) or the flow model
predicts the step on the same placement. Everything is named ``plaitls-<pid>-*`` and removed
on exit, also on errors.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from plait.net.twolink import _RECEIVER, _SENDER, available  # noqa: F401  (available: re-exported)

DST, PORT = "10.216.2.1", 5201


def _sh(*cmd: str) -> str:
    return subprocess.run(list(cmd), check=True, capture_output=True, text=True).stdout


@dataclass
class LeafSpineStep:
    case: str  # "planned" or "hashed seed S"
    seconds: float  # measured: first send to last byte received
    uplink_bytes: list[int]  # bytes each leaf->spine link carried (the kernel's counters)
    flows: int

    @property
    def flows_per_spine(self) -> list[int]:
        """Flows each uplink carried, from its byte counter (every flow sends the same bytes)."""
        per = sum(self.uplink_bytes) / self.flows
        return [round(b / per) for b in self.uplink_bytes]

    @property
    def spines(self) -> list[int]:
        """A spine per flow with these counts (which flow took which does not change the step)."""
        return [s for s, n in enumerate(self.flows_per_spine) for _ in range(n)]


class LeafSpine:
    """Context manager: the namespaces above, `spines` spines, uplinks shaped to `rate` bytes/s."""

    def __init__(self, spines: int = 4, rate: float = 4e6) -> None:
        self.k, self.rate = spines, rate
        self.tag = f"plaitls-{os.getpid()}"
        self.ns = {n: f"{self.tag}-{n}" for n in ["h0", "l0", "l1", "h1"] + [f"s{i}" for i in range(spines)]}
        self.up = [f"lu{os.getpid() % 10000}{i}" for i in range(spines)]  # l0's device towards spine i

    def _link(self, a: str, da: str, ip_a: str, b: str, db: str, ip_b: str) -> None:
        _sh("ip", "link", "add", da, "netns", self.ns[a], "type", "veth", "peer", "name", db, "netns", self.ns[b])
        for n, d, ip in ((a, da, ip_a), (b, db, ip_b)):
            _sh("ip", "-n", self.ns[n], "addr", "add", ip, "dev", d)
            _sh("ip", "-n", self.ns[n], "link", "set", d, "up")

    def __enter__(self) -> LeafSpine:
        try:
            for ns in self.ns.values():
                _sh("ip", "netns", "add", ns)
                _sh("ip", "-n", ns, "link", "set", "lo", "up")
                _sh("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.ip_forward=1")
            p = os.getpid() % 10000
            self._link("h0", f"ha{p}", "10.216.1.1/24", "l0", f"la{p}", "10.216.1.254/24")
            self._link("h1", f"hb{p}", "10.216.2.1/24", "l1", f"lb{p}", "10.216.2.254/24")
            kbit = max(8, int(self.rate * 8 / 1000))
            for i in range(self.k):
                s = f"s{i}"
                self._link("l0", self.up[i], f"10.217.{i}.1/24", s, f"sa{p}{i}", f"10.217.{i}.2/24")
                self._link(s, f"sb{p}{i}", f"10.218.{i}.2/24", "l1", f"ld{p}{i}", f"10.218.{i}.1/24")
                _sh("ip", "netns", "exec", self.ns["l0"], "tc", "qdisc", "add", "dev", self.up[i], "root", "tbf",
                    "rate", f"{kbit}kbit", "burst", "16kb", "latency", "100ms")
                _sh("ip", "-n", self.ns[s], "route", "add", "10.216.2.0/24", "via", f"10.218.{i}.1")
                _sh("ip", "-n", self.ns[s], "route", "add", "10.216.1.0/24", "via", f"10.217.{i}.1")
                # one table per spine for the planned placement's policy routes
                _sh("ip", "-n", self.ns["l0"], "route", "add", "10.216.2.0/24", "via", f"10.217.{i}.2",
                    "table", str(100 + i))
            _sh("ip", "-n", self.ns["h0"], "route", "add", "default", "via", "10.216.1.254")
            _sh("ip", "-n", self.ns["h1"], "route", "add", "default", "via", "10.216.2.254")
            hops = [x for i in range(self.k) for x in ("nexthop", "via", f"10.217.{i}.2")]
            _sh("ip", "-n", self.ns["l0"], "route", "add", "10.216.2.0/24", *hops)
            back = [x for i in range(self.k) for x in ("nexthop", "via", f"10.218.{i}.2")]
            _sh("ip", "-n", self.ns["l1"], "route", "add", "10.216.1.0/24", *back)
            _sh("ip", "netns", "exec", self.ns["l0"], "sysctl", "-qw", "net.ipv4.fib_multipath_hash_policy=1")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for ns in self.ns.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def set_seed(self, seed: int) -> None:
        _sh("ip", "netns", "exec", self.ns["l0"], "sysctl", "-qw", f"net.ipv4.fib_multipath_hash_seed={seed}")

    def pin(self, sports: Sequence[int], spines: Sequence[int]) -> None:
        """Policy routes on the leaf: flow with source port P to spine spines[i]."""
        for sp, s in zip(sports, spines):
            _sh("ip", "-n", self.ns["l0"], "rule", "add", "ipproto", "tcp", "sport", str(sp), "table", str(100 + s),
                "priority", str(1000 + s))

    def unpin(self, sports: Sequence[int], spines: Sequence[int]) -> None:
        for sp, s in zip(sports, spines):
            subprocess.run(["ip", "-n", self.ns["l0"], "rule", "del", "ipproto", "tcp", "sport", str(sp), "table",
                            str(100 + s), "priority", str(1000 + s)], capture_output=True)

    def _tx(self) -> list[int]:
        out = []
        for d in self.up:
            text = _sh("ip", "-n", self.ns["l0"], "-s", "link", "show", d)
            lines = text.splitlines()
            i = next(j for j, line in enumerate(lines) if line.strip().startswith("TX:"))
            out.append(int(lines[i + 1].split()[0]))
        return out

    def step(self, sports: Sequence[int], nbytes: int, case: str) -> LeafSpineStep:
        """All flows h0 -> h1 at once, each `nbytes`, from source ports `sports`; which uplink
        each took is read from the uplinks' byte counters."""
        before = self._tx()
        r = subprocess.Popen(["ip", "netns", "exec", self.ns["h1"], sys.executable, "-c", _RECEIVER, DST,
                              str(PORT), str(len(sports))], stdout=subprocess.PIPE, text=True)
        try:
            assert r.stdout is not None
            r.stdout.readline()  # "ready"
            go = time.monotonic() + 1.0
            snd = subprocess.run(["ip", "netns", "exec", self.ns["h0"], sys.executable, "-c", _SENDER,
                                  ",".join(f"{DST}:{PORT}" for _ in sports), str(nbytes),
                                  ",".join(map(str, sports)), repr(go)],
                                 capture_output=True, text=True, timeout=180)
            if snd.returncode:
                raise RuntimeError(f"leaf/spine sender failed: {snd.stderr.strip()[-200:]}")
            start = float(snd.stdout.split()[0])
            end, _got = r.stdout.readline().split()
            r.wait(timeout=30)
        finally:
            if r.poll() is None:
                r.kill()
                r.wait()
        after = self._tx()
        return LeafSpineStep(case, float(end) - start, [b - a for a, b in zip(before, after)], len(sports))


def measure(spines: int = 4, flows: int = 8, rate: float = 4e6, nbytes: int = 2_000_000,
            seeds: Sequence[int] = (1, 2, 3, 4, 5)) -> list[LeafSpineStep]:
    """The planned placement (flows spread evenly by policy routes) first, then the kernel's hash
    for each seed: `flows` TCP flows of `nbytes` over `spines` uplinks of `rate` bytes/s each."""
    out = []
    with LeafSpine(spines, rate) as net:
        base = 41000
        sports = [base + 5000 + 13 * i for i in range(flows)]
        spread = [i % spines for i in range(flows)]
        net.pin(sports, spread)
        try:
            out.append(net.step(sports, nbytes, "planned (policy routes)"))
        finally:
            net.unpin(sports, spread)
        for n, seed in enumerate(seeds):
            time.sleep(0.3)
            net.set_seed(seed)
            out.append(net.step([base + 97 * n + 13 * i for i in range(flows)], nbytes, f"hashed, seed {seed}"))
    return out
