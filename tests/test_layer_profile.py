"""Per-layer profiler (`plait.measure.layer_profile`) and the simulator's use of measured layer times."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch
from torch import nn

from plait.cluster.catalog import GPU_KINDS
from plait.cost.compute import ComputeModel
from plait.graph.resolve import resolve_model
from plait.graph.zoo import ModelSpec
from plait.ir.opgraph import Layer, OpGraph
from plait.ir.plan import Plan
from plait.measure.layer_profile import (
    LayerProfile,
    LayerProfileError,
    profile_layer_times,
    profile_layers,
)
from plait.net.view import ClusterView
from plait.sim.api import simulate

TINY = "gpt:layers=2,hidden=32,heads=2,seq=8,vocab=64"
A100, V100 = GPU_KINDS["a100-80gb"], GPU_KINDS["v100-32gb"]
ZERO = ComputeModel(host_fwd_s=0.0, host_bwd_s=0.0, host_comm_s=0.0, p2p_host_s=0.0, loss_host_s=0.0,
                    batch_host_s=0.0, step_host_s=0.0, optimizer_bytes_per_param=0.0, kernel_gpu_s=0.0)


class _SleepBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:
        time.sleep(0.03)
        return g


class _SlowForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.03)
        return self.lin(x)


class _SlowBackward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(_SleepBackward.apply(x))


def _sleepy_spec() -> ModelSpec:
    """Three layers: a plain linear, one that sleeps 30 ms in forward, one that sleeps 30 ms in
    backward (and makes the output, so it also runs the loss)."""

    def construct() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 4), _SlowForward(), _SlowBackward())

    def make_batch(batch: int, gen: torch.Generator, dtype: torch.dtype) -> tuple:
        return (torch.randn(batch, 4, generator=gen, dtype=dtype),), torch.randint(0, 3, (batch,), generator=gen)

    return ModelSpec(name="sleepy", config={}, construct=construct, make_batch=make_batch,
                     loss_fn=nn.functional.cross_entropy)


def test_times_land_on_the_layer_that_spends_them() -> None:
    prof = profile_layers(_sleepy_spec(), micro_batch=2, repeats=3, warmup=1)
    assert list(prof.times) == ["0", "1", "2"]  # layer_assignment names of a Sequential
    assert prof.loss_layer == "2"
    (f0, b0), (f1, b1), (f2, b2) = prof.times["0"], prof.times["1"], prof.times["2"]
    assert f1 >= 0.03 and f0 < 0.03 and f2 < 0.03
    assert b2 >= 0.03 and b0 < 0.03 and b1 < 0.03
    assert prof.params == {"0": 20, "1": 20, "2": 15}
    assert all(v > 0 for v in prof.optimizer.values())
    assert prof.optimizer_total_s > 0
    assert set(prof.spread) == set(prof.times)


def test_gpt_layers_match_the_opgraph_and_count_tied_weights_once() -> None:
    prof = profile_layers(TINY, micro_batch=2, repeats=2, warmup=1)
    graph = resolve_model(TINY, Plan(micro_batch=2, global_batch=2, dtype="fp32"))
    assert list(prof.times) == [layer.name for layer in graph.layers]
    assert all(f > 0 and b > 0 for f, b in prof.times.values())
    assert prof.loss_layer == "head"
    from plait.graph.zoo import load_model

    model = load_model(TINY).build()
    assert sum(prof.params.values()) == sum(p.numel() for p in model.parameters())
    assert prof.threads == 1
    assert prof.to_dict()["layers"]["head"]["params"] == prof.params["head"]
    again = LayerProfile.from_dict(json.loads(json.dumps(prof.to_dict())))
    assert again.times == prof.times and again.params == prof.params and again.optimizer == prof.optimizer
    assert again.optimizer_total_s == prof.optimizer_total_s
    with pytest.raises(LayerProfileError, match="layers"):
        LayerProfile.from_dict({"model": "x"})


def test_reset_gradients_option_leaves_no_accumulated_gradient() -> None:
    """With accumulate=False every repetition starts from fresh gradients; by default they pile up
    over the repetitions, as over a step's micro-batches."""
    spec = _sleepy_spec()
    fresh = profile_layers(spec, micro_batch=2, repeats=1, warmup=0, optimizer=False, accumulate=False)
    piled = profile_layers(spec, micro_batch=2, repeats=1, warmup=0, optimizer=False)
    assert set(fresh.times) == set(piled.times) == {"0", "1", "2"}


def test_mean_statistic() -> None:
    prof = profile_layers(TINY, micro_batch=1, repeats=5, warmup=0, optimizer=False, statistic="mean")
    assert prof.statistic == "mean" and all(f > 0 for f, _ in prof.times.values())


def test_shard_hook_profiles_one_tensor_rank() -> None:
    """With the runtime's Megatron slicing (collectives replaced by no-ops) a transformer layer holds
    half its matrices, and every layer is handed to the hook."""
    from plait.runtime.comm import NullGroup
    from plait.runtime.tensor_parallel import (
        TPContext,
        apply_tensor_parallel,
        is_tensor_parallel_layer,
    )

    seen: list[str] = []
    ctx = TPContext(group=NullGroup(2), size=2, rank=0)

    def shard(name: str, module: nn.Module) -> None:
        seen.append(name)
        if is_tensor_parallel_layer(module):
            apply_tensor_parallel(module, ctx, None)

    full = profile_layers(TINY, micro_batch=2, repeats=1, warmup=0, optimizer=False)
    half = profile_layers(TINY, micro_batch=2, repeats=1, warmup=0, optimizer=False, tp=2, shard=shard)
    assert seen == list(full.times)
    assert half.tp == 2
    assert half.params["layers.0"] < 0.6 * full.params["layers.0"]
    assert half.params["embed"] == full.params["embed"]  # the runtime keeps embeddings replicated


