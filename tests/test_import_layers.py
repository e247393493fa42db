"""The import contract of docs/DESIGN.md ("Layers"), as `lint-imports` checks it in `make test`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_imports_run_only_downward() -> None:
    # In a subprocess: import-linter reconfigures logging (dictConfig), which would silence
    # the loggers later tests read.
    code = ("import sys; from importlinter.cli import lint_imports; "
            "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


def test_the_contract_catches_an_upward_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The contract is live: a planner importing the simulator breaks it."""
    import grimp

    graph = grimp.build_graph("plait", include_external_packages=False, cache_dir=None)
    graph.add_import(importer="plait.plan.threed", imported="plait.sim.api", line_number=1,
                     line_contents="from plait.sim.api import simulate")
    layers = ["plait.search", "plait.measure", "plait.sim", "plait.plan", "plait.cost"]
    illegal = graph.find_illegal_dependencies_for_layers(layers=layers, containers=set())
    assert any(d.importer == "plait.plan" and d.imported == "plait.sim" for d in illegal)
    graph.remove_import(importer="plait.plan.threed", imported="plait.sim.api")
    assert not graph.find_illegal_dependencies_for_layers(layers=layers, containers=set())


def test_cluster_package_has_no_import_cycle() -> None:
    import grimp
    import networkx as nx

    graph = grimp.build_graph("plait", include_external_packages=False, cache_dir=None)
    g = nx.DiGraph()
    for m in graph.find_descendants("plait.cluster"):
        for imp in graph.find_modules_directly_imported_by(m):
            if imp.startswith("plait.cluster.") and imp != m:
                g.add_edge(m, imp)
    assert not list(nx.simple_cycles(g))


def test_sim_and_runtime_import_no_planner() -> None:
    """Issue 27: the simulator and the runtime read plans (`plait.ir`) and costs (`plait.cost`),
    never a planner -- not even inside a function (grimp reads every import statement)."""
    import grimp

    graph = grimp.build_graph("plait", include_external_packages=False, cache_dir=None)
    planners = ("plait.plan", "plait.spmd", "plait.search")
    found = [(m, imp) for pkg in ("plait.sim", "plait.runtime") for m in graph.find_descendants(pkg)
             for imp in graph.find_modules_directly_imported_by(m) if imp.startswith(planners)]
    assert found == []
    graph.add_import(importer="plait.sim.api", imported="plait.spmd.search", line_number=1,
                     line_contents="from plait.spmd.search import search")
    assert graph.find_shortest_chain(importer="plait.sim.api", imported="plait.spmd.search")
