"""SIGTERM to a `plait` command is raised as an interrupt (`plait.cli.Terminated`), so whatever runs
stops the way Ctrl-C stops it (the launcher kills its agents and workers: `Launcher.wait`), and the
command exits 143. The multi-process case is `test_sigterm_to_plait_run_stops_its_agents_and_workers`."""

from __future__ import annotations

import argparse
import os
import signal
import time

import pytest

from plait import cli


def test_sigterm_during_a_command_exits_143_after_its_cleanup_ran(monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    cleaned = []

    def command(args: argparse.Namespace) -> int:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(100):  # delivered at the next bytecode boundary; the handler raises
                time.sleep(0.01)
            return 0
        except KeyboardInterrupt:
            cleaned.append(True)  # what Launcher.wait does: stop every agent and worker, re-raise
            raise

    parser = argparse.ArgumentParser()
    parser.set_defaults(func=command, command="fake")
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    unhandled: list[int] = []

    def caller_handler(signum: int, frame: object) -> None:  # what runs if main() installs none
        unhandled.append(signum)

    before = signal.signal(signal.SIGTERM, caller_handler)
    try:
        code = cli.main([])
        assert signal.getsignal(signal.SIGTERM) is caller_handler  # the caller's handler is back
    finally:
        signal.signal(signal.SIGTERM, before)
    assert unhandled == [] and cleaned == [True]
    assert code == 128 + signal.SIGTERM
    assert "terminated (SIGTERM)" in capsys.readouterr().err
