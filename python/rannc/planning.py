"""Planning a traced model without its devices: `rannc.plan(model, args, world_size=...)`.

Costs come from the device profiler by default (cost_model="profile"): every candidate
piece is run forward and backward at its real micro-batch size on this machine's device,
measured pieces are kept in a cache keyed by content (so identical layers, and a second
plan of the same model, cost nothing), and the work is spread over the ranks of the MPI
world when there are several (rank 0 plans, the others profile their share; see
[Note: parallel profiling] in csrc/profile/profiling_cost_model.h). cost_model="analytic"
plans from shapes alone (FLOPs and bytes against DeviceSpec's peaks); models whose
parameters live on the meta device are always planned that way.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

import torch

from . import _C, failure
from .graph import TracedGraph
from .options import PLAN, Options, format_bytes, option_docs, parse_bytes  # noqa: F401 (option_docs: rannc.plan's CLI)
from .update_cost import measure_update_rate

ProfileCache = _C.ProfileCache

# One cache per process: a second plan of the same model only traces and plans.
_DEFAULT_CACHE = _C.ProfileCache()
_BANDWIDTH = {}

def default_profile_cache():
    """The process-wide profile cache rannc.plan and RaNNCModule use by default."""
    return _DEFAULT_CACHE


def profile_device(device=None) -> str:
    """The device pieces are profiled on: `device` when given ("cpu", "cuda", "cuda:N" or a
    torch.device), else this rank's CUDA device when torch.cuda.is_available() (the local
    rank's, modulo the devices visible, so that the ranks of a node measure on different
    devices), else "cpu"."""
    if device is not None:
        return str(device)
    if torch.cuda.is_available():
        if _C.get_world_size() == 1:
            return f"cuda:{torch.cuda.current_device()}"
        from .transport import local_cuda_device
        return str(local_cuda_device())
    return "cpu"


class _Progress:
    """Rank 0's progress while profiling: per batch of pieces, measured / to measure, the
    time so far and an estimate of the rest; tqdm when installed, else one rewritten line
    on stderr. Off (None: when stderr is a terminal) it prints nothing."""

    def __init__(self, enabled: bool):
        self.enabled, self.bar, self.last, self.kind = enabled, None, 0.0, None
        self.batch, self.started = 0, 0.0

    def __call__(self, done: int, total: int):
        if not self.enabled:
            return
        if done == 1:
            self.batch += 1
            self.started = time.monotonic()
            self._open(total)
        if self.kind == "tqdm":
            self.bar.update(1)
            if done == total:
                self.bar.close()
        elif time.monotonic() - self.last > 0.5 or done == total:
            self.last = time.monotonic()
            elapsed = self.last - self.started
            left = elapsed / done * (total - done)
            sys.stderr.write(f"\rrannc: profiling batch {self.batch}: {done}/{total} pieces, "
                             f"{elapsed:.1f} s, about {left:.0f} s left"
                             + ("\n" if done == total else ""))
            sys.stderr.flush()

    def _open(self, total):
        try:
            from tqdm import tqdm
            self.kind, self.bar = "tqdm", tqdm(total=total, desc=f"rannc profiling {self.batch}",
                                               leave=False)
        except ImportError:
            self.kind = "line"


@dataclass
class PlanTimes:
    """Where the time before the first step went (seconds). Profiling is the measuring of
    pieces (with the optimizer-step timing), search the rest of planning."""
    tracing: float = 0.0
    profiling: float = 0.0
    search: float = 0.0
    pieces_measured: int = 0
    unions_composed: int = 0
    records_fitted: int = 0

    @property
    def total(self) -> float:
        return self.tracing + self.profiling + self.search

    def line(self) -> str:
        measured = (f" ({self.pieces_measured} pieces measured, {self.records_fitted} fitted, "
                    f"{self.unions_composed} composed)"
                    if self.pieces_measured or self.unions_composed else "")
        return (f"rannc: planned in {self.total:.2f} s: tracing {self.tracing:.2f} s, profiling "
                f"{self.profiling:.2f} s{measured}, search {self.search:.2f} s")


@dataclass
class StageSummary:
    index: int
    tasks: int
    param_bytes: int
    forward_time: float
    backward_time: float
    memory_bytes: int
    replicas: int
    micro_batch_rows: int
    recompute: bool
    update_time: float = 0.0  # the optimizer step, per iteration


class Plan:
    """A plan for a traced model: the Deployment and what it predicts."""

    def __init__(self, graph: TracedGraph, deployment, cost_model: str, planning_time: float,
                 times: PlanTimes | None = None):
        self.graph = graph
        self.deployment = deployment
        self.cost_model = cost_model
        self.planning_time = planning_time
        self.times = times or PlanTimes(search=planning_time)

    @property
    def num_stages(self) -> int:
        return self.deployment.num_stages

    @property
    def micro_batches(self) -> int:
        return self.deployment.micro_batches

    @property
    def iteration_time(self) -> float:
        return self.deployment.iteration_time

    @property
    def hash(self) -> str:
        """8 hex digits naming what the runtime would execute (equal hashes: the same plan)."""
        return self.deployment.hash

    def stages(self) -> list[StageSummary]:
        d = self.deployment
        out = []
        for i, s in enumerate(d.stages):
            out.append(StageSummary(i, len(s.tasks), s.param_bytes, s.forward_time, s.backward_time,
                                    s.memory_bytes, len(s.ranks) // max(1, d.pipelines),
                                    s.micro_batch_rows, s.recompute, s.update_time))
        return out

    @property
    def bubble_fraction(self) -> float:
        """Share of the iteration the stages spend idle (mean over stages of
        1 - busy / iteration, busy = micro-batches x (forward + backward) + optimizer step)."""
        return self.deployment.bubble_fraction

    def validate(self) -> None:
        """Every stage convex over its non-constant tasks, every task in exactly one stage."""
        self.deployment.validate(self.graph.ir)

    def stage_pieces(self) -> list:
        return [self.deployment.stage_piece(self.graph.ir, i) for i in range(self.num_stages)]

    def save(self, path: str) -> None:
        self.deployment.save(path)

    def summary(self) -> str:
        d = self.deployment
        lines = [
            f"rannc plan {d.hash} ({self.cost_model} costs, planned in {self.planning_time:.2f} s): "
            f"{d.num_stages} stage(s) x {d.pipelines} pipeline cop{'y' if d.pipelines == 1 else 'ies'} "
            f"on {d.world_size} device(s), {d.micro_batches} micro-batch(es) of global batch "
            f"{d.batch_size}, {d.schedule}",
            f"predicted iteration {d.iteration_time * 1e3:.3f} ms, bubble fraction "
            f"{self.bubble_fraction:.1%}, memory limit {format_bytes(d.memory_limit)}"
            + ("" if d.feasible else " (EXCEEDED)"),
            self.times.line(),
            f"{'stage':>5} {'tasks':>6} {'params':>10} {'fwd ms':>9} {'bwd ms':>9} {'upd ms':>8} "
            f"{'memory':>10} {'/ limit':>8} {'replicas':>8} {'rows':>5} {'recomp':>6}",
        ]
        for s in self.stages():
            frac = s.memory_bytes / d.memory_limit if d.memory_limit else 0.0
            lines.append(f"{s.index:>5} {s.tasks:>6} {format_bytes(s.param_bytes):>10} "
                         f"{s.forward_time * 1e3:>9.3f} {s.backward_time * 1e3:>9.3f} "
                         f"{s.update_time * 1e3:>8.3f} "
                         f"{format_bytes(s.memory_bytes):>10} {frac:>8.1%} {s.replicas:>8} "
                         f"{s.micro_batch_rows:>5} {'yes' if s.recompute else 'no':>6}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.summary()


def _on_meta(model: torch.nn.Module) -> bool:
    return any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))


def _meta_state(model, args, kwargs):
    """What to trace a model on the meta device with, on the CPU: stand-ins for its
    parameters ([Note: stand-in parameters] in _trace.py: the largest one's memory, not
    the model's), its buffers and arguments on meta made up (zeros for integers, N(0, 0.02)
    or N(0, 1) for floats)."""
    import torch.utils._pytree as pytree

    from ._trace import ModelState, state_for_tracing

    def real(x, scale=1.0):
        if isinstance(x, torch.Tensor) and x.is_meta:
            return (torch.zeros(x.shape, dtype=x.dtype) if not x.is_floating_point()
                    else torch.randn(x.shape, dtype=x.dtype) * scale)
        return x

    tensors = state_for_tracing(model, ModelState.of(model), torch.device("cpu"),
                                make_up_buffer=lambda b: real(b, scale=0.02))
    return tensors, pytree.tree_map(real, args), pytree.tree_map(real, kwargs)


def _device_spec(world_size, devices_per_node, device_memory):
    device = _C.DeviceSpec()
    device.memory_bytes = parse_bytes(device_memory)
    device.devices_per_node = max(1, min(devices_per_node or world_size, world_size))
    return device


def profile_in_parallel(wanted: bool, device: str) -> bool:
    """Whether the ranks share the profiling ([Note: parallel profiling]): where asked and
    there are several, unless ranks share a GPU, where each would time its pieces against
    the others' on the same device. Collective: every rank decides alike."""
    if not wanted or _C.get_world_size() == 1:
        return False
    crowded = device.startswith("cuda") and _C.get_local_size() > max(1, torch.cuda.device_count())
    from .transport import all_gather_objects
    if not any(all_gather_objects(crowded)):
        return True
    if _C.get_rank() == 0:
        _C.log_info("ranks share GPUs: rank 0 profiles alone, so that no measurement runs "
                    "beside another on the same device")
    return False


