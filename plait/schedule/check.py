"""A tiny executor of schedules in pure Python: proves a schedule runs to the end.

`execute(schedule)` runs every rank's action list with blocking receives and checks, as it
goes, that

* each compute action has its inputs: a forward has every piece of its input (received,
  or computed earlier on the same rank), a backward has its own forward and the gradient
  of every piece of its output;
* each send follows the compute that produced its tensor;
* each receive is matched by the right send (same pieces, same peers), in FIFO order per
  pair of ranks (torch's untagged point-to-point semantics);
* nothing is left over: no rank blocked forever (deadlock), no message never received,
  every (node, micro-batch) runs exactly one forward and one backward.

Two send semantics:

* ``rendezvous=False`` (the runtime executor's): a send is posted and the rank moves on;
* ``rendezvous=True`` (Megatron's blocking p2p): consecutive send/recv actions of a rank
  form one batch (`batch_isend_irecv`) that completes only when every message in it has
  met its partner, as NCCL's blocking send/recv would.

Violations raise `ScheduleError` with the rank and action.
"""

from __future__ import annotations

from collections import deque

from plait.schedule.core import Action, Schedule, ScheduleError


def _matches(send: Action, recv: Action) -> bool:
    return (send.op[5:] == recv.op[5:] and send.peer == (recv.stage, recv.chunk, recv.micro_batch)
            and recv.peer == (send.stage, send.chunk, send.micro_batch) and send.samples == recv.samples)


