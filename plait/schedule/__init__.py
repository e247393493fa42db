"""Pipeline schedules as data: per-rank ordered action lists (see `plait.schedule.core`).

Imports only `plait.errors` and the standard library, so the planner, the simulator and the
runtime can all read the same schedules: the simulator lowers them into tasks, the runtime's
executor (`plait.runtime.executor`) runs them, `plait.schedule.check.execute` proves them
deadlock-free, and `in_flight` reads off them the micro-batches each rank holds activations for (what
a composed plan's memory counts, `plait.cost.memory.composed_peak_memory`).
"""

from plait.schedule.builders import (
           SCHEDULES,
           build,
           chain_in_flight,
           gpipe,
           graph_1f1b,
           graph_in_flight,
           interleaved_1f1b,
           one_f_one_b,
)
from plait.schedule.check import execute
from plait.schedule.core import (
           Action,
           Node,
           PipelineGraph,
           Schedule,
           ScheduleError,
           event_key,
           in_flight,
)

__all__ = ["SCHEDULES", "Action", "Node", "PipelineGraph", "Schedule", "ScheduleError", "build", "chain_in_flight",
           "event_key", "execute", "gpipe", "graph_1f1b", "graph_in_flight", "in_flight", "interleaved_1f1b", "one_f_one_b"]
