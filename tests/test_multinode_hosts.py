"""Multi-node launch, the parts without processes: Slurm variables, rank mapping after the
rendezvous and the check of the hosts that joined against the cluster file."""

from __future__ import annotations

import pytest

from plait.cluster.loader import parse_yaml_text
from plait.errors import PlaitError
from plait.ir.plan import Plan
from plait.runtime.api import rank_layout
from plait.runtime.multinode import (
    HostMismatch,
    HostNode,
    Rendezvous,
    assign_nodes,
    check_hosts,
    cluster_nodes,
    first_host,
    from_slurm,
    local_workers,
)

GiB = 2**30
CLUSTER = """\
name: mixed
nodes:
  - {name: big, gpus: {kind: a100-80gb, count: 2}}
  - {name: small, gpus: {kind: v100-16gb, count: 1}}
"""


@pytest.fixture
def nodes() -> list[HostNode]:
    cluster = parse_yaml_text(CLUSTER, source="mixed.yaml")
    return cluster_nodes(cluster, rank_layout(cluster, Plan.load("pp=3,global_batch=6")))


def _host(name: str, workers: int, hostname: str | None = None, cuda: dict | None = None, **run: object) -> dict:
    return {"name": name, "hostname": hostname or f"h-{name}", "workers": workers, "backend": "gloo",
            "cuda": cuda, "run": run}


def _cuda(names: list[str], memory_gib: list[float]) -> dict:
    return {"count": len(names), "names": names, "memory": [int(m * GiB) for m in memory_gib]}


@pytest.mark.parametrize("nodelist, host", [("gpu[03-05,9],cpu1", "gpu03"), ("n1,n2", "n1"), ("solo", "solo"),
                                            ("rack[7]-gpu", "rack7-gpu")])
def test_first_host_of_a_slurm_hostlist(nodelist: str, host: str) -> None:
    assert first_host(nodelist) == host


def test_slurm_variables_give_the_rendezvous() -> None:
    env = {"SLURM_JOB_ID": "77", "SLURM_NNODES": "4", "SLURM_NTASKS": "4", "SLURM_STEP_ID": "2",
           "SLURM_STEP_NODELIST": "a[10-13]", "SLURM_JOB_NODELIST": "zzz", "SLURMD_NODENAME": "a11"}
    rdzv = from_slurm(env)
    assert rdzv == Rendezvous(nnodes=4, endpoint="a10:29400", run_id="slurm-77.2", node_name="a11", source="slurm")
    assert from_slurm({**env, "MASTER_PORT": "6000"}).endpoint == "a10:6000"
    assert from_slurm({"HOME": "/root"}) is None
    with pytest.raises(PlaitError, match="one launcher per node"):
        from_slurm({**env, "SLURM_NTASKS": "8"})
    batch = {k: v for k, v in env.items() if k != "SLURM_STEP_ID"}  # the batch script, not an srun step
    with pytest.raises(PlaitError, match="not a job step; start `plait run` with `srun --ntasks-per-node=1`"):
        from_slurm(batch)


def test_rendezvous_options_are_checked() -> None:
    with pytest.raises(PlaitError, match="--rdzv-endpoint: must be HOST:PORT"):
        Rendezvous(nnodes=2, endpoint="nohost", run_id="x", node_name="a")
    with pytest.raises(PlaitError, match="--nnodes: must be >= 1"):
        Rendezvous(nnodes=0, endpoint="h:1", run_id="x", node_name="a")


def test_cluster_nodes_and_workers_before_the_rendezvous(nodes: list[HostNode]) -> None:
    assert [(n.name, n.ranks, n.local) for n in nodes] == [("big", (0, 1), (0, 1)), ("small", (2,), (0,))]
    rdzv = Rendezvous(nnodes=2, endpoint="big:29400", run_id="x", node_name="small")
    assert local_workers(nodes, rdzv) == (1, nodes[1])
    unnamed = Rendezvous(nnodes=2, endpoint="big:29400", run_id="x", node_name="cn7")
    with pytest.raises(PlaitError, match="'cn7' is not a node of the cluster file .* --node-name NAME"):
        local_workers(nodes, unnamed)
    assert local_workers(nodes, Rendezvous(nnodes=2, endpoint="b:1", run_id="x", node_name="cn7", nproc=2)) == (2, None)
    with pytest.raises(PlaitError, match="--nnodes: the plan runs on 2 node"):
        local_workers(nodes, Rendezvous(nnodes=3, endpoint="b:1", run_id="x", node_name="cn7", nproc=1))
    with pytest.raises(HostMismatch, match="host small: GPU count: --nproc-per-node 2"):
        local_workers(nodes, Rendezvous(nnodes=2, endpoint="b:1", run_id="x", node_name="small", nproc=2))