def probe_bandwidth(fallback_inter: float) -> dict:
    """Link bandwidths from a ping-pong probe between ranks (collective), once per process.
    With one rank: intra-node = this host's memory-copy bandwidth, inter-node = fallback."""
    if "result" not in _BANDWIDTH:
        _BANDWIDTH["result"] = _C.probe_bandwidth(float(fallback_inter))
    return _BANDWIDTH["result"]


# [Note: rows coupled] Micro-batches give the model's result only where each row's values
# are its own until the loss, and the loss is a mean or a sum of the rows' terms. Three ways
# a model couples its rows otherwise, each computed per micro-batch without a word before:
# - rows paired: a value with the batch in two dimensions (an in-batch contrastive loss;
#   [Note: rows paired] in csrc/frontend/traced_model.h);
# - a statistic over the rows that flows back into rows: a float tensor made from a batch
#   value that holds no batch dimension, from which a batch value is computed (batch
#   centering `(h - h.mean(0)) / h.std(0)`, hardest examples mined over the batch);
# - a loss whose reduction over the rows is neither a mean nor a sum (a max, a logsumexp,
#   a median or a listwise loss over the batch: ir::outputReduction "unknown").
# Such a model is planned with one micro-batch unless the user fixed their number, and the
# stage where the rows couple and every later one run one replica in one pipeline copy
# unless the user fixed the layout ([Note: rows kept together] in
# csrc/partition/stage/stage_cost.h), so they compute over the whole global batch, as
# PyTorch does; before session 40 each replica computed over its share (a plan with 2
# replicas of a SigLIP loss stage on 3 ranks gave 2.013 for PyTorch's 3.946, neither
# PyTorch's nor DDP's); rank 0 names the ops, and warns where the user's layout splits them. A statistic that only reaches the outputs (a
# mixture of experts' load-balancing loss, a count) stays per micro-batch, as Megatron's.
def rows_coupled(graph: TracedGraph) -> list[str]:
    """What couples the rows of `graph`'s batch ([Note: rows coupled]), for a message."""
    return _couplings(graph)[0]


