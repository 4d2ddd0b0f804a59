"""The traced graph as users see it: `rannc.trace(model, args, kwargs)`.

`g(*args, **kwargs)` runs the whole IR with autograd and returns what the model returns,
at any batch size; `g.split(k)` cuts the IR into k convex pieces and returns a callable
that runs them one after another, each seeing only the values that cross its boundary.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from . import _C, _trace


class TracedGraph:
    """A model traced into rannc's IR, runnable like the model itself."""

    def __init__(self, model: torch.nn.Module, args: tuple, kwargs: dict | None = None,
                 state_tensors: list | None = None, home: torch.device | None = None):
        """`state_tensors`, `home`: see _trace.trace."""
        self._model = model
        self._trace = _trace.trace(model, args, kwargs, state_tensors, home)

    # ---- inspection -----------------------------------------------------------------
    @property
    def ir(self) -> _C.IrGraph:
        """The IR (values, tasks, inputs, outputs) as plain data."""
        return self._trace.traced.ir

    @property
    def batch_size(self) -> int:
        """The batch size of the example arguments."""
        return self._trace.batch_size

    def summary(self) -> str:
        """Tasks, values, parameters, batch values and outputs of the IR."""
        return self.ir.summary()

    def save_ir(self, path: str) -> None:
        """Writes the IR to a versioned file (read back with rannc.load_ir)."""
        self.ir.save(path)

    # ---- execution ------------------------------------------------------------------
    def _flat_inputs(self, args, kwargs, at_home: bool = False) -> list[torch.Tensor]:
        """The graph's inputs: the model's parameters and buffers, then the tensors of
        `args` and `kwargs`; with `at_home`, those copied to the model's device where they
        are elsewhere ([Note: home device] in _trace.py)."""
        return self._trace.state.tensors(self._model) + self._flat_args(args, kwargs, at_home)

    def _profiling_inputs(self, args, kwargs) -> list[torch.Tensor]:
        """The graph's inputs for profiling: the state it was traced with (stand-ins for
        parameters this rank does not hold, [Note: stand-in parameters] in _trace.py), then
        the tensors of `args` and `kwargs` on the model's device."""
        return list(self._trace.state_tensors) + self._flat_args(args, kwargs, at_home=True)

    @staticmethod
    def arguments_of(args, kwargs) -> tuple:
        """What a trace bakes in of a call's arguments: their structure and the values of
        those that are not tensors (a call whose differ is another program)."""
        flat = _trace.flatten_args(args, kwargs)
        return (repr(flat.spec),) + tuple(repr(x) for x in flat.leaves
                                          if not isinstance(x, torch.Tensor))

    def takes(self, args, kwargs) -> bool:
        """Whether a call with `args` and `kwargs` runs this trace (see arguments_of)."""
        return self._differs(_trace.flatten_args(args, kwargs)) is None

    def _differs(self, flat: "_trace.FlatArgs") -> str | None:
        """How `flat` differs from the traced arguments' structure and constants (None:
        it does not)."""
        example = self._trace.inputs
        if flat.spec != example.spec:
            now, then = set(flat.paths), set(example.paths)
            parts = ([f"{p} not passed (traced with it)" for p in example.paths if p not in now]
                     + [f"{p} passed (traced without it)" for p in flat.paths if p not in then])
            if not parts:  # the same leaves in another container
                parts = [f"the arguments' structure {' '.join(str(flat.spec).split())} differs "
                         f"from the traced one {' '.join(str(example.spec).split())}"]
            return "; ".join(parts)
        for i, (now, then) in enumerate(zip(flat.leaves, example.leaves)):
            if isinstance(then, torch.Tensor) != isinstance(now, torch.Tensor):
                # an optional tensor passed as None (or a number) now, or the reverse: another
                # program, not the traced one at new shapes
                def kind(x):
                    return "a tensor" if isinstance(x, torch.Tensor) else repr(x)
                return (f"argument {example.paths[i]} was {kind(then)} when traced and is "
                        f"{kind(now)} now")
            if not isinstance(then, torch.Tensor) and now != then:
                return (f"argument {example.paths[i]} was {then!r} when traced and is {now!r} "
                        "now; constants are baked into the trace")
        return None

    def _flat_args(self, args, kwargs, at_home: bool = False) -> list[torch.Tensor]:
        """The tensors of `args` and `kwargs` (the graph's inputs after the model's state),
        checked against the traced arguments' structure and constants."""
        flat = _trace.flatten_args(args, kwargs)
        differs = self._differs(flat)
        if differs is not None:
            raise _C.TraceError(differs)
        if not at_home:
            return flat.tensors
        return [t.to(self._trace.home) for t in flat.tensors]

    def _rebuild_output(self, tensors: list) -> Any:
        leaves = list(self._trace.out_leaves)
        for slot, t in zip(self._trace.out_tensor_slots, tensors):
            leaves[slot] = t
        return pytree.tree_unflatten(leaves, self._trace.out_spec)

    def __call__(self, *args, **kwargs) -> Any:
        return self._rebuild_output(self._trace.traced.run(self._flat_inputs(args, kwargs, at_home=True)))

    def split(self, k: int) -> "SplitGraph":
        """Cuts the IR into k convex pieces, contiguous in topological order."""
        return SplitGraph(self, self.ir.split(k))


class SplitGraph:
    """Pieces of a traced graph, run one after another."""

    def __init__(self, graph: TracedGraph, pieces: list):
        self._graph = graph
        self.pieces = pieces

    def __len__(self) -> int:
        return len(self.pieces)

    def __call__(self, *args, **kwargs) -> Any:
        g = self._graph
        outs = g._trace.traced.run_chained(self.pieces, g._flat_inputs(args, kwargs, at_home=True))
        return g._rebuild_output(outs)


def trace(model: torch.nn.Module, args: Any, kwargs: dict | None = None) -> TracedGraph:
    """Traces `model(*args, **kwargs)` into rannc's IR.

    `args` is a tuple of positional arguments (a single tensor is taken as one argument);
    arguments may be tensors, tuples, lists and dicts of tensors, or constants. The batch
    dimension is dimension 0 of the tensor arguments whose size matches the first one's
    (dimension 1 for sequence-first recurrent models: [Note: batch dimensions] in _trace.py).
    Raises rannc.TraceError when the model cannot be traced faithfully.
    """
    return TracedGraph(model, args if isinstance(args, tuple) else (args,), kwargs)


def load_ir(path: str) -> _C.IrGraph:
    """Reads an IR file written by TracedGraph.save_ir; raises rannc.SerializationError
    when the file is corrupt, truncated or of another version."""
    return _C.load_ir(path)
