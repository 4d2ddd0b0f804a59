"""torch.distributed over the ranks mpirun started, for the rest of a DDP training script.

Scripts written for DistributedDataParallel use torch.distributed beside the model: a
DistributedSampler to shard the data, all_reduce to average a metric, barrier. Under
mpirun nothing sets the MASTER_ADDR and MASTER_PORT that torch's env:// rendezvous reads,
so `dist.init_process_group()` fails there. `rannc.init_process_group()` makes the same
default group from the MPI world: rank 0 names an address and a free port, every rank
learns them over MPI, and torch's TCP rendezvous does the rest. rannc itself does not use
the group (its collectives are its own, over MPI or NCCL).

[Note: torch.distributed agrees with rannc] A rank waiting in a torch.distributed
collective cannot serve a gather that another rank asked from a RaNNCModule ([Note:
gathers asked by some ranks] in handshake.py): transformers' Trainer saves on rank 0 alone
and then, on every rank, all-gathers its FLOP counts, so rank 0 would wait in rannc's
gather and the others in torch's all_gather, until comm_timeout. So on the group this
function makes, the world collectives of torch.distributed (called as `dist.all_gather`,
with the default group) first meet rannc's handshake, once a RaNNCModule exists: the ranks
agree on the collective, serving a pending gather on the way, and a rank in a
torch.distributed collective while another is in a RaNNCModule call gets an error naming
both instead of a hang. Subgroups' collectives are left alone (not every rank is in them).
"""
from __future__ import annotations

import functools
import inspect
import os
import socket

import torch
import torch.distributed as dist

from . import _C, handshake
from .transport import all_gather_objects


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def init_process_group(backend: str | None = None, **kwargs) -> None:
    """torch.distributed.init_process_group over this job's MPI ranks (a collective; when
    the default group exists, only what follows). Its world collectives agree with rannc's
    ([Note: torch.distributed agrees with rannc]). `backend`: torch's default for the
    devices (NCCL with CUDA, else gloo) unless given; `kwargs` go to torch (timeout...).
    MASTER_ADDR and MASTER_PORT, where set, are used as torch would use them."""
    if dist.is_initialized():
        if dist.get_world_size() == _C.get_world_size():
            _agree_with_rannc()  # a group the script made over the same ranks
        return
    rank, world = _C.get_rank(), _C.get_world_size()
    host = socket.gethostname()
    hosts = all_gather_objects(host)
    if rank == 0:
        # one host: the loopback, which needs no name resolution; else rank 0's name
        addr = os.environ.get("MASTER_ADDR") or ("127.0.0.1" if len(set(hosts)) == 1 else host)
        port = int(os.environ.get("MASTER_PORT") or _free_port())
        found = (addr, port)
    else:
        found = None
    addr, port = all_gather_objects(found)[0]
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank,
                            world_size=world, **kwargs)
    _agree_with_rannc()


def _agree_with_rannc() -> None:
    """[Note: torch.distributed agrees with rannc]"""
    for name in handshake.TORCH_COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is not None and not getattr(fn, "_rannc_agrees", False):
            setattr(dist, name, _agreeing(fn, name))


def _agreeing(fn, name: str):
    signature = inspect.signature(fn)
    what = f"torch.distributed.{name}"

    @functools.wraps(fn)
    def collective(*args, **kwargs):
        if handshake.sources_made():
            group = signature.bind_partial(*args, **kwargs).arguments.get("group")
            if group is None or group is dist.GroupMember.WORLD:
                handshake.enter(what)
        return fn(*args, **kwargs)

    collective._rannc_agrees = True
    return collective
