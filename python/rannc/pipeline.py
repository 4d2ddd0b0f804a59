"""The pipeline engine: runs this rank's stage of a plan, micro-batch by micro-batch, in
the order the schedule (built in C++, `_C.build_schedule`) gives, moving exactly the rows
each replica needs.

[Note: row ownership] The global batch is the concatenation of the ranks' local batches
(rank r owns global rows [r*b, (r+1)*b)). Pipeline copy c takes a contiguous share of the
global rows, micro-batch m a contiguous share of the copy's rows, and replica j of a stage
a contiguous share of the micro-batch's rows. A batch value (IR `batch_dim` d, `batch_multiple`
k) of a row interval [s, t) has (t-s)*k entries along d. Every transfer sends the overlap of
the interval a source holds and the interval a consumer needs: this is the redistribution
between stages with different replica counts. Values without a batch dimension go whole,
from replica (j mod r) of the producing stage to replica j of the consumer.

[Note: send/receive ordering] Sends are non-blocking and are waited for at the end of the
step; the receives of the next action are posted before the current action computes and
are waited for when it needs them. Transfers go over channels that deliver in order
([Note: channels] in transport.py): on every channel both sides issue their transfers by
(micro-batch, value id, first row), forwards and backwards each in ascending micro-batch
order as every schedule runs them.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from . import _C
from .transport import (ACTIVATION, BATCH_OUTPUT, GRADIENT, INPUT_GRADIENT, INPUT_ROWS,
                        OUTPUT_GRADIENT, MpiChannels, NcclChannels)


def bounds(n: int, parts: int) -> list[int]:
    """Split points of n items into `parts` contiguous, nearly equal parts."""
    return [n * i // parts for i in range(parts + 1)]


@dataclass(frozen=True)
class Rows:
    start: int
    stop: int

    def __len__(self):
        return self.stop - self.start

    def overlap(self, other: "Rows") -> "Rows | None":
        s, t = max(self.start, other.start), min(self.stop, other.stop)
        return Rows(s, t) if s < t else None


class Layout:
    """Who runs what: stages, pipeline copies, replicas and the rows each one holds."""

    def __init__(self, deployment, world_size: int, local_batch: int, cap_micro_batches=False):
        """With `cap_micro_batches`, a batch too small for the plan's micro-batch count runs
        as many micro-batches as its rows allow (a short last batch of an epoch)."""
        self.world_size, self.local_batch = world_size, local_batch
        self.global_batch = world_size * local_batch
        self.pipelines = deployment.pipelines
        self.micro_batches = deployment.micro_batches
        self.stage_ranks = [list(s.ranks) for s in deployment.stages]
        self.replicas = [len(r) // self.pipelines for r in self.stage_ranks]
        self.copy_bounds = bounds(self.global_batch, self.pipelines)
        smallest = min(self.copy_bounds[c + 1] - self.copy_bounds[c] for c in range(self.pipelines))
        # Every replica of every stage needs at least one row of each micro-batch.
        fits = smallest // max(self.replicas)
        if cap_micro_batches and 1 <= fits < self.micro_batches:
            self.micro_batches = fits
        if fits < self.micro_batches:
            raise _C.Error(
                f"a global batch of {self.global_batch} rows ({world_size} ranks x {local_batch}) is "
                f"too small for this plan: {self.pipelines} pipeline copies x {self.micro_batches} "
                f"micro-batches with up to {max(self.replicas)} replicas per stage need at least "
                f"{self.pipelines * self.micro_batches * max(self.replicas)} rows; use a larger batch "
                "or fewer micro-batches (option num_microbatches)")
        self.place = {}
        for s, ranks in enumerate(self.stage_ranks):
            for i, r in enumerate(ranks):
                self.place[r] = (s, i // self.replicas[s], i % self.replicas[s])

    def rank_of(self, stage: int, copy: int, replica: int) -> int:
        return self.stage_ranks[stage][copy * self.replicas[stage] + replica]

    def micro_batch_rows(self, copy: int, m: int) -> Rows:
        lo, hi = self.copy_bounds[copy], self.copy_bounds[copy + 1]
        b = bounds(hi - lo, self.micro_batches)
        return Rows(lo + b[m], lo + b[m + 1])

    def share(self, stage: int, copy: int, m: int, replica: int) -> Rows:
        mb = self.micro_batch_rows(copy, m)
        b = bounds(len(mb), self.replicas[stage])
        return Rows(mb.start + b[replica], mb.start + b[replica + 1])

    def owned(self, rank: int) -> Rows:
        return Rows(rank * self.local_batch, (rank + 1) * self.local_batch)


@dataclass
class Piece:
    """One transfer: rows `rows` of value `vid` for micro-batch `m`, from `src` (whose
    tensor starts at row `src_start`) to `dst` (whose tensor starts at row `dst_start`)."""
    vid: int
    m: int
    src: int
    dst: int
    rows: Rows | None   # None: the whole (non-batch) value
    src_start: int = 0
    dst_start: int = 0


def _narrow(t: torch.Tensor, value: dict, rows: Rows | None, start: int) -> torch.Tensor:
    if rows is None:
        return t
    k, d = value["batch_multiple"], value["batch_dim"]
    return t.narrow(d, (rows.start - start) * k, len(rows) * k)


class Engine:
    """Runs one rank's stage of a deployment."""

    def __init__(self, traced, deployment, rank: int, world_size: int, local_batch: int,
                 state: dict, recompute: bool, device: torch.device = torch.device("cpu"),
                 nccl: bool = False):
        """`state`: value id -> the module's tensor (this rank's stage's ones must be on
        `device` before the first step); `nccl`: CUDA stages talk over NCCL."""
        self.traced, self.ir = traced, traced.ir
        self.device = device
        self.deployment = deployment
        self.rank, self.world_size = rank, world_size
        self.layout = Layout(deployment, world_size, local_batch)
        self.stage, self.copy, self.replica = self.layout.place[rank]
        self.pieces = [deployment.stage_piece(self.ir, s) for s in range(deployment.num_stages)]
        piece = self.pieces[self.stage]
        self.my_state = {v: state[v] for v in piece.inputs if v in state}
        self.executor = _C.StageExecutor(traced, piece, self.my_state, str(device))
        self.recompute = recompute or deployment.stages[self.stage].recompute
        # The executor's boundary values in channel order ([Note: send/receive ordering]).
        self._inputs_by_id = sorted(enumerate(self.executor.input_ids), key=lambda x: x[1])
        self._outputs_by_id = sorted(self.executor.output_ids)
        self.values = {}
        self.producer = {}  # value id -> stage producing it
        for s, p in enumerate(self.pieces):
            for v in p.outputs:
                self.producer[v] = s
        self.graph_inputs = set(self.ir.inputs)
        # Graph inputs come from the user's (host) batch over MPI; the rest over the
        # device's data plane.
        self.host_channels = MpiChannels()
        self.nccl = nccl
        self._batches = {}  # local batch -> its configuration ([Note: batch sizes])
        self._configure(self.layout)
        self.before_last_backward = None  # called before the step's last backward action
        self.input_grad_vids = None       # graph inputs whose user tensors require grad
        self.input_grads = {}             # their gradients after a step: vid -> tensor
        self._local_meta = {}             # those inputs: vid -> (shape, dtype) of this rank's
        self.set_input_grads(set())

    # ---- gradients of the inputs -----------------------------------------------------------
    # [Note: input gradients] An argument whose tensor requires grad gets its gradient, as
    # in PyTorch: each replica's backward returns the gradient of the rows it received, and
    # sends each row range back to the rank that owns it (the reverse of the input rows'
    # transfer, over MPI like them). A tensor without a batch dimension (every rank passes
    # its own copy) gets the sum over all ranks' rows, as the concatenated batch would.
    def set_input_grads(self, vids: set):
        """The graph inputs whose tensors require grad in the next steps."""
        if vids == self.input_grad_vids:
            return
        self.input_grad_vids = set(vids)
        self.executor.set_no_grad_inputs([v for v in self.executor.input_ids
                                          if v in self.graph_inputs and v not in vids])

    def _begin_input_grads(self):
        """Zeroed gradients of this rank's inputs that require grad, and the posted receives
        of their rows that other ranks ran."""
        self.input_grads = {vid: torch.zeros(shape, dtype=dtype, device=self.device)
                            for vid, (shape, dtype) in self._local_meta.items()
                            if vid in self.input_grad_vids}
        posted = []
        for p in self.input_sends:
            if p.vid in self.input_grad_vids:
                buf = self._empty(p.vid, p.rows)
                posted.append((p, buf, self.host_channels.recv(buf, p.dst, INPUT_GRADIENT)))
        return posted

    def _return_input_grad(self, vid: int, m: int, grad: torch.Tensor, sends: list):
        """Micro-batch m's gradient of this replica's rows of input `vid` to their owners."""
        v = self.value(vid)
        if v["batch_dim"] < 0:
            self.input_grads[vid].add_(grad.to(self.input_grads[vid].dtype))
            return
        mine = self.layout.owned(self.rank).start
        for p in self.recv[m].get(vid, []):
            piece = _narrow(grad, v, p.rows, p.dst_start)
            if p.src == self.rank:
                _narrow(self.input_grads[vid], v, p.rows, mine).add_(piece)
            else:
                sends.append(self.host_channels.send(piece.contiguous(), p.src, INPUT_GRADIENT))

    def _finish_input_grads(self, posted):
        mine = self.layout.owned(self.rank).start
        for p, buf, work in posted:
            work.wait()
            _narrow(self.input_grads[p.vid], self.value(p.vid), p.rows, mine).add_(buf)
        comm = None
        for vid in sorted(self.input_grads):  # every rank, in one order: a collective
            if self.value(vid)["batch_dim"] < 0:
                comm = comm or _C.Communicator.world_cpu()
                total = self.input_grads[vid].to("cpu", torch.float64)
                comm.all_reduce(total).wait()
                self.input_grads[vid] = total.to(self.device, self.input_grads[vid].dtype)

    # ---- batch sizes ----------------------------------------------------------------------
    # [Note: batch sizes] The plan's stages and replicas hold for any batch; what depends
    # on the batch size (the rows of each micro-batch and replica, the schedule's
    # micro-batch count, the transfer lists and the channels they use) is computed per
    # local batch size and cached. A batch smaller than the plan's runs fewer micro-batches
    # when its rows do not fill them all.
    _BATCH_STATE = ("layout", "train_actions", "recv", "send", "input_sends", "out_recv",
                    "out_send", "channels")

    def _configure(self, layout: Layout):
        self.layout = layout
        # This stage's actions of the planned schedule (the same lists the simulator ran).
        self.train_actions = _C.build_schedule(self.deployment.schedule, self.deployment.num_stages,
                                               layout.micro_batches)[self.stage]
        self._plan_transfers()
        self.channels = (NcclChannels(self._channels(), self.device) if self.nccl
                         else self.host_channels)
        self._batches[layout.local_batch] = {k: getattr(self, k) for k in self._BATCH_STATE}

    def use_batch(self, local_batch: int) -> bool:
        """Runs the next steps on local batches of `local_batch` rows (every rank calls it
        with the same size). Returns True when this size is new."""
        if local_batch == self.layout.local_batch:
            return False
        known = self._batches.get(local_batch)
        if known is not None:
            for k, v in known.items():
                setattr(self, k, v)
            return False
        self._configure(Layout(self.deployment, self.world_size, local_batch,
                               cap_micro_batches=True))
        return True

    # ---- transfer planning (pure; every rank computes the same lists) ------------------
    def value(self, vid: int) -> dict:
        if vid not in self.values:
            self.values[vid] = self.ir.value(vid)
        return self.values[vid]

    def _holders(self, vid: int, copy: int, m: int, replica_hint: int):
        """(rank, rows, start row of its tensor) for the holders of vid's rows, or the one
        holder of a non-batch value (rows None)."""
        v = self.value(vid)
        L = self.layout
        if vid in self.graph_inputs:
            if v["batch_dim"] < 0:
                return None  # every rank has its own copy
            return [(q, L.owned(q), L.owned(q).start) for q in range(L.world_size)]
        t = self.producer[vid]
        if v["batch_dim"] < 0:
            return [(L.rank_of(t, copy, replica_hint % L.replicas[t]), None, 0)]
        return [(L.rank_of(t, copy, j), L.share(t, copy, m, j), L.share(t, copy, m, j).start)
                for j in range(L.replicas[t])]

    def _pieces_into(self, stage: int, copy: int, m: int, replica: int, vid: int):
        L = self.layout
        dst = L.rank_of(stage, copy, replica)
        v = self.value(vid)
        holders = self._holders(vid, copy, m, replica)
        if holders is None:
            return [Piece(vid, m, dst, dst, None)]
        if v["batch_dim"] < 0:
            src, _, _ = holders[0]
            return [Piece(vid, m, src, dst, None)]
        need = L.share(stage, copy, m, replica)
        out = []
        for src, rows, start in holders:
            o = need.overlap(rows)
            if o is not None:
                out.append(Piece(vid, m, src, dst, o, start, need.start))
        return out

    def _plan_transfers(self):
        L, M = self.layout, self.layout.micro_batches
        me = self.rank
        self.recv = {m: {} for m in range(M)}   # m -> vid -> [Piece] into this rank
        self.send = {m: {} for m in range(M)}   # m -> vid -> [Piece] out of this rank
        self.input_sends = []                   # graph-input rows other ranks need from me
        for s in range(len(self.pieces)):
            for vid in self._stage_inputs(s):
                for c in range(L.pipelines):
                    for m in range(M):
                        for j in range(L.replicas[s]):
                            for p in self._pieces_into(s, c, m, j, vid):
                                if p.dst == me:
                                    self.recv[m].setdefault(vid, []).append(p)
                                elif p.src == me:
                                    target = (self.input_sends if vid in self.graph_inputs
                                              else self.send[m].setdefault(vid, []))
                                    target.append(p)
        # [Note: send/receive ordering]: each channel's transfers in one order on both sides
        order = lambda p: (p.m, p.vid, p.rows.start if p.rows is not None else 0)
        for table in (self.recv, self.send):
            for m in table:
                table[m] = {vid: sorted(ps, key=order) for vid, ps in sorted(table[m].items())}
        self.input_sends.sort(key=order)
        self._plan_outputs()

    def _channels(self):
        """(sender, receiver, kind) of every device channel this rank uses; both ends of a
        channel list it (the transfer lists are symmetric)."""
        out = set()
        for table in (self.recv, self.send):
            for by_vid in table.values():
                for vid, pieces in by_vid.items():
                    if vid in self.graph_inputs:
                        continue
                    for p in pieces:
                        out.add((p.src, p.dst, ACTIVATION))
                        out.add((p.dst, p.src, GRADIENT))
        for p in itertools.chain(*self.out_recv.values(),
                                 *(ps for t in self.out_send.values() for ps in t.values())):
            out.add((p.src, p.dst, BATCH_OUTPUT))
            out.add((p.dst, p.src, OUTPUT_GRADIENT))
        return sorted(c for c in out if c[0] != c[1])

    def _stage_inputs(self, s):
        """Inputs of stage s that move between ranks: not state, not constants, not shape
        values (which each stage computes from its own rows)."""
        piece = self.pieces[s]
        moved = []
        for vid in piece.inputs:
            v = self.value(vid)
            if v["role"] in ("param", "buffer", "constant") or self._is_shape_value(vid):
                continue
            if v["kind"] != "Tensor":
                raise _C.Error(
                    f"stage {s} needs the {v['kind']} value {v['name'] or vid} from another stage; "
                    f"rannc moves only tensors and shape values between stages "
                    f"(produced by {self.traced.describe_task(v['producer'])})")
            moved.append(vid)
        return moved

    def _is_shape_value(self, vid) -> bool:
        v = self.value(vid)
        return bool(v["int_values"]) and v["role"] == "intermediate" and (
            v["kind"] != "Tensor" or v["shape"] == [])

    def _shape_value(self, vid, m):
        """A size or shape for this replica's rows of micro-batch m (see [Note: shape
        values] in csrc/ir/value.h)."""
        v = self.value(vid)
        rows = len(self.layout.share(self.stage, self.copy, m, self.replica))
        ints = [k * rows if k else x for x, k in zip(v["int_values"], v["int_batch_multiples"])]
        if v["kind"] == "int":
            return ints[0]
        if v["kind"] == "int[]":
            return ints
        return torch.tensor(ints[0], dtype=_DTYPES[v["dtype"]])

    def _plan_outputs(self):
        """Batch outputs go back to the ranks owning their rows; scalars are averaged."""
        L, M, me = self.layout, self.layout.micro_batches, self.rank
        self.out_recv = {}   # vid -> [Piece] of my own rows
        self.out_send = {m: {} for m in range(M)}
        for vid in set(self.ir.outputs):
            v = self.value(vid)
            if vid in self.graph_inputs or v["batch_dim"] < 0:
                continue
            t = self.producer[vid]
            for c in range(L.pipelines):
                for m in range(M):
                    for j in range(L.replicas[t]):
                        src, rows = L.rank_of(t, c, j), L.share(t, c, m, j)
                        for q in range(L.world_size):
                            o = rows.overlap(L.owned(q))
                            if o is None:
                                continue
                            p = Piece(vid, m, src, q, o, rows.start, L.owned(q).start)
                            if q == me:
                                self.out_recv.setdefault(vid, []).append(p)
                            if src == me:
                                self.out_send[m].setdefault(vid, []).append(p)
        order = lambda p: (p.m, p.vid, p.rows.start)
        self.out_recv = {vid: sorted(ps, key=order) for vid, ps in sorted(self.out_recv.items())}
        self.out_send = {m: {vid: sorted(ps, key=order) for vid, ps in sorted(t.items())}
                         for m, t in self.out_send.items()}

    # ---- gradient groups ----------------------------------------------------------------
    def grad_groups(self, state_ids):
        """[(ranks, [vid, ...])]: for every parameter this rank uses, the ranks whose stages
        use it too; their gradients are summed (replicas, and tied weights across stages)."""
        users = {}
        for s, piece in enumerate(self.pieces):
            for v in piece.inputs:
                if v in state_ids:
                    users.setdefault(v, set()).update(self.layout.stage_ranks[s])
        groups = {}
        for v in sorted(users):
            groups.setdefault(tuple(sorted(users[v])), []).append(v)
        return sorted(groups.items())

    # ---- execution ------------------------------------------------------------------------
    def _empty(self, vid: int, rows: Rows | None, device=None) -> torch.Tensor:
        v = self.value(vid)
        shape = list(v["shape"])
        if rows is not None:
            shape[v["batch_dim"]] = len(rows) * v["batch_multiple"]
        return torch.empty(shape, dtype=_DTYPES[v["dtype"]], device=device or self.device)

    def _post_inputs(self, m: int) -> dict:
        """Posts the receives of micro-batch m's forward inputs: {vid: [(piece, buffer, work)]}
        (buffer and work None for rows this rank holds itself)."""
        posted = {}
        for _, vid in self._inputs_by_id:
            if self._is_shape_value(vid):
                continue
            pieces = self.recv[m].get(vid, [])
            if not pieces:
                raise _C.InternalError(f"rank {self.rank}: no source for input {vid} of micro-batch {m}")
            kind = INPUT_ROWS if vid in self.graph_inputs else ACTIVATION
            posted[vid] = [(p, None, None) if p.src == self.rank else
                           self._post_recv(p.vid, p.rows, p.src, kind, p) for p in pieces]
        return posted

    def _post_output_grads(self, m: int) -> dict:
        """Posts the receives of the gradients that micro-batch m's consumers send back."""
        return {vid: [self._post_recv(vid, p.rows, p.dst, GRADIENT, p) for p in self.send[m][vid]]
                for vid in self._outputs_by_id
                if self._carries_grad(vid) and self.send[m].get(vid)}

    def _post_recv(self, vid, rows, src, kind, piece):
        buf = self._empty(vid, rows)
        channels = self.host_channels if kind == INPUT_ROWS else self.channels
        return piece, buf, channels.recv(buf, src, kind)

    def _post(self, action):
        kind, m = action
        return self._post_inputs(m) if kind == "F" else self._post_output_grads(m)

    def _gather(self, vid: int, m: int, local: dict, posted: dict) -> torch.Tensor:
        """This replica's rows of an input value for micro-batch m."""
        if self._is_shape_value(vid):
            return self._shape_value(vid, m)
        v = self.value(vid)
        parts = []
        for p, buf, work in posted[vid]:
            if work is None:
                parts.append(_narrow(local[vid], v, p.rows, p.src_start).to(self.device))
            else:
                work.wait()
                parts.append(buf)
        if len(parts) == 1:
            return parts[0]
        return torch.cat(parts, dim=v["batch_dim"])

    def step(self, local: dict, train: bool):
        """Runs one iteration: with `train`, the planned schedule seeded by the scalar loss
        (1F1B), else forwards only. `local` maps graph-input value ids to this rank's
        tensors. Returns ({m: {output vid: tensor produced here}}, local batch outputs)."""
        M = self.layout.micro_batches
        actions = self.train_actions if train else [("F", m) for m in range(M)]
        self._seeds = {}
        if train:
            L = self.layout
            for m in range(M):
                rows = L.share(self.stage, self.copy, m, self.replica)
                self._seeds[m] = {self.loss_vid: len(rows) / L.global_batch}
        return self._execute(actions, local, train)

    def forward_for_backward(self, local: dict):
        """The forwards of a fill-drain iteration, stashing for backward_from(); returns
        what step() returns."""
        self.executor.discard()  # a training forward whose backward never came
        return self._execute([a for a in self.train_actions if a[0] == "F"], local, True)

    def backward_from(self, seeds: dict):
        """The backwards of the fill-drain iteration begun by forward_for_backward().
        `seeds` maps m -> {output vid: gradient seed of this replica's share} (a float for
        scalars, a tensor for others), see RaNNCModule."""
        self._seeds = seeds
        self._execute([a for a in self.train_actions if a[0] == "B"], None, True)

    def _execute(self, actions, local, train):
        """Runs a list of actions. The receives of the next action are posted before the
        current one computes, so its data arrive during the compute ([Note: progress
        thread] in csrc/comm/world.h)."""
        sends = []
        has_forwards = any(kind == "F" for kind, _ in actions)
        if has_forwards:
            self._shapes, self._produced = {}, {}
            self._local_meta = {vid: (local[vid].shape, local[vid].dtype)
                                for vid in self.input_grad_vids}
            for p in self.input_sends:
                t = _narrow(local[p.vid], self.value(p.vid), p.rows, p.src_start).contiguous()
                sends.append(self.host_channels.send(t, p.dst, INPUT_ROWS))
        input_grads = (self._begin_input_grads()
                       if self.input_grad_vids and any(k == "B" for k, _ in actions) else None)
        outputs = set(self.ir.outputs)
        last_backward = max((i for i, (kind, _) in enumerate(actions) if kind == "B"), default=-1)
        upcoming = self._post(actions[0]) if actions else {}
        for i, (kind, m) in enumerate(actions):
            if i == last_backward and self.before_last_backward is not None:
                self.before_last_backward()
            posted = upcoming
            upcoming = self._post(actions[i + 1]) if i + 1 < len(actions) else {}
            if kind == "F":
                ins = [self._gather(vid, m, local, posted) for vid in self.executor.input_ids]
                outs = self.executor.forward(m, ins, train, self.recompute)
                out_map = dict(zip(self.executor.output_ids, outs))
                self._shapes[m] = {vid: (t.shape, t.dtype) for vid, t in out_map.items()
                                   if isinstance(t, torch.Tensor)}
                for table, kind in ((self.send[m], ACTIVATION), (self.out_send[m], BATCH_OUTPUT)):
                    for vid, ps in table.items():
                        for p in ps:
                            if p.dst == self.rank:
                                continue  # my own rows of a batch output: _collect_batch_outputs
                            t = _narrow(out_map[vid], self.value(vid), p.rows, p.src_start)
                            sends.append(self.channels.send(t.contiguous(), p.dst, kind))
                self._produced[m] = {vid: t for vid, t in out_map.items() if vid in outputs}
            else:
                grads = [self._output_grad(vid, m, posted) for vid in self.executor.output_ids]
                in_grads = self.executor.backward(m, grads)
                for i, vid in self._inputs_by_id:
                    g = in_grads[i]
                    if vid in self.graph_inputs:
                        if g is not None and vid in self.input_grad_vids:
                            self._return_input_grad(vid, m, g, sends)
                        continue
                    if not self._carries_grad(vid) or self._is_shape_value(vid):
                        continue
                    for p in self.recv[m].get(vid, []):
                        piece = (self._empty(vid, p.rows).zero_() if g is None
                                 else _narrow(g, self.value(vid), p.rows, p.dst_start))
                        sends.append(self.channels.send(piece.contiguous(), p.src, GRADIENT))
        batch_outputs = self._collect_batch_outputs() if has_forwards else {}
        for w in sends:
            w.wait()
        if input_grads is not None:
            self._finish_input_grads(input_grads)
        return (self._produced, batch_outputs) if has_forwards else None

    # ---- gradients of outputs from outside (fill-drain) --------------------------------
    def scatter_output_grads(self, grads: dict) -> dict:
        """Sends the gradients of this rank's rows of the batch outputs (`grads`: vid ->
        tensor shaped like the local output, or None for zeros) to the replicas that
        produced those rows, and returns m -> {vid: summed gradient of my share} for the
        batch outputs this stage produces (the reverse of the outputs' transfers)."""
        sends, posted, mine = [], [], {}
        for p in sorted(itertools.chain(*self.out_recv.values()),
                        key=lambda p: (p.m, p.vid, p.rows.start)):
            g = grads.get(p.vid)
            t = (_narrow(g, self.value(p.vid), p.rows, p.dst_start).to(self.device).contiguous()
                 if g is not None else self._empty(p.vid, p.rows).zero_())
            if p.src == self.rank:
                mine[(p.m, p.vid, p.rows.start)] = t
            else:
                sends.append(self.channels.send(t, p.src, OUTPUT_GRADIENT))
        for m, table in self.out_send.items():
            for vid, pieces in table.items():
                for p in pieces:
                    if p.dst == self.rank:
                        posted.append((m, (p, mine[(m, vid, p.rows.start)], None)))
                    else:
                        posted.append((m, self._post_recv(vid, p.rows, p.dst, OUTPUT_GRADIENT, p)))
        seeds = {}
        for m, (p, buf, work) in posted:
            if work is not None:
                work.wait()
            shape, dtype = self._shapes[m][p.vid]
            seed = seeds.setdefault(m, {}).get(p.vid)
            if seed is None:
                seed = seeds[m][p.vid] = torch.zeros(shape, dtype=dtype, device=self.device)
            _narrow(seed, self.value(p.vid), p.rows, p.src_start).add_(buf)
        for w in sends:
            w.wait()
        return seeds

    def _carries_grad(self, vid: int) -> bool:
        v = self.value(vid)
        return v["kind"] == "Tensor" and v["requires_grad"]

    def _output_grad(self, vid, m, posted):
        """Gradient of one of this stage's outputs for micro-batch m: its seed (the loss's
        share, or a gradient from outside) and the pieces its consumers send back (posted
        receives), added at their rows."""
        shape, dtype = self._shapes[m][vid] if vid in self._shapes[m] else (None, None)
        seed = self._seeds.get(m, {}).get(vid)
        grad = None
        if seed is not None:
            grad = (seed.to(self.device, copy=True) if isinstance(seed, torch.Tensor)
                    else torch.full(shape, seed, dtype=dtype, device=self.device))
        if vid in posted:
            if grad is None:
                grad = torch.zeros(shape, dtype=dtype, device=self.device)
            for p, buf, work in posted[vid]:
                work.wait()
                _narrow(grad, self.value(vid), p.rows, p.src_start).add_(buf)
        return grad

    def _collect_batch_outputs(self):
        """This rank's own rows of every batch output, assembled in row order."""
        parts, works = {}, []
        for p in sorted(itertools.chain(*self.out_recv.values()),
                        key=lambda p: (p.m, p.vid, p.rows.start)):
            if p.src == self.rank:
                t = _narrow(self._produced[p.m][p.vid], self.value(p.vid), p.rows, p.src_start)
            else:
                t = self._empty(p.vid, p.rows)
                works.append(self.channels.recv(t, p.src, BATCH_OUTPUT))
            parts.setdefault(p.vid, []).append((p.rows.start, t))
        for w in works:
            w.wait()
        return {vid: torch.cat([t for _, t in sorted(ps, key=lambda x: x[0])],
                               dim=self.value(vid)["batch_dim"])
                for vid, ps in parts.items()}

    @property
    def loss_vid(self):
        losses = [v for v in self.ir.outputs if self.value(v)["is_loss"]]
        return losses[0] if len(losses) == 1 else None


_DTYPES = {
    "Float32": torch.float32, "Float64": torch.float64, "Float16": torch.float16,
    "BFloat16": torch.bfloat16, "Int64": torch.int64, "Int32": torch.int32,
    "Int16": torch.int16, "Int8": torch.int8, "UInt8": torch.uint8, "Bool": torch.bool,
}
