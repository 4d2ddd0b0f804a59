"""The user's optimizer, cut down to the parameters this rank's training stage updates.

The optimizer object stays the user's (its step, zero_grad, hyperparameters and schedulers
work as before); once training is deployed its param groups hold only this rank's
parameters (the same tensor objects) and the state of the others is dropped. Parameters
outside the module (a learnt temperature the loss outside the model uses) stay in every
rank's groups: they are the user's, as under DDP (before session 31 the cut dropped them,
and they never trained). The groups as
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

[Note: optimizers made anew] A script that builds a new optimizer over the same parameters
(a second fine-tuning phase with a fresh AdamW, or SGD after AdamW) means the old one no
longer steps them: the new one replaces every earlier optimizer whose parameters it all
holds. Before, the old one stayed the module's first, so the new one's state_dict() gave
the old one's state (a resume from it went wrong without a word), and it kept the old
state's memory alive.

[Note: the optimizer's own state_dict] Once its groups are cut, the optimizer's own
state_dict() would number this rank's share from 0: a file that loads into nothing (DDP's
`torch.save(optimizer.state_dict(), p)` on rank 0, transformers' Trainer checkpoints and
accelerate's save_state all write it). So a module's optimizer gets two torch hooks: its
state_dict() gives the whole optimizer's state as the user built it (the module's
optimizer_state_dict(): a gather, which rank 0 may ask alone, [Note: gathers asked by some
ranks] in handshake.py), and its load_state_dict() takes such a whole state (from any world
size, or a plain optimizer) and loads this rank's share of it. rannc's own loads of a share
pass under `loading_share()`.

[Note: several optimizers] Parameters of different kinds may step with different
optimizers: Muon for the hidden matrices and AdamW for embeddings, norms and biases (torch's
own advice for Muon), or another learning rule per part. `RaNNCModule(model, [muon, adamw])`
takes them all, and an optimizer built after wrapping over some of the model's parameters is
added at its first step, as the first one would be adopted. Each is cut to this rank's share;
each one's own state_dict() gives its whole state (DDP's `torch.save({"muon":
muon.state_dict(), "adamw": adamw.state_dict()})` on rank 0, which the other ranks serve: the
gather names which optimizer), and its load_state_dict() loads its share. Checkpoints and
the module's optimizer_state_dict() take their groups one after another, as one optimizer's;
the plan counts the largest state among them. (Before, a second optimizer kept its groups
whole, each rank stepping its own parameters right, but its state_dict() held this rank's
share only: a checkpoint saved on rank 0 resumed the others' parameters from no state.)
"""
from __future__ import annotations

import contextlib

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from . import _C, failure, handshake, registry


# [Note: optimizers rannc cannot share] rannc keeps each parameter's optimizer state on the
# ranks that keep the parameter, through the optimizer's own hooks and param_groups. Two
# kinds of optimizer cannot be shared so, and both failed far from their cause:
# torch.distributed's ZeroRedundancyOptimizer shards the state over the torch.distributed
# ranks itself (on one stage its consolidated state_dict() lost 4 of 20 entries and mixed up
# 8, without a word; on two stages its broadcast of parameters a rank does not keep aborted
# every rank in gloo), and an optimizer subclass that never ran Optimizer.__init__ (a
# Lookahead wrapper sharing its inner optimizer's param_groups) has none of the hooks
# (an AttributeError from torch's register_state_dict_post_hook).
def _refuse_unfit(optimizer) -> None:
    name = type(optimizer).__name__
    try:
        from torch.distributed.optim import ZeroRedundancyOptimizer
    except ImportError:  # torch built without distributed
        ZeroRedundancyOptimizer = ()
    if ZeroRedundancyOptimizer and isinstance(optimizer, ZeroRedundancyOptimizer):
        raise _C.Error(
            f"{name} shards the optimizer state over the torch.distributed ranks, which rannc "
            "does itself: each rank keeps the state of the parameters it keeps. Pass the "
            "optimizer it wraps (ZeroRedundancyOptimizer(params, optimizer_class=AdamW, ...): "
            "AdamW(params, ...)) ([Note: optimizers rannc cannot share] in optimizer_share.py)")
    if isinstance(optimizer, torch.optim.Optimizer) and not hasattr(
            optimizer, "_optimizer_state_dict_post_hooks"):
        raise _C.Error(
            f"{name} subclasses torch.optim.Optimizer without running Optimizer.__init__ (a "
            "wrapper sharing another optimizer's param_groups, as Lookahead implementations "
            "do): rannc needs the hooks that __init__ makes. Pass the optimizer it wraps to "
            f"RaNNCModule and step the {name} in the loop, or call super().__init__(params, "
            "defaults) in it ([Note: optimizers rannc cannot share] in optimizer_share.py)")


