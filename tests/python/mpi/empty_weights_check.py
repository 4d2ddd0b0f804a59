"""A model built with its parameters on the meta device (rannc.empty_weights) and its weights
loaded with load_checkpoint (or load_state_dict) before the first call trains, evaluates and
takes new sequence lengths equal to single-process PyTorch, and no rank ever gives storage
to a parameter its stages do not use; state_dict() and save_checkpoint before the first call,
when no parameter has a value yet, are errors naming the cause. Without a checkpoint,
modules with reset_parameters() are initialised alike on every rank that holds them (a
parameter no stage uses on every rank, as a model built with values keeps it); a parameter
nothing can fill is an error that every rank raises, naming it. Exits non-zero on the first
mismatch.

    empty_weights_check.py MODEL --stages S --micro M --dir DIR [--load state_dict]
"""
import argparse
import os

import torch
import torch.nn as nn

import rannc
import zoo
from rannc.transport import all_gather_objects

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("--stages", type=int, default=2)
ap.add_argument("--micro", type=int, default=2)
ap.add_argument("--dir", required=True)
ap.add_argument("--load", choices=["checkpoint", "state_dict"], default="checkpoint")
a = ap.parse_args()
rank, world = rannc.get_rank(), rannc.get_world_size()
torch.set_num_threads(1)
zoo.full_fp32()
ADAM = dict(lr=1e-2, eps=1e-5)
batch = zoo.Batches(a.model, world, rank)


def make(seed):
    m, _, _ = zoo.make(a.model, batch=4 * world, seed=seed)
    return zoo.no_dropout(m)


def close(x, y, what):
    torch.testing.assert_close(x.detach().cpu(), y.detach().cpu(), rtol=1e-4, atol=1e-5,
                               msg=lambda m: f"rank {rank}: {what}: {m}")


def loss_of(m, inputs):
    args, kwargs = inputs[1] if isinstance(m, rannc.RaNNCModule) else inputs[0]
    return zoo.loss_of(m(*args, **kwargs))


def wrap(m, opt, **options):
    return rannc.RaNNCModule(m, opt, num_stages=a.stages, num_microbatches=a.micro, **options)


def storage_only_where_used(w, when):
    """The parameters this rank's stages use hold storage; no other has ever had any (it
    would show as storage here: freeing keeps the empty tensor). Returns (held, total)."""
    used = {id(t) for d in w._deployed.values() for t in d.engine.my_state.values()}
    held = total = 0
    for (name, p), shaped in zip(w.module.named_parameters(), w.placement.shaped_parameters()):
        full = shaped.shape
        total += full.numel()
        if id(p) in used:
            assert p.shape == full, f"rank {rank}: {name} {p.shape}, not {full} ({when})"
            held += p.numel()
        else:
            assert p.numel() == 0 and p.untyped_storage().nbytes() == 0, \
                f"rank {rank}: {name} is used by no stage here yet holds {p.numel()} ({when})"
    return held, total


# ---- a checkpoint loaded before the first call ------------------------------------------------
reference = make(0)
path = os.path.join(a.dir, f"{a.model}.pt")
if rank == 0:
    torch.save(reference.state_dict(), path)
rannc.barrier()

with rannc.empty_weights():
    model = make(0)
assert all(p.is_meta for p in model.parameters()), "empty_weights left a parameter with storage"
assert not any(b.is_meta for b in model.buffers()), "empty_weights put a buffer on meta"
opt = torch.optim.Adam(model.parameters(), **ADAM)
ref_opt = torch.optim.Adam(reference.parameters(), **ADAM)
wrapped = wrap(model, opt)
assert all(p.numel() == 0 for p in model.parameters())  # swapped for empty ones, same objects
assert all(any(p is q for q in model.parameters()) for p in opt.param_groups[0]["params"])
if a.load == "checkpoint":
    wrapped.load_checkpoint(path)
else:  # read at the first call, as a checkpoint is
    keys = wrapped.load_state_dict(torch.load(path))
    assert not keys.missing_keys and not keys.unexpected_keys, keys
