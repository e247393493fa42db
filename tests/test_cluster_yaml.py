"""Cluster YAML: examples load, defaults resolve field by field, and every malformed file
raises ClusterError naming the file and the field (hypothesis-generated bad input)."""

from __future__ import annotations

import copy
import math
import re
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plait.cluster import load_cluster, parse_yaml_text
from plait.cluster.catalog import DEFAULT_LATENCY, GPU_KINDS, NODE_TEMPLATES
from plait.cluster.loader import MAX_DEVICES
from plait.cluster.spec import Cluster, ClusterError
from plait.cluster.topology import bandwidth_matrix, latency_matrix

EXAMPLES = sorted((Path(__file__).parent.parent / "examples" / "clusters").glob("*.yaml"))

# A valid file touching every part of the format (11 devices).
BASE: dict[str, Any] = {
    "name": "lab",
    "gpu_kinds": {
        "a10": {"memory_bandwidth": "560 GB/s"},
        "custom-gpu": {"flops": {"fp32": "20 TFLOPS", "bf16": "80 TFLOPS"}, "memory": "24 GiB",
                       "memory_bandwidth": "700 GB/s"},
    },
    "nodes": [
        {"name": "n0", "gpus": {"kind": "a100-80g", "count": 4},
         "intra": {"type": "nvlink", "bandwidth": "300 GB/s", "latency": "2 us"},
         "nic": {"type": "infiniband", "bandwidth": "200 Gb/s", "latency": "5 us", "count": 4},
         "leaf": "leaf0"},
        {"name": "n1", "gpus": ["custom-gpu", {"kind": "a10", "count": 2}],
         "intra": {"type": "pcie", "bandwidth": "31.5 GB/s"}, "nic": {"bandwidth": "100 Gb/s"}},
    ],
    "node_groups": [
        {"name": "v", "count": 2, "gpus": {"kind": "v100", "count": 2},
         "intra": {"bandwidth": "150 GB/s", "latency": "2 us"},
         "nic": {"bandwidth": "100 Gb/s", "latency": "5 us", "count": 2}},
    ],
    "fabric": {"type": "infiniband", "bandwidth": "200 Gb/s", "latency": "5 us", "nics": 2,
               "switches": {"leaves": [{"name": "leaf0", "uplink": {"bandwidth": "400 Gb/s", "latency": "1 us"}},
                                       {"name": "leaf1", "uplink": {"bandwidth": "400 Gb/s"}}],
                            "spines": 2}},
    "overrides": [{"devices": [0, 5], "bandwidth": "10 GB/s", "latency": "9 us"},
                  {"nodes": ["n0", 2], "bandwidth": "50 Gb/s"}],
    "emulation": {"enabled": True, "namespaces": False, "bandwidth_scale": 0.01,
                  "slowdown": {"v100": 2.0}},
}

BAD = {
    "bandwidth": [-5, 0, "-5 GB/s", "0 GB/s", "fast", "5 GX/s", "5 GB", True, [1], {"a": 1}, None,
                  math.nan, math.inf, "1e999 GB/s"],
    "latency": [-1, "-2 us", "soon", "2 parsecs", True, [1], None, math.nan, "1e999 s"],
    "memory": [-1, 0, "0.1 B", "lots", True, [1], None, "5 GB/s"],
    "flops": [-1, 0, "fast", True, "312 TOPS", None, [3]],
    "count": [0, -1, 1.5, "two", True, None, 10**9, [2]],
    "kind": ["b200", "", 5, True, None, [], {"x": 1}],
    "linktype": ["carrier-pigeon", 5, "", None],
    "name": [5, "", None, [], True],
    "bool": ["yes", 1, None, "true", 0.5],
    "scale": [0, -1, "x", True, None, math.inf],
    "leaf": ["leaf9", 5, "", True],
    "device_ref": [11, -1, "n0:9", "nope:0", True, 1.5, None],
    "node_ref": [4, -1, "nope", True, None],
    "mapping": [5, "text", [1, 2], True],
    "list": [5, "text", {"a": 1}],
}

