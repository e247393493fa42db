"""A TCP port for a store or rendezvous, chosen where no other process is handed one by the kernel.

`bind(("127.0.0.1", 0))` returns a port of the kernel's ephemeral range (`ip_local_port_range`),
the range every outgoing connection and every other `bind(0)` on the machine draws from. Released
before torchrun binds it, such a port was taken by another process in one CI run in three when two
test processes ran side by side (torchrun's static rendezvous: TCPStore EADDRINUSE). A port drawn at
random below that range is never given out by the kernel; two callers collide only by drawing the
same one of some ten thousand, and `plait.runtime.launch` restarts a run whose store found its port
taken.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10000  # below: well-known and registered services more often listen


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux's default where it cannot be read)."""
    try:
        lo, hi = (int(x) for x in _RANGE_FILE.read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(port: int, host: str) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", rng: random.Random | None = None) -> int:
    """A port that `host` and the wildcard address can bind now, outside the ephemeral range."""
    lo, hi = ephemeral_range()
    # The span below the ephemeral range, or above it where a machine widened it down to _LOWEST.
    span = (_LOWEST, lo) if lo - _LOWEST >= 1000 else (hi + 1, 65536)
    draw = rng or random.SystemRandom()
    for _ in range(200 if span[1] - span[0] >= 100 else 0):
        port = draw.randrange(*span)
        if _bindable(port, host) and _bindable(port, "0.0.0.0"):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # a machine with that span full
        s.bind((host, 0))
        return int(s.getsockname()[1])
