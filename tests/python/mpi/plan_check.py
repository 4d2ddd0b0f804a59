"""Parallel profiling on several ranks (run by test_profile.py under mpirun): with a
deterministic fake timer the parallel plan equals the plan one rank makes alone; with the
real clock every rank ends with the same plan; the bandwidth probe measures a link."""
import hashlib
import sys

import torch

import rannc
from rannc import _C
import zoo

torch.set_num_threads(1)
rank, world = _C.get_rank(), _C.get_world_size()
FAST = dict(profile_warmup=0, profile_repetitions=1)
model, args, kwargs = zoo.make("gpt", batch=4)
common = dict(world_size=8, devices_per_node=4, device_memory="64MiB")

par = rannc.plan(model, args, kwargs, profile_cache=rannc.ProfileCache(),
                 profile_fake_timer=True, **common, **FAST)
par.validate()
if rank == 0:
    alone = rannc.plan(model, args, kwargs, profile_cache=rannc.ProfileCache(),
                       profile_fake_timer=True, profile_parallel=False, **common, **FAST)
    if alone.deployment.to_bytes() != par.deployment.to_bytes():
        print("rank 0: the parallel plan differs from the single-rank plan", flush=True)
        print(alone.summary(), par.summary(), sep="\n", flush=True)
        sys.exit(1)
    print("fake timer: parallel plan equals single-rank plan", flush=True)

real = rannc.plan(model, args, kwargs, profile_cache=rannc.ProfileCache(), **common, **FAST)
real.validate()
digest = hashlib.sha1(real.deployment.to_bytes()).hexdigest()
bw = rannc.planning.probe_bandwidth(12.5e9)
print(f"rank {rank} plan {digest} intra {bw['intra_node']:.3g} measured {bw['intra_measured']}",
      flush=True)
_C.barrier()