# (path in BASE, category of bad values); the error must name exactly this path.
TARGETS = [
    (("name",), "name"),
    (("gpu_kinds",), "list"),
    (("gpu_kinds", "a10", "memory_bandwidth"), "bandwidth"),
    (("gpu_kinds", "a10"), "mapping"),
    (("gpu_kinds", "custom-gpu", "flops", "fp32"), "flops"),
    (("gpu_kinds", "custom-gpu", "flops", "bf16"), "flops"),
    (("gpu_kinds", "custom-gpu", "flops"), "mapping"),
    (("gpu_kinds", "custom-gpu", "memory"), "memory"),
    (("gpu_kinds", "custom-gpu", "memory_bandwidth"), "bandwidth"),
    (("nodes",), "list"),
    (("nodes", 0), "mapping"),
    (("nodes", 0, "name"), "name"),
    (("nodes", 0, "gpus"), "mapping"),
    (("nodes", 0, "gpus", "kind"), "kind"),
    (("nodes", 0, "gpus", "count"), "count"),
    (("nodes", 0, "intra"), "mapping"),
    (("nodes", 0, "intra", "type"), "linktype"),
    (("nodes", 0, "intra", "bandwidth"), "bandwidth"),
    (("nodes", 0, "intra", "latency"), "latency"),
    (("nodes", 0, "nic", "bandwidth"), "bandwidth"),
    (("nodes", 0, "nic", "latency"), "latency"),
    (("nodes", 0, "nic", "type"), "linktype"),
    (("nodes", 0, "nic", "count"), "count"),
    (("nodes", 0, "leaf"), "leaf"),
    (("nodes", 1, "gpus", 0), "kind"),
    (("nodes", 1, "gpus", 1, "kind"), "kind"),
    (("nodes", 1, "gpus", 1, "count"), "count"),
    (("nodes", 1, "intra", "bandwidth"), "bandwidth"),
    (("node_groups",), "list"),
    (("node_groups", 0, "count"), "count"),
    (("node_groups", 0, "name"), "name"),
    (("node_groups", 0, "gpus", "kind"), "kind"),
    (("node_groups", 0, "intra", "bandwidth"), "bandwidth"),
    (("node_groups", 0, "nic", "latency"), "latency"),
    (("fabric",), "mapping"),
    (("fabric", "bandwidth"), "bandwidth"),
    (("fabric", "latency"), "latency"),
    (("fabric", "type"), "linktype"),
    (("fabric", "nics"), "count"),
    (("fabric", "switches"), "mapping"),
    (("fabric", "switches", "leaves", 0, "name"), "name"),
    (("fabric", "switches", "leaves", 0, "uplink", "bandwidth"), "bandwidth"),
    (("fabric", "switches", "leaves", 0, "uplink", "latency"), "latency"),
    (("fabric", "switches", "leaves", 1, "uplink"), "mapping"),
    (("fabric", "switches", "spines"), "count"),
    (("overrides",), "list"),
    (("overrides", 0, "devices", 0), "device_ref"),
    (("overrides", 0, "devices", 1), "device_ref"),
    (("overrides", 0, "bandwidth"), "bandwidth"),
    (("overrides", 0, "latency"), "latency"),
    (("overrides", 1, "nodes", 0), "node_ref"),
    (("overrides", 1, "nodes", 1), "node_ref"),
    (("overrides", 0), "mapping"),
    (("emulation", "enabled"), "bool"),
    (("emulation", "namespaces"), "bool"),
    (("emulation", "bandwidth_scale"), "scale"),
    (("emulation", "slowdown", "v100"), "scale"),
    (("emulation", "slowdown"), "mapping"),
]
# Values that are fine at some paths (e.g. `name: null` means "the file name").
ALLOWED = {("name",): [None], ("fabric", "switches", "spines"): [None],
           ("fabric", "switches"): [None], ("fabric",): [None], ("gpu_kinds",): [None],
           ("nodes", 0, "intra"): [None], ("gpu_kinds", "a10"): [None]}

