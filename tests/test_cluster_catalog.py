"""GPU catalog: the required kinds, dense figures, honest fallbacks, aliases, node templates."""

from __future__ import annotations

import pytest

from plait.cluster.catalog import GPU_KINDS, NODE_TEMPLATES, get_kind, resolve_kind_name
from plait.cluster.spec import DTYPES, ClusterError

REQUIRED = ["v100-16gb", "v100-32gb", "t4", "a10", "l40s", "rtx-3090", "rtx-4090", "a100-40gb",
            "a100-80gb", "h100-80gb", "h200"]


def test_required_kinds_present_with_templates() -> None:
    assert set(REQUIRED) <= set(GPU_KINDS)
    for name in REQUIRED:
        kind = GPU_KINDS[name]
        assert kind.name == name
        assert set(kind.peak_flops) <= set(DTYPES) and "fp32" in kind.peak_flops
        assert kind.memory_bytes >= 16 * 2**30 and kind.memory_bandwidth >= 300e9
        assert name in NODE_TEMPLATES


@pytest.mark.parametrize("name, fp32, tf32, bf16, fp16, mem_gib, mem_bw", [
    # dense datasheet figures (tensor "with sparsity" figures halved)
    ("v100-32gb", 15.7e12, None, None, 125e12, 32, 900e9),
    ("t4", 8.1e12, None, None, 65e12, 16, 320e9),
    ("a100-80gb", 19.5e12, 156e12, 312e12, 312e12, 80, 2039e9),
    ("a100-40gb", 19.5e12, 156e12, 312e12, 312e12, 40, 1555e9),
    ("h100-80gb", 67e12, 494.7e12, 989.4e12, 989.4e12, 80, 3350e9),
    ("h200", 67e12, 494.7e12, 989.4e12, 989.4e12, 141, 4800e9),
    ("l40s", 91.6e12, 183e12, 362.05e12, 362.05e12, 48, 864e9),
    ("rtx-4090", 82.6e12, 82.6e12, 165.2e12, 165.2e12, 24, 1008e9),
])
def test_datasheet_figures(name, fp32, tf32, bf16, fp16, mem_gib, mem_bw) -> None:
    kind = GPU_KINDS[name]
    assert kind.peak_flops.get("fp32") == fp32
    assert kind.peak_flops.get("tf32") == tf32
    assert kind.peak_flops.get("bf16") == bf16
    assert kind.peak_flops.get("fp16") == fp16
    assert kind.memory_bytes == mem_gib * 2**30
    assert kind.memory_bandwidth == mem_bw


def test_kinds_without_tf32_bf16_fall_back_to_fp32() -> None:
    for name in ("v100-16gb", "v100-32gb", "t4"):
        kind = GPU_KINDS[name]
        assert "tf32" not in kind.peak_flops and "bf16" not in kind.peak_flops
        assert kind.flops("bf16") == kind.flops("tf32") == kind.flops("fp32")
        assert kind.peak_flops["fp16"] > 4 * kind.peak_flops["fp32"]  # tensor cores are real for fp16
        assert kind.flops("fp16") > 3 * kind.flops("fp32")  # and sustained (the T4's power cap: 28.5 vs 8.1)


def test_tensor_cores_faster_than_cuda_cores() -> None:
    for kind in GPU_KINDS.values():
        for dtype in ("bf16", "fp16"):
            assert kind.flops(dtype) >= kind.flops("fp32")


@pytest.mark.parametrize("alias, canonical", [
    ("a100-80g", "a100-80gb"), ("A100_80GB", "a100-80gb"), ("a100", "a100-80gb"),
    ("A100-40GB", "a100-40gb"), ("v100", "v100-32gb"), ("V100-16G", "v100-16gb"),
    ("h100", "h100-80gb"), ("H100-SXM", "h100-80gb"), ("h200", "h200"), ("RTX 3090", "rtx-3090"),
    ("rtx4090", "rtx-4090"), ("4090", "rtx-4090"), ("L40S", "l40s"), ("a10g", "a10"), ("T4", "t4"),
])
def test_aliases(alias, canonical) -> None:
    assert resolve_kind_name(alias) == canonical
    assert get_kind(alias) is GPU_KINDS[canonical]


def test_unknown_kind_lists_known() -> None:
    assert resolve_kind_name("b200") is None
    with pytest.raises(ClusterError, match="unknown GPU kind 'b200'.*a100-80gb"):
        get_kind("b200")


def test_node_templates_are_per_direction_figures() -> None:
    assert NODE_TEMPLATES["a100-80gb"].intra.bandwidth == 300e9  # NVLink 3: 600 GB/s both ways
    assert NODE_TEMPLATES["a100-80gb"].nic.bandwidth == 25e9 and NODE_TEMPLATES["a100-80gb"].nics == 8
    assert NODE_TEMPLATES["v100-32gb"].intra.bandwidth == 150e9  # NVLink 2
    assert NODE_TEMPLATES["h100-80gb"].intra.bandwidth == 450e9  # NVLink 4
    assert NODE_TEMPLATES["t4"].intra.kind == "pcie"


@pytest.mark.parametrize("name, fp32, fp16, mem_gib, mem_bw", [
    # NVIDIA Tesla P100 datasheet: SXM2 and PCIe parts; no tensor cores, fp16 = 2x fp32
    ("p100-16gb", 10.6e12, 21.2e12, 16, 732e9),
    ("p100-pcie-16gb", 9.3e12, 18.7e12, 16, 732e9),
    ("p100-pcie-12gb", 9.3e12, 18.7e12, 12, 549e9),
])
def test_p100_datasheet(name, fp32, fp16, mem_gib, mem_bw) -> None:
    kind = GPU_KINDS[name]
    assert kind.peak_flops == {"fp32": fp32, "fp16": fp16}
    assert kind.flops("bf16") == kind.flops("tf32") == fp32
    assert kind.memory_bytes == mem_gib * 2**30 and kind.memory_bandwidth == mem_bw
    assert name in NODE_TEMPLATES


def test_p100_aliases_and_dgx1_template() -> None:
    assert resolve_kind_name("P100") == resolve_kind_name("p100-sxm2") == "p100-16gb"
    assert resolve_kind_name("P100-PCIe") == "p100-pcie-16gb"
    assert resolve_kind_name("p100-pcie-12gb") == "p100-pcie-12gb"
    dgx1 = NODE_TEMPLATES["p100-16gb"]
    assert dgx1.intra.bandwidth == 80e9 and dgx1.intra.kind == "nvlink"  # NVLink 1: 4 x 20 GB/s
    assert dgx1.nics == 4 and "DGX-1 (P100)" in dgx1.source


def test_t4_tensor_rate_is_its_power_capped_one() -> None:
    """A T4 under its 70 W cap runs back-to-back fp16 4096^3 GEMMs at about 24 TFLOP/s, not the
    datasheet's 65 (NVIDIA developer forum, topic 264462): the catalog's T4 predicts that rate."""
    from plait.cost.compute import gemm_time

    n = 4096
    assert 2 * n**3 / gemm_time(n, n, n, GPU_KINDS["t4"], "fp16") == pytest.approx(24e12, rel=0.01)
