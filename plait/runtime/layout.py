"""How a plan's pipeline maps onto the runtime's ranks, and what the runtime can run.

A pipeline is a DAG of *nodes* (`plait.schedule.Node`):

* a chain plan (``pp`` stages, ``virtual_stages`` = v chunks each) has ``pp * v`` nodes in
  a line; node ``k`` runs on pipeline rank ``k % pp`` as its chunk ``k // pp`` (Megatron's
  interleaved layout); ranks are Megatron's grid (tp fastest, then dp, then pp);
* a graph plan (`Plan.stages` + `Plan.stage_edges`) has one node per stage, each with its
  own micro-batch size and data-parallel degree: its ranks are (stage, replica) pairs,
  numbered stage-major (the ranks of stage 0's replicas first; rank = stage when every dp
  is 1). A stage's micro-batches are cut from the whole batch and dealt to its replicas
  by the stage graph's one rule (`plait.ir.stage_graph.deal_micro_batches`); the schedule
  is built per stage over all of them (`Node.replicas`: each replica keeps its own
  warm-up) and each replica runs the stage's action list restricted to the micro-batches
  it owns (`rank_actions`) -- the simulator's lowering does the same (`sim/lowering/tensor_parallel.py`): a
  restriction of a deadlock-free order stays deadlock-free, and the messages between two
  ranks keep their FIFO order. A send/recv goes to the replica of the peer stage that owns
  the peer micro-batch (`PipelineLayout.rank_of`). A stage that runs per input
  (`StageSpec.segments`) has a node per segment on its ranks (`PipelineLayout.places`): the
  edges between segments come from the traced model's layer dependencies by the stage graph's
  rule (`split_model`, then `with_node_edges`), values between two segments of one rank are
  handed over in memory (`executor`).

`supports(plan)` is the runtime's own statement of what it runs; `api.run` refuses
exactly what it refuses, with its reason.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from plait.ir.plan import Plan, PlanSource
from plait.runtime.partition import (
    MicroBatch,
    Stage,
    layer_modules,
    load_model_spec,
    make_samples,
    replica_micro_batches,
    split_into_graph,
    split_into_stages,
    stage_micro_batches,
)
from plait.schedule import Action, Node, PipelineGraph, Schedule, ScheduleError, build

if TYPE_CHECKING:
    from plait.runtime.worker_config import WorkerConfig


@dataclass(frozen=True)
class PipelineLayout:
    num_stages: int  # pipeline ranks of one replica
    chunks: int  # nodes per pipeline rank
    edges: tuple[tuple[int, int], ...]  # between node ids
    graph_plan: bool  # stages come from Plan.stages
    # graph plan: the ranks of each stage's replicas (stage-major), and per stage the replica
    # that owns each of its micro-batches (index = the stage's micro-batch in sample order)
    stage_ranks: tuple[tuple[int, ...], ...] = ()
    owners: tuple[tuple[int, ...], ...] = ()
    # graph plan whose stages run per input (`StageSpec.segments`): (stage, chunk) of each node, a
    # node per segment, stage-major; `edges` then join segments (`split_model` sets them from the
    # traced model, `with_node_edges`). Empty: node = stage (or a chain's chunk * stages + stage).
    places: tuple[tuple[int, int], ...] = ()

    def rank_of(self, stage: int, replica: int) -> int:
        """Process rank of a graph plan's (stage, replica)."""
        return self.stage_ranks[stage][replica]

    def coords(self, rank: int) -> tuple[int, int]:
        """(stage, replica) of a graph plan's rank."""
        for s, ranks in enumerate(self.stage_ranks):
            if rank in ranks:
                return s, ranks.index(rank)
        raise ValueError(f"rank {rank} is not in the stage graph's {sum(map(len, self.stage_ranks))} ranks")

    def replicas(self, stage: int) -> int:
        return len(self.stage_ranks[stage]) if self.graph_plan else 1

    def node_of(self, stage: int, chunk: int) -> int:
        if self.places:
            return self.places.index((stage, chunk))
        return chunk * self.num_stages + stage

    def place(self, node: int) -> tuple[int, int]:
        """(pipeline rank, chunk) of a node."""
        if self.places:
            return self.places[node]
        return node % self.num_stages, node // self.num_stages

    def chunks_of(self, stage: int) -> int:
        """Nodes pipeline rank `stage` runs (its segments, or a chain's chunks)."""
        return sum(1 for s, _ in self.places if s == stage) if self.places else self.chunks

    @property
    def num_nodes(self) -> int:
        return len(self.places) if self.places else self.num_stages * self.chunks

    @property
    def sink(self) -> tuple[int, int]:
        """The node that computes the loss: the one without successors."""
        sources = {a for a, _ in self.edges}
        sinks = [n for n in range(self.num_nodes) if n not in sources]
        return self.place(sinks[-1])


