"""Multi-node launch on real hosts: which host runs which plan ranks, and does it match the cluster file.

Every node runs the same `plait run` command (same plan, same cluster file) with
`--nnodes N --rdzv-endpoint HOST:PORT`; each starts one torchrun agent
(`torch.distributed.run`, c10d rendezvous) that forks as many workers as the node has
plan ranks. c10d numbers the nodes in the order they join and ignores a node rank, so
the plan ranks are mapped to hosts *after* the rendezvous, in the workers:

1. before the rendezvous a node knows its plan ranks when its node name (`--node-name`,
   default the hostname; under Slurm `SLURMD_NODENAME`) is a node name of the cluster
   file; otherwise it starts `--nproc-per-node` workers (or the count every cluster node
   has) and takes a cluster node in rendezvous order;
2. after the rendezvous local rank 0 of every node publishes the node's facts (name,
   hostname, workers, backend, CUDA devices with name and memory) in the rendezvous's
   TCPStore (the store torchrun's agents share with their workers); every worker reads
   all of them and computes the same assignment (`assign_nodes`) and the same verdict
   (`check_hosts`), so a mismatch stops every node with the same message, naming the
   host and the field, before any training;
3. the worker's plan rank is the assigned cluster node's ranks[LOCAL_RANK]; the process
   group is then initialised with plan ranks (Megatron order), whatever RANK torchrun gave.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plait.errors import PlaitError

if TYPE_CHECKING:
    from plait.cluster.spec import Cluster
    from plait.runtime.worker_config import WorkerConfig

RANK_ENV = "PLAIT_PLAN_RANK"  # set once the mapping is known (the forked worker inherits it)
HOSTS_ERROR = "hosts_error.json"  # run-dir file: the mapping/check verdict, read by the launcher
NODE_FILE = "node.json"  # run-dir file: the plan ranks this node runs, written after the mapping
MEMORY_TOLERANCE = 0.10  # drivers report a little less than the marketed size (80 GB A100: 79.2 GiB)


class HostMismatch(PlaitError, RuntimeError):
    """A host that joined does not match the cluster file (the message names host and field)."""


@dataclass(frozen=True)
class Rendezvous:
    """Where and how this node meets the others (torchrun's c10d options)."""

    nnodes: int
    endpoint: str  # HOST:PORT of the c10d rendezvous store
    run_id: str
    node_name: str
    nproc: int | None = None  # workers to start when the node name is not in the cluster file
    source: str = "flags"  # "flags" or "slurm"

    def __post_init__(self) -> None:
        if self.nnodes < 1:
            raise PlaitError(f"--nnodes: must be >= 1, got {self.nnodes}")
        host, _, port = self.endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise PlaitError(f"--rdzv-endpoint: must be HOST:PORT, got {self.endpoint!r}")
        if not self.node_name:
            raise PlaitError("--node-name: must not be empty")
        if self.nproc is not None and self.nproc < 1:
            raise PlaitError(f"--nproc-per-node: must be >= 1, got {self.nproc}")


@dataclass(frozen=True)
class HostNode:
    """A node of the cluster file that holds plan ranks, as the hosts that join are checked against it."""

    name: str
    """Its name in the cluster file."""
    ranks: tuple[int, ...]
    """Its plan ranks, by local GPU index."""
    local: tuple[int, ...]
    """The local GPU index of each of `ranks`."""
    gpus: int
    """GPUs the cluster file gives it."""
    kinds: tuple[str, ...]
    """The GPU kind of each of its GPUs."""
    memory: tuple[int, ...]
    """The memory (bytes) of each of its GPUs."""


# ---------------------------------------------------------------------------------- Slurm
def first_host(nodelist: str) -> str:
    """The first host of a Slurm hostlist: 'gpu[03-05,9],cpu1' -> 'gpu03' (zero padding kept)."""
    text = nodelist.strip()
    m = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?([^,]*)", text)
    if not text or m is None or not (m.group(1) or m.group(2)):
        raise PlaitError(f"SLURM_JOB_NODELIST: cannot read a host from {nodelist!r}")
    prefix, ranges, suffix = m.group(1), m.group(2), m.group(3)
    if ranges is None:
        return prefix + suffix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first + suffix


def from_slurm(env: Mapping[str, str], port: int | None = None) -> Rendezvous | None:
    """Rendezvous options from a Slurm step's environment (`plait run` inside `srun`), or None
    outside Slurm. One `plait run` per node: srun must start one task per node."""
    if "SLURM_JOB_ID" not in env or "SLURM_NNODES" not in env and "SLURM_STEP_NUM_NODES" not in env:
        return None
    nnodes = int(env.get("SLURM_STEP_NUM_NODES") or env["SLURM_NNODES"])
    step = env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID") or ""
    if nnodes > 1 and not step:
        # The batch script itself runs on the first node only: started there, every rank would land on it.
        raise PlaitError(f"Slurm: the job has {nnodes} nodes but this is not a job step; start `plait run` with "
                         f"`srun --ntasks-per-node=1` (see `plait plan --export slurm`), or give --nnodes")
    tasks = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS")
    if tasks is not None and int(tasks) != nnodes:
        raise PlaitError(f"Slurm: the step runs {tasks} tasks on {nnodes} nodes; `plait run` is one launcher per "
                         f"node (srun --ntasks-per-node=1), it starts the node's workers itself")
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise PlaitError("Slurm: SLURM_JOB_NODELIST is not set; give --rdzv-endpoint HOST:PORT")
    if port is None:
        port = int(env.get("MASTER_PORT") or 29400)
    return Rendezvous(nnodes=nnodes, endpoint=f"{first_host(nodelist)}:{port}",
                      run_id=f"slurm-{env['SLURM_JOB_ID']}" + (f".{step}" if step else ""),
                      node_name=env.get("SLURMD_NODENAME") or socket.gethostname(), source="slurm")


# ---------------------------------------------------------------------------------- cluster side
def cluster_nodes(cluster: Cluster | None, layout: list[dict[str, Any]]) -> list[HostNode]:
    """The cluster file's nodes that hold plan ranks, in file order: name, plan ranks (by local
    device), local device index per rank, and what the file says of the node's GPUs."""
    out: list[HostNode] = []
    if cluster is None:
        raise PlaitError("--nnodes: a multi-node run needs --cluster (the file names the nodes and their GPUs)")
    devices = cluster.devices
    for n, node in enumerate(cluster.nodes):
        mine = sorted((devices[i["device"]].local, i["rank"]) for i in layout if i["node"] == n)
        if not mine:
            continue
        out.append(HostNode(name=node.name, ranks=tuple(r for _, r in mine), local=tuple(loc for loc, _ in mine),
                            gpus=len(node.gpus), kinds=tuple(node.gpus),
                            memory=tuple(cluster.kinds[k].memory_bytes for k in node.gpus)))
    return out


def local_workers(nodes: list[HostNode], rdzv: Rendezvous) -> tuple[int, HostNode | None]:
    """Before the rendezvous: how many workers this node starts, and its cluster node when named."""
    if len(nodes) != rdzv.nnodes:
        names = ", ".join(n.name for n in nodes)
        raise PlaitError(f"--nnodes: the plan runs on {len(nodes)} node(s) of the cluster file ({names}), "
                         f"got --nnodes {rdzv.nnodes}")
    named = next((n for n in nodes if n.name == rdzv.node_name), None)
    if named is not None:
        if rdzv.nproc is not None and rdzv.nproc != len(named.ranks):
            raise HostMismatch(f"host {rdzv.node_name}: GPU count: --nproc-per-node {rdzv.nproc}, but the cluster "
                               f"file's node '{rdzv.node_name}' runs {len(named.ranks)} plan ranks")
        return len(named.ranks), named
    if rdzv.nproc is not None:
        return rdzv.nproc, None
    counts = {len(n.ranks) for n in nodes}
    if len(counts) == 1:
        return counts.pop(), None
    names = ", ".join(f"{n.name} ({len(n.ranks)} ranks)" for n in nodes)
    raise PlaitError(f"--node-name: '{rdzv.node_name}' is not a node of the cluster file ({names}) and its nodes "
                     f"run different numbers of ranks; give --node-name NAME (or --nproc-per-node K)")


# ---------------------------------------------------------------------------------- host side
def run_fields(config: WorkerConfig) -> dict[str, Any]:
    """The settings every node must agree on (each node builds its config from its own command
    line), as JSON values: published with the node's facts and compared field by field."""
    ck = config.checkpoint
    return {"model": config.model, "plan": config.plan.to_dict(), "steps": config.steps, "seed": config.seed,
            "data_seed": config.data_seed, "optimizer": config.optimizer, "dtype": config.dtype,
            "inject": config.faults.inject.to_list() or None,
            "checkpoint": {"every": ck.every if ck else None, "resume": ck.resume if ck else None}}


def host_facts(node_name: str, workers: int, backend: str, cuda: bool, run: dict[str, Any] | None = None
               ) -> dict[str, Any]:
    """What this host is: compared with the cluster file after the rendezvous."""
    facts: dict[str, Any] = {"name": node_name, "hostname": socket.gethostname(), "workers": workers,
                             "backend": backend, "cuda": None, "run": run or {}}
    if cuda:
        import torch

        n = torch.cuda.device_count()
        props = [torch.cuda.get_device_properties(i) for i in range(n)]
        facts["cuda"] = {"count": n, "names": [p.name for p in props], "memory": [int(p.total_memory) for p in props]}
    return facts


def assign_nodes(nodes: Sequence[HostNode], joined: list[dict[str, Any]]) -> list[int]:
    """Cluster node index per joined host (in rendezvous order): by node name where the cluster
    file names the host, the remaining hosts in rendezvous order onto the remaining nodes."""
    if len(joined) != len(nodes):
        names = ", ".join(n.name for n in nodes)
        raise HostMismatch(f"{len(joined)} hosts joined ({', '.join(h['name'] for h in joined)}) but the plan runs on "
                           f"{len(nodes)} node(s) of the cluster file ({names})")
    index = {n.name: i for i, n in enumerate(nodes)}
    out: list[int | None] = [None] * len(joined)
    taken: dict[int, str] = {}
    for g, host in enumerate(joined):
        i = index.get(host["name"])
        if i is None:
            continue
        if i in taken:
            raise HostMismatch(f"host {host['hostname']}: node name: '{host['name']}' was claimed by host "
                               f"{taken[i]} too; give each node its own --node-name")
        taken[i] = host["hostname"]
        out[g] = i
    free = iter(i for i in range(len(nodes)) if i not in taken)
    return [o if o is not None else next(free) for o in out]


def _kind_matches(kind: str, device_name: str) -> bool:
    """'a100-80gb' ~ 'NVIDIA A100-SXM4-80GB', 'rtx-4090' ~ 'NVIDIA GeForce RTX 4090', 't4' ~ 'Tesla T4':
    the kind's model (its name less a trailing memory size) is one token, or two adjacent tokens,
    of the device name."""
    core = re.sub(r"[^a-z0-9]", "", re.sub(r"-\d+gb$", "", kind.lower()))
    tokens = [t for t in re.split(r"[^a-z0-9]+", device_name.lower()) if t]
    return core in tokens or core in {a + b for a, b in zip(tokens, tokens[1:])}


def check_hosts(nodes: Sequence[HostNode], joined: list[dict[str, Any]], assignment: list[int],
                emulated: bool) -> None:
    """Raise HostMismatch naming the first host and field that differ from the cluster file.

    Always: the workers a host started equal its node's plan ranks, and every host uses the
    same backend. CUDA hosts of a real (not emulated) cluster file: GPU count, each used
    GPU's kind (by name) and memory (within 10 %). CPU hosts and emulated clusters have no
    GPUs to compare."""
    first = joined[0]
    for host in joined[1:]:
        for key in first["run"]:
            if host["run"].get(key) != first["run"][key]:
                raise HostMismatch(f"host {host['hostname']} (node name '{host['name']}'): '{key}' is "
                                   f"{host['run'].get(key)!r} there but {first['run'][key]!r} on host "
                                   f"{first['hostname']}; run the same command on every node")
    backends = {h["backend"] for h in joined}
    if len(backends) > 1:
        which = ", ".join(f"{h['hostname']}: {h['backend']}" for h in joined)
        raise HostMismatch(f"backend: the hosts chose different backends ({which}); give --device on every node")
    for host, i in zip(joined, assignment):
        node = nodes[i]
        who = f"host {host['hostname']} (node name '{host['name']}', cluster node '{node.name}')"
        if host["workers"] != len(node.ranks):
            raise HostMismatch(f"{who}: GPU count: the cluster file puts {len(node.ranks)} plan rank(s) on this "
                               f"node, the host started {host['workers']} worker(s)")
        cuda = host.get("cuda")
        if emulated or cuda is None:
            continue
        if cuda["count"] != node.gpus:
            raise HostMismatch(f"{who}: GPU count: the cluster file says {node.gpus}, the host has {cuda['count']}")
        for local in node.local:
            kind, name = node.kinds[local], cuda["names"][local]
            if not _kind_matches(kind, name):
                raise HostMismatch(f"{who}: GPU kind: the cluster file says '{kind}' for GPU {local}, "
                                   f"the host has '{name}'")
            want, have = node.memory[local], cuda["memory"][local]
            if abs(have - want) > MEMORY_TOLERANCE * want:
                raise HostMismatch(f"{who}: memory: the cluster file says {want / 2**30:.1f} GiB for GPU {local} "
                                   f"('{kind}'), the host has {have / 2**30:.1f} GiB")


# ---------------------------------------------------------------------------------- worker side
def _store(timeout: float) -> Any:
    """A client of the rendezvous store torchrun's agents share with their workers."""
    import torch.distributed as dist

    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=datetime.timedelta(seconds=timeout))


