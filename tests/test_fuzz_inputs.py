"""Property-based fuzzing of every parser the CLI hands user text to (issue 12, item 5).

Plan strings, plan JSON files (raw bytes: invalid UTF-8, deep or oddly typed JSON) and
cluster YAML / preset strings go through the same functions `plait simulate`, `plait run`
and `plait plan` call (`Plan.load`, `plait.cluster.load_cluster`). The only exception any of
them may raise is PlaitError (which the CLI prints as one line): never a traceback.
"""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plait.cluster import load_cluster
from plait.cluster.loader import parse_yaml_text
from plait.errors import PlaitError
from plait.ir.plan import Plan

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

PLAN_KEYS = ["dp", "tp", "pp", "micro_batch", "global_batch", "recompute", "zero", "schedule", "virtual_stages",
             "sequence_parallel", "dtype", "layer_split", "dp_shares", "tp_ratios", "device_order",
             "collective.dp", "collective.tp", "stages", "dpp", ""]
VALUES = st.one_of(
    st.integers(-3, 70).map(str),
    st.sampled_from(["true", "maybe", "none", "full", "interleaved", "fp16", "nan", "inf", "-0", "1e309",
                     "0.5:0.5", "1:2:3", "0:0", "", ":", "9" * 5000, "ring", "x"]),
    st.lists(st.floats(allow_nan=True, allow_infinity=True), max_size=5).map(lambda xs: ":".join(map(str, xs))),
    st.text(max_size=8),
)
PLAN_STRINGS = st.one_of(
    st.text(max_size=60),
    st.lists(st.tuples(st.sampled_from(PLAN_KEYS), VALUES), max_size=8).map(
        lambda kv: ",".join(f"{k}={v}" for k, v in kv)),
    st.integers(1, 64).map(lambda n: f"dp={n},global_batch={n},dp_shares=" + ":".join([f"{1 / n:.6g}"] * n)),
)

JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=6))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(PLAN_KEYS + ["name", "layers", "devices"]),
                                                 inner, max_size=4)), max_leaves=12)
PLAN_DICTS = st.dictionaries(st.sampled_from(PLAN_KEYS[:-2] + ["stage_edges", "collectives", "plan"]),
                             JSON_VALUES, max_size=6)
PLAN_BYTES = st.one_of(
    st.binary(max_size=80),
    PLAN_DICTS.map(lambda d: json.dumps(d).encode()),
    PLAN_DICTS.map(lambda d: json.dumps(d).encode() + b"\xff\xfe"),
    st.integers(1, 5000).map(lambda n: b"[" * n + b"]" * n),
    st.integers(1, 5000).map(lambda n: b'{"plan":' * n + b"1" + b"}" * n),
    st.sampled_from([b'{"dp": 1e999}', b'{"dp": ' + b"9" * 5000 + b"}", b'{"dp": NaN}', b'"dp=2"', b"\xef\xbb\xbf{}"]),
)

YAML_TEXT = st.one_of(
    st.text(max_size=120),
    st.lists(st.sampled_from([
        "name: x", "nodes:", "  - name: a", "    gpus: [a100, a100]", "    gpus: 4", "    count: -1",
        "gpus_per_node: 8", "kind: v100", "  - {gpus: a100-80g, count: 2}", "intra_node: {bandwidth: 300 GB/s}",
        "inter_node: {bandwidth: -1, latency: 2 us}", "fabric:", "  nic: {bandwidth: 200 Gb/s}",
        "emulation: {enabled: true}", "gpu_kinds:", "  foo: {peak_tflops: x}", "&a [*a]", "? [1]", "x: !!python/object:os.system",
        "overrides:", "  - {a: 0, b: 1, bandwidth: 1 GB/s}", "nodes: 3", "- 1", "  : :",
    ]), max_size=10).map("\n".join),
)
CLUSTER_STRINGS = st.one_of(
    st.text(max_size=40),
    st.tuples(st.sampled_from(["a100-80g", "dgx-h100", "mixed-a100-v100", "uneven", "emulated-mixed", "v100", "h100"]),
              st.lists(st.tuples(st.sampled_from(["nodes", "gpus_per_node", "a100_nodes", "slow_fraction",
                                                  "slow_factor", "nics", "intra", "zz"]), VALUES), max_size=3))
    .map(lambda t: t[0] + ":" + ",".join(f"{k}={v}" for k, v in t[1])),
    st.just("x" * 400),
)


def _only_plait_errors(call, *args) -> None:
    try:
        call(*args)
    except PlaitError:
        pass


@FUZZ
@given(PLAN_STRINGS)
def test_plan_strings_raise_only_plait_errors(text: str) -> None:
    _only_plait_errors(Plan.load, text)


@FUZZ
@given(PLAN_BYTES)
def test_plan_files_raise_only_plait_errors(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "plan.json"
    path.write_bytes(data)
    _only_plait_errors(Plan.load, str(path))


@FUZZ
@given(PLAN_DICTS)
def test_plan_objects_raise_only_plait_errors(data: dict) -> None:
    _only_plait_errors(Plan.from_dict, data)


@FUZZ
@given(YAML_TEXT)
def test_cluster_yaml_raises_only_plait_errors(tmp_path: Path, text: str) -> None:
    _only_plait_errors(parse_yaml_text, text)
    path = tmp_path / "c.yaml"
    path.write_bytes(text.encode("utf-8", "surrogatepass") + b"\n\xff")
    _only_plait_errors(load_cluster, str(path))


@FUZZ
@given(CLUSTER_STRINGS)
def test_cluster_strings_raise_only_plait_errors(text: str) -> None:
    _only_plait_errors(load_cluster, text)
