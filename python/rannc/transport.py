"""How the pipeline moves tensors between ranks: MPI for CPU stages, NCCL for CUDA stages
(or MPI through host memory where NCCL is missing or option data_plane="mpi").

[Note: channels] The engine's point-to-point transfers go over channels: one per (sender,
receiver, kind), kinds being the graph-input rows, activations, gradients, batch outputs
and their gradients. A channel delivers in order: the n-th receive that a rank posts on it
gets the n-th message sent on it, whatever the size. The engine issues the transfers of
each channel in one canonical order on both sides (micro-batch, value, first row), so no
tags are needed. This is what NCCL point-to-point gives (ncclSend/ncclRecv match by order
on a communicator, and operations on one communicator run one after another on its
stream): one NCCL communicator per channel keeps a blocked receive of one kind from
holding back a send of another kind, which would deadlock 1F1B (a stage posts the receive
of a gradient before it sends the next activation, its neighbour the other way round).
Over MPI a channel is a tag, and MPI keeps the order of messages with the same tag between
two ranks; a receive whose message does not fill its buffer raises, so an ordering mistake
fails loudly on CPU ranks too, where every test runs.
"""
from __future__ import annotations

import io

import torch

from . import _C

# Channel kinds; over MPI, a channel's tag is _TAG_BASE + kind.
INPUT_ROWS, ACTIVATION, GRADIENT, BATCH_OUTPUT, OUTPUT_GRADIENT, INPUT_GRADIENT = range(6)
_TAG_BASE = 100


def local_cuda_device() -> torch.device:
    """This rank's GPU: its rank among the ranks of its host modulo the CUDA devices it
    sees, so that 8 ranks on 8 GPUs take one each and 2 ranks on 1 GPU share it. Stages,
    profiling and the NCCL communicators (csrc/comm/nccl_communicator.cpp) all use it."""
    count = torch.cuda.device_count()
    if count == 0:
        raise _C.Error(f"rank {_C.get_rank()} sees no CUDA device (torch {torch.__version__})")
    return torch.device("cuda", _C.get_local_rank() % count)


def resolve_device(option: str, module: torch.nn.Module) -> torch.device:
    """Where this rank's stage runs (option `device`): "cpu", "cuda", "cuda:N", or "auto":
    the CUDA device the model's state is on, else this rank's GPU (local rank modulo the
    devices visible) when CUDA is available, else the CPU."""
    if option == "auto":
        first = next(iter(list(module.parameters()) + list(module.buffers())), None)
        if first is not None and first.device.type == "cuda":
            return first.device
        option = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(option)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise _C.Error(f"option device={option!r} on rank {_C.get_rank()}, but torch "
                           f"{torch.__version__} sees no CUDA device")
        if device.index is None:
            device = local_cuda_device()
    elif device.type != "cpu":
        raise _C.Error(f"option device={option!r}: rannc runs stages on cpu or cuda devices")
    return device


def uses_nccl(device: torch.device, data_plane: str) -> bool:
    """Whether CUDA stages talk over NCCL (option data_plane: "auto" or "mpi")."""
    if device.type != "cuda" or data_plane == "mpi":
        return False
    if not _C.has_nccl:
        if data_plane == "nccl":
            raise _C.Error("option data_plane='nccl', but this build of rannc has no NCCL "
                           "(built against a torch without CUDA, or NCCL headers not found)")
        return False
    return True


def send_staged(comm, t: torch.Tensor, dst: int, tag: int):
    """An MPI send of a tensor on any device (a CUDA one goes through host memory)."""
    return comm.send(t.to("cpu") if t.device.type != "cpu" else t, dst, tag)


def recv_staged(comm, t: torch.Tensor, src: int, tag: int):
    """An MPI receive into a tensor on any device; wait() leaves the data in `t`."""
    if t.device.type == "cpu":
        return comm.recv(t, src, tag)
    host = _host_like(t)
    return _Staged(comm.recv(host, src, tag), host, t)


