"""Runtime pieces that need no worker processes: stage cutting, TP sharding math (two threads
standing in for two tensor ranks), data split, checkpoints, fault strings, failure diagnosis."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from plait.graph.zoo import load_model
from plait.ir.plan import Plan
from plait.ir.timeline import Timeline, TimelineEvent
from plait.runtime import checkpoint as ckpt
from plait.runtime.api import CheckpointConfig, RunResult, _check_plan, rank_layout, run
from plait.runtime.executor import _decode_header, _encode_header
from plait.runtime.inject import Fault, InjectError, Injection, fire, poison
from plait.runtime.launch import AgentSpec, Launcher, _Agent
from plait.runtime.partition import (
    RuntimeSetupError,
    layer_modules,
    make_samples,
    replica_micro_batches,
    split_into_stages,
)
from plait.runtime.rng_stream import RngStream
from plait.runtime.tensor_parallel import (
    ShardInfo,
    TPContext,
    apply_sequence_parallel,
    apply_tensor_parallel,
    is_tensor_parallel_layer,
    sequence_parallel_params,
    split_sizes,
)

TINY = "gpt:layers=4,hidden=16,heads=4,seq=8,vocab=32,dropout=0,attn_dropout=0"


# ---------------------------------------------------------------------------------- stages
def test_layers_follow_markers() -> None:
    model = load_model(TINY).build()
    assert [n for n, _ in layer_modules(model)] == ["embed", "layers.0", "layers.1", "layers.2", "layers.3", "head"]


@pytest.mark.parametrize("counts", [[1, 5], [2, 2, 2], [3, 1, 1, 1]])
def test_stages_compose_to_the_model(counts: list[int]) -> None:
    spec = load_model(TINY)
    model = spec.build(seed=1)
    inputs, _ = make_samples(spec, 0, 3, data_seed=0)
    stages = split_into_stages(model, counts)
    assert [len(s.layers) for s in stages] == counts
    values = stages[0].module(*inputs)
    for s in stages[1:]:
        values = s.module(*values)
    torch.testing.assert_close(values, model(*inputs), rtol=0, atol=0)
    # GPT ties its LM head to the word embedding: the same Parameter lives in the first and last stage.
    assert stages[-1].module.get_parameter("head.lm.weight") is stages[0].module.get_parameter("embed.tok.weight")


class _SkipModel(nn.Module):
    """Glue outside layers: a root parameter (get_attr), and a value used three layers later."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 4)
        self.d = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h0 = self.a(x) * self.scale
        h = self.c(self.b(h0))
        return self.d(h + h0) + y


def test_live_values_cross_several_cuts() -> None:
    model = _SkipModel()
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    stages = split_into_stages(model, [1, 1, 1, 1])
    # y (used at the end) and h0 are relayed; the glue add h + h0 runs as soon as h exists (stage 2).
    assert [s.output_names for s in stages[:3]] == [["y", "mul"], ["y", "mul", "b"], ["y", "add"]]
    v = stages[0].module(x, y)
    for s in stages[1:]:
        v = s.module(*v)
    torch.testing.assert_close(v, model(x, y))
    with pytest.raises(RuntimeSetupError, match="plan splits 5 layers but the model runs 4"):
        split_into_stages(model, [2, 3])


def test_untraceable_model_is_reported() -> None:
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x)) if x.sum() > 0 else self.a(x)

    with pytest.raises(RuntimeSetupError, match="torch.fx tracing failed"):
        split_into_stages(Branchy(), [1, 1])


# ---------------------------------------------------------------------------------- data
@settings(max_examples=60, deadline=None)
@given(dp=st.integers(1, 4), mb=st.integers(1, 4), mult=st.integers(1, 4), step=st.integers(0, 3),
       raw=st.lists(st.floats(0.05, 1.0), min_size=4, max_size=4), uneven=st.booleans())
def test_replicas_cover_the_global_batch_once(dp: int, mb: int, mult: int, step: int, raw: list[float],
                                              uneven: bool) -> None:
    shares = [r / sum(raw[:dp]) for r in raw[:dp]] if uneven else None
    plan = Plan(dp=dp, micro_batch=mb, global_batch=dp * mb * mult, dp_shares=shares)
    seen: list[int] = []
    for d in range(dp):
        mbs = replica_micro_batches(plan, step, d)
        assert sum(m.size for m in mbs) == plan.samples_per_replica()[d]
        assert all(1 <= m.size <= mb for m in mbs)
        seen += [m.first + i for m in mbs for i in range(m.size)]
        if not uneven:
            assert [m.size for m in mbs] == [mb] * plan.num_micro_batches
    g = plan.global_batch
    assert sorted(seen) == list(range(step * g, (step + 1) * g))


