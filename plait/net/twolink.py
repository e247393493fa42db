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
    go = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0  # a common start (one monotonic clock)
    while time.monotonic() < go:
        time.sleep(0.001)
    print(time.monotonic(), flush=True)
    for t in threads: t.start()
    for t in threads: t.join()
""")


@dataclass
class StepResult:
    links: list[int]  # link of each flow (A -> B ones, then B -> A ones)
    seconds: float  # measured: first send to last byte received
    predicted: float  # flow model (max-min fair on the two links)
    bandwidth: float  # bytes/s of the whole step (all flows' bytes / seconds)
    ways: int = 1  # 2: both nodes sent (a two-rank all-reduce)

    @property
    def busbw(self) -> float:
        """Read as a two-rank ring all-reduce, each rank sends its buffer S once (2(n-1)/n S at
        n = 2; S = the bytes of its flows, one channel's share each): busbw = algbw = S / t."""
        return self.bandwidth / self.ways


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

    def step(self, links: Sequence[int], nbytes: int, sports: Sequence[int], port: int = 5201,
             back: Sequence[int] | None = None) -> StepResult:
        """All flows at once, flow i A -> B over link ``links[i]`` and, with `back`, flow i B -> A
        over link ``back[i]`` (the other direction of a two-rank ring all-reduce: both ranks send
        at once over full-duplex links); measured and predicted step time."""
        ends = [(self.b, "10.215.{k}.2", list(links), list(sports))]
        if back is not None:
            ends.append((self.a, "10.215.{k}.1", list(back), [p + 500 for p in sports]))
        recvs = []
        try:
            for ns, addr, ks, _sp in ends:
                r = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", _RECEIVER,
                                      ",".join(addr.format(k=k) for k in range(2)), str(port), str(len(ks))],
                                     stdout=subprocess.PIPE, text=True)
                recvs.append(r)
                assert r.stdout is not None
                r.stdout.readline()  # "ready"
            go = time.monotonic() + 1.5  # both senders start together (python starts in under that)
            sends = [subprocess.Popen(["ip", "netns", "exec", self.a if ns == self.b else self.b, sys.executable,
                                       "-c", _SENDER, ",".join(f"{addr.format(k=k)}:{port}" for k in ks),
                                       str(nbytes), ",".join(map(str, sp)), repr(go)],
                                      stdout=subprocess.PIPE, text=True)
                     for ns, addr, ks, sp in ends]
            starts = []
            for snd in sends:
                out, _ = snd.communicate(timeout=120)
                if snd.returncode:
                    raise RuntimeError(f"two-link sender failed (exit {snd.returncode})")
                starts.append(float(out.split()[0]))
            finish, total = [], 0
            for r in recvs:
                assert r.stdout is not None
                end, got = r.stdout.readline().split()
                finish.append(float(end))
                total += int(got)
                r.wait(timeout=30)
        finally:
            for r in recvs:
                if r.poll() is None:
                    r.kill()
                    r.wait()
        seconds = max(finish) - min(starts)
        # Flow model: each direction of each link is its own resource (full duplex).
        res = [(k, 0) for k in links] + [(k, 1) for k in (back or [])]
        index = {x: i for i, x in enumerate(sorted(set(res)))}
        rates = max_min_rates([self.rate] * len(index), [[(index[x], 1.0)] for x in res])
        return StepResult(list(links) + list(back or []), seconds, nbytes / min(rates), total / seconds,
                          2 if back is not None else 1)


def hashed_links(sports: Sequence[int], seed: int, reverse: bool = False) -> list[int]:
    """Link (0/1) ECMP gives each flow A -> B (B -> A with `reverse`) with these source ports."""
    a, b = 0x0AD70001, 0x0AD70002
    src, dst = (b, a) if reverse else (a, b)
    return [choose(FiveTuple(src, dst, sp, 5201, 6), 2, seed, "leaf") for sp in sports]


def measure(rate: float = 4e6, nbytes: int = 2_000_000, flows: int = 2, seed: int | None = None,
            both_ways: bool = True) -> dict[str, StepResult]:
    """Planned (flows spread evenly) vs hashed (a seed whose hash puts them on one link, in both
    directions, unless `seed` is given) on two links of `rate` bytes/s each. `both_ways`: each
    node sends `flows` flows to the other at once, as the two ranks of a ring all-reduce do
    (each flow one channel's share of the buffer)."""
    sports = [40000 + 7 * i for i in range(flows)]
    back_ports = [p + 1500 for p in sports]
    if seed is None:
        seed = next(s for s in range(10000) if len(set(hashed_links(sports, s))) == 1
                    and (not both_ways or len(set(hashed_links(back_ports, s, reverse=True))) == 1))
    spread = [i % 2 for i in range(flows)]
    with TwoLinks(rate) as net:
        planned = net.step(spread, nbytes, sports, back=spread if both_ways else None)
        time.sleep(0.2)
        hashed = net.step(hashed_links(sports, seed), nbytes, [p + 1000 for p in sports],
                          back=hashed_links(back_ports, seed, reverse=True) if both_ways else None)
    return {"planned": planned, "hashed": hashed}