def _couplings(graph: TracedGraph) -> tuple[list[str], list[int]]:
    """What couples the rows of `graph`'s batch, for a message, and the tasks where it
    does ([Note: rows coupled])."""
    ir, traced = graph.ir, graph._trace.traced
    found = [f"{op} pairs the rows of the batch (a value with the batch in two dimensions, as "
             "an in-batch contrastive loss's similarities)" for op in traced.pairing_ops]
    where = list(traced.pairing_tasks)
    tasks = ir.tasks()
    values = [ir.value(i) for i in range(ir.num_values)]
    # whether rows are computed from a value: a batch value is made from it, or it meets a
    # batch value in one task (ops glued together hide the batch values they make)
    reaches_rows = [False] * len(values)
    for task in reversed(tasks):
        if any(values[o].batch_dim >= 0 or reaches_rows[o] for o in task.outputs) or \
                any(values[i].batch_dim >= 0 for i in task.inputs):
            for i in task.inputs:
                reaches_rows[i] = True
    statistics = [t for t in tasks
                  if any(values[i].batch_dim >= 0 for i in t.inputs)
                  and any((_row_statistic(values[o]) or _counts_rows(t, values[o]))
                          and reaches_rows[o] for o in t.outputs)]
    if statistics:
        where += [t.id for t in statistics]
        ops = failure.some_of([traced.describe_task(t.id) for t in statistics], shown=2)
        found.append(f"{ops} makes a statistic over the rows of the batch from which later rows "
                     "are computed")
    # an embedding whose gradient divides each row's by its token's count in the batch
    # (scale_grad_by_freq=True): a micro-batch counts its own tokens (the gradient 81% off
    # with 2 micro-batches on 2 replicas)
    by_frequency = [t for t in tasks if t.op in ("aten::embedding", "aten::embedding_bag")
                    and len(t.inputs) > 3 and values[t.inputs[3]].constant == "True"
                    and any(values[i].batch_dim >= 0 for i in t.inputs)]
    if by_frequency:
        where += [t.id for t in by_frequency]
        ops = failure.some_of([traced.describe_task(t.id) for t in by_frequency], shown=2)
        found.append(f"{ops} scales each token's gradient by its count in the batch "
                     "(scale_grad_by_freq=True)")
    # the loss, or every output that could be it (a mixture of experts' model returns its
    # load-balancing loss beside the total, a mean: the total is the loss trained)
    losses = [ir.value(vid) for vid in ir.outputs if ir.value(vid).is_loss]
    if (losses and not traced.pairing_ops  # pairs: named once
            and all(ir.output_reduction(v.id) == "unknown" and _reads_rows_together(ir, v)
                    for v in losses)):
        ops = failure.some_of([traced.describe_task(v.producer) for v in losses if v.producer >= 0])
        found.append(f"the loss ({ops}) is not a mean or a sum of the rows' terms")
        where += [v.producer for v in losses if v.producer >= 0]
    return found, where


