"""The recovery driver: after the doctor isolates ranks or nodes, stop the job, drop those devices
from the cluster, plan again for the cluster that is left, reshard the last complete checkpoint
onto the new plan and continue. Sits beside the search driver, above the planners and runtime."""
