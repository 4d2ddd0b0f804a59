"""Where each parameter and buffer of the user's module lives across the ranks.

[Note: freed state] A rank keeps real storage only for the parameters and buffers that its
stage of some deployed mode (train, eval) uses; the module's other state tensors are empty
(numel 0, same objects; their full shapes are kept here). Every rank computes the same
placement from the plans, so the copies below need no negotiation. A tensor's owner, which
holds its current value, is the first rank whose training stage updates it (else the first
rank keeping it). Tracing new input shapes or a new mode needs
no rank to hold the whole model: parameters are traced as stand-ins ([Note: stand-in
parameters] in _trace.py) and only the buffers are gathered for it. A tensor that a new
mode's stage uses on a rank that freed it gets storage there and its owner's value.

[Note: models built on the meta device] A model built with its parameters on the meta
device (`rannc.empty_weights()`) has them swapped for empty tensors when it is wrapped
(torch.utils.swap_tensors: the same Python objects, which the optimizer holds), as if
freed on every rank; it is traced and profiled with stand-ins, and each rank allocates
only the parameters its stages keep. Their values come from a checkpoint loaded
before the first call (`load_checkpoint` or `load_state_dict`, read once the plan is
known; until then state_dict() and save_checkpoint are refused: nothing has a value); a
parameter that no stage uses is kept on every rank, as one built with a value is; the
parameters no checkpoint filled are initialised by their modules' `reset_parameters()` (as FSDP does
for meta modules; `_reset_parameters()` where that is all there is, as in
nn.MultiheadAttention), children before parents as their constructors ran, each module
from a seed of its name and rank 0's seed, so replicas agree; a parameter left without a
value is an error on every rank that names it.

[Note: placement] Tracing runs the whole model where the user keeps it (`home`); each rank
then moves its stages' parameters and buffers to its device (the same tensor objects, so
the optimizer's references stay valid).
"""
from __future__ import annotations

import contextlib
import contextvars
import weakref
import zlib

import torch

from . import _C, failure
from ._trace import RUNNING_FORWARD, ModelState, stand_ins, state_for_tracing
from .transport import all_gather_objects, recv_staged, send_staged

# Tag of the point-to-point copies of parameters and buffers between ranks.
_STATE_TAG = 7

# rannc's own reads and loads of the module's state, which know what each rank holds
# ([Note: the module's own state_dict]).
_OWN_ACCESS = contextvars.ContextVar("rannc_own_state_access", default=False)


# [Note: tensors assigned after the first call] The stages run the tensors they were
# deployed with. A parameter, buffer or submodule assigned to the model after its first
# call (`model.module.scale = torch.tensor(3.0)`, a head re-made as `m.head = nn.Linear(..)`,
# register_buffer of a new name, load_state_dict(..., assign=True)) reached no stage: the
# steps ran the old tensors, and state_dict() returned the new, never-trained ones (loss
# 1.15 for 5.45 on a probe), without a word. Such an assignment is refused where it is
# made, before it changes the module, naming the tensor and the cure: write the value in
# place, or assign before wrapping. rannc's own runs of the forward (tracing, which may
# build a cache as a buffer, put back after) and its own loads pass.
_PLACED = weakref.WeakKeyDictionary()  # each submodule of a wrapped model -> its placement
_assignment_hooks = []


def _refuse_assignment(kind: str):
    def hook(module, name, value):
        placement = _PLACED.get(module)
        placement = placement() if placement is not None else None
        if (placement is None or not placement._users or _OWN_ACCESS.get()
                or RUNNING_FORWARD.get() or torch.jit.is_tracing()):
            return None
        placement.refuse_assignment(module, name, value, kind)
        return None
    return hook


def _watch_assignments(module: torch.nn.Module, placement) -> None:
    if not _assignment_hooks:
        nn_module = torch.nn.modules.module
        _assignment_hooks.extend([
            nn_module.register_module_parameter_registration_hook(_refuse_assignment("parameter")),
            nn_module.register_module_buffer_registration_hook(_refuse_assignment("buffer")),
            nn_module.register_module_module_registration_hook(_refuse_assignment("submodule"))])
    for m in module.modules():
        _PLACED[m] = weakref.ref(placement)


@contextlib.contextmanager
def _own_access():
    token = _OWN_ACCESS.set(True)
    try:
        yield
    finally:
        _OWN_ACCESS.reset(token)


