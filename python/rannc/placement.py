"""Where each parameter and buffer of the user's module lives across the ranks.

[Note: freed state] A rank keeps real storage only for the parameters and buffers that its
stage of some deployed mode (train, eval) uses; the module's other state tensors are empty
(numel 0, same objects; their full shapes are kept here). Every rank computes the same
placement from the plans, so the copies below need no negotiation. A tensor's owner, which
holds its current value, is the first rank whose training stage updates it (else the first
rank keeping it). Tracing a new mode runs the whole model, so it re-materialises every
tensor first and frees again after deploying.

[Note: placement] Tracing runs the whole model where the user keeps it (`home`); each rank
then moves its stages' parameters and buffers to its device (the same tensor objects, so
the optimizer's references stay valid).
"""
from __future__ import annotations

import torch

from . import _C
from .transport import recv_staged, send_staged

# Tag of the point-to-point copies of parameters and buffers between ranks.
_STATE_TAG = 7


class StatePlacement:
    """The module's state tensors (parameters and buffers in trace order) and, per tensor,
    which ranks use it, which hold its current value, and whether this rank holds it."""

    def __init__(self, module: torch.nn.Module, home: torch.device, device: torch.device,
                 optimizer: torch.optim.Optimizer | None = None):
        self.module, self.home, self.device = module, home, device
        self.optimizer = optimizer  # its state moves with the parameters
        self._users = {}      # mode -> per state tensor, the ranks whose stage uses it
        self._freed = {}      # state tensor position -> its full shape, for tensors freed here
        self._stale = False   # trained since the ranks that only evaluate a tensor got it
        self._trace_state = None  # the traced state's names, resolved on the module

    # ---- what is where --------------------------------------------------------------------
    @property
    def deployed(self) -> bool:
        """Whether any mode is deployed (before that every rank holds everything)."""
        return bool(self._users)

    def freed(self) -> dict[int, torch.Size]:
        """State tensor position -> its full shape, for the tensors freed on this rank."""
        return dict(self._freed)

    def tensors(self) -> list[torch.Tensor]:
        """The module's parameters and buffers in trace order (the same in every mode)."""
        return self._trace_state.tensors(self.module)

    def full_shape(self, i: int, t: torch.Tensor) -> torch.Size:
        """The shape of state tensor `i` (`t`), freed here or not."""
        return self._freed.get(i, t.shape)

    def sources(self) -> list[tuple]:
        """Per state tensor: (owner, ranks whose copy is current). A tensor no stage uses is
        kept everywhere and never changes: (None, all ranks)."""
        world = set(range(_C.get_world_size()))
        train = self._users.get(True)
        result = []
        for i in range(len(next(iter(self._users.values())))):
            keepers = set().union(*(users[i] for users in self._users.values()))
            trained = train[i] if train is not None else set()
            if not keepers:
                result.append((None, world))
            else:  # after training, only the ranks that trained it are up to date
                result.append((min(trained or keepers),
                               trained if trained and self._stale else keepers))
        return result

    def holders(self) -> dict[int, tuple[torch.Size, list[int], bool]]:
        """For checkpoints: id(state tensor) -> (its full shape, the ranks holding its current
        value and, once training is deployed, a parameter's optimizer state; whether this
        rank holds storage for it). Empty before the first deployment."""
        if not self._users:
            return {}
        train = self._users.get(True)
        result = {}
        for i, (t, (_, current)) in enumerate(zip(self.tensors(), self.sources())):
            trained = train[i] if train is not None else set()
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
        its owner to the ranks whose eval stage uses it and whose copy is stale."""
        if not self._stale:
            return
        users = self._users.get(False)
        if users is not None and True in self._users:
            copies = []
            for t, eval_users, (owner, current) in zip(self.tensors(), users, self.sources()):
                if owner is not None and eval_users - current:
                    copies.append((owner, eval_users - current, t.data))
            _transfer(copies)
        self._stale = False

    def materialize(self):
        """Gives every state tensor real storage and its current value on every rank (a
        collective), for tracing a new mode."""
        if not self._users:
            return
        world = set(range(_C.get_world_size()))
        copies = []
        for i, (t, (owner, current)) in enumerate(zip(self.tensors(), self.sources())):
            if i in self._freed:
                t.data = torch.empty(self._freed.pop(i), dtype=t.dtype, device=self.home)
            elif t.device != self.home:  # tracing runs the whole model at home
                t.data = t.data.to(self.home)
            if current != world:
                copies.append((owner, world - current, t.data))
        _transfer(copies)
        self._stale = False

    def add_mode(self, mode: bool, deployed):
        """`deployed` (a _Deployed) now runs `mode`: record which ranks use each tensor, free
        what no stage on this rank uses and move the rest to this rank's device."""
        self._trace_state = deployed.graph._trace.state
        position = {v: i for i, v in enumerate(deployed.state_ids)}
        users = [set() for _ in deployed.state_ids]
        for ranks, vids in deployed.engine.grad_groups():  # the ranks whose stages use each
            for v in vids:
                users[position[v]] = set(ranks)
        self._users[mode] = users
        self.settle()

    def settle(self):
        """The deployed placement (after materialize() or a new mode): frees what no deployed
        stage on this rank uses and moves the rest to this rank's device."""
        self._release()
        self._place()

    def _release(self):
        """Frees the storage of the state tensors that no deployed stage on this rank uses."""
        rank = _C.get_rank()
        for i, t in enumerate(self.tensors()):
            keepers = set().union(*(users[i] for users in self._users.values()))
            if keepers and rank not in keepers and i not in self._freed:
                self._freed[i] = t.shape
                t.grad = None
                t.data = torch.empty(0, dtype=t.dtype, device=t.device)

    def _place(self):
        """Moves the state tensors this rank keeps to its device ([Note: placement])."""
        if self.device == self.home:
            return
        for i, t in enumerate(self.tensors()):
            if i not in self._freed and t.device != self.device:
                t.data = t.data.to(self.device)
                self._place_optimizer_state(t)

    def _place_optimizer_state(self, param: torch.Tensor):
        """Optimizer state made before the first call (a loaded state_dict) follows its
        parameter to the device, as torch's load_state_dict places it: `step` stays on the
        CPU unless the group is fused or capturable."""
        state = self.optimizer.state.get(param) if self.optimizer is not None else None
        if not state:
            return
        group = next((g for g in self.optimizer.param_groups
                      if any(p is param for p in g["params"])), {})
        on_device = group.get("fused") or group.get("capturable")
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and (key != "step" or on_device):
                state[key] = value.to(self.device)


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
