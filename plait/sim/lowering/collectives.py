"""Collectives and point-to-point messages of op-level (SPMD) stages as engine tasks.

A collective is a latency, then a flow over the link resources of the ring through its devices
(`plait.net.view`) that alone takes exactly the bandwidth part of the cost module's time
(`plait.cost.collectives`, `plait.cost.spmd`), so concurrent collectives and pipeline messages
share links. The tensor-parallel stages of `plait.sim.lowering.tensor_parallel` price theirs the
same way from the same cost functions.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import numpy as np

from plait.cost.collectives import UNEVEN_OPS, choose_algorithm, collective_time, latency_steps
from plait.cost.spmd import Devices, comm_seconds, rail_links, rail_time
from plait.errors import PlaitError
from plait.ir.program import NODE, RAIL, Comm, Mesh
from plait.net.view import ClusterView
from plait.sim.engine import TaskGraph


class SpmdLoweringError(PlaitError, ValueError):
    """A program that cannot be lowered onto this cluster (the message names what)."""


def shares_of(comm: Comm, ratios: np.ndarray, of_dim: dict[tuple[str, int], int] | None) -> np.ndarray:
    """Per-device shares of the tensor an uneven collective moves: its segment's ratios."""
    r = np.atleast_2d(np.asarray(ratios, dtype=float))
    if r.shape[0] == 1 or comm.dim is None:
        return r.mean(axis=0) if r.shape[0] > 1 else r[0]
    return r[(of_dim or {}).get((comm.tensor, comm.dim), 0)]


def comm_task(tg: TaskGraph, comm: Comm, phase: str, devices: Devices, ids: list[int], view: ClusterView,
              ratios: np.ndarray, of_dim: dict | None, deps: list[int], host_comm_s: float,
              pricer: GroupPricer | None = None, stream: str = "world/comm") -> int:
    """One collective of a program over its devices: latency, then a flow over the ring's link
    resources that alone takes exactly the bandwidth part of the cost module's time. A
    hierarchical program's "node" and "rail" collectives are priced on their groups by `pricer`."""
    shares = shares_of(comm, ratios, of_dim)
    if pricer is not None and comm.group in (NODE, RAIL):
        total, lat, rings = pricer.price(comm, shares)
        flow = rings_flow(tg, view, rings, total - lat)
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
    flow = ring_flow(tg, view, ids, total - lat)
    cat = "comm_dp" if phase == "bwd" and comm.op == "all_reduce" else "comm_tp"
    return tg.add(f"{comm.op} {comm.tensor} ({phase})", cat, stream, lat + host_comm_s, deps, flow=flow,
                  device=ids[0], args={"bytes": comm.nbytes, "op": comm.op, "algorithm": comm.algorithm,
                                       "ranks": len(ids), "cls": "spmd", "copies": 1, "seconds": total})


def group_collective(tg: TaskGraph, view: ClusterView, op: str, nbytes: float, ids: list[int], deps: list[int],
                     name: str, stream: str, host_comm_s: float, *, stage: int | None = None,
                     mb: int | None = None, category: str = "comm") -> int:
    """One collective of `nbytes` on the devices `ids`, priced on their links (`plait.cost.collectives`,
    the algorithm NCCL's tuner would pick): what a pipeline adds between stage programs."""
    links = view.group(ids)
    algo = choose_algorithm(op, nbytes, links)
    total = collective_time(op, nbytes, links, algo)
    lat = latency_steps(op, links.n, algo) * links.ring_latency
    if algo in ("hierarchical", "measured"):
        lat = min(lat, total)
    flow = ring_flow(tg, view, ids, max(0.0, total - lat))
    return tg.add(name, category, stream, lat + host_comm_s, deps, flow=flow, device=ids[0], stage=stage,
                  micro_batch=mb, args={"bytes": nbytes, "op": op, "algorithm": algo, "ranks": len(ids),
                                        "cls": category, "copies": 1})


def ring_flow(tg: TaskGraph, view: ClusterView, ring: list[int], seconds: float) -> list | None:
    """A flow over the ring through `ring` whose bandwidth phase alone takes `seconds`: every hop
    carries ``seconds x`` the slowest hop's bandwidth (as the tensor-parallel stages run collectives)."""
    if len(ring) < 2 or seconds <= 0:
        return None
    slowest, hops = view.ring_loads(ring)
    load: dict[int, float] = defaultdict(float)
    for a, b, x in hops:
        for key, cap, part in view.route(a, b):
            load[tg.add_resource(key, cap)] += part * x
    nbytes = seconds * slowest
    return [(r, nbytes * x, 1.0) for r, x in load.items()]


def rings_flow(tg: TaskGraph, view: ClusterView, rings: list[list[int]], seconds: float) -> list | None:
    """One flow over several rings that run at once (every node's, or every rail's) that alone
    takes `seconds`: each link resource carries what one ring puts on it in that time. A resource
    several rings cross (a node's NIC under every rail) is not charged once per ring: `seconds`
    already prices their sharing (`plait.cost.spmd.rail_links`)."""
    if seconds <= 0:
        return None
    load: dict[int, float] = defaultdict(float)
    for ring in rings:
        for r, nbytes, _ in ring_flow(tg, view, ring, seconds) or []:
            load[r] = max(load[r], nbytes)
    return [(r, b, 1.0) for r, b in load.items()] or None


class GroupPricer:
    """Times of a hierarchical program's collectives (`plait.spmd.mesh`) on their real groups:
    "node" -- the op's collective in every node at once, each at its inner ratios and bytes
    (activations scale with the node's batch), the slowest node's time; "rail" -- a parameter
    gradient's cross-node all-reduce (`plait.cost.spmd.rail_time`)."""

    def __init__(self, problem, devices: Devices, view: ClusterView, ratios: np.ndarray,
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
