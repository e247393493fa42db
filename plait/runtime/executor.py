"""The runtime's one pipeline executor: runs a rank's `plait.schedule` action list.

A rank holds one or more *nodes* of the stage DAG (`partition.Stage`: a stage, or one
chunk of an interleaved rank) and executes its actions in order:

* ``fwd``: the node's module on one micro-batch. Its inputs are the model inputs it reads
  itself and, per incoming edge, the values received for the micro-batch's samples; when
  the producer's micro-batches are cut differently the pieces are concatenated along the
  batch dimension. The sink node computes the loss, scaled by n_j / B (micro-batch j's
  share of the global batch B), so summed gradients are those of the global mean loss.
* ``bwd``: back-propagates the gradients received for the node's outputs (summed over the
  edges that carry the same value; concatenated over pieces) or, on the sink, the loss
  (times the fp16 loss scale).
* ``send_*`` / ``recv_*``: one message each (the piece of samples the action names),
  to or from *any* peer stage: fan-out, fan-in, skip edges and several chunks per rank are
  all just peers. Tensors are cut along dim 0 when a piece is part of a micro-batch.
  Transfers between two nodes on the same rank have no action: the values are handed
  over in memory right after the producing compute. The nodes of a rank that runs a stage
  per input (`per_input`: its segments) take a later segment's forward receives early: posted
  in the batch of the first segment's, waited at their own segment's forward.

Every message of the executor goes through one function, `p2p`, and from it through the
runtime's communication facade (`plait.runtime.comm.Comm.p2p`, one record per tensor, keyed
by the action). A run of consecutive send/recv actions is posted together
(`batch_isend_irecv`) and its receives waited; its
sends are waited at the end of the step, or -- `blocking`, for linear 1F1B and GPipe as
Megatron does and as the simulator models -- at the end of the run. Both are the
semantics `plait.schedule.check.execute` proves deadlock-free and FIFO-consistent per pair
of ranks (buffered, and rendezvous for those schedules). The first time a piece of a given size crosses an edge between two ranks, the sender first sends a
fixed-size header describing the values (shapes, dtypes, requires_grad, Python
constants); both sides cache it.

Event names follow the shared key scheme (`plait.schedule.event_key`): "fwd s1 c0 mb3".
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from plait.runtime.comm import P2P, Comm
from plait.runtime.partition import MicroBatch, RuntimeSetupError, Stage
from plait.runtime.recorder import Recorder
from plait.schedule import Action

HEADER_BYTES = 1 << 14

Meta = list[tuple[str, Any, Any, bool]]  # ("t", shape, dtype, requires_grad) | ("c", value, None, False)
Piece = tuple[int, list[Any]]  # (first sample, values)


def _encode_header(meta: Meta, device: torch.device) -> torch.Tensor:
    payload = pickle.dumps(meta)
    if len(payload) + 8 > HEADER_BYTES:
        raise RuntimeError(f"pipeline header of {len(payload)} bytes exceeds {HEADER_BYTES}")
    buf = bytearray(HEADER_BYTES)
    buf[:8] = len(payload).to_bytes(8, "little")
    buf[8:8 + len(payload)] = payload
    return torch.frombuffer(buf, dtype=torch.uint8).clone().to(device)


def _decode_header(buf: torch.Tensor) -> Meta:
    raw = bytes(buf.cpu().numpy().tobytes())
    n = int.from_bytes(raw[:8], "little")
    return pickle.loads(raw[8:8 + n])


def _meta_of(values: list[Any]) -> Meta:
    return [("t", tuple(v.shape), v.dtype, bool(v.requires_grad)) if isinstance(v, torch.Tensor)
            else ("c", v, None, False) for v in values]


def _data_args(st: Stage, inputs: tuple[Any, ...]) -> list[Any]:
    """The model inputs a node reads itself, in its argument order (a *args placeholder takes the rest)."""
    if st.data_inputs is None:
        return list(inputs)
    if st.varargs:
        return [inputs[k] for k in st.data_inputs[:-1]] + list(inputs[st.data_inputs[-1]:])
    return [inputs[k] for k in st.data_inputs]


def p2p(comm: Comm, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]],
        keys: list[str], name: str, chunk: int, micro_batch: int, peer: str, wait_recvs: bool = True,
        **args: Any) -> list[Any]:
    """THE point-to-point call of the pipeline: post `sends` and `recvs` together through the
    communication facade (`Comm.p2p`: `batch_isend_irecv`, recorded per tensor), wait the
    receives (unless `wait_recvs` is False: a later segment's, posted early), return the works
    not waited (to wait later); one comm_pp span named by the first action's key. `keys[i]` is
    the event key of the i-th tensor (sends first)."""
    if not sends and not recvs:
        return []
    args["sent"] = sum(t.numel() * t.element_size() for t, _ in sends)
    ops = ([P2P("send", t, dst, k) for (t, dst), k in zip(sends, keys)]
           + [P2P("recv", t, src, k) for (t, src), k in zip(recvs, keys[len(sends):])])
    return comm.p2p(ops, name, "comm_pp", micro_batch, chunk=chunk, wait_sends=False, wait_recvs=wait_recvs,
                    peer=peer, **args)


class PipelineExecutor:
    """Runs the nodes of one pipeline rank (`chunks`: local chunk index -> Stage) by a schedule.

    `peer_rank(stage, chunk, micro_batch)` is the process rank that runs that node's
    micro-batch for this rank (`layout.peer_rank`: a chain's same replica and tensor index,
    a graph stage's replica that owns the micro-batch); `node_of(stage, chunk)` its node id
    (for the edges of `Stage.recv` / `Stage.send`); `sink` is the (stage, chunk) that
    computes the loss."""

    def __init__(self, chunks: dict[int, Stage], stage: int, node_of: Callable[[int, int], int],
                 peer_rank: Callable[[int, int, int], int], sink: tuple[int, int],
                 loss_fn: Callable[[Any, torch.Tensor], torch.Tensor], global_batch: int, device: torch.device,
                 recorder: Recorder, comm: Comm,
                 autocast: Callable[[], AbstractContextManager[Any]] | None = None,
                 blocking: bool = False, per_input: bool = False) -> None:
        self.chunks = chunks
        self.stage = stage
        self.node_of = node_of
        self.peer_rank = peer_rank
        self.sink = sink
        self.loss_fn = loss_fn
        self.global_batch = global_batch
        self.device = device
        self.rec = recorder
        self.comm = comm
        self.autocast = autocast or nullcontext
        self.blocking = blocking  # wait each group's sends at once (Megatron's blocking p2p, 1F1B/GPipe)
        # the chunks are the segments of a stage that runs per input (`StageSpec.segments`): the forward
        # receives of its later segments are posted with the first segment's and waited at their own
        self.per_input = per_input and len(chunks) > 1
        self.loss_sum: torch.Tensor = torch.zeros((), device=device)
        self.loss_scale = 1.0  # set per step by the worker's fp16 loss scaler
        # (producer node, consumer node, samples, peer rank) -> values; per peer rank, as each pair of
        # ranks exchanges its own headers (a graph stage's replicas meet several peers on one edge)
        self.send_meta: dict[tuple[int, int, int, int], Meta] = {}
        self.recv_meta: dict[tuple[int, int, int, int], Meta] = {}
        self.local: dict[int, int] = {self.node_of(stage, c): c for c in chunks}

    # ------------------------------------------------------------------ run
    def run(self, actions: Sequence[Action], micro_batches: dict[int, list[MicroBatch]],
            data: Callable[[int, MicroBatch], tuple[tuple[Any, ...], torch.Tensor]]) -> None:
        """Forward and backward of one step's micro-batches (gradients accumulated): `actions` are
        this rank's (`layout.rank_actions`), `micro_batches` each local chunk's list as the
        schedule numbers them (a graph stage's: all its replicas', in sample order)."""
        self.mbs = micro_batches
        self.data = data
        self.origin = {c: mbs[0].first if mbs else 0 for c, mbs in micro_batches.items()}
        self.inbox: dict[tuple[int, int, int], list[Piece]] = {}  # (chunk, mb, pred node) -> pieces
        self.grad_inbox: dict[tuple[int, int, int], list[Piece]] = {}  # (chunk, mb, succ node) -> pieces
        self.saved: dict[tuple[int, int], tuple[dict[int, list[Piece]], Any, Any]] = {}
        self.grads_out: dict[tuple[int, int], dict[int, list[Piece]]] = {}
        self.pending: list[Any] = []
        acts = list(actions)
        early = self._early_receives(acts)
        posted: set[int] = set()  # indices of receives posted early
        self.deferred: dict[tuple[int, int], list[tuple[Action, list[torch.Tensor], list[Any]]]] = {}
        k = 0
        while k < len(acts):
            if acts[k].is_compute:
                ahead = early.pop(k, [])
                if ahead and all(self._recv_meta(acts[x]) is not None for x in ahead):
                    self._exchange([], [acts[x] for x in ahead])  # no receives of its own before it
                    posted.update(ahead)
                for a, bufs, works in self.deferred.pop((acts[k].chunk, acts[k].micro_batch), []):
                    self.comm.wait(works, "wait early receives")
                    self._deliver(a, bufs)
                getattr(self, "_" + acts[k].op)(acts[k])
                k += 1
                continue
            j = k
            while j < len(acts) and not acts[j].is_compute:
                j += 1
            ahead = early.pop(j, [])
            if not (ahead and all(self._recv_meta(acts[x]) is not None for x in ahead)):
                ahead = []  # a header still to learn: those receives wait in their own place
            group = [acts[x] for x in range(k, j) if x not in posted]
            if group or ahead:
                self._exchange(group, [acts[x] for x in ahead])
            posted.update(ahead)
            k = j
        self.comm.wait(self.pending)
        self.pending = []
        assert not self.saved, "every forward has its backward"
        assert not self.deferred, "every receive posted early is waited at its forward"

    def _early_receives(self, acts: list[Action]) -> dict[int, list[int]]:
        """Per forward of a per-input stage's first segment (by action index), the indices of the
        forward receives of its later segments for the same micro-batch: posted with the first
        segment's, so a later segment's input crosses while the earlier segments compute (the
        simulator's `_transfer` does the same). Only receives whose headers are known are posted
        early (`run`); messages of one peer keep their order, as the peers send the pieces of a
        micro-batch in segment order and nothing else reaches this rank from them in between."""
        out: dict[int, list[int]] = {}
        if not self.per_input:
            return out
        first = min(self.chunks)
        for j, a in enumerate(acts):
            if a.op != "fwd" or a.chunk != first:
                continue
            ahead = []
            for x in range(j + 1, len(acts)):
                b = acts[x]
                if b.micro_batch != a.micro_batch or b.op not in ("fwd", "recv_fwd", "send_fwd"):
                    break
                if b.op == "recv_fwd":
                    ahead.append(x)
            if ahead:
                out[j] = ahead
        return out

    def _mb(self, chunk: int, index: int) -> MicroBatch:
        return self.mbs[chunk][index]

    def _range(self, chunk: int, index: int) -> tuple[int, int]:
        """Samples of a micro-batch relative to the replica's first sample (the schedule's numbering)."""
        mb = self._mb(chunk, index)
        lo = mb.first - self.origin[chunk]
        return lo, lo + mb.size

    # ------------------------------------------------------------------ compute
    def _fwd(self, a: Action) -> None:
        c, i = a.chunk, a.micro_batch
        st, mb = self.chunks[c], self._mb(c, i)
        me = self.node_of(self.stage, c)
        with self.rec.compute(a.key, "forward", micro_batch=i, chunk=c, samples=mb.size):
            is_sink = (self.stage, c) == self.sink
            args: list[Any] = []
            if st.data_inputs is None or st.data_inputs or is_sink:
                inputs, target = self.data(c, mb)
                args += _data_args(st, inputs)
            leaves: dict[int, list[Piece]] = {}
            for pred in sorted(st.recv):
                pieces = sorted(self.inbox.pop((c, i, pred), []), key=lambda p: p[0])
                if not pieces:
                    raise RuntimeSetupError(f"pipeline: {a.key} has no input from node {pred}")
                leaves[pred] = pieces
                args += self._concat([vals for _, vals in pieces], [st.batch_dims.get(n, 0) for n in st.recv[pred]])
            with self.autocast():
                out = st.module(*args)
                loss = self.loss_fn(out, target) * (mb.size / self.global_batch) if is_sink else None
            if loss is not None:
                self.loss_sum += loss.detach().float()
            outs = list(out) if not is_sink else []
            self.saved[(c, i)] = (leaves, outs, loss)
            lo, hi = self._range(c, i)
            for succ in st.send:  # same-rank successors: hand over in memory
                if succ in self.local:
                    self._hand_over(c, i, outs, me, succ, lo, hi)

    def _hand_over(self, c: int, i: int, outs: list[Any], me: int, succ: int, lo: int, hi: int) -> None:
        sc = self.local[succ]
        for k, _ in enumerate(self.mbs[sc]):
            qlo, qhi = self._range(sc, k)
            plo, phi = max(lo, qlo), min(hi, qhi)
            if plo < phi:
                vals = [v.detach().requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor) else v
                        for v in self._edge_values(c, outs, succ, plo - lo, phi - lo, hi - lo)]
                self.inbox.setdefault((sc, k, me), []).append((plo, vals))

    def _bwd(self, a: Action) -> None:
        c, i = a.chunk, a.micro_batch
        st, mb = self.chunks[c], self._mb(c, i)
        me = self.node_of(self.stage, c)
        leaves, outs, loss = self.saved.pop((c, i))
        with self.rec.compute(a.key, "backward", micro_batch=i, chunk=c, samples=mb.size):
            if loss is not None:
                (loss * self.loss_scale if self.loss_scale != 1.0 else loss).backward()
            else:
                tensors, grads = self._output_grads(c, i, st, outs)
                if tensors:
                    torch.autograd.backward(tensors, grads)
            result: dict[int, list[Piece]] = {}
            for pred, pieces in leaves.items():
                result[pred] = [(first, [x.grad if x.grad is not None else torch.zeros_like(x)
                                         for x in vals if isinstance(x, torch.Tensor) and x.requires_grad])
                                for first, vals in pieces]
            self.grads_out[(c, i)] = result
        for pred, pieces in result.items():  # same-rank predecessors: hand over in memory
            if pred in self.local:
                pc = self.local[pred]
                for first, grads in pieces:
                    k = next(k for k in range(len(self.mbs[pc])) if self._range(pc, k)[0] <= first
                             < self._range(pc, k)[1])
                    self.grad_inbox.setdefault((pc, k, me), []).append((first, grads))

    def _output_grads(self, c: int, i: int, st: Stage, outs: list[Any]) -> tuple[list[torch.Tensor], list[Any]]:
        """Per output value that needs a gradient: the sum over the edges that carried it."""
        index = {name: k for k, name in enumerate(st.output_names)}
        total: dict[int, torch.Tensor] = {}
        for succ, names in st.send.items():
            pieces = sorted(self.grad_inbox.pop((c, i, succ), []), key=lambda p: p[0])
            if not pieces:
                continue
            carried = [index[n] for n in names if isinstance(outs[index[n]], torch.Tensor)
                       and outs[index[n]].requires_grad]
            dims = [st.batch_dims.get(n, 0) for n in names if isinstance(outs[index[n]], torch.Tensor)
                    and outs[index[n]].requires_grad]
            cat = self._concat([g for _, g in pieces], dims)
            for k, g in zip(carried, cat):
                total[k] = g if k not in total else total[k] + g
        ks = sorted(total)
        return [outs[k] for k in ks], [total[k] for k in ks]

    # ------------------------------------------------------------------ values on edges
    @staticmethod
    def _concat(parts: list[list[Any]], dims: list[int]) -> list[Any]:
        """Values of consecutive sample pieces joined along their batch dimension."""
        if len(parts) == 1:
            return parts[0]
        out = []
        for vals, d in zip(zip(*parts), dims):
            out.append(torch.cat(list(vals), dim=d) if isinstance(vals[0], torch.Tensor) else vals[0])
        return out

    def _edge_values(self, c: int, outs: list[Any], succ: int, lo: int, hi: int, size: int) -> list[Any]:
        """The values of edge (this node -> succ), rows [lo, hi) of the micro-batch (all when whole)."""
        st = self.chunks[c]
        index = {name: k for k, name in enumerate(st.output_names)}
        vals = [outs[index[n]] for n in st.send[succ]]
        if (lo, hi) == (0, size):
            return vals
        out = []
        for name, v in zip(st.send[succ], vals):
            d = st.batch_dims.get(name, 0)
            if isinstance(v, torch.Tensor) and (v.dim() <= d or v.shape[d] != size):
                raise RuntimeSetupError(f"pipeline: value {name!r} crossing to node {succ} has no batch dimension "
                                        f"of size {size} (shape {tuple(v.shape)}); stages with different "
                                        f"micro-batch sizes cut and join tensors along the batch")
            out.append(v.narrow(d, lo, hi - lo) if isinstance(v, torch.Tensor) else v)
        return out

    # ------------------------------------------------------------------ communication
    def _peer(self, a: Action) -> tuple[int, int]:
        assert a.peer is not None
        return self.node_of(a.peer[0], a.peer[1]), self.peer_rank(*a.peer)

    def _exchange(self, group: list[Action], early: Sequence[Action] = ()) -> None:
        """One run of consecutive send/recv actions, posted together (Megatron's batch_isend_irecv).

        Sends are all posted in the first round. A receive whose piece size is new on its edge
        first receives the header; later receives from the same peer wait for the next round so
        that messages of one peer are matched in their order (FIFO). With `blocking` the sends are
        also waited at the end of the group, as Megatron's blocking p2p for 1F1B and GPipe.
        `early`: forward receives of later segments of a per-input stage (headers known), posted
        after the group's own in the same batch when it needs no header (else in a batch of their
        own after it) and waited at their segment's forward (`run`)."""
        if early and all(self._recv_meta(a) is not None for a in group if a.op.startswith("recv")):
            self._exchange_early(group, list(early))
            return
        sends, send_keys = self._group_sends(group)
        pending = [a for a in group if a.op.startswith("recv")]
        first = True
        while first or pending:
            recvs: list[tuple[torch.Tensor, int]] = []
            recv_keys: list[str] = []
            done: list[tuple[Action, list[torch.Tensor] | None, torch.Tensor | None]] = []
            blocked: set[int] = set()
            for a in list(pending):
                src = self._peer(a)[1]
                if src in blocked:
                    continue
                meta = self._recv_meta(a)
                if meta is None:  # first piece of this size on this edge: learn what crosses it
                    header = torch.empty(HEADER_BYTES, dtype=torch.uint8, device=self.device)
                    recvs.append((header, src))
                    recv_keys.append(a.key)
                    done.append((a, None, header))
                    blocked.add(src)
                    continue
                bufs = [torch.empty(shape, dtype=dtype, device=self.device) for kind, shape, dtype, rg in meta
                        if kind == "t" and (rg or a.op == "recv_fwd")]
                recvs += [(b, src) for b in bufs]
                recv_keys += [a.key] * len(bufs)
                done.append((a, bufs, None))
                pending.remove(a)
            lead = group[0] if first else done[0][0]
            keys = (send_keys if first else []) + recv_keys
            self.pending += p2p(self.comm, sends if first else [], recvs, keys, lead.key, lead.chunk, lead.micro_batch,
                                str(lead.peer), batch=[str(x) for x in group] if first else [str(x) for x, _, _ in done])
            first = False
            for a, bufs, header in done:
                if header is not None:
                    self.recv_meta[self._edge_key(a)] = _decode_header(header)
                else:
                    self._deliver(a, bufs or [])
        if self.blocking:
            self.comm.wait(self.pending)
            self.pending = []
        if early:
            self._exchange_early([], list(early))

    def _group_sends(self, group: list[Action]) -> tuple[list[tuple[torch.Tensor, int]], list[str]]:
        """The (tensor, peer) sends of `group`'s send actions, in order, and each one's action key."""
        sends: list[tuple[torch.Tensor, int]] = []
        keys: list[str] = []
        for a in group:
            if a.op in ("send_fwd", "send_bwd"):
                part = self._send_fwd_tensors(a) if a.op == "send_fwd" else self._send_bwd_tensors(a)
                sends += part
                keys += [a.key] * len(part)
        return sends, keys

    def _exchange_early(self, group: list[Action], early: list[Action]) -> None:
        """`group` (every header known) and the `early` receives in one batch, nothing waited by it:
        the group's receives are waited here, the early ones filed in `deferred` for their forward."""
        sends, keys = self._group_sends(group)
        recvs: list[tuple[torch.Tensor, int]] = []
        filed: list[tuple[Action, list[torch.Tensor]]] = []
        for a in [x for x in group if x.op.startswith("recv")] + early:
            meta = self._recv_meta(a)
            assert meta is not None
            bufs = [torch.empty(shape, dtype=dtype, device=self.device) for kind, shape, dtype, rg in meta
                    if kind == "t" and (rg or a.op == "recv_fwd")]
            src = self._peer(a)[1]
            recvs += [(b, src) for b in bufs]
            keys += [a.key] * len(bufs)
            filed.append((a, bufs))
        lead = (group or early)[0]
        works = p2p(self.comm, sends, recvs, keys, lead.key, lead.chunk, lead.micro_batch, str(lead.peer),
                    wait_recvs=False, batch=[str(x) for x in group + early])
        self.pending += works[:len(sends)]
        at = len(sends)
        own = len(filed) - len(early)
        for n, (a, bufs) in enumerate(filed):
            mine, at = works[at:at + len(bufs)], at + len(bufs)
            if n < own:
                self.comm.wait(mine, "wait receives")
                self._deliver(a, bufs)
            else:
                self.deferred.setdefault((a.chunk, a.micro_batch), []).append((a, bufs, mine))
        if self.blocking:
            self.comm.wait(self.pending)
            self.pending = []

    def _edge_key(self, a: Action) -> tuple[int, int, int, int]:
        """(producer node, consumer node, piece size, peer rank) of the edge a send/recv action uses."""
        assert a.samples is not None
        me, (peer, rank) = self.node_of(self.stage, a.chunk), self._peer(a)
        n = a.samples[1] - a.samples[0]
        return (me, peer, n, rank) if a.op in ("send_fwd", "recv_bwd") else (peer, me, n, rank)

    def _recv_meta(self, a: Action) -> Meta | None:
        if a.op == "recv_fwd":
            return self.recv_meta.get(self._edge_key(a))
        return self.send_meta[self._edge_key(a)]  # gradients of what this node sent

    def _send_fwd_tensors(self, a: Action) -> list[tuple[torch.Tensor, int]]:
        assert a.samples is not None
        c, i = a.chunk, a.micro_batch
        succ, dst = self._peer(a)
        lo, hi = self._range(c, i)
        vals = self._edge_values(c, self.saved[(c, i)][1], succ, a.samples[0] - lo, a.samples[1] - lo, hi - lo)
        key = self._edge_key(a)
        sends = []
        if key not in self.send_meta:
            self.send_meta[key] = _meta_of(vals)
            sends.append((_encode_header(self.send_meta[key], self.device), dst))
        return sends + [(v.detach().contiguous(), dst) for v in vals if isinstance(v, torch.Tensor)]

    def _send_bwd_tensors(self, a: Action) -> list[tuple[torch.Tensor, int]]:
        assert a.samples is not None
        pred, dst = self._peer(a)
        grads = next(g for first, g in self.grads_out[(a.chunk, a.micro_batch)][pred] if first == a.samples[0])
        return [(g.contiguous(), dst) for g in grads]

    def _deliver(self, a: Action, bufs: list[torch.Tensor]) -> None:
        """File received tensors: activations (with constants) for a forward, or gradients."""
        assert a.samples is not None
        peer = self._peer(a)[0]
        if a.op == "recv_bwd":
            self.grad_inbox.setdefault((a.chunk, a.micro_batch, peer), []).append((a.samples[0], bufs))
            return
        meta = self.recv_meta[self._edge_key(a)]
        it = iter(bufs)
        vals: list[Any] = []
        for kind, value, _, rg in meta:
            if kind == "t":
                t = next(it)
                vals.append(t.requires_grad_(True) if rg else t)
            else:
                vals.append(value)
        self.inbox.setdefault((a.chunk, a.micro_batch, peer), []).append((a.samples[0], vals))