# Ops that read the rows together where they reduce over the batch. A loss made inside a
# task of many ops glued together (transformers' masks index rows by position, which glues
# a Llama classifier from the mask to its cross entropy) hides its reduction from
# ir::outputReduction: it is coupled only where such an op is among them.
_ROWS_TOGETHER = frozenset({
    "aten::std", "aten::var", "aten::std_mean", "aten::var_mean", "aten::max", "aten::amax",
    "aten::min", "aten::amin", "aten::logsumexp", "aten::topk", "aten::sort", "aten::argsort",
    "aten::median", "aten::kthvalue", "aten::quantile", "aten::cumsum", "aten::logcumsumexp",
    "aten::flip"})


def _reads_rows_together(ir, loss) -> bool:
    if loss.producer < 0:
        return False
    ops = ir.task(loss.producer).op.split("+")
    return len(ops) == 1 or any(op in _ROWS_TOGETHER for op in ops)


# Ops that count the rows into bins: class-balanced weights from the batch (`1 /
# torch.bincount(y)`), integer counts, so not a float statistic, yet as coupled (a
# weighted cross entropy with each micro-batch's weights gave 1.129 for PyTorch's 1.454).
_COUNTS_ROWS = frozenset({"aten::bincount", "aten::histc", "aten::histogram"})


def _counts_rows(task, v) -> bool:
    return (v.kind == "Tensor" and v.batch_dependent and v.batch_dim < 0
            and any(op in _COUNTS_ROWS for op in task.op.split("+")))


def _row_statistic(v) -> bool:
    return (v.kind == "Tensor" and v.batch_dependent and v.batch_dim < 0
            and v.dtype in ("Float32", "Float64", "Float16", "BFloat16"))


def _rows_kept_whole(graph: TracedGraph, opts: Options, popts, world_size: int) -> list[int]:
    """[Note: rows coupled]: a model that couples the rows of its batch is planned with one
    micro-batch unless the user fixed their number, and the stages from the coupling on
    with one replica in one pipeline copy unless the user fixed the layout ([Note: rows
    kept together] in csrc/partition/stage/stage_cost.h); rank 0 names what couples them.
    Returns the tasks that couple them (none: an empty list)."""
    coupled, where = _couplings(graph)
    if not coupled:
        return []
    if not opts.num_microbatches:
        popts.max_microbatches = 1
    fixed = bool(opts.replica_counts()) or (opts.num_stages == 1 and world_size > 1)
    if not fixed:
        popts.rows_together = where
    if _C.get_rank() != 0:
        return where
    what = "; ".join(coupled)
    grouping = _groups_rows_by_index(graph) if world_size > 1 else []
    if grouping:  # [Note: rows grouped by an index]
        _C.log_warn(f"{failure.some_of(grouping, shown=2)} groups the rows of the batch by the "
                    "values of an index (one row per group: a set's or a graph's pooling by "
                    "its `batch` vector, or per-class sums), and the ranks' rows are joined "
                    "into one global batch: those values must name the same groups on every "
                    "rank (classes). Groups of a rank's own (set or graph ids counted from 0 on "
                    "each rank) join other ranks' rows into one group: pad the sets to [sets, "
                    "largest set, ...] with a mask, so that the rows are the sets")
    if opts.num_microbatches > 1:
        _C.log_warn(f"{what}; and num_microbatches={opts.num_microbatches} cuts the batch: each "
                    "micro-batch computes that over its own rows only, which is not the model's "
                    "result on the whole batch. Leave num_microbatches unset to plan one "
                    "micro-batch per step, or compute the loss outside the module from its "
                    "outputs ([Note: rows coupled] in planning.py)")
    elif not fixed:
        _C.log_info(f"{what}: planned with one micro-batch, and the stages from there on with "
                    "one replica in one pipeline copy, so that they compute over the whole "
                    "global batch, as PyTorch does (the stages before may be replicated). To "
                    "pipeline micro-batches, return what the loss is made from and compute it "
                    "outside the module ([Note: rows coupled] in planning.py)")
    return where


