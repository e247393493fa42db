"""Lowering of a synthesized SPMD program (HAP, `plait.spmd`) into the one task-DAG simulator.

A program (one strategy per aten op, its collectives with their chosen algorithms) at per-device
ratios becomes a `TaskGraph` that `plait.sim.engine` runs like every other plan, so SPMD plans are
ranked on the same scale as 3D and graph plans (issue 14 item 7):

* **compute**, per rank, on its compute stream in program order: the forward of every op, then
  the backward of every op in reverse. An op's forward on device ``i`` takes ``r_i w_i / 3`` when
  its strategy splits the work (``r_i`` the ratio of the op's segment), ``w_i / 3`` when it runs
  redundantly; backward twice that (``w_i`` from `plait.cost.spmd.op_work`, i.e.
  `plait.cost.compute.op_time` of the device's kind);
* **communication**: every collective of the program is one task joining all ranks, issued on the
  group's communication stream in program order (forward collectives by op, then gradient
  collectives in backward order). Its time is the cost module's on the program's device group
  (`plait.cost.spmd.comm_seconds`: the program's padded/grouped choice for uneven shards; for an
  all-reduce the algorithm NCCL's tuner picks), run as a latency then a flow over the ring's link
  resources, so concurrent collectives share links (`plait.sim.topology`);
* **dependencies** (where overlap comes from): a forward collective waits for the producer's
  forward on every rank and blocks the reader's forward; a gradient collective waits for the
  reader's backward on every rank (and, on another group, for the tensor's collective before it)
  and blocks the producer's backward -- for a parameter only the optimizer step, so data-parallel gradient all-reduces overlap the rest of backward. With
  `bucket_bytes` parameter-gradient all-reduces are packed in backward order into buckets of at
  least that size (PyTorch DDP's buckets, Shi et al. 2018's WFBP);
* the **optimizer step** per rank (`plait.cost.compute.optimizer_time` over the parameters it
  holds: replicated ones whole, sharded ones at its ratio) after its backward and every gradient
  collective of its parameters.

Ranks with the same GPU kind and ratios compute identically: one representative per such class
is simulated (its collectives still span every device's links).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from plait.cost.collectives import UNEVEN_OPS, choose_algorithm, collective_time
from plait.cost.compute import ComputeModel, optimizer_time
from plait.cost.program import Problem, Program, stored_placements
from plait.cost.spmd import BACKWARD_FACTOR, VIEWS, Devices, comm_seconds, rail_links, rail_time
from plait.errors import PlaitError
from plait.ir.program import NODE, RAIL, Comm, Mesh, shard_dim
from plait.sim.engine import TaskGraph
from plait.sim.topology import ClusterView


class SpmdLoweringError(PlaitError, ValueError):
    """A program that cannot be lowered onto this cluster (the message names what)."""


@dataclass
class SpmdLowered:
    graph: TaskGraph
    reps: list[int]  # representative rank (index into the program's devices) per class
    classes: list[list[int]]  # the ranks each representative stands for
    comm_tasks: list[int] = field(default_factory=list)
    params_per_rank: np.ndarray | None = None  # parameters each rank holds (optimizer)


def op_ratios(problem: Problem, program: Program, ratios: np.ndarray,
              of_op: dict[str, int] | None) -> np.ndarray:
    """(ops, devices): each op's share of its work per device (1 where it runs redundantly)."""
    r = np.atleast_2d(np.asarray(ratios, dtype=float))
    out = np.ones((len(problem.graph.ops), problem.devices.n))
    for k, op in enumerate(problem.graph.ops):
        if program.strategies[op.name].splits_work:
            out[k] = r[(of_op or {}).get(op.name, 0) if r.shape[0] > 1 else 0]
    return out