# (path to delete, path the error must name)
REQUIRED = [
    (("nodes", 0, "gpus"), "nodes[0].gpus"),
    (("nodes", 1, "gpus", 1, "kind"), "nodes[1].gpus[1].kind"),
    (("node_groups", 0, "count"), "node_groups[0].count"),
    (("node_groups", 0, "gpus"), "node_groups[0].gpus"),
    (("gpu_kinds", "custom-gpu", "memory"), "gpu_kinds.custom-gpu.memory"),
    (("gpu_kinds", "custom-gpu", "memory_bandwidth"), "gpu_kinds.custom-gpu.memory_bandwidth"),
    (("gpu_kinds", "custom-gpu", "flops"), "gpu_kinds.custom-gpu.flops.fp32"),
    (("fabric", "switches", "leaves"), "fabric.switches.leaves"),
    (("fabric", "switches", "spines"), "fabric.switches.spines"),
    (("fabric", "switches", "leaves", 0, "name"), "fabric.switches.leaves[0].name"),
    (("fabric", "switches", "leaves", 1, "uplink"), "fabric.switches.leaves[1].uplink"),
    (("overrides", 0, "devices"), "overrides[0]"),
    (("overrides", 1, "bandwidth"), "overrides[1]"),
]


def path_text(path: tuple) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out or "<top level>"


def set_at(data: Any, path: tuple, value: Any) -> None:
    for p in path[:-1]:
        data = data[p]
    data[path[-1]] = value


def del_at(data: Any, path: tuple) -> None:
    for p in path[:-1]:
        data = data[p]
    del data[path[-1]]


def load_text(text: str | bytes, name: str = "bad cluster.yaml") -> tuple[Cluster, str]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / name
        if isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(text, encoding="utf-8")
        return load_cluster(str(path)), str(path)


DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def dump(data: Any) -> str:
    return yaml.dump(data, Dumper=DUMPER, sort_keys=False)


def expect_error(data: Any, field: str) -> str:
    text = dump(data)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bad cluster.yaml"
        path.write_text(text, encoding="utf-8")
        with pytest.raises(ClusterError) as info:
            load_cluster(str(path))
    message = str(info.value)
    # the field itself, or a field inside it (a dict given for a kind: its unknown key)
    assert re.search(re.escape(f"{path}: {field}") + r"[:.\[]", message), message
    return message


# --- valid files -------------------------------------------------------------------------

def test_base_file_is_valid() -> None:
    c, _ = load_text(dump(BASE))
    assert c.name == "lab" and c.num_devices == 11
    assert [n.name for n in c.nodes] == ["n0", "n1", "v-0", "v-1"]
    assert c.nodes[1].gpus == ["custom-gpu", "a10", "a10"]
    assert c.kinds["a10"].memory_bandwidth == 560e9 and c.kinds["a10"].flops("bf16") == 125e12
    assert c.kinds["custom-gpu"].flops("fp16") == 20e12  # no fp16 given: falls back to fp32
    assert c.nodes[2].gpus == ["v100-32gb"] * 2
    # leaves: n0 named leaf0; the rest spread evenly in order (i * 2 // 4)
    assert [n.leaf for n in c.nodes] == ["leaf0", "leaf0", "leaf1", "leaf1"]
    assert c.overrides[1].scope == "node" and (c.overrides[1].a, c.overrides[1].b) == (0, 2)
    assert c.emulation.slowdown == {"v100-32gb": 2.0} and c.emulation.namespaces is False


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_load(path: Path) -> None:
    c = load_cluster(str(path))
    assert c.num_devices > 0 and c.source == str(path)
    bw = bandwidth_matrix(c)
    assert bw.shape == (c.num_devices, c.num_devices) and (bw > 0).all()


def test_example_mixed_overrides() -> None:
    c = load_cluster(str(Path(EXAMPLES[0].parent / "mixed-a100-v100.yaml")))
    bw, lat = bandwidth_matrix(c), latency_matrix(c)
    assert bw[8, 16] == 5e9 and bw[0, 16] == 12.5e9       # node override a100-1 <-> v100-0
    assert bw[24, 27] == 25e9 and lat[27, 24] == 9e-6      # "v100-1:0" <-> "v100-1:3"


