"""Each rank keeps only its stage's parameters and buffers (the others are empty tensors),
yet checkpoints are whole: state_dict() and optimizer_state_dict() give the full model and
Adam state under the original names and parameter indices, they load into plain PyTorch,
plain PyTorch's checkpoints load into a freshly wrapped model, and training and eval go on
equal to single-process PyTorch on the global batch. Exits non-zero on the first mismatch.

    checkpoint_check.py MODEL --stages S --micro M
"""
import argparse
import copy
import itertools

import torch

import rannc
import zoo

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("--stages", type=int, default=2)
ap.add_argument("--micro", type=int, default=2)
ap.add_argument("--opt", nargs="*", default=[], help="options of RaNNCModule, key=value")
a = ap.parse_args()
options = dict(o.split("=", 1) for o in a.opt)
rank, world = rannc.get_rank(), rannc.get_world_size()
torch.set_num_threads(1)
zoo.full_fp32()

local_batch = 4
global_batch = local_batch * world
ADAM = dict(lr=1e-2, eps=1e-5)  # eps above float noise (see train_check.py)


def make(seed):
    m, _, _ = zoo.make(a.model, batch=global_batch, seed=seed)
    return zoo.no_dropout(m)


def wrap(m, opt):
    return rannc.RaNNCModule(m, opt, num_stages=a.stages, num_microbatches=a.micro, **options)


batch = zoo.Batches(a.model, world, rank)


def run(m, inputs):
    """The loss of `m` on inputs ((global args, kwargs), (this rank's args, kwargs)): the
    global batch for plain PyTorch, this rank's rows for a RaNNCModule."""
    args, kwargs = inputs[1] if isinstance(m, rannc.RaNNCModule) else inputs[0]
    return zoo.loss_of(m(*args, **kwargs))


def close(x, y, what):
    # on the host: with option device=cuda the stages' tensors are on the GPU
    torch.testing.assert_close(x.cpu(), y.cpu(), rtol=1e-4, atol=1e-5,
                               msg=lambda m: f"rank {rank}: {what}: {m}")


def named_state(m):
    return itertools.chain(m.named_parameters(), m.named_buffers())


def check_freed(w, reference, when, share=True):
    """Exactly the tensors of this rank's deployed stages hold storage; the others are
    empty, storage included. With `share`, that is less than the whole model (not so after
    eval: a rank keeps what its train and its eval stage use, which may be everything).
    Returns (elements held, elements of the whole model)."""
    used = {id(t) for d in w._deployed.values() for t in d.engine.my_state.values()}
    shapes = {n: t.shape for n, t in named_state(reference)}
    held = total = 0
    for name, t in named_state(w.module):
        total += shapes[name].numel()
        if id(t) in used:
            assert t.shape == shapes[name], f"rank {rank}: {name} {t.shape} ({when})"
            held += t.numel()
        else:
            assert t.numel() == 0 and t.untyped_storage().nbytes() == 0, \
                f"rank {rank}: {name} is used by no stage here yet holds {t.numel()} ({when})"
            assert t.grad is None, f"rank {rank}: freed {name} keeps a gradient ({when})"
    assert 0 < held < total or (not share and held == total), \
        f"rank {rank}: holds {held} of {total} elements ({when})"
    return held, total


def check_state(w, reference, when):
    state, expected = w.state_dict(), reference.state_dict()
    assert list(state) == list(expected), f"rank {rank}: keys {list(state)} ({when})"
    for k, v in expected.items():
        close(state[k], v, f"state_dict()[{k!r}] {when}")
    return state


def check_optimizer_state(osd, ref_opt, when):
    expected = ref_opt.state_dict()
    assert osd["param_groups"] == expected["param_groups"], \
        f"rank {rank}: param_groups {osd['param_groups']} ({when})"
    assert sorted(osd["state"]) == sorted(expected["state"]), \
        f"rank {rank}: state of parameters {sorted(osd['state'])} ({when})"
    for i, entry in expected["state"].items():
        assert set(osd["state"][i]) == set(entry), f"rank {rank}: state {i} keys ({when})"
        for key, v in entry.items():
            close(osd["state"][i][key], v, f"optimizer state {i}.{key} {when}")


def train_step(seed, pairs):
    """One Adam step of every (module, optimizer) in pairs; the first one is the plain
    PyTorch reference (global batch); returns the losses."""
    inputs = batch(seed)
    losses = []
    for m, opt in pairs:
        opt.zero_grad()
        loss = run(m, inputs)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


model, reference = make(0), make(0)
opt = torch.optim.Adam(model.parameters(), **ADAM)
ref_opt = torch.optim.Adam(reference.parameters(), **ADAM)
wrapped = wrap(model, opt)

