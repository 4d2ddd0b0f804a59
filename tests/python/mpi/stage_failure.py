"""Trains the GPT on 2 stages; at the second step rank 0's stage gets token ids outside
the vocabulary, so its embedding raises. Every rank must end with an error naming the
failing rank and stage."""
import sys

import torch

import rannc
import zoo

rank, world = rannc.get_rank(), rannc.get_world_size()
model, (ids, targets), _ = zoo.make("gpt", batch=4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
wrapped = rannc.RaNNCModule(model, opt, num_stages=2, num_microbatches=2, comm_timeout=60)
try:
    for step in range(2):
        if step == 1 and rank == 0:
            ids = ids.clone()
            ids[0, 0] = 10_000  # not a token
        loss = wrapped(ids, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
except Exception as e:
    print(f"FAILED on rank {rank}: {type(e).__name__}: {e}", flush=True)
    sys.exit(1)
print(f"unexpected success on rank {rank}", flush=True)