class OptimizerShare:
    """The module's optimizers (usually one; several where parameters of different kinds
    step differently, as Muon for the matrices and AdamW for the rest: [Note: several
    optimizers]), each cut to this rank's share. Seen together, their param groups follow
    one another in the order the optimizers were given, as one optimizer's would: the
    format of rannc's optimizer_state_dict() and of checkpoints."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = []
        self._original = None  # per optimizer, per group: (params, param_names or None)
        self._loading_share = False
        self._check_state = False
        for optimizer in optimizers:
            self.add(optimizer)

    def add(self, optimizer: torch.optim.Optimizer) -> None:
        """Adds `optimizer` (cut by the next cut()). An optimizer it holds every parameter
        of is replaced ([Note: optimizers made anew])."""
        _refuse_unfit(optimizer)
        held = {id(p) for params, _ in _groups_of(optimizer) for p in params}
        for i in reversed(range(len(self.optimizers))):
            params = [p for g, _ in (self._original[i] if self._original is not None
                                     else _groups_of(self.optimizers[i])) for p in g]
            if params and all(id(p) in held for p in params):
                del self.optimizers[i]
                if self._original is not None:
                    del self._original[i]
        self.optimizers.append(optimizer)
        if self._original is not None:
            self._original.append(_groups_of(optimizer))
        if not getattr(optimizer, "_rannc_whole_state", False):
            optimizer._rannc_whole_state = True  # [Note: the optimizer's own state_dict]
            optimizer.register_state_dict_post_hook(_whole_state)
            optimizer.register_load_state_dict_pre_hook(_share_of_whole_state)

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The first optimizer (None without any)."""
        return self.optimizers[0] if self.optimizers else None

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

    def _chosen(self, optimizer) -> list[int]:
        """The positions of the optimizers meant: all (None) or `optimizer`."""
        if optimizer is None:
            return list(range(len(self.optimizers)))
        return [next(i for i, o in enumerate(self.optimizers) if o is optimizer)]

    def original_groups(self, optimizer=None) -> list[tuple[list[torch.Tensor], list[str] | None]]:
        """Per param group of every optimizer (or of `optimizer`), one after another: (its
        parameters, its param_names or None) as the user built it."""
        self.new_groups()
        return [g for i in self._chosen(optimizer)
                for g in (self._original[i] if self._original is not None
                          else _groups_of(self.optimizers[i]))]

    def groups(self, optimizer=None) -> list[dict]:
        """The live param groups of every optimizer (or of `optimizer`), one after another."""
        return [g for i in self._chosen(optimizer) for g in self.optimizers[i].param_groups]

    def state(self, param: torch.Tensor) -> dict | None:
        """The optimizer state of `param` (in whichever optimizer holds it), or None."""
        for optimizer in self.optimizers:
            state = optimizer.state.get(param)
            if state:
                return state
        return None

    def load(self, local: dict, optimizer=None) -> None:
        """Loads `local`, a state in torch's format over groups() (of every optimizer, or of
        `optimizer`), as this rank's share: each optimizer its groups' part."""
        start = 0
        with self.loading_share():  # [Note: the optimizer's own state_dict]
            for i in self._chosen(optimizer):
                o = self.optimizers[i]
                part = local["param_groups"][start:start + len(o.param_groups)]
                ids = {j for g in part for j in g["params"]}
                o.load_state_dict({"state": {j: v for j, v in local["state"].items() if j in ids},
                                   "param_groups": part})
                start += len(o.param_groups)

    def new_groups(self) -> bool:
        """Takes the groups added to an optimizer since it was cut (add_param_group, as a
        script unfreezing a layer adds its parameters) as the user's; whether there were
        any. cut() cuts them next."""
        if self._original is None:
            return False
        added = False
        for optimizer, original in zip(self.optimizers, self._original):
            if len(optimizer.param_groups) > len(original):
                original += _groups_of(optimizer)[len(original):]
                added = True
        return added

    def cut(self, elsewhere: set[int]) -> None:
        """Cuts the parameters whose id() is in `elsewhere` (the module's that other ranks
        train) out of every group, keeping the others in the user's order, and drops their
        state. Called again when a training call with other arguments than the first trains
        parameters first ([Note: other training arguments] in module.py), or an optimizer
        or a group is added: the groups are cut anew from the user's."""
        if self._original is None:
            self._original = [_groups_of(o) for o in self.optimizers]
        self._check_state = True  # at the next step, once the kept parameters have storage
        for optimizer, original in zip(self.optimizers, self._original):
            for group, (params, names) in zip(optimizer.param_groups, original):
                keep = [id(p) not in elsewhere for p in params]
                group["params"] = GroupShare([p for p, k in zip(params, keep) if k], params)
                if names is not None:
                    group["param_names"] = [n for n, k in zip(names, keep) if k]
                for p, k in zip(params, keep):
                    if not k:
                        optimizer.state.pop(p, None)


