"""One emulated device's profiler process, for `plait.measure.machine`.

    python -m plait.measure.machine_profiler RANK

A persistent process (torch is imported once) that joins rank RANK's cpu cgroups
(`plait.runtime.cpu_share.join_from_env`), so it runs where and how that rank will run, and
answers JSON requests, one per line on stdin, with one JSON line on stdout:

* ``{"kind": "layers", "model", "mb", "tp", "repeats", "statistic"}`` -> a
  `plait.measure.layer_profile.LayerProfile` as a dict: each layer's forward and backward alone,
  one thread, fp32 -- what a rank of `plait run` computes; under tensor parallelism the layer
  is sliced exactly as the runtime slices it with its collectives made no-ops (`tp_shard`),
  so the figure is one tensor rank's compute;
* ``{"kind": "flatten", "model", "repeats"}`` -> what the runtime's data-parallel step costs
  around its all-reduce besides communicating (`flatten_cost`);
* ``{"kind": "gloo", "store", "world", "sizes", "iters"}`` -> gloo between the profilers,
  placed as the ranks are (`gloo_sweep`; all profilers must get the request).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any


def tp_shard(tp: int) -> Any:
    """The runtime's Megatron slicing of tensor rank 0 with no-op collectives, as a `shard`
    callback of `plait.measure.layer_profile.profile_layers` (None when tp == 1)."""
    from plait.runtime.comm import NullGroup
    from plait.runtime.tensor_parallel import (
        TPContext,
        apply_tensor_parallel,
        is_tensor_parallel_layer,
    )

    if tp == 1:
        return None
    ctx = TPContext(group=NullGroup(tp), size=tp, rank=0)

    def shard(name: str, module: Any) -> None:
        if is_tensor_parallel_layer(module):
            apply_tensor_parallel(module, ctx, None)

    return shard


def flatten_cost(model: str, repeats: int) -> dict[str, float]:
    """Seconds and bytes of the runtime's gradient flatten into one buffer and copy-back
    (`plait.runtime.data_parallel`) for every parameter of `model`."""
    import torch

    from plait.graph.zoo import load_model
    from plait.runtime.data_parallel import _flat_grads, _scatter_back

    torch.set_num_threads(1)
    params = [p for p in load_model(model).build().parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p)
    times = []
    for i in range(3 + repeats):
        t0 = time.perf_counter()
        _scatter_back(_flat_grads(params), params, "grad")
        if i >= 3:
            times.append(time.perf_counter() - t0)
    nbytes = sum(p.numel() * p.element_size() for p in params)
    return {"seconds": statistics.median(times), "bytes": float(nbytes)}


def gloo_sweep(rank: int, req: dict[str, Any]) -> dict[str, list[list[float]]]:
    """Per message size, the mean time of an all-reduce over all profilers and of a pipeline
    exchange (send S to the next rank and receive S from the previous one with
    `batch_isend_irecv`, as the runtime's 1F1B steady state). Each call is made as training
    makes it: right after a compute segment of ~1.5 ms (a tensor-parallel layer of a small
    model), all ranks starting the segment together. A call then also pays for the ranks not
    finishing their segments together (each rank's speed jitters on a shared machine) and for
    waking gloo's threads after compute; a trimmed mean, because a step sums many calls."""
    import torch

    from plait.runtime.comm import P2P, Comm

    world = int(req["world"])
    # Through the runtime's facade (records off), so the calibration pays what training pays per call.
    comm = Comm(rank, world)
    group = comm.init_process_group("gloo", init_method=f"file://{req['store']}")
    torch.set_num_threads(1)
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    w = torch.randn(256, 256)

    def segment() -> None:
        for _ in range(int(req.get("segment_matmuls", 3))):
            w @ w

    out: dict[str, list[list[float]]] = {"all_reduce": [], "exchange": []}
    for size in req["sizes"]:
        x, y = torch.zeros(max(1, size // 4)), torch.zeros(max(1, size // 4))
        calls = {
            "all_reduce": lambda x=x: group.all_reduce(x, "all_reduce"),
            "exchange": lambda x=x, y=y: comm.p2p([P2P("send", x, nxt), P2P("recv", y, prev)], "exchange"),
        }
        for op, fn in calls.items():
            times = []
            for i in range(3 + int(req["iters"])):
                group.barrier("sweep")
                segment()
                t0 = time.perf_counter()
                fn()
                if i >= 3:
                    times.append(time.perf_counter() - t0)
            # trimmed mean: a step sums many calls (so not the median), but a 25-90-call sample
            # must not follow the odd scheduler hiccup of a shared VM
            out[op].append([float(x.numel() * 4), _trimmed_mean(times, 0.1)])
    return out


def _trimmed_mean(xs: list[float], cut: float) -> float:
    ys = sorted(xs)
    k = int(len(ys) * cut)
    return statistics.fmean(ys[k:len(ys) - k] if len(ys) > 2 * k else ys)


def handle(rank: int, req: dict[str, Any]) -> Any:
    from plait.measure.layer_profile import profile_layers

    kind = req.get("kind")
    if kind == "flatten":
        return flatten_cost(req["model"], int(req["repeats"]))
    if kind == "gloo":
        return gloo_sweep(rank, req)
    if kind == "layers":
        tp = int(req["tp"])
        return profile_layers(req["model"], int(req["mb"]), "fp32", tp=tp, shard=tp_shard(tp), threads=1,
                              repeats=int(req["repeats"]), warmup=3, statistic=req["statistic"]).to_dict()
    raise ValueError(f"unknown request kind {kind!r}")


def main(argv: list[str] | None = None) -> int:
    from plait.runtime.cpu_share import join_from_env

    argv = sys.argv[1:] if argv is None else argv
    rank = int(argv[0])
    join_from_env(rank)
    for line in sys.stdin:
        try:
            out: Any = {"ok": handle(rank, json.loads(line))}
        except Exception as exc:  # noqa: BLE001 -- the parent raises it with the rank named
            out = {"error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