def test_nodes_are_matched_by_name_then_in_rendezvous_order(nodes: list[HostNode]) -> None:
    assert assign_nodes(nodes, [_host("small", 1), _host("big", 2)]) == [1, 0]
    assert assign_nodes(nodes, [_host("cn1", 2), _host("small", 1)]) == [0, 1]  # named first, rest in order
    assert assign_nodes(nodes, [_host("cn2", 2), _host("cn1", 1)]) == [0, 1]
    with pytest.raises(HostMismatch, match="host h-b2: node name: 'big' was claimed by host h-big too"):
        assign_nodes(nodes, [_host("big", 2), _host("big", 2, hostname="h-b2")])
    with pytest.raises(HostMismatch, match="3 hosts joined"):
        assign_nodes(nodes, [_host("a", 1), _host("b", 1), _host("c", 1)])


def test_check_names_the_host_and_the_field(nodes: list[HostNode]) -> None:
    ok_big, ok_small = _cuda(["NVIDIA A100-SXM4-80GB"] * 2, [79.2, 79.2]), _cuda(["Tesla V100-SXM2-16GB"], [15.8])
    check_hosts(nodes, [_host("big", 2, cuda=ok_big), _host("small", 1, cuda=ok_small)], [0, 1], emulated=False)
    cases = [
        ([_host("cn1", 1), _host("cn2", 1)], "host h-cn1 .*cluster node 'big'.*: GPU count: the cluster file puts 2"),
        ([_host("big", 2, cuda=_cuda(["NVIDIA A100-SXM4-80GB"], [79.2])), _host("small", 1, cuda=ok_small)],
         "host h-big .*: GPU count: the cluster file says 2, the host has 1"),
        ([_host("big", 2, cuda=ok_big), _host("small", 1, cuda=_cuda(["NVIDIA GeForce RTX 4090"], [23.6]))],
         "host h-small .*: GPU kind: the cluster file says 'v100-16gb' for GPU 0, the host has 'NVIDIA GeForce"),
        ([_host("big", 2, cuda=_cuda(["NVIDIA A100-SXM4-40GB"] * 2, [39.4, 39.4])), _host("small", 1, cuda=ok_small)],
         "host h-big .*: memory: the cluster file says 80.0 GiB for GPU 0 .* the host has 39.4 GiB"),
        ([_host("big", 2, steps=3), _host("small", 1, steps=5)], "host h-small .*: 'steps' is 5 there but 3 on host h-big"),
    ]
    for joined, message in cases:
        with pytest.raises(HostMismatch, match=message):
            check_hosts(nodes, joined, assign_nodes(nodes, joined), emulated=False)
    # An emulated cluster file says nothing about the hosts' real GPUs: only worker counts are compared.
    wrong = _cuda(["NVIDIA GeForce RTX 4090"], [23.6])
    check_hosts(nodes, [_host("big", 2, cuda=ok_big), _host("small", 1, cuda=wrong)], [0, 1], emulated=True)


@pytest.mark.parametrize("kind, name, same", [("a100-80gb", "NVIDIA A100-SXM4-80GB", True),
                                              ("h100-80gb", "NVIDIA H100 80GB HBM3", True),
                                              ("rtx-4090", "NVIDIA GeForce RTX 4090", True),
                                              ("t4", "Tesla T4", True), ("a10", "NVIDIA A100-PCIE-40GB", False),
                                              ("l40s", "NVIDIA L40", False)])
def test_gpu_kind_names(kind: str, name: str, same: bool) -> None:
    from plait.runtime.multinode import _kind_matches

    assert _kind_matches(kind, name) is same


@pytest.mark.parametrize("args, message", [
    (["--node-name", "x"], "--node-name: needs --nnodes N"),
    (["--nnodes", "2"], "--nnodes: needs --rdzv-endpoint HOST:PORT"),
    (["--nnodes", "2", "--rdzv-endpoint", "h:1"], "--nnodes: a multi-node run needs --cluster"),
    (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--predict"], "--predict: runs on one machine"),
])
def test_run_flags_for_real_hosts_are_checked(args: list[str], message: str, capsys: pytest.CaptureFixture[str]
                                              ) -> None:
    from plait.cli import main

    assert main(["run", "--model", "gpt:layers=2,hidden=16,heads=4,seq=8,vocab=32", "--plan", "dp=2,global_batch=2", *args]) == 2
    assert message in capsys.readouterr().err