def test_samples_do_not_depend_on_the_split() -> None:
    spec = load_model(TINY)
    whole = make_samples(spec, 5, 6, data_seed=3)
    a, b = make_samples(spec, 5, 2, data_seed=3), make_samples(spec, 7, 4, data_seed=3)
    torch.testing.assert_close(whole[0][0], torch.cat([a[0][0], b[0][0]]))
    torch.testing.assert_close(whole[1], torch.cat([a[1], b[1]]))
    assert not torch.equal(whole[1], make_samples(spec, 5, 6, data_seed=4)[1])


# ---------------------------------------------------------------------------------- tensor parallel
@given(total=st.integers(1, 200), raw=st.lists(st.floats(0.01, 1.0), min_size=1, max_size=5))
def test_split_sizes_proportional(total: int, raw: list[float]) -> None:
    ratios = [r / sum(raw) for r in raw]
    sizes = split_sizes(total, len(ratios), ratios)
    assert sum(sizes) == total
    assert all(abs(s - r * total) < 1 for s, r in zip(sizes, ratios))


def test_shard_info_roundtrip() -> None:
    full = torch.arange(2 * 12 * 3, dtype=torch.float32).view(24, 3)
    info = ShardInfo(0, 2, (5, 7))  # two fused blocks of 12 rows, cut 5 | 7
    shards = [info.take(full, t) for t in range(2)]
    assert [s.shape[0] for s in shards] == [10, 14]
    torch.testing.assert_close(shards[0][:5], full[:5])
    torch.testing.assert_close(shards[0][5:], full[12:17])
    torch.testing.assert_close(info.assemble(shards), full)


class _ThreadTP(TPContext):
    """Stands in for a tensor-parallel group: ranks are threads, all-reduce sums through a barrier."""

    def __init__(self, size: int, rank: int, shared: dict) -> None:
        super().__init__(group=None, size=size, rank=rank)
        self.shared = shared

    def all_reduce(self, t: torch.Tensor, name: str) -> torch.Tensor:
        box, barrier = self.shared["box"], self.shared["barrier"]
        box[self.rank] = t.detach().clone()
        barrier.wait()
        total = sum(box[r] for r in range(self.size))
        barrier.wait()
        return total


