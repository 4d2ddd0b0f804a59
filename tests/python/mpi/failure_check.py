"""One rank fails inside its stage; every rank must end with an error naming it.

    failure_check.py raise   rank 1 raises and reports; the others are blocked in a receive
    failure_check.py hang    rank 1 stalls; rank 0 times out, reports, and the rest follow
    failure_check.py again   as raise, then every rank catches its error and communicates
                             again: each later wait fails at once, naming the first failure
                             ([Note: failures stay] in csrc/comm/world.cpp)
    failure_check.py caught_timeout   rank 0 times out waiting for rank 1 and the script
                             catches it: the peers are told at once and rank 0's next wait
                             fails at once ([Note: a timeout is a failure])
"""
import sys
import time

import torch

import rannc
from rannc import _C

mode = sys.argv[1]
rank, size = rannc.get_rank(), rannc.get_world_size()
comm = _C.Communicator.world_cpu()

if mode == "again":
    try:
        if rank == 1:
            message = "rank 1 | stage 1: ValueError: shape mismatch in stage 1"
            _C.report_failure(message)
            raise ValueError(message)
        comm.recv(torch.empty(4), 1, tag=9).wait(120)
    except Exception as e:  # the script catches it and goes on, as a loop skipping a batch
        print(f"CAUGHT rank {rank}: {type(e).__name__}", flush=True)
    start = time.monotonic()
    try:  # the ranks are at different points of the step: nothing may pair up now
        comm.recv(torch.empty(4), (rank + 1) % size, tag=10).wait(120)
    except _C.CommError as e:
        print(f"AGAIN rank {rank} after {time.monotonic() - start:.1f} s: {e}", flush=True)
        sys.exit(1)
    print(f"unexpected success on rank {rank}", flush=True)
    sys.exit(0)

if mode == "caught_timeout":
    began = time.monotonic()
    try:
        if rank == 0:
            try:
                comm.recv(torch.empty(4), 1, tag=9).wait(2)
            except _C.CommTimeoutError as e:  # caught, as a loop skipping a batch
                print(f"CAUGHT rank 0: {e}", flush=True)
            comm.recv(torch.empty(4), 1, tag=10).wait(120)
        elif rank == 1:
            time.sleep(6)
            comm.recv(torch.empty(4), 0, tag=10).wait(120)
        else:
            comm.recv(torch.empty(4), 1, tag=9).wait(120)
    except _C.CommError as e:
        print(f"AGAIN rank {rank} at {time.monotonic() - began:.1f} s: {e}", flush=True)
        sys.exit(1)
    print(f"unexpected success on rank {rank}", flush=True)
    sys.exit(0)

try:
    if mode == "raise":
        if rank == 1:
            raise ValueError("shape mismatch in stage 1")
        comm.recv(torch.empty(4), 1, tag=9).wait(120)   # never sent
    elif mode == "hang":
        if rank == 1:
            time.sleep(4)
            rannc.barrier(120)                           # finds rank 0's report here
        else:
            comm.recv(torch.empty(4), 1, tag=9).wait(2 if rank == 0 else 120)
except Exception as e:
    message = f"rank {rank} | stage {rank}: {type(e).__name__}: {e}"
    print("FAILED " + message, flush=True)
    _C.report_failure(message)
    sys.exit(1)
print(f"unexpected success on rank {rank}", flush=True)