# no values yet: refused, and what was loaded stays to read at the first call
for what, before in (("state_dict()", wrapped.state_dict),
                     ("optimizer_state_dict()", wrapped.optimizer_state_dict),
                     ("save_checkpoint", lambda: wrapped.save_checkpoint(os.path.join(a.dir, "early")))):
    try:
        before()
        raise AssertionError(f"rank {rank}: {what} before the first call of a meta model passed")
    except rannc.Error as e:
        assert what in str(e) and "meta device" in str(e) and "no values yet" in str(e), e
assert not os.path.exists(os.path.join(a.dir, "early")), "the refused save left a directory"

for step in range(3):
    inputs = batch(10 + step)
    losses = []
    for m, o in ((reference, ref_opt), (wrapped, opt)):
        o.zero_grad()
        loss = loss_of(m, inputs)
        loss.backward()
        o.step()
        losses.append(loss)
    close(losses[1], losses[0], f"loss at step {step}")
    held, total = storage_only_where_used(wrapped, f"after step {step}")
    assert a.stages == 1 or held < total, f"rank {rank}: holds {held} of {total} elements"
ref_params = dict(reference.named_parameters())
for name, p in model.named_parameters():
    if p.numel():
        close(p, ref_params[name], f"{name} after training")

# eval (a new mode, planned from stand-ins: no rank gathers the whole model) and training again
wrapped.eval()
reference.eval()
with torch.no_grad():
    inputs = batch(40)
    close(loss_of(wrapped, inputs), loss_of(reference, inputs), "eval loss")
wrapped.train()
reference.train()
if a.model == "gpt":  # new input shapes, traced from stand-ins
    inputs = batch(50, length=12)
    close(loss_of(wrapped, inputs), loss_of(reference, inputs), "loss at a new sequence length")
for name, t in wrapped.state_dict().items():  # gathered from the owners, equal to PyTorch's
    close(t, reference.state_dict()[name], f"state_dict()[{name!r}]")
print(f"rank {rank}: holds {held} of {total} parameter elements", flush=True)

# ---- no checkpoint: reset_parameters() of each module, alike on every rank ----------------------
with rannc.empty_weights():
    fresh = make(1)
    fresh.unused = nn.Linear(3, 5)  # no stage uses it: every rank keeps it, initialised alike
fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1)
fresh_wrapped = wrap(fresh, fresh_opt)
loss = loss_of(fresh_wrapped, batch(60))
loss.backward()
fresh_opt.step()
assert torch.isfinite(loss), f"rank {rank}: loss {loss}"
mine = {n: p.detach().clone() for n, p in fresh.named_parameters() if p.numel()}
assert all(torch.isfinite(v).all() for v in mine.values()), f"rank {rank}: not finite"
assert mine["unused.weight"].shape == (5, 3), f"rank {rank}: {mine.get('unused.weight')}"
everyone = all_gather_objects(mine)  # a rank's stage may hold no parameter at all
assert any(v.numel() > 1 and v.std() > 0 for held in everyone for v in held.values())
for n, v in mine.items():
    for r, theirs in enumerate(everyone):
        if n in theirs:  # every rank that holds it initialised and stepped it alike
            torch.testing.assert_close(theirs[n], v, rtol=0, atol=0,
                                       msg=lambda m: f"rank {rank}: {n} differs from rank {r}'s: {m}")


# ---- a parameter with no checkpoint and no reset_parameters(): named on every rank ---------------
class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 4)
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x, y):
        return ((self.lin(x) * self.scale - y) ** 2).mean()


with rannc.empty_weights():
    bare = Scaled()
bare_wrapped = rannc.RaNNCModule(bare, torch.optim.SGD(bare.parameters(), lr=0.1), num_stages=1)
try:
    bare_wrapped(torch.randn(4, 16), torch.randn(4, 4))
    raise AssertionError(f"rank {rank}: a parameter without a value went unnoticed")
except rannc.Error as e:
    assert "scale" in str(e) and "load_checkpoint" in str(e) and "lin.weight" not in str(e), e
print(f"OK rank {rank}", flush=True)
