"""The heterogeneous-SPMD family for the search driver: one HAP-style program over every device.

`search_spmd` captures the model at the global batch (aten level, meta device), synthesizes a
program with uneven per-device ratios (`plait.spmd.ratios.synthesize`: A* program search and the
ratio LP with memory, alternated), and has it timed by the one simulator
(the `Simulator`'s `spmd`: the program lowered op by op onto the cluster's links), so its
candidate competes with 3D and graph plans on the same scale. The result is the 3D family's
`PlanResult`; its plan carries the program (`Plan.spmd`), which `plait run --plan` runs.

Synthesis handles one flat device group: the family declines clusters larger than
`max_devices` (64 by default, HAP's testbed) with the reason rather than search for minutes.
It lives beside the driver because it joins a planner (`plait.spmd`) and the simulator it is handed.

`synthesize_program` is plait's program for a problem -- the one definition `search_spmd`,
`plait plan --family spmd` and `bench/hap.py` share: the synthesis at each weight of the
parameter-gradient collectives (`plait.spmd.ratios.synthesize_overlapped`), then the same
program with its whole parameters stored in even shards (`synthesize_stored`, ZeRO-3), the
simulator keeping whichever runs faster and fits.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from plait.cluster.spec import Cluster
from plait.planners.types import (
    Candidate,
    PlanResult,
    SearchError,
    Simulator,
    auto_dtype,
)

if TYPE_CHECKING:
    from plait.graph.resolve import ModelSource
    from plait.planners.options import SearchOptions, SpmdOptions

OVERLAP_WEIGHTS = (1.0, 0.0)  # gradient collectives counted in full / as hidden; the simulator picks


def synthesize_program(problem: Any, simulator: Simulator | None, *, batch: int, dtype: str,
                       optimizer: str = "adam", max_states: int = 20_000) -> tuple[Any, float | None, str]:
    """plait's flat SPMD program for `problem` (`plait.cost.program.Problem`) on the cluster.

    With a `simulator` (the cluster's): `synthesize_overlapped` at `OVERLAP_WEIGHTS`, each
    candidate timed by `simulator.spmd`, then the winner with its parameters stored sharded
    (`synthesize_stored`) kept if the simulator ranks it faster (or only it fits). Without: the
    plain synthesis, ranked by its own cost. Returns (synthesis, simulated seconds or None, form:
    "flat" or "flat+zero"). `seconds` and `expanded` of the synthesis count every candidate's."""
    from plait.spmd.ratios import synthesize, synthesize_overlapped, synthesize_stored

    if simulator is None:
        syn = synthesize(problem, dtype=dtype, optimizer=optimizer, max_states=max_states)
        return syn, None, "flat"

    def timed(p: Any, s: Any) -> float:
        return simulator.spmd(p, s, batch=batch).iteration_time_s if s.fits else float("inf")

    start = time.process_time()
    syn = synthesize_overlapped(problem, timed, OVERLAP_WEIGHTS, dtype=dtype, optimizer=optimizer,
                                max_states=max_states)
    best, form = timed(problem, syn), "flat"
    stored = synthesize_stored(problem, syn, dtype=dtype, optimizer=optimizer)
    if stored is not None and stored.fits:
        t = timed(problem, stored)
        if t < best or not syn.fits:
            syn, best, form = stored, t, "flat+zero"
    syn.seconds = time.process_time() - start
    return syn, (best if syn.fits else None), form


def search_spmd(model: ModelSource | None, cluster: Cluster, common: SearchOptions, simulator: Simulator | None,
                options: SpmdOptions) -> PlanResult:
    """The synthesized SPMD program of `model` on `cluster` as a one-candidate `PlanResult`.

    `common.dtype`: the program's compute dtype (default: the cluster's, as the 3D family picks it;
    the runtime runs every dtype, so `options.runnable` keeps it). Without a `simulator` the
    synthesis's own cost ranks."""
    from plait.cost.devices import DeviceModel
    from plait.cost.program import Problem
    from plait.cost.spmd import Devices
    from plait.graph.aten_stage import free_outputs
    from plait.graph.zoo import load_model
    from plait.planners.types import DEFAULT_GLOBAL_BATCH, DEFAULT_MODEL
    from plait.spmd.program_plan import (
        capture_graph,
        dtype_changes_graph,
        plan_collectives,
        program_plan,
    )

    t0 = time.perf_counter()
    n, max_devices, runnable = cluster.num_devices, options.max_devices, options.runnable
    if n > max_devices:
        raise SearchError(f"spmd: one flat program over {n} devices is not searched (max_devices="
                          f"{max_devices}); the SPMD family plans clusters of up to {max_devices} GPUs")
    from plait.graph.zoo import ModelSpec

    if not (model is None or isinstance(model, str) or (isinstance(model, ModelSpec) and model.spec)):
        raise SearchError("spmd: the family captures a zoo spec or file.py:factory (the ModelSpec of one), "
                          "not a prepared graph")
    gb = DEFAULT_GLOBAL_BATCH if common.global_batch is None else int(common.global_batch)
    if gb < n:
        raise SearchError(f"spmd: global batch {gb} is smaller than the {n} devices a program shards it over")
    dtype = common.dtype or auto_dtype(cluster)
    spec = load_model(DEFAULT_MODEL if model is None else model)
    graph = capture_graph(spec, gb, dtype)  # at the program's dtype: its messages are priced at it
    if runnable and (why := dtype_changes_graph(spec, gb, dtype, graph)):
        raise SearchError(f"spmd: {why}")
    from plait.cost.spmd import cluster_model_profile

    # the simulator's view is the search's one device model of the cluster (built once above it)
    devices = simulator.view if simulator is not None else DeviceModel.of_cluster(cluster)
    problem = Problem.build(graph, Devices.of(devices, dtype), outputs_free=free_outputs(graph, loss=True),
                            profile=cluster_model_profile(cluster, spec, dtype))  # measured op times where it has them
    syn, _, _ = synthesize_program(problem, simulator, batch=gb, dtype=dtype, max_states=options.max_states)
    ratios = syn.segment_ratios if syn.segment_ratios is not None else syn.ratios
    plan = program_plan(syn.program.strategies, ratios, gb, model=spec.spec, predicted_s=syn.cost, dtype=dtype,
                        collectives=plan_collectives(syn.program.comms, problem.devices, ratios),
                        homes=syn.program.homes)
    reasons: dict[str, int] = {}
    if common.supports is not None and runnable:
        ok, why = common.supports(plan)
        if not ok:
            raise SearchError(f"spmd: the runtime cannot run the synthesized program ({why})")
    cand = Candidate(plan=plan, analytic_s=float(syn.cost), family="spmd")
    if simulator is not None:
        sim = simulator.spmd(problem, syn, batch=gb, name=spec.spec)
        cand.iteration_time_s = sim.iteration_time_s
        cand.throughput = sim.throughput_samples_per_s
        cand.tflops_per_gpu = sim.tflops_per_gpu
        cand.sim = sim.to_dict()
        if sim.memory_peak_bytes:
            cand.peak_bytes = [int(x) for x in sim.memory_peak_bytes]
    else:
        cand.throughput = gb / float(syn.cost)
    if not cand.peak_bytes:
        cand.peak_bytes = [int(x) for x in syn.memory]
    if cand.peak_bytes:
        free: dict[str, int] = {}
        for d, peak in zip(cluster.devices, cand.peak_bytes):  # a program uses every device
            free[d.kind.name] = min(free.get(d.kind.name, d.kind.memory_bytes), d.kind.memory_bytes - peak)
        cand.headroom_by_kind = free
    return PlanResult(model=spec.spec, cluster=cluster.name, global_batch=gb, world_size=n, top=[cand][:common.top],
                      enumerated=1, pruned=0, pruned_reasons=reasons, memory_checked=1, ranked_analytic=1,
                      simulated=1 if simulator is not None else 0, search_time_s=time.perf_counter() - t0,
                      ranker="simulator" if simulator is not None else "analytic", family="spmd",
                      extra={"states_expanded": syn.expanded, "fits": syn.fits})
