"""The one device model (issue 27): the planner's SPMD device groups and the simulator's view are
two views of `plait.cost.devices.DeviceModel`, built from one cluster's facts."""

from __future__ import annotations

import numpy as np

from plait.cluster import load_cluster
from plait.cost.devices import DeviceModel
from plait.cost.spmd import Devices
from plait.net.view import ClusterView


def test_the_planner_and_the_simulator_read_one_device_model():
    cluster = load_cluster("emulated-mixed")
    view = ClusterView.from_cluster(cluster)
    model = DeviceModel.of_cluster(cluster)
    assert isinstance(view, DeviceModel)
    for name in ("node_of", "bandwidth", "latency"):
        assert np.array_equal(getattr(view, name), getattr(model, name))
    assert (view.kinds, view.node_nics, view.measured) == (model.kinds, model.node_nics, model.measured)
    ids = [3, 0, 2]
    a, b = Devices.from_cluster(cluster, "fp16", ids), Devices.of(view, "fp16", ids)
    assert a.names == b.names and a.links == b.links == view.group(ids) and a.ids == b.ids == tuple(ids)
    assert np.array_equal(a.flops, b.flops) and np.array_equal(a.memory, b.memory)


def test_a_hand_built_view_prices_spmd_groups_too():
    from plait.cluster.catalog import GPU_KINDS

    view = ClusterView.uniform(4, GPU_KINDS["a100-80gb"], 2, 300e9, 2e-6, inter_bandwidth=25e9)
    d = Devices.of(view, "bf16")
    assert d.n == 4 and d.links.inter_bandwidth == 25e9 and d.links.intra_bandwidth == 300e9
    assert d.names[2] == "gpu 2 (a100-80gb, node 1)"
