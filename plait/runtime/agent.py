"""One torchrun agent: `python -m plait.runtime.agent FAILURES_JSON TORCHRUN_ARGS...`.

Runs `torch.distributed.run.main` (torchrun) in this process and, when a worker fails,
writes torchrun's per-worker failure records (exit code or signal, pid, time) to
FAILURES_JSON, so the launcher can tell a worker killed by a signal from one that merely
lost its peer.
"""

from __future__ import annotations

import json
import os
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    failures_path, torchrun_args = argv[0], argv[1:]
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        torchrun.main(torchrun_args)
    except ChildFailedError as exc:
        records = {}
        for rank, failure in exc.failures.items():
            records[str(rank)] = {"local_rank": failure.local_rank, "pid": failure.pid,
                                  "exitcode": failure.exitcode, "timestamp": failure.timestamp,
                                  "signal": failure.signal_name() if failure.exitcode < 0 else None}
        tmp = failures_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"failures": records}, f)
        os.replace(tmp, failures_path)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
