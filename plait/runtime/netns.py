"""An emulated multi-node network on one machine: Linux network namespaces, veth pairs, `tc`.

Each emulated node that a run uses gets its own network namespace with

* `lo` up -- ranks of the same node talk over loopback, fast, as over NVLink/PCIe;
* one veth `plait0` whose peer sits on a bridge in a dedicated bridge namespace, with
  an address in the private subnet 10.213.0.0/24 (never routed anywhere: the bridge
  namespace has no other interface, so no packet can leave the machine).

Shaping (`tc`, egress of both veth ends, so a node's uplink *and* downlink are limited
like a real NIC)::

    plait0 (inside node a)              1: htb
      1:1   rate = ceil = uplink(a)     node's NIC total: nic.bandwidth * nics * scale
      1:1b  per destination node b      ceil = link(a, b) * scale, u32 match ip dst
            + netem delay latency(a, b) when the kernel has sch_netem
    peer on the bridge (towards node a) htb rate = downlink(a) = uplink(a)

`link(a, b)` is the slowest device-to-device bandwidth between the two nodes in
`bandwidth_matrix(Cluster)` (which holds the file's per-pair overrides and any
switch oversubscription), `latency(a, b)` the largest latency; `scale` is
`cluster.emulation.bandwidth_scale` (a CPU run sees the same *ratios* as the GPUs).
Child rates are the parent's rate divided evenly (ceil = the link) so HTB keeps the
sum under the NIC total: in HTB a class below its own `rate` sends without asking
its parent, so children's rates must not add up to more than the parent's.

Without root, when `ip netns add` fails, when the cluster file turns namespaces off,
or when a single node is used, ranks fall back to loopback (127.0.0.1) and the log
says why. Everything this module creates is named `<prefix>-<pid>-...` and removed on
exit, on exceptions, on SIGTERM/SIGHUP (handlers raise SystemExit so `finally` runs)
and at interpreter exit (atexit); `cleanup_stale(prefix)` removes leftovers of dead
processes (e.g. after SIGKILL).
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import logging
import os
import re
import shutil
import signal
import subprocess
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from plait.cluster.topology import bandwidth_matrix, latency_matrix
from plait.errors import PlaitError

if TYPE_CHECKING:
    from plait.cluster.spec import Cluster
    from plait.ir.plan import Plan

log = logging.getLogger("plait.runtime.netns")

SUBNET = ipaddress.ip_network("10.213.0.0/24")
IFNAME = "plait0"  # the veth inside every node namespace (same name everywhere: one GLOO_SOCKET_IFNAME)
LOOPBACK = "127.0.0.1"


class NetnsError(PlaitError, RuntimeError):
    """Creating or shaping the emulated network failed in a way the fallback cannot hide."""


@dataclass(frozen=True)
class NodeNet:
    """Where one emulated node's ranks live: a namespace (None: the current one) and an address."""

    node_index: int  # index into Cluster.nodes
    namespace: str | None
    ip: str
    ifname: str | None = None  # interface that carries inter-node traffic inside `namespace`

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside this node's namespace (`ip netns exec NS ...`), or as is."""
        if self.namespace is None:
            return list(argv)
        return ["ip", "netns", "exec", self.namespace, *argv]

    def env(self) -> dict[str, str]:
        """Environment that makes gloo/NCCL use this node's shaped interface.

        NCCL_HOSTID makes NCCL treat each emulated node as its own host, so traffic
        between nodes goes over the (shaped) socket transport, not P2P/SHM."""
        if self.namespace is None:
            return {}
        return {
            "GLOO_SOCKET_IFNAME": self.ifname or IFNAME,
            "NCCL_SOCKET_IFNAME": self.ifname or IFNAME,
            "NCCL_HOSTID": self.namespace,
            "NCCL_IB_DISABLE": "1",
        }


class EmulatedNetwork(list):
    """The list of `NodeNet`s `emulated_network` yields, plus what was actually emulated."""

    def __init__(self, nets: Sequence[NodeNet] = (), *, isolated: bool = False, shaped: bool = False,
                 latency_emulated: bool = False, reason: str = "",
                 links: dict[tuple[int, int], tuple[float, float]] | None = None,
                 uplinks: dict[int, float] | None = None) -> None:
        super().__init__(nets)
        self.isolated = isolated  # True when nodes live in their own namespaces
        self.shaped = shaped  # True when tc rate limits were installed
        self.latency_emulated = latency_emulated  # False when the kernel lacks sch_netem
        self.reason = reason  # why it fell back / what is missing, for the log and the report
        # (node a, node b) -> (bytes/s, seconds) as installed (after bandwidth_scale)
        self.links = dict(links or {})
        self.uplinks = dict(uplinks or {})  # node -> NIC total bytes/s as installed
        self.slow_links: dict[tuple[int, int], float] = {}  # injected: node pair -> bandwidth divisor

    def node(self, node_index: int) -> NodeNet:
        for n in self:
            if n.node_index == node_index:
                return n
        raise KeyError(f"node {node_index} is not part of this emulated network")

    @property
    def master_addr(self) -> str:
        return self[0].ip if self else LOOPBACK


