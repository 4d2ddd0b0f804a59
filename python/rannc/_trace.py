"""Tracing: an nn.Module and example arguments -> rannc's IR (through TorchScript).

Why a function trace rather than `torch.jit.trace(module)`: we want parameters and buffers
as named graph inputs. The module is traced through a function whose inputs are the
flattened tensors (parameters, buffers, then the tensors of args and kwargs); inside it the
module's parameters are swapped for those inputs.

The model is traced twice, at the example batch size B and at another size B2 with other
values. Both traces must be the same program (else the model has control flow on tensor
data, or bakes B into a shape); running the graph at both sizes tells which values carry
the batch dimension. Tracing leaves the model untouched: buffers are copied and the RNG
state is restored.
"""
from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import itertools
import linecache
import os
import re
import sys
import traceback
import types
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.nn.utils.stateless import _reparametrize_module

from . import _C, failure

# rannc's own runs of the user's forward (tracing, its untraced reruns): what they register
# on the modules is put back after ([Note: tracing changes no attribute])
RUNNING_FORWARD = contextvars.ContextVar("rannc_running_forward", default=False)

TraceError = _C.TraceError

# Non-tensor arguments that are baked into the trace as constants.
_CONSTANT_TYPES = (int, float, bool, str, type(None), torch.dtype, torch.device)


@dataclass
class FlatArgs:
    """Arguments flattened into tensor leaves plus what is needed to rebuild them."""
    tensors: list[torch.Tensor]
    tensor_slots: list[int]  # position of each tensor among all leaves
    leaves: list[Any]        # every leaf; tensors too (replaced on rebuild)
    paths: list[str]         # "args[0]", "kwargs['mask']" for every leaf
    spec: Any

    def rebuild(self, tensors):
        leaves = list(self.leaves)
        for slot, t in zip(self.tensor_slots, tensors):
            leaves[slot] = t
        return pytree.tree_unflatten(leaves, self.spec)


def flatten_with_path(tree):
    """pytree.tree_flatten_with_path, also over classes registered without a function that
    names their children (transformers 4's ModelOutput): those get one, naming each child
    by its key where the flattening's context lists them, else by its position."""
    while True:
        try:
            return pytree.tree_flatten_with_path(tree)
        except ValueError as e:
            unnamed = next((t for t, node in pytree.SUPPORTED_NODES.items()
                            if node.flatten_with_keys_fn is None and t.__name__ in str(e)), None)
            if unnamed is None:
                raise
            flatten = pytree.SUPPORTED_NODES[unnamed].flatten_fn

            def with_keys(node, flatten=flatten):
                children, context = flatten(node)
                names = list(context) if isinstance(context, (list, tuple)) and \
                    len(context) == len(children) else None
                keys = ([pytree.MappingKey(k) for k in names] if names is not None
                        else [pytree.SequenceKey(i) for i in range(len(children))])
                return list(zip(keys, children)), context
            pytree.SUPPORTED_NODES[unnamed] = pytree.SUPPORTED_NODES[unnamed]._replace(
                flatten_with_keys_fn=with_keys)


def flatten_args(args: tuple, kwargs: dict) -> FlatArgs:
    """Flattens (args, kwargs); rejects leaves that are neither tensors nor constants."""
    with_paths, spec = flatten_with_path((tuple(args), dict(kwargs)))
    leaves, paths, tensors, slots = [], [], [], []
    for i, (path, leaf) in enumerate(with_paths):
        name = _path_name(path)
        if isinstance(leaf, torch.Tensor) and leaf.is_nested:
            raise TraceError(
                f"argument {name} is a nested tensor (torch.nested): rannc traces dense tensors "
                "and cuts the batch along their dimension 0, and a nested tensor's rows have "
                "sizes of their own. Pass it padded with its mask: "
                f"{name}.to_padded_tensor(0.0) and a [batch, longest] mask of the real items")
        if isinstance(leaf, torch.Tensor):
            tensors.append(leaf)
            slots.append(i)
        elif not isinstance(leaf, _CONSTANT_TYPES):
            raise TraceError(
                f"argument {name} has type {type(leaf).__qualname__}, which cannot be traced: "
                "pass tensors, tuples, lists or dicts of tensors, or constants "
                "(int, float, bool, str, None, torch.dtype, torch.device)")
        leaves.append(leaf)
        paths.append(name)
    return FlatArgs(tensors, slots, leaves, paths, spec)


def home_device(model: torch.nn.Module, tensors=()) -> torch.device:
    """Where the model runs: the device of its first parameter or buffer that is not on the
    meta device, else of the first tensor argument, else the CPU ([Note: home device])."""
    for t in itertools.chain(model.parameters(), model.buffers(), tensors):
        if not t.is_meta:
            return t.device
    return torch.device("cpu")


# [Note: stand-in parameters] Tracing runs the whole model, but what it records and observes
# (the ops, the sizes, which values carry the batch) does not depend on the parameters'
# values: a model whose program changed with its weights would bake one program for every
# step anyway. So a parameter that this rank does not hold (built on the meta device, or
# freed here because another rank's stage keeps it) is traced as a stand-in: a contiguous
# view of one random buffer shared by every stand-in of its dtype and fan-in, each starting
# elsewhere (matrices and tensors of more dimensions: N(0, 1/fan_in), LeCun's
# initialisation, which keeps activations of order one through the layers; vectors, which
# are scales and biases: 1 + N(0, 0.02)). Each buffer takes the memory of the largest of
# its stand-ins (a transformer has two or three fan-ins). Values of order one matter: the
# batch analysis tells rows apart by their values, and with every matrix N(0, 0.02) (as
# before session 37) the rows of a layer's output were all near its bias, so a new length
# or an eval call after training, traced with stand-ins, read nn.MultiheadAttention's
# flattened rows as a batch dimension and was another program than the first trace's.
# They are dense, so ops and the profiler read them as they
# read real weights, without copies (a strided stand-in of the sum of its sizes made every
# matmul copy its weight: tracing a 387 MiB GPT peaked at 1 GiB). Every rank draws the
# same buffers (a fixed seed), so their traces agree. Buffers are never stood in for: they
# hold data (position ids, masks, running statistics) that indexes and decides.
_STAND_IN_SEED = 0x5EED
_STAND_IN_SLACK = 1 << 16  # elements


