"""SPMD programs with gradient clipping and checkpoints (plait.runtime.spmd_state): on 2 gloo ranks
at uneven ratios, a clipped Adam run equals one device (torch's clip_grad_norm_) within 1e-5; its
checkpoint holds the logical (unsharded) parameters; a resume at other ratios equals the
uninterrupted run."""

from __future__ import annotations

import copy
import multiprocessing as mp
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch
from test_spmd_program import BATCH, RATIOS, captured, synthesized

from plait.net.ports import free_port

NAME = "bert"  # tied embedding (one whole leaf), sharded and replicated parameters
CLIP = 0.05  # below every step's gradient norm: the clipping acts
STEPS, SAVE_AT = 4, 2
OPT = {"name": "adam", "lr": 1e-2}


def samples(step: int):
    spec = captured(NAME)[0]
    return spec.sample_batch(BATCH, seed=100 + step)


def reference() -> tuple[list[float], list[float], dict[int, dict[str, torch.Tensor]]]:
    """One device: losses, gradient norms before clipping, parameters after each step."""
    from plait.runtime.data_parallel import make_optimizer

    spec, model, *_ = captured(NAME)
    model = copy.deepcopy(model)
    opt = make_optimizer([p for p in model.parameters()], OPT)
    losses, norms, params = [], [], {}
    for step in range(STEPS):
        inputs, target = samples(step)
        loss = spec.loss(model(*inputs), target)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        params[step + 1] = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    return losses, norms, params


def _rank_main(rank: int, port: int, program, start: int, root: str, out) -> None:
    try:
        from plait.runtime import checkpoint as ckpt
        from plait.runtime.comm import Comm
        from plait.runtime.data_parallel import make_optimizer
        from plait.runtime.sharded_state import aliases_of
        from plait.runtime.spmd_program import RankProgram, whole_parameters
        from plait.runtime.spmd_state import (
            SpmdStep,
            checkpoint_layout,
            make_clipper,
            persistent_buffers,
        )

        torch.set_num_threads(1)
        comm = Comm(rank, 2)
        group = comm.init_process_group("gloo", timeout_s=60, init_method=f"tcp://127.0.0.1:{port}")
        spec, model, *_ = captured(NAME)
        runner = RankProgram(program, rank, group)
        leaves = runner.load(model)
        stepper = SpmdStep(leaves, make_optimizer(leaves, OPT))
        stepper.clip = make_clipper(runner, 2, CLIP, group)
        layout = checkpoint_layout(runner, stepper, aliases_of(model), persistent_buffers(model), rank)
        meta = {"model": NAME, "plan": "test", "optimizer": OPT, "seed": 0, "data_seed": 0}
        if start:
            train, _ = ckpt.load_into(ckpt.step_dir(Path(root), start), layout, rank)
            assert train["step"] == start
        losses = []
        for step in range(start, STEPS):
            inputs, target = samples(step)
            runner.step = step
            outs = runner.forward(inputs)
            loss = spec.loss(outs[0] if len(outs) == 1 else tuple(outs), target)
            loss.backward()
            stepper.step()
            losses.append(float(loss))
            if step + 1 == SAVE_AT and not start:
                ckpt.save(Path(root), step + 1, ckpt.rank_snapshot(layout, {"step": step + 1}, rank, {}),
                          meta, rank, 2, comm)
        params = whole_parameters(runner, lambda x, sizes, d: group.all_gather_uneven(x, sizes, d, "gather", "t"))
        comm.close()
        out.put((rank, losses, stepper.clip.norms, {k: v.numpy().copy() for k, v in params.items()}))
        Comm.destroy()
    except BaseException:
        out.put((rank, traceback.format_exc()))


