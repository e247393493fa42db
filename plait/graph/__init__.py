"""The model room: capture an nn.Module as an OpGraph, inspect it, and the model zoo.

Lazy exports so that `import plait.ir.opgraph` (used by the planners and the
simulator) does not import torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Layer", "Op", "OpGraph", "capture", "inspect_model", "summarize"]


def __getattr__(name: str) -> Any:
    if name in ("Layer", "Op", "OpGraph"):
        from plait.ir import opgraph

        return getattr(opgraph, name)
    if name == "capture":
        from plait.graph.capture import capture

        return capture
    if name in ("inspect_model", "summarize"):
        from plait.graph import inspect

        return getattr(inspect, name)
    raise AttributeError(f"module 'plait.graph' has no attribute {name!r}")
