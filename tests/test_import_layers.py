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
    graph.add_import(importer="plait.planners.threed", imported="plait.sim.api", line_number=1,
                     line_contents="from plait.sim.api import simulate")
    layers = ["plait.search", "plait.measure", "plait.sim", "plait.planners", "plait.cost"]
    illegal = graph.find_illegal_dependencies_for_layers(layers=layers, containers=set())
    assert any(d.importer == "plait.planners" and d.imported == "plait.sim" for d in illegal)
    graph.remove_import(importer="plait.planners.threed", imported="plait.sim.api")
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
    planners = ("plait.planners", "plait.spmd", "plait.search")
    found = [(m, imp) for pkg in ("plait.sim", "plait.runtime") for m in graph.find_descendants(pkg)
             for imp in graph.find_modules_directly_imported_by(m) if imp.startswith(planners)]
    assert found == []
    graph.add_import(importer="plait.sim.api", imported="plait.spmd.search", line_number=1,
                     line_contents="from plait.spmd.search import search")
    assert graph.find_shortest_chain(importer="plait.sim.api", imported="plait.spmd.search")


def _contracts() -> list[dict]:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


PLANNERS_NO_SIM = "planners and the search driver import no simulator"
SIM_NO_PLANNER = "sim and runtime import no planner"


@pytest.mark.parametrize("name,importer,imported", [
    (PLANNERS_NO_SIM, "plait.search.driver", "plait.sim.api"),  # the driver building the simulator itself
    (PLANNERS_NO_SIM, "plait.search.compose_family", "plait.sim.lowering"),
    (PLANNERS_NO_SIM, "plait.planners.threed", "plait.sim.api"),
    (PLANNERS_NO_SIM, "plait.spmd.ratios", "plait.sim.engine"),
    (SIM_NO_PLANNER, "plait.sim.api", "plait.search.driver"),
    (SIM_NO_PLANNER, "plait.runtime.worker", "plait.planners.threed"),
    (SIM_NO_PLANNER, "plait.sim.lowering.spmd", "plait.spmd.ratios"),
])
def test_each_forbidden_contract_catches_a_forbidden_import(name: str, importer: str, imported: str) -> None:
    """Issue 31: each forbidden contract of pyproject.toml (import-linter's own check, on the real
    import graph) is kept as the code stands and broken by one forbidden import."""
    import grimp
    from importlinter.configuration import configure
    from importlinter.contracts.forbidden import ForbiddenContract

    configure()  # import-linter's settings (its timer), as its command line sets them
    options = next(c for c in _contracts() if c["name"] == name)
    contract = ForbiddenContract(options["name"], {"root_packages": ["plait"]},
                                 {k: v for k, v in options.items() if k not in ("name", "type")})
    graph = grimp.build_graph("plait", include_external_packages=False, cache_dir=None)
    assert contract.check(graph, verbose=False).kept
    graph.add_import(importer=importer, imported=imported, line_number=1, line_contents=f"import {imported}")
    assert not contract.check(graph, verbose=False).kept
