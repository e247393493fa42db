"""The torch engine (issue 29): one rank of a data-parallel or ZeRO plan (pp = tp = 1) run on
torch's own modules -- DDP, or FSDP2 `fully_shard` for ZeRO -- composed by `parallelize` over the
plan's named DeviceMesh; and, asked for (`LaunchConfig(engine="torch")`, dp = 1), a tensor-parallel
plan on DTensor (`parallelize.apply_tp`: colwise / rowwise linears in the transformer layers). `plait.runtime.layout.engine_for` says which plans it runs; the others
stay on plait's own executors (`plait.runtime.worker`).

The path of one step, as the pipeline engine's, so both give the same losses, records and results:

1. every rank builds the whole model from the same seed, checkpoints its layers' activations as
   the plan's `recompute` names (`parallelize.apply_ac`), and wraps it in DDP (buckets of the
   plan's `grad_bucket_mb`, all-reduced through the communication facade by DDP's comm hook, so
   each bucket is a record in `comm/rankN.jsonl`) or FSDP2 (one unit per layer that shares no
   parameter with another layer -- a tied embedding and LM head stay in the root unit);
2. its replica runs its share of the global batch (`partition.replica_micro_batches`: uneven
   shares included) one micro-batch after the other, forward then backward, accumulating
   gradients: DDP's `no_sync` holds its all-reduce back to the last micro-batch; FSDP2
   reduce-scatters each micro-batch's gradients into the shards (ZeRO-3 keeps no whole gradient
   between micro-batches, as the memory model counts it). Micro-batch j's loss is scaled by n_j * dp / B: DDP and FSDP2
   average over the replicas, so the average is the gradient of the global batch's mean loss
   (`parallelize.replica_loss_weight`, per micro-batch);
3. under FSDP2 every micro-batch gathers the parameters again (ZeRO-3: a layer's gathered
   parameters live for one micro-batch) and reduce-scatters its gradients, so a replica with fewer micro-batches than another runs
   *ghost* micro-batches (one sample, loss weight 0) to join the gathers of the others in the
   same order; DDP reduces once per step, so it needs none;
4. the optimizer steps (global-norm clipping and the learning-rate schedule as the pipeline
   engine's), and the step's bounds, spans and records are kept as there
   (`results.write_result` writes rank 0's `result.json`).

bf16 / fp16 (issue 29): fp32 master parameters and optimizer state; the forward and the loss run
under `amp.autocast_for` (torch's autocast lists, as every engine and the reference); FSDP2 also
gathers its parameters in the run's dtype and reduce-scatters gradients in the plan's
`grad_reduce_dtype` (`parallelize.mixed_precision`). fp16 scales the loss with plait's
`amp.DynamicLossScaler`, its found-inf flag agreed over every rank, so all ranks skip or step
together (the pipeline engine's scaler: the same schedule, the same `result.json` fields).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import resource
import socket
import time
from dataclasses import asdict
from functools import partial
from typing import Any

import numpy as np
import torch
from torch import nn

from plait.ir.opgraph import TP_ALONE_ROLES
from plait.runtime.amp import SCALE_ENV, DynamicLossScaler, autocast_for
from plait.runtime.comm import (
    PROBE_BEFORE,
    PROBE_REPEAT,
    Comm,
    CommLog,
    Group,
)
from plait.runtime.data_parallel import make_optimizer
from plait.runtime.inject import PROCESS_FAULTS, fire, poison
from plait.runtime.parallelize import apply_ac, apply_ddp, apply_fsdp, apply_tp, build_mesh
from plait.runtime.partition import (
    MicroBatch,
    RuntimeSetupError,
    build_seeded,
    layer_modules,
    load_model_spec,
    make_samples,
    replica_micro_batches,
)
from plait.runtime.rank_config import RankConfig
from plait.runtime.recorder import Heartbeat, Recorder
from plait.runtime.results import comm_records_path, common_origin, write_result
from plait.runtime.tensor_parallel import head_local_params, is_tensor_parallel_layer
from plait.runtime.worker_config import WorkerConfig
from plait.schedule import event_key


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The layers (`partition.layer_modules`) that become FSDP2 units of their own: those that share
    no parameter with another layer (FSDP2 shards a parameter in one unit only; tied ones go to the
    root unit)."""
    layers = [m for name, m in layer_modules(model) if name]
    owners: dict[int, int] = {}
    for m in layers:
        for prm in m.parameters():
            owners[id(prm)] = owners.get(id(prm), 0) + 1
    return [m for m in layers if all(owners[id(prm)] == 1 for prm in m.parameters())]


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor (a DTensor's local shard)."""
    return t.to_local() if hasattr(t, "to_local") else t  # type: ignore[no-any-return]


class TorchWorker(RankConfig):
    def __init__(self, config: WorkerConfig, rank: int, heartbeat: Heartbeat) -> None:
        super().__init__(config, rank, heartbeat)
        self.t = rank % self.plan.tp  # pp = 1: Megatron's order, tensor rank fastest
        self.d = rank // self.plan.tp
        self.injection = config.faults.inject
        self.cuda = config.cuda
        self.fsdp = self.plan.zero >= 1

    # ------------------------------------------------------------------ setup
    def _init_dist(self) -> None:
        self.hb.progress("init")
        if self.cuda:
            torch.cuda.set_device(self.gpu % torch.cuda.device_count())
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        config = self.config
        log = CommLog(comm_records_path(self.run_dir, self.rank), self.rank, self.world) \
            if config.records.comm_records else None
        self.comm = Comm(self.rank, self.world, rec=self.rec, log=log, faults=config.faults.link_faults(),
                         injection=self.injection, probe_bytes=config.records.probe_bytes)
        self.comm.init_process_group(config.backend, timeout_s=config.collective_timeout)
        self.mesh = build_mesh(self.plan, self.comm, self.device.type)
        self.dp_group: Group = self.comm.group("dp")

    def _build(self) -> None:
        self.hb.progress("build")
        config, plan = self.config, self.plan
        self.spec = load_model_spec(config.model)
        seed = config.seed
        model = build_seeded(self.spec, seed)
        self.layers = [name for name, _ in layer_modules(model)]
        self.param_count = sum(prm.numel() for prm in model.parameters() if prm.requires_grad)
        self.head_local: list[nn.Parameter] = []
        if plan.tp > 1:  # DTensor shards of the transformer layers' linears (dp = 1: `layout.torch_runs`)
            tp_layers = [(n, m) for n, m in layer_modules(model) if is_tensor_parallel_layer(m)]
            alone = {getattr(m, "plait_tp", None) for _, layer in tp_layers for m in layer.modules()} \
                & set(TP_ALONE_ROLES)
            if alone:
                raise RuntimeSetupError(f"model {config.model}: its plan cuts {sorted(alone)} modules, which the torch "
                                        "engine's DTensor tensor parallelism does not; run it without engine=torch")
            apply_tp(model, self.mesh, tp_layers)
            # whole parameters inside a cut attention see this rank's heads only (Qwen3's q_norm)
            self.head_local = [prm for _, layer in tp_layers for prm in head_local_params(layer, {})]
            self.param_count = sum(_local(prm).numel() for prm in model.parameters() if prm.requires_grad)
        apply_ac([m for _, m in layer_modules(model)], plan.recompute)
        model.to(self.device)
        self.model = model  # the unwrapped module: its parameters (DTensors under FSDP2) by their own names
        if self.fsdp:
            self.runner: nn.Module = apply_fsdp(model, self.mesh, plan, fsdp_units(model), self.dp_group,
                                                dtype=config.dtype)
        elif plan.tp > 1:
            self.runner = model
        else:
            self.runner = apply_ddp(model, self.mesh, plan, self.dp_group, dtype=config.dtype)
        self.params = [prm for prm in model.parameters() if prm.requires_grad]
        stream_seed = seed + 1 + self.d  # dropout streams: one per replica, as the pipeline engine's
        torch.manual_seed(stream_seed)
        random.seed(stream_seed)
        np.random.seed(stream_seed % (2**32))

    # ------------------------------------------------------------------ run
    def run(self) -> None:
        self._prepare()
        steps = self.config.steps
        self.comm.barrier("startup barrier")
        self.rec.set_origin()
        origin_info = common_origin(self.rec, self.comm)
        losses: list[torch.Tensor] = []
        bounds: list[tuple[int, float, float]] = []
        for step in range(steps):
            t0, t1, loss_sum = self._train_step(step)
            bounds.append((step, t0, t1))
            losses.append(loss_sum)
            if self.config.records.step_records:
                self._record_step(step, t0, t1, loss_sum)
        self.rec.step = None
        self._finish(losses, bounds, steps, origin_info)

    def _prepare(self) -> None:
        """The recorder, the process groups, the wrapped model, its optimizer and loss scaler."""
        config = self.config
        slow = any(f.kind == "slow" and f.rank == self.rank for f in self.injection.faults)
        self.rec = Recorder(self.info.device, 0, self.rank, cuda=self.cuda, slowdown=self.info.slowdown,
                            heartbeat=self.hb,
                            inject_factor=partial(self.injection.compute_factor, self.rank) if slow else None,
                            compute_floor_s=config.faults.compute_sleep)
        self._init_dist()
        self._build()
        if self.cuda and config.dtype == "tf32":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        # The optimizer steps on each parameter's local tensor (a DTensor's shard: a view of its
        # storage): the update is elementwise, so it is the same, without DTensor's dispatch on every
        # op of every parameter (bench/torch_engine.py: that made the optimizer ~10x slower on CPU).
        self.locals = [_local(prm).detach() for prm in self.params]
        self.optimizer = make_optimizer(self.locals, config.optimizer)
        # Only fp16 needs loss scaling: bf16 has the exponent range of fp32.
        self.scaler = DynamicLossScaler.from_string(os.environ.get(SCALE_ENV)) if config.dtype == "fp16" else None
        self.scales: list[float] = []
        if self.scaler is not None:  # every rank of the job skips or steps together
            self.scaler.group = self.comm.world_group

    def _train_step(self, step: int) -> tuple[float, float, torch.Tensor]:
        """One step: faults due now, barriers and link probes around the timed span, the replica's
        micro-batches, the optimizer step. Returns the span's (start, end) and the loss summed."""
        config = self.config
        probe_every = config.records.probe_every
        self.hb.progress("train", step)
        mbs = replica_micro_batches(self.plan, step, self.d)
        data = self._step_data(mbs)
        self.rec.step = step
        fault = self.injection.at(self.rank, step, "step", PROCESS_FAULTS)
        if fault is not None:
            fire(fault)
        if config.records.comm_records == "alternate":  # bench/recorder_overhead.py (as the pipeline engine)
            self.comm.recording = (step // 2 + step) % 2 == 0
        if config.step_barrier:
            self.comm.barrier("step barrier")
        if probe_every and step % probe_every == 0:
            self.comm.probe_links(PROBE_BEFORE)
            self.comm.barrier("probe barrier")
        t0 = self.rec.begin_step(step)
        if self.scaler is not None:
            self.scales.append(self.scaler.scale)
        loss_sum = self._accumulate(step, mbs, data)
        for prm in self.head_local:  # each rank's gradient is its heads' part: summed
            if prm.grad is not None:
                self.comm.group("tp").all_reduce(prm.grad, "allreduce tp head-local grads", "comm_tp")
        if self.injection.at(self.rank, step, "step", ("inf",)) is not None:
            poison(self._local_grads())
        self._optimizer_step(step)
        t1 = self.rec.end_step()
        if probe_every and step % probe_every == 0:
            self.comm.probe_links(PROBE_REPEAT - PROBE_BEFORE)
        return t0, t1, loss_sum

    def _optimizer_step(self, step: int) -> None:
        """Unscale (fp16), set the learning rate, clip, and step on the local tensors."""
        # fp16: unscale this rank's gradients (its shards under FSDP2); an inf anywhere skips the step everywhere
        skip = self.scaler is not None and self.scaler.unscale_and_check(
            [g for g in self._local_grads() if g is not None])
        if self.scaler is not None:
            self.scaler.update(step)
        self._set_lr(step)
        if self.config.clip_grad and not skip:
            torch.nn.utils.clip_grad_norm_(self.params, self.config.clip_grad)
        with self.rec.compute("optimizer", "optimizer"):
            for prm, loc in zip(self.params, self.locals, strict=True):
                loc.grad = _local(prm.grad) if prm.grad is not None else None
            if not skip:
                self.optimizer.step()
        for prm, loc in zip(self.params, self.locals, strict=True):
            prm.grad = loc.grad = None

    def _accumulate(self, step: int, mbs: list[MicroBatch],
                    data: dict[int, tuple[tuple[Any, ...], torch.Tensor]]) -> torch.Tensor:
        """Forward and backward of each of the replica's micro-batches, gradients reduced in the
        last one's backward; under FSDP2, ghost micro-batches up to the most any replica runs."""
        plan = self.plan
        rounds = len(mbs)
        if self.fsdp:
            rounds = max(len(replica_micro_batches(plan, step, d)) for d in range(plan.dp))
        loss_sum = torch.zeros((), device=self.device)
        scale = self.scaler.scale if self.scaler is not None else 1.0  # fp16: the loss scaled, the gradients with it
        for i in range(rounds):
            last = i == rounds - 1
            if i < len(mbs):
                mb, weight = mbs[i], mbs[i].size * plan.dp / plan.global_batch
                inputs, target = data[mb.index]
            else:  # a ghost: the replica's first sample again, adding nothing to the gradients
                mb, weight = MicroBatch(i, mbs[0].first, 1), 0.0
                inputs, target = make_samples(self.spec, mbs[0].first, 1, self.config.data_seed, self.device)
            # DDP holds its all-reduce back to the last micro-batch; FSDP2 reduce-scatters every
            # micro-batch's gradients into the shards, so that no rank holds whole gradients between
            # them (ZeRO-3's memory, as the memory model counts it).
            sync: Any = contextlib.nullcontext() if last or self.fsdp or plan.tp > 1 \
                else self.runner.no_sync()  # type: ignore[operator]
            # a ghost's spans are "ghost" ones: calibration and the doctor count real micro-batches only
            fwd, bwd = ("forward", "backward") if weight else ("ghost", "ghost")
            with sync:
                with self.rec.compute(event_key(fwd[:3] if weight else "ghost fwd", 0, 0, i), fwd, micro_batch=i,
                                      chunk=0, samples=mb.size):
                    with self._autocast():
                        loss = self.spec.loss(self.runner(*inputs), target)
                with self.rec.compute(event_key(bwd[:3] if weight else "ghost bwd", 0, 0, i), bwd, micro_batch=i,
                                      chunk=0, samples=mb.size):
                    (loss * (weight * scale)).backward()
            loss_sum += loss.detach().float() * (weight / plan.dp)
        return loss_sum

    def _autocast(self) -> Any:
        return autocast_for(self.config.dtype, self.device.type)

    def _local_grads(self) -> list[torch.Tensor | None]:
        """This rank's gradients (the local shards of FSDP2's DTensors), for the inf fault."""
        return [g.to_local() if g is not None and hasattr(g, "to_local") else g for g in (p.grad for p in self.params)]

    def _set_lr(self, step: int) -> None:
        sched = self.config.lr_schedule
        if sched is None:
            return
        lr = sched.at(step, self.config.steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def _step_data(self, mbs: list[MicroBatch]) -> dict[int, tuple[tuple[Any, ...], torch.Tensor]]:
        """The replica's samples of one step: synthetic by global index, or the user data's stream
        in the pipeline engine's order (`plait.runtime.data`)."""
        seed, data = self.config.data_seed, self.config.data
        if data is None:
            return {mb.index: make_samples(self.spec, mb.first, mb.size, seed, self.device) for mb in mbs}
        if getattr(self, "_data_iter", None) is None:
            from plait.runtime import data as user_data

            dataset, collate = user_data.load_data(data.spec)
            order = user_data.SampleOrder(len(dataset), seed)
            ranges = [(mb.first, mb.size) for step in range(self.config.steps)
                      for mb in replica_micro_batches(self.plan, step, self.d)]
            self._data_iter = user_data.batches(dataset, collate, order, ranges, data.workers)
        out = {}
        for mb in mbs:
            with self.hb.pause():  # a wait for the loader is not the step's work (plait.runtime.recorder)
                inputs, target = next(self._data_iter)
            out[mb.index] = (tuple(x.to(self.device) if isinstance(x, torch.Tensor) else x for x in inputs),
                             target.to(self.device))
        return out

    def _record_step(self, step: int, t0: float, t1: float, loss_sum: torch.Tensor) -> None:
        """`RUN_DIR/steps/rankN.jsonl` as the pipeline engine writes it."""
        rec = {"step": step, "t0": t0, "t1": t1, "wall": time.time(), "cpu": time.process_time(),
               "main_cpu": time.thread_time(), "dp": self.d, "loss_share": float(loss_sum)}
        with open(self.run_dir / "steps" / f"rank{self.rank}.jsonl", "a") as fh:
            fh.write(json.dumps(rec) + "\n")

    # ------------------------------------------------------------------ results
    def _finish(self, losses: list[torch.Tensor], bounds: list[tuple[int, float, float]], steps: int,
                origin: dict[str, Any]) -> None:
        self.hb.progress("gather")
        loss_vec = torch.stack(losses) if losses else torch.zeros(0, device=self.device)
        if self.plan.dp > 1 and loss_vec.numel():
            self.dp_group.all_reduce(loss_vec, "allreduce dp losses", "comm_dp", span=False)
        local = [_local(prm) for prm in self.params]
        param_bytes = sum(t.numel() * t.element_size() for t in local)  # held between steps (FSDP2, TP: shards)
        params = None
        if self.config.records.return_params:
            full = {n: (prm.full_tensor() if hasattr(prm, "full_tensor") else prm).detach().cpu().clone()
                    for n, prm in self.model.named_parameters()}  # FSDP2: gathered, collective
            params = full if self.d == 0 else None
            if params is not None:  # a tied tensor under each of its names (GPT-2's lm_head.weight)
                for name, prm in self.model.named_parameters(remove_duplicate=False):
                    first = next((n for n, p in self.model.named_parameters() if p is prm), None)
                    if name not in params and first in params:
                        params[name] = params[first]
        if self.cuda:
            peak, mem_kind = int(torch.cuda.max_memory_allocated()), "cuda_max_allocated"
        else:
            peak, mem_kind = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "max_rss"
        mine = {
            "rank": self.rank, "pp": 0, "dp": self.d, "tp": self.t, "device": self.info.device,
            "host": self.info.host, "node": self.info.node, "kind": self.info.kind,
            "slowdown": self.rec.slowdown, "pid": os.getpid(), "hostname": socket.gethostname(),
            "layers": self.layers, "params": self.param_count, "param_bytes": param_bytes,
            "peak_memory_bytes": peak, "memory_kind": mem_kind,
            "samples_per_step": self.plan.samples_per_replica()[self.d],
            "events": [asdict(e) for e in self.rec.events], "step_bounds": bounds,
            "losses": loss_vec.cpu().tolist(), "params_state": params if self.t == 0 else None, "shard_infos": {}, "clock": origin,
            "amp": {"scales": self.scales, "skipped": list(self.scaler.skipped), "final_scale": self.scaler.scale}
            if self.scaler is not None else None, "engine": "torch",
        }
        gathered = self.comm.gather_object(mine, dst=0, name="gather results")
        if self.rank == 0:
            assert gathered is not None
            write_result(self.run_dir, self.plan, gathered, 0, steps, self.config.records.return_params)
        self.comm.barrier("final barrier")
        self.comm.close()