def pipeline_layout(plan: Plan) -> PipelineLayout:
    if plan.stages:
        ranks, owners = _stage_ranks(plan), tuple(_owners(plan, s) for s in range(len(plan.stages)))
        stage_edges = tuple(tuple(e) for e in plan.stage_edges)
        if not any(spec.segments and len(spec.segments) > 1 for spec in plan.stages):
            return PipelineLayout(len(plan.stages), 1, stage_edges, True, ranks, owners)  # type: ignore[arg-type]
        places = tuple((s, k) for s, spec in enumerate(plan.stages) for k in range(len(spec.segment_layers())))
        # until `split_model` reads the segments' edges off the model: stage edges from last to first
        # segment, and each stage's segments in a line (the same sink)
        node = {p: i for i, p in enumerate(places)}
        last = {s: node[(s, k)] for s, k in places}
        edges = {(last[a], node[(b, 0)]) for a, b in stage_edges}
        edges |= {(node[(s, k - 1)], i) for i, (s, k) in enumerate(places) if k > 0}
        return PipelineLayout(len(plan.stages), max(k for _, k in places) + 1, tuple(sorted(edges)), True,
                              ranks, owners, places)
    v = plan.virtual_stages
    n = plan.pp * v
    return PipelineLayout(plan.pp, v, tuple((k, k + 1) for k in range(n - 1)), False)


def _stage_ranks(plan: Plan) -> tuple[tuple[int, ...], ...]:
    """A graph plan's ranks per stage, stage-major: one per device (a replica each, or the ranks
    of the stage's SPMD program in a composed plan, `plait.runtime.compose_worker`)."""
    ranks, first = [], 0
    for spec in plan.stages:
        ranks.append(tuple(range(first, first + len(spec.devices))))
        first += len(spec.devices)
    return tuple(ranks)


def _owners(plan: Plan, stage: int) -> tuple[int, ...]:
    """The replica of each of a graph stage's micro-batches, in sample order (the stage graph's deal)."""
    by_first = {mb.first: r for r in range(plan.stages[stage].dp)
                for mb in stage_micro_batches(plan, 0, stage, r)}
    return tuple(by_first[k] for k in sorted(by_first))


def node_micro_batches(plan: Plan, layout: PipelineLayout, step: int, dp_index: int) -> dict[int, list[MicroBatch]]:
    """Micro-batches of every node at `step` (node id -> list) as the schedule numbers them: a
    chain's replica `dp_index` runs its own share; a graph stage's list holds every micro-batch
    of the stage in sample order, all its replicas' (`owned_micro_batches` picks a replica's)."""
    if layout.graph_plan:
        out = {}
        for s in range(len(plan.stages)):
            units = sorted((mb for r in range(layout.replicas(s)) for mb in stage_micro_batches(plan, step, s, r)),
                           key=lambda mb: mb.first)
            out[s] = [MicroBatch(i, mb.first, mb.size) for i, mb in enumerate(units)]
        if layout.places:  # a stage's segments run its micro-batches
            return {n: out[s] for n, (s, _) in enumerate(layout.places)}
        return out
    mbs = replica_micro_batches(plan, step, dp_index)
    return {n: mbs for n in range(layout.num_nodes)}


def owned_micro_batches(layout: PipelineLayout, node: int, replica: int, mbs: list[MicroBatch]) -> list[MicroBatch]:
    """The micro-batches of a node's list (`node_micro_batches`) that `replica` runs."""
    if not layout.graph_plan:
        return mbs
    stage = layout.place(node)[0]
    return [mb for mb in mbs if layout.owners[stage][mb.index] == replica]


