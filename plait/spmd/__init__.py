"""Heterogeneous SPMD synthesis (HAP, Zhang et al. EuroSys'24): per-op sharding with uneven ratios.

* `plait.spmd.placement` -- how a tensor lives on the devices (R, S<d>, P), the collectives that
  convert between placements, integer shard sizes from ratios;
* `plait.spmd.rules`     -- sharding rules as data: each aten op kind's strategies;
* `plait.spmd.cost`      -- compute and communication time of a strategy on a cluster;
* `plait.spmd.search`    -- best-first (A*) search over placements for the cheapest program;
* `plait.spmd.ratios`    -- the ratio LP with per-device memory, alternated with the search.

A planner (row "plan" of docs/DESIGN.md): it reads the ir, graph, cluster and cost packages.
"""
