"""Trains a zoo model with RaNNCModule on every rank and compares, step by step, with
plain PyTorch on the concatenated global batch: loss, this rank's gradients and
parameters after each Adam step. Exits non-zero on the first mismatch.

    train_check.py MODEL STAGES MICROBATCHES [STEPS] [extra options as key=value]
"""
import copy
import sys

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

import rannc
import zoo

name, stages, micro = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
steps = int(sys.argv[4]) if len(sys.argv) > 4 else 5
extra = dict(a.split("=", 1) for a in sys.argv[5:])
rank, world = rannc.get_rank(), rannc.get_world_size()
torch.set_num_threads(1)

local_batch = 4
model, args, kwargs = zoo.make(name, batch=local_batch * world, seed=0)
for m in model.modules():  # dropout masks cannot match a single process: switch it off
    if isinstance(m, nn.Dropout):
        m.p = 0.0
    if isinstance(m, nn.MultiheadAttention):
        m.dropout = 0.0
reference = copy.deepcopy(model)
# eps well above float noise: some gradients are exactly zero in exact arithmetic (the key
# bias of attention), and Adam would turn their rounding noise into full-size steps.
ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2, eps=1e-5)
opt = torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-5)
wrapped = rannc.RaNNCModule(model, opt, num_stages=stages, num_microbatches=micro, **extra)


def local(x):
    if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == local_batch * world:
        return x[rank * local_batch:(rank + 1) * local_batch]
    return x


def close(a, b, what):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m: f"rank {rank}: {what}: {m}")


def fail_everywhere(kind, value, tb):
    """A mismatch on one rank ends every rank (the others may wait for it)."""
    rannc._C.report_failure(f"rank {rank}: {kind.__name__}: {value}")
    sys.__excepthook__(kind, value, tb)


sys.excepthook = fail_everywhere
names = {id(p): n for n, p in model.named_parameters()}
ref_params = dict(reference.named_parameters())
for step in range(steps):
    # a new global batch each step
    _, g_args, g_kwargs = zoo.make(name, batch=local_batch * world, seed=100 + step)
    l_args, l_kwargs = pytree.tree_map(local, (g_args, g_kwargs))

    opt.zero_grad()
    out = wrapped(*l_args, **l_kwargs)
    loss = out["score"] if isinstance(out, dict) else out  # multi_io returns a dict
    loss.backward()
    ref_opt.zero_grad()
    ref_out = reference(*g_args, **g_kwargs)
    ref_loss = ref_out["score"] if isinstance(ref_out, dict) else ref_out
    ref_loss.backward()
    if isinstance(out, dict):  # batch-shaped outputs: this rank's own rows
        close(out["hidden"], local(ref_out["hidden"]).detach(), "hidden rows")
        close(out["aux"][0], local(ref_out["aux"][0]).detach(), "aux rows")
    close(loss.detach(), ref_loss.detach(), f"loss at step {step}")
    own = [p for g in opt.param_groups for p in g["params"]]
    # (a stage without parameters, an elementwise tail say, leaves its ranks nothing to update)
    for p in own:
        close(p.grad, ref_params[names[id(p)]].grad, f"gradient of {names[id(p)]} at step {step}")
    opt.step()
    ref_opt.step()
    for p in own:
        close(p.detach(), ref_params[names[id(p)]].detach(), f"{names[id(p)]} after step {step}")
    if rank == 0:
        print(f"step {step}: loss {loss.item():.6f} (reference {ref_loss.item():.6f})", flush=True)

# every parameter is updated by some rank
counts = torch.zeros(len(names), dtype=torch.int64)
index = {n: i for i, n in enumerate(names.values())}
for p in own:
    counts[index[names[id(p)]]] = 1
rannc._C.Communicator.world_cpu().all_reduce(counts).wait()
assert counts.min().item() >= 1, "some parameter is updated by no rank"
print(f"OK rank {rank}", flush=True)
