"""bench/validate.py and bench/source_fit.py (issue 37): source loading, the node layout, the fit per GPU kind
and engine, and the transcribed figures."""

import csv
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import source_fit as sf  # noqa: E402
import validate  # noqa: E402

from plait.cost.compute import DEFAULT_MODEL  # noqa: E402

ROW = dict(model="small", hidden=2048, heads=16, layers=2, ffn=8192, vocab=1024, seq=1024, global_batch=16,
           micro_batch=4, gpus=2, dp=2, tp=1, pp=1, zero=0, recompute="none", sequence_parallel="false",
           dtype="bf16", gpu="a100-80gb", gpus_per_node=8, nics="", engine="eager-fsdp", measured_s=0.01,
           memory_gib="", memory_kind="")


def write(path: Path, rows: list[dict]) -> Path:
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return path


def test_unknown_gpu_kind_names_file_row_and_field(tmp_path):
    p = write(tmp_path / "s.csv", [dict(ROW, gpu="no-such-gpu")])
    with pytest.raises(SystemExit, match=r"s\.csv: row 0, field 'gpu': 'no-such-gpu'"):
        validate.load_csv(p)


def test_template_cluster_fills_nodes_and_takes_the_sources_nic_count():
    c = validate.template_cluster("v100-16gb", 20, 8, nics=1)
    assert [len(n.gpus) for n in c.nodes] == [8, 8, 4]
    assert {n.nics for n in c.nodes} == {1}
    assert {n.nics for n in validate.template_cluster("v100-16gb", 8, 8).nodes} == {4}  # DGX-1 template


def test_a_fit_prices_each_cell_with_its_own_factors(tmp_path):
    """`predict` takes a row's constants from the fit's factors of its GPU kind, GEMM unit and engine
    family: a slower compute factor for another kind or unit changes nothing."""
    rows = validate.load_csv(write(tmp_path / "s.csv", [ROW]))
    for r in rows:
        r["family"] = sf.engine_family(r["engine"])
    src = validate.Source("s", "eager-fsdp", rows, validate.csv_simulator())
    shipped = validate.predict(src, rows, None)[0]
    assert validate.predict(src, rows, sf.Fit())[0] == shipped  # no factor: the shipped constants
    half = float(np.log(0.5))
    assert validate.predict(src, rows, sf.Fit(log={"compute:a100-80gb:tc": half}))[0] > shipped
    assert validate.predict(src, rows, sf.Fit(log={"host:eager": float(np.log(3))}))[0] > shipped
    for other in ("compute:a100-80gb:fp32", "compute:v100-16gb:tc", "host:fused", "memory:h100-80gb"):
        assert validate.predict(src, rows, sf.Fit(log={other: half}))[0] == shipped


def test_the_fit_recovers_known_factors_and_keeps_uninformed_ones():
    """Hand-made sources whose time is compute / gemm_efficiency + kernels x host_fwd_s: the
    Gauss-Newton fit finds the factors they were made with (compute x0.6 on one kind, host x2 on the
    eager engine) and leaves a factor no row informs at 1."""
    truth = {("k1", "eager"): (0.6, 2.0), ("k2", "eager"): (1.0, 2.0), ("k1", "fused"): (0.6, 1.0)}

    def simulate(rows, model):
        return np.array([r["flops"] / model.gemm_efficiency + r["kernels"] * model.host_fwd_s for r in rows])

    rows = []
    for (kind, family), (c, h) in truth.items():
        for flops, kernels in ((1.0, 1000), (0.5, 4000), (2.0, 500), (0.2, 6000)):
            rows.append(dict(gpu=kind, dtype="bf16", family=family, flops=flops, kernels=kernels,
                             measured_s=flops / (DEFAULT_MODEL.gemm_efficiency * c) + kernels * DEFAULT_MODEL.host_fwd_s * h))
    fit = sf.fit_factors([(simulate, rows)])
    factor = {k: np.exp(v) for k, v in fit.log.items()}
    assert factor["compute:k1:tc"] == pytest.approx(0.6, rel=0.02)
    assert factor["compute:k2:tc"] == pytest.approx(1.0, rel=0.02)
    assert factor["host:eager"] == pytest.approx(2.0, rel=0.02)
    assert "host:fused" not in factor  # the fused engine's host times are the reference fit's (held at 1)
    assert factor["memory:k1"] == pytest.approx(1.0, abs=1e-6)  # no row has memory time
    # the cell the shipped constants were fitted on is held at 1: its factors are never fitted
    ref = dict(sf.REFERENCE, flops=1.0, kernels=1000, measured_s=2.0)
    assert not {sf.group_key(g, ref) for g in sf.GROUPS} & set(sf.fit_factors([(simulate, [ref])]).log)
    assert sf.engine_family("megatron") == "fused" and sf.engine_family("eager-fsdp") == "eager"


