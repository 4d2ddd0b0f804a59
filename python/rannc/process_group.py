"""torch.distributed over the ranks mpirun started, for the rest of a DDP training script.

Scripts written for DistributedDataParallel use torch.distributed beside the model: a
DistributedSampler to shard the data, all_reduce to average a metric, barrier. Under
mpirun nothing sets the MASTER_ADDR and MASTER_PORT that torch's env:// rendezvous reads,
so `dist.init_process_group()` fails there. `rannc.init_process_group()` makes the same
default group from the MPI world: rank 0 names an address and a free port, every rank
learns them over MPI, and torch's TCP rendezvous does the rest. rannc itself does not use
the group (its collectives are its own, over MPI or NCCL).

[Note: a DDP script's environment on GPUs] torchrun gives a script RANK, WORLD_SIZE,
LOCAL_RANK and LOCAL_WORLD_SIZE; mpirun does not. Scripts pick their GPU from LOCAL_RANK,
and accelerate (so transformers' Trainer) sees a multi-GPU run only where LOCAL_RANK is set:
without it, each rank of a GPU job trained alone on the whole dataset, with no sampler
sharding it. So the group sets them from the MPI world, and makes this rank's current CUDA
device the one rannc runs its stages on (local rank modulo the GPUs it sees). Its backend
is NCCL for CUDA tensors where every rank has a GPU of its own and gloo for CPU tensors
beside it, as torch's default; where ranks share a GPU (NCCL runs one rank per GPU) it is
gloo alone, which moves CUDA tensors through host memory.

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

[Note: the group ends before the interpreter] A script that never calls
destroy_process_group() (most do not; Trainer does not) left gloo's worker threads alive
into the interpreter's teardown, where one of them now and then aborted the process after
its last line ("terminate called without an active exception", exit code 134: the job
failed though it trained; torch's own atexit fix, pytorch#179291, was abandoned). So the
group this function makes is destroyed at exit, after rannc's last collective (atexit runs
last-registered first: the end-of-script handshake is registered with the first
RaNNCModule, after the group); a group the script destroyed or replaced is left alone.

[Note: launched by another launcher] rannc's ranks are MPI's: under torchrun (or
torch.distributed.launch, accelerate launch, deepspeed) each process is a world of one,
so each trained alone on its own shard of the data without a word (losses 1.80 and 0.97
where one process gives 1.38), and this function then overwrote torchrun's RANK and
WORLD_SIZE with 0 and 1. A WORLD_SIZE above 1 in a world of one MPI rank is an error
naming the launch to use.
"""
from __future__ import annotations

import atexit
import collections
import functools
import inspect
import os
import socket

import torch
import torch.distributed as dist

from . import _C, handshake
from .transport import all_gather_objects, local_cuda_device


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def refuse_other_launchers() -> None:
    """[Note: launched by another launcher]; and the rank's identity for the processes it
    starts, in os.environ too (a subprocess given a copy of it: [Note: processes a rank
    starts] in csrc/comm/world.cpp)."""
    launched = os.environ.get("WORLD_SIZE", "")
    world = _C.get_world_size()
    os.environ.update(_C.rank_environment())
    if launched.isdigit() and int(launched) > 1 and world == 1:
        raise _C.Error(
            f"this process was started with WORLD_SIZE={launched} (torchrun or another "
            "torch.distributed launcher), but rannc's ranks are MPI's, and MPI sees it alone: "
            "each process would train by itself on its own data. Launch with "
            f"`mpirun -np {launched} python ...` instead")


def init_process_group(backend: str | None = None, **kwargs) -> None:
    """torch.distributed.init_process_group over this job's MPI ranks (a collective; when
    the default group exists, only what follows). Its world collectives agree with rannc's
    ([Note: torch.distributed agrees with rannc]); it sets torchrun's variables and the
    current CUDA device ([Note: a DDP script's environment on GPUs]). `backend`: NCCL for
    CUDA tensors and gloo for CPU ones where every rank has a GPU of its own, else gloo,
    unless given; `kwargs` go to torch (timeout...). MASTER_ADDR and MASTER_PORT, where
    set, are used as torch would use them."""
    refuse_other_launchers()  # [Note: launched by another launcher]
    if dist.is_initialized():
        if dist.get_world_size() == _C.get_world_size():
            _agree_with_rannc()  # a group the script made over the same ranks
        return
    rank, world = _C.get_rank(), _C.get_world_size()
    host = socket.gethostname()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    machines = all_gather_objects((host, gpus))
    hosts = [h for h, _ in machines]
    if rank == 0:
        # one host: the loopback, which needs no name resolution; else rank 0's name
        addr = os.environ.get("MASTER_ADDR") or ("127.0.0.1" if len(set(hosts)) == 1 else host)
        port = int(os.environ.get("MASTER_PORT") or _free_port())
        found = (addr, port)
    else:
        found = None
    addr, port = all_gather_objects(found)[0]
    _torchrun_environment(addr, port)  # [Note: a DDP script's environment on GPUs]
    if gpus:
        torch.cuda.set_device(local_cuda_device())
    if backend is None:
        backend = backend_for(machines)
        if rank == 0 and backend == "gloo" and any(g for _, g in machines):
            _C.log_info("torch.distributed over gloo: ranks share GPUs (NCCL runs one rank "
                        "per GPU)")
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank,
                            world_size=world, **kwargs)
    atexit.register(_destroy_at_exit, dist.group.WORLD)
    _agree_with_rannc()


def _destroy_at_exit(made) -> None:
    """[Note: the group ends before the interpreter]"""
    if dist.is_initialized() and dist.group.WORLD is made:
        dist.destroy_process_group()


def backend_for(machines: list[tuple[str, int]]) -> str:
    """torch.distributed's backend for ranks on `machines` (per rank: its host, the GPUs it
    sees): NCCL for CUDA tensors and gloo for CPU ones where every rank has a GPU of its
    own, else gloo ([Note: a DDP script's environment on GPUs])."""
    if not all(gpus for _, gpus in machines):
        return "gloo"
    ranks = collections.Counter(host for host, _ in machines)
    if any(ranks[host] > gpus for host, gpus in machines):
        return "gloo"
    return "cpu:gloo,cuda:nccl"


def _torchrun_environment(addr: str, port: int) -> None:
    """The variables torchrun sets, from the MPI world ([Note: a DDP script's environment
    on GPUs]); MASTER_ADDR and MASTER_PORT where unset."""
    os.environ.update(RANK=str(_C.get_rank()), WORLD_SIZE=str(_C.get_world_size()),
                      LOCAL_RANK=str(_C.get_local_rank()),
                      LOCAL_WORLD_SIZE=str(_C.get_local_size()))
    os.environ.setdefault("MASTER_ADDR", addr)
    os.environ.setdefault("MASTER_PORT", str(port))


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
