"""Timeline: what ran where and when, for one or more iterations.

The simulator predicts one and the runtime measures one, in the same schema, so
accuracy is a row-by-row diff. Exported as Chrome / Perfetto trace-event JSON
("X" complete events, microsecond timestamps; one process per device or link; flow events
"s"/"f" from each pipeline send to the compute that consumes it: the stage graph's edges).
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from plait.ir.formats import check_version, stamp

# Event categories, shared by simulator and runtime ("ghost": the runtime's torch engine runs a
# weight-0 micro-batch so a replica with fewer joins FSDP2's gathers; no real sample, not modelled).
CATEGORIES = ("forward", "backward", "recompute", "optimizer", "data", "h2d",
              "comm_tp", "comm_pp", "comm_dp", "comm_zero", "comm", "idle", "ghost")


@dataclass
class TimelineEvent:
    name: str  # e.g. "fwd s0 c0 mb3" (plait.schedule.event_key), "allreduce dp bucket2"
    category: str  # one of CATEGORIES
    resource: str  # "dev3/compute", "dev3/comm", "link 0-8", ...
    start: float  # seconds from the iteration's start
    end: float
    device: int | None = None  # cluster device id, when the event belongs to one
    stage: int | None = None
    micro_batch: int | None = None
    args: dict[str, Any] = field(default_factory=dict)  # bytes, flops, algorithm, ...
    chunk: int | None = None  # model chunk on its stage (interleaved 1F1B); after args for positional callers

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class Timeline:
    events: list[TimelineEvent] = field(default_factory=list)
    source: str = "simulated"  # "simulated" | "measured"
    meta: dict[str, Any] = field(default_factory=dict)

    def add(self, event: TimelineEvent) -> None:
        self.events.append(event)

    @property
    def span(self) -> float:
        """Wall time from the first start to the last end."""
        if not self.events:
            return 0.0
        return max(e.end for e in self.events) - min(e.start for e in self.events)

    def busy_time(self, resource: str) -> float:
        """Union length of the intervals on `resource` (overlapping events count once)."""
        spans = sorted((e.start, e.end) for e in self.events if e.resource == resource)
        total, cur = 0.0, None  # cur: the (start, end) of the union interval being grown
        for s, e in spans:
            if cur is None or s > cur[1]:
                if cur is not None:
                    total += cur[1] - cur[0]
                cur = (s, e)
            else:
                cur = (cur[0], max(cur[1], e))
        if cur is not None:
            total += cur[1] - cur[0]
        return total

    def busy_fraction(self) -> dict[str, float]:
        span = self.span or 1.0
        return {r: self.busy_time(r) / span for r in sorted({e.resource for e in self.events})}

    def by_category(self) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for e in self.events:
            out[e.category] += e.duration
        return dict(out)

    # ---------------------------------------------------------------- export
    def to_chrome_trace(self) -> dict[str, Any]:
        """Trace-event format (the JSON Perfetto and chrome://tracing open)."""
        resources = sorted({e.resource for e in self.events}, key=_resource_sort_key)
        pids: dict[str, int] = {}
        tids: dict[str, int] = {}
        trace: list[dict[str, Any]] = []
        for r in resources:
            proc, _, thread = r.partition("/")
            if proc not in pids:
                pids[proc] = len(pids)
                trace.append({"ph": "M", "name": "process_name", "pid": pids[proc], "tid": 0,
                              "args": {"name": proc}})
                trace.append({"ph": "M", "name": "process_sort_index", "pid": pids[proc], "tid": 0,
                              "args": {"sort_index": pids[proc]}})
            if r not in tids:
                tids[r] = len(tids) + 1
                trace.append({"ph": "M", "name": "thread_name", "pid": pids[proc], "tid": tids[r],
                              "args": {"name": thread or proc}})
        t0 = min((e.start for e in self.events), default=0.0)
        for e in self.events:
            proc = e.resource.partition("/")[0]
            args = {k: v for k, v in e.args.items() if isinstance(v, (int, float, str, bool))}
            for key in ("device", "stage", "micro_batch"):
                if getattr(e, key) is not None:
                    args[key] = getattr(e, key)
            trace.append({"ph": "X", "name": e.name, "cat": e.category, "pid": pids[proc],
                          "tid": tids[e.resource], "ts": (e.start - t0) * 1e6,
                          "dur": max(e.duration, 0.0) * 1e6, "args": args})
        trace += self._flows(pids, tids, t0)
        return {"traceEvents": trace, "displayTimeUnit": "ms",
                "otherData": {"source": self.source, **{k: str(v) for k, v in self.meta.items()}}}

    def _flows(self, pids: dict[str, int], tids: dict[str, int], t0: float) -> list[dict[str, Any]]:
        """Flow events ("ph": "s" -> "f") for pipeline transfers: from each send (a "comm_pp" event
        naming its `peer` receive and `dst` device) to the compute on the receiving device that
        consumes it -- the first forward (backward) of that stage and micro-batch starting after the
        send ends -- so Perfetto draws the stage graph's edges as arrows."""
        compute: dict[tuple, list[TimelineEvent]] = defaultdict(list)
        for e in self.events:
            if e.category in ("forward", "backward") and e.device is not None:
                compute[(e.device, e.stage, e.micro_batch, e.category)].append(e)
        for lst in compute.values():
            lst.sort(key=lambda e: e.start)
        out: list[dict[str, Any]] = []
        for e in self.events:
            peer, dst = e.args.get("peer"), e.args.get("dst")
            if e.category != "comm_pp" or not isinstance(peer, str) or dst is None:
                continue
            parts = peer.split()  # "recv_fwd s3 c0 mb0"
            if len(parts) != 4 or not parts[1][1:].isdigit() or not parts[3][2:].isdigit():
                continue
            cat = "forward" if parts[0].endswith("fwd") else "backward"
            key = (int(dst), int(parts[1][1:]), int(parts[3][2:]), cat)
            target = next((c for c in compute.get(key, ()) if c.start >= e.end - 1e-12), None)
            if target is None:
                continue
            fid = len(out) // 2 + 1
            out.append({"ph": "s", "id": fid, "name": "stage edge", "cat": "pp_flow",
                        "pid": pids[e.resource.partition("/")[0]], "tid": tids[e.resource],
                        "ts": (e.start - t0) * 1e6})
            out.append({"ph": "f", "bp": "e", "id": fid, "name": "stage edge", "cat": "pp_flow",
                        "pid": pids[target.resource.partition("/")[0]], "tid": tids[target.resource],
                        "ts": (target.start - t0) * 1e6})
        return out

    def save_chrome_trace(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_chrome_trace()))

    def to_dict(self) -> dict[str, Any]:
        return stamp("timeline", {"source": self.source, "meta": self.meta,
                                  "events": [asdict(e) for e in self.events]})

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "timeline") -> Timeline:
        d = check_version("timeline", d, source)
        return cls(events=[TimelineEvent(**e) for e in d["events"]], source=d.get("source", "simulated"),
                   meta=d.get("meta", {}))


def _resource_sort_key(resource: str) -> tuple:
    proc, _, thread = resource.partition("/")
    digits = "".join(c for c in proc if c.isdigit())
    return (not proc.startswith("dev"), int(digits) if digits else 0, proc, thread)