@pytest.mark.parametrize("ratios", [None, [0.75, 0.25]])
def test_tensor_parallel_block_equals_full_block(ratios: list[float] | None) -> None:
    """Megatron f/g conjugates: sharded forward and backward of a zoo transformer block equal the full one."""
    spec = load_model("gpt:layers=1,hidden=16,heads=4,seq=5,vocab=11,dropout=0,attn_dropout=0")
    full = spec.build(seed=2).layers[0]
    assert is_tensor_parallel_layer(full) and not is_tensor_parallel_layer(spec.build().head)
    x = torch.randn(5, 3, 16)
    xf = x.clone().requires_grad_(True)
    out_full = full(xf)
    out_full.square().sum().backward()
    shared = {"box": {}, "barrier": threading.Barrier(2)}
    results: dict[int, tuple] = {}
    blocks = [spec.build(seed=2).layers[0] for _ in range(2)]  # build seeds the global RNG: not in threads

    def rank_main(t: int) -> None:
        block = blocks[t]
        infos = apply_tensor_parallel(block, _ThreadTP(2, t, shared), ratios, prefix="")
        xs = x.clone().requires_grad_(True)
        out = block(xs)
        out.square().sum().backward()
        results[t] = (out.detach(), xs.grad, dict(block.named_parameters()), infos)

    threads = [threading.Thread(target=rank_main, args=(t,)) for t in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    expected_heads = [2, 2] if ratios is None else [3, 1]
    assert results[0][3]["attn.qkv.weight"].sizes == tuple(h * 12 for h in expected_heads)
    for t in range(2):
        torch.testing.assert_close(results[t][0], out_full.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(results[t][1], xf.grad, rtol=1e-5, atol=1e-6)
    for name, p in full.named_parameters():
        info = results[0][3].get(name)
        if info is None:  # replicated: identical gradient on both ranks
            grad = results[0][2][name].grad
            torch.testing.assert_close(results[1][2][name].grad, grad)
        else:
            grad = info.assemble([results[t][2][name].grad for t in range(2)])
        torch.testing.assert_close(grad, p.grad, rtol=1e-5, atol=1e-6)


class _ThreadSP(_ThreadTP):
    """Thread tensor group with the sequence-parallel collectives (along dim 0, the zoo's [s, b, h])."""

    def __init__(self, size: int, rank: int, shared: dict) -> None:
        super().__init__(size, rank, shared)
        self.sequence_parallel = True

    def _exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        box, barrier = self.shared["box"], self.shared["barrier"]
        box[self.rank] = t.detach().clone()
        barrier.wait()
        parts = [box[r] for r in range(self.size)]
        barrier.wait()
        self.shared.setdefault("log", []).append(self.rank)
        return parts

    def all_gather(self, t: torch.Tensor, name: str) -> torch.Tensor:
        return torch.cat(self._exchange(t), dim=0)

    def reduce_scatter(self, t: torch.Tensor, name: str) -> torch.Tensor:
        return sum(self._exchange(t)).chunk(self.size, dim=0)[self.rank].contiguous()

    def all_reduce(self, t: torch.Tensor, name: str) -> torch.Tensor:
        raise AssertionError(f"sequence parallelism must not all-reduce activations ({name})")


def test_sequence_parallel_block_equals_full_block() -> None:
    """g-bar/g conjugates with the sequence cut (Korthikanti et al. 2022, §4.2.2): a zoo block entered
    and left as its own region equals the full block; LayerNorm and row-bias gradients, summed over
    the ranks, equal the full ones."""
    spec = load_model("gpt:layers=1,hidden=16,heads=4,seq=6,vocab=11,dropout=0,attn_dropout=0")
    full = spec.build(seed=3).layers[0]
    x = torch.randn(6, 3, 16)
    xf = x.clone().requires_grad_(True)
    out_full = full(xf)
    out_full.square().sum().backward()
    shared = {"box": {}, "barrier": threading.Barrier(2)}
    results: dict[int, tuple] = {}
    blocks = [spec.build(seed=3).layers[0] for _ in range(2)]

    def rank_main(t: int) -> None:
        block = blocks[t]
        tp = _ThreadSP(2, t, shared)
        infos = apply_tensor_parallel(block, tp, None)
        apply_sequence_parallel(block, tp, enter=True, leave=True)
        sp_params = {id(p) for p in sequence_parallel_params(block, infos)}
        xs = x.clone().requires_grad_(True)
        out = block(xs)
        out.square().sum().backward()
        results[t] = (out.detach(), xs.grad, dict(block.named_parameters()), infos, sp_params)

    threads = [threading.Thread(target=rank_main, args=(t,)) for t in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(results) == 2
    replicated = {n for n, p in results[0][2].items() if id(p) in results[0][4]}
    assert replicated == {"ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias", "attn.proj.bias", "mlp.fc2.bias"}
    for t in range(2):
        torch.testing.assert_close(results[t][0], out_full.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(results[t][1], xf.grad, rtol=1e-5, atol=1e-6)
    for name, p in full.named_parameters():
        info = results[0][3].get(name)
        grads = [results[t][2][name].grad for t in range(2)]
        grad = sum(grads) if info is None else info.assemble(grads)
        if info is None:  # each rank saw half the tokens: a partial sum, not a replica
            assert not torch.allclose(grads[0], p.grad)
        torch.testing.assert_close(grad, p.grad, rtol=1e-5, atol=1e-6)
    # Forward: 2 gathers, 2 reduce-scatters, the leave gather; backward: the same again and the enter gather.
    assert shared["log"].count(0) == 10


def test_sequence_parallel_needs_divisible_sequence() -> None:
    with pytest.raises(RuntimeSetupError, match="sequence length 7 does not divide by tp=2"):
        TPContext(None, 2, 0, sequence_parallel=True).split(torch.zeros(7, 1, 4))
    with pytest.raises(RuntimeSetupError, match="'sequence_parallel': the sequence length 9 of gpt"):
        run("gpt:layers=2,hidden=16,heads=4,seq=9,vocab=32", None, "tp=2,sequence_parallel=true", steps=1)


def test_private_rng_stream_leaves_the_outer_stream_alone() -> None:
    torch.manual_seed(5)
    expected_outer = torch.rand(4)
    torch.manual_seed(5)
    inner = RngStream(99, cuda=False)
    torch.manual_seed(99)
    expected_inner = torch.rand(4)
    torch.manual_seed(5)
    got_outer, got_inner = [], []
    for _ in range(2):  # draws alternate between the streams; each continues where it stopped
        got_outer.append(torch.rand(2))
        inner.enter()
        got_inner.append(torch.rand(2))
        inner.leave()
    assert torch.equal(torch.cat(got_inner), expected_inner)
    torch.manual_seed(5)
    assert torch.equal(torch.cat(got_outer), expected_outer)
    copy = RngStream(0, cuda=False)
    copy.load_state_dict(inner.state_dict())
    copy.enter()
    a = torch.rand(3)
    copy.leave()
    inner.enter()
    assert torch.equal(torch.rand(3), a)
    inner.leave()


def test_tensor_parallel_rejects_indivisible_heads() -> None:
    block = load_model("gpt:layers=1,hidden=12,heads=3,seq=4,vocab=8").build().layers[0]
    with pytest.raises(RuntimeSetupError, match="3 heads, not divisible by tp=2"):
        apply_tensor_parallel(block, TPContext(None, 2, 0), None)


# ---------------------------------------------------------------------------------- pipeline header
def test_pipeline_header_roundtrip() -> None:
    meta = [("t", (8, 2, 16), torch.float32, True), ("c", (2, 8), None, False), ("t", (2,), torch.int64, False)]
    assert _decode_header(_encode_header(meta, torch.device("cpu"))) == meta


# ---------------------------------------------------------------------------------- checkpoints
# Checkpoint directories (DCP, manifest, fallback, old format): tests/test_checkpoint_dcp.py.
def test_interrupted_write_keeps_previous_file(tmp_path: Path) -> None:
    path = tmp_path / "f.json"
    ckpt.atomic_write_bytes(path, lambda f: f.write(b"1"))

    def crash(f: object) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ckpt.atomic_write_bytes(path, crash)
    assert path.read_bytes() == b"1"


# ---------------------------------------------------------------------------------- faults, diagnosis
def test_fault_strings() -> None:
    """The process faults of --inject (the spec language itself: tests/test_inject.py)."""
    inj = Injection.parse("hang:rank=1,step=2; kill:rank=0,step=3,at=checkpoint; inf:rank=1,step=0")
    assert inj.at(1, 2, "step", ("hang",)) == Fault("hang", 1, 2)
    assert inj.at(0, 3, "checkpoint", ("kill",)) == Fault("kill", 0, 3, at="checkpoint")
    assert inj.at(0, 3, "step", ("kill",)) is None and not Injection.parse("")
    with pytest.raises(InjectError):
        Injection.parse("explode:rank=0,step=1")
    with pytest.raises(RuntimeError, match="injected fault on rank 2 at step 5"):
        fire(Fault("error", 2, 5))
    params = [nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(3))]
    params[1].grad = torch.ones(3)
    assert inj.at(0, 0, "step", ("inf",)) is None  # another rank
    poison(p.grad for p in params)
    assert params[1].grad.tolist() == [float("inf"), 1.0, 1.0]


def _launcher(tmp_path: Path, world: int = 2) -> Launcher:
    for sub in ("hb", "status"):
        (tmp_path / sub).mkdir()
    layout = [{"rank": r, "device": r, "node": r, "host": f"node{r}"} for r in range(world)]
    launcher = Launcher(tmp_path / "config.json", tmp_path, [AgentSpec(0, "node0", list(range(world)))], layout,
                        timeout=5.0, startup_timeout=60.0)
    launcher._running.append(_Agent(launcher.agents[0], None, tmp_path / "agent0.log",  # type: ignore[arg-type]
                                    tmp_path / "agent0.failures.json"))
    return launcher


def _put(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data))


def test_diagnosis_blames_the_killed_rank_not_its_peers(tmp_path: Path) -> None:
    launcher = _launcher(tmp_path)
    now = time.time()
    _put(tmp_path / "hb/rank0.json", {"pid": 1, "phase": "error", "step": 3, "progress": now})
    _put(tmp_path / "hb/rank1.json", {"pid": 2, "phase": "train", "step": 3, "progress": now - 1})
    _put(tmp_path / "status/rank0.json", {"state": "error", "time": now, "step": 3, "phase": "train",
                                          "error": "DistBackendError: Connection closed by peer", "peer_error": True})
    _put(tmp_path / "agent0.failures.json", {"failures": {
        "1": {"local_rank": 1, "pid": 2, "exitcode": -9, "timestamp": now, "signal": "SIGKILL"},
        "0": {"local_rank": 0, "pid": 1, "exitcode": 1, "timestamp": now - 0.5, "signal": None}}})
    failure = launcher._diagnose_exit()
    assert failure.rank == 1 and failure.host == "node1" and failure.kind == "died"
    assert "rank 1 (host node1, device 1) died at step 3 (killed by SIGKILL)" in str(failure)


def test_diagnosis_names_the_rank_that_stopped_making_progress(tmp_path: Path) -> None:
    launcher = _launcher(tmp_path, world=3)
    now = time.time()
    _put(tmp_path / "hb/rank0.json", {"pid": 1, "phase": "train", "step": 2, "progress": now - 9,
                                      "waiting": "allreduce dp bucket0"})
    _put(tmp_path / "hb/rank1.json", {"pid": 2, "phase": "train", "step": 2, "progress": now - 9.5, "waiting": None})
    _put(tmp_path / "hb/rank2.json", {"pid": 3, "phase": "train", "step": 2, "progress": now - 9,
                                      "waiting": "recv fwd"})
    failure = launcher._find_hang(started=now - 100)
    assert failure is not None and failure.rank == 1 and failure.kind == "hang"
    assert "rank 1 (host node1, device 1) hung at step 2" in str(failure)
    assert "ranks 0, 2 were waiting for it" in str(failure)
    _put(tmp_path / "hb/rank1.json", {"pid": 2, "phase": "train", "step": 2, "progress": now - 1, "waiting": None})
    assert launcher._find_hang(started=now - 100) is None  # a slow step within the timeout is fine


# ---------------------------------------------------------------------------------- layout, API checks
def test_rank_layout_places_ranks_and_slowdowns(tmp_path: Path) -> None:
    from plait.cluster import load_cluster

    path = tmp_path / "c.yaml"
    path.write_text(EMU_YAML.format(namespaces="false"))
    cluster = load_cluster(str(path))
    plan = Plan(dp=2, global_batch=2, device_order=[1, 0], dtype="fp32")
    layout = rank_layout(cluster, plan)
    assert [(i["device"], i["host"], i["kind"], i["slowdown"]) for i in layout] == [
        (1, "slownode", "slow", 3.0), (0, "fastnode", "fast", 1.0)]
    with pytest.raises(RuntimeSetupError, match="needs 4 devices but the cluster has 2"):
        rank_layout(cluster, Plan(dp=4, global_batch=4))


def test_run_rejects_what_it_cannot_run() -> None:
    _check_plan(Plan(pp=2, schedule="interleaved", virtual_stages=2, global_batch=2))  # runs since issue 11
    _check_plan(Plan(pp=2, zero=3, global_batch=2))  # on the torch engine since issue 29
    with pytest.raises(RuntimeSetupError, match="zero=3.*engine=plait"):  # what the run asks counts too
        _check_plan(Plan(pp=2, zero=3, global_batch=2), {"engine": "plait"})
    with pytest.raises(RuntimeSetupError, match="checkpoint directory"):
        run(TINY, None, "dp=1", steps=1, checkpoint=CheckpointConfig(resume=True))
    with pytest.raises(RuntimeSetupError, match="steps must be >= 1"):
        run(TINY, None, "dp=1", steps=0)


def test_step_timeline_rebases_one_iteration() -> None:
    ev = [TimelineEvent("fwd", "forward", "dev0/compute", 1.0 + s, 1.2 + s, 0, 0, 0, {"step": s}) for s in range(2)]
    result = RunResult("m", "c", "p", "gloo", "cpu", [0, 1], [1.0, 0.9], [0.5, 0.5], Timeline(ev, "measured"), [],
                       step_bounds=[(1.0, 1.5), (2.0, 2.5)])
    one = result.step_timeline(1)
    assert [(e.start, e.end) for e in one.events] == [(0.0, pytest.approx(0.2))]
    assert one.meta["iteration_time"] == 0.5


EMU_YAML = """
name: emu2
gpu_kinds:
  fast: {{flops: {{fp32: 20 TFLOPS}}, memory: 16 GiB, memory_bandwidth: 700 GB/s}}
  slow: {{flops: {{fp32: 10 TFLOPS}}, memory: 16 GiB, memory_bandwidth: 300 GB/s}}
nodes:
  - {{name: fastnode, gpus: {{kind: fast, count: 1}}, intra: {{type: pcie, bandwidth: 16 GB/s}}}}
  - {{name: slownode, gpus: {{kind: slow, count: 1}}, intra: {{type: pcie, bandwidth: 16 GB/s}}}}
fabric: {{type: ethernet, bandwidth: 10 Gb/s, latency: 50 us}}
emulation: {{enabled: true, namespaces: {namespaces}, bandwidth_scale: 0.1, slowdown: {{slow: 3.0}}}}
"""


def test_zero3_hooks_free_gather_and_reduce_in_layer_order() -> None:
    """ZeRO-3 in one process (dp=1: the collectives are copies): parameters hold no storage outside
    their layer's forward/backward, each micro-batch gathers and reduces per layer in the order the
    ghost rounds replay, and the step equals plain training (gradient accumulation over 2 micro-batches)."""
    from plait.runtime.data_parallel import make_optimizer
    from plait.runtime.partition import layer_modules, load_model_spec, make_samples
    from plait.runtime.recorder import Recorder
    from plait.runtime.zero3 import Zero3Step

    spec = load_model_spec("gpt:layers=2,hidden=16,heads=4,seq=8,vocab=32,dropout=0,attn_dropout=0")
    plain, sharded = (spec.build(device="cpu", dtype=torch.float32, seed=0) for _ in range(2))
    cfg = {"name": "adamw", "lr": 1e-2}
    opt = make_optimizer(list(plain.parameters()), cfg)
    z3 = Zero3Step(sharded, layer_modules(sharded), lambda ps: make_optimizer(ps, cfg), None, 1, 0,
                   Recorder(0, 0, 0))
    assert [u.name for u in z3.units] == ["embed", "layers.0", "layers.1", "head"] and z3.root is not None
    shard_bytes = sum(u.shard_param.numel() * 4 for u in z3.all_units)
    assert z3.resident_param_bytes() == shard_bytes  # nothing gathered between steps
    z3.begin_step()  # the root (tied embedding / LM head) stays gathered for the step
    for mb in range(2):
        inputs, target = make_samples(spec, 2 * mb, 2, 0)
        (spec.loss(plain(*inputs), target) / 2).backward()
        loss = spec.loss(sharded(*inputs), target) / 2
        assert all(u.full.untyped_storage().nbytes() == 0 for u in z3.units)  # freed after each forward
        loss.backward()
        assert all(p.grad is None for u in z3.units for p in u.params)  # reduced into the shards at once
    assert z3.sequence == z3.expected_round * 2
    assert z3.step()
    opt.step()
    assert z3.resident_param_bytes() == shard_bytes
    z3.gather_all()
    for (name, a), b in zip(plain.named_parameters(), sharded.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=name)


# ---------------------------------------------------------------------------------- stage graphs
class _Diamond(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(4, 4) for _ in range(4))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return self.d(self.b(h) * self.c(h * 0.5) + h) + y


def test_stage_graph_cut_routes_values_along_edges() -> None:
    from plait.runtime.partition import split_into_graph

    model = _Diamond()
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    stages = split_into_graph(model, [["a"], ["b"], ["c"], ["d"]], [(0, 1), (0, 2), (1, 3), (2, 3), (0, 3)])
    # The skip edge a -> d carries h and the model input y; the branch merge b * c runs in d.
    assert stages[0].send == {1: ["tanh"], 2: ["mul"], 3: ["y", "tanh"]}
    assert stages[3].recv == {0: ["y", "tanh"], 1: ["b"], 2: ["c"]} and stages[3].data_inputs == []
    out0 = dict(zip(stages[0].output_names, stages[0].module(x, y)))
    vals = {0: out0}
    for k in (1, 2):
        (v,) = stages[k].module(*[out0[n] for n in stages[k].recv[0]])
        vals[k] = {stages[k].output_names[0]: v}
    args = [vals[p][n] for p in sorted(stages[3].recv) for n in stages[3].recv[p]]
    torch.testing.assert_close(stages[3].module(*args), model(x, y))
    # Without the skip edge, h and y are relayed through b (the first path of the DAG).
    relayed = split_into_graph(model, [["a"], ["b"], ["c"], ["d"]], [(0, 1), (0, 2), (1, 3), (2, 3)])
    assert relayed[1].send == {3: ["y", "tanh", "b"]}
    with pytest.raises(RuntimeSetupError, match="one sink"):
        split_into_graph(model, [["a"], ["b"], ["c"], ["d"]], [(0, 1), (0, 2), (0, 3)])
    with pytest.raises(RuntimeSetupError, match="does not reach"):
        split_into_graph(model, [["a"], ["b"], ["c"], ["d"]], [(0, 1), (1, 3), (2, 3), (0, 2)][:3] + [(2, 0)])


class _WithStatelessLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)
        self.drop = nn.Dropout(0.0)  # runs no op: the capture has no layer 'drop', plans never name it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.drop(torch.tanh(self.a(x))))


def test_stage_graph_cut_traces_a_stateless_layer_no_plan_names_as_glue() -> None:
    """BertForSequenceClassification's p=0 dropout: a graph plan from the captured layers left it
    out and the cut refused it ('layers ['drop'] are in no stage'). Without parameters or buffers
    it is traced through; a layer with parameters left out is still refused."""
    from plait.runtime.partition import split_into_graph

    model = _WithStatelessLayer()
    x = torch.randn(3, 4)
    stages = split_into_graph(model, [["a"], ["b"]], [(0, 1)])
    (h,) = stages[0].module(x)
    torch.testing.assert_close(stages[1].module(h), model(x))
    with pytest.raises(RuntimeSetupError, match=r"layers \['b'\] are in no stage"):
        split_into_graph(model, [["a"]], [])


# ---------------------------------------------------------------------------------- clip-grad
@pytest.mark.parametrize("zero", [0, 1])
def test_clip_grad_step_equals_clip_grad_norm(zero: int) -> None:
    """One process: the optimizer steps clip exactly like torch.nn.utils.clip_grad_norm_, and a
    parameter with copy weight 1/2 (held by two ranks) counts half in the norm."""
    from plait.runtime.clip import GradClipper, clip_coefficient
    from plait.runtime.data_parallel import DataParallelStep, Zero1Step, make_optimizer
    from plait.runtime.recorder import Recorder

    torch.manual_seed(0)
    ref, mine = nn.Linear(5, 3), nn.Linear(5, 3)
    mine.load_state_dict(ref.state_dict())
    for m in (ref, mine):
        m.weight.grad = torch.full_like(m.weight, 2.0)
        m.bias.grad = torch.full_like(m.bias, -1.0)
    sgd = {"name": "sgd", "lr": 0.5}
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.3)
    make_optimizer(list(ref.parameters()), sgd).step()
    params = list(mine.parameters())
    rec = Recorder(0, 0, 0)
    step = DataParallelStep(params, lambda p: make_optimizer(p, sgd), None, 1, rec) if zero == 0 else \
        Zero1Step(params, lambda p: make_optimizer(p, sgd), None, 1, 0, rec)
    step.clip = GradClipper(0.3, {id(p): 1.0 for p in params})
    assert step.step()
    for a, b in zip(ref.parameters(), mine.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-7)
    assert step.clip.norms == [pytest.approx((15 * 4 + 3) ** 0.5)]
    half = GradClipper(100.0, {id(params[0]): 0.5})
    params[0].grad, params[1].grad = torch.ones_like(params[0]), torch.ones_like(params[1])
    assert half.clip_params(params, replicas=1) == pytest.approx((15 * 0.5 + 3) ** 0.5)
    assert clip_coefficient(10.0, 1.0) == pytest.approx(1.0 / (10.0 + 1e-6)) and clip_coefficient(0.5, 1.0) == 1.0


