"""What every worker (`plait.runtime.worker`, `plait.runtime.spmd_worker`,
`plait.runtime.compose_worker`) writes to the run folder the same way: where a rank streams its
communication records, the ranks' common clock origin, and rank 0's `result.json` / `params.pt`
(which the launcher reads). Shared by the workers so that none of them imports another."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import torch

from plait.ir.formats import stamp
from plait.ir.plan import Plan
from plait.runtime.comm import Comm
from plait.runtime.layout import PipelineLayout, pipeline_layout
from plait.runtime.recorder import Recorder
from plait.runtime.tensor_parallel import ShardInfo


def comm_records_path(run_dir: Path, rank: int) -> Path:
    """Where rank `rank` streams its communication records (`plait.ir.comm`)."""
    return run_dir / "comm" / f"rank{rank}.jsonl"


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() + "@" + socket.gethostname()
    except OSError:
        return socket.gethostname()


def common_origin(rec: Recorder, comm: Comm) -> dict[str, Any]:
    """Ranks on the same host share CLOCK_MONOTONIC: use one origin for all of them (exact).
    Across hosts the barrier exit is the alignment (skew = the barrier's release skew).
    Collective: every rank calls it once, after `rec.set_origin()`."""
    mine = {"boot": _boot_id(), "origin": rec.origin}
    everyone = comm.all_gather_object(mine, "clock origins")
    if len({e["boot"] for e in everyone}) == 1:
        common = min(e["origin"] for e in everyone)
        shift = rec.origin - common
        rec.origin = common
        return {"alignment": "shared monotonic clock", "shift": shift}
    return {"alignment": "barrier exit", "shift": 0.0}


def _rank(plan: Plan, layout: PipelineLayout, stage: int, replica: int, tensor: int = 0) -> int:
    """Process rank of (pipeline stage, replica, tensor rank): a graph plan's (stage, replica)
    pairs (`PipelineLayout.rank_of`), else Megatron's grid (`Plan.rank`)."""
    return layout.rank_of(stage, replica) if layout.graph_plan else plan.rank(stage, replica, tensor)


def _fill_aliases(params: dict[str, torch.Tensor], aliases: dict[str, str]) -> None:
    """Give every name of a tied tensor its value where no stage held it under that name (T5's
    `shared.weight` never runs: its tensor is each stack's `embed_tokens` on their own stages, which
    hold the same values as their gradients are summed across stages)."""
    by_first: dict[str, list[str]] = {}
    for name, first in aliases.items():
        by_first.setdefault(first, []).append(name)
    for names in by_first.values():
        held = next((params[n] for n in names if n in params), None)
        if held is not None:
            for n in names:
                params.setdefault(n, held)


def write_result(run_dir: Path, plan: Plan, ranks: list[dict[str, Any]], start: int, steps: int,
                 return_params: bool) -> None:
    """Rank 0, once every rank's record is gathered (`ranks`, by rank): `result.json` (losses of
    the loss-holding rank, iteration times over all ranks, amp, per-rank records) and, with
    `return_params` (`RecordSettings.return_params`), `params.pt` (the full parameters,
    tensor-parallel shards assembled)."""
    layout = pipeline_layout(plan)
    last = _rank(plan, layout, layout.sink[0], 0)
    losses = ranks[last]["losses"] or []
    step_ids = list(range(start, steps))
    iteration_times = []
    for i, _ in enumerate(step_ids):
        t0 = min(r["step_bounds"][i][1] for r in ranks)
        t1 = max(r["step_bounds"][i][2] for r in ranks)
        iteration_times.append(t1 - t0)
    params = None
    if return_params:
        params = {}
        for p in range(layout.num_stages):
            base = ranks[_rank(plan, layout, p, 0)]
            for name, tensor in base["params_state"].items():
                info = base["shard_infos"].get(name)
                if info is None or plan.tp == 1:
                    params[name] = tensor
                else:
                    si = ShardInfo(info["dim"], info["chunks"], tuple(info["sizes"]))
                    shards = [ranks[plan.rank(p, 0, t)]["params_state"][name] for t in range(plan.tp)]
                    params[name] = si.assemble(shards)
        _fill_aliases(params, next((r["param_aliases"] for r in ranks if r.get("param_aliases")), {}))
        torch.save(params, run_dir / "params.pt")
    amp = None
    if ranks[0].get("amp") is not None:
        # Every rank took the same skip decisions (the found-inf flag is all-reduced over the job).
        skipped_by_rank = {r["rank"]: r["amp"]["skipped"] for r in ranks}
        amp = {"loss_scales": ranks[0]["amp"]["scales"], "skipped_steps": ranks[0]["amp"]["skipped"],
               "final_loss_scale": ranks[0]["amp"]["final_scale"], "skipped_by_rank": skipped_by_rank}
    out = {
        "steps": step_ids, "losses": losses, "iteration_times": iteration_times, "amp": amp,
        "ranks": [{k: v for k, v in r.items() if k not in ("params_state", "shard_infos", "amp", "param_aliases")}
                  for r in ranks],
        "params_file": "params.pt" if params is not None else None,
    }
    tmp = run_dir / "result.json.tmp"
    tmp.write_text(json.dumps(stamp("run", out)))
    os.replace(tmp, run_dir / "result.json")
