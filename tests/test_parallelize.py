"""plait.runtime.parallelize (issue 29): a plan's data parallelism on torch's DDP and FSDP2, with
uneven shares, equal to one process (fp32 gradients of the global batch's mean loss)."""

from __future__ import annotations

import multiprocessing as mp
import traceback

import pytest
import torch
from torch import nn

from plait.ir.plan import Plan
from plait.net.ports import free_port

BATCH = 8


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 4, generator=g)


def _reference() -> dict[str, torch.Tensor]:
    model = _model()
    x, y = _data()
    nn.functional.mse_loss(model(x), y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _rank_main(rank: int, port: int, plan: Plan, how: str, out, log_dir) -> None:
    try:
        from pathlib import Path

        from plait.runtime.comm import Comm, CommLog
        from plait.runtime.parallelize import apply_ddp, apply_fsdp, build_mesh, replica_loss_weight

        torch.set_num_threads(1)
        log = CommLog(Path(log_dir) / f"rank{rank}.jsonl", rank, plan.dp) if log_dir else None
        comm = Comm(rank, plan.dp, log=log)
        comm.init_process_group("gloo", timeout_s=60, init_method=f"tcp://127.0.0.1:{port}")
        mesh = build_mesh(plan, comm)
        model = _model()
        if how == "fsdp":
            wrapped = apply_fsdp(model, mesh, plan, [m for m in model if isinstance(m, nn.Linear)])
        else:  # "ddp_recorded": the buckets through the facade's recorded "dp" group
            wrapped = apply_ddp(model, mesh, plan, comm.group("dp") if how == "ddp_recorded" else None)
        x, y = _data()
        shares = plan.samples_per_replica()
        lo = sum(shares[:rank])
        loss = nn.functional.mse_loss(wrapped(x[lo:lo + shares[rank]]), y[lo:lo + shares[rank]])
        (loss * replica_loss_weight(plan, rank)).backward()
        grads = {}
        for n, p in model.named_parameters():
            g = p.grad
            grads[n.removeprefix("module.")] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().numpy().copy()
        comm.close()
        out.put((rank, grads))
        Comm.destroy()
    except BaseException:
        out.put((rank, traceback.format_exc()))


def _spawn(target, ranks: int, *args) -> list[dict]:
    """`target(rank, port, *args, out)` in `ranks` forked processes; each rank's dict, in rank order."""
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, port, *args, out)) for r in range(ranks)]
    for p in procs:
        p.start()
    results = sorted((out.get(timeout=120) for _ in procs), key=lambda r: r[0])
    for p in procs:
        p.join(timeout=30)
    for _, r in results:
        assert isinstance(r, dict), r
    return [r for _, r in results]


def _run(plan: Plan, how: str, log_dir=None) -> list[dict]:
    return _spawn(lambda r, port, out: _rank_main(r, port, plan, how, out, log_dir), plan.dp)


@pytest.mark.parametrize("how, zero", [("ddp", 0), ("ddp_recorded", 0), ("fsdp", 2), ("fsdp", 3)])
@pytest.mark.parametrize("shares", [None, [0.75, 0.25]])
def test_data_parallel_on_torch_modules_equals_one_process(how, zero, shares):
    plan = Plan(dp=2, zero=zero, micro_batch=2, global_batch=BATCH, dp_shares=shares, dtype="fp32",
                grad_bucket_mb=0.001)
    if shares:
        assert plan.samples_per_replica() == [6, 2]
    want = _reference()
    for grads in _run(plan, how):
        assert set(grads) == set(want)
        for n, g in grads.items():
            torch.testing.assert_close(torch.from_numpy(g), want[n], rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")


def test_mixed_precision_follows_the_plan():
    from plait.runtime.parallelize import mixed_precision

    mp_ = mixed_precision(Plan(dp=2, micro_batch=1, global_batch=2, dtype="bf16"))
    assert mp_.param_dtype == torch.bfloat16 and mp_.reduce_dtype == torch.float32
    mp_ = mixed_precision(Plan(dp=2, micro_batch=1, global_batch=2, dtype="fp16", grad_reduce_dtype="fp16"))
    assert mp_.param_dtype == torch.float16 and mp_.reduce_dtype == torch.float16


def test_ddp_buckets_are_recorded_with_their_bytes(tmp_path):
    import json

    plan = Plan(dp=2, micro_batch=2, global_batch=BATCH, dp_shares=[0.75, 0.25], dtype="fp32",
                grad_bucket_mb=0.001)
    _run(plan, "ddp_recorded", tmp_path)
    numel = sum(p.numel() for p in _model().parameters())
    for rank in range(2):
        lines = [json.loads(x) for x in (tmp_path / f"rank{rank}.jsonl").read_text().splitlines()]
        calls = [x for x in lines if x.get("op") == "all_reduce" and "dp bucket" in str(x.get("name"))]
        # DDP's first iteration puts up to 1 MiB in its first bucket (dist._DEFAULT_FIRST_BUCKET_BYTES);
        # the plan's bucket size applies once it rebuilds its buckets, after that iteration
        assert len(calls) >= 1
        assert sum(x["bytes"] for x in calls) == 4 * numel  # every fp32 gradient once
        assert all(x["t_end"] >= x["t_start"] for x in calls)


@pytest.mark.parametrize("recompute, wrapped", [("none", 0), ("full", 2), ("selective", 1)])
def test_activation_checkpointing_reruns_what_the_plan_names_with_equal_gradients(recompute, wrapped):
    from plait.runtime.parallelize import apply_ac

    calls = []

    class Core(nn.Module):  # the attention core a zoo model marks for selective recompute
        plait_selective = True

        def forward(self, x):
            calls.append(1)
            return torch.tanh(x) * x

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Sequential(nn.Linear(16, 16), Core()), nn.Sequential(nn.Linear(16, 4)))

    x = torch.randn(4, 16)
    ref = model()
    ref(x).square().mean().backward()
    m = model()
    assert len(apply_ac(list(m), recompute)) == wrapped
    calls.clear()
    m(x).square().mean().backward()
    assert len(calls) == (1 if recompute == "none" else 2)  # the core's forward re-run in backward
    for (n, p), q in zip(m.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=n)
    assert [n for n, _ in m.named_parameters()] == [n for n, _ in ref.named_parameters()]