def test_zoo_multi_branch_model_cuts_into_a_stage_graph() -> None:
    """MMT (one branch per input, a merging head) as branch stages -> head: each branch stage reads
    the model inputs itself (no stage reaches both branches), and the head gets one tensor per edge."""
    from plait.runtime.executor import _data_args
    from plait.runtime.partition import split_into_graph

    spec = load_model("mmt:branches=2,layers=2,hidden=16,heads=2,seq=4,in_dim=8,dropout=0")
    model = spec.build(seed=0).eval()
    inputs, _ = make_samples(spec, 0, 3, data_seed=0)
    names = [n for n, _ in layer_modules(model)]
    branches = [[n for n in names if n.startswith(f"branches.{i}.")] for i in range(2)]
    stages = split_into_graph(model, branches + [["head"]], [(0, 2), (1, 2)])
    assert [s.data_inputs for s in stages] == [[0], [0], []] and stages[0].varargs
    outs = {k: dict(zip(stages[k].output_names, stages[k].module(*_data_args(stages[k], inputs)))) for k in (0, 1)}
    args = [outs[p][n] for p in sorted(stages[2].recv) for n in stages[2].recv[p]]
    torch.testing.assert_close(stages[2].module(*args), model(*inputs), rtol=0, atol=0)
    # As a chain, the second branch's input is indexed out on stage 0 and relayed (not the tuple).
    chain = split_into_stages(model, [3, 4])
    assert chain[1].input_names == ["branches_0_layers_1", "getitem_1"]
    torch.testing.assert_close(chain[1].module(*chain[0].module(*_data_args(chain[0], inputs))), model(*inputs))