def train_two_ranks(program, start: int, root: Path) -> list[tuple]:
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, program, start, str(root), out)) for r in range(2)]
    for p in procs:
        p.start()
    results = [out.get(timeout=180) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    for r in results:
        assert len(r) == 4, r[1]
    return sorted(results, key=lambda r: r[0])


def close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) <= set(want) and got
    for k, v in got.items():
        torch.testing.assert_close(torch.as_tensor(v), want[k], rtol=1e-5, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


def test_clipped_run_equals_one_device_and_resumes_at_other_ratios(tmp_path) -> None:
    from plait.runtime import checkpoint as ckpt
    from plait.runtime.spmd_program import compile_program

    torch.set_num_threads(1)
    spec, model, _, _, graph = captured(NAME)
    program = synthesized(graph)
    assert any(s.sharded for s in program.strategies.values())
    losses, norms, params = reference()
    assert min(norms) > CLIP  # every step is clipped
    first = train_two_ranks(program, 0, tmp_path)
    for _, got_losses, got_norms, got_params in first:
        np.testing.assert_allclose(got_losses, losses, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got_norms, norms, rtol=1e-5)
        close(got_params, params[STEPS])
    # the checkpoint holds the logical parameters, whole, under the model's names
    saved = ckpt.load_consolidated(ckpt.step_dir(tmp_path, SAVE_AT))
    names = {n for n, _ in model.named_parameters()}  # a tied parameter once, under its first name
    assert names <= set(saved["model"])
    close({n: saved["model"][n] for n in names}, params[SAVE_AT])
    # resume onto other ratios (other shard sizes): the same as the uninterrupted run
    other = compile_program(graph, program.strategies, [0.35, 0.65], 2)
    assert other.sizes != program.sizes and RATIOS != [0.35, 0.65]
    second = train_two_ranks(other, SAVE_AT, tmp_path)
    for _, got_losses, _, got_params in second:
        np.testing.assert_allclose(got_losses, losses[SAVE_AT:], rtol=1e-5, atol=1e-6)
        close(got_params, params[STEPS])


def test_clip_weights_count_each_parameter_once() -> None:
    from plait.ir.program import shard_dim
    from plait.runtime.spmd_program import RankProgram
    from plait.runtime.spmd_state import clip_weights

    _, model, _, _, graph = captured(NAME)
    program = synthesized(graph)

    class Group:  # RankProgram only needs one to exist for 2 ranks
        size = 2

    runner = RankProgram(program, 0, Group())
    runner.load(model)
    weights = clip_weights(runner, 2)
    kinds = {shard_dim(runner.param_placement[p]) is not None: weights[id(leaf)] for p, leaf in runner.params.items()}
    assert kinds == {True: 1.0, False: 0.5}


@pytest.mark.slow
def test_plait_run_clips_checkpoints_and_resumes_an_spmd_plan(tmp_path) -> None:
    """Through the launcher (`plait run --clip-grad --checkpoint-dir`, then `--resume` with the
    program at other ratios): losses and final parameters equal the single-process clipped
    reference -- about a minute (three torchrun workers' captures)."""
    from plait.graph.aten_capture import capture_aten
    from plait.runtime.api import (
        CheckpointConfig,
        RecordsConfig,
        TrainingConfig,
        reference_run,
        run,
    )
    from plait.runtime.partition import make_samples
    from plait.spmd.program_plan import program_plan

    spec, model, *_ = captured(NAME)
    inputs, _ = make_samples(spec, 0, BATCH, 0)
    program = synthesized(capture_aten(model, inputs, name=spec.name))
    model_spec = spec.spec
    paths = []
    for ratios in (RATIOS, [0.35, 0.65]):
        paths.append(tmp_path / f"spmd-{ratios[0]}.json")
        program_plan(program.strategies, ratios, BATCH, model=model_spec).save(paths[-1])
    training = TrainingConfig(optimizer="adam", lr=1e-2, clip_grad=CLIP)
    ck = str(tmp_path / "ck")
    first = run(model_spec, None, str(paths[0]), steps=SAVE_AT, training=training,
                checkpoint=CheckpointConfig(dir=ck, every=SAVE_AT))
    second = run(model_spec, None, str(paths[1]), steps=STEPS, training=training,
                 checkpoint=CheckpointConfig(dir=ck, resume=True), records=RecordsConfig(return_params=True))
    losses, params = reference_run(model_spec, str(paths[0]), STEPS, training=training)
    assert second.resumed_from == SAVE_AT and second.steps == list(range(SAVE_AT, STEPS))
    np.testing.assert_allclose(list(first.losses) + list(second.losses), losses, rtol=1e-5, atol=1e-6)
    assert second.params
    for k, v in second.params.items():
        torch.testing.assert_close(v, params[k], rtol=1e-5, atol=1e-5)
