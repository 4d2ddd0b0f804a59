"""Copies of a wrapped model that run on its plan: an EMA, SWA, a frozen reference model.

[Note: copies of a wrapped model] Training scripts copy the model they train:
torch.optim.swa_utils.AveragedModel and timm's ModelEmaV3 deep-copy it and average its
parameters into the copy after each step (zip over `parameters()`), RLHF keeps a frozen
reference copy, distillation a teacher. `copy.deepcopy` of a RaNNCModule gives a
PlanSharingCopy: the user's module copied on each rank as this rank holds it (the tensors
freed here stay empty: [Note: freed state] in placement.py), so an average updated from the
RaNNCModule's parameters is updated where each tensor lives, with no communication and no
memory beyond the copy of this rank's share. A call of the copy runs the RaNNCModule's
deployments with the copy's tensors swapped in for the call (`.data`: the stages hold the
same tensor objects, so nothing is copied), in the copy's mode (train, eval) and forward
only, as under torch.no_grad(): nobody backpropagates through an average, and its
parameters are not the optimizer's. A mode neither has run yet is deployed from the
RaNNCModule's own tensors first, as its own first call would.

Where a copy's value is current: on the ranks that train a tensor. The RaNNCModule's tensors on
the ranks that only evaluate them are stale between steps (before_eval refreshes them), so
an average updated there is wrong there; placement.viewing_copy() reads the copy as current
only where training updates it. Before an eval call after the copy changed (its tensors'
version counters, agreed over the ranks in the call's own all-gather), each such tensor goes
from its owner to the ranks that evaluate it, as the RaNNCModule's own before_eval does.
state_dict() gathers the copy's values from those owners; load_state_dict() (directly, or
through AveragedModel's) loads each rank's share of the whole state it is passed.

[Note: writes into a copy's state_dict] timm's ModelEmaV2 and YOLOv5's ModelEMA update the
average in place through the copy's state_dict() values (`ema_v.copy_(d * ema_v + (1 - d) *
model_v)`), which are views of the parameters in PyTorch. Here they are gathered copies, so
the average never moved, without a word. The tensors state_dict() last returned are kept
with their versions: before the copy is next used (a call, state_dict(), a save), those
written since are copied into the copy's own tensors where this rank holds their current
value (every rank runs the same update, so each owner writes its own share).

The copies follow the RaNNCModule's placement when a later mode is deployed (storage where
its new stages need it, with the owner's value; freed where no stage does); this is a
collective, so every rank must make the same copies, as every DDP rank keeps its own EMA
(checked there). The plan counts the copies made before the first call (one more copy of
each stage's parameters and buffers each, partition/cost/memory.h) and the option
model_copies; rank 0 warns of a copy made later beyond them.
"""
from __future__ import annotations

import copy as _copy
import contextlib
import types
import weakref

import torch

from . import _C, failure, handshake
from .optimizer_share import OptimizerShare
from .options import format_bytes

_COPY_CALL = "a copy's call"  # [Note: named collectives] in handshake.py


def _checkpoint():
    from .module import _checkpoint as checkpoint_module  # imported on first use there
    return checkpoint_module()