# [Note: rows grouped by an index] A model that pools the rows into groups by an index
# (DeepSets or a GNN's readout: index_add_ of the rows by a `batch` vector of set ids; per-
# class sums by the labels) couples them ([Note: rows coupled]), and the stages from there
# on compute over the global batch, every rank's rows joined. Class ids mean the same on
# every rank; set ids counted from 0 on each rank do not, and rank 1's set 0 joined rank 0's
# (parameters 3.3e-3 off after 3 steps, without a word): the graph cannot tell which, so
# rank 0 warns, naming the op.
_GROUPS_BY_INDEX = frozenset({"aten::index_add", "aten::index_add_", "aten::scatter_add",
                              "aten::scatter_add_", "aten::scatter_reduce", "aten::scatter_reduce_",
                              "aten::index_reduce", "aten::index_reduce_"})


def _groups_rows_by_index(graph: TracedGraph) -> list[str]:
    ir, traced = graph.ir, graph._trace.traced
    found = []
    for t in ir.tasks():
        op = next((op for op in t.op.split("+") if op in _GROUPS_BY_INDEX), None)
        if (op is not None and any(ir.value(i).batch_dim >= 0 for i in t.inputs)
                and any(ir.value(o).batch_dependent and ir.value(o).batch_dim < 0
                        for o in t.outputs)):
            where = traced.describe_task(t.id).partition(" in module ")[2]
            found.append(f"op {op} in module {where}" if where else f"op {op}")
    return found


