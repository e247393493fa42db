"""Heterogeneous SPMD synthesis (HAP, Zhang et al. EuroSys'24): per-op sharding with uneven ratios.

* `plait.spmd.search`    -- best-first (A*) search over placements for the cheapest program;
* `plait.spmd.ratios`    -- the ratio LP with per-device memory, alternated with the search;
* `plait.spmd.mesh`      -- hierarchical programs (the flat synthesis in each node, data
  parallel across nodes);
* `plait.spmd.program_plan` -- a synthesized program as a `Plan`.

What the planner stands on lives below it, shared with the simulator and the runtime: the
program's types (placements R / S<d> / P, collectives, strategies) in `plait.ir.program`, the
sharding rules per aten op kind in `plait.graph.sharding`, the prices of a program's pieces in
`plait.cost.spmd` and its replay (`Problem`, `evaluate`, segments) in `plait.cost.program`, its
memory in `plait.cost.memory.memory_model`.

A planner (row "plan" of docs/DESIGN.md): it reads the ir, graph, cluster and cost packages.
"""