# ---------------------------------------------------------------- helpers


def _run(cmd: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise NetnsError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def _tools_present() -> bool:
    return shutil.which("ip") is not None and shutil.which("tc") is not None


def list_namespaces() -> list[str]:
    """Names of the network namespaces `ip netns` knows."""
    if shutil.which("ip") is None:
        return []
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale(prefix: str = "plait") -> list[str]:
    """Delete namespaces `<prefix>-<pid>-*` whose creating process is gone; returns their names."""
    pattern = re.compile(rf"^{re.escape(prefix)}-(\d+)-")
    removed = []
    for name in list_namespaces():
        m = pattern.match(name)
        if m and not _pid_alive(int(m.group(1))):
            if _run(["ip", "netns", "del", name], check=False).returncode == 0:
                removed.append(name)
    if removed:
        log.info("removed %d stale namespace(s): %s", len(removed), ", ".join(removed))
    return removed


def _used_nodes(cluster: Cluster, plan_or_world: Plan | int) -> list[int]:
    """Cluster node indices that host a rank of the run, in order."""
    devices = cluster.devices
    if isinstance(plan_or_world, int):
        if plan_or_world < 1 or plan_or_world > len(devices):
            raise NetnsError(f"cluster '{cluster.name}': world size {plan_or_world} does not fit its "
                             f"{len(devices)} devices")
        ids = range(plan_or_world)
    else:
        plan = plan_or_world
        ids = [plan.device_of(r) for r in range(plan.world_size)]
        bad = [d for d in ids if d >= len(devices)]
        if bad:
            raise NetnsError(f"plan places ranks on device(s) {bad} but cluster '{cluster.name}' has "
                             f"{len(devices)} devices")
    return sorted({devices[d].node for d in ids})


def node_links(cluster: Cluster, nodes: Sequence[int]
               ) -> tuple[dict[int, float], dict[tuple[int, int], tuple[float, float]]]:
    """Unscaled (uplink per node, (bandwidth, latency) per ordered node pair) for `nodes`.

    The pair figure is the slowest device pair between the two nodes in the cluster's
    effective matrices (a ring crossing them runs at its slowest link; Pipette §3)."""
    import numpy as np

    bw = np.asarray(bandwidth_matrix(cluster), dtype=float)
    lat = np.asarray(latency_matrix(cluster), dtype=float)
    members: dict[int, list[int]] = {}
    for d in cluster.devices:
        members.setdefault(d.node, []).append(d.id)
    uplinks = {n: float(cluster.nodes[n].nic.bandwidth) * max(1, int(cluster.nodes[n].nics)) for n in nodes}
    links: dict[tuple[int, int], tuple[float, float]] = {}
    for a in nodes:
        for b in nodes:
            if a == b:
                continue
            sub = np.ix_(members[a], members[b])
            links[(a, b)] = (float(bw[sub].min()), float(lat[sub].max()))
    return uplinks, links


def _htb_params(rate: float) -> list[str]:
    """Explicit burst/quantum: the defaults are too small for veth's 64 KiB GSO packets."""
    burst = max(int(rate * 0.002), 2 * 65536)  # 2 ms of tokens, at least two GSO packets
    quantum = min(max(int(rate / 1000), 1514), 200_000)
    return ["burst", str(burst), "cburst", str(burst), "quantum", str(quantum)]


def _rate(rate: float) -> str:
    return f"{max(int(rate * 8), 8000)}bit"  # tc takes bits/s; the floor keeps tc from rejecting 0


# ---------------------------------------------------------------- the network


class _Builder:
    """Creates and removes one run's namespaces; safe to call `remove` more than once."""

    def __init__(self, prefix: str) -> None:
        self.tag = f"{prefix}-{os.getpid()}-{next(_SEQ)}"
        self.created: list[str] = []
        self._lock = threading.Lock()

    def ns(self, suffix: str) -> str:
        return f"{self.tag}-{suffix}"

    def add_ns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self.created.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def remove(self) -> None:
        with self._lock:
            names, self.created = self.created, []
        for name in reversed(names):  # node namespaces first; deleting one end removes the veth pair
            proc = _run(["ip", "netns", "del", name], check=False)
            if proc.returncode != 0:
                log.warning("could not remove namespace %s: %s", name, proc.stderr.strip())


def _counter() -> Iterator[int]:
    i = 0
    while True:
        yield i
        i += 1


_SEQ = _counter()


def _netem_available(ns: str, dev: str) -> bool:
    """Probe once per namespace: many container kernels ship without sch_netem."""
    probe = _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "9:", "netem", "delay", "1us"],
                 check=False)
    if probe.returncode != 0:
        return False
    _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
    return True