def test_field_by_field_defaults() -> None:
    c = parse_yaml_text(textwrap.dedent("""
        fabric: {bandwidth: 400 Gb/s}
        nodes:
          - {gpus: {kind: h100, count: 2}}
          - {gpus: {kind: h100, count: 2}, nic: {latency: 3 us, count: 1}, intra: {type: pcie, bandwidth: 64 GB/s}}
          - {gpus: [t4]}
    """), source="d.yaml")
    tpl = NODE_TEMPLATES["h100-80gb"]
    a, b, t = c.nodes
    assert c.name == "d" and [n.name for n in c.nodes] == ["node0", "node1", "node2"]
    assert a.intra == tpl.intra and a.nics == tpl.nics
    assert a.nic.bandwidth == 50e9 and a.nic.kind == tpl.nic.kind and a.nic.latency == tpl.nic.latency
    assert b.nic.latency == 3e-6 and b.nics == 1 and b.nic.bandwidth == 50e9
    assert b.intra.kind == "pcie" and b.intra.latency == DEFAULT_LATENCY["pcie"]
    assert t.intra == NODE_TEMPLATES["t4"].intra and t.nic.bandwidth == 50e9


def test_custom_kind_needs_links() -> None:
    with pytest.raises(ClusterError, match=r"x.yaml: nodes\[0\].intra.bandwidth: required"):
        parse_yaml_text("gpu_kinds: {g: {flops: {fp32: 1e12}, memory: 1 GiB, memory_bandwidth: 1e11}}\n"
                        "nodes: [{gpus: [g]}]", source="x.yaml")


def test_tensor_sustained_scales_tensor_dtypes_and_round_trips() -> None:
    """An H100 sustains 0.853 of its datasheet tensor rate on GEMMs (measured), x 0.936 fitted on
    llm-foundry's H100 runs (bench/validate.py); fp32 CUDA cores are not scaled; a kind 'like' it
    inherits the fraction, a file may set it, and it is written back."""
    from plait.cluster.loader import dump_cluster

    h100 = GPU_KINDS["h100-80gb"]
    assert h100.tensor_sustained == pytest.approx(0.853 * 0.936)
    assert h100.flops("bf16") == pytest.approx(989.4e12 * h100.tensor_sustained)
    assert h100.flops("fp32") == 67e12
    assert GPU_KINDS["a100-80gb"].flops("bf16") == 312e12
    c = parse_yaml_text("gpu_kinds: {mine: {like: h100}, cool: {like: h100, tensor_sustained: 0.95}}\n"
                        "nodes: [{gpus: {kind: mine, count: 1}}, {gpus: {kind: cool, count: 1}}]")
    assert c.kinds["mine"].flops("bf16") == h100.flops("bf16")
    assert c.kinds["cool"].flops("fp16") == pytest.approx(989.4e12 * 0.95)
    again = parse_yaml_text(dump_cluster(c))
    assert again.kinds["cool"].tensor_sustained == 0.95 and again.kinds["mine"].tensor_sustained == h100.tensor_sustained
    with pytest.raises(ClusterError, match=r"gpu_kinds\.g\.tensor_sustained"):
        parse_yaml_text("gpu_kinds: {g: {like: a100, tensor_sustained: 1.5}}\nnodes: [{gpus: [g]}]")


def test_memory_sustained_scales_streaming_bandwidth_and_round_trips() -> None:
    """A kind's streaming bandwidth is its datasheet figure x `memory_sustained` (1 for the A100 the
    constants were fitted on); a file may set it, a catalog kind's own figure is inherited by a kind
    'like' it, it is written back, and a figure past the datasheet is refused naming the field."""
    from plait.cluster.loader import dump_cluster

    a100 = GPU_KINDS["a100-80gb"]
    assert a100.memory_sustained == 1.0 and a100.streaming_bandwidth == a100.memory_bandwidth
    c = parse_yaml_text("gpu_kinds: {slowmem: {like: a100, memory_sustained: 0.8}, same: {like: v100}}\n"
                        "nodes: [{gpus: {kind: slowmem, count: 1}}, {gpus: {kind: same, count: 1}}]")
    assert c.kinds["slowmem"].streaming_bandwidth == pytest.approx(0.8 * a100.memory_bandwidth)
    assert c.kinds["same"].memory_sustained == GPU_KINDS["v100-16gb"].memory_sustained
    again = parse_yaml_text(dump_cluster(c))
    assert again.kinds["slowmem"].memory_sustained == 0.8
    with pytest.raises(ClusterError, match=r"gpu_kinds\.g\.memory_sustained"):
        parse_yaml_text("gpu_kinds: {g: {like: a100, memory_sustained: 1.5}}\nnodes: [{gpus: [g]}]")