def step_schedule(plan: Plan, layout: PipelineLayout, mbs: dict[int, list[MicroBatch]], name: str) -> Schedule:
    """The plan's schedule (`plait.schedule`) over the nodes' micro-batches of one step."""
    nodes = tuple(Node(*layout.place(n), tuple(mb.size for mb in mbs[n]),
                       layout.replicas(layout.place(n)[0]) if layout.graph_plan else 1) for n in range(layout.num_nodes))
    graph = PipelineGraph(nodes, layout.edges)
    if layout.graph_plan:
        name = "gpipe" if name == "gpipe" else "graph_1f1b"
    return build(name, graph)


def rank_actions(schedule: Schedule, layout: PipelineLayout, stage: int, replica: int) -> tuple[Action, ...]:
    """The actions one rank runs: its pipeline rank's list, restricted on a graph plan to the
    micro-batches its replica owns (module docstring)."""
    acts = schedule.of(stage)
    if not layout.graph_plan or layout.replicas(stage) == 1:
        return acts
    owner = layout.owners[stage]
    return tuple(a for a in acts if owner[a.micro_batch] == replica)


def peer_rank(plan: Plan, layout: PipelineLayout, replica: int, tensor: int) -> Callable[[int, int, int], int]:
    """(peer stage, chunk, micro-batch) -> the process rank on the other side of a send/recv: a
    chain's peer is the same replica and tensor rank of that stage; a graph stage's, the replica
    that owns the micro-batch."""
    if layout.graph_plan:
        return lambda s, c, mb: layout.rank_of(s, layout.owners[s][mb])
    return lambda s, c, mb: plan.rank(s, replica, tensor)


def split_model(model: nn.Module, plan: Plan, layout: PipelineLayout, spec: Any = None) -> list[Stage]:
    """The model cut into the layout's nodes (index = node id). Where a graph plan's stages cut
    the batch differently, the model spec's samples at two batch sizes find each boundary
    value's batch dimension."""
    if layout.graph_plan:
        from plait.graph.capture import layer_assignment

        path_of = {name: path for path, (name, _) in layer_assignment(model).items()}
        probe = None
        if spec is not None and len({s.micro_batch or plan.micro_batch for s in plan.stages}) > 1:
            probe = [make_samples(spec, 0, n, 0)[0] for n in (1, 2)]
        if layout.places:  # stages that run per input: a node per segment
            node_layers = [[path_of.get(n, n) for n in seg] for s in plan.stages for seg in s.segment_layers()]
            return split_into_graph(model, node_layers, [tuple(e) for e in plan.stage_edges], probe,
                                    node_stage=[s for s, _ in layout.places])
        node_layers = [[path_of.get(n, n) for n in s.layers] for s in plan.stages]
        return split_into_graph(model, node_layers, layout.edges, probe)
    if layout.num_nodes == 1:
        return split_into_stages(model, [0])
    probe = None
    if spec is not None and mixed_micro_batches(plan):  # the boundary values' batch dims (torch's buffers)
        probe = [make_samples(spec, 0, n, 0)[0] for n in (1, 2)]
    return split_into_stages(model, plan.layers_per_stage, probe)


def mixed_micro_batches(plan: Plan) -> bool:
    """Whether a chain's replica runs micro-batches of more than one size: uneven shares that the
    micro-batch does not divide, or at ZeRO-3 a replica's ghost micro-batches of one sample up to the
    most another replica runs (`torch_worker._with_ghosts`)."""
    replicas = [replica_micro_batches(plan, 0, d) for d in range(plan.dp)]
    if plan.zero >= 3 and len({len(mbs) for mbs in replicas}) > 1:
        return True
    return any(len({mb.size for mb in mbs}) > 1 for mbs in replicas)


def with_node_edges(layout: PipelineLayout, stages: list[Stage]) -> PipelineLayout:
    """`layout` with the edges between segments that `split_model` found (`Stage.send`); other
    layouts unchanged."""
    if not layout.places:
        return layout
    return dataclasses.replace(layout, edges=tuple(sorted((st.index, b) for st in stages for b in st.send)))


def merge_modules(modules: list[nn.Module]) -> nn.Module:
    """One module that holds the parameters and buffers of several chunk modules under their
    original names (the same objects): for the optimizer, checkpoints and returned parameters."""
    if len(modules) == 1:
        return modules[0]
    root = nn.Module()
    for m in modules:
        _merge(root, m)
    return root


