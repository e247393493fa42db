"""Cost models: memory per device (and, from other modules, compute and communication time)."""

from plait.cost.memory import (
    FRAMEWORK_OVERHEAD_BYTES,
    MemoryBreakdown,
    MemoryEstimate,
    MemoryEstimateError,
    estimate_memory,
)

__all__ = [
    "FRAMEWORK_OVERHEAD_BYTES",
    "MemoryBreakdown",
    "MemoryEstimate",
    "MemoryEstimateError",
    "estimate_memory",
]