class PlanSharingCopy(torch.nn.Module):
    """copy.deepcopy of a RaNNCModule: `module` holds the copy's tensors (this rank's share)
    and its calls run on the RaNNCModule's plan ([Note: copies of a wrapped model])."""

    def __init__(self, source, module: torch.nn.Module, memo: dict):
        super().__init__()
        placement = source.placement
        lacking = placement.without_values()
        if lacking:
            raise _C.Error(
                f"copy.deepcopy of a RaNNCModule whose parameters have no values yet "
                f"({failure.some_of(lacking)}, built on the meta device): copy it after its "
                "first call or load_checkpoint, once every parameter has a value")
        _checkpoint().apply_pending(source)  # a checkpoint loaded before the first call
        with placement.own_access():
            self.module = _copy.deepcopy(module, memo)
        placement.strip_hooks(self.module)
        object.__setattr__(self, "_source", source)  # not a submodule: not our parameters
        # what each call walks, resolved once: the modules paired with the model's, the
        # batch norms among them, and (per trace) the state tensors paired with the model's
        self._module_pairs = list(zip(source.module.named_modules(), self.module.modules()))
        self._norms = [(name, m, c) for (name, m), c in self._module_pairs
                       if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
        self._resolved = None
        for t in self._tensors():
            t.grad = None  # the copy is never trained
        self._seen = None  # the tensors' versions when the ranks last shared them
        self._given = None  # state_dict()'s last values and their versions ([Note: writes
        #                     into a copy's state_dict])
        self._writes = 0  # train-mode calls and loads change tensors behind the versions
        placement.add_copy(self)
        self.gather_serial = handshake.register_source(self)  # [Note: gathers asked by some ranks]
        # hooks without a reference cycle: a copy is freed when its last user lets go, at
        # the same point on every rank (the ranks must agree on the copies that live)
        this = weakref.ref(self)
        self.module.register_forward_pre_hook(lambda m, _: this()._refuse_direct_call(m))
        self.register_load_state_dict_pre_hook(_load_share)
        self.register_load_state_dict_post_hook(_forget_freed_keys)
        counted = min((getattr(d, "model_copies", 0) for d in source._deployed.values()),
                      default=None)
        if _C.get_rank() == 0 and counted is not None and placement.copy_count() > counted:
            held = sum(t.numel() * t.element_size() for t in self._tensors())
            _C.log_warn(
                f"a copy of the model (copy.deepcopy: AveragedModel, an EMA) made after the "
                f"first call: rank 0 keeps {format_bytes(held)} more for it, which the plan did "
                f"not count; make copies before the first call, or pass the option "
                f"model_copies={placement.copy_count()}, for a plan that counts them")

    def __deepcopy__(self, memo):
        return PlanSharingCopy(self._source, self.module, memo)

    def __getstate__(self):
        raise _C.Error("a copy of a RaNNCModule cannot be pickled (torch.save(model)): save "
                       "its weights with state_dict() on every rank")

    # ---- calls ------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        self._write_back()
        mode = self.module.training
        self._check_traced_attributes()
        self._say_forward_only(mode)
        with _modes_from(self._module_pairs):
            return self._source._call(mode, _COPY_CALL, args, kwargs, copy=self)

    def _say_forward_only(self, mode: bool) -> None:
        """A copy trained as a second model (its loss's backward) met torch's "element 0 of
        tensors does not require grad" without a word of why: rank 0 says so once, where a
        copy with trainable parameters is called in training mode with gradients on."""
        if (self.__dict__.get("_said_forward_only") or not mode or not torch.is_grad_enabled()
                or not any(p.requires_grad for p in self.module.parameters())):
            return
        self.__dict__["_said_forward_only"] = True
        if _C.get_rank() == 0:
            _C.log_warn("a copy of a RaNNCModule (copy.deepcopy) runs forward only: its outputs "
                        "carry no gradient, so a backward through them trains nothing. To train "
                        "a second model, wrap a fresh one in a RaNNCModule of its own; call a "
                        "reference or teacher copy under torch.no_grad() ([Note: copies of a "
                        "wrapped model] in copies.py)")

    def _check_traced_attributes(self):
        """The copy runs the model's traces, which baked in its modules' attributes: a
        batch norm's momentum set otherwise on the copy (torch.optim.swa_utils.update_bn
        sets None, a cumulative average) would be ignored without a word."""
        for name, m, c in self._norms:
            if getattr(c, "momentum", None) != m.momentum:
                raise _C.Error(
                    f"the copy's batch norm {name} has momentum {c.momentum}, the model's "
                    f"{m.momentum}: a copy runs the model's traced graph, which holds the "
                    "model's momentum (torch.optim.swa_utils.update_bn on a copy is not "
                    "supported: recompute the statistics with the model's own calls)")

    def changed(self) -> bool:
        """Whether this rank's tensors of the copy changed since the ranks last shared them
        (an average updated, a load, a call in train mode)."""
        return self._versions() != self._seen

    def run(self, deployed, call, args, kwargs):
        """Runs the agreed `call` on `deployed` (the RaNNCModule's, of this copy's mode) with
        the copy's tensors, forward only."""
        # new shapes are traced as the module's own call would (a variant that training
        # runs later is traced with gradients); at shapes where the model is another program,
        # an error ([Note: programs at other shapes] in module.py)
        target = deployed.variant(call, args, kwargs, new_programs=False)
        writes = call.flagged or self.module.training  # a share, batch-norm statistics
        with self._as_model(writes), torch.no_grad():
            if call.flagged and not self.module.training:
                # the owners' values to the ranks that evaluate
                self._source.placement.before_eval()
            if call.flagged:
                self._seen = self._versions()
            out = target._run(call.local, call.flat, call.rows)
        if self.module.training:
            self._writes += 1  # batch-norm statistics, updated behind the versions
        return out

    # ---- state ------------------------------------------------------------------------------
    def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
        """The copy's full state under the model's names on every rank (a collective), as
        the RaNNCModule's state_dict() gathers its own."""
        handshake.gather("state_dict()", self)
        out = self._gather_state(*args, destination=destination, prefix=prefix,
                                 keep_vars=keep_vars)
        self._given = (prefix, out, {k: v._version for k, v in out.items()
                                     if isinstance(v, torch.Tensor)})
        return out

    def _gather_state(self, *args, keep=True, **kwargs):
        from . import full_state
        self._write_back()
        with self._as_model(writes=False):
            return full_state.gather_state_dict(self._source, *args, keep=keep, **kwargs)

    def _write_back(self) -> None:
        """[Note: writes into a copy's state_dict]: what was written into the values
        state_dict() last returned goes into the copy's tensors this rank holds current."""
        if self._given is None:
            return
        prefix, values, versions = self._given
        self._given = None
        written = {k for k, v in values.items() if isinstance(v, torch.Tensor)
                   and k in versions and v._version != versions[k]}
        if not written:
            return
        names = self._source.placement._trace_state.names
        with self._as_model(writes=False):
            sources = self._source.placement.sources()
        rank = _C.get_rank()
        with torch.no_grad():
            for name, t, (_, current) in zip(names, self._tensors(), sources):
                v = values.get(prefix + name)
                if (prefix + name in written and rank in current and t.numel()
                        and v.numel() == t.numel()):
                    t.copy_(v.reshape(t.shape))

    def serve_gather(self, what: str, part: int = 0) -> None:
        """Takes part in a gather of the copy's state that other ranks asked for
        ([Note: gathers asked by some ranks] in handshake.py)."""
        self._gather_state(keep=False)

    def save_checkpoint(self, directory: str, extra=None) -> None:
        """The copy's weights as a sharded checkpoint in `directory` (a collective), as the
        RaNNCModule's save_checkpoint writes its own but without optimizer state: the
        average of a model is a model checkpoint (transformers' from_pretrained reads it)."""
        source = self._source
        handshake.enter("save_checkpoint()")  # [Note: named collectives]
        self._write_back()
        weights_only = types.SimpleNamespace(placement=source.placement, module=source.module,
                                             optimizer=None, optimizer_share=OptimizerShare([]),
                                             deployments=source.deployments)
        with self._as_model(writes=False):
            _checkpoint().save_checkpoint(weights_only, directory, extra)

    def load_checkpoint(self, path: str, strict: bool = True) -> None:
        """Reads the weights of a checkpoint (save_checkpoint's, a Hugging Face directory or
        a state_dict file) into the copy; each rank reads its share (a collective)."""
        handshake.enter("load_checkpoint()")
        self._given = None  # what the load reads replaces what was written into them
        with self._as_model(writes=True):
            _checkpoint().load_weights(self._source, path, strict)
        self._writes += 1

    def _refuse_direct_call(self, module):
        freed = self._freed_keys()
        if freed:
            raise _C.Error(
                f"{type(module).__name__} inside a copy of a RaNNCModule called directly on "
                f"rank {_C.get_rank()}: this rank keeps only its stages' share of the copy "
                f"(not {failure.some_of(freed)}). Call the copy itself (AveragedModel's "
                "forward does), on every rank")

    # ---- helpers ----------------------------------------------------------------------------
    def _tensors(self) -> list[torch.Tensor]:
        return self._state_pairs()[1]

    def _state_pairs(self) -> tuple[list, list]:
        """The model's state tensors and the copy's, in trace order (resolved by name once
        per trace state: the same objects until a mode is deployed)."""
        placement = self._source.placement
        if self._resolved is None or self._resolved[0] is not placement._trace_state:
            self._resolved = (placement._trace_state, placement.tensors(),
                              placement.tensors_of(self.module))
        return self._resolved[1], self._resolved[2]

    def _freed_keys(self) -> list[str]:
        """The names in the copied module's state_dict of the tensors freed on this rank
        (every name of a tied one)."""
        freed = self._source.placement.freed()
        ids = {id(t) for i, t in enumerate(self._tensors()) if i in freed}
        return [k for k, v in self.module.state_dict(keep_vars=True).items() if id(v) in ids]

    def _versions(self) -> tuple:
        return (self._writes,) + tuple(t._version for t in self._tensors())

    @contextlib.contextmanager
    def _as_model(self, writes: bool):
        """The RaNNCModule's state tensors hold the copy's storage (on their device) while
        the block runs, and the placement reads them as a copy's (current where trained);
        what the block `writes` there stays the copy's (a copy the user moved to another
        device, as AveragedModel(model, device="cpu") does, is copied to the stages' device
        and, if the block `writes`, back)."""
        own, mine = self._state_pairs()
        kept = [t.data for t in own]
        for t, c in zip(own, mine):
            t.data = c.data if c.device == t.device else c.data.to(t.device)
        try:
            with self._source.placement.viewing_copy():
                yield
        finally:
            for t, c, before in zip(own, mine, kept):
                # on the same device the block wrote into the copy's storage itself (the
                # stages and the transfers write in place)
                if writes and c.device != t.device:
                    c.data = t.data.to(c.device)
                t.data = before


def _load_share(copy: PlanSharingCopy, state_dict, prefix, *_):
    """Load pre-hook (also under AveragedModel's load_state_dict): every rank is passed the
    whole state under the model's names, as state_dict() gives it, and loads what it holds;
    the tensors freed here are left out."""
    copy._given = None  # what is loaded replaces what was written into state_dict()'s values
    for key in copy.module.state_dict(keep_vars=True):
        if prefix + key in state_dict and prefix + "module." + key not in state_dict:
            state_dict[prefix + "module." + key] = state_dict.pop(prefix + key)
    freed = {prefix + "module." + k for k in copy._freed_keys()}
    for key in freed:
        state_dict.pop(key, None)
    copy._loading_freed = freed


def _forget_freed_keys(copy: PlanSharingCopy, incompatible):
    """Load post-hook: the keys left out above are not missing."""
    for key in copy.__dict__.pop("_loading_freed", ()):
        if key in incompatible.missing_keys:
            incompatible.missing_keys.remove(key)


@contextlib.contextmanager
def _modes_from(pairs):
    """The model's submodules in the train/eval mode of the copy's (`pairs`: ((name,
    model's), copy's)) for the block: its traces and runs of the copy's calls see the
    copy's modes (each submodule's own)."""
    changed = [m for (_, m), c in pairs if m.training != c.training]
    for m in changed:
        m.training = not m.training
    try:
        yield
    finally:
        for m in changed:
            m.training = not m.training
