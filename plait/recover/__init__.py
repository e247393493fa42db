"""The recovery driver: after the doctor isolates ranks or nodes, stop the job, drop those devices
from the cluster, plan again for the cluster that is left, reshard the last complete checkpoint
onto the new plan and continue. Sits beside the search driver, above the planners and runtime.

    from plait.recover import RecoveryConfig, recover
    result = recover(model, "emulated-mixed", "dp=4,micro_batch=2,global_batch=16,dtype=fp32", steps=20,
                     run_dir="runs/r1", config=RecoveryConfig(checkpoint_every=2))
"""

from plait.recover.detect import default_detect, launcher_diagnosis
from plait.recover.isolate import (
    Isolation,
    RecoveryError,
    link_end,
    nodes_to_isolate,
    remaining_cluster,
)
from plait.recover.loop import (
    REJOIN_FILE,
    Phase,
    RecoveryConfig,
    RecoveryResult,
    Transition,
    predict_step,
    recover,
    replan,
)

__all__ = ["REJOIN_FILE", "Isolation", "Phase", "RecoveryConfig", "RecoveryError", "RecoveryResult",
           "Transition", "default_detect", "launcher_diagnosis", "link_end", "nodes_to_isolate",
           "predict_step", "recover", "remaining_cluster", "replan"]