def _box_rank_main(rank: int, port: int, plan: Plan, out) -> None:
    try:
        from plait.runtime.comm import Comm
        from plait.runtime.parallelize import apply_fsdp, apply_tp, build_mesh
        from plait.runtime.sharded_state import dtensor_cuts

        torch.set_num_threads(1)
        comm = Comm(rank, plan.dp * plan.tp)
        comm.init_process_group("gloo", timeout_s=60, init_method=f"tcp://127.0.0.1:{port}")
        mesh = build_mesh(plan, comm)
        torch.manual_seed(0)  # the column linear's 10 outputs: 5 per tensor rank, cut 3 and 2 over dp
        block = nn.Sequential(nn.Linear(16, 10), nn.Tanh(), nn.Linear(10, 16))
        block[0].plait_tp, block[2].plait_tp = "column", "row"
        model = nn.Sequential(block, nn.LayerNorm(16))
        apply_tp(model, mesh, [("0", block)])
        apply_fsdp(model, mesh, plan, [block])
        boxes: dict = {}
        infos, _ = dtensor_cuts(model, boxes)
        out.put((rank, {n: (boxes.get(n), str(tuple(p.placements)), p.to_local().detach().numpy().copy(),
                            n in infos) for n, p in model.named_parameters()}))
        comm.close()
        Comm.destroy()
    except BaseException:
        out.put((rank, traceback.format_exc()))


def test_fsdp2_over_dtensor_tp_shards_are_boxes_of_the_whole_tensor():
    """FSDP2 over DTensor TP (dp=2 x tp=2, issue 29): a TP-cut parameter becomes a 2D DTensor, which
    `sharded_state.dtensor_cuts` takes as one box per rank (its local tensor's global offsets); the
    four ranks' boxes tile the whole tensor, each holding the single-process values there, uneven
    cuts included; a parameter cut over one mesh dim keeps its one-dim cut (no box)."""
    plan = Plan(dp=2, tp=2, zero=1, micro_batch=1, global_batch=2, dtype="fp32")
    results = list(enumerate(_spawn(lambda r, port, out: _box_rank_main(r, port, plan, out), 4)))
    torch.manual_seed(0)
    whole = dict(nn.Sequential(nn.Sequential(nn.Linear(16, 10), nn.Tanh(), nn.Linear(10, 16)),
                               nn.LayerNorm(16)).named_parameters())
    assert "_StridedShard" in results[0][1]["0.0.weight"][1]  # FSDP2's dim-0 cut over the colwise one
    for name, want in whole.items():
        if name.startswith("1.") or name == "0.2.bias":  # LayerNorm, rowwise bias: FSDP2's one-dim cut
            assert all(r[name][0] is None and r[name][3] for _, r in results)
            continue
        covered = torch.zeros(want.shape, dtype=torch.int32)
        for _, r in results:
            box, _, local, _ = r[name]
            assert box is not None and box[1] == tuple(want.shape), name
            region = tuple(slice(o, o + s) for o, s in zip(box[0], local.shape, strict=True))
            torch.testing.assert_close(torch.from_numpy(local), want.detach()[region], rtol=0, atol=0, msg=name)
            covered[region] += 1
        assert covered.unique().tolist() == [1], name  # cut over dp and tp: each element on one rank
