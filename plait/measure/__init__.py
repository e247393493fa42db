"""Measurement of real things, in one place: what the models are checked against.

* `layer_profile`    -- each layer's forward/backward and the optimizer step, timed on a device;
* `step_memory`      -- the peak memory of a real training step (PyTorch's MemTracker);
* `cluster_profile`  -- a live (or emulated) cluster's links, collectives and matmul speed,
                        written as a cluster YAML (`plait profile`);
* `machine_profiler` -- the persistent per-rank profiler process `machine` drives;
* `machine`          -- `LocalMachine`: predicts plans for *this* machine from the above.

It sits above the simulator and the runtime (it runs the one and feeds the other) and below
the search driver and the commands (docs/DESIGN.md).
"""