class _Run:
    def __init__(self, schedule: Schedule, rendezvous: bool) -> None:
        self.s = schedule
        self.g = schedule.graph
        self.rendezvous = rendezvous
        self.pc = [0] * len(schedule.actions)
        self.done: set[tuple] = set()  # ("fwd"|"bwd", node, mb), ("recv_fwd"|"recv_bwd", node, mb, samples, peer)
        self.channels: dict[tuple[int, int], deque[Action]] = {}
        self.trace: list[Action] = []
        self.node = {(n.stage, n.chunk): i for i, n in enumerate(self.g.nodes)}

    # ------------------------------------------------------------ dependencies
    def _node(self, a: Action) -> int:
        key = (a.stage, a.chunk)
        if key not in self.node:
            raise ScheduleError(f"schedule {self.s.name}: action {a} names no node of the pipeline graph")
        return self.node[key]

    def _have_piece(self, direction: str, n: int, mb: int, peer_node: int, peer_mb: int, lo: int, hi: int) -> bool:
        if self.g.nodes[peer_node].stage == self.g.nodes[n].stage:  # handed over in memory
            return (direction, peer_node, peer_mb) in self.done
        peer = (self.g.nodes[peer_node].stage, self.g.nodes[peer_node].chunk, peer_mb)
        return ("recv_" + direction, n, mb, (lo, hi), peer) in self.done

    def _check_compute(self, a: Action) -> None:
        n = self._node(a)
        if (a.op, n, a.micro_batch) in self.done:
            raise ScheduleError(f"schedule {self.s.name}: {a} runs twice")
        if a.micro_batch >= self.g.nodes[n].micro_batches:
            raise ScheduleError(f"schedule {self.s.name}: {a} is past the node's micro-batches")
        if a.op == "fwd":
            for p in self.g.predecessors(n):
                for j, i, lo, hi in self.g.overlaps(p, n):
                    if i == a.micro_batch and not self._have_piece("fwd", n, i, p, j, lo, hi):
                        raise ScheduleError(f"schedule {self.s.name}: {a} runs before its input "
                                            f"(node {p} mb{j}, samples {lo}..{hi})")
        else:
            if ("fwd", n, a.micro_batch) not in self.done:
                raise ScheduleError(f"schedule {self.s.name}: {a} runs before its forward")
            for b in self.g.successors(n):
                for j, i, lo, hi in self.g.overlaps(n, b):
                    if j == a.micro_batch and not self._have_piece("bwd", n, j, b, i, lo, hi):
                        raise ScheduleError(f"schedule {self.s.name}: {a} runs before the gradient "
                                            f"of its output (node {b} mb{i}, samples {lo}..{hi})")
        self.done.add((a.op, n, a.micro_batch))

    def _check_send(self, a: Action) -> None:
        n = self._node(a)
        source = "fwd" if a.op == "send_fwd" else "bwd"
        if (source, n, a.micro_batch) not in self.done:
            raise ScheduleError(f"schedule {self.s.name}: {a} is posted before its {source}")
        if a.peer is None or a.peer[0] == a.stage:
            raise ScheduleError(f"schedule {self.s.name}: {a} has no remote peer")

    # ------------------------------------------------------------ matching
    def _take(self, a: Action) -> bool:
        """Receive `a` if its message is at the head of its channel."""
        assert a.peer is not None
        q = self.channels.get((a.peer[0], a.stage))
        if not q:
            return False
        if not _matches(q[0], a):
            raise ScheduleError(f"schedule {self.s.name}: rank {a.stage} receives {a} but the next message "
                                f"from rank {a.peer[0]} is {q[0]} (FIFO order broken)")
        q.popleft()
        self.done.add((a.op, self._node(a), a.micro_batch, a.samples, a.peer))
        return True

    def _post(self, a: Action) -> None:
        self._check_send(a)
        assert a.peer is not None
        self.channels.setdefault((a.stage, a.peer[0]), deque()).append(a)

    # ------------------------------------------------------------ stepping
    def _batch(self, r: int) -> list[Action]:
        acts = self.s.actions[r]
        out = []
        k = self.pc[r]
        while k < len(acts) and not acts[k].is_compute:
            out.append(acts[k])
            k += 1
        return out

    def step_buffered(self, r: int) -> bool:
        acts = self.s.actions[r]
        moved = False
        while self.pc[r] < len(acts):
            a = acts[self.pc[r]]
            if a.stage != r:
                raise ScheduleError(f"schedule {self.s.name}: rank {r}'s list holds {a} of stage {a.stage}")
            if a.is_compute:
                self._check_compute(a)
            elif a.op.startswith("send"):
                self._post(a)
            elif not self._take(a):
                return moved
            self.trace.append(a)
            self.pc[r] += 1
            moved = True
        return moved

    def run(self) -> list[Action]:
        if self.rendezvous:
            return self._run_rendezvous()
        progress = True
        while progress:
            progress = False
            for r in range(len(self.s.actions)):
                progress |= self.step_buffered(r)
        return self._finish()

    def _run_rendezvous(self) -> list[Action]:
        """Batches of consecutive p2p actions complete together once all their partners are posted."""
        posted: dict[int, list[tuple[int, Action]]] = {}  # rank -> its posted batch (position, action)
        matched: set[tuple[int, int]] = set()  # (rank, position) of messages that met their partner
        progress = True
        while progress:
            progress = False
            for r in range(len(self.s.actions)):
                acts = self.s.actions[r]
                while r not in posted and self.pc[r] < len(acts) and acts[self.pc[r]].is_compute:
                    self._check_compute(acts[self.pc[r]])
                    self.trace.append(acts[self.pc[r]])
                    self.pc[r] += 1
                    progress = True
                if self.pc[r] < len(acts) and r not in posted:
                    batch = self._batch(r)
                    for a in batch:
                        if a.op.startswith("send"):
                            self._check_send(a)
                    posted[r] = [(self.pc[r] + k, a) for k, a in enumerate(batch)]
                    progress = True
            for r, batch in posted.items():  # pair each posted send with a posted receive
                for k, a in batch:
                    if not a.op.startswith("send") or (r, k) in matched:
                        continue
                    assert a.peer is not None
                    for k2, b in posted.get(a.peer[0], []):
                        if (a.peer[0], k2) not in matched and b.op.startswith("recv") and _matches(a, b):
                            matched |= {(r, k), (a.peer[0], k2)}
                            progress = True
                            break
            for r in [r for r, batch in posted.items() if all((r, k) in matched for k, _ in batch)]:
                for _, a in posted.pop(r):
                    if a.op.startswith("recv"):
                        self.done.add((a.op, self._node(a), a.micro_batch, a.samples, a.peer))
                    self.trace.append(a)
                    self.pc[r] += 1
                progress = True
        return self._finish()

    def _finish(self) -> list[Action]:
        stuck = [(r, self.s.actions[r][pc]) for r, pc in enumerate(self.pc) if pc < len(self.s.actions[r])]
        if stuck:
            where = "; ".join(f"rank {r} at {a}" for r, a in stuck[:4])
            raise ScheduleError(f"schedule {self.s.name}: deadlock ({where})")
        left = [a for q in self.channels.values() for a in q]
        if left:
            raise ScheduleError(f"schedule {self.s.name}: {len(left)} messages never received, e.g. {left[0]}")
        for i, node in enumerate(self.g.nodes):
            for mb in range(node.micro_batches):
                for op in ("fwd", "bwd"):
                    if (op, i, mb) not in self.done:
                        raise ScheduleError(f"schedule {self.s.name}: node {i} (stage {node.stage} chunk "
                                            f"{node.chunk}) never runs {op} of micro-batch {mb}")
        return self.trace


def execute(schedule: Schedule, rendezvous: bool = False) -> list[Action]:
    """Run `schedule` (see module docstring); returns the actions in one valid global order."""
    return _Run(schedule, rendezvous).run()