# ---- training frees the other stages' tensors and still equals PyTorch --------------------
for step in range(3):
    ref_loss, loss = train_step(10 + step, [(reference, ref_opt), (wrapped, opt)])
    close(loss, ref_loss, f"loss at step {step}")
    held, total = check_freed(wrapped, reference, f"after step {step}")
names = {id(p): n for n, p in model.named_parameters()}
ref_params = dict(reference.named_parameters())
for g in opt.param_groups:
    for p in g["params"]:
        close(p.detach(), ref_params[names[id(p)]].detach(), f"{names[id(p)]} after training")
print(f"rank {rank}: holds {held} of {total} state elements", flush=True)

# ---- gathered checkpoints: the reference's state, without re-materialising the model -------
state = check_state(wrapped, reference, "after training")
osd = wrapped.optimizer_state_dict()
check_optimizer_state(osd, ref_opt, "after training")
check_freed(wrapped, reference, "after the checkpoint was gathered")

# ... they load into plain PyTorch (a model of another seed, its own Adam)
plain = make(3)
plain.load_state_dict(state)
plain_opt = torch.optim.Adam(plain.parameters(), **ADAM)
plain_opt.load_state_dict(osd)

# ---- plain PyTorch's checkpoint into a freshly wrapped model, after its first call --------
fresh_model = make(4)
fresh_opt = torch.optim.Adam(fresh_model.parameters(), lr=0.5, eps=1e-5)  # lr comes from the dict
fresh = wrap(fresh_model, fresh_opt)
run(fresh, batch(50))  # deploys: only this rank's stage keeps its tensors
check_freed(fresh, reference, "freshly wrapped")
ref_state = reference.state_dict()
freed_here = next(n for n, t in named_state(fresh.module) if t.numel() == 0)
# keys and shapes are checked as torch checks them, the freed tensors' included
for bad, message in [({k: v for k, v in ref_state.items() if k != freed_here}, "Missing key(s)"),
                     ({**ref_state, "nonsense.weight": torch.zeros(2)}, "Unexpected key(s)"),
                     ({**ref_state, freed_here: torch.zeros(3)}, f"size mismatch for {freed_here}")]:
    try:
        fresh.load_state_dict(bad)
        raise AssertionError(f"rank {rank}: load_state_dict accepted a bad dict ({message})")
    except RuntimeError as e:
        assert message in str(e), e
result = fresh.load_state_dict({k: v for k, v in ref_state.items() if k != freed_here},
                               strict=False)
assert result.missing_keys == [freed_here] and result.unexpected_keys == [], result
bad_groups = copy.deepcopy(ref_opt.state_dict())
bad_groups["param_groups"][0]["params"].pop()
try:
    fresh.load_optimizer_state_dict(bad_groups)
    raise AssertionError(f"rank {rank}: load_optimizer_state_dict accepted a short group")
except ValueError as e:
    assert "doesn't match the size" in str(e), e
fresh.load_state_dict(ref_state)
fresh.load_optimizer_state_dict(ref_opt.state_dict())
check_freed(fresh, reference, "after loading")
check_optimizer_state(fresh.optimizer_state_dict(), ref_opt, "loaded into a fresh model")

# ---- all four go on training equal to the reference ---------------------------------------
for step in range(2):
    ref_loss, loss, fresh_loss, plain_loss = train_step(
        20 + step, [(reference, ref_opt), (wrapped, opt), (fresh, fresh_opt), (plain, plain_opt)])
    close(loss, ref_loss, f"loss at step {step} after the checkpoint")
    close(fresh_loss, ref_loss, f"loss of the fresh model at step {step}")
    close(plain_loss, ref_loss, f"loss of plain PyTorch at step {step}")
for name, p in plain.named_parameters():
    close(p.detach(), ref_params[name].detach(), f"plain PyTorch's {name}")
check_state(wrapped, reference, "after more steps")
check_state(fresh, reference, "the fresh model after more steps")
check_optimizer_state(wrapped.optimizer_state_dict(), ref_opt, "after more steps")
check_optimizer_state(fresh.optimizer_state_dict(), ref_opt, "the fresh model after more steps")

# ---- eval after training, and again after more training (the owners' point-to-point sync) -
for round in range(2):
    inputs = batch(90 + round)
    wrapped.eval()
    reference.eval()
    with torch.no_grad():
        close(run(wrapped, inputs), run(reference, inputs), f"eval loss, round {round}")
    check_freed(wrapped, reference, f"after eval round {round}", share=False)
    wrapped.train()
    reference.train()
    ref_loss, loss = train_step(30 + round, [(reference, ref_opt), (wrapped, opt)])
    close(loss, ref_loss, f"loss after eval round {round}")
check_state(wrapped, reference, "at the end")
print(f"OK rank {rank}", flush=True)
