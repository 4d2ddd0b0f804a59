"""[Note: memory at other batches] in csrc/runtime/batch_memory.h: a plan made to fit a memory
limit at the first call's batch and shapes runs a larger batch, and longer sequences, in more
micro-batches, so that its predicted peak stays within the limit, and still equals
single-process PyTorch. Under fill-drain, which keeps every micro-batch in flight, no count
fits and a warning says so. Exits non-zero on the first mismatch.

    batch_memory_check.py --schedule 1f1b|fill_drain
"""
import argparse
import copy

import torch

import rannc
from models import GPT, TransformerConfig

ap = argparse.ArgumentParser()
ap.add_argument("--schedule", default="1f1b")
a = ap.parse_args()
rank, world = rannc.get_rank(), rannc.get_world_size()
torch.set_num_threads(1)
torch.manual_seed(0)
# small weights, large activations: the stash is most of a stage's memory
model = GPT(TransformerConfig(vocab=64, hidden=32, heads=2, layers=4, max_len=128, dropout=0.0))
reference = copy.deepcopy(model)
opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, reference))


def batch(seed, rows, length):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (rows * world, length), generator=g)
    return ids, ids.roll(1, dims=1)


def limit_for(rows, length):
    """device_memory under which the plan of 2 stages x 2 micro-batches just fits this
    batch: its predicted peak with 10% to spare (the margin option keeps 10% more)."""
    ids, targets = batch(0, rows, length)
    probe = rannc.plan(copy.deepcopy(reference), (ids[:rows], targets[:rows]), num_stages=2,
                       num_microbatches=2, world_size=world, schedule=a.schedule, optimizer="sgd")
    return int(max(s.memory_bytes for s in probe.deployment.stages) * 1.1 / 0.9)


wrapped = rannc.RaNNCModule(model, opt, num_stages=2, num_microbatches=2, schedule=a.schedule,
                            device_memory=limit_for(4, 32))
for step, (rows, length) in enumerate([(4, 32), (16, 32), (4, 96)]):
    ids, targets = batch(step + 1, rows, length)
    mine = slice(rank * rows, (rank + 1) * rows)
    losses = []
    for m, o, args in ((reference, ref_opt, (ids, targets)), (wrapped, opt, (ids[mine], targets[mine]))):
        o.zero_grad()
        loss = m(*args)
        loss.backward()
        o.step()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6,
                               msg=lambda m: f"rank {rank}: loss at {rows} rows x {length}: {m}")
    deployed = wrapped._deployed[True]
    engine = deployed.last_trained.engine  # the variant of these shapes, which just ran
    fit, plan = engine.memory_fit, deployed.deployment
    assert plan.micro_batches == 2 and plan.feasible, plan.summary()
    micro = engine.layout.micro_batches
    if step == 0:
        assert micro == 2 and fit.fits, (micro, fit.peak_bytes, plan.memory_limit)
    elif a.schedule == "1f1b":  # four times the rows, or three times the length: more micro-batches
        assert micro > 2 and fit.fits and fit.peak_bytes <= plan.memory_limit, \
            (rows, length, micro, fit.peak_bytes, plan.memory_limit)
    else:  # fill-drain keeps them all in flight: no count fits, the lowest peak's runs
        assert not fit.fits and fit.peak_bytes > plan.memory_limit, \
            (rows, length, micro, fit.peak_bytes, plan.memory_limit)
    print(f"rank {rank}: {rows} rows x {length}: {micro} micro-batches, peak "
          f"{fit.peak_bytes} of {plan.memory_limit}", flush=True)
for p, q in zip(model.parameters(), reference.parameters()):
    if p.numel():
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-4, atol=1e-6)
print(f"OK rank {rank}", flush=True)
