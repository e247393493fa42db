"""The emulated network: namespaces created and removed, tc shaping measured, loopback fallback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from plait.cluster.spec import Cluster, EmulationSpec, GPUKind, Link, NodeSpec, PairOverride
from plait.runtime import netns
from plait.runtime.netns import NodeNet, cleanup_stale, emulated_network, list_namespaces

KIND = GPUKind("test-gpu", {"fp32": 1e12}, 16 * 2**30, 1e11)
MB = 1e6


def TinyCluster(bw: list[list[float]], uplink: float, latency: float = 0.0, scale: float = 1.0,  # noqa: N802
                namespaces: bool = True) -> Cluster:
    """A real Cluster, one GPU per node, whose node-to-node bandwidths are `bw[a][b]` (measured
    pair overrides), so these tests check only the network emulation."""
    n = len(bw)
    nodes = [NodeSpec(f"n{i}", ["test-gpu"], Link(1e10, 1e-6), Link(uplink, latency)) for i in range(n)]
    overrides = [PairOverride(a, b, bandwidth=float(bw[a][b]), latency=latency)
                 for a in range(n) for b in range(a + 1, n)]
    return Cluster("tiny", {"test-gpu": KIND}, nodes, overrides=overrides,
                   emulation=EmulationSpec(bandwidth_scale=scale, namespaces=namespaces), source="<test>")


def _can_make_namespaces() -> bool:
    ok, _ = netns.namespaces_possible()
    if not ok:
        return False
    name = f"plaitprobe-{os.getpid()}"
    if subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode != 0:
        return False
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return True


needs_netns = pytest.mark.skipif(not _can_make_namespaces(), reason="needs root and working `ip netns`")

SERVER = textwrap.dedent("""
    import socket, sys
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[1], 5301)); s.listen(4); print("ready", flush=True)
    while True:
        c, _ = s.accept()
        while c.recv(1 << 20):
            pass
        c.sendall(b"k"); c.close()
""")

CLIENT = textwrap.dedent("""
    import json, socket, sys, time
    out = {}
    for arg in sys.argv[1:]:
        ip, total = arg.split("=")
        total = int(total); c = socket.create_connection((ip, 5301)); buf = b"\\0" * 65536
        sent, t0 = 0, time.perf_counter()
        while sent < total:
            c.sendall(buf); sent += len(buf)
        c.shutdown(socket.SHUT_WR); c.recv(1)
        out[ip] = sent / (time.perf_counter() - t0)
    print(json.dumps(out))
""")


def _rates(src: NodeNet, targets: dict[NodeNet, int], tries: int = 3) -> dict[str, float]:
    """Bytes/s of a TCP transfer from `src` to each target (one at a time), measured by the sender:
    the best of `tries` transfers -- the link's capacity, which a busy machine only hides (a
    scheduling delay of tens of ms in a 0.2 s transfer reads as a slower link), never raises."""
    best: dict[str, float] = {}
    for _ in range(tries):
        for ip, rate in _rates_once(src, targets).items():
            best[ip] = max(best.get(ip, 0.0), rate)
    return best


def _rates_once(src: NodeNet, targets: dict[NodeNet, int]) -> dict[str, float]:
    servers = []
    try:
        for t in targets:
            p = subprocess.Popen(t.command([sys.executable, "-c", SERVER, t.ip]), stdout=subprocess.PIPE, text=True)
            servers.append(p)
            assert p.stdout.readline().strip() == "ready"
        argv = [sys.executable, "-c", CLIENT, *(f"{t.ip}={n}" for t, n in targets.items())]
        out = subprocess.run(src.command(argv), capture_output=True, text=True, timeout=30, check=True).stdout
        return json.loads(out)
    finally:
        for p in servers:
            p.kill()
            p.wait()


@needs_netns
def test_namespaces_created_shaped_and_removed() -> None:
    # node0 -> node1: 16 MB/s; node0 -> node2: 8 MB/s (an uneven link); uplinks 16 MB/s.
    bw = [[0, 16 * MB, 8 * MB], [16 * MB, 0, 16 * MB], [8 * MB, 16 * MB, 0]]
    cluster = TinyCluster(bw, uplink=16 * MB)
    with emulated_network(cluster, 3, prefix="plaittest") as net:
        assert net.isolated and net.shaped
        names = [n.namespace for n in net]
        assert len(set(names)) == 3 and all(n.startswith(f"plaittest-{os.getpid()}-") for n in names)
        assert set(names) <= set(list_namespaces())
        assert all(n.ip.startswith("10.213.0.") for n in net)
        assert net.links[(0, 2)][0] == pytest.approx(8 * MB)
        rates = _rates(net[0], {net[1]: 3_000_000, net[2]: 1_500_000})
        # htb counts Ethernet/IP/TCP headers (~3.5% at 1500-byte MTU) against the rate.
        assert rates[net[1].ip] == pytest.approx(16 * MB, rel=0.2)
        assert rates[net[2].ip] == pytest.approx(8 * MB, rel=0.2)
    assert not set(names) & set(list_namespaces())


@needs_netns
def test_bandwidth_scale_and_removal_on_exception() -> None:
    cluster = TinyCluster([[0, 400 * MB], [400 * MB, 0]], uplink=400 * MB, scale=0.05)  # -> 20 MB/s
    with pytest.raises(RuntimeError, match="boom"):
        with emulated_network(cluster, 2, prefix="plaittest") as net:
            names = [n.namespace for n in net]
            assert net.links[(0, 1)][0] == pytest.approx(20 * MB)
            rate = _rates(net[1], {net[0]: 3_000_000})[net[0].ip]
            assert rate == pytest.approx(20 * MB, rel=0.2)
            raise RuntimeError("boom")
    assert not set(names) & set(list_namespaces())


@needs_netns
def test_removed_on_sigterm_and_stale_after_sigkill() -> None:
    code = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {os.getcwd()!r})
        from tests.test_netns import TinyCluster
        from plait.runtime.netns import emulated_network
        with emulated_network(TinyCluster([[0, 1e8], [1e8, 0]], uplink=1e8), 2, prefix="plaitsig") as net:
            print(" ".join(n.namespace for n in net), flush=True)
            time.sleep(60)
    """)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        names = p.stdout.readline().split()
        assert len(names) == 2 and set(names) <= set(list_namespaces())
        os.kill(p.pid, sig)
        p.wait(timeout=20)
        if sig == signal.SIGKILL:  # no handler can run: the stale sweep removes them
            assert set(names) <= set(list_namespaces())
            removed = cleanup_stale("plaitsig")
            assert set(names) <= set(removed)
        time.sleep(0.05)
        assert not set(names) & set(list_namespaces())