class GroupShare(list):
    """A param group's parameters cut to this rank's share, holding the group as the user
    built it in `whole`. [Note: clipping a param group] A loop that clips each group by its
    own norm, `for g in optimizer.param_groups: clip_grad_norm_(g["params"], 1.0)`, means the
    whole group on every rank; given only the share, a rank whose share of a group is empty
    clipped by torch's function and joined no collective, so the ranks' collectives paired
    one group with another and both were clipped by a wrong norm without a word. Optimizers
    see a list; clip_grad_norm_ reads `whole`."""

    def __init__(self, share, whole):
        super().__init__(share)
        self.whole = list(whole)


def _state_made_on_empty(optimizer) -> None:
    """[Note: state made on freed parameters] Adagrad makes its state in __init__, of each
    parameter's shape. Built after an eval call (Trainer's `evaluate(); train()` with
    optim="adagrad"), it saw this rank's freed parameters, empty, and its step failed once
    training gave them storage ("The size of tensor a (0) must match ..."). Such state is
    made again as a fresh optimizer of the same type and group settings makes it (none
    where it makes none)."""
    for group in optimizer.param_groups:
        # empty state beside a parameter with storage (LBFGS keeps flat vectors of another
        # shape in its first parameter's state: they are its own)
        stale = [p for p in group["params"] if p.numel() and any(
            isinstance(v, torch.Tensor) and v.dim() and v.numel() == 0
            for v in optimizer.state.get(p, {}).values())]
        if not stale:
            continue
        settings = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        try:
            fresh = type(optimizer)(stale, **settings).state
        except Exception:
            fresh = {}
        for p in stale:
            if p in fresh:
                optimizer.state[p] = fresh[p]
            else:
                optimizer.state.pop(p, None)


def _groups_of(optimizer) -> list[tuple[list[torch.Tensor], list[str] | None]]:
    return [(list(g["params"]), None if g.get("param_names") is None else list(g["param_names"]))
            for g in optimizer.param_groups]


def _owner(optimizer):
    """The module whose cut optimizer this is, or None (not yet cut: torch's own state)."""
    for module in registry.modules():
        share = module.optimizer_share
        if share.patched and any(o is optimizer for o in share.optimizers):
            return module
    return None


def _whole_state(optimizer, state_dict):
    """[Note: the optimizer's own state_dict]"""
    module = _owner(optimizer)
    return None if module is None else module.optimizer_state_dict(optimizer)


def _share_of_whole_state(optimizer, state_dict):
    """[Note: the optimizer's own state_dict]"""
    module = _owner(optimizer)
    if module is None or module.optimizer_share._loading_share:
        return None
    return module.share_of_optimizer_state(state_dict, optimizer)


def _before_step(optimizer, args, kwargs):
    """A global step pre-hook: an optimizer over a trained module's parameters that is not
    the module's becomes one of its optimizers ([Note: optimizers made after wrapping],
    [Note: several optimizers]); a group added to a module's optimizer is cut to this
    rank's share."""
    for module in registry.modules():
        share = module.optimizer_share
        if any(o is optimizer for o in share.optimizers):
            if share.new_groups():
                share.cut(module.placement.optimized_elsewhere())
        elif module._deployed.get(True) is not None and registry.holds(optimizer, module):
            module.adopt_optimizer(optimizer)
        if any(o is optimizer for o in share.optimizers) and module._deployed.get(True) is not None:
            average_outside_gradients(module, entered=True)  # [Note: a step is a collective]
            # the step updates the trainers' values: an eval call since the backward gave
            # the ranks that only evaluate a tensor the values before it
            module.placement.trained()
        if share._check_state:  # [Note: state made on freed parameters]
            share._check_state = False
            for o in share.optimizers:
                _state_made_on_empty(o)
    return None


