"""GraphPipe's case study (Jeon et al. 2025, §7 case study): 2 branches x 4 blocks of
[attention + 2 linear], concatenated, on 8 devices.

The blocks are MMT's (`plait.graph.zoo.mmt`): a Megatron block is attention followed by an MLP of
two linears. The paper reports a sequential plan of depth 8 (micro-batch 2) against a graph plan of
depth 4 (micro-batch 4). Sizes the paper leaves open (sequence, hidden, heads) are MMT's.
"""

from __future__ import annotations

from plait.graph.zoo.mmt import make_mmt
from plait.graph.zoo.registry import ModelEntry, Param, model_entry, register

_mmt = model_entry("mmt")
register(
    ModelEntry(
        name="graphpipe_case",
        description="GraphPipe's case study: 2 branches x 4 [attention + 2 linear] blocks, concatenated",
        params={**_mmt.params, "branches": Param(int, 2, "parallel branches"),
                "layers": Param(int, 4, "[attention + 2 linear] blocks per branch")},
        make=make_mmt,
    )
)
