"""Pipeline schedules as data: per-rank ordered action lists (see `plait.schedule.core`).

Imports only `plait.errors` and the standard library, so the planner, the simulator and the
runtime can all read the same schedules: the simulator lowers them into tasks, the runtime's
executor (`plait.runtime.executor`) runs them, `plait.schedule.check.execute` proves them
deadlock-free.
"""

from plait.schedule.builders import (
           SCHEDULES,
           build,
           gpipe,
           graph_1f1b,
           interleaved_1f1b,
           one_f_one_b,
)
from plait.schedule.check import execute
from plait.schedule.core import Action, Node, PipelineGraph, Schedule, ScheduleError, event_key

__all__ = ["SCHEDULES", "Action", "Node", "PipelineGraph", "Schedule", "ScheduleError", "build", "event_key",
           "execute", "gpipe", "graph_1f1b", "interleaved_1f1b", "one_f_one_b"]