# [Note: a step is a collective] A rank that reads the state alone between backward and
# step (`if rank == 0: log(model.state_dict())`) is served by the others at their next
# collective ([Note: gathers asked by some ranks] in handshake.py); that was the next
# training call, after their own step, so rank 0 got its own parameters before the update
# and the others' after it. The step of a module's optimizer is a named collective (one
# small all-gather, which the averaging below carries where it runs), so a gather asked
# before it is served with every rank's values before the update, as DDP's rank would
# read its own.
#
# [Note: gradients made outside] A parameter that no stage uses yet has a gradient was
# computed with outside the module: inputs_embeds made from the model's own embedding
# (FreeLB, soft prompts), a penalty on a weight. Each rank's gradient of it is its own, as a
# DistributedDataParallel rank's is before DDP averages it: the gradients of the module's
# inputs are each rank's as if its loss were its own rows' mean (DDP's), and a penalty
# every rank computes alike is whole on each. So, as DDP, the step first averages those
# gradients over the ranks (a parameter without one on a rank counts as zero there, as
# DDP's unused parameters); before, the copies drifted apart without a word (an embedding
# 7.6e-3 off after 3 steps). Rank 0 says so once per module. clip_grad_norm_ averages them
# first too, and counts and scales them (averaging again at the step changes nothing).
def average_outside_gradients(module, what: str = "optimizer.step()", entered: bool = False) -> None:
    """`entered`: `what` is a named collective whatever the parameters ([Note: a step is a
    collective])."""
    world = _C.get_world_size()
    if world == 1:
        return
    params = [(n, p) for n, p in module.placement.unused_parameters() if p.requires_grad]
    if not params:  # the same on every rank: the placement is
        if entered:
            handshake.enter(what)
        return
    # every rank is here; most such parameters have no gradient anywhere (a pooler that a
    # masked language model never runs): then this all-gather is all
    mine = torch.tensor([float(any(p.grad is not None for _, p in params))])
    if not handshake.exchange(what, mine).any():
        return
    comm = _C.Communicator.world_cpu()
    has = torch.tensor([float(p.grad is not None) for _, p in params], dtype=torch.float64)
    comm.all_reduce(has).wait()
    present = [p for (_, p), h in zip(params, has.tolist()) if h > 0]
    if not present:
        return
    flat = torch.cat([(p.grad.detach() if p.grad is not None else torch.zeros_like(p))
                      .reshape(-1).to("cpu", torch.float64) for p in present])
    comm.all_reduce(flat).wait()
    flat /= world
    offset = 0
    for p in present:
        mean = flat[offset:offset + p.numel()].view_as(p).to(p.device, p.dtype)
        offset += p.numel()
        if p.grad is None:
            p.grad = mean
        else:
            p.grad.copy_(mean)
    if not module._said_outside_gradients and _C.get_rank() == 0:
        module._said_outside_gradients = True
        names = [n for (n, _), h in zip(params, has.tolist()) if h > 0]
        _C.log_info(f"{failure.some_of(names)}: no stage uses "
                    f"{'them' if len(names) > 1 else 'it'}, and the script computes with "
                    f"{'them' if len(names) > 1 else 'it'} outside the module (inputs_embeds "
                    "made from the model's own embedding, a penalty): each step averages "
                    f"{'their' if len(names) > 1 else 'its'} gradient over the ranks first, as "
                    "DistributedDataParallel does ([Note: gradients made outside] in "
                    "optimizer_share.py)")


def built_over(module) -> list[torch.optim.Optimizer]:
    """The live optimizers that hold any of `module`'s parameters, by a walk over the objects
    the garbage collector tracks ([Note: optimizers made after wrapping])."""
    import gc
    return [o for o in gc.get_objects()
            if issubclass(type(o), torch.optim.Optimizer) and registry.holds(o, module)]


def install() -> None:
    register_optimizer_step_pre_hook(_before_step)