class _Staged:
    """A receive through host memory: its wait() moves the data into the device buffer."""

    def __init__(self, work, host: torch.Tensor, target: torch.Tensor):
        self.work, self.host, self.target = work, host, target

    def wait(self, timeout_s=None):
        self.work.wait(timeout_s)
        self.target.copy_(self.host, non_blocking=True)

    def is_completed(self):
        return self.work.is_completed()


def _host_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())


class MpiChannels:
    """Channels over MPI ([Note: channels]); tensors on a CUDA device go through host memory."""

    def __init__(self):
        self.comm = _C.Communicator.world_cpu()

    def send(self, t: torch.Tensor, dst: int, kind: int):
        return send_staged(self.comm, t, dst, _TAG_BASE + kind)

    def recv(self, buf: torch.Tensor, src: int, kind: int):
        return recv_staged(self.comm, buf, src, _TAG_BASE + kind)


# (sender, receiver, kind) -> its NCCL communicator, shared by the deployments of all modes.
_nccl_channels = {}


class NcclChannels:
    """Channels over NCCL: one two-rank communicator per (sender, receiver, kind) this rank
    uses ([Note: channels]). `channels` lists them; every rank creates the ones it lacks in
    ascending order, so the members of each pair meet (each creation is collective over the
    pair, and both ends of a channel have created it before or neither has)."""

    def __init__(self, channels, device: torch.device):
        self.device = device
        world = _C.Communicator.world_cuda()
        me = _C.get_rank()
        self.comms = {}
        for key in sorted(set(channels)):
            src, dst, _ = key
            if me in (src, dst) and src != dst:
                if key not in _nccl_channels:
                    _nccl_channels[key] = world.subgroup(sorted((src, dst)))
                self.comms[key] = _nccl_channels[key]

    def _peer(self, comm, rank):
        return 0 if comm.world_rank(0) == rank else 1

    def send(self, t: torch.Tensor, dst: int, kind: int):
        comm = self.comms[(_C.get_rank(), dst, kind)]
        return comm.send(t.to(self.device).contiguous(), self._peer(comm, dst))

    def recv(self, buf: torch.Tensor, src: int, kind: int):
        comm = self.comms[(src, _C.get_rank(), kind)]
        return comm.recv(buf, self._peer(comm, src))


class _StagedCollective:
    """An MPI sub-communicator's all-reduce for tensors on a CUDA device (through host)."""

    def __init__(self, comm):
        self.comm = comm

    def all_reduce(self, t: torch.Tensor):
        host = t.to("cpu")
        return _Staged(self.comm.all_reduce(host), host, t)


def group_communicator(ranks, device: torch.device, nccl: bool):
    """The communicator that all-reduces gradients among `ranks` (ascending, this rank
    among them; collective over them): NCCL for CUDA stages where available, else MPI."""
    if nccl:
        return _C.Communicator.world_cuda().subgroup(list(ranks))
    sub = _C.Communicator.world_cpu().subgroup(list(ranks))
    return _StagedCollective(sub) if device.type != "cpu" else sub


def all_gather_objects(obj) -> list:
    """Copies of every rank's `obj` (anything torch.save takes), in rank order, on every
    rank; this rank's too, so nothing returned aliases live state."""
    comm, rank = _C.Communicator.world_cpu(), _C.get_rank()
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    sizes = torch.empty(comm.size, 1, dtype=torch.int64)
    comm.all_gather(torch.tensor([len(data)], dtype=torch.int64), sizes).wait()
    parts = []
    for r, size in enumerate(sizes[:, 0].tolist()):
        part = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if r == rank
                else torch.empty(size, dtype=torch.uint8))
        comm.broadcast(part, r).wait()
        parts.append(torch.load(io.BytesIO(part.numpy().tobytes()), weights_only=False,
                                map_location="cpu"))
    return parts