@pytest.mark.parametrize("kwargs, field", [({"micro_batch": 0}, "micro_batch"), ({"dtype": "int8"}, "dtype"),
                                            ({"repeats": 0}, "repeats"), ({"threads": 0}, "threads"),
                                            ({"statistic": "mode"}, "statistic")])
def test_bad_arguments_name_the_field(kwargs: dict, field: str) -> None:
    args = {"micro_batch": 1, **kwargs}
    with pytest.raises(LayerProfileError, match=field):
        profile_layer_times(TINY, **args)


def test_unknown_model_object_is_rejected() -> None:
    with pytest.raises(LayerProfileError, match="model_spec"):
        profile_layer_times(object(), 1)


# ---------------------------------------------------------------- the simulator's side
def _two_kinds(kinds: list) -> ClusterView:
    bw = np.full((2, 2), 10e9)
    lat = np.full((2, 2), 5e-6)
    np.fill_diagonal(lat, 0.0)
    return ClusterView(kinds=kinds, node_of=np.array([0, 0]), bandwidth=bw, latency=lat)


def _chain(n: int = 2) -> OpGraph:
    layers = [Layer(name=f"l{i}", kind="Linear", param_count=10) for i in range(n)]
    return OpGraph(model="chain", layers=layers, layer_edges=[(a.name, b.name) for a, b in zip(layers, layers[1:])])


def test_layer_times_scale_with_the_kind() -> None:
    """Data parallelism on an A100 and a V100: given times are the fastest kind's; the V100 replica
    takes peak(A100)/peak(V100) longer by default, or the explicit `layer_time_scale`."""
    times = {"l0": (1e-3, 2e-3), "l1": (1e-3, 2e-3)}
    plan = Plan(dp=2, micro_batch=1, global_batch=2, dtype="fp32")
    graph = _chain()
    same = simulate(graph, _two_kinds([A100, A100]), plan, compute=ZERO, layer_times=times)
    mixed = simulate(graph, _two_kinds([A100, V100]), plan, compute=ZERO, layer_times=times)
    ratio = A100.flops("fp32") / V100.flops("fp32")
    comm = same.iteration_time_s - 6e-3
    assert mixed.iteration_time_s == pytest.approx(6e-3 * ratio + comm, rel=1e-9)
    explicit = simulate(graph, _two_kinds([A100, V100]), plan, compute=ZERO, layer_times=times,
                        layer_time_scale={V100.name: 3.0})
    assert explicit.iteration_time_s == pytest.approx(18e-3 + comm, rel=1e-9)


def test_each_transformer_layer_keeps_its_own_given_time() -> None:
    """Equal transformer layers share a cost in the compute model, but measured times differ."""
    spec = "gpt:layers=2,hidden=64,heads=2,seq=16,vocab=64"
    plan = Plan(micro_batch=1, global_batch=1, dtype="fp32")
    graph = resolve_model(spec, plan)
    times = {"embed": (0.0, 0.0), "layers.0": (1e-3, 1e-3), "layers.1": (5e-3, 5e-3), "head": (0.0, 0.0)}
    view = ClusterView.uniform(1, A100, 1, 10e9, 5e-6)
    res = simulate(graph, view, plan, compute=ZERO, layer_times=times, memory=False)
    assert res.iteration_time_s == pytest.approx(12e-3, rel=1e-5)  # + the input's host-to-device copy


def test_tensor_parallel_given_times_keep_the_collectives() -> None:
    """tp=2 with given times: the compute is the given one and Megatron's all-reduces are added,
    priced on the group's link (4 per transformer layer per micro-batch), each with the host's
    per-call cost (not part of a measured compute time)."""
    spec = "gpt:layers=1,hidden=64,heads=2,seq=16,vocab=64"
    plan = Plan(tp=2, micro_batch=1, global_batch=1, dtype="fp32", collectives={"tp": "ring"})
    graph = resolve_model(spec, plan)
    times = {"embed": (0.0, 0.0), "layers.0": (1e-3, 2e-3), "head": (0.0, 0.0)}
    bw, alpha = 1e9, 1e-4
    view = ClusterView.uniform(2, A100, 2, bw, alpha)
    host = 3e-5
    res = simulate(graph, view, plan, compute=ZERO.replace(host_comm_s=host), layer_times=times, memory=False,
                   granularity="layer")
    tl = res.timeline
    tp_ops = [e for e in tl.events if e.category == "comm_tp" and "layers.0" in e.name]
    assert len(tp_ops) == 4
    nbytes = 16 * 64 * 4  # micro-batch x seq x hidden, fp32
    per = 2 * alpha + nbytes / bw + host  # 2-rank ring all-reduce + the call
    compute = sum(e.duration for e in tl.events if e.category in ("forward", "backward") and e.device == 0
                  and "layers.0" in e.name)
    assert compute == pytest.approx(3e-3, rel=1e-9)
    assert sum(e.duration for e in tp_ops) == pytest.approx(4 * per, rel=1e-6)
