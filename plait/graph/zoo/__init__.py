"""The model zoo: real, trainable nn.Modules at configurable sizes, paper configs by default.

``load_model("gpt:size=175b")`` returns a :class:`ModelSpec` (``build``, ``sample_batch``,
``loss``, ``param_count_formula``, ``config``); see :mod:`plait.graph.zoo.registry` for the
spec syntax and the ``path/to/file.py:factory`` contract, and :mod:`plait.graph.zoo.layers`
for the module markers the capture and the runtime read.
"""

from __future__ import annotations

# Importing a model module registers it.
from plait.graph.zoo import (  # noqa: F401
    bert,
    candle_uno,
    case_study,
    cnn,
    dlrm,
    gpt,
    llama,
    mmt,
    moe,
    vit,
)
from plait.graph.zoo.registry import (
    ModelEntry,
    ModelSpec,
    ModelSpecError,
    Param,
    count_params,
    layer_graph,
    list_models,
    load_model,
    model_entry,
    parse_spec,
    register,
    tied_parameters,
)

__all__ = [
    "ModelEntry",
    "ModelSpec",
    "ModelSpecError",
    "Param",
    "count_params",
    "layer_graph",
    "list_models",
    "load_model",
    "model_entry",
    "parse_spec",
    "register",
    "tied_parameters",
]
