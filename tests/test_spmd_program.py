"""Per-rank SPMD programs (plait.runtime.spmd_program): run on 2 gloo ranks with uneven ratios, a
program's loss and every parameter's gradient equal the single-device ones (fp32, 1e-5) on small
BERT, ViT, VGG and BERT-MoE -- for the synthesized program and for random valid programs (which
exercise every conversion: padded and grouped uneven gathers and reduce-scatters, all-reduces,
all-to-alls, vocabulary-parallel lookups); bad programs are refused naming the op or device."""

from __future__ import annotations

import dataclasses
import functools
import multiprocessing as mp
import random
import traceback

import numpy as np
import pytest
import torch

from plait.graph.aten_capture import capture_aten
from plait.graph.sharding import strategies
from plait.graph.zoo import load_model
from plait.ir.program import PARTIAL, REPLICATED, ShardingError, Strategy, conversion, shard_dim
from plait.net.ports import free_port

MODELS = {
    "bert": "bert:layers=1,hidden=24,heads=4,seq=8,vocab=40,dropout=0,attn_dropout=0",
    "vit": "vit:layers=1,hidden=24,heads=4,patch=8,image=24,classes=6",
    "vgg19": "vgg19:width=8,fc=16,image=32,pool=1,classes=6,dropout=0",
    "bert_moe": "bert_moe:layers=2,hidden=24,heads=4,seq=8,vocab=40,experts=4,dropout=0,attn_dropout=0",
}
BATCH = 6
RATIOS = [0.7, 0.3]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@functools.cache
def captured(name: str):
    spec = load_model(MODELS[name])
    model = spec.build(seed=0)
    inputs, target = spec.sample_batch(BATCH, seed=1)
    return spec, model, inputs, target, capture_aten(model, inputs, name=spec.name)


def reference(name: str) -> tuple[float, dict[str, torch.Tensor]]:
    spec, model, inputs, target, _ = captured(name)
    model.zero_grad(set_to_none=True)
    loss = spec.loss(model(*inputs), target)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)
             if p.grad is not None}  # tied parameters under each of their names
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def random_program(graph, world: int, seed: int) -> dict[str, Strategy]:
    """A valid program drawn at random: each op takes a strategy whose inputs can be reached from
    where they are (the tests' way to reach every conversion)."""
    rng = random.Random(seed)
    origin: dict[str, str] = {}
    chosen = {}
    for op in graph.ops:
        ok = []
        for s in strategies(op, graph, world):
            where = dict(origin)
            good = True
            for t, q in zip(op.inputs, s.inputs):
                meta = graph.tensors[t]
                if t not in where:
                    where[t] = REPLICATED if (q == PARTIAL or meta.role != "param") else q
                good = good and conversion(where[t], q, t, 0) is not None
            if good:
                ok.append(s)
        s = rng.choice(ok[1:] or ok) if rng.random() < 0.85 else ok[0]
        for t, q in zip(op.inputs, s.inputs):
            if t not in origin:
                origin[t] = REPLICATED if (q == PARTIAL or graph.tensors[t].role != "param") else q
        for t, p in zip(op.outputs, s.outputs):
            origin[t] = p
        chosen[op.name] = s
    return chosen


def compiled_random(graph, seed: int, collective: str = "padded"):
    from plait.runtime.spmd_program import compile_program

    for attempt in range(20):
        chosen = random_program(graph, 2, seed * 100 + attempt)
        try:
            tensors = {t for (t, _) in compile_program(graph, chosen, RATIOS, 2).sizes}
            return compile_program(graph, chosen, RATIOS, 2, collective={t: collective for t in tensors})
        except ShardingError:
            continue  # a draw whose linked dimensions leave a rank no rows: draw again
    raise AssertionError("no valid random program in 20 draws")