def _merge(dst: nn.Module, src: nn.Module) -> None:
    for name, prm in src._parameters.items():
        if prm is not None and name not in dst._parameters:
            dst.register_parameter(name, prm)
    for name, buf in src._buffers.items():
        if buf is not None and name not in dst._buffers:
            dst.register_buffer(name, buf)
    for name, child in src._modules.items():
        if child is None:
            continue
        if name not in dst._modules:
            dst._modules[name] = nn.Module()  # a fresh container: the chunks' own stay untouched
        _merge(dst._modules[name], child)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------- supports
#: The engines a plan can run on, by the plan's form (`plait.runtime.entry.make_worker` builds them).
ENGINES: dict[str, str] = {
    "compose": "plait.runtime.compose_worker (pipeline stages that each run an SPMD program)",
    "spmd": "plait.runtime.spmd_worker (one op-level SPMD program)",
    "pipeline": "plait.runtime.worker (a 3D grid or a stage graph: plait's own executors)",
    "torch": "plait.runtime.torch_worker (data parallelism and ZeRO on torch's DDP and FSDP2, tensor "
             "and sequence parallelism on DTensor, alone or under data parallelism -- FSDP2 at ZeRO-1/2/3, torch's "
             "FSDP2-based replicate at ZeRO-0 --, chain pipelines on torch.distributed.pipelining with DDP or "
             "FSDP2 over each stage's replicas, DTensor inside each stage -- under FSDP2 or replicate over its "
             "replicas with dp > 1)",
}


@dataclass(frozen=True)
class EngineVerdict:
    """Which engine runs a plan, or why none can."""

    engine: str | None  # a key of ENGINES; None when no engine can run the plan
    reason: str  # "" when an engine runs it, else why not, naming the plan field
    not_torch: str = ""  # why torch's modules do not run it (yet), when an engine of plait's runs it

    @property
    def ok(self) -> bool:
        return self.engine is not None


@dataclass(frozen=True)
class _RunAsks:
    """What a run config says that picks the engine."""

    engine: str = "auto"  # LaunchConfig.engine
    checkpoints: bool = False
    model: str | None = None  # the model spec string; None: not known (its cut is not checked)

    @classmethod
    def of(cls, run: WorkerConfig | Mapping[str, Any] | None) -> _RunAsks:
        if run is None:
            return cls()
        if isinstance(run, Mapping):  # the same keys, by hand (tests, bench/gpu_check.py)
            return cls(run.get("engine") or "auto", bool(run.get("checkpoint")), run.get("model"))
        return cls(run.engine, run.checkpoint is not None, run.model)


def engine_for(plan: PlanSource, run: WorkerConfig | Mapping[str, Any] | None = None) -> EngineVerdict:
    """The engine that runs `plan` (by its form: composed stages, one SPMD program, or a 3D grid /
    stage graph), or why none can, naming the field. The one place that decides both: the worker
    entry builds this engine, and `api.run` refuses a plan without one before any process starts.

    A plan torch's modules run (`torch_runs`) goes to the torch engine, else to plait's own; `run`
    is the run's worker config (`api.run` writes it; or a dict of its `engine`, `dtype` and
    `checkpoint`), whose engine, training dtype and checkpoints count too (without it: the plan's
    dtype, no checkpoints)."""
    plan = Plan.load(plan)
    if any(spec.spmd is not None for spec in plan.stages):
        ok, why = _supports_composed(plan)
        return EngineVerdict("compose" if ok else None, why, "a composed plan runs on plait's own engine")
    engine = "spmd" if plan.spmd is not None else "pipeline"
    ok, why = _supports_pipeline(plan)
    if not ok:
        return EngineVerdict(None, why, why)
    not_torch = torch_runs(plan, _RunAsks.of(run))
    if not_torch and (why := _torch_only(plan)):  # plait's own engine does not run it either
        return EngineVerdict(None, f"{why}; the torch engine does not run it here: {not_torch}", not_torch)
    return EngineVerdict("torch" if not not_torch else engine, "", not_torch)


def _torch_only(plan: Plan) -> str:
    """Why plait's own engine (`plait.runtime.worker`) does not run a plan that the torch engine
    runs when `torch_runs` lets it; "" when plait's own engine runs it."""
    if plan.zero >= 3 and plan.pp > 1 and not plan.stages:
        # As DeepSpeed: plait's own executors gather no parameters per layer and micro-batch inside a
        # pipeline schedule; torch's FSDP2 does (`torch_worker._build_pipeline`).
        return (f"plan field 'zero': zero={plan.zero} (parameters sharded) with pp={plan.pp} runs on the torch "
                "engine only (FSDP2 on torch's pipelining), not on plait's own")
    return ""