def test_fitted_factors_apply_on_the_kinds_figures_and_come_off_again() -> None:
    """The catalog's per-kind factors (fitted by bench/validate.py) multiply the kind's own figures;
    `unfitted` gives back the figures before the fit, where the bench fits from."""
    from plait.cluster.catalog import FITTED, unfitted

    assert set(FITTED) <= set(GPU_KINDS) and "a100-80gb" not in FITTED  # the reference the model was fitted on
    for name, (tensor, memory) in FITTED.items():
        kind, before = GPU_KINDS[name], unfitted(GPU_KINDS[name])
        assert kind.tensor_sustained == pytest.approx(before.tensor_sustained * tensor)
        assert kind.streaming_bandwidth == pytest.approx(before.memory_bandwidth * before.memory_sustained * memory)
    assert unfitted(GPU_KINDS["h100-80gb"]).tensor_sustained == pytest.approx(0.853)
    assert unfitted(GPU_KINDS["v100-16gb"]).flops("fp16") == pytest.approx(125e12)


def test_like_kind_inherits_template_and_figures() -> None:
    c = parse_yaml_text("gpu_kinds: {slow-a100: {like: a100, flops: {bf16: 200 TFLOPS}}}\n"
                        "nodes: [{gpus: {kind: slow-a100, count: 2}}]")
    kind = c.kinds["slow-a100"]
    assert kind.flops("bf16") == 200e12 and kind.flops("tf32") == 156e12
    assert kind.memory_bytes == GPU_KINDS["a100-80gb"].memory_bytes
    assert c.nodes[0].intra == NODE_TEMPLATES["a100-80gb"].intra


# --- specific errors ---------------------------------------------------------------------

@pytest.mark.parametrize("text, fragment", [
    ("nodes: [{gpus: {kind: a100, count: 8}}, {gpus: {kind: a100, count: 8}},"
     " {gpus: {kind: a100}, intra: {bandwidth: -5 GB/s}}]",
     "nodes[2].intra.bandwidth: must be > 0, got '-5 GB/s'"),
    ("nodes: [{gpus: {kind: b200}}]", "nodes[0].gpus.kind: unknown GPU kind 'b200'; known: "),
    ("nodes: [{gpus: {kind: a100}, intra: {bandwith: 5 GB/s}}]",
     "nodes[0].intra.bandwith: unknown field (did you mean 'bandwidth'?)"),
    ("nodes: [{name: a, gpus: [t4]}, {name: a, gpus: [t4]}]", "nodes[1].name: duplicate node name 'a'"),
    ("name: x", "nodes: required field is missing"),
    ("nodes: []", "nodes: a cluster needs at least one node"),
    ("nodes: [{gpus: [t4]}]\noverrides: [{devices: [0, 0], bandwidth: 1 GB/s}]",
     "overrides[0].devices: a device pair needs two different devices"),
    ("nodes: [{gpus: [t4]}]\nfabric: {switches: {leaves: 2}}",
     "fabric.switches.leaves.uplink: required"),
    ("nodes: [{gpus: [t4]}]\nfabric: {switches: {leaves: {count: 2, uplink: {bandwidth: 1 GB/s}}}}",
     "fabric.switches.spines: 2 leaves need at least one spine"),
    ("nodes: [{gpus: [t4]}]\nemulation: {slowdown: {a100: 2}}",
     "emulation.slowdown.a100: kind 'a100-80gb' is not used by this cluster"),
    ("nodes: [{gpus: [t4]}]\nnodes: [{gpus: [t4]}]", "line 2, column 1: not valid YAML: duplicate key 'nodes'"),
    ("nodes: [{gpus: [t4]}\n", "not valid YAML"),
    ("- 1\n- 2", "<top level>: expected a mapping"),
    ("nodes: [{gpus: {kind: t4, count: 40000}}, {gpus: {kind: t4, count: 40000}}]",
     "nodes[1].gpus.count: must be between 1 and 25536"),
])
def test_specific_errors(text: str, fragment: str) -> None:
    with pytest.raises(ClusterError) as info:
        load_text(text, name="c.yaml")
    message = str(info.value)
    assert "c.yaml: " in message and fragment in message, message