def test_fallback_without_root(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    cluster = TinyCluster([[0, 1e8], [1e8, 0]], uplink=1e8)
    with caplog.at_level("WARNING", logger="plait.runtime.netns"):
        with emulated_network(cluster, 2) as net:
            assert [n.namespace for n in net] == [None, None]
            assert [n.ip for n in net] == ["127.0.0.1", "127.0.0.1"]
            assert not net.isolated and "root" in net.reason
            assert net[0].command(["true"]) == ["true"] and net[0].env() == {}
    assert "falling back to loopback" in caplog.text


def test_fallback_when_netns_add_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns, "namespaces_possible", lambda: (True, ""))

    def fail(self: object, name: str) -> None:
        raise netns.NetnsError(f"`ip netns add {name}` failed: Operation not permitted")

    monkeypatch.setattr(netns._Builder, "add_ns", fail)
    with emulated_network(TinyCluster([[0, 1e8], [1e8, 0]], uplink=1e8), 2) as net:
        assert [n.namespace for n in net] == [None, None]
        assert "Operation not permitted" in net.reason


def test_off_single_node_and_bad_world() -> None:
    cluster = TinyCluster([[0, 1e8], [1e8, 0]], uplink=1e8, namespaces=False)
    with emulated_network(cluster, 2) as net:
        assert not net.isolated and "off" in net.reason
    with emulated_network(TinyCluster([[0, 1e8], [1e8, 0]], uplink=1e8), 1) as net:
        assert len(net) == 1 and net[0].namespace is None
    with pytest.raises(netns.NetnsError, match="world size 5"):
        with emulated_network(cluster, 5):
            pass


def test_node_links_take_slowest_device_pair() -> None:
    # Two devices on node 0: the slower of its links to node 1 wins.
    nodes = [NodeSpec("n0", ["test-gpu"] * 2, Link(1e10, 1e-6), Link(10.0, 2e-6)),
             NodeSpec("n1", ["test-gpu"], Link(1e10, 1e-6), Link(10.0, 2e-6))]
    c = Cluster("tiny", {"test-gpu": KIND}, nodes, source="<test>",
                overrides=[PairOverride(0, 1, 5.0, 2e-6), PairOverride(0, 2, 7.0, 2e-6),
                           PairOverride(1, 2, 3.0, 2e-6)])
    up, links = netns.node_links(c, [0, 1])
    assert links[(0, 1)] == (3.0, 2e-6) and up == {0: 10.0, 1: 10.0}


def test_nodenet_command_and_env() -> None:
    n = NodeNet(1, "plait-1-n1", "10.213.0.2", "plait0")
    assert n.command(["python", "x.py"]) == ["ip", "netns", "exec", "plait-1-n1", "python", "x.py"]
    env = n.env()
    assert env["GLOO_SOCKET_IFNAME"] == "plait0" and env["NCCL_HOSTID"] == "plait-1-n1"