def synthesized(graph):
    """The program plait.spmd's search picks at 0.7:0.3 on a mixed pair whose compute is slow
    (a million times slower than the datasheet: the tiny models' ops then outweigh the link's
    latency and the search shards them)."""
    from plait.runtime.spmd_program import compile_program
    from plait.spmd.search import beam_search

    program = beam_search(synthesized_problem(graph), RATIOS, width=16)
    return compile_program(graph, program.strategies, RATIOS, 2)


def synthesized_problem(graph):
    """`graph` on that slow mixed pair (a search Problem)."""
    from plait.cluster.loader import parse_cluster
    from plait.cost.program import Problem
    from plait.cost.spmd import Devices

    cluster = parse_cluster({"name": "pair", "nodes": [{"name": "n", "gpus": [
        {"kind": "v100-16gb", "count": 1}, {"kind": "p100-16gb", "count": 1}],
        "intra": {"type": "nvlink", "bandwidth": "300 GB/s"}}]})
    devices = Devices.from_cluster(cluster)
    devices = dataclasses.replace(devices, flops=devices.flops * 1e-6, mem_bw=devices.mem_bw * 1e-6,
                                  kinds=())  # op work from these figures (op_work), not the kinds
    return Problem.build(graph, devices)


# ----------------------------------------------------------------------------- two gloo ranks
def _rank_main(rank: int, port: int, name: str, program, out, log_dir=None) -> None:
    try:
        from pathlib import Path

        from plait.runtime.comm import Comm, CommLog
        from plait.runtime.spmd_program import RankProgram

        torch.set_num_threads(1)
        log = CommLog(Path(log_dir) / f"rank{rank}.jsonl", rank, 2) if log_dir else None
        comm = Comm(rank, 2, log=log)
        group = comm.init_process_group("gloo", timeout_s=60, init_method=f"tcp://127.0.0.1:{port}")
        spec, model, inputs, target, _ = captured(name)
        runner = RankProgram(program, rank, group)
        leaves = runner.load(model)
        outs = runner.forward(inputs)
        loss = spec.loss(outs[0] if len(outs) == 1 else tuple(outs), target)
        loss.backward()
        grads = {path: (leaf.grad.numpy().copy() if leaf.grad is not None else None, runner.param_placement[path],
                        runner.rows(runner.param_paths()[path], d) if (d := shard_dim(runner.param_placement[path]))
                        is not None else None)
                 for path, leaf in runner.params.items()}
        ops = sorted(runner.moves)
        comm.close()
        out.put((rank, float(loss), grads, ops, len(leaves)))
        Comm.destroy()
    except BaseException:
        out.put((rank, traceback.format_exc()))


def run_two_ranks(name: str, program, log_dir=None) -> list[tuple]:
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, name, program, out, log_dir)) for r in range(2)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    for r in results:
        assert len(r) == 5, r[1]
    return sorted(results)


def check_equal(name: str, results: list[tuple]) -> None:
    want_loss, want_grads = reference(name)
    for rank, loss, grads, _, _ in results:
        assert abs(loss - want_loss) <= 1e-5 * max(1.0, abs(want_loss)), (rank, loss, want_loss)
        assert set(grads) <= set(want_grads) | {p for p in grads if grads[p][0] is None}
        assert len(grads) == len({id(p) for p in captured(name)[1].parameters()})  # every parameter, once
        for path, (g, placement, rows) in grads.items():
            want = want_grads.get(path)
            if want is None:
                assert g is None or not np.abs(g).max() > 0, path
                continue
            d = shard_dim(placement)
            if d is not None:
                want = want.narrow(d, rows[0], rows[1])
            assert g is not None, f"rank {rank}: no gradient for {path}"
            g = torch.from_numpy(g)
            torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-5, msg=lambda m, r=rank, p=path: f"rank {r} {p}: {m}")


@pytest.mark.parametrize("name", list(MODELS))
def test_synthesized_program_equals_single_device(name) -> None:
    graph = captured(name)[4]
    program = synthesized(graph)
    assert any(s.sharded for s in program.strategies.values())
    check_equal(name, run_two_ranks(name, program))


