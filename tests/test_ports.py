"""Rendezvous ports (plait.net.ports) and the launcher's new start when its store's port was taken."""

from __future__ import annotations

import random
import socket
from pathlib import Path

import pytest

from plait.net import ports
from plait.runtime import launch
from plait.runtime.api import RecordsConfig, run


def test_free_ports_lie_below_the_ephemeral_range_and_bind() -> None:
    lo, _ = ports.ephemeral_range()
    rng = random.Random(7)
    for _ in range(50):
        port = ports.free_port(rng=rng)
        assert ports._LOWEST <= port < lo
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free when returned


def test_a_port_in_use_is_never_returned(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        monkeypatch.setattr(ports, "ephemeral_range", lambda: (taken + 1, 60999))
        monkeypatch.setattr(ports, "_LOWEST", taken - 999)  # a span of 1000 ports, one of them held
        rng = random.Random(1)
        assert taken not in {ports.free_port(rng=rng) for _ in range(300)}


def test_a_run_whose_store_port_was_taken_starts_again_on_another(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process binds the port between free_port and torchrun: agent 0's TCPStore fails
    with EADDRINUSE before any worker starts; the launcher starts the run again on a new port and
    keeps the failed start's log."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        draws = iter([taken])
        real = ports.free_port
        monkeypatch.setattr(launch, "free_port", lambda: next(draws, None) or real())
        rdir = tmp_path / "run"
        result = run("gpt:layers=2,hidden=16,heads=4,seq=8,vocab=32", None, "dp=2,micro_batch=1,global_batch=2",
                     steps=1, records=RecordsConfig(run_dir=rdir))
    assert len(result.losses) == 1
    old = (rdir / f"agent0.port{taken}.log").read_text()
    assert "EADDRINUSE" in old
    assert f"port {taken} was taken" in (rdir / "agent0.log").read_text()
