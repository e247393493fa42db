"""The neutral IR: the data types every other package shares, and nothing else.

* `plait.ir.opgraph`  -- the model as a DAG of ops grouped into layers (`OpGraph`, `Layer`, `Op`);
* `plait.ir.plan`     -- `Plan` (how one iteration is cut up and placed) and `StageSpec`;
* `plait.ir.stage_graph` -- the one stage graph derived from a Plan and an OpGraph: stages, device
                        groups, per-replica batch shares (one rounding rule), per-edge tensors;
* `plait.ir.formats`  -- `format_version` of every file plait writes, and the rule for reading it;
* `plait.ir.timeline` -- `Timeline` / `TimelineEvent`, written by the simulator *and* the runtime;
* `plait.ir.comm`     -- `CommRecord`, one line per collective or p2p call of a rank (JSON Lines);
* `plait.ir.diagnosis` -- `Finding` / `Diagnosis`: what the doctor found in a run.

This package sits at the bottom of the import order (see docs/DESIGN.md): it imports only
`plait.errors`, the standard library, numpy and networkx -- never a planner, the simulator or
the runtime -- so every layer above can read the same types. Each file format it defines
carries a `format_version`; an older one is migrated, a newer one refused with a clear message.
"""
