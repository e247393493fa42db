"""`plait inspect`: per-layer parameters, FLOPs and activation bytes of a model.

    plait inspect                                        # the zoo's default GPT (345M shape)
    plait inspect gpt:size=175b --batch 1 --dtype fp16
    plait inspect path/to/model.py:factory --json
    plait inspect gpt --dtype bf16 --precision amp       # as plait's engines train it (autocast)

The model is captured on the meta device (no real memory), so any size works.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

DEFAULT_MODEL = "gpt"


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "inspect",
        help="per-layer parameters, FLOPs and activation bytes of a model (captured on meta)",
        description="Capture MODEL on the meta device (one forward + backward, shapes only) and "
        "print, per layer and in total, parameters, forward and backward FLOPs, bytes saved "
        "for backward and bytes each layer outputs, for --batch samples.",
    )
    p.add_argument(
        "model",
        nargs="?",
        default=DEFAULT_MODEL,
        metavar="MODEL",
        help="zoo spec (gpt:layers=24,hidden=1024,heads=16,seq=1024,vocab=50257) or "
        f"path/to/file.py:factory (default: {DEFAULT_MODEL})",
    )
    p.add_argument("--batch", type=int, default=1, help="samples per step (default 1)")
    p.add_argument("--dtype", default="bf16", help="fp32, fp16 or bf16 (default bf16)")
    from plait.cost.memory import PRECISIONS

    p.add_argument("--precision", choices=PRECISIONS, default="megatron",
                   help="how a bf16 / fp16 model is shown: megatron, the whole model in that dtype (default; "
                        "Megatron-LM, DeepSpeed) or amp, fp32 parameters with the ops under CUDA's autocast "
                        "lists (plait's engines: what `plait plan` and `plait simulate` price by default)")
    p.add_argument("--json", action="store_true", help="print the same figures as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from plait.graph.inspect import (
        InspectError,
        dtype_label,
        inspect_model,
        render_table,
        summarize,
    )
    from plait.graph.resolve import autocast_of

    if args.batch < 1:
        raise InspectError(f"--batch: must be >= 1, got {args.batch}")
    dtype = dtype_label(args.dtype)
    autocast = autocast_of(dtype, args.precision)
    graph = inspect_model(args.model, batch=args.batch, dtype=args.dtype, autocast=autocast)
    summary = summarize(graph, args.batch)
    summary["dtype"] = dtype
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    from rich.console import Console

    console = Console()
    if not console.is_terminal:  # piped: do not squeeze the table into 80 columns
        console = Console(width=140)
    console.print(render_table(summary, f"{dtype} under autocast (amp)" if autocast else dtype))
    tot = summary["totals"]
    console.print(
        f"{len(summary['layers'])} layers, {tot['ops']} ops; layer graph "
        f"{'is a chain' if summary['is_chain'] else 'branches'} "
        f"({len(summary['layer_edges'])} edges); figures for {args.batch} sample(s), "
        f"captured at {summary['capture_batch']} on the meta device"
    )
    for note in summary["config"].get("capture_notes", []):
        console.print(f"note: {note}", highlight=False)
    return 0