def torch_runs(plan: Plan, run: _RunAsks) -> str:
    """"" when the torch engine (`plait.runtime.torch_worker`: DDP, FSDP2, DTensor, pipelining) runs
    `plan` under what the run asks, else why not (the plan then runs on plait's own engine)."""
    if run.engine == "plait":
        return "the run asks for plait's own engine (engine=plait)"
    if plan.spmd is not None or plan.stages:
        return "an SPMD program or a stage graph runs on plait's own engines"
    # every chain pipeline runs on torch's pipelining (`parallelize.apply_pp`): at ZeRO-1/2 FSDP2's units
    # over each stage's replicas gather and reduce-scatter once a step whatever a replica's micro-batch
    # count; at ZeRO-3 every micro-batch does, so a replica with fewer runs ghost ones (one sample, loss
    # weight 0) through its pipeline up to the most any replica runs (`torch_worker._with_ghosts`, as
    # the non-pipeline path and plait's own ZeRO-3); tp > 1 runs DTensor inside each stage, with dp > 1
    # under FSDP2 or, at ZeRO-0, torch's replicate (DDP takes no DTensor parameters): the 3D grid
    if plan.tp != 1 and (why := _torch_tensor_parallel_runs(plan) or (
            run.model and _dtensor_cut(run.model, plan.tp, plan.sequence_parallel))):
        return why
    if any(n == 0 for n in plan.samples_per_replica()):
        return "a replica with no samples cannot join DDP's or FSDP2's collectives"
    return ""


def _torch_tensor_parallel_runs(plan: Plan) -> str:
    """"" when DTensor's tensor parallelism (`parallelize.apply_tp`, its collectives recorded through
    `recorded_pg`) runs the tp > 1 plan `plan`, else why not."""
    if plan.tp_ratios and len(set(plan.tp_ratios)) > 1:
        return (f"uneven tensor shards (tp_ratios={plan.tp_ratios}) run on plait's own engine: DTensor shards "
                "every dimension evenly")
    # dp > 1 (no pipeline): FSDP2 over the DTensor-TP model at ZeRO-1/2/3 (2D parameters), torch's
    # FSDP2-based `replicate` at ZeRO-0 (DDP fails on DTensor parameters): `torch_worker._build`
    return ""