def exchange(store: Any, prefix: str, group_rank: int, group_world: int, mine: dict[str, Any] | None
             ) -> list[dict[str, Any]]:
    """Publish this node's facts (when `mine`, i.e. on local rank 0) and read every node's."""
    if mine is not None:
        store.set(f"{prefix}/{group_rank}", json.dumps(mine))
    keys = [f"{prefix}/{g}" for g in range(group_world)]
    store.wait(keys)
    return [json.loads(store.get(k)) for k in keys]


def rank_after_rendezvous(config: WorkerConfig) -> int:
    """In a torchrun worker of a multi-node run: this worker's plan rank (see the module doc).
    The verdict of a failed check is written to RUN_DIR/hosts_error.json before raising."""
    if os.environ.get(RANK_ENV):
        return int(os.environ[RANK_ENV])
    mn = config.multinode
    assert mn is not None, "a multi-node run's config has its node's share"
    run_dir = Path(config.run_dir)
    local, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    group, group_world = int(os.environ["GROUP_RANK"]), int(os.environ["GROUP_WORLD_SIZE"])
    prefix = f"plait/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}"
    try:
        mine = host_facts(mn.node_name, local_world, config.backend, config.cuda,
                          run_fields(config)) if local == 0 else None
        joined = exchange(_store(mn.timeout), prefix + "/node", group, group_world, mine)
        nodes = mn.nodes
        assignment = assign_nodes(nodes, joined)
        check_hosts(nodes, joined, assignment, mn.emulated)
    except HostMismatch as exc:
        write_json(run_dir / HOSTS_ERROR, {"error": str(exc)})
        raise
    node = nodes[assignment[group]]
    rank = node.ranks[local]
    if local == 0:
        write_json(run_dir / NODE_FILE, {"host": joined[group]["hostname"], "node_name": mn.node_name,
                                          "cluster_node": node.name, "ranks": list(node.ranks),
                                          "hosts": [{"hostname": h["hostname"], "name": h["name"],
                                                     "cluster_node": nodes[i].name, "ranks": list(nodes[i].ranks)}
                                                    for h, i in zip(joined, assignment)]})
    os.environ[RANK_ENV] = str(rank)
    return rank


def write_json(path: Path, data: dict[str, Any]) -> None:
    """`data` to `path` whole: written beside it, then renamed over it (a reader never sees half)."""
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)
