"""ECMP and bond hashing of flows, and what random hashing costs.

A switch with ``k`` equal-cost next hops sends a flow along ``hash(5-tuple) mod k``.
Real switches use a CRC of the header fields with a per-switch seed; we use CRC-32 of
the packed 5-tuple mixed with the seed and a per-tier salt (`_mix`). Two modes:

* ``per_tier`` (default): each tier mixes its own salt into the seed, so the choices at
  successive tiers are independent;
* ``same``: every tier uses the same hash. A flow that chose next hop ``i`` of ``k`` at
  the first tier reaches a switch where, with the same hash and the same ``k``, it
  chooses ``i`` again: *hash polarisation*, the second tier then uses 1 of ``k`` links.

A bonded NIC picks its port the same way (Linux bonding ``xmit_hash_policy=layer3+4``:
a hash of addresses and ports modulo the number of ports) with its own salt.

Expected maximum load: ``n`` flows hashed uniformly onto ``k`` links, the busiest link
carries ``E[max]`` flows. Computed exactly by *occupancy counting*: the number of
assignments with every link holding at most ``c`` flows is ``n! [x^n] (sum_{j<=c} x^j/j!)^k``,
so ``P(max <= c)`` needs one polynomial power per ``c`` -- not the ``k^n`` assignments.
8 flows on 8 links: 2.597; 4 on 8: 1.648; 16 on 16: 3.078 (SYSTEMS.md, C4P).
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from fractions import Fraction
from math import factorial

ROCE_PORT = 4791  # RoCEv2's UDP destination port: every flow shares it, only the source port varies
TIER_SALT = {"bond": 0x9E3779B9, "leaf": 0x85EBCA6B, "spine": 0xC2B2AE35, "core": 0x27D4EB2F}


@dataclass(frozen=True)
class FiveTuple:
    src_ip: int
    dst_ip: int
    src_port: int
    dst_port: int = ROCE_PORT
    proto: int = 17  # UDP

    def packed(self) -> bytes:
        return struct.pack(">IIHHB", self.src_ip & 0xFFFFFFFF, self.dst_ip & 0xFFFFFFFF,
                           self.src_port & 0xFFFF, self.dst_port & 0xFFFF, self.proto & 0xFF)


def node_ip(node: int, nic: int, port: int = 0) -> int:
    """An IPv4 address per NIC port (10.x.y.z) so that 5-tuples differ as on a real fabric."""
    return (10 << 24) | ((node & 0xFFF) << 12) | ((nic & 0xFF) << 4) | (port & 0xF)


def source_port(flow_id: int) -> int:
    """A RoCE queue pair's UDP source port, in the ephemeral range, one per flow (connection)."""
    return 49152 + (zlib.crc32(struct.pack(">Q", flow_id & 0xFFFFFFFFFFFFFFFF)) % 16384)


def choose(five: FiveTuple, k: int, seed: int, tier: str, mode: str = "per_tier") -> int:
    """Index of the next hop (0..k-1) a switch of `tier` picks for `five` (see module doc)."""
    if k <= 1:
        return 0
    if mode == "same":
        salt = 0
    elif mode == "per_tier":
        salt = TIER_SALT[tier]
    else:
        raise ValueError(f"ECMP hash mode must be 'per_tier' or 'same', got {mode!r}")
    return _mix(zlib.crc32(five.packed()), seed, salt) % k


_M64 = 0xFFFFFFFFFFFFFFFF


def _mix(crc: int, seed: int, salt: int) -> int:
    """The header's CRC mixed with the seed by the splitmix64 finaliser (Steele et al., 2014).

    A plain CRC with the seed as initial value is linear: another seed XORs one constant onto
    every flow's hash, so the flows would collide in the same groups for every seed. The
    multiplications make each seed a different partition of the flows, as a switch's
    hash-seed setting does."""
    x = (crc | ((seed & 0xFFFFFFFF) << 32)) ^ salt
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _M64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _M64
    return x ^ (x >> 31)


def _power_coeffs(c: int, n: int, k: int) -> Fraction:
    """[x^n] (sum_{j<=c} x^j / j!)^k, truncated at degree n (exact)."""
    base = [Fraction(1, factorial(j)) if j <= c else Fraction(0) for j in range(n + 1)]
    acc = [Fraction(1)] + [Fraction(0)] * n
    for _ in range(k):
        acc = [sum(acc[i] * base[d - i] for i in range(d + 1)) for d in range(n + 1)]
    return acc[n]


def prob_max_at_most(n: int, k: int, c: int) -> Fraction:
    """P(no link carries more than `c` of `n` flows hashed uniformly onto `k` links)."""
    if c >= n:
        return Fraction(1)
    if c * k < n:
        return Fraction(0)
    return _power_coeffs(c, n, k) * factorial(n) / Fraction(k) ** n


def expected_max_load(n: int, k: int) -> float:
    """E[flows on the busiest link] for `n` flows hashed uniformly onto `k` links (exact).

    ``E[max] = sum_{c>=0} P(max > c)``."""
    if n < 0 or k < 1:
        raise ValueError(f"need n >= 0 flows and k >= 1 links, got n={n}, k={k}")
    return float(sum(1 - prob_max_at_most(n, k, c) for c in range(n)))
