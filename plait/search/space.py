"""`plait plan --space SPEC`: restrict the 3D search to the degrees, micro-batches and options a
user allows, as other planners' search-space flags do (Alpa's and Aceso's degree lists, Metis'
and Galvatron's option switches).

    --space "tp=1,2 pp=1,2,4 mb=1,2"            # fields separated by spaces or ';'
    --space "dp=8,16;recompute=none,selective;zero=0,1;schedule=1f1b,interleaved;sp=off"

Fields (each a comma list; a field not given leaves every valid value):

  dp, tp, pp    data-, tensor- and pipeline-parallel degrees (positive integers)
  mb            micro-batch sizes (positive integers)
  recompute     none, selective, full
  zero          0, 1, 2, 3
  schedule      1f1b, gpipe, interleaved
  sp            on, off (Megatron sequence parallelism inside tensor groups)
  layouts       on, off (on mixed clusters: try GPU kinds along pp and along dp)
  hetero        on, off (on mixed clusters: uneven layer and batch splits)

A bad field or value is a `SpaceError` naming the field and the values allowed.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from plait.errors import PlaitError
from plait.ir.plan import RECOMPUTE_CHOICES, Plan
from plait.planners.threed import SearchSpace

SCHEDULES = ("1f1b", "gpipe", "interleaved")
ZERO_LEVELS = (0, 1, 2, 3)
_SWITCH = {"on": True, "off": False, "true": True, "false": False, "1": True, "0": False}
FIELDS = ("dp", "tp", "pp", "mb", "recompute", "zero", "schedule", "sp", "layouts", "hetero")


class SpaceError(PlaitError, ValueError):
    """A --space specification that cannot be read."""


def _ints(name: str, values: list[str]) -> list[int]:
    out = []
    for v in values:
        if not re.fullmatch(r"[0-9]+", v) or int(v) < 1:
            raise SpaceError(f"--space field '{name}': {v!r} is not a positive integer")
        out.append(int(v))
    return sorted(set(out))


def _choices(name: str, values: list[str], allowed: tuple) -> tuple:
    text = [str(a) for a in allowed]
    bad = [v for v in values if v not in text]
    if bad:
        raise SpaceError(f"--space field '{name}': {bad[0]!r} is not one of {', '.join(text)}")
    return tuple(a for a in allowed if str(a) in values)


def _switch(name: str, values: list[str]) -> tuple[bool, ...]:
    bad = [v for v in values if v.lower() not in _SWITCH]
    if bad:
        raise SpaceError(f"--space field '{name}': {bad[0]!r} is not on or off")
    return tuple(sorted({_SWITCH[v.lower()] for v in values}))


def parse_space(text: str) -> SearchSpace:
    """The `SearchSpace` a --space specification allows (module docstring)."""
    space = SearchSpace()
    seen: set[str] = set()
    dps: list[int] | None = None
    for item in (t for t in re.split(r"[\s;]+", text.strip()) if t):
        name, sep, rest = item.partition("=")
        name = name.strip().lower()
        if not sep or not name:
            raise SpaceError(f"--space: {item!r} is not FIELD=V1,V2,... (fields: {', '.join(FIELDS)})")
        if name not in FIELDS:
            raise SpaceError(f"--space: unknown field {name!r} (fields: {', '.join(FIELDS)})")
        if name in seen:
            raise SpaceError(f"--space field '{name}': given twice")
        seen.add(name)
        values = [v.strip().lower() for v in rest.split(",") if v.strip()]
        if not values:
            raise SpaceError(f"--space field '{name}': no values")
        if name in ("tp", "pp", "mb"):
            grid: dict[str, Any] = {"micro_batch" if name == "mb" else name: _ints(name, values)}
            space = dataclasses.replace(space, **grid)
        elif name == "dp":
            dps = _ints(name, values)
        elif name == "recompute":
            space = dataclasses.replace(space, recompute=_choices(name, values, RECOMPUTE_CHOICES))
        elif name == "zero":
            space = dataclasses.replace(space, zero=tuple(int(z) for z in _choices(name, values, ZERO_LEVELS)))
        elif name == "schedule":
            space = dataclasses.replace(space, schedules=_choices(name, values, SCHEDULES))
        elif name == "sp":
            space = dataclasses.replace(space, sequence_parallel=_switch(name, values))
        else:  # layouts, hetero: one switch each
            on = _switch(name, values)
            if len(on) != 1:
                raise SpaceError(f"--space field '{name}': give on or off, not both")
            switch: dict[str, Any] = {name: on[0]}
            space = dataclasses.replace(space, **switch)
    if dps is not None:
        allowed = frozenset(dps)

        def allow(plan: Plan) -> bool:
            return plan.dp in allowed

        allow.__doc__ = f"dp={dps}"
        space = dataclasses.replace(space, allow=allow)
    return space


def describe(space: SearchSpace) -> str:
    """What a space restricts, for the command's output."""
    parts = []
    default = SearchSpace()
    for f, label in (("tp", "tp"), ("pp", "pp"), ("micro_batch", "mb"), ("recompute", "recompute"),
                     ("zero", "zero"), ("schedules", "schedule"), ("sequence_parallel", "sp"),
                     ("layouts", "layouts"), ("hetero", "hetero")):
        value = getattr(space, f)
        if value != getattr(default, f):
            parts.append(f"{label}={value}")
    if space.allow is not None:
        parts.append(space.allow.__doc__ or "a plan filter")
    return ", ".join(parts) or "every value"
