"""The one pipeline driver: a plan's stage graph, its schedule's action lists and its stages'
emitters to one iteration's `TaskGraph`.

Every plan is a stage graph (`plait.ir.stage_graph`; a chain is the special case, an SPMD plan
one stage) whose stages run a program over their devices; a stage may have data-parallel
replicas, each running its share of the batch as micro-batches (first sample, size). A *worker*
is one simulated replica of one stage. The driver walks the same action lists the runtime
executes (`plait.schedule`) in four steps, the same for every family:

1. **compute**: each worker's fwd/bwd actions in program order, emitted by its stage's emitter
   (`emit_worker`), which records per action the tasks that start it (`item_first`: what a
   received tensor must precede) and the tasks that end it (`item_last`: what a sent tensor waits
   for). Two emitters exist: Megatron tensor parallelism per layer
   (`plait.sim.lowering.tensor_parallel`) and op-level SPMD programs
   (`plait.sim.lowering.spmd`);
2. **transfers** (`emit_transfers`): for each edge of the stage graph, every producer
   micro-batch whose samples meet a consumer micro-batch's sends them forward and receives
   their gradients back -- a replica of one stage meets the replicas of the next on sample
   ranges, so stages of different data-parallel degrees or micro-batch sizes meet correctly.
   Two named options say how the runtime's point-to-point works: `rendezvous` (the transfer
   starts once the receiver has reached its receive, Megatron's p2p; else an eager send that
   starts when the tensor exists) and `blocking` (the sender waits for the transfer to end
   before its next action, Megatron's blocking 1F1B / GPipe p2p). The emitter prices the
   message on the cluster's links (`send`);
3. **data** (`emit_data`): input loading and host-to-device copies where the emitter's runtime
   has them on their own streams;
4. **finish**: gradient synchronisation, tied parameters, the optimizer step (the emitter's).
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from typing import Any

from plait.sim.engine import TaskGraph

# One action of a worker's program: ("F" | "B", chunk id, micro-batch index on the worker).
Item = tuple[str, int, int]


class PipelineDriver:
    """Base of the two stage emitters: the walk of module docstring. A worker has ``wid``,
    ``chunks`` (chunk ids, the first one receiving a stage's inputs) and ``units`` ((first sample,
    size) per micro-batch); a subclass fills `programs` and implements the emitter hooks."""

    tg: TaskGraph
    programs: dict[int, list[Item]]  # per worker id, its compute program (set by the subclass)
    rendezvous: bool = True  # a transfer waits for its receiver to reach the receive (else eager)
    blocking: bool = False  # the sender's next action waits for its transfer to end
    per_input: bool = False  # a later chunk of a stage takes its inputs with the stage's first chunk

    def drive(self, workers: list[Any], edges: list[tuple[int, int]]) -> None:
        """Steps 1 to 4 of the module docstring over `workers` (emission order) and the chunk
        graph's `edges`."""
        self.item_first: dict[int, list] = {}
        self.item_last: dict[int, list] = {}
        for w in workers:
            self.emit_worker(w)
        self.emit_transfers(workers, edges)
        self.emit_data(workers)
        self.finish(workers)

    # ------------------------------------------------------------ emitter hooks
    def emit_worker(self, w: Any) -> None:
        """Emit w's program (`self.programs[w.wid]`); set `item_first[w.wid]` / `item_last[w.wid]`
        per action: a task id, or a list of them."""
        raise NotImplementedError

    def message_bytes(self, edge: tuple[int, int], samples: int, src: Any) -> float:
        """Bytes of the tensors crossing chunk `edge` for `samples` samples, sent by `src` (it may
        depend on the sender through its stage only: the walk caches it so)."""
        raise NotImplementedError

    def send(self, src: Any, dst: Any, c_src: int, c_dst: int, u_src: int, u_dst: int, nbytes: float,
             deps: list[int], forward: bool) -> int:
        """The task (or last task) carrying a message of `nbytes` from `src` to `dst` after `deps`."""
        raise NotImplementedError

    def emit_data(self, workers: list[Any]) -> None:
        """Step 3 (nothing by default)."""

    def finish(self, workers: list[Any]) -> None:
        """Step 4."""
        raise NotImplementedError

    # ------------------------------------------------------------ step 2
    def emit_transfers(self, workers: list[Any], edges: list[tuple[int, int]]) -> None:
        # index: (wid, kind, chunk, unit) -> program position
        position: dict[tuple[int, str, int, int], int] = {}
        for w in workers:
            for idx, (k, c, i) in enumerate(self.programs[w.wid]):
                position[(w.wid, k, c, i)] = idx
        holders: dict[int, list[Any]] = defaultdict(list)
        for w in workers:
            for c in w.chunks:
                holders[c].append(w)
        starts = {w.wid: [s for s, _ in w.units] for w in workers}
        # [first sample, end of the last unit) of each holder, as the per-unit test below reads them
        span = {w.wid: (w.units[0][0], w.units[-1][0] + w.units[-1][1]) for w in workers if w.units}
        message_bytes, transfer = self.message_bytes, self._transfer
        sizes: dict[tuple[tuple[int, int], int, int], float] = {}  # (edge, samples, sender's stage)
        for a, b in edges:
            edge = (a, b)
            for q in holders[b]:
                if not q.units:
                    continue
                # producers whose samples meet q's at all (in holder order: emission order is kept)
                q_lo, q_hi = min(u[0] for u in q.units), max(u[0] + u[1] for u in q.units)
                near = [p for p in holders[a] if p.units and span[p.wid][0] < q_hi and span[p.wid][1] > q_lo]
                for ui, (qs, qn) in enumerate(q.units):
                    for p in near:
                        if p.units[0][0] >= qs + qn or p.units[-1][0] + p.units[-1][1] <= qs:
                            continue
                        # Producer micro-batches overlapping [qs, qs+qn): bisect on their starts.
                        first = max(0, bisect.bisect_right(starts[p.wid], qs) - 1)
                        for uj in range(first, len(p.units)):
                            ps, pn = p.units[uj]
                            if ps >= qs + qn:
                                break
                            lo, hi = max(qs, ps), min(qs + qn, ps + pn)
                            if hi <= lo:
                                continue
                            size_key = (edge, hi - lo, p.stage)
                            nbytes = sizes.get(size_key)
                            if nbytes is None:
                                nbytes = sizes[size_key] = message_bytes(edge, hi - lo, p)
                            transfer(p, q, a, b, uj, ui, nbytes, position, True)
                            transfer(q, p, b, a, ui, uj, nbytes, position, False)

    def _transfer(self, src: Any, dst: Any, c_src: int, c_dst: int, u_src: int, u_dst: int,
                  nbytes: float, position: dict, forward: bool) -> None:
        k = "F" if forward else "B"
        ks = position.get((src.wid, k, c_src, u_src))
        kd = position.get((dst.wid, k, c_dst, u_dst))
        if ks is None or kd is None:
            return
        # an item is one task id (an int: every 3D worker's) or a list of them (an SPMD stage's);
        # `x.__class__ is int` keeps the 1024-GPU grid's hundreds of thousands of transfers cheap
        sent = self.item_last[src.wid][ks]
        deps = [sent] if sent.__class__ is int else list(sent)
        after = self.item_first[dst.wid][kd]
        if src.wid == dst.wid:  # two chunks of one worker: program order, no message
            for a in (after if isinstance(after, list) else [after]):
                for d in deps:
                    self.tg.add_dep(d, a)
            return
        if self.rendezvous:
            post = kd
            if forward and self.per_input and c_dst != dst.chunks[0]:
                # a later segment of a stage that runs per input: the executor posts its receives
                # with those of the stage's first segment for the micro-batch and waits them at
                # its forward
                post = position.get((dst.wid, "F", dst.chunks[0], u_dst), kd)
            if post > 0:
                ready = self.item_last[dst.wid][post - 1]  # receiver has posted its receive
                if ready.__class__ is int:
                    deps.append(ready)
                else:
                    deps.extend(ready)
        tid = self.send(src, dst, c_src, c_dst, u_src, u_dst, nbytes, deps, forward)
        succ, npred = self.tg.succ[tid], self.tg.npred  # `tg.add_dep`, inlined: 10^4 transfers
        if after.__class__ is int:
            succ.append(after)
            npred[after] += 1
        else:
            for a in after:
                succ.append(a)
                npred[a] += 1
        if self.blocking:
            firsts = self.item_first[src.wid]
            if ks + 1 < len(firsts):
                nxt = firsts[ks + 1]
                if nxt.__class__ is int:
                    succ.append(nxt)
                    npred[nxt] += 1
                else:
                    for a in nxt:
                        succ.append(a)
                        npred[a] += 1


def compute_program(actions: list, chunks: list[int], mine: dict[int, int] | None = None) -> list[Item]:
    """A worker's program from its stage's compute actions (`Schedule.compute`): chunk ids from the
    actions' local chunks; `mine`: the stage's micro-batch -> this replica's, keeping only its own
    (a restriction of a deadlock-free order stays deadlock-free)."""
    if mine is None:
        return [("F" if a.op == "fwd" else "B", chunks[a.chunk], a.micro_batch) for a in actions]
    return [("F" if a.op == "fwd" else "B", chunks[a.chunk], mine[a.micro_batch])
            for a in actions if a.micro_batch in mine]