def _shape(builder: _Builder, br_ns: str, nets: list[NodeNet], uplinks: dict[int, float],
           links: dict[tuple[int, int], tuple[float, float]]) -> bool:
    """Install the htb (+ netem) tree described in the module docstring; returns latency_emulated."""
    netem = _netem_available(nets[0].namespace, IFNAME) if nets else False
    ip_of = {n.node_index: n.ip for n in nets}
    for net in nets:
        a, ns = net.node_index, net.namespace
        up = uplinks[a]
        peers = [b for b in ip_of if b != a]
        tc = ["tc", "-n", ns]
        _run([*tc, "qdisc", "add", "dev", IFNAME, "root", "handle", "1:", "htb", "default", "1"])
        _run([*tc, "class", "add", "dev", IFNAME, "parent", "1:", "classid", "1:1", "htb",
              "rate", _rate(up), "ceil", _rate(up), *_htb_params(up)])
        share = up / max(1, len(peers))
        for k, b in enumerate(peers):
            bw, lat = links[(a, b)]
            ceil = min(bw, up)
            classid = f"1:{k + 10:x}"
            _run([*tc, "class", "add", "dev", IFNAME, "parent", "1:1", "classid", classid, "htb",
                  "rate", _rate(min(share, ceil)), "ceil", _rate(ceil), *_htb_params(ceil)])
            if netem and lat > 0:
                _run([*tc, "qdisc", "add", "dev", IFNAME, "parent", classid, "handle", f"{k + 10:x}:",
                      "netem", "delay", f"{max(1, round(lat * 1e6))}us", "limit", "100000"])
            _run([*tc, "filter", "add", "dev", IFNAME, "parent", "1:", "protocol", "ip", "prio", "1",
                  "u32", "match", "ip", "dst", f"{ip_of[b]}/32", "flowid", classid])
        # Downlink: the bridge-side peer's egress carries everything sent *to* node a.
        peer = f"n{a}"
        _run(["tc", "-n", br_ns, "qdisc", "add", "dev", peer, "root", "handle", "1:", "htb", "default", "1"])
        _run(["tc", "-n", br_ns, "class", "add", "dev", peer, "parent", "1:", "classid", "1:1", "htb",
              "rate", _rate(up), "ceil", _rate(up), *_htb_params(up)])
    return netem


_WARNED: set[str] = set()


def warn_once(reason: str) -> None:
    """Log an emulation shortfall the first time this process meets it: one `plait plan --run`
    builds the emulated network several times (calibration, profiling, the run) and a note
    printed at each would say the same thing four times."""
    if reason in _WARNED:
        log.debug("emulated network: %s", reason)
        return
    _WARNED.add(reason)
    log.warning("emulated network: %s", reason)


def already_reported(note: str) -> bool:
    """Whether `note` (a run note "network: <reason>") was already logged by `warn_once`."""
    text = note.removeprefix("network:").strip()
    return bool(text) and any(w.endswith(text) for w in _WARNED)


