"""`plait plan --family spmd`: JSON and plan file, the machine prediction's calibration, errors, --run."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from plait.cli import main
from plait.ir.plan import Plan

MODEL = "bert:layers=1,hidden=32,heads=4,seq=8,vocab=64,dropout=0,attn_dropout=0"
CLUSTER = "emulated-mixed:gpus_per_node=1"


@pytest.fixture(scope="module")
def choice():
    from plait.commands.spmd_plan import synthesize_plan

    return synthesize_plan(MODEL, CLUSTER, 8)


def test_json_and_a_plan_file_that_names_every_op(tmp_path, capsys) -> None:
    out = tmp_path / "spmd.json"
    assert main(["plan", "--family", "spmd", "--model", MODEL, "--cluster", CLUSTER, "--global-batch", "8",
                 "--json", "--out", str(out)]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["family"] == "spmd" and res["global_batch"] == 8 and len(res["devices"]) == 2
    assert abs(sum(res["ratios"]) - 1) < 1e-9 and res["fits"]
    assert res["predicted_iteration_s"] <= res["predicted_even_s"] * (1 + 1e-9)
    plan = Plan.load(str(out))
    assert plan.spmd is not None and plan.world_size == 2 and len(plan.spmd.strategies) == res["ops"]
    assert plan.spmd.model == res["model"]


def test_the_machine_model_is_calibrated_to_what_was_measured(choice) -> None:
    """The program's modelled work on a rank with no slowdown is the measured one-rank time; the
    links reproduce the all-gathers they were fitted to."""
    from plait.cost.collectives import collective_time
    from plait.cost.spmd import op_work

    alpha, bw = 2e-4, 5e8
    rows = [[s, (2 - 1) * alpha + 0.5 * s / bw] for s in (8e3, 1.3e5, 2e6, 8e6)]
    devices = machine_devices_of(choice, 0.5, [1.0, 1.6], {"all_gather": rows})
    work = sum(op_work(op, choice.graph, devices) for op in choice.graph.ops)
    assert work[0] == pytest.approx(0.5, rel=1e-9) and work[1] == pytest.approx(0.8, rel=1e-9)
    for s, t in rows:
        assert collective_time("all_gather", s, devices.links) == pytest.approx(t, rel=1e-6)


def test_each_rank_is_calibrated_to_its_own_timing(choice) -> None:
    """`--run`'s ranks time the whole program side by side (`program_s` before, `program_s_after`
    after the steps): each rank's speed is its own mean, so a rank whose CPU was 1.5x slower
    models 1.5x the work on top of its emulated slowdown (hand-computed: 0.4 and 0.6 s, x1 and x2)."""
    from plait.commands.spmd_plan import ranks_timing
    from plait.cost.spmd import op_work

    cal = {"all_gather": [[8e3, 1e-4], [8e6, 2e-2]],
           "program_s": [{"program": 0.3, "loss": 0.01, "optimizer": 0.02},
                         {"program": 0.5, "loss": 0.03, "optimizer": 0.04}],
           "program_s_after": [{"program": 0.5, "loss": 0.03, "optimizer": 0.02},
                               {"program": 0.7, "loss": 0.01, "optimizer": 0.06}]}
    one = ranks_timing(cal)
    np.testing.assert_allclose(one.program, [0.4, 0.6])
    np.testing.assert_allclose(one.loss, [0.02, 0.02])
    np.testing.assert_allclose(one.optimizer, [0.02, 0.05])
    assert ranks_timing({"all_gather": []}) is None
    devices = machine_devices_of(choice, one.program, [1.0, 2.0], cal)
    work = sum(op_work(op, choice.graph, devices) for op in choice.graph.ops)
    np.testing.assert_allclose(work, [0.4, 0.6 * 2.0], rtol=1e-9)


def test_per_rank_loss_and_optimizer_take_the_slowest_rank(choice) -> None:
    """The loss and optimizer step added to a program's time are the slowest rank's: its own
    timing x its emulated slowdown x its share (hand-computed for a replicated program: every rank
    computes the whole loss: max(0.01 x 1, 0.02 x 2) = 0.04; a loss on batch shards, each rank its
    half of the rows: 0.02)."""
    from plait.commands.spmd_plan import OneRank, machine_prediction
    from plait.graph.aten_stage import batch_loss_output

    devices = machine_devices_of(choice, 0.5, [1.0, 2.0], {"all_gather": [[1e3, 1e-5], [1e6, 2e-3]]})
    segs = choice.synthesis.segments.count if choice.synthesis.segments else 1
    r = np.full((segs, 2), 0.5)
    none = OneRank(program=0.5, loss=np.zeros(2), optimizer=np.zeros(2))
    base = machine_prediction(choice, devices, r, none, [1.0, 2.0])
    loss = machine_prediction(choice, devices, r, OneRank(0.5, np.array([0.01, 0.02]), np.zeros(2)), [1.0, 2.0])
    sharded = batch_loss_output(choice.run_graph, choice.synthesis.program.strategies) is not None
    assert loss - base == pytest.approx(0.02 if sharded else 0.04, rel=1e-9)


def test_links_are_fitted_in_relative_error() -> None:
    """gloo all-gathers timed on an idle 16-core machine (2 ranks, loopback): the fit weights each
    size alike, so the 8 KB row keeps its latency (an unweighted fit gave alpha 0.096 ms and priced
    it at 32 % of its time). Expected figures: weighted least squares by hand (numpy lstsq on the
    rows divided by their times)."""
    from plait.commands.spmd_plan import fit_links

    rows = np.array([[8192, 3.33708e-4], [131072, 4.234e-4], [2097152, 1.921997e-3], [8388608, 9.688358e-3]])
    alpha, bw = fit_links(rows, 2)
    assert alpha == pytest.approx(3.1454e-4, rel=1e-3) and bw == pytest.approx(5.5608e8, rel=1e-3)
    assert alpha + 0.5 * 8192 / bw == pytest.approx(3.33708e-4, rel=0.05)
    exact = np.array([[s, 2e-4 + 0.5 * s / 5e8] for s in (8e3, 1.3e5, 2e6, 8e6)])
    assert fit_links(exact, 2) == pytest.approx((2e-4, 5e8), rel=1e-9)


def test_rank_work_of_a_redundant_program_is_each_ranks_own_timing(choice) -> None:
    """`rank_work` (what a rank computes before its stretch): this tiny BERT's program splits no op,
    so each rank computes it whole, at any ratios -- its own timing (0.4 s, 0.6 s), not stretched."""
    from plait.commands.spmd_plan import rank_work

    assert not any(s.splits_work for s in choice.synthesis.program.strategies.values())
    devices = machine_devices_of(choice, [0.4, 0.6], [1.0, 2.0], {"all_gather": [[1e3, 1e-5], [1e6, 2e-3]]})
    for r in ([0.5, 0.5], [0.8, 0.2]):
        assert rank_work(choice, devices, r, [1.0, 2.0]) == pytest.approx([0.4, 0.6], rel=1e-9)


def test_ranks_calibrated_to_their_own_program_model_its_time_as_their_work() -> None:
    """With each rank's own program timed alone (`OneRank.own`: its shards at the plan's ratios),
    `machine_devices` sets each rank's speed so the model's work of that rank's share is exactly
    that time (hand-chosen 0.15 s and 0.05 s for an A100 + T4 pair's sharded GPT at 0.83 : 0.17),
    and `rank_work` reads it back before the emulated stretch."""
    from plait.commands.spmd_plan import machine_devices, rank_work, synthesize_plan

    pair = str(Path(__file__).resolve().parents[1] / "bench" / "data" / "a100_t4_pair.yaml")
    sharded = synthesize_plan("gpt:layers=2,hidden=128,heads=4,seq=64,vocab=256,dropout=0,attn_dropout=0",
                              pair, 64, dtype="fp16")
    assert any(s.splits_work for s in sharded.synthesis.program.strategies.values())
    ratios = sharded.plan.spmd.ratios
    cal = {"all_gather": [[1e3, 1e-5], [1e6, 2e-3]]}
    devices = machine_devices(sharded, 0.2, [1.0, 4.8], cal, ratios, [0.15, 0.05])
    assert rank_work(sharded, devices, ratios, [1.0, 4.8]) == pytest.approx([0.15, 0.05], rel=1e-9)
    whole = machine_devices(sharded, 0.2, [1.0, 4.8], cal)  # calibrated to the whole program instead
    assert rank_work(sharded, whole, ratios, [1.0, 4.8]) != pytest.approx([0.15, 0.05], rel=1e-2)


def test_a_null_group_gives_each_uneven_collective_this_ranks_shape() -> None:
    """`NullGroup` (timing one rank's program alone): rank 1 of sizes [3, 1] gets the gathered shape
    with its own row in place, its own reduce-scattered row, and an all-to-all's re-sharded shape."""
    import torch

    from plait.runtime.comm import NullGroup

    g = NullGroup(2, 1)
    x = torch.arange(1.0, 3.0).reshape(1, 2)
    out = g.all_gather_uneven(x, [3, 1], 0, "t")
    assert out.shape == (4, 2) and torch.equal(out[3], x[0]) and not out[:3].any()
    whole = torch.arange(8.0).reshape(4, 2)
    assert torch.equal(g.reduce_scatter_uneven(whole, [3, 1], 0, "t"), whole[3:])
    y = torch.ones(1, 6)  # rank 1: 1 of 4 rows of dim 0, all 6 of dim 1 -> all 4 rows, 2 of 6 columns
    assert g.all_to_all_uneven(y, [3, 1], 0, [4, 2], 1, "t").shape == (4, 2)


def machine_devices_of(choice, one, slow, calibration):
    from plait.commands.spmd_plan import machine_devices

    return machine_devices(choice, one, slow, calibration)


def test_uneven_ratios_are_predicted_faster_on_uneven_ranks_when_the_work_is_split(choice) -> None:
    from plait.commands.spmd_plan import OneRank, machine_prediction

    devices = machine_devices_of(choice, 0.5, [1.0, 2.0], {"all_gather": [[1e3, 1e-5], [1e6, 2e-3]]})
    syn = choice.synthesis
    split = [k for k, op in enumerate(choice.graph.ops) if syn.program.strategies[op.name].splits_work]
    segs = syn.segments.count if syn.segments else 1
    even = machine_prediction(choice, devices, np.full((segs, 2), 0.5))
    uneven = machine_prediction(choice, devices, np.tile([2 / 3, 1 / 3], (segs, 1)))
    assert (uneven < even) if split else (uneven == pytest.approx(even))
    # what the runtime adds: the loss on the slowest rank, each rank's optimizer step on its elements
    one = OneRank(program=0.5, loss=0.01, optimizer=0.02)
    full = machine_prediction(choice, devices, np.full((segs, 2), 0.5), one, [1.0, 2.0])
    assert full >= even + 0.01 * 2.0 + 0.02 * 2.0 * 0.5 - 1e-12


def test_machine_prediction_of_a_program_with_sharded_storage() -> None:
    """`plait plan --family spmd` picks, for this GPT on an A100 + V100 pair at fp16, the program
    with its MLP weights stored in shards (ZeRO-3, `Program.homes`: storage segments, one ratio
    row each); the machine prediction of `--run` compiles that storage as the worker does
    (before, the homes were dropped and the per-segment rows refused)."""
    from plait.commands.spmd_plan import OneRank, machine_prediction, synthesize_plan

    stored = synthesize_plan("gpt:layers=2,hidden=128,heads=4,seq=64,vocab=256,dropout=0,attn_dropout=0",
                             CLUSTER, 64, dtype="fp16")
    syn = stored.synthesis
    assert syn.program.homes and syn.segment_ratios is not None and syn.segment_ratios.shape[0] > 1
    devices = machine_devices_of(stored, 0.5, [1.0, 2.0], {"all_gather": [[1e3, 1e-5], [1e6, 2e-3]]})
    bare = machine_prediction(stored, devices, syn.segment_ratios)
    full = machine_prediction(stored, devices, syn.segment_ratios, OneRank(program=0.5, loss=0.01, optimizer=0.02),
                              [1.0, 2.0])
    assert full > bare + 0.01 * 0.5 - 1e-12  # at least the loss on the slow rank's rows


@pytest.mark.parametrize("argv,needle", [
    (["--export", "megatron"], "no Megatron/DeepSpeed equivalent"),
    (["--model", "bert:layers=two"], "layers"),
])
def test_bad_arguments_give_one_line_errors(argv, needle, capsys) -> None:
    rc = main(["plan", "--family", "spmd", "--model", MODEL, "--cluster", CLUSTER, "--global-batch", "8", *argv])
    assert rc == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_run_predict_refuses_an_spmd_plan(tmp_path, choice, capsys) -> None:
    path = tmp_path / "p.json"
    choice.plan.save(path)
    assert main(["run", "--model", MODEL, "--cluster", CLUSTER, "--plan", str(path), "--predict"]) == 2
    assert "plait plan --family spmd --run" in capsys.readouterr().err


@pytest.mark.slow
def test_run_trains_both_programs_and_compares(capsys) -> None:
    """--run end to end (two launches of two ranks: about a minute)."""
    assert main(["plan", "--family", "spmd", "--model", MODEL, "--cluster", CLUSTER, "--global-batch", "8",
                 "--run", "--steps", "3", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)["run"]
    assert res["uneven"]["losses"] and res["even"]["losses"]
    np.testing.assert_allclose(res["uneven"]["losses"][0], res["even"]["losses"][0], rtol=1e-5)
    assert res["uneven"]["predicted_machine_s"] > 0 and res["measured_speedup_over_even"] > 0


@pytest.mark.slow
def test_bench_spmd_run_core_on_a_tiny_case() -> None:
    """bench/spmd_run.py's `measure` on its --quick case (two launches: about a minute)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "spmd_run.py"
    spec = importlib.util.spec_from_file_location("spmd_run_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    model, batch, cluster = bench.QUICK[0]
    row = bench.measure(model, batch, cluster, 2)
    assert row["ranks"] == 2 and row["uneven"]["measured_iteration_s"] > 0 and row["even"]["losses"]
    assert row["uneven"]["predicted_machine_s"] > 0


def test_an_fp16_plan_says_fp16_prices_fp16_bytes_and_names_its_collectives(tmp_path, capsys) -> None:
    """`--dtype fp16 --out`: the plan's dtype is fp16, the graph the program was priced on holds
    fp16 tensors (half the bytes of the fp32 capture, the same op names), and the plan carries
    the search's padded/grouped choice for every tensor with an uneven all-gather or
    reduce-scatter (`plan_collectives`)."""
    from plait.commands.spmd_plan import synthesize_plan
    from plait.spmd.program_plan import plan_collectives

    # an A100 and a T4 on NVLink: this VGG's convolutions are sharded (all-gathers, reduce-scatters)
    cluster = tmp_path / "a100_t4.yaml"
    cluster.write_text("name: a100+t4\nnodes:\n  - name: m\n    gpus: [{kind: a100-40gb, count: 1}, "
                       "{kind: t4, count: 1}]\n    intra: {type: nvlink, bandwidth: 150 GB/s}\n")
    model = "vgg19:width=16,fc=1024,image=32,pool=1,classes=10,dropout=0"
    out = tmp_path / "spmd16.json"
    assert main(["plan", "--family", "spmd", "--model", model, "--cluster", str(cluster), "--global-batch", "32",
                 "--dtype", "fp16", "--json", "--out", str(out)]) == 0
    res = json.loads(capsys.readouterr().out)
    plan = Plan.load(str(out))
    assert plan.dtype == "fp16" and res["dtype"] == "fp16"
    choice = synthesize_plan(model, str(cluster), 32, dtype="fp16")
    g16, g32 = choice.graph, choice.run_graph
    assert [op.name for op in g16.ops] == [op.name for op in g32.ops]
    acts = [t for t, m in g16.tensors.items() if m.dtype.startswith("float")]
    assert acts and all(g16.tensors[t].nbytes * 2 == g32.tensors[t].nbytes for t in acts)
    uneven = {c.tensor: c.algorithm for _, c in choice.synthesis.program.comms
              if c.op in ("all_gather", "reduce_scatter")}
    written = choice.plan.spmd.collectives
    assert uneven and set(written) == set(uneven) and set(written.values()) <= {"padded", "grouped"}
    assert written == plan_collectives(choice.synthesis.program.comms, choice.problem.devices,
                                       choice.plan.spmd.ratios)
    assert plan.spmd.collectives == written and choice.even_plan.spmd.collectives == written


def test_plan_collectives_keeps_each_message_choice_and_settles_a_conflict_by_time() -> None:
    from plait.cluster import load_cluster
    from plait.cost.spmd import Devices, comm_seconds
    from plait.ir.program import Comm
    from plait.spmd.program_plan import plan_collectives

    devices = Devices.from_cluster(load_cluster(CLUSTER))
    r = np.array([0.7, 0.3])
    big, small = 64 << 20, 4 << 10
    comms = [("a", Comm("all_gather", "x", big, dim=0, algorithm="grouped")),
             ("b", Comm("reduce_scatter", "x", big, "bwd", dim=0, algorithm="grouped")),
             ("c", Comm("all_gather", "y", small, dim=0, algorithm="padded")),
             ("d", Comm("all_reduce", "z", big, algorithm="ring")),  # not an uneven collective: not written
             ("e", Comm("all_gather", "w", big, dim=0, algorithm="grouped")),
             ("f", Comm("reduce_scatter", "w", small, "bwd", dim=0, algorithm="padded"))]
    out = plan_collectives(comms, devices, r)
    assert out["x"] == "grouped" and out["y"] == "padded" and "z" not in out
    cost = {m: comm_seconds(Comm("all_gather", "w", big, dim=0, algorithm=m), devices, r)
            + comm_seconds(Comm("reduce_scatter", "w", small, "bwd", dim=0, algorithm=m), devices, r)
            for m in ("padded", "grouped")}
    assert out["w"] == min(cost, key=cost.__getitem__)


def test_the_spmd_family_captures_and_prices_at_the_plans_dtype(tmp_path) -> None:
    """`plait.search.spmd_family.search_spmd` at fp16: the program is synthesized on the fp16
    capture (its messages at fp16 bytes, not the fp32 capture's), the plan says fp16 and carries
    the per-tensor collectives."""
    from plait.cluster import load_cluster
    from plait.cost.program import Problem
    from plait.cost.spmd import Devices
    from plait.graph.zoo import load_model
    from plait.search import SearchOptions, SpmdOptions
    from plait.search.spmd_family import search_spmd
    from plait.spmd.program_plan import capture_graph
    from plait.spmd.ratios import synthesize

    path = tmp_path / "a100_t4.yaml"
    path.write_text("name: a100+t4\nnodes:\n  - name: m\n    gpus: [{kind: a100-40gb, count: 1}, "
                    "{kind: t4, count: 1}]\n    intra: {type: nvlink, bandwidth: 150 GB/s}\n")
    cluster = load_cluster(str(path))
    model = "vgg19:width=16,fc=1024,image=32,pool=1,classes=10,dropout=0"
    res = search_spmd(model, cluster, SearchOptions(global_batch=32, top=1, dtype="fp16"), None, SpmdOptions())
    plan = res.top[0].plan
    assert plan.dtype == "fp16" and plan.spmd.collectives
    spec = load_model(model)
    cost = {dt: synthesize(Problem.build(capture_graph(spec, 32, dt), Devices.from_cluster(cluster, "fp16")),
                           dtype="fp16", max_states=20_000).cost for dt in ("fp16", "fp32")}
    assert plan.spmd.predicted_s == pytest.approx(cost["fp16"], rel=1e-12)
    assert cost["fp16"] < cost["fp32"]  # fp32 bytes would price its messages twice as large


def test_step_pieces_split_a_measured_step_by_rank() -> None:
    """`step_pieces` on a hand-made step of 1.0 s: rank 0 computes 0.3 s (0.2 s of CPU: other jobs
    took the rest) and waits 0.5 s in a collective; rank 1 computes 0.2 s stretched to 0.8 s (an
    emulated kind 4x slower) with a 0.1 s collective. "other" is the step less the spans; `steal`
    is wall over CPU seconds of the compute (0.5 / 0.4)."""
    from types import SimpleNamespace

    from plait.commands.spmd_plan import steal, step_pieces
    from plait.ir.timeline import Timeline, TimelineEvent

    def ev(rank, kind, start, end, **args):
        return TimelineEvent("x", "spmd", f"dev{rank}/{kind}", start, end, rank, 0, None,
                             {"rank": rank, "step": 0, **args})

    events = [ev(0, "compute", 0.0, 0.3, compute_s=0.3, cpu_s=0.2), ev(0, "comm", 0.3, 0.8),
              ev(1, "compute", 0.0, 0.8, compute_s=0.2, cpu_s=0.2), ev(1, "comm", 0.8, 0.9)]
    res = SimpleNamespace(steps=[0], step_bounds=[(0.0, 1.0)], timeline=Timeline(events, "measured"))
    got = step_pieces(res, skip=0)
    assert got["0"] == pytest.approx({"work": 0.3, "stretch": 0.0, "comm": 0.5, "cpu": 0.2, "other": 0.2})
    assert got["1"] == pytest.approx({"work": 0.2, "stretch": 0.6, "comm": 0.1, "cpu": 0.2, "other": 0.1})
    assert steal(got) == pytest.approx(0.5 / 0.4)


def test_simulate_of_an_fp16_plan_file_is_the_search_own_simulation(tmp_path) -> None:
    """`plait simulate --plan` of an fp16 SPMD plan prices the program the search priced: the model
    captured in the plan's dtype (before, in fp32 whatever the plan said: 9.78 ms against the
    search's 7.09 ms for a 2-layer GPT-1024 on mixed-a100-v100)."""
    from plait.commands.spmd_plan import synthesize_plan
    from plait.sim.api import simulate, simulate_spmd

    model = "gpt:layers=1,hidden=512,heads=8,seq=256,vocab=4096,dropout=0,attn_dropout=0"
    pair = "mixed-a100-v100:a100_nodes=1,v100_nodes=1,gpus_per_node=1"
    stored = synthesize_plan(model, pair, 32, dtype="fp16", max_states=2000)
    path = tmp_path / "p.json"
    stored.plan.save(path)
    own = simulate_spmd(stored.problem, stored.synthesis, stored.cluster, bucket_bytes=None, batch=32)
    assert simulate(model, pair, str(path)).iteration_time_s == pytest.approx(own.iteration_time_s, rel=1e-9)


def test_the_machine_prediction_prices_the_program_in_the_plans_dtype(tmp_path) -> None:
    """`--dtype fp16 --run` (or bf16): the prediction for this machine prices the program in the
    plan's dtype (its collectives at fp16 bytes, half the fp32 capture's) that the run trains in,
    not an fp32 one."""
    from plait.commands.spmd_plan import machine_pieces, synthesize_plan

    cluster = tmp_path / "a100_t4.yaml"  # the VGG's convolutions are sharded here (all-gathers, reduce-scatters)
    cluster.write_text("name: a100+t4\nnodes:\n  - name: m\n    gpus: [{kind: a100-40gb, count: 1}, "
                       "{kind: t4, count: 1}]\n    intra: {type: nvlink, bandwidth: 150 GB/s}\n")
    choice = synthesize_plan("vgg19:width=16,fc=1024,image=32,pool=1,classes=10,dropout=0", str(cluster), 32,
                             dtype="fp16")
    program = choice.machine_program()
    low = [(c.tensor, c.nbytes) for _, c in program.comms if choice.graph.tensors[c.tensor].dtype == "float16"]
    assert low and all(n == choice.graph.tensors[t].nbytes == choice.run_graph.tensors[t].nbytes // 2 for t, n in low)
    cal = {"all_gather": [[8e3, 1e-4], [1.3e5, 4e-4], [2e6, 3e-3], [8e6, 1e-2]]}
    devices = machine_devices_of(choice, 0.5, [1.0, 1.6], cal)
    comm = machine_pieces(choice, devices, choice.plan.spmd.ratios)["comm"]
    as_fp32 = dataclasses.replace(choice, synthesis=dataclasses.replace(choice.synthesis, program=dataclasses.replace(
        program, comms=[(n, dataclasses.replace(c, nbytes=choice.run_graph.tensors[c.tensor].nbytes))
                        for n, c in program.comms])))
    assert 0 < comm < machine_pieces(as_fp32, devices, choice.plan.spmd.ratios)["comm"]


@pytest.mark.slow
def test_run_in_bf16_trains_and_predicts_bf16(capsys) -> None:
    """`plait plan --family spmd --dtype bf16 --run` (two launches of two ranks: about a minute):
    both programs train in bf16 (their first losses those of the one-process bf16 reference, not
    fp32's) and are predicted in bf16."""
    from plait.commands.spmd_plan import synthesize_plan
    from plait.runtime.api import TrainingConfig, reference_run

    assert main(["plan", "--family", "spmd", "--model", MODEL, "--cluster", CLUSTER, "--global-batch", "8",
                 "--dtype", "bf16", "--run", "--steps", "3", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["dtype"] == "bf16" and res["run"]["dtype"] == "bf16"
    plan = synthesize_plan(MODEL, CLUSTER, 8, dtype="bf16").plan
    low = reference_run(MODEL, plan, 1, training=TrainingConfig(dtype="bf16", optimizer="adam"))[0][0]
    fp32 = reference_run(MODEL, plan, 1, training=TrainingConfig(dtype="fp32", optimizer="adam"))[0][0]
    for name in ("uneven", "even"):
        first = res["run"][name]["losses"][0]
        assert abs(first - low) <= 3 * 2.0 ** -8 * abs(low) and abs(first - low) < abs(first - fp32), (first, low, fp32)
        assert res["run"][name]["predicted_machine_s"] > 0