def stand_ins(specs, device: torch.device) -> list[torch.Tensor]:
    """Stand-ins ([Note: stand-in parameters]) for parameters of `specs`, a list of
    (shape, dtype, requires_grad), on `device`: leaves that require grad where asked
    (floating dtypes only), views of shared buffers, one per dtype and fan-in."""
    def key(shape, dtype):
        numel = torch.Size(shape).numel()
        return dtype, (numel // shape[0] if len(shape) > 1 and shape[0] else 0)  # 0: vectors

    sizes = {}
    for shape, dtype, _ in specs:
        k = key(shape, dtype)
        sizes[k] = max(sizes.get(k, 0), torch.Size(shape).numel())
    # room to start each stand-in elsewhere: two parameters of one shape were the same
    # values, and values equal by chance read as one another in the batch analysis
    sizes = {k: n + min(n, _STAND_IN_SLACK) for k, n in sizes.items()}
    generator = torch.Generator().manual_seed(_STAND_IN_SEED)
    buffers = {}
    for (dtype, fan_in), n in sorted(sizes.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
        if dtype.is_floating_point or dtype.is_complex:
            std = fan_in ** -0.5 if fan_in else 0.02
            values = torch.empty(n, dtype=torch.float32).normal_(0.0, std, generator=generator)
            buffers[dtype, fan_in] = (values if fan_in else 1.0 + values).to(device=device, dtype=dtype)
        else:
            buffers[dtype, fan_in] = torch.zeros(n, dtype=dtype, device=device)
    out = []
    for i, (shape, dtype, requires_grad) in enumerate(specs):
        numel = torch.Size(shape).numel()
        buffer = buffers[key(shape, dtype)]
        start = (i * 2654435761) % (buffer.numel() - numel + 1)  # the same on every rank
        t = buffer[start:start + numel].view(shape).detach()
        out.append(t.requires_grad_(requires_grad and (dtype.is_floating_point or dtype.is_complex)))
    return out


def state_for_tracing(model: torch.nn.Module, state: "ModelState", home: torch.device,
                      freed=None, make_up_buffer=None) -> list[torch.Tensor]:
    """The tensors to trace `model`'s state with, in `state` order: its parameters, as
    stand-ins ([Note: stand-in parameters]) those on the meta device and those `freed`
    maps (position -> full shape), then its buffers. A buffer on the meta device has no
    values to trace with: `make_up_buffer(buffer)` makes them, else an error names it."""
    tensors = state.tensors(model)
    n_params = len(state.param_names)
    freed = freed or {}
    stood = {i: (t.shape if t.is_meta else freed[i], t.dtype, t.requires_grad)
             for i, t in enumerate(tensors[:n_params]) if t.is_meta or i in freed}
    made = dict(zip(stood, stand_ins(list(stood.values()), home)))
    out = []
    for i, (name, t) in enumerate(zip(state.names, tensors)):
        if i in made:
            out.append(made[i])
        elif t.is_meta and make_up_buffer is not None:
            out.append(make_up_buffer(t))
        elif t.is_meta:
            raise TraceError(
                f"the buffer {name!r} is on the meta device, so it has no values to trace the "
                "model with (buffers hold data such as position ids and masks); build the model "
                "with only its parameters on the meta device: `with rannc.empty_weights(): "
                "model = ...`")
        else:
            out.append(t)
    return out


def autocast_dtype(device_type: str):
    """The dtype autocast computes in on `device_type` in this thread, or None when off."""
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def autocast_off(device_type: str = "cpu", amp=None):
    """No autocast on any device this process computes on (the traced casts do the work),
    but for the autograd.Functions of a program traced in precision `amp` on `device_type`:
    their ops were not traced, and run under that autocast ([Note: autocast in Python ops]
    in csrc/bind/module.cpp)."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.autocast("cpu", enabled=False))
    if torch.cuda.is_available():
        stack.enter_context(torch.autocast("cuda", enabled=False))
    stack.enter_context(_python_ops_autocast(device_type, amp))
    return stack


_python_ops_state = ("", "")


@contextlib.contextmanager
def _python_ops_autocast(device_type: str, amp):
    global _python_ops_state
    before = _python_ops_state
    _python_ops_state = (device_type, "" if amp is None else str(amp).replace("torch.", ""))
    _C.set_python_op_autocast(*_python_ops_state)
    try:
        yield
    finally:
        _python_ops_state = before
        _C.set_python_op_autocast(*before)


def recording_autocast(device_type: str):
    """[Note: mixed precision] Tracing under autocast records its casts (aten::to to bf16
    before a matmul, to fp32 before a softmax) as ops of the graph, so the traced program
    computes in the precision of the call it was traced in, wherever it later runs, and
    the IR knows the 2-byte activations. Autocast's weight cache must be off while
    tracing: a cached cast weight is a tensor from outside the trace, which the tracer
    refuses as a constant that requires grad. Returns the context to trace in: the
    caller's autocast state on `device_type`, cache off."""
    dtype = autocast_dtype(device_type)
    if dtype is None:
        return torch.autocast(device_type, enabled=False)
    return torch.autocast(device_type, dtype=dtype, cache_enabled=False)


def _path_name(path) -> str:
    # path[0] selects args (0) or kwargs (1); the rest is inside them.
    root = "args" if path[0].idx == 0 else "kwargs"
    return root + pytree.keystr(path[1:])


@dataclass
class ModelState:
    """The module's parameters and buffers, in graph input order, deduplicated (tied
    weights appear once under their first name)."""
    param_names: list[str]
    buffer_names: list[str]

    @staticmethod
    def of(model: torch.nn.Module) -> "ModelState":
        return ModelState([n for n, _ in model.named_parameters()],
                          [n for n, _ in model.named_buffers()])

    def tensors(self, model: torch.nn.Module) -> list[torch.Tensor]:
        params = dict(model.named_parameters())
        buffers = dict(model.named_buffers())
        if list(params) != self.param_names or list(buffers) != self.buffer_names:
            raise TraceError("the module's parameters or buffers changed since it was traced; "
                             "trace it again")
        return list(params.values()) + list(buffers.values())

    @property
    def names(self) -> list[str]:
        return self.param_names + self.buffer_names


@dataclass
class Trace:
    traced: Any            # _C.TracedModel
    state: ModelState
    state_tensors: list | None  # what the state was traced with (profiling runs them too)
    home: torch.device     # where the model was traced ([Note: home device])
    inputs: FlatArgs       # the example inputs
    out_spec: Any          # pytree spec of the model's output
    out_leaves: list[Any]  # output leaves; non-tensors are returned as traced
    out_tensor_slots: list[int]
    batch_size: int
    # the modules' plain attributes the forward read, as traced ([Note: attributes read])
    attributes: list = dataclasses.field(default_factory=list)
    # outputs that grow with the batch but are not cut into rows ([Note: outputs not cut
    # into rows] in planning.py), by their paths
    outputs_not_cut: list = dataclasses.field(default_factory=list)
    # arguments without rows whose values chose the program, by their positions in
    # inputs.tensors ([Note: tensors that choose the program])
    choosing: list = dataclasses.field(default_factory=list)


def _second_batch(flat: FlatArgs, batch: int, dims: list, mirror: bool = True
                  ) -> tuple[list[torch.Tensor], int]:
    """Inputs at another batch size (half the rows from 4 up), each tensor cut along its
    batch dimension `dims[i]` (None: it carries no batch): the smaller batch's rows are
    the larger's trailing rows (cycled where the new size is larger), so the rows both
    sizes share hold the same data, and values that hold row positions differ there
    ([Note: row positions] in csrc/frontend/convert.cpp). With `mirror`, values change too, to expose programs
    that depend on them (for the second trace): floats are negated, bools inverted, and
    integer rows (token ids, labels with sentinels) taken in reverse order, which keeps
    every integer a valid one."""
    # Half the rows from 4 up: the second trace and its observation cost half a run of
    # the model instead of nearly a whole one (BERT-base at batch 8: tracing 8.2 -> 5.6 s).
    batch2 = batch // 2 if batch >= 4 else batch - 1 if batch > 2 else batch + 1
    rows = (torch.arange(batch2) - (batch2 - batch)) % batch if batch2 > batch \
        else torch.arange(batch - batch2, batch)
    out = []
    for t, dim in zip(flat.tensors, dims):
        if dim is not None:
            if mirror and not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
                t = t.detach().index_select(dim, (batch - 1 - rows).to(t.device))
            else:
                t = t.detach().index_select(dim, rows.to(t.device))
            if mirror and (t.is_floating_point() or t.is_complex()):
                t = -t
            elif mirror and t.dtype == torch.bool:
                t = ~t
        out.append(t)
    return out, batch2


# [Note: batch dimensions] The batch is dimension 0 of the tensor arguments whose size there
# matches the first one's. A sequence-first model (nn.LSTM, nn.GRU, nn.RNN without
# batch_first=True, fed [sequence, batch, ...] as PyTorch's own word language model is) has
# the sequence there: cut into micro-batches, each piece would run the recurrence over a
# slice of the sequence and train on something else without an error. Along a real batch
# a recurrence's output is a batch value (its rows do not depend on each other); along a
# sequence its rows differ where the observations at both sizes share them, so the
# analysis glues it into its task and no batch value comes out of that task. Such a trace
# is traced again with the batch in dimension 1 of the arguments that have it there (the
# others in dimension 0: labels [batch], a hidden state [layers, batch, hidden] in 1), and
# kept if its recurrences then run along their batch; else a warning names the op.
# Attention along the sequence mixes its rows the same way: a sequence-first transformer
# (nn.TransformerEncoder and nn.MultiheadAttention without batch_first=True, as PyTorch's own
# language-model tutorial builds it) traced batch first glued everything from the first
# attention to the loss into one task, which trained right but as one stage, unpipelined.
# So where the model has such modules, a task whose attention takes a batch value and makes
# none is traced again the same way (not for batch-first models, whose attention may be
# glued for other reasons: a padding mask's row positions).
# A trace of a recurrent model that fails with the batch in dimension 0 is tried with the
# batch elsewhere before its error is raised: in dimension 1 of the arguments that have it
# there but not in 0, where an RNN is batch first (its hidden state is [layers, batch,
# hidden] all the same, passed in for truncated backpropagation: the second trace cut the
# inputs alone, and the LSTM refused the hidden state); then sequence first, where an RNN
# or attention is (a sequence-first model's short last chunk, whose length may equal the
# layers of its hidden state). Not for other models, where dimension 1 is most often the
# sequence.
_RECURRENT_OPS = ("aten::lstm", "aten::gru", "aten::rnn_tanh", "aten::rnn_relu", "aten::_cudnn_rnn")
_ATTENTION_OPS = ("aten::scaled_dot_product_attention", "aten::_native_multi_head_attention",
                  "aten::softmax", "aten::_softmax")


def _leading_batch_dims(tensors: list, batch: int) -> list:
    """Dimension 0 for the tensors with `batch` rows there, None for the others."""
    return [0 if t.dim() >= 1 and t.shape[0] == batch else None for t in tensors]


def _hidden_state_layout(tensors: list, batch: int):
    """(batch, dims) with the batch in dimension 1 of the tensors that have `batch` there
    and not in dimension 0 ([Note: batch dimensions]); None where there are none."""
    dims = [0 if t.dim() >= 1 and t.shape[0] == batch
            else 1 if t.dim() >= 2 and t.shape[1] == batch else None for t in tensors]
    return (batch, dims) if 1 in dims else None


def _sequence_first_layout(tensors: list):
    """(batch, dims) with the batch in dimension 1 of the first tensor of two dimensions or
    more ([Note: batch dimensions]); None where that is ambiguous or no different."""
    first = next((t for t in tensors if t.dim() >= 2), None)
    if first is None or first.shape[1] < 2 or first.shape[1] == first.shape[0]:
        return None
    batch = first.shape[1]
    dims = [1 if t.dim() >= 2 and t.shape[1] == batch else 0 if t.dim() >= 1 and t.shape[0] == batch
            else None for t in tensors]
    return batch, dims


def sequence_first_attention(model: torch.nn.Module) -> list[str]:
    """The names of `model`'s nn.MultiheadAttention modules without batch_first=True (those
    of nn.Transformer* layers built so)."""
    return [name for name, m in model.named_modules()
            if isinstance(m, torch.nn.MultiheadAttention) and not m.batch_first]


def recurrent_along_batch(graph, ops=_RECURRENT_OPS) -> list[str]:
    """The recurrent ops (or other `ops`) of `graph` (an IrGraph) that run along its batch
    dimension: each task running one that takes a batch value and makes none ([Note: batch
    dimensions])."""
    found = []
    for task in graph.tasks():
        running = [op for op in task.op.split("+") if op in ops]
        if not running:
            continue
        takes = any(graph.value(v).batch_dim >= 0 for v in task.inputs)
        makes = any(graph.value(v).batch_dim >= 0 for v in task.outputs)
        if takes and not makes:
            where = f" in '{task.scope}'" if task.scope else ""
            found.append(f"{running[0]}{where}" + (f" at {task.source}" if task.source else ""))
    return found


# [Note: random decisions] A model that draws a random number and turns it into a Python
# value (LayerDrop: `if torch.rand([]) < p: skip the layer`) has the trace fix one draw for
# every step, and both traces may well draw alike, so the comparison of the two cannot
# tell. The first trace of a model in training mode watches for it: a value made by a
# random op, and what is computed from such values alone, must not become a Python bool or
# number. Not in eval mode, where models do not drop layers: a TorchFunctionMode makes
# has_torch_function true, which turns eval's fast path of nn.TransformerEncoderLayer and
# nn.MultiheadAttention off, so the two traces would differ.
_RANDOM_OPS = frozenset({
    "rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "randperm",
    "bernoulli", "normal", "multinomial", "poisson", "uniform_", "normal_", "bernoulli_",
    "random_", "exponential_", "geometric_", "cauchy_", "log_normal_"})
_TO_PYTHON = frozenset({"__bool__", "item", "__int__", "__float__", "__index__", "tolist"})
# A draw in [0, 1) compared with a number outside it decides the same at every draw:
# transformers 4's LayerDrop with layerdrop=0.0 (`skip = self.training and torch.rand([]) <
# 0.0; if not skip: ...`, wav2vec2, HuBERT) is no random decision, and its value is not
# a drawn one. Each comparison: its outcome for every draw, given the number, or None.
_UNIT_DRAWS = frozenset({"rand", "rand_like"})
_UNIT_COMPARISONS = {
    "lt": lambda c: True if c >= 1 else False if c <= 0 else None,
    "le": lambda c: True if c >= 1 else False if c < 0 else None,
    "gt": lambda c: True if c < 0 else False if c >= 1 else None,
    "ge": lambda c: True if c <= 0 else False if c >= 1 else None,
}
for _short, _long in (("lt", "less"), ("le", "less_equal"), ("gt", "greater"),
                      ("ge", "greater_equal")):
    _UNIT_COMPARISONS[f"__{_short}__"] = _UNIT_COMPARISONS[_long] = _UNIT_COMPARISONS[_short]


class _RandomDecision(Exception):
    pass


class _WatchRandomDecisions(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.drawn: dict[int, torch.Tensor] = {}  # random tensors by id (held: ids stay theirs)
        self.unit: set[int] = set()  # ids of drawn tensors whose values lie in [0, 1)

    def _is_drawn(self, x) -> bool:
        return isinstance(x, torch.Tensor) and id(x) in self.drawn

    def _decided_alike(self, name: str, args) -> bool:
        """Whether a comparison of a draw in [0, 1) with a number has one outcome."""
        if name not in _UNIT_COMPARISONS or len(args) != 2 or id(args[0]) not in self.unit:
            return False
        number = args[1]  # a Python number (a tensor's value would be read into the trace)
        return (isinstance(number, (int, float)) and not isinstance(number, bool)
                and _UNIT_COMPARISONS[name](number) is not None)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _TO_PYTHON and args and self._is_drawn(args[0]):
            raise _RandomDecision(f"{name} of a random value")
        out = func(*args, **kwargs)
        if self._decided_alike(name, args):
            return out  # the same at every draw: nothing random to decide on
        if name in _UNIT_DRAWS and isinstance(out, torch.Tensor):
            self.unit.add(id(out))
        tensors = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        if name in _RANDOM_OPS or (tensors and all(self._is_drawn(t) for t in tensors)):
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.drawn[id(t)] = t
        return out


# [Note: hooks] A trace records the ops a forward runs, not the hooks autograd would call:
# - a gradient hook registered on a tensor inside forward (`y.register_hook(fn)`) would be
#   dropped without a word, and the gradients it changes (a gradient reversal, a clip)
#   would train another model: a TraceError names its source line;
# - modules' backward hooks (register_full_backward_hook and pre-hooks) likewise: a
#   TraceError names the modules (before, tracing failed on a cast of their tuple);
# - forward hooks and pre-hooks run while the model is traced, so what they return is in
#   the graph, but the steps run the graph: their side effects (storing activations,
#   logging) happen at tracing only, and RaNNCModule warns on rank 0 naming the modules.
class _TensorHook(Exception):
    pass


# - torch.autograd.grad inside forward (an R1 or WGAN-GP gradient penalty computed in the
#   discriminator's forward): the backward it runs is no op of the trace, so its result
#   would be a constant; tracing failed with torch.jit's "Cannot insert a Tensor that
#   requires grad as a constant". A TraceError names the line and the cure.
class _GradInForward(Exception):
    pass


@contextlib.contextmanager
def _refuse_grad_in_forward():
    own = torch.autograd.grad

    def refused(*args, **kwargs):
        raise _GradInForward()

    torch.autograd.grad = refused
    try:
        yield
    finally:
        torch.autograd.grad = own


# [Note: vmap over the batch] torch.func.vmap runs its function as batched ops, and a trace
# records them at the traced batch size: vmap's own views (an einsum's) hold it, so the
# error names a view the user never wrote, and its cure (compute the size from the input)
# cannot be followed inside vmap. While tracing, the lines that call vmap are noted; an
# error about the batch size at such a line says so, with the cure: the batched op itself.
@contextlib.contextmanager
def _noting_vmap_calls(notes: list):
    import torch._functorch.apis as apis  # vmap and torch.func.vmap look vmap_impl up here
    own = apis.vmap_impl

    def noted(*args, **kwargs):
        notes.append(f"vmap:{_caller_line()}")
        return own(*args, **kwargs)

    apis.vmap_impl = noted
    try:
        yield
    finally:
        apis.vmap_impl = own


def _vmap_hint(error: str, notes: list) -> str:
    lines = [n[len("vmap:"):] for n in notes if n.startswith("vmap:")]
    at = [line for line in dict.fromkeys(lines) if f" at {line} " in error]
    if not at or "batch size" not in error:
        return ""
    return (f"\nThe op runs inside torch.func.vmap (at {at[0]}), whose batched ops a trace "
            "records at the traced batch size. Write the function over the whole batch "
            "instead of vmap over its rows (torch.einsum('bi,bi->b', x, x), not "
            "vmap(lambda a: torch.einsum('i,i->', a, a))(x))")


class _RefuseTensorHooks(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.register_hook and args and args[0].requires_grad:
            raise _TensorHook()
        return func(*args, **(kwargs or {}))


# [Note: no_grad in forward] A teacher evaluated inside the model (distillation, BYOL, mean
# teacher: `with torch.no_grad(): t = self.teacher(x)`) or a buffer updated in forward
# (DINO's center, a VQ-VAE's EMA codebook: `with torch.no_grad():
# self.center.mul_(0.9).add_(h.mean(0), alpha=0.1)`) relies on grad mode, which a trace
# does not record (nor, reliably, what each value's requires_grad was: a convolution's
# output is typed requires_grad=0 in grad mode too). The stages run in grad mode, so the
# teacher trained and the buffer took autograd history ("backward through the graph a
# second time" at the next step). While a training call is traced, an op called with grad
# disabled reads its inputs that require grad through detach(), recorded in the trace:
# the same values, and the same autograd behaviour as when it ran, in place (the buffer's
# add_) as out of place. A parameter that only such ops read gets no gradient, and its
# .grad stays None as in PyTorch (so AdamW does not decay it; csrc/runtime/engine.cpp).
_KEEP_ATTACHED = {torch.Tensor.requires_grad_, torch.Tensor.detach, torch.Tensor.detach_,
                  torch.Tensor.retain_grad, torch.Tensor.register_hook,
                  torch.Tensor.register_post_accumulate_grad_hook}


# [Note: writes through .data] What forward does to a tensor's `.data` (a VQ-VAE codebook's
# EMA update `self.cluster_size.data.mul_(d)`, Glow's ActNorm initialised from the first
# batch `self.loc.data.copy_(-mean)`, `out.data.clamp_(...)`) is no op of the trace: the
# steps never did it, without a word, and the trace itself did it to the real parameters,
# with the tracer's inputs. While tracing, each `.data` taken is watched (its own version
# counter); one written, or a `.data =` assignment, is a TraceError naming the tensor, the
# line and the cure, and the parameters it wrote are put back as they were. A `.data` only
# read is traced as detach(), which it is for the forward: traced as it was, it became a
# constant of the trace (a weight's norm read through .data never moved with training).
# The same holds for a decision in Python on a buffer the forward writes (ActNorm's
# `if self.initialized.item() == 0: initialise; self.initialized.fill_(1)` under no_grad):
# both traces start from the same buffers, so the decision was fixed for every step (an
# initialisation from each batch) without a word; it is a TraceError too. The decision may
# be on a value made from state tensors alone (an observer's `if self.min_val ==
# float("inf")`, torch.ao.quantization's moving-average observers: QAT overwrote min/max
# with each batch's instead of averaging, without a word): small values made by ops whose
# tensor arguments are all state tensors, or such values, count as their state tensors
# (not values made with the data: batch norm's output reads its running statistics).
# A decision that the written state no longer changes (an observer's `if min_val == inf`
# once it holds a batch's range, as after one call of the plain model) is left alone: the
# forward runs once more, untraced, from the state the trace wrote, and where every such
# decision comes out the same, the trace holds for every step.
#
# A decision on the size of a state tensor that the forward resizes (a per-channel
# observer's `if min_val.numel() == 0: min_val = aminmax(x) else: min(...)`, which sizes
# its range at its first call) is fixed the same way: the trace took the first call's
# branch, and every step set the range anew. It is a TraceError with the same cure.
_DATA = torch._C.TensorBase.__dict__["data"]
_SHAPE = torch._C.TensorBase.__dict__["shape"]
_SIZES = frozenset({"numel", "size", "dim", "__len__"})
_DERIVED_NUMEL = 4096  # larger values made from state alone (a parametrized weight) are not
# decided on in Python, and keeping them alive for the trace would hold a model's copy


def _same_size(t: torch.Tensor, args, kwargs) -> bool:
    """Whether resize_(*args) asks `t` for the sizes it has."""
    if kwargs:  # memory_format: restrides even at the same sizes
        return False
    sizes = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) else args
    return tuple(int(n) for n in sizes) == tuple(t.shape)


class _WatchDataWrites(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.names = {}     # id of a state tensor while traced -> its name (fn fills it)
        self.taken = []     # (the .data alias, its version then, name or None, source line)
        self.assigned = []  # (name or None, source line)
        self.originals = {}  # id -> (the state tensor, a copy of it when .data was first taken)
        self.versions = {}  # id of a state tensor -> (it, its version when the trace began)
        self.decided = []  # (name, source line) of each state tensor turned into a Python value
        self.derived = {}  # id of a small value made from state tensors alone -> (it, names)
        self.outcomes = []  # (source line, the Python value) of each such decision
        self.watched = []   # the state tensors the trace ran with
        self.sized = []     # (name, source line) of each size of a state tensor read
        self.shapes = {}    # id of a state tensor -> (it, its shape when the trace began)

    def watch(self, names: list, tensors) -> None:
        """The state tensors the trace runs with (`fn` calls it first)."""
        self.watched = list(tensors)
        for name, t in zip(names, tensors):
            self.names[id(t)] = name
            self.shapes.setdefault(id(t), (t, tuple(t.shape)))
            if not t.is_inference():  # under torch.inference_mode() nothing can be written
                self.versions.setdefault(id(t), (t, t._version))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # on every op of the trace: cheap tests first (most ops read no state tensor first)
        first = id(args[0]) if args else None
        state = first in self.names
        name = getattr(func, "__name__", "") if state or first in self.derived else ""
        if state and name == "resize_" and _same_size(args[0], args[1:], kwargs):
            # [Note: resizes to the same size] a no-op (ATen returns at once), which the
            # tracer cannot represent: the buffer's later uses became constants (a
            # per-channel observer's range: "uses a constant that was tensor(...) in one
            # trace and ... in another" at every call)
            return args[0]
        if state and name.endswith("_"):
            self._keep_original(args[0])  # an in-place write: to put back on an error
        out = func(*args, **(kwargs or {}))
        if state and (name in _SIZES or (name == "__get__" and getattr(func, "__self__", None) is _SHAPE)):
            self.sized.append((self.names[first], _caller_line()))
        if name in _TO_PYTHON:
            names = [self.names[first]] if state else self.derived[first][1]
            where = _caller_line()
            self.decided.extend((n, where) for n in names)
            self.outcomes.append((where, repr(out)))
        elif state or first in self.derived:
            self._derive(args, kwargs, out)
        if getattr(func, "__self__", None) is _DATA and args:
            owner = args[0]
            name = self.names.get(id(owner))
            if name is not None:
                self._keep_original(owner)
            where = _caller_line()
            if func.__name__ == "__get__" and isinstance(out, torch.Tensor):
                out = owner.detach()
                if not out.is_inference():
                    self.taken.append((out, out._version, name, where))
            elif func.__name__ == "__set__":
                self.assigned.append((name, where))
        return out

    def _derive(self, args, kwargs, out) -> None:
        """Marks `out` as made from state tensors where every tensor argument is one, or
        made from them ([Note: writes through .data])."""
        if not isinstance(out, torch.Tensor) or out.numel() > _DERIVED_NUMEL:
            return
        names = []
        for a in itertools.chain(args, (kwargs or {}).values()):
            if isinstance(a, torch.Tensor):
                if id(a) in self.names:
                    names.append(self.names[id(a)])
                elif id(a) in self.derived:
                    names.extend(self.derived[id(a)][1])
                else:
                    return  # made with the data too
        if names and id(out) not in self.names:
            self.derived[id(out)] = (out, list(dict.fromkeys(names)))

    def _keep_original(self, owner: torch.Tensor) -> None:
        if id(owner) not in self.originals:
            with torch.no_grad():
                self.originals[id(owner)] = (owner, _DATA.__get__(owner).clone())

    def _put_back(self) -> None:
        """The state tensors as before the trace, which wrote them with its own inputs."""
        with torch.no_grad():
            for owner, original in self.originals.values():
                data = _DATA.__get__(owner)
                if data.shape != original.shape:  # resized by the forward
                    data.resize_(original.shape)
                data.copy_(original)

    def refuse_writes(self, rerun=None) -> None:
        """Raises where the trace wrote through .data or decided on what it writes;
        `rerun(watch, changed, written)` runs the forward again under `watch` from copies
        of the state tensors the trace wrote (ids in `changed`), as they were before it or
        as it wrote them."""
        written = [(name, where) for alias, version, name, where in self.taken
                   if alias._version != version] + self.assigned
        ids = {i for i, (t, version) in self.versions.items() if t._version != version}
        changed = {self.names[i] for i in ids}
        decided = [(name, where) for name, where in self.decided if name in changed]
        resized = {self.names[i] for i, (t, shape) in self.shapes.items() if tuple(t.shape) != shape}
        sized = [(name, where) for name, where in self.sized if name in resized]
        if sized:
            self._put_back()
            what = _places(sized)
            raise TraceError(
                f"the forward reads the size of {what}, which it also resizes (a per-channel "
                "observer of quantization-aware training sizes its range at its first call): a "
                "trace fixes what it decided on that size for every step. Run the plain model "
                "once on a batch before RaNNCModule(model), so that its sizes are set ([Note: "
                "writes through .data] in _trace.py)")
        if decided and not written and rerun is not None:
            try:  # untraced both: the trace's own conversions add decisions of their own
                before, after = _WatchDataWrites(), _WatchDataWrites()
                rerun(before, ids, written=False)
                rerun(after, ids, written=True)
                if before.outcomes == after.outcomes:
                    decided = []  # the written state decides as the trace did
            except Exception:  # the decision stands as the cause
                pass
        if written or decided:
            self._put_back()
        if written:
            what = _places(written)
            raise TraceError(
                f"the forward writes through .data: {what}. A trace does not record what is "
                "done to .data, so rannc's steps would never do it. Write it under "
                "torch.no_grad() without .data (`with torch.no_grad(): self.buf.mul_(d)`), "
                "which is recorded; initialise from the data (Glow's ActNorm) before wrapping, "
                "by running the plain model once on a batch before RaNNCModule(model) ([Note: "
                "writes through .data] in _trace.py)")
        if decided:
            what = _places(decided)
            raise TraceError(
                f"the forward decides in Python on {what}, which it also writes (as Glow's "
                "ActNorm initialises itself at the first call): a trace fixes the decision for "
                "every step. Initialise before wrapping, by running the plain model once on a "
                "batch before RaNNCModule(model), or decide with tensor ops (torch.where) "
                "([Note: writes through .data] in _trace.py)")


def _places(found: list) -> str:
    """"'loc' at train.py:42, ..." for (state tensor's name or None, source line) pairs."""
    return failure.some_of(list(dict.fromkeys(
        f"{repr(name) if name else 'a tensor'} at {where}" for name, where in found)))


def _noting_where(caught: list):
    """A warnings.showwarning that records each warning with `where`: its line, or the
    user's line where it points into torch or rannc (a conversion that rannc's modes ran
    for the forward)."""
    ours = (os.path.dirname(torch.__file__), os.path.dirname(__file__))

    def note(message, category, filename, lineno, file=None, line=None):
        w = warnings.WarningMessage(message, category, filename, lineno, file, line)
        w.where = _caller_line() if filename.startswith(ours) else f"{filename}:{lineno}"
        caught.append(w)

    return note


def _caller_line() -> str:
    """file:line of the user's innermost frame of the current stack (_innermost_user_line)."""
    return _innermost_user_line(traceback.extract_stack()) or "?"


class _DetachUnderNoGrad(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (torch.is_grad_enabled() or func in _KEEP_ATTACHED
                or getattr(func, "__name__", "") == "__get__"):  # attributes: as they are
            return func(*args, **kwargs)

        def detached(x):
            return x.detach() if isinstance(x, torch.Tensor) and x.requires_grad else x

        args, kwargs = pytree.tree_map(detached, (args, kwargs))
        return func(*args, **kwargs)


def module_hooks(model: torch.nn.Module, backward: bool) -> list[str]:
    """The names of `model`'s modules with forward hooks or pre-hooks (`backward`: backward
    hooks or pre-hooks), "every module" for hooks registered on all modules."""
    mm = torch.nn.modules.module
    if backward:
        kinds = ("_backward_hooks", "_backward_pre_hooks")
        everywhere = mm._global_backward_hooks or mm._global_backward_pre_hooks
    else:
        kinds = ("_forward_hooks", "_forward_pre_hooks")
        everywhere = mm._global_forward_hooks or mm._global_forward_pre_hooks
    names = ["every module (a global hook)"] if everywhere else []
    return names + [name or "the model" for name, m in model.named_modules()
                    if any(not getattr(h, "__rannc__", False) and not _needless_here(h)
                           for k in kinds for h in getattr(m, k, {}).values())]


def _needless_here(hook) -> bool:
    """transformers' own hooks that need no word: enable_input_require_grads's (gradient
    checkpointing with frozen embeddings, PEFT), which makes the embeddings' output require
    grad so that reentrant checkpoints pass gradients (rannc's stages recompute and pass
    them without it), and the hooks that capture hidden states and attentions for a call
    with output_hidden_states=True (installed at the first such call, inert in the others;
    what they capture is an output of the trace); and torch's older spectral_norm and
    weight_norm, whose pre-hooks compute the weight, which the trace records."""
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm
    if isinstance(hook, (SpectralNorm, WeightNorm)):
        return True  # torch's older spectral and weight norms: the weight they make is traced
    return (getattr(hook, "__name__", "") in ("make_inputs_require_grads", "output_capturing_hook")
            and getattr(hook, "__module__", "").startswith("transformers."))


def _refuse_backward_hooks(model: torch.nn.Module):
    hooked = module_hooks(model, backward=True)
    if hooked:
        raise TraceError(
            f"backward hooks on {failure.some_of(hooked)} (register_full_backward_hook or "
            "register_full_backward_pre_hook): a trace records the forward's ops, not the hooks "
            "autograd would call, so rannc cannot run them. Remove them, or hook the parameters "
            "(param.register_hook) outside the model")


def _rows_written(before: torch.Tensor, after: torch.Tensor) -> list[int]:
    """The indices along dimension 0 where `after` differs from `before`."""
    differ = after.ne(before)
    if before.is_floating_point() or before.is_complex():
        differ &= ~(before.isnan() & after.isnan())
    return torch.nonzero(differ.reshape(before.shape[0], -1).any(1)).view(-1).tolist()


def _refuse_rows_kept_in_buffers(state: ModelState, state_tensors: list, observe1: list,
                                 batch1: int, observe2: list, batch2: int) -> None:
    """[Note: rows kept in buffers] A buffer the forward writes the batch's rows into in
    place, rows 0 to B-1 for a batch of B (a KV cache as Meta's Llama keeps it,
    `self.cache_k[:B, start:start + T] = k`, read back by a later call), holds state per row
    of the caller's batch. rannc runs the rows as micro-batches and replicas, each writing
    its rows into rows 0.. of its stage's copy, so a later call read other rows' keys: eval
    outputs 1.27 off on 2 stages without a word. Found from the observation runs: at both
    batch sizes the rows written are exactly the first B. Batch norm's statistics and
    codebook updates change rows that do not follow the batch."""
    n_params = len(state.param_names)
    for j, name in enumerate(state.buffer_names):
        before = state_tensors[n_params + j]
        after1, after2 = observe1[n_params + j], observe2[n_params + j]
        if (before.dim() == 0 or before.shape[0] < max(batch1, batch2) or before.is_meta
                or after1.shape != before.shape or after2.shape != before.shape):
            continue
        if (_rows_written(before, after1) == list(range(batch1))
                and _rows_written(before, after2) == list(range(batch2))):
            raise TraceError(
                f"the forward writes the rows of its batch into rows 0 to B-1 of buffer {name} "
                f"in place (B = {batch1} and {batch2} while tracing): a cache kept per row of "
                "the caller's batch, as a KV cache for generation is. rannc runs the batch's "
                "rows as micro-batches and replicas, each writing into rows 0.. of its stage's "
                "copy of the buffer, so a later call would read other rows' values. Pass such a "
                "cache to forward as an argument and return it (as transformers' "
                "past_key_values), or generate with the model outside rannc ([Note: rows kept "
                "in buffers] in _trace.py)")


def _fresh_buffers(state: ModelState, state_tensors: list) -> list[torch.Tensor]:
    """`state_tensors` with the buffers copied: a run may write into them."""
    n_params = len(state.param_names)
    return state_tensors[:n_params] + [b.clone() for b in state_tensors[n_params:]]


def compiled_parts(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The (name, module) of `model` and its submodules that torch.compile or
    Module.compile() compiled ("" for the model itself; names as in the uncompiled model)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # imported once compile was used
    optimized = eval_frame.OptimizedModule if eval_frame is not None else ()
    return [(name.replace("_orig_mod.", "").removesuffix("_orig_mod"), m)
            for name, m in model.named_modules()
            if m.__dict__.get("_compiled_call_impl") is not None
            or (optimized and isinstance(m, optimized) and "forward" in m.__dict__)]


def traced_differently(model: torch.nn.Module) -> list[str]:
    """Warnings for the parts of `model` that rannc runs otherwise than PyTorch would, though
    they train the same model: compiled parts ([Note: compiled models]), forward hooks
    ([Note: hooks]) and SyncBatchNorm ([Note: SyncBatchNorm])."""
    compiled = [name or "the model" for name, _ in compiled_parts(model)]
    hooked = module_hooks(model, backward=False)
    synced = [name for name, m in model.named_modules() if isinstance(m, torch.nn.SyncBatchNorm)]
    found = []
    if compiled:
        found.append(f"torch.compile was applied to {failure.some_of(compiled)}: rannc "
                         "traces the model eagerly and runs its own stages, which are not "
                         "compiled")
    if hooked:
        found.append(f"forward hooks on {failure.some_of(hooked)} run while rannc traces "
                         "the model, not in each step: what they return is traced into the "
                         "graph, but their side effects (storing activations, logging) happen "
                         "at tracing only")
    if synced:
        found.append(f"SyncBatchNorm in {failure.some_of(synced)}: rannc computes "
                         "batch-norm statistics over each micro-batch share, as for BatchNorm, "
                         "not synchronised over the ranks")
    return found


# [Note: cumulative batch norm] A batch norm with momentum=None keeps the cumulative average
# of the batches' statistics (as torch.optim.swa_utils.update_bn sets it to recompute them):
# its forward computes the factor 1 / num_batches_tracked in Python, which a trace fixes at
# its value then, so every step moved the statistics by the traced factor (0.43 off
# PyTorch's after 4 steps). While traced, such a module computes the same with tensor ops:
# the factor from the counter, the batch's mean and unbiased variance over every dimension
# but the channels, and the statistics moved in place (no gradient), around a batch norm
# that normalises by the batch's own statistics, as PyTorch's kernel does.
def _cumulative_average(m: torch.nn.Module) -> bool:
    return (isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training
            and m.track_running_stats and m.momentum is None and m.running_mean is not None
            and m.num_batches_tracked is not None)


def _cumulative_batch_norm(self, input: torch.Tensor) -> torch.Tensor:
    self._check_input_dim(input)
    self.num_batches_tracked.add_(1)
    out = torch.nn.functional.batch_norm(input, None, None, self.weight, self.bias, True, 0.0,
                                         self.eps)
    with torch.no_grad():
        factor = 1.0 / self.num_batches_tracked
        dims = [d for d in range(input.dim()) if d != 1]
        mean = input.mean(dims).to(self.running_mean.dtype)
        var = input.var(dims, correction=1).to(self.running_var.dtype)
        self.running_mean.mul_(1.0 - factor).add_(mean * factor)
        self.running_var.mul_(1.0 - factor).add_(var * factor)
    return out


class _CheckpointRunPlainly:
    """torch.utils.checkpoint's reentrant CheckpointFunction while a model is traced
    ([Note: checkpoints in forward])."""

    @staticmethod
    def apply(function, preserve_rng_state, *args):
        _say_checkpoints()
        return function(*args)


_CHECKPOINTS_SAID = []


def _say_checkpoints() -> None:
    """Rank 0 says once that the forward's torch.utils.checkpoint calls are traced through
    ([Note: checkpoints in forward]): a user who wrote them expects less memory."""
    if not _CHECKPOINTS_SAID and _C.get_rank() == 0:
        _CHECKPOINTS_SAID.append(True)
        _C.log_info("the forward calls torch.utils.checkpoint: rannc traces through it, and "
                    "which stages recompute their forward in the backward is the plan's, from "
                    "the memory each needs (option recompute=\"always\" recomputes every stage, "
                    "as the checkpoints would)")


def _noting_checkpoints(generator):
    """torch.utils.checkpoint's non-reentrant generator, noting its use."""
    def noted(*args, **kwargs):
        _say_checkpoints()
        return generator(*args, **kwargs)
    return noted


@contextlib.contextmanager
def traceable_parts(model: torch.nn.Module):
    """Parts of the model that cannot be traced as written run as rannc runs them, while
    traced; the module tree stays as the user built it, and everything is restored after.

    [Note: compiled models] torch.compile(model), or submodules compiled with torch.compile
    or Module.compile(), run eagerly: torch.jit.trace refuses dynamo-optimized code, and
    rannc runs the traced graph in its own stages, so what dynamo would compile never runs
    anyway. nanoGPT-style scripts compile the model before wrapping it for
    DistributedDataParallel, and run unchanged. Parameters keep their names (`_orig_mod.`
    included), as DDP keeps them.

    [Note: SyncBatchNorm] A SyncBatchNorm runs as the BatchNorm it extends: statistics over
    each micro-batch share, as every batch norm under rannc (docs/api.md). Its own forward,
    once torch.distributed is initialised (rannc.init_process_group(), accelerate), would
    record an all-gather over the world into the trace, which the stages, each on a few
    ranks, would run out of step (on the CPU it refuses outright).

    [Note: checkpoints in forward] torch.utils.checkpoint.checkpoint called in forward with
    use_reentrant=True (the default where the argument is left out, and transformers' for
    its gradient checkpointing) is an autograd.Function that torch.jit.trace cannot record:
    tracing failed with "unordered_map::at". It runs its function plainly, as the
    non-reentrant form is traced: the ops are the same, and which stages recompute in the
    backward is the plan's (option recompute).

    [Note: transformers 4 masks] transformers 4.5x builds its attention masks with torch.vmap
    over the batch, head, query and key indices (masking_utils._vmap_for_bhqkv) inside
    TransformGetItemToIndex, a mode that turns `tensor[index]` into an autograd.Function:
    torch.jit.trace cannot record either ("unordered_map::at", plain torch.jit.trace too),
    so no Llama, Mistral, Qwen or Gemma of those versions traced. While tracing, the mask
    function is called once on index tensors shaped to broadcast against each other and
    expanded, as transformers 5 does: the same mask, from ops the trace records.
    """
    import torch.nn.utils.parametrize as parametrize
    import torch.utils.checkpoint as checkpoints
    saved = [(checkpoints, "CheckpointFunction", checkpoints.CheckpointFunction)]
    # [Note: cached parametrizations] torch refuses to trace while parametrize.cached() is
    # on ("Cannot trace a model while caching parametrizations"), around the call as torch
    # documents it or inside forward: off while traced (the graph computes each weight
    # once per step anyway)
    saved += [(parametrize, "_cache_enabled", parametrize._cache_enabled),
              (parametrize, "cached", parametrize.cached)]
    parametrize._cache_enabled = 0
    parametrize.cached = contextlib.nullcontext
    checkpoints.CheckpointFunction = _CheckpointRunPlainly
    if hasattr(checkpoints, "_checkpoint_without_reentrant_generator"):
        generator = checkpoints._checkpoint_without_reentrant_generator
        saved.append((checkpoints, "_checkpoint_without_reentrant_generator", generator))
        checkpoints._checkpoint_without_reentrant_generator = _noting_checkpoints(generator)
    masks = sys.modules.get("transformers.masking_utils")
    if masks is not None and hasattr(masks, "_vmap_for_bhqkv"):  # [Note: transformers 4 masks]
        saved.append((masks, "_vmap_for_bhqkv", masks._vmap_for_bhqkv))
        masks._vmap_for_bhqkv = _broadcast_for_bhqkv
        if hasattr(masks, "TransformGetItemToIndex"):
            saved.append((masks, "TransformGetItemToIndex", masks.TransformGetItemToIndex))
            masks.TransformGetItemToIndex = contextlib.nullcontext
    for _, m in compiled_parts(model):
        if m.__dict__.get("_compiled_call_impl") is not None:  # Module.compile()
            saved.append((m, "_compiled_call_impl", m.__dict__["_compiled_call_impl"]))
            m._compiled_call_impl = None
        if hasattr(m, "_orig_mod") and "forward" in m.__dict__:  # torch.compile(module)
            saved.append((m, "forward", m.__dict__["forward"]))
            m.forward = m._orig_mod.__call__
    for m in model.modules():
        if _cumulative_average(m):  # [Note: cumulative batch norm]
            saved.append((m, "forward", m.__dict__.get("forward")))
            m.forward = types.MethodType(_cumulative_batch_norm, m)
        elif isinstance(m, torch.nn.SyncBatchNorm):
            saved.append((m, "forward", m.__dict__.get("forward")))
            m.forward = types.MethodType(torch.nn.modules.batchnorm._BatchNorm.forward, m)
    try:
        yield
    finally:
        for m, name, value in reversed(saved):
            if value is None:
                delattr(m, name)  # the class's method again
            else:
                setattr(m, name, value)


@contextlib.contextmanager
def _state_put_back(model: torch.nn.Module):
    """[Note: modules under several names] Every module's parameters and buffers as they
    were, after torch's _reparametrize_module. A module reachable under two names (one
    embedding as `shared` and `encoder.embed_tokens`, transformers 4's T5) is swapped once
    per name, and torch puts back under the second name what the first swap put there: the
    trace's tensor stayed in the model. With stand-ins (a new length, an eval call after
    training) the model then trained on the stand-in weights without a word (a loss 1.5%
    off), or a weight tied to it failed the next trace ("Cannot insert a Tensor that
    requires grad as a constant").

    [Note: tracing changes no attribute] The modules' own attributes too, and buffers the
    forward registered: each run of the forward while tracing starts from the module as the
    call found it, and leaves it so, as rannc's steps do (they run the traced graph, which
    sets no attribute). A cache the forward builds or grows (a rotary or ALiBi table built
    at the first call, or rebuilt for a longer sequence as transformers 4.3x's
    LlamaRotaryEmbedding did) was built by the trace's first run only, so the run at another
    batch size took the other branch: "the traced program depends on the input values",
    or "the model fails when run at batch size 2" with a stale table; the module kept a
    length that disagreed with its table. A value the forward leaves in an attribute for
    the loop to read (an auxiliary loss) is named by rank 0 ([Note: attributes read])."""
    saved = [(m, dict(m._parameters), dict(m._buffers), _own_attributes(m))
             for m in model.modules()]
    # [Note: tensors written in attributes] a plain tensor attribute (not a parameter or
    # buffer) is a constant of the trace: a forward that writes into one in place (Meta's
    # Llama keeps its KV cache so, `self.cache_k[:B, start:start + T] = k`) had each rank's
    # trace hold its own data, and the ranks' graphs differed ("the model's control flow
    # depends on its input data"); the steps would write into the one constant
    versions = [(m, name, t, _version(t)) for m, _, _, attributes in saved
                for name, t in attributes.items() if isinstance(t, torch.Tensor)]
    try:
        yield
        written = [(m, name) for m, name, t, v in versions if v is not None and _version(t) != v]
    finally:
        for m, parameters, buffers, attributes in saved:
            for name, value in parameters.items():
                if m._parameters.get(name) is not value:
                    m._parameters[name] = value
            for name in [n for n in m._buffers if n not in buffers]:  # registered by forward
                del m._buffers[name]
                m._non_persistent_buffers_set.discard(name)
            for name, value in buffers.items():
                if m._buffers.get(name) is not value:
                    m._buffers[name] = value
            own = m.__dict__
            for name in [n for n in own if n not in attributes and n not in _MODULE_INTERNALS]:
                del own[name]
            for name, value in attributes.items():
                if own.get(name, _MISSING) is not value:
                    own[name] = value
    if written:
        names = {id(m): n for n, m in model.named_modules()}
        where = [f"{name} of {names.get(id(m)) or 'the model'}" for m, name in written]
        raise TraceError(
            f"the forward writes into the tensor {failure.some_of(where)} in place: a tensor "
            "kept in a module's attribute, not a parameter or buffer, is a constant to the "
            "trace, which rannc's steps cannot update. Register it as a buffer "
            "(self.register_buffer(name, tensor, persistent=False)), or, for a cache kept per "
            "row of the batch (a KV cache), pass it to forward and return it ([Note: tensors "
            "written in attributes] in _trace.py)")


def _version(t: torch.Tensor) -> int | None:
    """The tensor's version counter (None for inference tensors, which keep none)."""
    try:
        return t._version
    except RuntimeError:
        return None


def _own_attributes(module: torch.nn.Module) -> dict:
    """The module's own attributes, not nn.Module's bookkeeping ([Note: tracing changes no
    attribute])."""
    return {n: v for n, v in module.__dict__.items() if n not in _MODULE_INTERNALS}


def _broadcast_for_bhqkv(mask_function, bh_indices: bool = True):
    """transformers 4's _vmap_for_bhqkv without vmap ([Note: transformers 4 masks]): the
    mask of every (batch, head, query, key) index, or every (query, key) one."""
    def mask(batch_idx, head_idx, q_idx, kv_idx):
        if not bh_indices:
            out = mask_function(batch_idx, head_idx, q_idx[:, None], kv_idx[None, :])
            return out.expand(q_idx.shape[0], kv_idx.shape[0])
        out = mask_function(batch_idx[:, None, None, None], head_idx[None, :, None, None],
                            q_idx[None, None, :, None], kv_idx[None, None, None, :])
        return out.expand(batch_idx.shape[0], head_idx.shape[0], q_idx.shape[0], kv_idx.shape[0])
    return mask


# [Note: dataclass outputs] A forward that returns a plain @dataclass (not transformers'
# ModelOutput, which pytree knows) had the whole object read as one leaf that is no tensor:
# the trace recorded no output, and planning failed with "cannot plan a graph without
# tasks". Such classes are registered with pytree, so their fields are the outputs and each
# call returns an instance of the class, as the model does.
def _register_dataclasses(x, depth: int = 6) -> None:
    if depth == 0 or isinstance(x, torch.Tensor):
        return
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        if type(x) not in pytree.SUPPORTED_NODES:
            try:
                pytree.register_dataclass(type(x))
            except Exception:  # fields that init cannot take: left as a leaf
                return
        items = [getattr(x, f.name) for f in dataclasses.fields(x)]
    elif isinstance(x, dict):
        items = list(x.values())
    elif isinstance(x, (list, tuple)):
        items = list(x)
    else:
        return
    for item in items:
        _register_dataclasses(item, depth - 1)


def _trace_once(model, state: ModelState, state_tensors: list, flat: FlatArgs, tensors,
                tracer_notes: list, watch_random: bool = False):
    """[Note: autocast in forward] A model may enter torch.autocast itself (its cast-weight
    cache on, the default). Autocast empties that cache only when the outermost autocast
    context exits, and tracing runs inside one (recording_autocast), so the second trace
    met the first trace's cast weights: "Cannot insert a Tensor that requires grad as a
    constant", reported as a batch-size failure. Each trace starts and ends with the
    cache empty."""
    torch.clear_autocast_cache()
    running = RUNNING_FORWARD.set(True)
    try:
        return _trace_body(model, state, state_tensors, flat, tensors, tracer_notes, watch_random)
    finally:
        RUNNING_FORWARD.reset(running)
        torch.clear_autocast_cache()


def _trace_body(model, state: ModelState, state_tensors: list, flat: FlatArgs, tensors,
                tracer_notes: list, watch_random: bool = False):
    n_state = len(state.names)
    out_info = {}
    watch_data = _WatchDataWrites()  # [Note: writes through .data]

    def fn(*inputs):
        watch_data.watch(state.names, inputs[:n_state])
        with _state_put_back(model), \
                _reparametrize_module(model, dict(zip(state.names, inputs[:n_state])),
                                      tie_weights=True):
            args, kwargs = flat.rebuild(inputs[n_state:])
            out = model(*args, **kwargs)
        _register_dataclasses(out)
        with_paths, spec = flatten_with_path(out)
        leaves = [x for _, x in with_paths]
        out_info["spec"], out_info["leaves"] = spec, leaves
        out_info["paths"] = [".".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
                                      for k in p) for p, _ in with_paths]
        return tuple(x for x in leaves if isinstance(x, torch.Tensor))

    def rerun(watch: _WatchDataWrites, changed: set, written: bool) -> None:
        # [Note: writes through .data]: the forward from copies of the state the trace
        # started from (the model's own: the trace ran on fresh copies) or wrote
        now = [(t if written else own).detach().clone() if id(t) in changed else t
               for t, own in zip(watch_data.watched, state_tensors)]
        watch.watch(state.names, now)
        with torch.no_grad(), watch, _state_put_back(model), \
                _reparametrize_module(model, dict(zip(state.names, now)), tie_weights=True):
            args, kwargs = flat.rebuild(tensors)
            model(*args, **kwargs)

    example = tuple(_fresh_buffers(state, state_tensors)) + tuple(tensors)
    old_map = torch.jit._trace._trace_module_map
    torch.jit._trace._trace_module_map = {m: name for name, m in model.named_modules()}
    try:
        with warnings.catch_warnings(record=True) as caught:
            # the user's line, where the warning's own is a frame of rannc's modes
            warnings.showwarning = _noting_where(caught)
            warnings.simplefilter("always", torch.jit.TracerWarning)
            warnings.filterwarnings("ignore", message=".*torch.jit.trace. is deprecated")
            with (watch_data,
                  _WatchRandomDecisions() if watch_random else contextlib.nullcontext(),
                  _RefuseTensorHooks(), _refuse_grad_in_forward(), traceable_parts(model),
                  _noting_vmap_calls(tracer_notes), _NotingDataDecisions(tracer_notes),
                  _DetachUnderNoGrad() if torch.is_grad_enabled() else contextlib.nullcontext()):
                traced = torch.jit.trace(fn, example, check_trace=False, strict=False)
        watch_data.refuse_writes(rerun)
    except _RandomDecision as e:
        raise TraceError(
            f"the model decides in Python on a random number ({e} at {_user_frame(e)}), as "
            "LayerDrop does (if torch.rand([]) < p: skip a layer); a trace fixes one draw for "
            "every step. Draw with tensor ops instead (torch.where), or set the probability to 0 "
            "(transformers: layerdrop=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0)") from None
    except _GradInForward as e:
        raise TraceError(
            f"the model calls torch.autograd.grad in its forward (at {_user_frame(e)}), as a "
            "gradient penalty (R1, WGAN-GP) computed inside a discriminator does: a trace "
            "records the forward's ops, not the backward run inside it, and the stages' "
            "backwards are not differentiable (create_graph=True). Compute such a penalty "
            "on a model outside the RaNNCModule ([Note: hooks] in _trace.py)") from None
    except _TensorHook as e:
        raise TraceError(
            f"the model registers a gradient hook on a tensor in its forward (register_hook at "
            f"{_user_frame(e)}): a trace records the forward's ops, not the hooks autograd would "
            "call, so the gradients it changes would be lost. Write the change as an op "
            "(a torch.autograd.Function is recorded too), or hook the parameters outside "
            "the model ([Note: hooks] in _trace.py)") from None
    except RuntimeError as e:
        if any(f.filename.endswith(os.path.join("attention", "flex_attention.py"))
               for f in traceback.extract_tb(e.__traceback__)):
            # torch.jit.trace cannot follow flex_attention's vmap over score_mod (torch's
            # own "Unsupported value kind: Tensor", which named nothing)
            raise TraceError(
                f"the model calls torch.nn.attention.flex_attention (at {_user_frame(e)}), "
                "which torch.jit.trace cannot trace: its score_mod and block mask run through "
                f"torch.vmap ({type(e).__name__}: {e}). Write the attention with "
                "torch.nn.functional.scaled_dot_product_attention and a mask built from the "
                "same rule (attn_mask=q_idx[:, None] >= kv_idx[None, :] for a causal one)") from None
        if "stateless API can't be used with Jitted modules" not in str(e):
            raise
        # torch.func.functional_call (per-sample gradients, a hypernetwork's weights) calls
        # the module with other tensors, which a module under torch.jit.trace refuses
        raise TraceError(
            f"the model calls torch.func.functional_call (or torch.nn.utils.stateless) in its "
            f"forward (at {_user_frame(e)}): rannc traces the forward with torch.jit.trace, "
            "under which a module cannot be called with other parameters. Compute with the "
            "weights as tensors (torch.nn.functional.linear(x, w, b)), or call functional_call "
            "outside the RaNNCModule") from None
    finally:
        torch.jit._trace._trace_module_map = old_map
    for w in caught:
        if issubclass(w.category, torch.jit.TracerWarning):
            tracer_notes.append(f"{w.where}: {str(w.message).split('.')[0]}")
    # [Note: outputs kept from tracing] What is kept of the run's outputs is their structure:
    # a tensor becomes a meta tensor of its shape (each call returns the call's values in
    # its place), and an output object that holds tensors (transformers' DynamicCache of
    # past_key_values) becomes None. Kept as they were, they held the trace's autograd graph,
    # every activation of the model on its device for as long as the module lived (a
    # 1.3B-parameter GPT-2 at 256 tokens: 1.6 GiB per trace), and every call returned the
    # same cache of the trace's stand-in values.
    kept = []
    for path, x in zip(out_info["paths"], out_info["leaves"]):
        if isinstance(x, torch.Tensor):
            kept.append(torch.empty_like(x, device="meta"))
        elif _holds_tensors(x):
            kept.append(None)
            out_info.setdefault("dropped", []).append(f"{path or 'the output'} ({type(x).__name__})")
        else:
            kept.append(x)
    out_info["leaves"] = kept
    graph = traced.graph
    torch._C._jit_pass_inline(graph)
    torch._C._jit_pass_lower_all_tuples(graph)
    _outputs_made_by_ops(graph)
    return graph, example, out_info


# [Note: outputs that are inputs] A model may return one of its parameters or buffers (a
# learnt temperature for a loss computed outside, as `self.logit_scale`) or an argument as
# it came (the labels, passed through). Such an output is no op's result: no stage makes it,
# so every call failed with a KeyError where the outputs are gathered. An aten::alias of it
# (a view, free to run, and differentiable, so a parameter's gradient from outside reaches
# it through its stage) makes it an op's result like any other output.
def _outputs_made_by_ops(graph) -> None:
    ret = graph.return_node()
    for i, value in enumerate(list(ret.inputs())):
        if value.node().kind() == "prim::Param" and isinstance(value.type(), torch._C.TensorType):
            alias = graph.create("aten::alias", [value], 1)
            alias.insertBefore(ret)
            alias.output().setType(value.type())
            ret.replaceInput(i, alias.output())


def _holds_tensors(x, depth: int = 4) -> bool:
    """Whether the object `x` (not a tensor) reaches a tensor through its attributes,
    lists, tuples and dicts within `depth` steps ([Note: outputs kept from tracing])."""
    if isinstance(x, torch.Tensor):
        return True
    if depth == 0 or x is None or isinstance(x, (bool, int, float, complex, str, bytes, type)):
        return False
    if isinstance(x, dict):
        items = list(x.values())
    elif isinstance(x, (list, tuple, set, frozenset)):
        items = list(x)
    else:
        items = list(getattr(x, "__dict__", {}).values())
    return any(_holds_tensors(v, depth - 1) for v in items)


def _user_frame(error: BaseException) -> str:
    """file:line of the innermost frame of the error outside torch and rannc."""
    frames = traceback.extract_tb(error.__traceback__)
    found = _innermost_user_line(frames)
    if found:
        return found
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"


def _innermost_user_line(frames) -> str | None:
    """file:line of the innermost of `frames` outside torch, rannc and Python's own library
    (warnings, contextlib; not its site-packages), or None."""
    skipped = (os.path.dirname(torch.__file__), os.path.dirname(__file__))
    python_lib = os.path.dirname(warnings.__file__) + os.sep
    for frame in reversed(frames):
        f = frame.filename
        if not f.startswith(skipped) and not (f.startswith(python_lib) and "-packages" not in f):
            return f"{f}:{frame.lineno}"
    return None


# [Note: attributes read] A module's attribute that forward reads as a Python number
# (`logits / self.temperature`, `if self.use_extra:`, dropout's `p`) is a constant of the
# trace. A training loop that changes it between steps (an annealed temperature, a
# curriculum flag, update_bn's momentum=None) had it ignored without a word. While the model
# is traced, every read of an int, float, bool or None from a module's own __dict__ is recorded (nn.Module's
# __getattribute__, swapped for the trace and put back); a call whose values differ from
# the traced ones is another program, traced with the new values ([Note: other arguments]
# in module.py). An attribute that forward itself changes (a counter) is not watched, as
# the steps run the graph and change none: rank 0 warns, naming it. One that forward sets
# before it reads it (Funnel Transformer's `self.pooling_mult = 1`, then doubled per block)
# carries nothing from one call to the next: neither watched nor named (writes through
# nn.Module's __setattr__, swapped the same way).
_MODULE_INTERNALS = frozenset(torch.nn.Module().__dict__) | {"training"}
_PLAIN = (int, float, bool, type(None))


class _AttributeReads:
    def __init__(self, model: torch.nn.Module):
        self.names = {id(m): name for name, m in model.named_modules()}
        self.first = {}  # (id of the module, attribute) -> (module, attribute, value first read)
        self.set_first = set()  # (id of the module, attribute) written before any read
        # (id of the module, attribute) -> the value the forward wrote last: the tracing put
        # the attribute back ([Note: tracing changes no attribute])
        self.written = {}

    def __enter__(self):
        names, first, set_first, written = self.names, self.first, self.set_first, self.written
        self.own = torch.nn.Module.__dict__.get("__getattribute__")  # None: object's
        self.own_set = torch.nn.Module.__setattr__
        get, put = self.own or object.__getattribute__, self.own_set

        def recording(module, attribute):
            value = get(module, attribute)
            if (type(value) in _PLAIN and attribute not in _MODULE_INTERNALS
                    and (id(module), attribute) not in first and id(module) in names
                    and (id(module), attribute) not in set_first
                    and attribute in get(module, "__dict__")):
                first[(id(module), attribute)] = (module, attribute, value)
            return value

        def writing(module, attribute, value):
            if (id(module), attribute) not in first:
                set_first.add((id(module), attribute))
            if id(module) in names and attribute not in _MODULE_INTERNALS:
                written[(id(module), attribute)] = (module, attribute, value)
            put(module, attribute, value)

        torch.nn.Module.__getattribute__ = recording
        torch.nn.Module.__setattr__ = writing
        return self

    def __exit__(self, *exc):
        torch.nn.Module.__setattr__ = self.own_set
        if self.own is None:
            del torch.nn.Module.__getattribute__
        else:
            torch.nn.Module.__getattribute__ = self.own

    def watched(self) -> list:
        """(module name, module, attribute, value) of each attribute read and left as read;
        rank 0 warns of those forward changed."""
        kept, changed = [], []
        for module, attribute, value in self.first.values():
            name = self.names[id(module)] or "the model"
            now = self.written.get((id(module), attribute), (None, None, value))[2]
            if type(now) is type(value) and now == value:
                kept.append((name, module, attribute, value))
            elif type(now) in _PLAIN and (id(module), attribute) not in _WARNED_CHANGES:
                # a count or flag (a tensor or object set in its place: _say_tensors_left)
                _WARNED_CHANGES.add((id(module), attribute))
                changed.append(f"{attribute} of {name} ({value!r} -> {now!r})")
        if changed and _C.get_rank() == 0:
            _C.log_warn(f"the forward changes {failure.some_of(changed)}: a trace runs the "
                        "forward's Python, rannc's steps run the traced graph, which changes no "
                        "attribute. Keep a count in a buffer (register_buffer) to have the steps "
                        "update it ([Note: attributes read] in _trace.py)")
        self._say_tensors_left()
        return kept

    def _say_tensors_left(self) -> None:
        """Rank 0 names, once each, the tensors the forward leaves in a module's attribute
        (`self.aux_loss = ...` for the loop to read after the call, a cache): tracing put
        the attribute back and the steps set none ([Note: tracing changes no attribute])."""
        left = []
        for key, (module, attribute, value) in self.written.items():
            if (isinstance(value, torch.Tensor) and attribute not in module._buffers
                    and attribute not in module._parameters and key not in _WARNED_CHANGES):
                _WARNED_CHANGES.add(key)
                left.append(f"{attribute} of {self.names[id(module)] or 'the model'}")
        if left and _C.get_rank() == 0:
            _C.log_info(f"the forward sets {failure.some_of(left)} to a tensor: within the call "
                        "it reads as in PyTorch (a cache it builds is rebuilt by every step), but "
                        "rannc's steps run the traced graph, which sets no attribute, so the "
                        "module keeps the value it had before (return a value the loop reads "
                        "after the call, such as an auxiliary loss, from forward; [Note: tracing "
                        "changes no attribute] in _trace.py)")


_MISSING = object()
_WARNED_CHANGES = set()  # (id of the module, attribute) that forward changes, named once


def attribute_values(watched: list) -> tuple:
    """The current values of the attributes `watched` ([Note: attributes read])."""
    return tuple(module.__dict__.get(attribute, _MISSING) for _, module, attribute, _ in watched)


def trace(model: torch.nn.Module, args: tuple, kwargs: dict | None = None,
          state_tensors: list | None = None, home: torch.device | None = None) -> Trace:
    """`state_tensors`: what to trace the model's parameters and buffers with, in
    ModelState order (default: state_for_tracing's, the module's own with stand-ins for
    parameters on the meta device); `home`: where they are and the model runs (default:
    home_device)."""
    if not isinstance(model, torch.nn.Module):
        raise TraceError(f"expected an nn.Module, got {type(model).__qualname__}")
    if not isinstance(args, tuple):
        args = (args,)
    _refuse_backward_hooks(model)  # [Note: hooks]
    flat = flatten_args(args, kwargs or {})
    # [Note: home device] The model runs where its parameters and buffers are; arguments
    # on another device (inputs on the GPU, the model still on the CPU, or the reverse)
    # are copied there for tracing. The user's tensors stay where they are.
    home = home if home is not None else home_device(model, flat.tensors)
    if any(t.device != home for t in flat.tensors):
        flat = dataclasses.replace(flat, tensors=[t.to(home) for t in flat.tensors])
    batched = [t for t in flat.tensors if t.dim() >= 1]
    if not batched:
        raise TraceError("no tensor argument has a batch dimension (dimension 0)")
    batch = batched[0].shape[0]
    state = ModelState.of(model)
    if state_tensors is None:
        state_tensors = state_for_tracing(model, state, home)
    reads = _AttributeReads(model)  # [Note: attributes read]
    sequence_first = _sequence_first_layout(flat.tensors)
    try:
        with reads:
            traced, out1 = _trace_with_layout(model, state, state_tensors, flat, home, batch,
                                              _leading_batch_dims(flat.tensors, batch))
    except TraceError as leading_failed:  # [Note: batch dimensions]: the batch elsewhere?
        rnns = [m for m in model.modules() if isinstance(m, torch.nn.RNNBase)]
        hidden = (_hidden_state_layout(flat.tensors, batch)
                  if any(m.batch_first for m in rnns) else None)
        first = (sequence_first if any(not m.batch_first for m in rnns)
                 or sequence_first_attention(model) else None)
        traced, out1, batch = _traced_in_another_layout(
            model, state, state_tensors, flat, home, reads,
            [(hidden, "a hidden state's"), (first, "")], leading_failed)
        if batch != batched[0].shape[0]:
            sequence_first = None  # traced so already
    # [Note: batch dimensions]
    ops = _RECURRENT_OPS + (_ATTENTION_OPS if sequence_first_attention(model) else ())
    along = recurrent_along_batch(traced.ir, ops)
    layout = sequence_first if along else None
    if layout is not None:
        try:
            with reads:
                traced2, out2 = _trace_with_layout(model, state, state_tensors, flat, home, *layout)
        except TraceError:
            traced2 = None
        if traced2 is not None and not recurrent_along_batch(traced2.ir, ops):
            traced, out1, batch, along = traced2, out2, layout[0], []
            _C.log_info(f"the arguments are sequence first: the batch is dimension 1 of those "
                        f"that have {batch} rows there ([Note: batch dimensions] in _trace.py)")
    recurrent = [a for a in along if a.split(" ")[0] in _RECURRENT_OPS]
    if recurrent:
        _C.log_warn(
            f"rannc takes dimension 0 of the arguments as the batch ({batch} rows), but "
            f"{failure.some_of(recurrent)} runs along it, and tracing with the batch in "
            "dimension 1 did not help: a sequence-first model (nn.LSTM, nn.GRU or nn.RNN "
            "without batch_first=True) would be cut along the sequence and train wrongly. Pass "
            "the arguments batch first ([batch, sequence, ...]) to a model built with "
            "batch_first=True")
    elif along:  # attention glued with what follows it: right, but in one stage
        _C.log_info(
            f"{failure.some_of(along)} mixes the rows of dimension 0 of the arguments, which "
            "rannc takes as the batch, and tracing with the batch in dimension 1 did not help: "
            "the model's layers from there on stay in one task (one stage). A model built "
            "with batch_first=True and fed [batch, sequence, ...] pipelines")
    if out1.get("dropped"):  # [Note: outputs kept from tracing]
        _C.log_info(f"the model's output {', '.join(out1['dropped'])} holds tensors that are not "
                    "the model's outputs to rannc: each call returns None in its place "
                    "(transformers models: pass use_cache=False, or set config.use_cache = False, "
                    "not to compute a cache)")
    leaves = out1["leaves"]
    slots = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    ir = traced.ir
    not_cut = [out1["paths"][slot] for vid, slot in zip(ir.outputs, slots)
               if slot in out1["resized"] and ir.value(vid).batch_dim < 0]
    return Trace(traced, state, state_tensors, home, flat, out1["spec"], leaves, slots, batch,
                 attributes=reads.watched(), outputs_not_cut=not_cut,
                 choosing=out1.get("choosing", []))


def _traced_in_another_layout(model, state, state_tensors, flat, home, reads, layouts: list,
                              leading_failed: TraceError):
    """The first of `layouts` ((batch, dims) or None, and what has the batch in dimension 1)
    that traces: (the traced model, the first trace's outputs, the batch size); else
    `leading_failed`, the error with the batch in dimension 0 ([Note: batch dimensions])."""
    for layout, what in layouts:
        if layout is None:
            continue
        try:
            with reads:
                traced, out1 = _trace_with_layout(model, state, state_tensors, flat, home, *layout)
        except TraceError:
            continue
        batch, dims = layout
        named = [flat.paths[slot] for slot, d in zip(flat.tensor_slots, dims) if d == 1]
        _C.log_info(f"the batch ({batch} rows) is dimension 1 of {failure.some_of(named)}"
                    + (f" ({what} layout)" if what else " (sequence first)")
                    + ": traced so, as with the batch in dimension 0 the model failed "
                    "([Note: batch dimensions] in _trace.py)")
        return traced, out1, batch
    raise leading_failed


def _batch_order_hint(flat: FlatArgs, batch: int) -> str:
    """Where another argument holds more rows than the first tensor argument, from which the
    batch size was taken (a [1, S] position_ids passed before input_ids): say so."""
    if not flat.tensors:
        return ""
    first = flat.paths[flat.tensor_slots[0]]
    per_row = _list_per_row(flat, batch)
    if per_row:
        return (f" Or is {per_row} a list with one entry per row of the batch ({batch} entries: "
                "per-image targets)? rannc cuts tensors along dimension 0 into micro-batches "
                "and replicas, and passes lists whole to each of them, so its entries no longer "
                "match the rows. Pass such values as tensors whose dimension 0 is the batch: "
                "padded to [batch, most items, ...] with a count or mask of the real items")
    concatenated = _concatenated_items(flat, batch)
    if concatenated:
        items, lengths, total = concatenated
        return (f" Or does {items} hold each row's items concatenated ({total} items, that "
                f"{lengths} splits among the {batch} rows: its values sum to {total}, as CTC's "
                "1-D targets and their lengths)? rannc cuts the arguments whose dimension 0 "
                "holds the batch's rows, and concatenated items are no rows: pad them to "
                "[batch, longest] (CTCLoss takes targets [batch, longest target] with their "
                "lengths)")
    others = collections.Counter(t.shape[0] for t in flat.tensors[1:] if t.dim())
    rows, count = others.most_common(1)[0] if others else (batch, 0)
    if count >= 2 and rows != batch:
        named = [flat.paths[slot] for t, slot in zip(flat.tensors[1:], flat.tensor_slots[1:])
                 if t.dim() and t.shape[0] == rows]
        return (f" Or is {first} not the batch? rannc takes the batch size from the first "
                f"tensor argument ({first}, shape {list(flat.tensors[0].shape)}), but "
                f"{failure.some_of(named)} have {rows} rows: pass the batch's tensors first "
                "(keyword arguments count in the order given), and keep a tensor of the "
                "model's own sizes (class weights) in the model (register_buffer)")
    flattened = _indices_of_flattened_rows(flat, batch)
    if flattened:
        name, rows, of = flattened
        return (f" Or does {name} hold positions in the batch flattened ({of} reshaped to "
                f"[{rows}, ...], positions as b * {rows // batch} + t)? rannc cuts the rows "
                "into micro-batches and replicas, and positions counted over the whole batch "
                "point past the rows of a micro-batch. Give each row its own positions: "
                "[batch, k] indices into its own items, gathered per row (torch.gather or "
                "h[torch.arange(batch)[:, None], pos])")
    # integers that point at rows (a graph's edge_index over its nodes) in an argument
    # that is not cut: rows that refer to each other
    indexing = [flat.paths[slot] for t, slot in zip(flat.tensors, flat.tensor_slots)
                if t.dim() and t.shape[0] != batch and t.numel() > 1 and not t.is_floating_point()
                and t.dtype != torch.bool and 0 <= int(t.min()) and batch // 2 <= int(t.max()) < batch]
    if indexing:
        return (f" Or does {indexing[0]} hold indices of the batch's rows (integers below "
                f"{batch}, as a graph's edge_index over its nodes)? rannc takes dimension 0 of "
                f"{first} as the batch and cuts its rows into micro-batches and replicas: rows "
                "that refer to each other (the nodes of one graph) cannot be cut. Give each "
                "sample its own rows (a batch of graphs padded to [graphs, nodes, ...] with "
                "their adjacency [graphs, nodes, nodes])")
    more = [(flat.paths[slot], t.shape[0]) for t, slot in zip(flat.tensors, flat.tensor_slots)
            if t.dim() and t.shape[0] > batch]
    same = [flat.paths[slot] for t, slot in zip(flat.tensors[1:], flat.tensor_slots[1:])
            if t.dim() == 1 and t.shape[0] == batch and t.is_floating_point()]
    if not more and same:
        return (f" Or is {failure.some_of(same)} of a size of the model's own that equals the "
                f"batch size here ({batch}: class weights over {batch} classes)? rannc takes "
                "dimension 0 of every tensor argument as long as the first one's as the batch "
                "and cuts it into micro-batches: keep such a tensor in the model "
                "(register_buffer) and set it in place")
    if not more:
        return ""
    name, rows = more[0]
    return (f" Or is {name} the batch? rannc takes the batch size, {batch}, from the first "
            f"tensor argument ({first}, shape {list(flat.tensors[0].shape)}), and {name} has "
            f"{rows} rows: pass the batch's tensors first (keyword arguments count in the "
            "order given). Or are its rows not the batch's (each row's items concatenated, as "
            "CTC's 1-D targets)? rannc cuts the arguments whose dimension 0 holds the batch's "
            "rows and passes the others whole to every micro-batch: pad it to [batch, ...] "
            "(CTCLoss takes targets [batch, longest target] with their lengths; EmbeddingBag "
            "a 2-D input [batch, largest bag] padded with its padding_idx, without offsets)")


def _list_per_row(flat: FlatArgs, batch: int):
    """The path of a list or tuple argument (or one inside an argument) of `batch` entries
    that are tensors or containers of them (a detection model's per-image targets), if any."""
    args, kwargs = flat.rebuild(flat.tensors)

    def walk(x, name):
        if isinstance(x, (list, tuple)):
            if len(x) == batch and batch > 1 and all(
                    isinstance(e, (torch.Tensor, dict, list, tuple)) for e in x):
                return name
            return next((w for w in (walk(e, f"{name}[{i}]") for i, e in enumerate(x)) if w), None)
        if isinstance(x, dict):
            return next((w for w in (walk(v, f"{name}[{k!r}]") for k, v in x.items()) if w), None)
        return None

    return (next((w for w in (walk(a, f"args[{i}]") for i, a in enumerate(args)) if w), None)
            or next((w for w in (walk(v, f"kwargs[{k!r}]") for k, v in kwargs.items()) if w), None))


def _integers(t: torch.Tensor) -> bool:
    return not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool


def _concatenated_items(flat: FlatArgs, batch: int):
    """(items, lengths, total) where a 1-D integer argument `lengths` of `batch` values sums
    to the length of another 1-D argument `items` (CTC's targets and target lengths)."""
    named = list(zip(flat.tensors, (flat.paths[s] for s in flat.tensor_slots)))
    for lengths, lname in named:
        if lengths.dim() != 1 or lengths.shape[0] != batch or not _integers(lengths):
            continue
        total = int(lengths.sum())
        for items, iname in named:
            if (items is not lengths and items.dim() == 1 and items.shape[0] == total > 0
                    and _integers(items)):
                return iname, lname, total
    return None


def _indices_of_flattened_rows(flat: FlatArgs, batch: int):
    """(name, rows, of) where an integer argument without the batch's rows holds positions
    up to `rows` = batch x dimension 1 of argument `of` (`h.reshape(-1, d)[pos]` with
    pos = b * T + t), past the batch itself."""
    named = list(zip(flat.tensors, (flat.paths[s] for s in flat.tensor_slots)))
    for t, name in named:
        if not t.dim() or t.shape[0] == batch or not t.numel() or not _integers(t):
            continue
        low, high = int(t.min()), int(t.max())
        for shaped, of in named:
            if shaped.dim() >= 2 and shaped.shape[0] == batch:
                rows = batch * shaped.shape[1]
                if 0 <= low and max(batch, rows // 2) <= high < rows:
                    return name, rows, of
    return None


# [Note: checks of the data] A forward that checks its batch in Python (`assert (y >= 0).all()`,
# wav2vec2's `if labels.max() >= vocab_size: raise`) runs the check at tracing only: a trace
# records the ops, and the condition is a Python bool the tracer fixed, so the steps never
# run it and a batch the check would refuse (a NaN, a label out of range) trains on without
# a word, where PyTorch raises. While tracing, each bool taken of a tensor is followed back
# through the trace's graph: where it comes from an input (the data or the state) other than
# through sizes (a shape check: each new shape is traced anew), and the line it is taken at
# (or the two after it) asserts or raises, rank 0 says so, once per line.
_CHECKS_SAID: set = set()
_CHECK_SOURCE = re.compile(r"\bassert\b|\braise\b|\b_assert\(")


def _inputs_read(value) -> set:
    """The positions of the traced graph's inputs whose values (not only sizes) `value`
    depends on."""
    seen, stack, found = {value.unique()}, [value], set()
    while stack:
        v = stack.pop()
        node = v.node()
        if node.kind() == "prim::Param":
            found.add(v.offset())
            continue
        if node.kind() in ("aten::size", "aten::dim", "aten::numel"):
            continue
        for u in node.inputs():
            if u.unique() not in seen:
                seen.add(u.unique())
                stack.append(u)
    return found


# a tensor turned into a Python value: `if t`, `int(t)`, `heads[t]`, `t.item()`
_DECISIONS = (torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__index__,
              torch.Tensor.__float__, torch.Tensor.item, torch.Tensor.tolist)


class _NotingDataDecisions(torch.overrides.TorchFunctionMode):
    """Notes "decision:<file:line>" for each bool taken of a tensor computed from the data
    ([Note: checks of the data]), and "decided-by:<input>" for each graph input that a
    tensor turned into a Python value reads ([Note: tensors that choose the program])."""

    def __init__(self, notes: list):
        super().__init__()
        self.notes = notes

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _DECISIONS and torch._C._get_tracing_state() is not None:
            try:
                traced = torch._C._get_value_trace(args[0])
            except RuntimeError:  # a tensor the trace has no value for: a constant
                traced = None
            read = _inputs_read(traced) if traced is not None else set()
            if read and func is torch.Tensor.__bool__:
                self.notes.append(f"decision:{_caller_line()}")
            self.notes.extend(f"decided-by:{i}" for i in sorted(read))
        return func(*args, **(kwargs or {}))


# [Note: tensors that choose the program] A tensor argument without rows that the forward
# turns into a Python value (a task id from the collate function: `self.heads[int(task)]`,
# `if task == 0`) chooses the traced program: the second trace changes the rows' values
# to expose decisions on the data, not a tensor without rows, so the trace fixed the first
# call's branch and every later call ran it (a multi-task model trained the first task's
# head on every task without a word: parameters 0.167 off after 4 steps). Such an argument
# of at most _CHOOSING_VALUES values is part of what names a program, as a Python number
# is: a call with other values runs (or traces) the program of those values.
_CHOOSING_VALUES = 64


def choosing_inputs(notes: list, n_state: int, flat: FlatArgs, dims: list) -> list[int]:
    """The positions in flat.tensors of the arguments without rows that chose the program."""
    read = {int(n[len("decided-by:"):]) - n_state for n in notes if n.startswith("decided-by:")}
    return [i for i in sorted(read) if 0 <= i < len(flat.tensors) and dims[i] is None
            and flat.tensors[i].numel() <= _CHOOSING_VALUES]


def chosen_by(flat: FlatArgs, inputs: list[int]) -> tuple:
    """The values of the arguments at `inputs` of flat.tensors, as a program's key."""
    return tuple((flat.paths[flat.tensor_slots[i]], tuple(flat.tensors[i].detach().cpu().reshape(-1).tolist()))
                 for i in inputs)


def _warn_of_checks_on_the_data(notes: list) -> None:
    checks = []
    for where in dict.fromkeys(n[len("decision:"):] for n in notes if n.startswith("decision:")):
        file, _, line = where.rpartition(":")
        if not line.isdigit() or where in _CHECKS_SAID:
            continue
        source = "".join(linecache.getline(file, int(line) + i) for i in range(3))
        if _CHECK_SOURCE.search(source):
            _CHECKS_SAID.add(where)
            checks.append(f"{where} ({linecache.getline(file, int(line)).strip()})")
    if checks and _C.get_rank() == 0:
        _C.log_warn(
            f"the forward checks tensor values in Python at {'; '.join(checks)}: a trace "
            "records the ops, not the check, so rannc's steps never run it, and a batch it "
            "would refuse (a NaN, a label out of range) trains on without a word. Check the "
            "batch before the call ([Note: checks of the data] in _trace.py)")


# [Note: numbers in the outputs] An output that is a Python number computed from tensors
# (`return loss, loss.item()`, an accuracy's `.item()`) is no op of the trace: every call
# returned the number the trace computed, frozen (each rank its own shard's), without a
# word. The two traces run other data: a number that differs between them comes from the
# data, and tracing stops, naming the output and the cure. One that agrees (a constant, a
# flag passed through) is returned as traced.
def _refuse_numbers_of_data(out1: dict, out2: dict, notes: list) -> None:
    for path, a, b in zip(out1["paths"], out1["leaves"], out2["leaves"]):
        if isinstance(a, (int, float, complex)) and not isinstance(a, bool) and a != b:
            where = [n for n in notes if "Python number" in n or "Python float" in n
                     or "Python integer" in n]
            raise TraceError(
                f"the model's output {path or 'value'} is a Python number computed from the data "
                f"({a!r} in one trace, {b!r} in the other: .item(), float() or int() of a "
                "tensor): a trace fixes it, so every call would return the same number. Return "
                "the tensor instead (loss.detach(), not loss.item())"
                + (f"; the tracer warned at: {'; '.join(dict.fromkeys(where))}" if where else ""))


def _trace_with_layout(model, state, state_tensors, flat: FlatArgs, home, batch: int, dims: list):
    """The model traced and analysed with the batch (`batch` rows) in dimension `dims[i]` of
    each tensor argument: (the traced model, the first trace's outputs)."""
    notes: list[str] = []
    tensors2, batch2 = _second_batch(flat, batch, dims)
    # the user's random streams stay as they were, the model's GPU's too
    cuda = [home.index if home.index is not None else torch.cuda.current_device()] if home.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda), recording_autocast(home.type):
        g1, ex1, out1 = _trace_once(model, state, state_tensors, flat, flat.tensors, notes,
                                    watch_random=model.training)
        try:
            try:
                g2, ex2, out2 = _trace_once(model, state, state_tensors, flat, tensors2, notes)
            except Exception:  # perhaps only the changed values upset it: same values then
                tensors2, _ = _second_batch(flat, batch, dims, mirror=False)
                g2, ex2, out2 = _trace_once(model, state, state_tensors, flat, tensors2, notes)
        except Exception as e:  # the model itself fails at another batch size
            raise TraceError(
                f"the model fails when run at batch size {batch2} instead of {batch}, so it cannot "
                f"be split into micro-batches: {type(e).__name__}: {e} (at {_user_frame(e)}); "
                f"is the batch size written into a shape?{_batch_order_hint(flat, batch)}") from e
        if out1["spec"] != out2["spec"]:
            raise TraceError("the structure of the model's output differs between batch sizes "
                             f"{batch} and {batch2}: {out1['spec']} vs {out2['spec']}")
        _refuse_numbers_of_data(out1, out2, notes)
        _warn_of_checks_on_the_data(notes)
        out1["choosing"] = choosing_inputs(notes, len(state.names), flat, dims)
        out1["resized"] = {i for i, (a, b) in enumerate(zip(out1["leaves"], out2["leaves"]))
                           if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                           and a.shape != b.shape}
        names = state.names + [f"input:{flat.paths[s]}" for s in flat.tensor_slots]
        roles = (["param"] * len(state.param_names) + ["buffer"] * len(state.buffer_names)
                 + ["input"] * len(flat.tensors))
        classes = {name: type(m).__qualname__ for name, m in model.named_modules()}
        try:
            observe1 = _fresh_buffers(state, state_tensors) + list(flat.tensors)
            observe2 = (_fresh_buffers(state, state_tensors)
                        + _second_batch(flat, batch, dims, mirror=False)[0])
            # the observation runs run the graph as the stages will: its recorded casts with
            # autocast off (under autocast an op the model ran with autocast disabled would
            # be cast again, and its value's dtype recorded wrong)
            with autocast_off(home.type, autocast_dtype(home.type)):
                traced = _C.build_traced_model(g1, list(ex1), batch, g2, list(ex2), batch2,
                                               observe1, observe2, names, roles, classes)
            _refuse_rows_kept_in_buffers(state, state_tensors, observe1, batch, observe2, batch2)
        except TraceError as e:
            hints = [n for n in notes if "boolean" in n or "Python number" in n or "integer" in n]
            vmap = _vmap_hint(str(e), notes)
            if vmap:  # vmap's own conversions, not the user's
                hints = [n for n in hints if f"vmap:{n.split(': ')[0]}" not in notes]
            if hints or vmap:
                warned = "\nThe tracer warned at: " + "; ".join(dict.fromkeys(hints)) if hints else ""
                raise TraceError(f"{e}{vmap}{warned}") from None
            raise
    return traced, out1