def test_sharded_storage_equals_single_device() -> None:
    """ZeRO-3 storage (`Problem.homes`, `plait.spmd.ratios.stored_homes`): the synthesized program
    with its whole parameters stored in uneven shards, all-gathered for their readers and their
    gradients reduce-scattered home, still equals one device."""
    from plait.runtime.spmd_program import compile_program
    from plait.spmd.ratios import stored_homes
    from plait.spmd.search import beam_search

    graph = captured("bert")[4]
    problem = synthesized_problem(graph)
    program = beam_search(problem, RATIOS, width=16)
    homes = stored_homes(problem, program, min_numel=1, min_rows=1)
    assert len(homes) >= 4
    compiled = compile_program(graph, program.strategies, RATIOS, 2, homes=homes)
    assert all(compiled.stored[t] == q for t, q in homes.items())
    results = run_two_ranks("bert", compiled)
    check_equal("bert", results)
    moves = results[0][3]
    assert any(m.startswith("fwd S") and m.endswith("->R") for m in moves), moves
    assert any(m.startswith("bwd P->S") for m in moves), moves
    with pytest.raises(ShardingError, match="cannot be stored as 'S9'"):
        compile_program(graph, program.strategies, RATIOS, 2, homes={next(iter(homes)): "S9"})


MOVES: set[str] = set()


@pytest.mark.parametrize("name,seed,mode", [("bert", 1, "padded"), ("vit", 2, "grouped"), ("vgg19", 3, "padded"),
                                            ("bert_moe", 4, "grouped")])
def test_random_programs_equal_single_device(name, seed, mode, tmp_path) -> None:
    from plait.ir.comm import read_comm_records

    graph = captured(name)[4]
    program = compiled_random(graph, seed, mode)
    sharded_params = [t for t, q in program.stored.items() if q.startswith("S")]
    assert sharded_params and len(program.sizes) > 3
    assert any(sizes[0] != sizes[1] for sizes in program.sizes.values())  # uneven shards
    results = run_two_ranks(name, program, tmp_path)
    check_equal(name, results)
    MOVES.update(results[0][3])
    # every collective is a record of the facade; grouped uneven shards are broadcasts and reduces
    ops = {r.op for r in read_comm_records(tmp_path / "rank0.jsonl").records}
    assert ops & ({"broadcast", "reduce"} if mode == "grouped" else {"all_gather", "reduce_scatter"})
    assert not ops & ({"all_gather", "reduce_scatter"} if mode == "grouped" else {"broadcast", "reduce"})


def test_the_random_programs_ran_every_collective_conversion() -> None:
    if len(MOVES) == 0:
        pytest.skip("runs after the random programs")
    want = {f"{phase} {a}" for phase in ("fwd", "bwd") for a in ("S->R", "P->R", "P->S", "S->S")}
    assert want <= MOVES, want - MOVES


# ----------------------------------------------------------------------------- bad programs
def test_a_ratio_leaving_a_device_no_rows_names_the_op_and_device() -> None:
    from plait.runtime.spmd_program import compile_program

    graph = captured("vit")[4]
    chosen = synthesized(graph).strategies
    with pytest.raises(ShardingError, match=r"\(op \w+\).*leave gpu 1 \(p100\) with zero rows"):
        compile_program(graph, chosen, [0.999, 0.001], 2, devices=["gpu 0 (v100)", "gpu 1 (p100)"])


