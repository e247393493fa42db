"""One torchrun agent: `python -m plait.runtime.agent FAILURES_JSON TORCHRUN_ARGS...`.

Parses TORCHRUN_ARGS with torchrun's own parser (`torch.distributed.run`) and runs its
elastic agent (`torch.distributed.launcher.elastic_launch`) in this process. With
`--start-method=fork` (the CPU default) the workers are started from the Python entry
point `plait.runtime.entry.entrypoint`, forked from this agent, so they inherit the
already-imported torch instead of importing it again (an import of torch costs about
as much CPU as a short test run); otherwise the entry module is started as a fresh
interpreter, exactly as `torchrun -m plait.runtime.entry CONFIG` would.

When a worker fails it writes torchrun's per-worker failure records (exit code or
signal, pid, time) to FAILURES_JSON, so the launcher can tell a worker killed by a
signal from one that merely lost its peer.
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
    from torch.distributed.launcher.api import elastic_launch

    args = torchrun.parse_args(torchrun_args)
    config, cmd, cmd_args = torchrun.config_from_args(args)
    try:
        if args.start_method in ("fork", "forkserver") and args.module and \
                args.training_script == "plait.runtime.entry":
            import plait.runtime.entry as entry  # imported once here, inherited by every worker

            elastic_launch(config, entry.entrypoint)(*args.training_script_args)
        else:
            elastic_launch(config, cmd)(*cmd_args)
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
    code = main()
    # The workers are stopped and reaped; skip the interpreter's teardown of torch's elastic agent,
    # rendezvous keep-alive and store threads (3+ s on a loaded machine, on every run).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
