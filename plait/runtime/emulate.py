"""Emulating slower GPU kinds on one machine: an honest per-rank compute slowdown.

All ranks of an emulated cluster run on the same CPUs (or the same GPU model), so a
rank that stands for a slower kind must take longer for the same work. The factor is
the datasheet ratio

    slowdown(device) = max_k peak_flops(k, dtype) / peak_flops(kind(device), dtype)   (>= 1)

over the kinds present in the cluster, or `emulation.slowdown[kind]` when the cluster
file gives one. `dtype` defaults to **bf16**, `Plan.dtype`'s default: the simulator
prices compute of a mixed-precision plan at the kinds' bf16 peaks, so the emulation
must use the same ratio. A kind without a bf16 unit (V100, T4) falls back to its fp32
peak (`GPUKind.flops`), which is what such a GPU would really deliver for bf16 work.
Pass the plan's dtype (e.g. fp32) to emulate an fp32 plan.

The runtime applies it to each measured compute span: after a span that took
`elapsed` seconds it sleeps `(factor - 1) * elapsed`, so the span lasts
`factor * elapsed` as on the slower kind. Sleeping (not spinning) leaves the CPU to
the other ranks, as a slower GPU would leave the host free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from plait.errors import PlaitError

if TYPE_CHECKING:
    from plait.cluster.spec import Cluster

DEFAULT_DTYPE = "bf16"


class EmulationError(PlaitError, ValueError):
    """A cluster file whose emulation section cannot be applied."""


def compute_slowdown(cluster: Cluster, device_id: int, dtype: str | None = None) -> float:
    """Compute slowdown (>= 1) of `device_id` relative to the fastest kind in `cluster`."""
    dtype = dtype or DEFAULT_DTYPE
    devices = cluster.devices
    if not 0 <= device_id < len(devices):
        raise EmulationError(f"cluster '{cluster.name}': no device {device_id} (it has {len(devices)})")
    kind = devices[device_id].kind
    source = getattr(cluster, "source", "cluster")
    emu = getattr(cluster, "emulation", None)
    if emu is not None and not emu.enabled:
        return 1.0
    if emu is not None and emu.slowdown and kind.name in emu.slowdown:
        factor = float(emu.slowdown[kind.name])
        if not factor >= 1.0:
            raise EmulationError(f"{source}: field 'emulation.slowdown.{kind.name}': must be >= 1 "
                                 f"(relative to the fastest kind), got {factor}")
        return factor
    fastest = max(d.kind.flops(dtype) for d in devices)
    own = kind.flops(dtype)
    if not own > 0:
        raise EmulationError(f"{source}: GPU kind '{kind.name}' has no positive peak FLOP/s for {dtype}")
    return max(1.0, fastest / own)


def slowdowns(cluster: Cluster, dtype: str | None = None) -> list[float]:
    """`compute_slowdown` for every device, indexed by device id."""
    return [compute_slowdown(cluster, d.id, dtype) for d in cluster.devices]


def extra_time(elapsed_s: float, factor: float) -> float:
    """Seconds to add after a compute span of `elapsed_s` so it lasts `factor * elapsed_s`."""
    if factor < 1.0:
        raise EmulationError(f"slowdown factor must be >= 1, got {factor}")
    return max(0.0, elapsed_s) * (factor - 1.0)
