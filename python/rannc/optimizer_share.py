"""The user's optimizer, cut down to the parameters this rank's training stage updates.

The optimizer object stays the user's (its step, zero_grad, hyperparameters and schedulers
work as before); once training is deployed its param groups hold only this rank's
parameters (the same tensor objects) and the state of the others is dropped. The groups as
the user built them are remembered: checkpoints and optimizer_state_dict() name and number
parameters as the original optimizer did.

[Note: optimizers made after wrapping] DistributedDataParallel's habit is to wrap first and
build the optimizer over the wrapper's parameters:

    model = rannc.RaNNCModule(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

Training is right either way (a freed parameter has no gradient, and torch's optimizers skip
it), but a RaNNCModule without its optimizer cannot save or gather the optimizer's state, and
the optimizer would keep its groups whole. So `import rannc` registers a global step
pre-hook (torch.optim.optimizer.register_optimizer_step_pre_hook): the first step of an
optimizer that holds a trained RaNNCModule's parameters, when that module has none, makes it
the module's optimizer, as if it had been passed (its groups are cut to this rank's share
before its first state exists). Its state must be in the plan's memory (Adam: two values per
parameter): torch keeps no registry of optimizers, so the first training call, which plans,
looks for one among the live objects (`built_over`: transformers' Trainer builds its AdamW
before the first forward) and plans for the largest state found; an optimizer built after
that call was not counted, and rank 0 warns when it is adopted.

[Note: the optimizer's own state_dict] Once its groups are cut, the optimizer's own
state_dict() would number this rank's share from 0: a file that loads into nothing (DDP's
`torch.save(optimizer.state_dict(), p)` on rank 0, transformers' Trainer checkpoints and
accelerate's save_state all write it). So a module's optimizer gets two torch hooks: its
state_dict() gives the whole optimizer's state as the user built it (the module's
optimizer_state_dict(): a gather, which rank 0 may ask alone, [Note: gathers asked by some
ranks] in handshake.py), and its load_state_dict() takes such a whole state (from any world
size, or a plain optimizer) and loads this rank's share of it. rannc's own loads of a share
pass under `loading_share()`.
"""
from __future__ import annotations

import contextlib

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from . import registry


class OptimizerShare:
    def __init__(self, optimizer: torch.optim.Optimizer | None):
        self.optimizer = optimizer
        self._original = None  # per group: (params, param_names or None), before patching
        self._loading_share = False
        if optimizer is not None and not getattr(optimizer, "_rannc_whole_state", False):
            optimizer._rannc_whole_state = True  # [Note: the optimizer's own state_dict]
            optimizer.register_state_dict_post_hook(_whole_state)
            optimizer.register_load_state_dict_pre_hook(_share_of_whole_state)

    @contextlib.contextmanager
    def loading_share(self):
        """optimizer.load_state_dict() inside loads this rank's share as given."""
        self._loading_share = True
        try:
            yield
        finally:
            self._loading_share = False

    @property
    def patched(self) -> bool:
        """Whether the groups hold only this rank's parameters (training is deployed)."""
        return self._original is not None

    def original_groups(self) -> list[tuple[list[torch.Tensor], list[str] | None]]:
        """Per param group: (its parameters, its param_names or None) as the user built it."""
        if self._original is not None:
            return self._original
        return [(list(g["params"]), None if g.get("param_names") is None else list(g["param_names"]))
                for g in self.optimizer.param_groups]

    def keep(self, own: set[int]) -> None:
        """Cuts every group down to the parameters whose id() is in `own`, in the user's
        order, and drops the others' state. Called again when a training call with other
        arguments than the first trains parameters first ([Note: other training arguments]
        in module.py): the groups are cut anew from the user's."""
        if self.optimizer is None:
            return
        if self._original is None:
            self._original = [(list(g["params"]), None if g.get("param_names") is None
                               else list(g["param_names"]))
                              for g in self.optimizer.param_groups]
        for group, (params, names) in zip(self.optimizer.param_groups, self._original):
            keep = [id(p) in own for p in params]
            group["params"] = [p for p, k in zip(params, keep) if k]
            if names is not None:
                group["param_names"] = [n for n, k in zip(names, keep) if k]
            for p, k in zip(params, keep):
                if not k:
                    self.optimizer.state.pop(p, None)


def _owner(optimizer):
    """The module whose cut optimizer this is, or None (not yet cut: torch's own state)."""
    for module in registry.modules():
        if module.optimizer is optimizer and module.optimizer_share.patched:
            return module
    return None


def _whole_state(optimizer, state_dict):
    """[Note: the optimizer's own state_dict]"""
    module = _owner(optimizer)
    return None if module is None else module.optimizer_state_dict()


def _share_of_whole_state(optimizer, state_dict):
    """[Note: the optimizer's own state_dict]"""
    module = _owner(optimizer)
    if module is None or module.optimizer_share._loading_share:
        return None
    return module.share_of_optimizer_state(state_dict)


def _adopt_on_first_step(optimizer, args, kwargs):
    """[Note: optimizers made after wrapping]"""
    for module in registry.modules():
        if (module.optimizer is None and module._deployed.get(True) is not None
                and registry.holds(optimizer, module)):
            module.adopt_optimizer(optimizer)
    return None


def built_over(module) -> list[torch.optim.Optimizer]:
    """The live optimizers that hold any of `module`'s parameters, by a walk over the objects
    the garbage collector tracks ([Note: optimizers made after wrapping])."""
    import gc
    return [o for o in gc.get_objects()
            if issubclass(type(o), torch.optim.Optimizer) and registry.holds(o, module)]


def install() -> None:
    register_optimizer_step_pre_hook(_adopt_on_first_step)