def op_seconds(problem: Problem, program: Program, ratios: np.ndarray, of_op: dict[str, int] | None,
               device_scale: np.ndarray | None = None, model: ComputeModel | None = None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(forward, backward) seconds per (op, device), the kernels each op launches forward and
    backward, and each op's share of its work per device (`op_ratios` x `device_scale`).

    The compute model's fixed costs, as the 3D lowering charges them (plait.cost.compute): each
    kernel's GPU time besides its work -- one forward kernel per op that is not a view, two
    backward kernels for ops with FLOPs (input and weight gradients), one otherwise."""
    graph = problem.graph
    share = op_ratios(problem, program, ratios, of_op)  # (ops, n)
    if device_scale is not None:
        share = share * np.asarray(device_scale, dtype=float)[None, :]
    fwd = np.stack(problem.work) * share / BACKWARD_FACTOR  # (ops, n) seconds
    bwd = fwd * (BACKWARD_FACTOR - 1.0)
    kern_f = np.array([0.0 if op.kind in VIEWS else 1.0 for op in graph.ops])
    kern_b = np.array([0.0 if op.kind in VIEWS else (2.0 if op.flops > 0 else 1.0) for op in graph.ops])
    if model is not None:
        fwd = fwd + model.kernel_gpu_s * kern_f[:, None]
        bwd = bwd + model.kernel_gpu_s * kern_b[:, None]
    return fwd, bwd, kern_f, kern_b, share


def rank_classes(devices: Devices, share: np.ndarray) -> list[list[int]]:
    """Ranks that compute identically (same kind, same share of every op), first one first."""
    classes: dict[tuple, list[int]] = defaultdict(list)
    for i in range(devices.n):
        kind = devices.kinds[i].name if devices.kinds else ""
        classes[(kind, tuple(np.round(share[:, i], 12)))].append(i)
    return list(classes.values())


def _shares(comm: Comm, ratios: np.ndarray, of_dim: dict[tuple[str, int], int] | None) -> np.ndarray:
    """Per-device shares of the tensor an uneven collective moves: its segment's ratios."""
    r = np.atleast_2d(np.asarray(ratios, dtype=float))
    if r.shape[0] == 1 or comm.dim is None:
        return r.mean(axis=0) if r.shape[0] > 1 else r[0]
    return r[(of_dim or {}).get((comm.tensor, comm.dim), 0)]


def params_held(problem: Problem, program: Program, ratios: np.ndarray,
                of_dim: dict[tuple[str, int], int] | None) -> np.ndarray:
    """Parameters each device stores (and steps): a replicated one whole, a sharded one at the
    ratio of its segment -- where `stored_placements` says, as `plait.cost.memory.memory_model`."""
    r = np.atleast_2d(np.asarray(ratios, dtype=float))
    held = np.zeros(problem.devices.n)
    for t, q in stored_placements(problem.graph, program).items():
        numel = problem.graph.tensors[t].numel
        d = shard_dim(q)
        if d is None:
            held += numel
        else:
            held += numel * r[(of_dim or {}).get((t, d), 0) if r.shape[0] > 1 else 0]
    return held


def lower_spmd(problem: Problem, program: Program, ratios: np.ndarray, view: ClusterView, *,
               devices: Devices | None = None, of_op: dict[str, int] | None = None,
               of_dim: dict[tuple[str, int], int] | None = None, bucket_bytes: float | None = None,
               host_comm_s: float = 0.0, device_scale: np.ndarray | None = None,
               mesh: Mesh | None = None, model: ComputeModel | None = None) -> SpmdLowered:
    """The task graph of one training iteration of `program` at `ratios` (one vector, or one row
    per segment with `of_op` / `of_dim` from `plait.cost.program.Segments`) on `view`.

    `devices`: the program's devices as priced for the run (default `problem.devices`; a program
    searched under HAP's flat model is simulated on the real links). `device_scale`: a multiplier
    of every op's work per device -- data parallelism written as the graph of one device's batch
    run whole on every device, device ``i`` holding ``device_scale[i]`` times that batch.
    `mesh`: a hierarchical program's nodes x GPUs (`plait.spmd.mesh`): collectives of group
    "node" run in every node at once, "rail" ones across nodes (`_GroupPricer`)."""
    devices = devices or problem.devices
    graph, n = problem.graph, devices.n
    ids = list(devices.ids) if devices.ids else list(range(n))
    bad = [i for i in ids if not 0 <= i < view.num_devices]
    if bad:
        raise SpmdLoweringError(f"program devices {bad[:3]} are not in cluster {view.name!r} "
                                f"({view.num_devices} devices)")
    missing = [op.name for op in graph.ops if op.name not in program.strategies]
    if missing:
        raise SpmdLoweringError(f"program has no strategy for op {missing[0]} ({len(missing)} ops missing)")
    fwd, bwd, kern_f, kern_b, share = op_seconds(problem, program, ratios, of_op, device_scale, model)
    groups = rank_classes(devices, share)
    reps = [g[0] for g in groups]
    tg = TaskGraph()
    n_ops = len(graph.ops)
    F = [[0] * n_ops for _ in reps]
    B = [[0] * n_ops for _ in reps]
    extra_f: dict[int, list[int]] = defaultdict(list)  # op -> collectives its forward waits for
    extra_b: dict[int, list[int]] = defaultdict(list)
    after_fwd: list[int] = []  # collectives the backward waits for (the loss reads whole outputs)
    to_optimizer: list[int] = []
    index = {op.name: k for k, op in enumerate(graph.ops)}

    # the collectives, in issue order, with the ops they wait for and the ops that wait for them
    fwd_comms = [(index[name], c) for name, c in program.comms if c.phase == "fwd"]
    bwd_comms = sorted(((index[name], c) for name, c in program.comms if c.phase == "bwd"),
                       key=lambda kc: -kc[0])
    plan: list[tuple[str, list[tuple[int, Comm]]]] = [("fwd", [kc]) for kc in fwd_comms]
    # one open bucket per kind of collective (group; rail ones: sharded or replicated inside)
    buckets: dict[tuple, list[tuple[int, Comm]]] = {}
    filled: dict[tuple, float] = defaultdict(float)
    for k, c in bwd_comms:
        is_param = graph.tensors[c.tensor].role == "param" and c.op == "all_reduce"
        if bucket_bytes is not None and is_param:
            key = (c.group, c.dim is None)
            buckets.setdefault(key, []).append((k, c))
            filled[key] += c.nbytes
            if filled[key] >= bucket_bytes:
                plan.append(("bwd", buckets.pop(key)))
                filled[key] = 0.0
            continue
        plan.append(("bwd", [(k, c)]))
    plan.extend(("bwd", b) for b in buckets.values())

    producer = {t: index[m.producer] for t, m in graph.tensors.items() if m.producer in index}
    # forward passes; a forward collective needs its tensor's producer (all ranks)
    fwd_plan = [p for p in plan if p[0] == "fwd"]
    bwd_plan = [p for p in plan if p[0] == "bwd"]
    prev_comm: dict[str, int] = {}  # the last collective issued on each group's stream
    comm_tasks: list[int] = []
    pricer = _GroupPricer(problem, devices, view, ratios, of_dim, device_scale, mesh) if mesh is not None else None
    fwd_done_upto = -1

    host_last: list[int] = [-1] * len(reps)

    def launch(j: int, i: int, name: str, seconds: float) -> list[int]:
        """The host task that dispatches a kernel of rank rep `j` (none without a compute model)."""
        if model is None:
            return []
        deps = [host_last[j]] if host_last[j] >= 0 else []
        host_last[j] = tg.add(f"launch {name}", "host", f"dev{ids[i]}/host", seconds, deps, device=ids[i])
        return [host_last[j]]

    def emit_forward_until(k_stop: int) -> None:
        nonlocal fwd_done_upto
        for k in range(fwd_done_upto + 1, k_stop + 1):
            for j, i in enumerate(reps):
                deps = [F[j][k - 1]] if k > 0 else []
                deps += extra_f.get(k, [])
                if model is not None:
                    host = model.host_fwd_s * kern_f[k] + (model.batch_host_s if k == 0 else 0.0) \
                        + (model.loss_host_s if k == n_ops - 1 else 0.0)
                    deps += launch(j, i, f"fwd {graph.ops[k].name}", host)
                F[j][k] = tg.add(f"fwd {graph.ops[k].name}", "forward", f"dev{ids[i]}/compute",
                                 float(fwd[k, i]), deps, device=ids[i])
        fwd_done_upto = max(fwd_done_upto, k_stop)

    for _, members in fwd_plan:
        k, c = members[0]
        p = producer.get(c.tensor)
        # the producer's forward must exist before the collective: emit forward ops up to it
        if p is not None and p >= k:  # an output of op k itself (the loss reading partial sums)
            emit_forward_until(k)
            deps = [F[j][k] for j in range(len(reps))]
        else:
            emit_forward_until(k - 1)
            deps = [F[j][p] for j in range(len(reps))] if p is not None else []
        last = prev_comm.get(c.group, -1)
        tid = _comm_task(tg, c, "fwd", devices, ids, view, ratios, of_dim, deps + ([last] if last >= 0 else []),
                         host_comm_s, pricer)
        prev_comm[c.group] = tid
        comm_tasks.append(tid)
        if p is not None and p >= k:
            after_fwd.append(tid)
        else:
            extra_f[k].append(tid)
    emit_forward_until(n_ops - 1)

    # backward: gradient collectives wait for the reader's backward and block the producer's
    done_b: set[int] = set()
    pending = list(range(len(bwd_plan)))
    made: dict[str, int] = {}  # tensor -> the last gradient collective issued for it
    for k in range(n_ops - 1, -1, -1):
        for j, i in enumerate(reps):
            deps = [B[j][k + 1]] if k + 1 < n_ops else [F[j][n_ops - 1]] + after_fwd
            deps += extra_b.get(k, [])
            if model is not None:
                deps += launch(j, i, f"bwd {graph.ops[k].name}", model.host_bwd_s * kern_b[k])
            B[j][k] = tg.add(f"bwd {graph.ops[k].name}", "backward", f"dev{ids[i]}/compute",
                             float(bwd[k, i]), deps, device=ids[i])
        done_b.add(k)
        # issue every collective whose readers' backward is done, in plan order
        while pending and all(kk in done_b for kk, _ in bwd_plan[pending[0]][1]):
            pi = pending.pop(0)
            members = bwd_plan[pi][1]
            deps = [B[j][kk] for kk, _ in members for j in range(len(reps))]
            c = members[0][1]
            if len(members) > 1:  # a bucket: one all-reduce of all its gradients
                c = dataclasses.replace(c, tensor=f"bucket of {len(members)} gradients",
                                        nbytes=sum(m.nbytes for _, m in members), algorithm=None)
            last = prev_comm.get(c.group, -1)
            # a gradient's collective on another group (a rail's all-reduce of what the node's
            # reduce-scatter or all-reduce made) starts once that one has ended
            deps += [made[m.tensor] for _, m in members if m.tensor in made]
            tid = _comm_task(tg, c, "bwd", devices, ids, view, ratios, of_dim,
                             deps + ([last] if last >= 0 else []), host_comm_s, pricer)
            prev_comm[c.group] = tid
            comm_tasks.append(tid)
            made.update((m.tensor, tid) for _, m in members)
            for _, m in members:
                p = producer.get(m.tensor)
                if p is not None and p < k:
                    extra_b[p].append(tid)
                elif p is None and graph.tensors[m.tensor].role == "param":
                    to_optimizer.append(tid)
                elif p is not None and p >= k:
                    raise SpmdLoweringError(f"gradient of {m.tensor} needed by op {graph.ops[p].name} "
                                            "before it is reduced")
    held = params_held(problem, program, ratios, of_dim)
    for j, i in enumerate(reps):
        kind = devices.kinds[i] if devices.kinds else view.kinds[ids[i]]
        step_host = model.step_host_s if model is not None else 0.0
        tg.add("optimizer step", "optimizer", f"dev{ids[i]}/compute",
               optimizer_time(float(held[i]), kind) + step_host,
               [B[j][0]] + to_optimizer, device=ids[i], args={"params": float(held[i])})
    return SpmdLowered(tg, reps, groups, comm_tasks, held)


def _comm_task(tg: TaskGraph, comm: Comm, phase: str, devices: Devices, ids: list[int], view: ClusterView,
               ratios: np.ndarray, of_dim: dict | None, deps: list[int], host_comm_s: float,
               pricer: _GroupPricer | None = None, stream: str = "world/comm") -> int:
    """One collective over every device: latency, then a flow over the ring's link resources that
    alone takes exactly the bandwidth part of the cost module's time. A hierarchical program's
    "node" and "rail" collectives are priced on their groups by `pricer`."""
    shares = _shares(comm, ratios, of_dim)
    if pricer is not None and comm.group in (NODE, RAIL):
        total, lat, rings = pricer.price(comm, shares)
        flow = _rings_flow(tg, view, rings, total - lat)
        cat = "comm_dp" if comm.group == RAIL else "comm_tp"
        return tg.add(f"{comm.op} {comm.tensor} ({phase}, {comm.group})", cat, f"{comm.group}/comm",
                      lat + host_comm_s, deps, flow=flow, device=ids[0],
                      args={"bytes": comm.nbytes, "op": comm.op, "group": comm.group, "ranks": len(rings[0]),
                            "cls": "spmd", "copies": 1, "seconds": total})
    if comm.op not in UNEVEN_OPS:  # NCCL picks the all-reduce algorithm at run time
        algo = choose_algorithm(comm.op, comm.nbytes, devices.links)
        comm = dataclasses.replace(comm, algorithm=algo)
        total = collective_time(comm.op, comm.nbytes, devices.links, algo)
    else:
        total = comm_seconds(comm, devices, shares)
    if comm.algorithm == "measured":
        lat = 0.0
    else:
        flat = dataclasses.replace(devices, links=dataclasses.replace(
            devices.links, ring_latency=0.0, intra_latency=0.0, inter_latency=0.0))
        lat = max(0.0, total - comm_seconds(comm, flat, shares))
    flow = _ring_flow(tg, view, ids, total - lat)
    cat = "comm_dp" if phase == "bwd" and comm.op == "all_reduce" else "comm_tp"
    return tg.add(f"{comm.op} {comm.tensor} ({phase})", cat, stream, lat + host_comm_s, deps, flow=flow,
                  device=ids[0], args={"bytes": comm.nbytes, "op": comm.op, "algorithm": comm.algorithm,
                                       "ranks": len(ids), "cls": "spmd", "copies": 1, "seconds": total})


def _ring_flow(tg: TaskGraph, view: ClusterView, ring: list[int], seconds: float) -> list | None:
    """A flow over the ring through `ring` whose bandwidth phase alone takes `seconds`: every hop
    carries ``seconds x`` the slowest hop's bandwidth (as `plait.sim.lower` runs collectives)."""
    if len(ring) < 2 or seconds <= 0:
        return None
    slowest, hops = view.ring_loads(ring)
    load: dict[int, float] = defaultdict(float)
    for a, b, x in hops:
        for key, cap, part in view.route(a, b):
            load[tg.add_resource(key, cap)] += part * x
    nbytes = seconds * slowest
    return [(r, nbytes * x, 1.0) for r, x in load.items()]


def _rings_flow(tg: TaskGraph, view: ClusterView, rings: list[list[int]], seconds: float) -> list | None:
    """One flow over several rings that run at once (every node's, or every rail's) that alone
    takes `seconds`: each link resource carries what one ring puts on it in that time. A resource
    several rings cross (a node's NIC under every rail) is not charged once per ring: `seconds`
    already prices their sharing (`plait.cost.spmd.rail_links`)."""
    if seconds <= 0:
        return None
    load: dict[int, float] = defaultdict(float)
    for ring in rings:
        for r, nbytes, _ in _ring_flow(tg, view, ring, seconds) or []:
            load[r] = max(load[r], nbytes)
    return [(r, b, 1.0) for r, b in load.items()] or None


class _GroupPricer:
    """Times of a hierarchical program's collectives (`plait.spmd.mesh`) on their real groups:
    "node" -- the op's collective in every node at once, each at its inner ratios and bytes
    (activations scale with the node's batch), the slowest node's time; "rail" -- a parameter
    gradient's cross-node all-reduce (`plait.cost.spmd.rail_time`)."""

    def __init__(self, problem: Problem, devices: Devices, view: ClusterView, ratios: np.ndarray,
                 of_dim: dict | None, device_scale: np.ndarray | None, mesh: Mesh) -> None:
        cluster = view.cluster
        if cluster is None:
            raise SpmdLoweringError("a hierarchical program needs the cluster's nodes (a Cluster, not a view)")
        self.problem, self.mesh = problem, mesh
        self.nodes = [Devices.of(view, devices.dtype, node) for node in mesh.nodes]
        self.node_links = [d.links for d in self.nodes]
        self.rails = rail_links(cluster, mesh)
        scale = np.ones(len(mesh.ids)) if device_scale is None else np.asarray(device_scale, dtype=float)
        self.scale = [float(scale[a * mesh.inner]) for a in range(mesh.outer)]
        self.zero = [dataclasses.replace(d, links=dataclasses.replace(
            d.links, ring_latency=0.0, intra_latency=0.0, inter_latency=0.0)) for d in self.nodes]
        self.zero_rails = [dataclasses.replace(x, ring_latency=0.0, intra_latency=0.0, inter_latency=0.0)
                           for x in self.rails]
        self.zero_node_links = [d.links for d in self.zero]

    def price(self, comm: Comm, shares: np.ndarray) -> tuple[float, float, list[list[int]]]:
        """(seconds, latency part, rings that carry it)."""
        g = self.mesh.inner
        if comm.group == RAIL:
            local = shares[:g] if comm.dim is not None else None
            total = rail_time(comm.nbytes, local, self.rails, self.node_links)
            bw = rail_time(comm.nbytes, local, self.zero_rails, self.zero_node_links)
            return total, max(0.0, total - bw), [list(r) for r in self.mesh.rails()]
        meta = self.problem.graph.tensors.get(comm.tensor)
        grows = meta is not None and meta.role != "param"  # activations scale with the node's batch
        total = bw = 0.0
        for a, node in enumerate(self.nodes):
            c = dataclasses.replace(comm, nbytes=int(comm.nbytes * self.scale[a]) if grows else comm.nbytes,
                                    algorithm=comm.algorithm if comm.op in UNEVEN_OPS else None)
            local = shares[a * g:(a + 1) * g]
            local = local / local.sum() if local.sum() > 0 else local
            t = comm_seconds(c, node, local)
            if t >= total:
                total, bw = t, comm_seconds(c, self.zero[a], local)
        return total, max(0.0, total - bw), [list(n) for n in self.mesh.nodes]
