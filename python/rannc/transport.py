"""Moving tensors and objects between ranks from Python: the device choice per rank, the
data plane choice (NCCL or MPI), MPI transfers of tensors on any device (through host
memory), and gathering objects. The pipeline's own transfers are in C++
(csrc/runtime/channels.h, [Note: channels] in csrc/runtime/transfers.h).
"""
from __future__ import annotations

import io

import torch

from . import _C

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
    a GPU when the model's state is on one or CUDA is available, else the CPU. Under
    "auto" the GPU of one rank alone is the model's; with several ranks it is this rank's
    GPU (local rank modulo the devices visible), where the NCCL communicators are too: a
    model moved with `.cuda()` on every rank without `torch.cuda.set_device` sits on cuda:0
    everywhere, and its stages go to each rank's own GPU instead."""
    if option == "auto":
        first = next(iter(list(module.parameters()) + list(module.buffers())), None)
        if first is not None and first.device.type == "cuda" and _C.get_world_size() == 1:
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


def sharing_a_device(keys: list, rank: int) -> bool:
    """Whether rank `rank`'s device key (host, device identity) is another rank's too."""
    return keys.count(keys[rank]) > 1


def _device_key(device: torch.device) -> tuple:
    """This rank's GPU as every rank can compare it: its host and its UUID (the same GPU
    under two CUDA_VISIBLE_DEVICES settings has one UUID)."""
    props = torch.cuda.get_device_properties(device)
    ident = getattr(props, "uuid", None)
    ident = str(ident) if ident is not None else f"{getattr(props, 'pci_bus_id', '?')}:{device.index}"
    return (_C.get_hostname(), ident)


def uses_nccl(device: torch.device, data_plane: str) -> bool:
    """Whether CUDA stages talk over NCCL (option data_plane: "auto", "nccl" or "mpi").
    Collective over the ranks when it may be NCCL: NCCL runs one rank per GPU, so where
    any two ranks share a GPU, "auto" means MPI for every rank (through host memory) and
    "nccl" is an error naming the ranks."""
    if data_plane == "mpi":
        return False
    wants = device.type == "cuda" and _C.has_nccl
    if device.type == "cuda" and not _C.has_nccl and data_plane == "nccl":
        raise _C.Error("option data_plane='nccl', but this build of rannc has no NCCL "
                       "(built against a torch without CUDA, or NCCL headers not found)")
    if _C.get_world_size() == 1 or not _C.has_nccl:
        return wants
    # Every rank takes part, so that all decide alike.
    keys = all_gather_objects(_device_key(device) if device.type == "cuda" else None)
    if not all(k is not None for k in keys):
        return False  # some ranks run on the CPU: stages talk over MPI
    shared = [r for r in range(len(keys)) if sharing_a_device(keys, r)]
    if not shared:
        return True
    if data_plane == "nccl":
        raise _C.Error(f"option data_plane='nccl', but ranks {shared} share GPUs (NCCL runs one "
                       "rank per GPU): use data_plane='mpi' or 'auto', or one rank per GPU")
    if _C.get_rank() == 0:
        _C.log_info(f"ranks {shared} share GPUs: stages talk over MPI through host memory "
                    "(NCCL runs one rank per GPU)")
    return False


def device_memory_default(device: torch.device) -> int:
    """Bytes the plan may use where the option `device_memory` is not given: a GPU's total
    memory, shared evenly by the ranks of this host that use it (local rank modulo the
    devices); 8 GiB elsewhere."""
    if device.type != "cuda":
        return 8 << 30
    count = max(1, torch.cuda.device_count())
    index = device.index if device.index is not None else torch.cuda.current_device()
    sharing = sum(1 for r in range(_C.get_local_size()) if r % count == index % count) or 1
    return torch.cuda.get_device_properties(device).total_memory // sharing


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
