"""Exercises the MPI data plane on every rank; exits non-zero on any mismatch."""
import torch

import rannc
from rannc import _C

rank, size = rannc.get_rank(), rannc.get_world_size()
comm = _C.Communicator.world_cpu()
assert comm.rank == rank and comm.size == size
assert rannc.get_local_rank() == rank  # one host

# ring of sends and receives, the receive target not contiguous
nxt, prv = (rank + 1) % size, (rank - 1) % size
out = torch.full((3, 4), float(rank))
into = torch.empty(4, 3).t()
works = [comm.send(out, nxt, tag=5), comm.recv(into, prv, tag=5)]
for w in works:
    w.wait(30)
assert torch.equal(into, torch.full((3, 4), float(prv))), into

# messages with one tag between two ranks arrive in order, and a message that does not
# fill its buffer (transfers paired wrongly) raises instead of leaving stale data
if size >= 2 and rank in (0, 1):
    peer = 1 - rank
    if rank == 0:
        for w in [comm.send(torch.arange(3.0), peer, 9), comm.send(torch.arange(5.0), peer, 9)]:
            w.wait(30)
    else:
        first, second = torch.empty(3), torch.empty(5)
        w1, w2 = comm.recv(first, peer, 9), comm.recv(second, peer, 9)
        w1.wait(30)
        w2.wait(30)
        assert torch.equal(first, torch.arange(3.0)) and torch.equal(second, torch.arange(5.0))
    if rank == 0:
        comm.send(torch.arange(3.0), peer, 10).wait(30)
    else:
        try:
            comm.recv(torch.empty(5), peer, 10).wait(30)
            raise AssertionError("a short message into a larger buffer was accepted")
        except _C.CommError as e:
            assert "received 3 elements into a buffer of 5" in str(e), e

# all-reduce: sum, max, and bfloat16 (reduced in float)
t = torch.tensor([rank + 1.0, 2.0 * rank])
comm.all_reduce(t).wait()
assert torch.equal(t, torch.tensor([size * (size + 1) / 2, size * (size - 1) * 1.0])), t
m = torch.tensor([rank], dtype=torch.int64)
comm.all_reduce(m, _C.ReduceOp.MAX).wait()
assert m.item() == size - 1
b = torch.full((5,), 0.5, dtype=torch.bfloat16)
comm.all_reduce(b).wait()
assert torch.equal(b, torch.full((5,), 0.5 * size, dtype=torch.bfloat16))

# complex tensors (an FFT layer's weights, gradients and activations) move and sum
c = torch.tensor([complex(rank, 1), complex(1, -rank)], dtype=torch.complex64)
comm.all_reduce(c).wait()
assert torch.equal(c, torch.tensor([complex(size * (size - 1) / 2, size),
                                    complex(size, -size * (size - 1) / 2)], dtype=torch.complex64)), c
z = torch.tensor([complex(prv, 2.5)], dtype=torch.complex128)
works = [comm.send(torch.tensor([complex(rank, 2.5)], dtype=torch.complex128), nxt, tag=6),
         comm.recv(got := torch.empty(1, dtype=torch.complex128), prv, tag=6)]
for w in works:
    w.wait(30)
assert torch.equal(got, z), got
try:
    comm.all_reduce(c, _C.ReduceOp.MAX).wait()
    raise AssertionError("a max of complex tensors was accepted")
except _C.CommError as e:
    assert "complex tensors have no order" in str(e), e

# broadcast from the last rank
x = torch.arange(6.0) if rank == size - 1 else torch.zeros(6)
comm.broadcast(x, size - 1).wait()
assert torch.equal(x, torch.arange(6.0))

# all-gather
g = torch.empty(size, 2)
comm.all_gather(torch.tensor([rank, -rank], dtype=torch.float32), g).wait()
assert torch.equal(g, torch.tensor([[r, -r] for r in range(size)], dtype=torch.float32))

# a sub-group of the even ranks
evens = list(range(0, size, 2))
if rank in evens:
    sub = comm.subgroup(evens)
    assert sub.rank == evens.index(rank) and sub.size == len(evens)
    assert sub.world_rank(sub.rank) == rank
    s = torch.tensor([float(rank)])
    sub.all_reduce(s).wait()
    assert s.item() == sum(evens), s

rannc.barrier(60)
print(f"OK rank {rank}", flush=True)