class StatePlacement:
    """The module's state tensors (parameters and buffers in trace order) and, per tensor,
    which ranks use it, which hold its current value, and whether this rank holds it."""

    def __init__(self, module: torch.nn.Module, home: torch.device, device: torch.device,
                 optimizer_share=None):
        self.module, self.home, self.device = module, home, device
        self.optimizer_share = optimizer_share  # the optimizers' state moves with the parameters
        # mode (or (mode, arguments): [Note: other arguments] in module.py) -> per state
        # tensor, the ranks whose stage uses it
        self._users = {}
        # per state tensor, the ranks that train it (hold its gradient, optimizer state and,
        # after a step, its current value): the first training call's stages, else the first
        # training call with other arguments that uses it ([Note: other training arguments])
        self._trainers = None
        self._freed = {}      # state tensor position -> its full shape, for tensors freed here
        self._unset = set()   # positions allocated here without a value yet (built on meta)
        self._stale = False   # trained since the ranks that only evaluate a tensor got it
        self._copies = []     # weak references to the PlanSharingCopy objects of the module
        self._copy_view = False  # reading a copy's values: current only where trained
        # (position, first user, other users) of the buffers a training forward writes that
        # several ranks use ([Note: buffers of replicas])
        self._buffer_routes = None
        self._unused = None  # unused_parameters(), once deployed
        # the state's names in trace order, resolved on the module (the trace's once deployed)
        self._trace_state = ModelState.of(module)
        self._meta_built = self._empty_meta_parameters()
        # (functions, not bound methods: torch marks its hooks with an attribute)
        def check_call(*_):
            self._check_users_call()
        check_call.__rannc__ = True  # not the user's hook ([Note: hooks] in _trace.py)
        self._hooks = [
            module.register_state_dict_post_hook(lambda *_: self._check_users_state_dict()),
            module.register_load_state_dict_pre_hook(lambda *_: self._check_users_load()),
            module.register_forward_pre_hook(check_call)]
        _watch_assignments(module, self)  # [Note: tensors assigned after the first call]
        # a submodule called directly (`model.module.net(x)`, a sampling method of the
        # model): (its name, the handle of its check)
        self._part_hooks = []
        for name, part in module.named_modules():
            if not name or isinstance(part, torch.jit.ScriptModule):  # which take no hooks
                continue
            def check_part(part, *_, name=name):
                self._check_part_call(name, part)
            check_part.__rannc__ = True
            self._part_hooks.append((name, part.register_forward_pre_hook(check_part)))

    def strip_hooks(self, module: torch.nn.Module):
        """Removes the hooks above from `module`, a deep copy of the user's module (which
        copied them), whose own state has other holders ([Note: copies of a wrapped
        model] in copies.py)."""
        for handle in self._hooks:
            for hooks in (module._state_dict_hooks, module._load_state_dict_pre_hooks,
                          module._forward_pre_hooks):
                hooks.pop(handle.id, None)
        for name, handle in self._part_hooks:
            module.get_submodule(name)._forward_pre_hooks.pop(handle.id, None)

    own_access = staticmethod(_own_access)

    # ---- the module's own state_dict ------------------------------------------------------
    # [Note: the module's own state_dict] DistributedDataParallel's habits
    #     if rank == 0: torch.save(model.module.state_dict(), path)
    #     model.module.load_state_dict(torch.load(path))       # resuming
    #     model.module(x), model.module.generate(ids)          # a local forward, sampling
    # (and transformers' model.module.save_pretrained) use the user's module directly.
    # (RaNNCModule.save_pretrained saves the gathered weights.)
    # Under rannc a rank holds only its stages' tensors: the others are empty (numel 0) or
    # stale, so the first wrote a checkpoint of empty tensors without a word, and the others
    # failed on a size of 0 in some op. Each is refused on a rank that lacks tensors, naming
    # them and the wrapper's calls to use instead; rannc's own reads pass (_own_access), and
    # so does its tracing. Where every rank holds everything, they work as under DDP.
    def module_state_dict(self, *args, **kwargs) -> dict:
        """The module's own state_dict() (what this rank holds), for rannc's use."""
        with _own_access():
            return self.module.state_dict(*args, **kwargs)

    def module_load_state_dict(self, *args, **kwargs):
        with _own_access():
            return self.module.load_state_dict(*args, **kwargs)

    def not_current_here(self) -> list[str]:
        """The state tensors whose current value this rank lacks (freed, stale, or, for a
        model built on the meta device, without a value anywhere yet)."""
        if not self._users:
            return self.without_values()
        rank, names = _C.get_rank(), self._trace_state.names
        return [names[i] for i, (_, current) in enumerate(self.sources())
                if rank not in current or i in self._freed]

    def _check_users_state_dict(self):
        if not _OWN_ACCESS.get():
            extra = (", save_pretrained(dir)" if hasattr(self.module, "save_pretrained")
                     else "")  # transformers' model.module.save_pretrained ends here
            self._refuse_partial("state_dict()", f"state_dict(){extra} or save_checkpoint(dir)")

    def _check_users_call(self):
        if _OWN_ACCESS.get() or torch.jit.is_tracing():
            return
        lacking = self.not_current_here()
        if lacking:
            raise _C.Error(
                f"{type(self.module).__name__} called directly on rank {_C.get_rank()} (as "
                "model.module(...) or transformers' generate): inside a RaNNCModule this rank "
                f"keeps only its stages' parameters and buffers and does not hold the current "
                f"values of {failure.some_of(lacking)}. Call the RaNNCModule itself, on "
                "every rank (in eval mode for an evaluation)")

    def _check_part_call(self, name: str, part: torch.nn.Module):
        """A submodule called directly: refused where this rank lacks its current state (it
        failed inside torch, on a size of 0, or ran on stale values)."""
        if (_OWN_ACCESS.get() or torch.jit.is_tracing() or not self._users
                or not (self._freed or self._stale)):
            return
        lacking = [n for n in self.not_current_here() if n.startswith(name + ".")]
        if lacking:
            raise _C.Error(
                f"{type(part).__name__} '{name}' of the model inside a RaNNCModule called "
                f"directly on rank {_C.get_rank()} (as model.module.{name}(...) or a method of "
                "the model): this rank keeps only its stages' parameters and buffers and does "
                f"not hold the current values of {failure.some_of(lacking)}. Call the "
                "RaNNCModule itself, on every rank (in eval mode for an evaluation), or a copy "
                "of it (copy.deepcopy(wrapped), [Note: copies of a wrapped model] in copies.py)")

    def refuse_assignment(self, module: torch.nn.Module, name: str, value, kind: str):
        """[Note: tensors assigned after the first call]"""
        now = module._parameters.get(name, module._buffers.get(name, module._modules.get(name)))
        if value is now:
            return
        prefix = next((n for n, m in self.module.named_modules() if m is module), None)
        full = f"{prefix}.{name}" if prefix else name
        if now is None:
            what, cure = f"registered as a new {kind}", "register it before wrapping"
        elif kind == "submodule":
            what, cure = "assigned a new submodule", (
                "re-initialise the submodule in place (its reset_parameters(), or copy_ into "
                "its tensors under torch.no_grad()), or make the change before wrapping")
        else:
            what, cure = f"assigned a new {kind}", (
                "write the new value into the tensor in place (with torch.no_grad(): "
                f"model.module.{full}.copy_(value)), or assign it before wrapping")
        raise _C.Error(
            f"{kind} '{full}' of the model {what} after the RaNNCModule's first call (on rank "
            f"{_C.get_rank()}): the plan's stages run the tensors they were deployed with, so "
            f"the steps would not see it and state_dict() would return it untrained; {cure}")

    def _check_users_load(self):
        if not _OWN_ACCESS.get() and self._users:
            self._refuse_partial("load_state_dict()", "load_state_dict(state) or "
                                 "load_checkpoint(path)", loading=True)

    def _refuse_partial(self, what: str, instead: str, loading: bool = False):
        lacking = self._freed_names() if loading else self.not_current_here()
        if not lacking:
            return
        holds = ("has no storage for" if loading else "does not hold the current values of")
        how = ("every rank passes the whole state and keeps its share" if loading else
               "they gather from every rank; write the file on rank 0 only")
        raise _C.Error(
            f"{type(self.module).__name__}.{what} of the model inside a RaNNCModule on rank "
            f"{_C.get_rank()}: this rank keeps only its stages' parameters and buffers and "
            f"{holds} {failure.some_of(lacking)}. Call the RaNNCModule's {instead} on every "
            f"rank instead ({how}), not model.module's as with DistributedDataParallel")

    def _freed_names(self) -> list[str]:
        names = self._trace_state.names
        return [names[i] for i in sorted(self._freed)]

    def _empty_meta_parameters(self) -> set[int]:
        """Swaps the parameters built on the meta device for empty ones at home, freed on
        every rank ([Note: models built on the meta device]); their positions."""
        built = set()
        for i, t in enumerate(self.tensors()[:len(self._trace_state.param_names)]):
            if t.is_meta:
                empty = torch.nn.Parameter(_freed_like(t, self.home),
                                           requires_grad=t.requires_grad)
                shape = t.shape
                torch.utils.swap_tensors(t, empty)
                self._freed[i] = shape
                built.add(i)
        return built

    # ---- what is where --------------------------------------------------------------------
    @property
    def deployed(self) -> bool:
        """Whether any mode is deployed (before that every rank holds everything)."""
        return bool(self._users)

    def without_values(self) -> list[str]:
        """The parameters built on the meta device while no mode is deployed: they have no
        storage or value on any rank yet (a pending checkpoint is read at the first call)."""
        if self._users:
            return []
        names = self._trace_state.names
        return [names[i] for i in sorted(self._meta_built)]

    def require_values(self, what: str):
        """Raises for `what` (state_dict(), save_checkpoint, ...) while parameters built on
        the meta device have no values anywhere yet (the same on every rank)."""
        names = self.without_values()
        if names:
            raise _C.Error(
                f"{what} before the first call of a model built on the meta device: its "
                f"parameters ({failure.some_of(names)}) have no values yet. They get them "
                "at the first call, once the plan says which ranks keep them: from "
                "load_checkpoint or load_state_dict called before it, else from their "
                "modules' reset_parameters()")

    def freed(self) -> dict[int, torch.Size]:
        """State tensor position -> its full shape, for the tensors freed on this rank."""
        return dict(self._freed)

    def tensors(self) -> list[torch.Tensor]:
        """The module's parameters and buffers in trace order (the same in every mode)."""
        return self._trace_state.tensors(self.module)

    def first_buffer(self) -> int:
        """The index of the first buffer in tensors() (parameters come first)."""
        return len(self._trace_state.param_names)

    def full_shape(self, i: int, t: torch.Tensor) -> torch.Size:
        """The shape of state tensor `i` (`t`), freed here or not."""
        return self._freed.get(i, t.shape)

    def sources(self) -> list[tuple]:
        """Per state tensor: (owner, ranks whose copy is current). A tensor no stage uses is
        kept everywhere and never changes: (None, all ranks). Viewing a copy's values, only
        the ranks that train a tensor hold its current value ([Note: copies of a wrapped
        model] in copies.py)."""
        world = set(range(_C.get_world_size()))
        stale = self._stale or self._copy_view
        result = []
        for i in range(len(next(iter(self._users.values())))):
            keepers = set().union(*(users[i] for users in self._users.values()))
            trained = self._trainers[i] if self._trainers is not None else set()
            if not keepers:
                result.append((None, world))
            else:  # after training, only the ranks that trained it are up to date
                result.append((min(trained or keepers),
                               trained if trained and stale else keepers))
        return result

    def unused_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """The parameters that no deployed stage uses (name, tensor): kept on every rank.
        Asked at every step: learnt once per deployed mode."""
        if not self._users:
            return []
        if self._unused is None:
            names, tensors = self._trace_state.names, self.tensors()
            self._unused = [(names[i], tensors[i])
                            for i in range(len(self._trace_state.param_names))
                            if not self._keepers(i)]
        return self._unused

    def trained_here(self) -> set[int]:
        """id() of the parameters this rank's training stages use, frozen ones included (an
        optimizer keeps them: a step after unfreezing updates them, as in PyTorch)."""
        rank = _C.get_rank()
        return {id(t) for t, trainers in self.trained_parameters() if rank in trainers}

    def optimized_elsewhere(self) -> set[int]:
        """id() of the module's parameters that this rank's share of the optimizers leaves
        out: those other ranks train. It keeps those it trains, those no training call has
        run yet (on every rank: a later training call with other arguments may train them
        anywhere, and a checkpoint's optimizer state for them waits there, [Note: other
        training arguments] in module.py; torch's optimizers skip them while they have no
        gradient) and any parameter outside the module (a learnt temperature the loss
        outside uses: the user's, as under DDP)."""
        rank = _C.get_rank()
        return {id(t) for t, trainers in self.trained_parameters() if rank not in trainers}

    def trained_parameters(self) -> list[tuple[torch.Tensor, set[int]]]:
        """The parameters some rank trains, each with the ranks that train it (the same
        sum of gradients on each)."""
        if self._trainers is None:
            return []
        n_params = len(self._trace_state.param_names)
        return [(t, self._trainers[i]) for i, t in enumerate(self.tensors()[:n_params])
                if self._trainers[i]]

    def holders(self) -> dict[int, tuple[torch.Size, list[int], bool]]:
        """For checkpoints: id(state tensor) -> (its full shape, the ranks holding its current
        value and, once training is deployed, a parameter's optimizer state; whether this
        rank holds storage for it). Before the first deployment, only the parameters built on
        the meta device, with no storage anywhere yet."""
        if not self._users:
            world = list(range(_C.get_world_size()))
            tensors = self.tensors()
            return {id(tensors[i]): (shape, world, False) for i, shape in self._freed.items()}
        result = {}
        for i, (t, (_, current)) in enumerate(zip(self.tensors(), self.sources())):
            trained = self._trainers[i] if self._trainers is not None else set()
            result[id(t)] = (self.full_shape(i, t), sorted(trained or current), i not in self._freed)
        return result

    # ---- changes --------------------------------------------------------------------------
    def trained(self):
        """A training step ran: only the ranks that trained a tensor hold its current value."""
        self._stale = True

    def current_everywhere(self):
        """Every rank keeping a tensor holds its current value (after eval's sync, or a
        checkpoint loaded into all of them)."""
        self._stale = False

    def before_eval(self):
        """Before an eval call after training: each tensor that training updated goes from
        its owner to the ranks whose eval stage uses it and whose copy is stale. Under
        viewing_copy(), each tensor the ranks that train it do not all evaluate."""
        if not (self._stale or self._copy_view):
            return
        evals = [users for key, users in self._users.items() if key is not True]
        if evals and True in self._users:
            copies = []
            users = [set().union(*per_tensor) for per_tensor in zip(*evals)]
            for t, eval_users, (owner, current) in zip(self.tensors(), users, self.sources()):
                if owner is not None and eval_users - current:
                    copies.append((owner, eval_users - current, t.data))
            _transfer(copies)
        if not self._copy_view:
            self._stale = False

    # ---- training calls with other arguments ([Note: other training arguments] in module.py)
    def gradient_routes(self, key) -> list[tuple[int, int, set[int]]]:
        """For the training program `key` ((True, arguments)): per parameter its stages use,
        in state order, (its position, the rank that sends its gradient: the first whose
        stage uses it, the ranks that train it but do not run it in `key`)."""
        users = self._users[key]
        n_params = len(self._trace_state.param_names)
        return [(i, min(users[i]), self._trainers[i] - users[i])
                for i in range(n_params) if users[i]]

    @staticmethod
    def transfer(copies):
        """Point-to-point copies [(owner, receivers, tensor)] listed alike on every rank (see
        _transfer)."""
        _transfer(copies)

    # [Note: buffers of replicas] A stage's replicas each update its buffers (batch norm's
    # running statistics) from their own share of the batch, so they drifted apart: the
    # ranks' evaluations differed from each other and from the state_dict(), which takes
    # the first replica's. DistributedDataParallel gives every rank rank 0's buffers before
    # each forward (broadcast_buffers); here, after each training call, the buffers its
    # forward writes go from the first rank using them to the others, with the same result.
    # Which buffers are written is learnt at the first call (their values before and after,
    # agreed by all ranks: batch norm's kernels write the statistics without bumping their
    # version counters), so constant buffers (a causal mask) never move.
    def buffers_before(self) -> dict[int, torch.Tensor] | None:
        """Copies of the buffers while it is not known which ones training writes (see
        share_written_buffers), else None."""
        if self._buffer_routes is not None:
            return None
        n_params = len(self._trace_state.param_names)
        return {i: t.detach().clone() for i, t in enumerate(self.tensors()) if i >= n_params}

    def share_written_buffers(self, before: dict[int, torch.Tensor] | None) -> list[str] | None:
        """After a call of the first training program: the buffers its forward writes go
        from their first user to the other ranks using them. Returns the names of those
        buffers at the first call (when they are learnt), else None."""
        written = None
        if self._buffer_routes is None:
            tensors = self.tensors()
            mine = [i for i, b in before.items()
                    if b.shape != tensors[i].shape or not torch.equal(b, tensors[i].detach())]
            everyone = all_gather_objects(mine) if _C.get_world_size() > 1 else [mine]
            users = self._users[True]
            indices = sorted(set().union(*map(set, everyone)))
            self._buffer_routes = [(i, min(users[i]), users[i] - {min(users[i])})
                                   for i in indices if len(users[i]) > 1]
            written = [self._trace_state.names[i] for i in indices]
        if self._buffer_routes:  # most models: none, and nothing to look up per call
            tensors = self.tensors()
            _transfer([(owner, others, tensors[i].data) for i, owner, others in self._buffer_routes])
        return written

    def after_other_training(self, key):
        """After a call of the training program `key`: the buffers its stages use (batch
        norm's running statistics, which its forward updated) go from the first rank running
        them to the ranks that train them and do not run them in `key`."""
        users = self._users[key]
        n_params = len(self._trace_state.param_names)
        tensors = self.tensors()
        _transfer([(min(users[i]), self._trainers[i] - users[i], tensors[i].data)
                   for i in range(n_params, len(tensors))
                   if users[i] and self._trainers[i] - users[i]])

    @contextlib.contextmanager
    def viewing_copy(self):
        """What runs inside reads and writes a copy's tensors (swapped into the module's):
        their current values are where training updates them ([Note: copies of a wrapped
        model] in copies.py), and the module's own staleness is left as it was."""
        before = self._copy_view
        self._copy_view = True
        try:
            yield
        finally:
            self._copy_view = before

    # ---- copies of the module ([Note: copies of a wrapped model] in copies.py) --------------
    def add_copy(self, copy):
        """`copy` (a PlanSharingCopy) holds its tensors where the module holds its own, and
        follows it as modes are deployed."""
        self._copies = [r for r in self._copies if r() is not None] + [weakref.ref(copy)]

    def copy_count(self) -> int:
        """How many copies of the module live on this rank."""
        return sum(r() is not None for r in self._copies)

    def tensors_of(self, module: torch.nn.Module) -> list[torch.Tensor]:
        """The state tensors of `module`, a copy of the user's module, in trace order."""
        return self._trace_state.tensors(module)

    def _copies_state(self) -> list[list[torch.Tensor]]:
        """Each live copy's state tensors, in the order of copying (a collective: the ranks
        must have made the same copies, or their transfers would not match)."""
        copies = [c for c in (r() for r in self._copies) if c is not None]
        if _C.get_world_size() > 1:
            counts = all_gather_objects(len(copies))
            if len(set(counts)) > 1:
                raise failure.agreed(
                    f"the ranks hold different numbers of copies of the model ({dict(enumerate(counts))} "
                    "(rank: copies)): copy.deepcopy of a RaNNCModule (AveragedModel, an EMA) "
                    "must be made on every rank alike")
        return [self.tensors_of(c.module) for c in copies]

    def trace_tensors(self) -> list[torch.Tensor]:
        """What to trace (and profile) the module's state with at `home`, in trace order: once
        a mode is deployed, stand-ins for every parameter and the buffers' current values
        (a collective: a rank that freed a buffer, or holds a stale one, gets a copy from
        its owner); before, the module's own tensors with stand-ins for parameters built on
        the meta device ([Note: freed state])."""
        if not self._users:
            return state_for_tracing(self.module, self._trace_state, self.home, self._freed)
        rank, world = _C.get_rank(), set(range(_C.get_world_size()))
        tensors = self.tensors()
        n_params = len(self._trace_state.param_names)
        # every rank stands in for all parameters: their traces agree
        out = stand_ins([(self.full_shape(i, t), t.dtype, t.requires_grad)
                         for i, t in enumerate(tensors[:n_params])], self.home)
        copies = []
        for i, (t, (owner, current)) in enumerate(zip(tensors, self.sources())):
            if i < n_params:
                continue
            if rank in current and i not in self._freed:
                value = t.detach() if t.device == self.home else t.detach().to(self.home)
            else:
                value = torch.empty(self.full_shape(i, t), dtype=t.dtype, device=self.home)
            if current != world:
                copies.append((owner, world - current, value))
            out.append(value)
        _transfer(copies)
        return out

    def shaped_parameters(self) -> list[torch.Tensor]:
        """The parameters as meta tensors of their full shapes (for what reads only shapes)."""
        n_params = len(self._trace_state.param_names)
        return [torch.empty(self.full_shape(i, t), dtype=t.dtype, device="meta")
                .requires_grad_(t.requires_grad)
                for i, t in enumerate(self.tensors()[:n_params])]

    def add_mode(self, mode: bool, deployed):
        """`deployed` (a Deployed) now runs `mode` (a collective): record which ranks use
        each tensor, give the ones this rank's stages newly use storage and their current
        value, free what no stage on this rank uses and move the rest to this rank's
        device."""
        first = not self._users
        self._unused = None  # unused_parameters() learns them again
        self._trace_state = deployed.graph._trace.state
        tensors = self.tensors()
        position = {v: i for i, v in enumerate(deployed.state_ids)}
        users = [set() for _ in deployed.state_ids]
        for ranks, vids in deployed.engine.grad_groups():  # the ranks whose stages use each
            for v in vids:
                users[position[v]] = set(ranks)
        world = set(range(_C.get_world_size()))
        # before this mode: who holds each tensor's storage, and its current value
        holding = ([set() if i in self._meta_built else world for i in range(len(tensors))]
                   if first else [self._keepers(i) or world for i in range(len(tensors))])
        sources = None if first else self.sources()
        copies = self._copies_state()
        self._users[mode] = users
        if mode is True:
            self._trainers = [set(u) for u in users]
        elif isinstance(mode, tuple) and mode[0] is True:  # [Note: other training arguments]
            self._trainers = [t or set(u) for t, u in zip(self._trainers, users)]
        self._fill(tensors, holding, sources, copies)
        if first:
            self._from_rank_zero(tensors, users, copies)
        self._release(tensors)
        self._place(tensors)
        for state in copies:
            self._release(state, own=False)
            self._place(state, own=False)

    # [Note: rank 0's weights] DistributedDataParallel broadcasts rank 0's parameters and
    # buffers when it wraps the model, and scripts rely on it: timm seeds each rank
    # differently before create_model, a script loads pretrained weights on rank 0 alone.
    # Here each stage trained from its own rank's values without a word (loss 0.808 for
    # PyTorch's 1.192 at step 0 on 2 stages; replicas of one stage kept different weights
    # for good). So at the first deployment every rank that keeps a tensor gets rank 0's
    # value (a model built on the meta device has none yet: a checkpoint fills it), and so
    # does each copy made before it (an EMA).
    def _from_rank_zero(self, tensors, users, copies=()):
        if _C.get_world_size() == 1:
            return
        world = set(range(_C.get_world_size()))
        transfers = []
        for i, t in enumerate(tensors):
            if i in self._meta_built:
                continue
            receivers = (users[i] or world) - {0}
            if receivers:
                transfers.append((0, receivers, t.data))
                transfers += [(0, receivers, state[i].data) for state in copies]
        _transfer(transfers)

    def _keepers(self, i: int) -> set:
        """The ranks whose deployed stages use state tensor `i`."""
        return set().union(*(users[i] for users in self._users.values()))

    def _fill(self, tensors, holding, sources, copies=()):
        """Storage on this rank's device for the tensors its stages now use and it does not
        hold, with the owner's value where some rank holds one (a collective); the same for
        each copy's tensors (`copies`), from the same owner (whose copy is current: it
        trains the tensor, [Note: copies of a wrapped model] in copies.py)."""
        rank, world = _C.get_rank(), set(range(_C.get_world_size()))
        transfers = []
        for i, t in enumerate(tensors):
            # what no stage uses is kept everywhere, as a parameter built with a value is
            newly = (self._keepers(i) or world) - holding[i]
            if not newly:
                continue
            shape = self.full_shape(i, t)
            if rank in newly:
                t.data = torch.empty(shape, dtype=t.dtype, device=self.device)
                for state in copies:
                    state[i].data = torch.empty(shape, dtype=state[i].dtype, device=self.device)
                self._freed.pop(i, None)
            if sources is not None and sources[i][0] is not None:
                transfers.append((sources[i][0], newly, t.data))
                transfers += [(sources[i][0], newly, state[i].data) for state in copies]
            elif rank in newly:
                self._unset.add(i)  # built on meta: a checkpoint or initialize() fills it
        _transfer(transfers)

    def _release(self, tensors, own: bool = True):
        """Frees the storage of the state tensors that no deployed stage on this rank uses:
        the module's (`own`), or a copy's where the module's are freed."""
        rank = _C.get_rank()
        for i, t in enumerate(tensors):
            if own:
                keepers = self._keepers(i)
                if not (keepers and rank not in keepers and i not in self._freed):
                    continue
                self._freed[i] = t.shape
            elif i not in self._freed or t.numel() == 0:
                continue
            t.grad = None
            t.data = _freed_like(t, t.device)

    def _place(self, tensors, own: bool = True):
        """Moves the state tensors this rank keeps to its device ([Note: placement]): the
        module's, or a copy's that are where the module's were (not where the user moved
        them)."""
        if self.device == self.home:
            return
        for i, t in enumerate(tensors):
            if i in self._freed or t.device == self.device or (not own and t.device != self.home):
                continue
            t.data = t.data.to(self.device)
            if own:
                self._place_optimizer_state(t)

    # ---- values of parameters built on the meta device --------------------------------------
    def loaded(self, tensors):
        """`tensors` (state tensors) got values here (from a checkpoint or a state_dict)."""
        if self._unset:
            ids, state = {id(t) for t in tensors}, self.tensors()
            self._unset = {i for i in self._unset if id(state[i]) not in ids}

    def initialize(self):
        """Values for the parameters built on the meta device that no checkpoint filled
        ([Note: models built on the meta device]); a collective where the model was built
        there. Raises, on every rank, naming them, where some are left without one."""
        if not self._meta_built:
            return
        seed = all_gather_objects(torch.initial_seed())[0]  # rank 0's: replicas agree
        tensors = self.tensors()
        unset = {id(tensors[i]) for i in self._unset}
        # children first, as their constructors run before their parent's own reset
        # (nn.MultiheadAttention zeroes out_proj.bias after out_proj initialised it)
        for name, m in reversed(list(self.module.named_modules())):
            reset = getattr(m, "reset_parameters", getattr(m, "_reset_parameters", None))
            held = [p for p in m.parameters(recurse=False) if p.numel()]
            if callable(reset) and held and all(id(p) in unset for p in held):
                with torch.random.fork_rng(devices=[]), torch.no_grad():
                    torch.manual_seed((seed ^ zlib.crc32(name.encode())) & 0x7FFFFFFFFFFFFFFF)
                    reset()
                self.loaded(held)
        names = self._trace_state.names
        left = [names[i] for i in sorted(self._unset)]
        everyone = all_gather_objects(left)
        missing = {r: l for r, l in enumerate(everyone) if l}
        if missing:
            r, first = next(iter(missing.items()))
            more = sum(len(l) for l in missing.values()) - min(len(first), 5)
            raise failure.agreed(
                f"parameters built on the meta device have no values (rank {r}: "
                f"{', '.join(first[:5])}{f' and {more} more' if more > 0 else ''}): no "
                "checkpoint held them and their modules have no reset_parameters(); load "
                "their values with load_checkpoint(path) before the first call (each rank "
                "reads its stages' tensors), or build those modules on a real device")

    def _place_optimizer_state(self, param: torch.Tensor):
        """Optimizer state made before the first call (a loaded state_dict) follows its
        parameter to the device, as torch's load_state_dict places it: `step` stays on the
        CPU unless the group is fused or capturable."""
        share = self.optimizer_share
        state = share.state(param) if share is not None else None
        if not state:
            return
        group = next((g for g in share.groups() if any(p is param for p in g["params"])), {})
        on_device = group.get("fused") or group.get("capturable")
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and (key != "step" or on_device):
                state[key] = value.to(self.device)


# [Note: freed tensors keep their dimensions] A freed tensor holds no elements but keeps
# its number of dimensions (a weight is [0, 0]): scripts build optimizer groups from
# p.dim() (nanoGPT's weight decay for p.dim() >= 2), and an optimizer built after the first
# call read the freed weights as 1-D, so the ranks' groups differed from each other and
# from PyTorch's, and optimizer.state_dict() put one parameter's state under another.
def _freed_like(t: torch.Tensor, device) -> torch.Tensor:
    return torch.empty((0,) * max(1, t.dim()), dtype=t.dtype, device=device)


def _transfer(copies):
    """Point-to-point copies [(owner, receivers, tensor)], listed in the same order on every
    rank: the owner sends its tensor to each receiver, which receives into its own.
    [Note: the engine's transfers are all finished between calls, so one tag suffices: MPI
    keeps the order of messages between a pair.]"""
    comm, rank = _C.Communicator.world_cpu(), _C.get_rank()
    works = []
    for owner, receivers, t in copies:
        if rank == owner:
            works += [send_staged(comm, t, r, _STATE_TAG) for r in sorted(receivers) if r != rank]
        elif rank in receivers:
            works.append(recv_staged(comm, t, owner, _STATE_TAG))
    for w in works:
        w.wait()
