"""Two parallel links between two emulated nodes (Linux network namespaces, root only):
flows pinned to their planned link versus to the link a hash gives them (issue 16, item 4).

Nodes ``A`` and ``B`` are namespaces joined by two veth pairs (link 0 and link 1), each
shaped with ``tc tbf`` to the same rate on both ends. B has one address per link (10.215.k.2),
so a flow sent to link k's address crosses link k: pinning a flow to a link is choosing the
address, as a policy route per (source, destination) would on a real fabric. "Hashed" pins
each flow where `plait.net.ecmp.choose` sends its 5-tuple (what a switch's ECMP would do);
"planned" spreads them evenly. Every flow sends the same bytes at once; the step ends when
the last one has (a collective step runs at the pace of its busiest link). The flow model's
prediction: max-min fair rates on the two links (`plait.net.maxmin`).

Everything created is named ``plaitnet-<pid>-*`` and removed on exit, also on errors.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Sequence
from dataclasses import dataclass

from plait.net.ecmp import FiveTuple, choose
from plait.net.maxmin import max_min_rates

_RECEIVER = textwrap.dedent("""
    import socket, sys, threading, time
    addrs = sys.argv[1].split(","); port = int(sys.argv[2]); n = int(sys.argv[3])
    done = []
    def serve(addr):
        s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((addr, port)); s.listen(16); s.settimeout(60)
        while True:
            try:
                c, _ = s.accept()
            except OSError:
                return
            threading.Thread(target=drain, args=(c,), daemon=True).start()
    def drain(c):
        total = 0
        while True:
            b = c.recv(1 << 16)
            if not b:
                break
            total += len(b)
        done.append((time.monotonic(), total)); c.close()
    for a in addrs:
        threading.Thread(target=serve, args=(a,), daemon=True).start()
    print("ready", flush=True)
    t0 = time.monotonic()
    while len(done) < n and time.monotonic() - t0 < 120:
        time.sleep(0.005)
    print(max(t for t, _ in done), sum(b for _, b in done), flush=True)
""")

_SENDER = textwrap.dedent("""
    import socket, sys, threading, time
    targets = [(a, int(p)) for a, p in (x.split(":") for x in sys.argv[1].split(","))]
    nbytes = int(sys.argv[2]); sports = [int(x) for x in sys.argv[3].split(",")]
    socks = []
    for (a, p), sp in zip(targets, sports):
        s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", sp)); s.connect((a, p)); socks.append(s)
    buf = b"x" * (1 << 16)
    def send(s):
        left = nbytes
        while left > 0:
            left -= s.send(buf[: min(len(buf), left)])
        s.shutdown(socket.SHUT_WR)
    threads = [threading.Thread(target=send, args=(s,)) for s in socks]
    print(time.monotonic(), flush=True)
    for t in threads: t.start()
    for t in threads: t.join()
""")


@dataclass
class StepResult:
    links: list[int]  # link of each flow
    seconds: float  # measured: first send to last byte received
    predicted: float  # flow model (max-min fair on the two links)
    bandwidth: float  # bytes/s of the whole step (all flows' bytes / seconds)


def available() -> tuple[bool, str]:
    """(True, "") when namespaces can be made here, else (False, why)."""
    if os.geteuid() != 0:
        return False, "needs root (network namespaces)"
    for tool in ("ip", "tc"):
        if subprocess.run(["which", tool], capture_output=True).returncode:
            return False, f"needs the '{tool}' tool"
    probe = f"plaitnet-{os.getpid()}-probe"
    if subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode:
        return False, "cannot create a network namespace here"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return True, ""


def _sh(*cmd: str) -> None:
    subprocess.run(list(cmd), check=True, capture_output=True)


class TwoLinks:
    """Context manager: namespaces A and B joined by two links shaped to `rate` bytes/s."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.tag = f"plaitnet-{os.getpid()}"
        self.a, self.b = f"{self.tag}-a", f"{self.tag}-b"

    def __enter__(self) -> TwoLinks:
        try:
            for ns in (self.a, self.b):
                _sh("ip", "netns", "add", ns)
                _sh("ip", "-n", ns, "link", "set", "lo", "up")
            kbit = max(8, int(self.rate * 8 / 1000))
            for k in range(2):
                va, vb = f"pna{os.getpid() % 100000}{k}", f"pnb{os.getpid() % 100000}{k}"
                _sh("ip", "link", "add", va, "netns", self.a, "type", "veth", "peer", "name", vb, "netns", self.b)
                _sh("ip", "-n", self.a, "addr", "add", f"10.215.{k}.1/24", "dev", va)
                _sh("ip", "-n", self.b, "addr", "add", f"10.215.{k}.2/24", "dev", vb)
                for ns, dev in ((self.a, va), (self.b, vb)):
                    _sh("ip", "-n", ns, "link", "set", dev, "up")
                    _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                        f"{kbit}kbit", "burst", "16kb", "latency", "50ms")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for ns in (self.a, self.b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def step(self, links: Sequence[int], nbytes: int, sports: Sequence[int], port: int = 5201) -> StepResult:
        """All flows at once, flow i over link ``links[i]``; measured and predicted step time."""
        recv = subprocess.Popen(["ip", "netns", "exec", self.b, sys.executable, "-c", _RECEIVER,
                                 "10.215.0.2,10.215.1.2", str(port), str(len(links))],
                                stdout=subprocess.PIPE, text=True)
        try:
            assert recv.stdout is not None
            recv.stdout.readline()  # "ready"
            targets = ",".join(f"10.215.{k}.2:{port}" for k in links)
            send = subprocess.run(["ip", "netns", "exec", self.a, sys.executable, "-c", _SENDER, targets,
                                   str(nbytes), ",".join(map(str, sports))],
                                  capture_output=True, text=True, timeout=120, check=True)
            start = float(send.stdout.split()[0])
            end, total = recv.stdout.readline().split()
            recv.wait(timeout=30)
        finally:
            if recv.poll() is None:
                recv.kill()
                recv.wait()
        seconds = float(end) - start
        rates = max_min_rates([self.rate, self.rate], [[(k, 1.0)] for k in links])
        return StepResult(list(links), seconds, nbytes / min(rates), int(total) / seconds)


def hashed_links(sports: Sequence[int], seed: int) -> list[int]:
    """Link (0/1) ECMP gives each flow A -> B with these source ports."""
    return [choose(FiveTuple(0x0AD70001, 0x0AD70002, sp, 5201, 6), 2, seed, "leaf") for sp in sports]


def measure(rate: float = 4e6, nbytes: int = 2_000_000, flows: int = 2, seed: int | None = None
            ) -> dict[str, StepResult]:
    """Planned (flows spread evenly) vs hashed (a seed whose hash puts them on one link unless
    `seed` is given) on two links of `rate` bytes/s each."""
    sports = [40000 + 7 * i for i in range(flows)]
    if seed is None:
        seed = next(s for s in range(10000) if len(set(hashed_links(sports, s))) == 1)
    with TwoLinks(rate) as net:
        planned = net.step([i % 2 for i in range(flows)], nbytes, sports)
        time.sleep(0.2)
        hashed = net.step(hashed_links(sports, seed), nbytes, [p + 1000 for p in sports])
    return {"planned": planned, "hashed": hashed}