def test_a_fraction_of_peak_never_exceeds_one():
    fit = sf.Fit(log={"compute:k:tc": 5.0, "memory:k": 5.0})
    m = fit.model(dict(gpu="k", dtype="fp16", family="eager"))
    assert m.gemm_efficiency == 1.0 and m.memory_efficiency == 1.0


def test_megatron_times_are_the_papers_flops_at_the_published_mfu():
    """Hand computation for the 22B row: 72 B s L h^2 (1 + s/6h + V/12Lh) / (MFU x GPUs x 312 TFLOP/s)."""
    r = validate.load_csv(validate.SOURCES_DIR / "megatron_korthikanti.csv")[0]
    B, s, L, h, V = 4, 2048, 48, 6144, 51200
    flops = 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))
    assert (r["hidden"], r["layers"], r["global_batch"], r["gpus"]) == (h, L, B, 8)
    assert r["measured_s"] == pytest.approx(flops / (0.415 * 8 * 312e12), rel=1e-4)


def test_hf_sources_transcribe_the_published_figures():
    """hf-ddp-titanrtx: train_runtime / 200 steps; hf-memory-v100-bert: train_runtime / 128 steps (512
    samples, batch 4) and NVML's used MiB, as the docs print them."""
    ddp = validate.load_csv(validate.SOURCES_DIR / "hf_ddp_titanrtx.csv")
    assert [round(r["measured_s"] * 200, 4) for r in ddp] == [101.9003, 131.4367]
    assert [(r["intra"], r["intra_gbs"]) for r in ddp] == [("nvlink", 50.0), ("pcie-shm", 15.75)]
    bert = validate.load_csv(validate.SOURCES_DIR / "hf_memory_v100_bert.csv")
    assert [round(r["measured_s"] * 128, 2) for r in bert] == [57.82, 66.03, 85.47, 27.46, 50.76]
    assert [round(r["memory_gib"] * 1024) for r in bert] == [14949, 8681, 6775, 13939, 7275]
    assert all(r["head_out"] == 2 and not r["causal"] for r in bert)


def test_the_sources_link_replaces_the_template_link():
    c = validate.template_cluster("titan-rtx", 2, 2, intra="pcie-shm", intra_gbs=15.75)
    assert c.nodes[0].intra.kind == "pcie" and c.nodes[0].intra.bandwidth == 15.75e9
    nv = validate.template_cluster("titan-rtx", 2, 2, intra="nvlink", intra_gbs=50)
    assert nv.nodes[0].intra.kind == "nvlink" and nv.nodes[0].intra.bandwidth == 50e9
    with pytest.raises(SystemExit, match="intra"):
        validate.template_cluster("titan-rtx", 2, 2, intra="carrier-pigeon", intra_gbs=1)


def test_a_slower_gpu_link_predicts_a_slower_ddp_step():
    """The two TITAN RTX rows differ only in the link: the PCIe one must be predicted slower."""
    rows = validate.load_csv(validate.SOURCES_DIR / "hf_ddp_titanrtx.csv")
    nvlink, pcie = validate.csv_simulator()(rows, DEFAULT_MODEL)
    assert pcie > nvlink


def test_classifier_head_graph_has_no_vocabulary_projection():
    r = validate.load_csv(validate.SOURCES_DIR / "hf_memory_v100_bert.csv")[0]
    g = validate.row_graph(r)
    head = g.layer("head")
    assert head.param_count == 2 * 1024 + 2 * 1024  # LayerNorm + the 2-way classifier, untied
    assert head.output_bytes == 512 * 2 * 4 and not g.tied
    assert g.config["causal"] is False
