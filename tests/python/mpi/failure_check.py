"""One rank fails inside its stage; every rank must end with an error naming it.

    failure_check.py raise   rank 1 raises and reports; the others are blocked in a receive
    failure_check.py hang    rank 1 stalls; rank 0 times out, reports, and the rest follow
"""
import sys
import time

import torch

import rannc
from rannc import _C

mode = sys.argv[1]
rank, size = rannc.get_rank(), rannc.get_world_size()
comm = _C.Communicator.world_cpu()

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
