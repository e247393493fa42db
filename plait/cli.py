"""`plait` command line: one entry point, one subcommand per job.

Each subcommand lives in its own module under `plait/commands/` and registers
itself with `add_parser(subparsers)`; the module's `run(args)` returns an exit code.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading
from types import FrameType

# Subcommands in the order `plait --help` lists them: name -> module.
COMMANDS = {
    "inspect": "plait.commands.inspect_cmd",
    "simulate": "plait.commands.simulate_cmd",
    "plan": "plait.commands.plan_cmd",
    "run": "plait.commands.run_cmd",
    "doctor": "plait.commands.doctor_cmd",
    "profile": "plait.commands.profile_cmd",
    "cluster": "plait.commands.cluster_cmd",
    "report": "plait.report.command",  # beside plait.commands on the contract's top row
}


class UserError(Exception):
    """An error caused by the user's input: printed as one line, no traceback."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's cancel, `kill`): raised like Ctrl-C so that what is running stops the
    way an interrupt stops it (`plait run` kills its agents and workers instead of orphaning them)."""


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise Terminated(signum)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="plait",
        description="Plan, predict, run and watch distributed DNN training on heterogeneous clusters.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in COMMANDS.values():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:
                continue  # subcommand not built yet
            raise
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from plait.errors import PlaitError

    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if in_main else None
    try:
        return int(args.func(args) or 0)
    except (PlaitError, UserError, FileNotFoundError) as exc:
        print(f"plait {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except Terminated:
        print("terminated (SIGTERM)", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