def test_missing_and_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(ClusterError, match="nope.yaml: no such cluster file"):
        load_cluster(str(tmp_path / "nope.yaml"))
    (tmp_path / "d.yaml").mkdir()
    with pytest.raises(ClusterError, match="d.yaml: is a directory"):
        load_cluster(str(tmp_path / "d.yaml"))
    with pytest.raises(ClusterError, match="not UTF-8"):
        load_text(b"nodes: \xff\xfe", name="bin.yaml")


# --- generated bad input -----------------------------------------------------------------

def budget(n: int) -> settings:
    return settings(max_examples=n, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


@budget(80)
@given(st.sampled_from(TARGETS).flatmap(
    lambda t: st.tuples(st.just(t[0]), st.sampled_from(BAD[t[1]]))))
def test_bad_value_names_file_and_field(case: tuple[tuple, Any]) -> None:
    path, value = case
    if value in ALLOWED.get(path, []) and value is not True:
        return
    data = copy.deepcopy(BASE)
    set_at(data, path, value)
    expect_error(data, path_text(path))


@pytest.mark.parametrize("path, field", REQUIRED, ids=[f for _, f in REQUIRED])
def test_missing_required_field(path: tuple, field: str) -> None:
    data = copy.deepcopy(BASE)
    del_at(data, path)
    expect_error(data, field)


def _mappings(data: Any, path: tuple = ()) -> list[tuple]:
    """Paths of every mapping in `data` whose keys are field names (not kind names)."""
    out = []
    if isinstance(data, dict):
        if path not in (("gpu_kinds",), ("emulation", "slowdown")):
            out.append(path)
        for k, v in data.items():
            out += _mappings(v, path + (k,))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            out += _mappings(v, path + (i,))
    return out


@budget(30)
@given(st.sampled_from(_mappings(BASE)), st.sampled_from(["bandwith", "lattency", "gpu", "x"]))
def test_unknown_field_is_named(path: tuple, key: str) -> None:
    data = copy.deepcopy(BASE)
    target = data
    for p in path:
        target = target[p]
    target[key] = 1
    expect_error(data, path_text(path + (key,)))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.floats(allow_nan=True)
    | st.text(max_size=8) | st.sampled_from(["t4", "a100", "200 Gb/s", "2 us", "leaf0", "n0:1"]),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.sampled_from(["name", "gpus", "kind", "count", "bandwidth", "latency",
                                       "intra", "nic", "type", "leaves", "spines", "uplink"])
                      | st.text(max_size=5), children, max_size=4),
    max_leaves=12,
)


def _all_paths(data: Any, path: tuple = ()) -> list[tuple]:
    out = [path] if path else []
    if isinstance(data, dict):
        for k, v in data.items():
            out += _all_paths(v, path + (k,))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            out += _all_paths(v, path + (i,))
    return out


@budget(40)
@given(st.sampled_from(_all_paths(BASE)), json_values)
def test_any_replacement_is_valid_or_cluster_error(path: tuple, value: Any) -> None:
    """Never another exception: replace any part of a valid file with arbitrary data."""
    data = copy.deepcopy(BASE)
    set_at(data, path, value)
    try:
        load_text(dump(data))
    except ClusterError as exc:
        assert "bad cluster.yaml: " in str(exc)


@budget(40)
@given(st.dictionaries(st.sampled_from(["name", "nodes", "node_groups", "gpu_kinds", "fabric",
                                        "overrides", "emulation", "extra"]), json_values, max_size=5))
def test_random_documents_are_valid_or_cluster_error(data: dict) -> None:
    try:
        c, _ = load_text(dump(data))
        assert c.num_devices >= 1
    except ClusterError as exc:
        assert "bad cluster.yaml: " in str(exc)


@budget(50)
@given(st.one_of(st.text(max_size=200), st.binary(max_size=200)))
def test_garbage_files_raise_cluster_error(garbage: str | bytes) -> None:
    try:
        load_text(garbage)
    except ClusterError as exc:
        assert "bad cluster.yaml: " in str(exc)
    else:  # pragma: no cover - random bytes are never a cluster
        raise AssertionError(f"garbage accepted: {garbage!r}")


def test_max_devices_guard() -> None:
    assert MAX_DEVICES == 65536