def _build(builder: _Builder, cluster: Cluster, nodes: list[int], scale: float,
           slow_links: dict[tuple[int, int], float] | None = None) -> EmulatedNetwork:
    br_ns = builder.ns("br")
    builder.add_ns(br_ns)
    _run(["ip", "-n", br_ns, "link", "add", "br0", "type", "bridge"])
    _run(["ip", "-n", br_ns, "link", "set", "br0", "up"])
    hosts = list(SUBNET.hosts())
    nets: list[NodeNet] = []
    for k, a in enumerate(nodes):
        ns = builder.ns(f"n{a}")
        builder.add_ns(ns)
        peer = f"n{a}"
        # Both ends are created directly inside their namespaces: nothing appears in the root namespace.
        _run(["ip", "link", "add", IFNAME, "netns", ns, "type", "veth", "peer", "name", peer, "netns", br_ns])
        _run(["ip", "-n", br_ns, "link", "set", peer, "master", "br0"])
        _run(["ip", "-n", br_ns, "link", "set", peer, "up"])
        ip = str(hosts[k])
        _run(["ip", "-n", ns, "addr", "add", f"{ip}/{SUBNET.prefixlen}", "dev", IFNAME])
        _run(["ip", "-n", ns, "link", "set", IFNAME, "up"])
        nets.append(NodeNet(node_index=a, namespace=ns, ip=ip, ifname=IFNAME))
    uplinks, links = node_links(cluster, nodes)
    uplinks = {a: v * scale for a, v in uplinks.items()}
    # Injected slow links (`plait run --inject link:...`): that node pair's class runs `factor` x slower.
    links = {p: (bw * scale / (slow_links or {}).get(p, 1.0), lat) for p, (bw, lat) in links.items()}
    netem = _shape(builder, br_ns, nets, uplinks, links)
    reason = "" if netem else "kernel has no sch_netem: link latency is not emulated (bandwidth is)"
    if reason:
        warn_once(reason)
    out = EmulatedNetwork(nets, isolated=True, shaped=True, latency_emulated=netem, reason=reason,
                          links=links, uplinks=uplinks)
    out.slow_links = dict(slow_links or {})
    return out


def _loopback(nodes: list[int], reason: str) -> EmulatedNetwork:
    warn_once(f"falling back to loopback (127.0.0.1) for all nodes: {reason}")
    return EmulatedNetwork([NodeNet(node_index=a, namespace=None, ip=LOOPBACK) for a in nodes], reason=reason)


@contextlib.contextmanager
def _cleanup_guard(builder: _Builder) -> Iterator[None]:
    """Remove the namespaces on any exit: normal, exception, SIGTERM/SIGHUP, interpreter exit."""
    atexit.register(builder.remove)
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        def _raise(signum: int, _frame: Any) -> None:
            raise SystemExit(128 + signum)

        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) in (signal.SIG_DFL, None):
                previous[sig] = signal.signal(sig, _raise)
    try:
        yield
    finally:
        try:
            builder.remove()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            atexit.unregister(builder.remove)


def namespaces_possible() -> tuple[bool, str]:
    """(True, "") when this process can create network namespaces, else (False, why)."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return False, "not a Linux system"
    if os.geteuid() != 0:
        return False, "not running as root (network namespaces and tc need root)"
    if not _tools_present():
        return False, "iproute2 (`ip`, `tc`) is not installed"
    return True, ""


@contextlib.contextmanager
def emulated_network(cluster: Cluster, plan_or_world: Plan | int, *, prefix: str = "plait",
                     slow_links: dict[tuple[int, int], float] | None = None) -> Iterator[EmulatedNetwork]:
    """One shaped network namespace per node the run uses; yields an `EmulatedNetwork` (a list of NodeNet).

    `plan_or_world` is a `Plan` (nodes of `plan.device_of(r)` for every rank) or a world
    size (devices 0..world-1). Falls back to loopback entries, and logs why, when
    namespaces are impossible or not wanted."""
    nodes = _used_nodes(cluster, plan_or_world)
    emu = getattr(cluster, "emulation", None)
    if emu is not None and not (emu.enabled and emu.namespaces):
        yield _loopback(nodes, "the cluster file turns network namespaces off")
        return
    if len(nodes) < 2:
        # Nothing crosses a node boundary: shaping would change nothing.
        yield EmulatedNetwork([NodeNet(node_index=a, namespace=None, ip=LOOPBACK) for a in nodes],
                              reason="a single node: all traffic is intra-node")
        return
    if len(nodes) > SUBNET.num_addresses - 2:
        raise NetnsError(f"cluster '{cluster.name}': {len(nodes)} nodes do not fit the emulation subnet {SUBNET}")
    ok, why = namespaces_possible()
    if not ok:
        yield _loopback(nodes, why)
        return
    scale = float(emu.bandwidth_scale) if emu is not None else 1.0
    if not scale > 0:
        raise NetnsError(f"{getattr(cluster, 'source', 'cluster')}: field 'emulation.bandwidth_scale' must be > 0, "
                         f"got {scale}")
    builder = _Builder(prefix)
    with _cleanup_guard(builder):
        try:
            net = _build(builder, cluster, nodes, scale, slow_links)
        except NetnsError as exc:
            builder.remove()
            net = _loopback(nodes, f"could not build the namespaces ({exc})")
        else:
            log.info("emulated network %s: %d node namespaces on %s, %s", builder.tag, len(nodes), SUBNET,
                     ", ".join(f"node{a}->node{b} {bw / 1e6:.1f} MB/s" for (a, b), (bw, _) in sorted(net.links.items())))
        yield net

