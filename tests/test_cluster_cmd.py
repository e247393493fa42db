"""`plait cluster show` / `plait cluster presets`."""

from __future__ import annotations

import json

from plait.cli import main
from plait.cluster import load_cluster, parse_yaml_text


def test_show_table(capsys) -> None:
    assert main(["cluster", "show", "mixed-a100-v100:a100_nodes=1,v100_nodes=1"]) == 0
    out = capsys.readouterr().out
    for text in ("a100-80gb", "v100-32gb", "GPU kinds", "Nodes", "inter-node", "12.5 GB/s", "312"):
        assert text in out


def test_show_default_is_emulated_mixed(capsys) -> None:
    assert main(["cluster", "show"]) == 0
    out = capsys.readouterr().out
    assert "emulated-mixed" in out and "Emulation: on" in out


def test_show_json(capsys) -> None:
    assert main(["cluster", "show", "uneven:nodes=4,gpus_per_node=2", "--json", "--matrix"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["num_devices"] == 8 and data["num_nodes"] == 4
    assert data["devices"][3] == {"id": 3, "node": 1, "local": 1, "kind": "a100-80gb"}
    assert data["cluster"]["nodes"][0]["intra"]["bandwidth"] == 300e9
    assert len(data["bandwidth_matrix"]) == 8 and data["latency_matrix"][0][0] == 0
    inter = data["summary"]["inter_node"]["bandwidth"]
    assert inter["min"] == 25e9 / 4 and inter["max"] == 25e9 and inter["pairs"] == 24
    assert data["summary"]["overrides"]["node_pairs"] == 3


def test_show_yaml_loads_back(capsys) -> None:
    assert main(["cluster", "show", "large-mixed:nodes=4,nodes_per_leaf=2", "--yaml"]) == 0
    text = capsys.readouterr().out
    assert parse_yaml_text(text) == load_cluster("large-mixed:nodes=4,nodes_per_leaf=2")


def test_presets_listing(capsys) -> None:
    assert main(["cluster", "presets"]) == 0
    out = capsys.readouterr().out
    for name in ("dgx-a100", "mixed-a100-v100", "uneven", "large-mixed", "emulated-mixed", "h200"):
        assert name in out
    assert main(["cluster", "presets", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["default"] == "emulated-mixed" and "uneven" in data["presets"]
    assert data["presets"]["uneven"]["params"]["slow_factor"]["default"] == 0.25


def test_errors_are_one_line(capsys) -> None:
    assert main(["cluster", "show", "nope:x=1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("plait cluster: error: unknown cluster 'nope:x=1'") and err.count("\n") == 1
    assert main(["cluster"]) == 2