@functools.lru_cache(maxsize=16)
def _dtensor_cut(model: str, tp: int, sequence_parallel: bool = False) -> str:
    """"" when DTensor's colwise / rowwise styles (`parallelize.apply_tp`) cut `model`'s transformer
    layers as plait's own engine does at `tp`, else why not. They shard `nn.Linear` weights evenly and
    change nothing else, so a layer must hold no other cut module with parameters of its own (experts,
    Conv1D, a relative-position bias cut by heads), and no head count or head width stored as an
    attribute (plait's engine sets those to this rank's, `tensor_parallel._localize_heads`; DTensor
    would leave a module reshaping by the whole model's heads). With `sequence_parallel` the layer's
    cut must also be one torch's styles express (`_sequence_parallel_cut`)."""
    import torch

    from plait.runtime.tensor_parallel import (
        HEAD_ATTRS,
        KV_HEAD_ATTRS,
        WIDTH_ATTRS,
        is_tensor_parallel_layer,
    )

    try:
        spec = load_model_spec(model)
        try:
            built = spec.build(device="meta", dtype=torch.float32, seed=0)
        except TypeError:
            built = spec.build(device="meta", dtype=torch.float32)
    except Exception as exc:  # noqa: BLE001 -- any failure: plait's own engine runs it (and says what is wrong)
        return f"model {model}: its tensor-parallel cut was not read on the meta device ({type(exc).__name__})"
    for name, layer in layer_modules(built):
        if not is_tensor_parallel_layer(layer):
            continue
        for sub, m in layer.named_modules():
            where = ".".join(x for x in (name, sub) if x)
            kind = getattr(m, "plait_tp", None)
            if kind in ("column", "row") and not isinstance(m, nn.Linear):
                return (f"model {model}: {where} ({type(m).__name__}, cut {kind}) is not an nn.Linear, which "
                        "DTensor's colwise / rowwise styles cut; plait's own engine runs it")
            if kind not in (None, "column", "row") and any(True for _ in m.parameters(recurse=False)):
                return (f"model {model}: {where} (cut {kind!r}) holds parameters DTensor's colwise / rowwise "
                        "styles do not cut; plait's own engine runs it")
            attrs = [a for a in (*HEAD_ATTRS, *KV_HEAD_ATTRS, *WIDTH_ATTRS) if isinstance(getattr(m, a, None), int)]
            if attrs:
                return (f"model {model}: {where} keeps its head count or width as attributes ({', '.join(attrs)}), "
                        "which plait's own engine sets to each rank's heads and DTensor does not; it runs there")
            head_dim = getattr(m, "head_dim", None)
            if kind == "sharded" and isinstance(head_dim, int) and head_dim > 0:
                parent = sub.rsplit(".", 1)[0] if "." in sub else ""
                rows = [r for n, r in layer.named_modules() if getattr(r, "plait_tp", None) == "row"
                        and (n.rsplit(".", 1)[0] if "." in n else "") == parent and isinstance(r, nn.Linear)]
                if rows and (rows[0].in_features // head_dim) % tp:
                    return (f"model {model}: {where} has {rows[0].in_features // head_dim} heads, not divisible by "
                            f"tp={tp} (DTensor would cut a head)")
        if sequence_parallel and (why := _sequence_parallel_cut(layer)):
            return f"model {model}: {name}: {why}"
    return ""


def _sequence_parallel_cut(layer: nn.Module) -> str:
    """"" when torch's styles run Megatron's sequence parallelism on the tensor-parallel `layer` as
    `parallelize.apply_tp` places them, else why not (the plan field named: plait's own engine runs
    it). Each column linear reads its input inside a submodule of the layer called with that one
    input (`PrepareModuleInput` all-gathers it: the zoo's `attn`, `mlp`); every row linear is inside
    such a region (its output reduce-scattered back to the sequence shard); every other module with
    parameters outside the regions is a layer norm (`SequenceParallel` runs nn.LayerNorm / nn.RMSNorm
    on the shard); the layer and the regions take one positional input (the hidden states)."""
    import inspect

    from plait.runtime.parallelize import sequence_parallel_norms, sequence_parallel_regions

    regions = sequence_parallel_regions(layer)
    why = "plan field 'sequence_parallel': DTensor's sequence parallelism"
    if "" in regions:
        return f"{why} all-gathers a column linear's input in a submodule of the layer; one is the layer's own"
    inside = tuple(f"{r}." for r in regions)
    for sub, m in layer.named_modules():
        if getattr(m, "plait_tp", None) == "row" and not sub.startswith(inside):
            return f"{why} reduce-scatters row linears inside the column linears' regions ({regions}); {sub} is not"
    for sub in sequence_parallel_norms(layer, regions):
        m = layer.get_submodule(sub)
        if not isinstance(m, nn.LayerNorm | nn.RMSNorm):
            return (f"{why} runs layer norms on a sequence shard between the regions {regions}; {sub} "
                    f"({type(m).__name__}) holds parameters there")
    for sub in ["", *regions]:
        m = layer.get_submodule(sub) if sub else layer
        params = [p for p in inspect.signature(m.forward).parameters.values()
                  if p.default is inspect.Parameter.empty
                  and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
        if len(params) != 1 or params[0].kind is inspect.Parameter.VAR_POSITIONAL:
            return (f"{why} cuts one input along the sequence; {sub or 'the layer'} "
                    f"({type(m).__name__}.forward) takes {[p.name for p in params]}")
    return ""


def supports(plan: PlanSource) -> tuple[bool, str]:
    """(True, "") when the runtime can run `plan`, else (False, the reason naming the field)."""
    verdict = engine_for(plan)
    return verdict.ok, verdict.reason


def _supports_pipeline(plan: Plan) -> tuple[bool, str]:
    """What `plait.runtime.worker` (and, for `Plan.spmd`, the SPMD worker) runs."""
    if plan.schedule == "eager_1f1b":
        return False, ("plan field 'schedule': 'eager_1f1b' runs on composed plans (stages with SPMD programs) "
                       "only; use '1f1b'")
    if plan.stages:
        for i, spec in enumerate(plan.stages):
            if spec.tp != 1:
                # Tensor parallelism inside a graph stage would need per-stage tensor groups and the
                # executor's sends per tensor rank; the graph planners give tp=1 stages.
                return False, (f"plan field 'stages[{i}].tp': the runtime runs a stage graph's stages "
                               f"data-parallel only (tp=1), stage {spec.name!r} has tp={spec.tp}")
            if len(spec.devices) != spec.dp:
                return False, (f"plan field 'stages[{i}].devices': stage {spec.name!r} has dp={spec.dp} "
                               f"but {len(spec.devices)} devices (one per replica)")
        devices = [d for spec in plan.stages for d in spec.devices]
        if len(set(devices)) != len(devices):
            return False, "plan field 'stages': two stages share a device; the runtime runs one stage per rank"
        if plan.schedule == "interleaved":
            return False, "plan field 'schedule': a stage graph runs 'gpipe' or '1f1b' (graph 1F1B), not interleaved"
        try:
            PipelineGraph.dag([[1]] * len(plan.stages), list(plan.stage_edges))
        except ScheduleError as exc:
            return False, str(exc).replace("pipeline graph field 'edges'", "plan field 'stage_edges'")
        sources = {a for a, _ in plan.stage_edges}
        sinks = [s for s in range(len(plan.stages)) if s not in sources]
        if len(sinks) != 1:
            return False, (f"plan field 'stage_edges': the runtime needs one sink stage (it computes the loss), "
                           f"the graph has {len(sinks)}")
    if plan.zero >= 3 and plan.stages:
        # As DeepSpeed: plait's own executors gather no parameters per layer and micro-batch inside a
        # pipeline schedule; a chain pipeline's ZeRO-3 runs on the torch engine (`_torch_only`).
        return False, (f"plan field 'zero': zero={plan.zero} (parameters sharded) runs with a stage graph's "
                       "stages on no engine; use zero=1 or zero=2 with a stage graph, or a chain pipeline (pp)")
    if plan.schedule == "interleaved" and plan.virtual_stages > 1:
        for d, n in enumerate(plan.samples_per_replica()):
            m = -(-n // plan.micro_batch) if n else 0
            if m % plan.pp:
                return False, (f"plan field 'dp_shares': replica {d} runs {m} micro-batches, not a multiple of "
                               f"pp={plan.pp} (interleaved 1F1B runs them in groups of pp)")
    return True, ""


def _supports_composed(plan: Plan) -> tuple[bool, str]:
    """What `plait.runtime.compose_worker` runs: a chain of stages, each an SPMD program on its
    own devices, every micro-batch of the plan's size, without ZeRO, in any dtype (fp32 masters,
    ops autocast to bf16 / fp16)."""
    for i, spec in enumerate(plan.stages):
        if spec.spmd is None:
            return False, (f"plan field 'stages[{i}].program': stage {spec.name!r} has no SPMD program; a composed "
                           "plan runs every stage as one (give it a one-device program)")
        if spec.micro_batch not in (None, plan.micro_batch):
            return False, (f"plan field 'stages[{i}].micro_batch': a composed plan's stages run the plan's "
                           f"micro-batch ({plan.micro_batch}), stage {spec.name!r} asks for {spec.micro_batch}")
    devices = [d for spec in plan.stages for d in spec.devices]
    if len(set(devices)) != len(devices):
        return False, "plan field 'stages': two stages share a device; the runtime runs one stage per rank"
    n = len(plan.stages)
    if sorted(tuple(e) for e in plan.stage_edges) != [(s, s + 1) for s in range(n - 1)]:
        return False, (f"plan field 'stage_edges': a composed plan runs a chain of stages (0 -> 1 -> ... -> "
                       f"{n - 1}), the plan has {list(plan.stage_edges)}")
    if plan.schedule not in ("1f1b", "eager_1f1b", "gpipe"):
        return False, (f"plan field 'schedule': a composed plan runs '1f1b', 'eager_1f1b' or 'gpipe', "
                       f"not {plan.schedule!r}")
    if plan.global_batch % plan.micro_batch:
        return False, (f"plan field 'micro_batch': {plan.micro_batch} does not divide global_batch "
                       f"{plan.global_batch} (a composed plan's micro-batches are all of one size)")
    if plan.zero:
        return False, f"plan field 'zero': a composed plan's stage programs hold their own shards (zero=0), not {plan.zero}"
    return True, ""