def test_graph_plan_ranks_owners_and_per_replica_actions() -> None:
    # A stage graph whose stages have 1, 3 and 2 replicas (the last dealt 3:1 by dp_shares): ranks are
    # (stage, replica) stage-major on the stages' devices; every action of a stage's graph 1F1B runs on
    # exactly the replica that owns its micro-batch, and each send/recv names the owning peer replica.
    from plait.ir.plan import StageSpec
    from plait.ir.stage_graph import deal_micro_batches
    from plait.runtime.layout import (
        node_micro_batches,
        owned_micro_batches,
        peer_rank,
        pipeline_layout,
        rank_actions,
        step_schedule,
    )

    plan = Plan(stages=[StageSpec(name="a", layers=["a"], devices=[5]),
                        StageSpec(name="b", layers=["b"], devices=[2, 3, 4], dp=3, micro_batch=1),
                        StageSpec(name="c", layers=["c"], devices=[0, 1], dp=2, dp_shares=[0.75, 0.25])],
                stage_edges=[(0, 1), (0, 2), (1, 2)], micro_batch=2, global_batch=8)
    lay = pipeline_layout(plan)
    assert lay.stage_ranks == ((0,), (1, 2, 3), (4, 5))
    assert [lay.coords(r) for r in range(6)] == [(0, 0), (1, 0), (1, 1), (1, 2), (2, 0), (2, 1)]
    assert [plan.device_of(r) for r in range(6)] == [5, 2, 3, 4, 0, 1]
    assert lay.owners == ((0, 0, 0, 0), (0, 1, 2, 0, 1, 2, 0, 1), (0, 0, 1, 0))  # 3:1, ties to replica 0
    mbs = node_micro_batches(plan, lay, 1, 0)
    assert [(m.first, m.size) for m in mbs[2]] == [(8, 2), (10, 2), (12, 2), (14, 2)]
    for r, units in enumerate(deal_micro_batches(8, 2, [0.75, 0.25], 2)):  # the stage graph's one deal
        assert [m.first - 8 for m in owned_micro_batches(lay, 2, r, mbs[2])] == [u.first for u in units]
    sched = step_schedule(plan, lay, mbs, "1f1b")
    peer = peer_rank(plan, lay, 0, 0)
    for s in range(3):
        per_replica = [rank_actions(sched, lay, s, r) for r in range(lay.replicas(s))]
        assert sorted(map(str, sched.of(s))) == sorted(str(a) for acts in per_replica for a in acts)
        for r, acts in enumerate(per_replica):
            assert all(lay.owners[s][a.micro_batch] == r for a in acts)
            for a in acts:
                if a.peer is not None:
                    assert lay.coords(peer(*a.peer)) == (a.peer[0], lay.owners[a.peer[0]][a.peer[2]])


@pytest.mark.distributed
def test_a_lopsided_pipeline_runs_with_a_note_and_a_balanced_one_without() -> None:
    """Issue 38: a split no planner picks (the embedding alone on stage 0, every block and the head
    on stage 1) runs, and the result says which stage computed how much more; Megatron's default
    split of the same model says nothing."""
    lopsided = run(TINY, None, Plan(pp=2, layer_split=[1, 5], micro_batch=2, global_batch=4, dtype="fp32"),
                   steps=3)
    note = next(n for n in lopsided.notes if n.startswith("pipeline:"))
    assert "stage 1 computed" in note and "stage 0" in note
    balanced = run(TINY, None, Plan(pp=2, micro_batch=2, global_batch=4, dtype="fp32"), steps=3)
    assert not any(n.startswith("pipeline:") for n in balanced.notes)
