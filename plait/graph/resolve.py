"""One answer to "which OpGraph is this model?", shared by the planners, the simulator and
the machine predictor, so all of them rank and predict the same graph.

A model may be an `OpGraph`, a path to an OpGraph JSON file, a zoo spec string
(``gpt:layers=24,hidden=1024``), a `ModelSpec`, or an `nn.Module` with sample inputs. Deep
zoo GPTs use the closed-form graph (`plait.graph.gpt_closed_form`, checked op for op against
a capture in tests/test_sim_gpt.py) because capturing 96 layers takes seconds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

from plait.errors import PlaitError
from plait.ir.opgraph import OpGraph
from plait.ir.plan import Plan

if TYPE_CHECKING:  # torch loads where a model is captured, not on import
    from torch import nn

    from plait.graph.zoo.registry import ModelSpec

# What `resolve_model` accepts (the simulator, the planners and `plait.api` take it as given): an
# OpGraph, a zoo spec or `file.py:factory` string, an OpGraph JSON path, a zoo `ModelSpec`, or an
# nn.Module (with sample inputs). A string alias: its torch names exist for the type checker only.
ModelSource: TypeAlias = "OpGraph | str | Path | ModelSpec | nn.Module"

# A capture of a GPT deeper than this takes seconds; the closed form is exact for the zoo's GPT.
CLOSED_FORM_MIN_LAYERS = 24


class ModelResolveError(PlaitError, ValueError):
    """A model argument that names no model plait can build (the message says which and why)."""


def autocast_of(dtype: str, precision: str) -> str | None:
    """The autocast dtype a `dtype` model is captured under at `precision`: a 16-bit dtype under
    "amp" (plait's engines), none under "megatron" (the model in that dtype) or in fp32 / tf32."""
    if precision not in ("megatron", "amp"):
        raise ModelResolveError(f"precision: 'megatron' or 'amp', got {precision!r}")
    return dtype if precision == "amp" and dtype in ("bf16", "fp16") else None


def resolve_model(model: ModelSource, plan: Plan, inputs: Any = None, analytic: bool | None = None,
                  precision: str = "megatron") -> OpGraph:
    """OpGraph of `model` at `plan`'s micro-batch and dtype. GPT zoo specs use the closed-form
    graph when `analytic` is True, or when it is None and the capture would be slow.

    `precision` (`plait.cost.memory.PRECISIONS`) says how a bf16 / fp16 plan trains: "megatron",
    the model in that dtype (Megatron-LM, DeepSpeed); "amp", fp32 parameters under autocast to it
    (plait's engines, torch's AMP) -- the graph is captured so (`OpGraph.autocast`), and its memory
    estimate and costs follow. An OpGraph (object or file) is returned as it is."""
    autocast = autocast_of(plan.dtype, precision)
    if isinstance(model, OpGraph):
        return model
    if isinstance(model, (str, Path)):
        text = str(model)
        if text.endswith(".json"):
            path = Path(text)
            if not path.exists():
                raise ModelResolveError(f"{text}: OpGraph file not found")
            try:
                return OpGraph.from_dict(json.loads(path.read_bytes().decode("utf-8")), source=text)
            except (KeyError, TypeError, ValueError, RecursionError) as exc:  # ValueError: bad JSON or UTF-8
                raise ModelResolveError(f"{text}: not an OpGraph JSON ({exc})") from None
        if text.split(":", 1)[0].strip().lower() == "gpt" and analytic is not False:
            from plait.graph.gpt_closed_form import gpt_config, gpt_opgraph

            cfg = gpt_config(text)
            if analytic or cfg.get("layers", 0) > CLOSED_FORM_MIN_LAYERS:
                return gpt_opgraph(cfg, dtype=plan.dtype, autocast=autocast)
    from plait.graph.inspect import inspect_model

    dtype = "fp32" if plan.dtype == "tf32" else plan.dtype
    import torch.nn as nn

    if isinstance(model, nn.Module):
        if inputs is None:
            raise ModelResolveError("model: an nn.Module needs inputs=(sample forward arguments)")
        return inspect_model(model, batch=plan.micro_batch, dtype=dtype, sample_inputs=inputs, autocast=autocast)
    return inspect_model(model, batch=plan.micro_batch, dtype=dtype, autocast=autocast)
