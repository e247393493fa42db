"""Read nccl-tests output (`all_reduce_perf`, `all_gather_perf`, ...) into a MeasuredCollective.

nccl-tests (github.com/NVIDIA/nccl-tests, doc/PERFORMANCE.md) print one row per message size:

    #       size         count      type   redop    root     time   algbw   busbw #wrong  ...
    #        (B)    (elements)                               (us)  (GB/s)  (GB/s)         ...
         1048576        262144     float     sum      -1    30.43   34.46   60.31      0  ...

Columns are read by name from the header line (their set differs between tests and
versions); the out-of-place `busbw` (GB/s = 1e9 bytes/s) is taken, the first of the two.
The ranks are the `#  Rank  N Group ... on HOST device ...` lines, the nodes their distinct
hosts. The collective is named by `op` or read off a "Collective test starting: X_perf" line.
"""

from __future__ import annotations

import re

from plait.cluster.spec import COLLECTIVE_OPS, ClusterError, MeasuredCollective

_PERF_NAMES = {"all_reduce": "all_reduce", "allreduce": "all_reduce", "all_gather": "all_gather",
               "allgather": "all_gather", "reduce_scatter": "reduce_scatter",
               "reducescatter": "reduce_scatter", "alltoall": "all_to_all", "all_to_all": "all_to_all",
               "broadcast": "broadcast", "sendrecv": "send_recv", "send_recv": "send_recv"}
_RANK = re.compile(r"^#\s*Rank\s+(\d+)\s+Group\s+\d+\s+Pid\s+\d+\s+on\s+(\S+)\s+device", re.M)
_TEST = re.compile(r"Collective test starting:\s*(\w+?)_perf", re.I)


def parse_nccl_tests(text: str, source: str = "<nccl-tests>", op: str | None = None) -> MeasuredCollective:
    """The table in `text` as a MeasuredCollective; errors name `source` and what is missing."""
    if op is None:
        found = _TEST.search(text)
        if found is None:
            raise ClusterError(f"{source}: cannot tell which collective this is; give the op "
                               f"({', '.join(COLLECTIVE_OPS)})")
        op = _PERF_NAMES.get(found.group(1).lower())
        if op is None:
            raise ClusterError(f"{source}: unknown nccl-tests collective {found.group(1)!r}")
    if op not in COLLECTIVE_OPS:
        raise ClusterError(f"{source}: unknown collective {op!r}; use one of {', '.join(COLLECTIVE_OPS)}")
    ranks = {int(r): host for r, host in _RANK.findall(text)}
    if len(ranks) < 2:
        raise ClusterError(f"{source}: found {len(ranks)} '#  Rank N ... on HOST device' line(s); a "
                           f"collective table needs the output of a run on 2 or more ranks")
    columns: list[str] | None = None
    sizes: list[float] = []
    busbw: list[float] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("#"):
            words = stripped.lstrip("#").split()
            if "size" in words and "busbw" in words:
                columns = words
            continue
        if columns is None or not stripped:
            continue
        cells = stripped.split()
        if len(cells) < columns.index("busbw") + 1 or not cells[0].isdigit():
            continue
        try:
            size = float(cells[columns.index("size")])
            bw = float(cells[columns.index("busbw")]) * 1e9
        except ValueError:
            raise ClusterError(f"{source}: line {lineno}: cannot read size/busbw from {stripped!r}") from None
        if size > 0 and bw > 0:
            sizes.append(size)
            busbw.append(bw)
    if columns is None:
        raise ClusterError(f"{source}: no nccl-tests header line with 'size' and 'busbw' columns")
    if not sizes:
        raise ClusterError(f"{source}: no row with a positive size and bus bandwidth")
    points = sorted(dict(zip(sizes, busbw)).items())
    return MeasuredCollective(op=op, nodes=len(set(ranks.values())), ranks=len(ranks),
                              sizes=tuple(p[0] for p in points), busbw=tuple(p[1] for p in points),
                              source=f"nccl-tests {op}_perf: {source}")