def _say_rows_split(graph: TracedGraph, deployment, where: list[int]) -> None:
    """Rank 0 warns where a layout the user fixed replicates a stage that computes over
    rows the model couples ([Note: rows coupled]): each replica (or pipeline copy) computes
    over its share of the rows only."""
    if not where or _C.get_rank() != 0 or deployment is None:
        return
    coupled = set(where)
    first = next((i for i, st in enumerate(deployment.stages) if coupled & set(st.tasks)), None)
    if first is None:
        return
    copies = max(1, deployment.pipelines)
    split = [i for i, st in enumerate(deployment.stages)
             if i >= first and (copies > 1 or len(st.ranks) // copies > 1)]
    if split:
        _C.log_warn(f"{'; '.join(rows_coupled(graph))}; and the layout given (options "
                    f"num_stages and replicas) runs stage{'s' if len(split) > 1 else ''} "
                    f"{failure.some_of([str(i) for i in split])} in "
                    f"{len(deployment.stages[split[0]].ranks)} replicas: each computes over its "
                    "share of the rows only, which is not the model's result on the whole "
                    "batch. Leave the layout to the planner, which keeps those stages on one "
                    "replica ([Note: rows coupled] in planning.py)")


# [Note: outputs not cut into rows] An output whose size grows with the batch but that
# holds no dimension of rows (a sequence-first model's `decoded.view(-1, ntoken)`, PyTorch's
# word language model: rows of the sequence and the batch interleaved; rows selected by the
# data) cannot be cut into each rank's rows nor put together from micro-batches. Such an
# output came back as micro-batch 0's of the first replica on every rank, so a loss made
# outside from it trained on rank 0's rows without a word (parameters 1.2e-2 off after 3
# steps). With one rank, one micro-batch returns it whole; with several ranks it is an
# error on every rank, naming the output and the cure.
def _outputs_kept_whole(graph: TracedGraph, opts: Options, popts, world_size: int) -> None:
    paths = graph._trace.outputs_not_cut
    if not paths:
        return
    named = [f"#{p}" if p.replace(".", "").isdigit() else p for p in paths if p]
    what = (f"the model's output{' ' + failure.some_of(named) if named else ''} grows with the "
            "batch but holds no "
            "dimension of its rows (a batch flattened with another dimension, as a "
            "sequence-first model's decoded.view(-1, ntoken), or rows the data selects)")
    cure = ("Return it with the batch as a dimension of its own (the [sequence, batch, ...] "
            "value before the view) and flatten it outside, or compute the loss inside the "
            "module ([Note: outputs not cut into rows] in planning.py)")
    ir, batch = graph.ir, graph.batch_size
    if batch > 1 and any(ir.value(v).batch_dim < 0 and list(ir.value(v).shape).count(batch) >= 2
                         for v in ir.outputs):
        # the batch in two dimensions (CLIP's logits_per_image): its rows pair the batch's
        what = what.replace("(a batch flattened", "(one that pairs the rows of the batch, with "
                            "the batch in two dimensions, as a contrastive model's "
                            "similarities; a batch flattened")
        cure = ("Return the loss and what it is made from (the embeddings), not the "
                "similarities of every pair of rows, or compute those outside from the "
                "embeddings ([Note: outputs not cut into rows] in planning.py)")
    if world_size > 1:
        raise _C.TraceError(f"{what}: it cannot be cut into each rank's rows. {cure}")
    if opts.num_microbatches > 1:
        raise _C.TraceError(f"{what}: it cannot be put together from {opts.num_microbatches} "
                         f"micro-batches. {cure}")
    popts.max_microbatches = 1


# [Note: spectral norm per micro-batch] A spectral norm (torch.nn.utils.parametrizations's,
# or the older hook) runs one power iteration per forward and writes its vectors `u`, `v`
# into buffers. A stage runs the forward once per micro-batch, so with several micro-batches
# each uses another normalised weight, and the vectors move as many times per step (logits
# 1e-3 off PyTorch after 2 steps of 2 micro-batches; one micro-batch is exact). Rank 0 says
# so where a training plan has several.
def spectral_norms(model) -> list[str]:
    import torch.nn.utils.parametrize as parametrize
    from torch.nn.utils.parametrizations import _SpectralNorm
    from torch.nn.utils.spectral_norm import SpectralNorm
    found = []
    for name, m in model.named_modules():
        hooked = any(isinstance(h, SpectralNorm) for h in m._forward_pre_hooks.values())
        parametrized = parametrize.is_parametrized(m) and any(
            isinstance(p, _SpectralNorm) for ps in m.parametrizations.values() for p in ps)
        if hooked or parametrized:
            found.append(name or "the model")
    return found


def _say_spectral_norms(graph: TracedGraph, deployment) -> None:
    model = getattr(graph, "_model", None)
    if (_C.get_rank() != 0 or model is None or not model.training
            or isinstance(deployment, Exception)):
        return
    if deployment.micro_batches <= 1:
        _say_norms_per_replica(model, deployment)
        return
    # [Note: batch norm per micro-batch] batch norm in training mode normalises each
    # micro-batch by its own statistics, over fewer rows than a DistributedDataParallel
    # rank's local batch (2 micro-batches: loss 0.887 for DDP's 0.738 on a probe), which
    # was documented only; rank 0 says so where a training plan has several.
    norms = [name for name, m in model.named_modules()
             if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training]
    if norms:
        _C.log_warn(f"batch norm in {failure.some_of(norms)} normalises each micro-batch by its "
                    f"own statistics: with {deployment.micro_batches} micro-batches each is "
                    "over fewer rows than a DistributedDataParallel rank's local batch, so "
                    "training differs from DDP's (num_microbatches=1 gives DDP's; [Note: batch "
                    "norm per micro-batch] in planning.py)")
    found = spectral_norms(model)
    if found:
        _C.log_warn(f"spectral norm in {failure.some_of(found)} runs its power iteration once "
                    f"per micro-batch: with {deployment.micro_batches} micro-batches each uses "
                    "another normalised weight and its vectors move as many times per step, "
                    "unlike one process (num_microbatches=1 is exact; [Note: spectral norm per "
                    "micro-batch] in planning.py)")


def _say_norms_per_replica(model, deployment) -> None:
    """[Note: batch norm per micro-batch], for replicas: a stage on several replicas
    normalises each replica's share of the rows by its own statistics, as DDP's ranks do,
    not by the whole batch's as one process would (a probe's CNN on 2 replicas: parameters
    1.3e-2 off one process), which went without a word."""
    copies = max(1, deployment.pipelines)
    if copies <= 1 and all(len(st.ranks) <= 1 for st in deployment.stages):
        return
    norms = [name for name, m in model.named_modules()
             if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training]
    if norms:
        _C.log_info(f"batch norm in {failure.some_of(norms)} normalises each replica's share of "
                    "the rows by its own statistics, as DistributedDataParallel's ranks do, not "
                    "by the whole batch's as one process would ([Note: batch norm per "
                    "micro-batch] in planning.py)")


def plan_graph(graph: TracedGraph, flat_inputs: list, opts: Options, *, world_size: int, device,
               optimizer: str = "adam", profile_cache=None, broadcast: bool = True,
               times: PlanTimes | None = None, update_seconds_per_byte: float | None = None,
               memory_note: str = ""):
    """Plans an already traced graph with `opts` (Options). With opts.cost_model "profile"
    and several MPI ranks this is collective: rank 0 plans while the others profile their
    share; with `broadcast` every rank gets rank 0's Deployment, else the others get None.
    `times` (PlanTimes) gets the seconds spent profiling and searching added.
    `memory_note`: why the device's memory is what it is, for the error when no plan fits."""
    start = time.perf_counter()
    times = times if times is not None else PlanTimes()
    popts = opts.planner_options(world_size, opts.batch_size or graph.batch_size * int(world_size),
                                 optimizer, update_seconds_per_byte)
    coupled = _rows_kept_whole(graph, opts, popts, int(world_size))
    _outputs_kept_whole(graph, opts, popts, int(world_size))

    def explained(e: Exception) -> Exception:
        if not (memory_note and isinstance(e, _C.InfeasiblePlanError)):
            return e
        why = _C.InfeasiblePlanError(f"{e} ({memory_note})")
        why.bytes_needed = getattr(e, "bytes_needed", 0)
        return why

    if opts.cost_model == "analytic":
        try:
            deployment = _C.plan_analytic(graph.ir, device, popts)
        except _C.InfeasiblePlanError as e:
            raise explained(e) from e
        times.search += time.perf_counter() - start
        _say_spectral_norms(graph, deployment)
        _say_rows_split(graph, deployment, coupled)
        return deployment
    if opts.probe_bandwidth:
        bw = probe_bandwidth(device.inter_node_bandwidth)
        device.intra_node_bandwidth = bw["intra_node"]
        device.inter_node_bandwidth = bw["inter_node"]
    cache = profile_cache if profile_cache is not None else _DEFAULT_CACHE
    parallel = profile_in_parallel(opts.profile_parallel, profile_device(opts.profile_device))
    progress = opts.progress
    if progress is None:
        progress = sys.stderr.isatty() and _C.get_rank() == 0
    limit = int(device.memory_bytes * (1.0 - popts.memory_margin))
    stats = {}
    try:
        deployment = _C.plan_profiled(
            graph._trace.traced, flat_inputs, device, popts,
            opts.profiler_options(profile_device(opts.profile_device), limit), cache,
            parallel=parallel, progress=_Progress(bool(progress)), compose=opts.compose_costs,
            fit_tolerance=opts.profile_fit_tolerance, stats=stats)
    except Exception as e:
        error = explained(e)
        if not isinstance(error, _C.InfeasiblePlanError):
            if parallel and _C.get_rank() == 0:  # the others are in collectives with rank 0
                _C.report_failure(f"rank 0 could not plan: {type(error).__name__}: {error}")
            raise
        if not (parallel and broadcast):
            raise error from e  # the caller's broadcast_plan tells every rank
        deployment = error
    if parallel and broadcast:
        def planned():
            if isinstance(deployment, Exception):
                raise deployment
            return deployment
        deployment = broadcast_plan(planned, graph.ir, popts.batch_size, popts.world_size)
    measuring = float(stats.get("measuring_seconds", 0.0))
    times.profiling += measuring
    times.search += max(0.0, time.perf_counter() - start - measuring)
    times.pieces_measured += int(stats.get("pieces_measured", 0))
    times.unions_composed += int(stats.get("unions_composed", 0))
    times.records_fitted += int(stats.get("records_fitted", 0))
    if progress:
        sys.stderr.write(times.line() + "\n")
    if deployment is not None:
        _say_spectral_norms(graph, deployment)
        _say_rows_split(graph, deployment, coupled)
    return deployment


def broadcast_plan(make, ir, batch_size: int = 0, world_size: int = 0):
    """Rank 0's plan to every rank: `make()` runs on rank 0 only and returns its
    Deployment. A rank 0 that fails tells the others through the failure channel before it
    raises (csrc/comm/world.h), so every rank raises with its message, wherever it waits:
    here, or in a profiling collective with rank 0. `batch_size`/`world_size` > 0: what
    the plan must be for (checked on every rank)."""
    comm = _C.Communicator.world_cpu()
    data, infeasible, needed = b"", 0, 0
    if _C.get_rank() == 0:
        try:
            data = make().to_bytes()
        except _C.InfeasiblePlanError as e:
            # No plan fits: the same on any rank, and rank 0 is well, so every rank raises
            # it and the job may go on (evaluate with a smaller batch, save a checkpoint).
            data, infeasible, needed = str(e).encode(), 1, int(getattr(e, "bytes_needed", 0) or 0)
        except Exception as e:
            _C.report_failure(f"rank 0 could not plan: {type(e).__name__}: {e}")
            raise
    header = torch.tensor([len(data), infeasible, needed], dtype=torch.int64)
    comm.broadcast(header, 0).wait()
    size, infeasible, needed = header.tolist()
    buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if _C.get_rank() == 0
           else torch.empty(size, dtype=torch.uint8))
    comm.broadcast(buf, 0).wait()
    data = bytes(buf.numpy().tobytes())
    if infeasible:
        error = _C.InfeasiblePlanError(data.decode())
        error.bytes_needed = needed
        error.on_every_rank = True  # failure.agreed: nobody waits, nothing to tell
        raise error
    return _C.deployment_from_bytes(data, ir, "the plan from rank 0",
                                    batch_size=batch_size, world_size=world_size)


def plan(model: torch.nn.Module, args, kwargs: dict | None = None, *, world_size: int,
         devices_per_node: int = 8, device_memory="32GiB", optimizer: str = "adam",
         cost_model: str = "profile", profile_cache=None, **options) -> Plan:
    """Plans `model(*args, **kwargs)` for `world_size` devices of `device_memory` bytes
    each (an int or "32GiB"), `devices_per_node` to a node, without needing those devices.

    Costs are measured on this machine's device at the real micro-batch sizes
    (cost_model="profile", cached in `profile_cache`, a rannc ProfileCache or a file path;
    default: one cache per process) or derived from shapes (cost_model="analytic"). A model
    on the meta device is traced and profiled with stand-ins for its parameters, never
    materialised. `optimizer` (adam, adamw, sgd_momentum, sgd) sets
    the optimizer state in the memory model. Other options: see `option_docs()`.
    Raises rannc.InfeasiblePlanError (with .bytes_needed) when no plan fits.
    """
    start = time.perf_counter()
    args = args if isinstance(args, tuple) else (args,)
    kwargs = kwargs or {}
    state, home = None, None
    if _on_meta(model):
        # Observing the graph needs values (sizes read with .item()): traced and profiled
        # on the CPU with stand-ins, so a model larger than this host plans too.
        state, args, kwargs = _meta_state(model, args, kwargs)
        home = torch.device("cpu")
    opts = Options.resolve(dict(options, cost_model=cost_model), environ={}, entry=PLAN)
    times = PlanTimes()
    graph = TracedGraph(model, args, kwargs, state_tensors=state, home=home)
    times.tracing = time.perf_counter() - start
    device = _device_spec(world_size, devices_per_node, device_memory)
    cache, path = profile_cache, None
    if isinstance(profile_cache, (str, os.PathLike)):
        path, cache = os.fspath(profile_cache), _C.ProfileCache()
        cache.load(path)
    flat = graph._profiling_inputs(args, kwargs) if cost_model == "profile" else []
    update_rate = None
    if cost_model == "profile" and opts.training and opts.update_seconds_per_byte is None:
        device_name = profile_device(opts.profile_device)
        _C.profile_device_kind(device_name)  # says what is wrong with the name first
        timed = time.perf_counter()
        update_rate = measure_update_rate(model.parameters(), kind=optimizer, device=device_name)
        times.profiling += time.perf_counter() - timed
    deployment = plan_graph(graph, flat, opts, world_size=world_size, device=device,
                            optimizer=optimizer, profile_cache=cache, times=times,
                            update_seconds_per_byte=update_rate)
    if path and _C.get_rank() == 0:
        cache.save(path)
    return Plan(graph, deployment, cost_model, time.perf_counter() - start, times)
