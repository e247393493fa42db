"""How many flows NCCL opens between two neighbouring NICs, by message size and settings.

ECMP's collision loss depends on how many separately hashed flows a collective opens. NCCL
opens, per connection (a ring neighbour, or a tree parent/child), one network connection per
channel, and per connection ``NCCL_IB_QPS_PER_CONNECTION`` RoCE queue pairs; each queue pair
has its own UDP source port, so each is a flow ECMP hashes on its own. Sources:

* NCCL user guide, "Environment Variables": ``NCCL_IB_QPS_PER_CONNECTION`` (default 1),
  ``NCCL_IB_SPLIT_DATA_ON_QPS`` (whether one message is split over the QPs or sent whole on one,
  round-robin; over an iteration's many messages each QP carries an equal share either way),
  ``NCCL_MIN_NCHANNELS`` / ``NCCL_MAX_NCHANNELS`` (bounds on a communicator's channels; NCCL's
  MAXCHANNELS is 32), ``NCCL_ALGO`` (Ring, Tree), ``NCCL_PXN_DISABLE`` (PXN on by default since
  2.12: a send to a peer on another rail goes over NVLink to the GPU local to that rail's NIC).
* NCCL ``src/enqueue.cc`` (getAlgoInfo / topoGetAlgoInfo, 2.x): for one collective of
  ``nBytes`` the channels start at the communicator's and drop one at a time while
  ``nBytes < nc * nthreads * threadThreshold`` (``src/include/comm.h``:
  ``NCCL_SIMPLE_THREAD_THRESHOLD 64``, ``NCCL_LL_THREAD_THRESHOLD 8``; nthreads 512): a small
  message runs on fewer channels, so fewer flows.
* NCCL's double binary tree (``src/graph/connect.cc``): the communicator's channels are split
  between the two trees, so one tree edge carries half the channels.

The protocol follows NCCL's usual choice between nodes: LL below 64 KiB, Simple above (the
LL128 protocol is off on most RoCE fabrics). `flows_per_connection` is what `plait.net.fabric`
uses per device pair; a flow's index ``c`` numbers channel ``c // qps`` and queue pair
``c % qps``.
"""

from __future__ import annotations

from plait.cluster.spec import NcclSpec

NTHREADS = 512  # NCCL_SIMPLE_MAX_NTHREADS / NCCL_LL_MAX_NTHREADS
THREAD_THRESHOLD = {"simple": 64, "ll": 8}  # src/include/comm.h
LL_BELOW = 64 * 1024  # bytes: NCCL's tuner picks LL for small inter-node messages
LARGE = 1 << 30  # a message big enough to run on every channel


def protocol(nbytes: float) -> str:
    return "ll" if nbytes < LL_BELOW else "simple"


def comm_channels(channels: int, nccl: NcclSpec) -> int:
    """The communicator's channels through one NIC connection: `channels` (the fabric's, as
    NCCL's topology search finds them) held between NCCL_MIN_NCHANNELS and NCCL_MAX_NCHANNELS."""
    return max(nccl.min_channels, min(nccl.max_channels, channels))


def channels_for(nbytes: float, channels: int, nccl: NcclSpec, algorithm: str | None = None) -> int:
    """Channels one collective of `nbytes` (per rank) runs on one connection (see module doc)."""
    nc = comm_channels(channels, nccl)
    if (algorithm or nccl.algorithm) == "tree":
        nc = max(1, nc // 2)  # the two trees of the double binary tree share the channels
    per_channel = NTHREADS * THREAD_THRESHOLD[protocol(nbytes)]
    while nc >= 2 and nbytes < nc * per_channel:
        nc -= 1
    return nc


def flows_per_connection(nbytes: float, channels: int, nccl: NcclSpec, algorithm: str | None = None) -> int:
    """Separately hashed flows (queue pairs) one connection opens for a message of `nbytes`."""
    return channels_for(nbytes, channels, nccl, algorithm) * nccl.qps_per_connection


def settings_env(channels: int, nccl: NcclSpec) -> dict[str, str]:
    """The NCCL environment that makes stock NCCL open these flows (every value a decimal or 0/1)."""
    return {"NCCL_IB_QPS_PER_CONNECTION": str(nccl.qps_per_connection),
            "NCCL_MIN_NCHANNELS": str(comm_channels(channels, nccl)),
            "NCCL_MAX_NCHANNELS": str(comm_channels(channels, nccl)),
            "NCCL_ALGO": nccl.algorithm.capitalize(),
            "NCCL_PXN_DISABLE": "0" if nccl.pxn else "1"}
