"""gloo's all-gather and reduce-scatter against its all-reduce, as plait's ZeRO-3 calls them.

    python bench/gloo_collectives.py            # 2 ranks, 64 KiB .. 4 MiB, ~20 s
    python bench/gloo_collectives.py --json

Two ranks (one CPU each in their own cpu cgroup where root can make one, as `plait run --predict`
places them) time `all_gather_into_tensor`, `reduce_scatter_tensor` and `all_reduce` of S bytes
(S: the full buffer, nccl-tests' convention) over loopback, `--iters` calls each after a barrier;
the table shows the fastest call of each (a shared machine slows calls at random, never speeds
them up) and the JSON the median too. The all-reduce is the baseline measured in the same run. What the table shows:
gloo's reduce-scatter costs what its all-reduce costs (``ProcessGroupGloo::reduce_scatter_tensor``
clones the input, all-reduces all of it and copies this rank's slice out), about twice a ring
reduce-scatter and twice its all-gather -- which is why `plait.measure.machine.compute_model`
sets `ComputeModel.reduce_scatter_algorithm = "allreduce"` and `plait.cost.collectives` prices a
gloo reduce-scatter as ``2(n-1) a + 2(n-1)/n S/B``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SIZES = [64 << 10, 256 << 10, 793088, 1 << 21, 1 << 22]
OPS = ("all_reduce", "all_gather", "reduce_scatter")


def _rank(rank: int, port: int, iters: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from plait.runtime.cpu_share import join_from_env

    join_from_env(rank)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    rows = []
    for size in SIZES:
        n = size // 4 // 2 * 2
        full, shard = torch.ones(n), torch.ones(n // 2)
        for op in OPS:
            times = []
            for _ in range(iters):
                dist.barrier()
                t0 = time.perf_counter()
                if op == "all_reduce":
                    dist.all_reduce(full)
                elif op == "all_gather":
                    dist.all_gather_into_tensor(full, shard)
                else:
                    dist.reduce_scatter_tensor(shard, full)
                times.append(time.perf_counter() - t0)
            rows.append({"op": op, "bytes": n * 4, "seconds": statistics.median(times[2:]), "min_s": min(times[2:])})
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--json", action="store_true", help="print the rows as one JSON object")
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=29617, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rank is not None:
        _rank(args.rank, args.port, args.iters, args.out)
        return 0
    import tempfile

    from rich.console import Console
    from rich.table import Table

    from plait.runtime.cpu_share import RankCgroups, pinned

    t0, cpu0 = time.perf_counter(), time.process_time()
    out = Path(tempfile.mkdtemp(prefix="plait-gloo-bench-")) / "rows.json"
    with RankCgroups(2, shares=8192, cpuset=pinned(2)) as groups:
        env = {**os.environ, **groups.env()}
        procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--port", str(args.port), "--iters",
                                   str(args.iters), "--out", str(out)], env=env) for r in range(2)]
        if any(p.wait(timeout=600) != 0 for p in procs):
            print("a rank failed", file=sys.stderr)
            return 1
        placed = "one CPU and cgroup per rank" if groups.active else f"unpinned ({groups.reason})"
    rows = json.loads(out.read_text())
    t = {(r["op"], r["bytes"]): r["min_s"] for r in rows}
    table = Table(title=f"gloo on 2 ranks over loopback ({placed}): fastest of {args.iters} calls")
    for col in ("bytes S", "all_reduce ms (baseline)", "all_gather ms", "reduce_scatter ms", "RS / AR", "AG / AR"):
        table.add_column(col, justify="right")
    ratios = []
    for size in sorted({r["bytes"] for r in rows}):
        ar, ag, rs = (t[(op, size)] for op in OPS)
        ratios.append(rs / ar)
        table.add_row(f"{size:,}", f"{ar * 1e3:.3f}", f"{ag * 1e3:.3f}", f"{rs * 1e3:.3f}", f"{rs / ar:.2f}",
                      f"{ag / ar:.2f}")
    summary = {"rs_over_ar_median": statistics.median(ratios), "cpu_s": time.process_time() - cpu0,
               "wall_s": time.perf_counter() - t0}
    if args.json:
        print(json.dumps({"summary": summary, "rows": rows}))
    else:
        Console(width=120).print(table)
        print(f"reduce-scatter / all-reduce, median over sizes: {summary['rs_over_ar_median']:.2f} "
              f"(ring model: 0.5; gloo's all-reduce-based one: 1.0); bench CPU {summary['cpu_s']:.1f} s, "
              f"wall {summary['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