def test_an_op_without_a_rule_or_strategy_is_named() -> None:
    from plait.runtime.spmd_program import compile_program

    class Fft(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return torch.cumprod(self.lin(x), dim=1)

    graph = capture_aten(Fft(), (torch.randn(4, 4),), name="fft")
    chosen = {op.name: strategies(op, graph, 2)[0] for op in graph.ops if op.kind != "cumprod"}
    with pytest.raises(ShardingError, match=r"op cumprod\w* \(aten.cumprod.default.*no sharding rule"):
        compile_program(graph, chosen, RATIOS, 2)
    graph2 = captured("vit")[4]
    chosen2 = dict(synthesized(graph2).strategies)
    victim = graph2.ops[3].name
    del chosen2[victim]
    with pytest.raises(ShardingError, match=rf"op {victim} .*no strategy in the spmd program"):
        compile_program(graph2, chosen2, RATIOS, 2)
    chosen2[victim] = Strategy(("S9",) * len(graph2.ops[3].inputs), ("S9",) * len(graph2.ops[3].outputs), True)
    with pytest.raises(ShardingError, match=rf"op {victim} .*not one its sharding rule offers"):
        compile_program(graph2, chosen2, RATIOS, 2)


def test_ratios_per_segment_must_match_the_program() -> None:
    from plait.runtime.spmd_program import compile_program

    graph = captured("vgg19")[4]
    chosen = synthesized(graph).strategies
    with pytest.raises(ShardingError, match="segment"):
        compile_program(graph, chosen, np.full((7, 2), 0.5), 2)


# ----------------------------------------------------------------------------- a plan file through the launcher
def test_plan_round_trips_and_validates() -> None:
    from plait.ir.plan import Plan, PlanError
    from plait.spmd.program_plan import program_plan

    graph = captured("vgg19")[4]
    program = synthesized(graph)
    plan = program_plan(program.strategies, [[0.7, 0.3]] * 1, BATCH, model=MODELS["vgg19"], predicted_s=0.1)
    back = Plan.from_json(plan.to_json())
    assert back == plan and back.world_size == 2 and back.spmd.strategies == program.strategies
    assert back.spmd.ratio_array().shape == (1, 2)
    assert "spmd" not in Plan().to_dict()  # other plans are written as before
    bad = plan.to_dict()
    bad["spmd"]["strategies"][graph.ops[0].name] = [["S0"], ["Q"], True]
    with pytest.raises(PlanError, match=rf"spmd'.strategies.{graph.ops[0].name}: must be"):
        Plan.from_dict(bad)
    bad = plan.to_dict()
    bad["spmd"]["ratios"] = [0.7, 0.4]
    with pytest.raises(PlanError, match="spmd'.ratios: values must be >= 0 and sum to 1"):
        Plan.from_dict(bad)
    bad = plan.to_dict()
    bad["spmd"]["version"] = 9
    with pytest.raises(PlanError, match="newer than this plait reads"):
        Plan.from_dict(bad)
    bad = plan.to_dict()
    bad["dp"], bad["micro_batch"] = 2, 3
    with pytest.raises(PlanError, match="needs dp=tp=pp=1"):
        Plan.from_dict(bad)


@pytest.mark.slow
def test_a_plan_file_trains_like_one_device_through_the_launcher(tmp_path) -> None:
    """`plait run --plan FILE` with an SPMD plan: losses and final parameters equal the
    single-process reference (SGD, 3 steps) -- about 30 s (two torchrun workers each capture)."""
    from plait.runtime.api import RecordsConfig, TrainingConfig, reference_run, run
    from plait.runtime.partition import make_samples
    from plait.spmd.program_plan import program_plan

    spec, model, _, _, _ = captured("vit")
    inputs, _ = make_samples(spec, 0, BATCH, 0)
    program = synthesized(capture_aten(model, inputs, name=spec.name))
    plan = program_plan(program.strategies, RATIOS, BATCH, model=MODELS["vit"])
    path = tmp_path / "spmd.json"
    plan.save(path)
    training = TrainingConfig(optimizer="sgd", lr=0.1)
    res = run(MODELS["vit"], None, str(path), steps=3, training=training, records=RecordsConfig(return_params=True))
    losses, params = reference_run(MODELS["vit"], plan, 3, training=training)
    np.testing.assert_allclose(res.losses, losses, rtol=1e-5, atol=1e-6)
    assert set(res.params) <= set(params)
    for k, v in res.params.items():
        torch.testing.assert_close(v, params[k], rtol=1e-5, atol=1e-5)
    assert res.spmd["moves"]
