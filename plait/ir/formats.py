"""`format_version` of every file plait writes, and the one rule for reading it.

A file names its version in a top-level ``format_version`` field. Reading one:

* absent        -- written before plait versioned its files; version 1's fields are a superset
                   of what those files hold, so it is read as version 1 (migrated);
* older         -- migrated by the reader when a migration is known, else refused;
* this version  -- read;
* newer, or not a positive integer -- refused with a message that names the file, the version
                   found and the one this plait reads (a newer plait wrote it: upgrade).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from plait.errors import PlaitError

# The version each format is written in today. Bump one when its fields change meaning, and add
# a migration from the previous version to MIGRATIONS.
FORMAT_VERSIONS: dict[str, int] = {
    "plan": 2,        # plan JSON (plait plan --out, plait simulate/run --plan FILE); 2: typed stage programs
    "cluster": 1,     # cluster YAML (plait profile --out, examples/clusters/)
    "opgraph": 2,     # OpGraph JSON (plait inspect --json); 2: captures under autocast (per-op dtypes, parameter copies)
    "atengraph": 1,   # AtenGraph JSON (the op-level capture, plait.graph.aten_capture)
    "timeline": 1,    # Timeline JSON (simulated or measured events)
    "run": 1,         # a run folder's result.json
    "diagnosis": 1,   # plait doctor --json / a run folder's diagnosis.json
    "recovery": 1,    # a recovering run's RUN_DIR/recovery.json (plait.recover)
    "prediction": 1,  # a run folder's prediction.json (plait run --predict: predicted for this machine)
    "profile": 1,     # a model profile (plait.ir.profile): per-GPU-kind measured layer times
    "search": 1,      # PLAN.search.json beside plait plan --out's plan: each family's best (plait.search.summary)
    "worker": 1,      # a run folder's config.json: the workers' config (plait.runtime.worker_config); no migration
}

# (format, from_version) -> function turning a dict of that version into the next version; each
# format's module registers its own (plan 1 -> 2: `plait.ir.plan._plan_v1_to_v2`).
MIGRATIONS: dict[tuple[str, int], Callable[[dict[str, Any]], dict[str, Any]]] = {}


def stamp(kind: str, data: dict[str, Any]) -> dict[str, Any]:
    """`data` with ``format_version`` first, as it is written."""
    return {"format_version": FORMAT_VERSIONS[kind], **{k: v for k, v in data.items() if k != "format_version"}}


def check_version(kind: str, data: Mapping[str, Any], source: str,
                  error: type[PlaitError] = PlaitError) -> dict[str, Any]:
    """`data` without its ``format_version``, migrated to the current version of `kind`;
    raises `error` naming `source` when the version cannot be read."""
    current = FORMAT_VERSIONS[kind]
    out = dict(data)
    found = out.pop("format_version", None)
    if found is None:  # written before versioning: read as version 1, migrated from there
        found = 1
    if isinstance(found, bool) or not isinstance(found, int) or found < 1:
        raise error(f"{source}: format_version: expected a positive integer, got {found!r}")
    if found > current:
        raise error(f"{source}: format_version {found} is newer than this plait reads ({kind} format "
                    f"{current}); it was written by a newer plait -- upgrade plait to read it")
    while found < current:
        migrate = MIGRATIONS.get((kind, found))
        if migrate is None:
            raise error(f"{source}: format_version {found} of the {kind} format can no longer be read "
                        f"(this plait reads {current}); write the file again with this plait")
        out = migrate(out)
        found += 1
    return out
