"""Sharded checkpoints under real mpirun, one phase per launch (every rank exits between
phases, as after a kill):

    straight --out F   train N+M steps without a stop; rank 0 writes the losses and the
                       final state to F
    save --dir D       train N steps, save_checkpoint(D); checks that each tensor was written
                       once, by a rank holding it, and that the index lists every tensor
    resume --dir D     a model of another seed loads D (before its first call, or after a
                       first call with --deploy-first), trains M steps; the losses and the
                       parameters equal plain PyTorch's N+M steps, and with --exact F, equal
                       the straight run's bit for bit
    weights --dir D    a model of another seed loads the weights in D (a Hugging Face
                       directory or a state_dict file of the seed-0 model), trains M steps
                       equal to plain PyTorch from those weights

The global batch is 8 rows whatever the world size, so layouts of 1, 2 and 4 ranks train
the same model on the same data. Exits non-zero on the first mismatch.
"""
import argparse
import json
import os

import torch

import rannc
import zoo

ap = argparse.ArgumentParser()
ap.add_argument("phase", choices=["straight", "save", "resume", "weights"])
ap.add_argument("--model", default="gpt")
ap.add_argument("--dir")
ap.add_argument("--out")
ap.add_argument("--exact", help="the straight run's file: resumed results must equal it exactly")
ap.add_argument("--deploy-first", choices=["none", "train", "eval"], default="none")
ap.add_argument("--stages", type=int, default=2)
ap.add_argument("--micro", type=int, default=2)
ap.add_argument("--opt", nargs="*", default=[], help="options of RaNNCModule, key=value")
a = ap.parse_args()
options = dict(o.split("=", 1) for o in a.opt)
rank, world = rannc.get_rank(), rannc.get_world_size()
torch.set_num_threads(1)
zoo.full_fp32()  # with option device=cuda: no TF32 against the CPU's float32

N, M = 3, 2
GLOBAL = 8
ADAM = dict(lr=1e-2, eps=1e-5)
batches = zoo.Batches(a.model, world, rank)


def make(seed):
    m, _, _ = zoo.make(a.model, batch=GLOBAL, seed=seed)
    return zoo.no_dropout(m)


def wrapped_model(seed, lr=ADAM["lr"]):
    m = make(seed)
    opt = torch.optim.Adam(m.parameters(), lr=lr, eps=ADAM["eps"])
    return rannc.RaNNCModule(m, opt, num_stages=a.stages, num_microbatches=a.micro,
                             **options), opt


def step(m, opt, seed):
    """One Adam step on batch `seed`: the global batch for plain PyTorch, this rank's rows
    of it for a RaNNCModule; returns the loss."""
    both = batches(seed, local_batch=GLOBAL // world)
    args, kwargs = both[1] if isinstance(m, rannc.RaNNCModule) else both[0]
    opt.zero_grad()
    loss = zoo.loss_of(m(*args, **kwargs))
    loss.backward()
    opt.step()
    return float(loss.detach())


def close(x, y, what, exact=False):
    if exact:
        assert torch.equal(x, y), f"rank {rank}: {what}: {x} != {y} (expected bit for bit)"
    else:
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"rank {rank}: {what}: {m}")


if a.phase == "straight":
    w, opt = wrapped_model(0)
    losses = [step(w, opt, 10 + i) for i in range(N + M)]
    state = w.state_dict()
    if rank == 0:
        torch.save({"losses": losses, "state": state}, a.out)

elif a.phase == "save":
    w, opt = wrapped_model(0)
    losses = [step(w, opt, 10 + i) for i in range(N)]
    w.save_checkpoint(a.dir, extra={"losses": losses, "next": N})
    meta = json.load(open(os.path.join(a.dir, "rannc_checkpoint.json")))
    index = json.load(open(os.path.join(a.dir, "model.safetensors.index.json")))
    state = w.placement.module_state_dict(keep_vars=True)  # what this rank holds
    first = {}
    for name, t in state.items():
        first.setdefault(id(t), name)
    # every tensor once, under its first name; tied names are aliases
    assert sorted(index["weight_map"]) == sorted(first.values()), \
        f"rank {rank}: index {sorted(index['weight_map'])} vs {sorted(first.values())}"
    assert set(meta["aliases"]) == set(state) - set(first.values()), meta["aliases"]
    # each tensor is in one shard, written by a rank that holds it; every rank writes a part
    from rannc.transport import all_gather_objects
    from safetensors import safe_open
    held = all_gather_objects({n for n, t in state.items() if t.numel() == t.shape.numel()
                               and t.untyped_storage().nbytes() > 0})
    shards = sorted(set(index["weight_map"].values()))
    seen = []
    for f in shards:
        with safe_open(os.path.join(a.dir, f), "pt") as st:
            names = list(st.keys())
        seen += names
        assert any(set(names) <= h for h in held), f"no rank holds all of {f}: {names}"
    assert sorted(seen) == sorted(index["weight_map"]), "a tensor was written twice or never"
    assert meta["world_size"] == world and meta["optimizer_step"] == N, meta["optimizer_step"]
    assert len(shards) == world, f"{len(shards)} model shards for {world} ranks: {shards}"
    assert os.path.exists(os.path.join(a.dir, "plan-train.rannc"))
    assert not [d for d in os.listdir(os.path.dirname(os.path.abspath(a.dir)))
                if ".tmp-" in d or ".old-" in d], "a temporary directory was left behind"

elif a.phase == "resume":
    # another seed and another learning rate: the checkpoint brings both
    w, opt = wrapped_model(7, lr=0.5)
    if a.deploy_first != "none":
        both = batches(99, local_batch=GLOBAL // world)
        args, kwargs = both[1]
        if a.deploy_first == "eval":
            w.eval()
            with torch.no_grad():
                w(*args, **kwargs)
            w.train()
        else:
            zoo.loss_of(w(*args, **kwargs)).backward()
            opt.zero_grad()
    extra = w.load_checkpoint(a.dir)
    assert extra["next"] == N, extra
    losses = extra["losses"] + [step(w, opt, 10 + N + i) for i in range(M)]
    assert opt.param_groups[0]["lr"] == ADAM["lr"], opt.param_groups[0]["lr"]
    # plain PyTorch, N + M steps without a stop
    reference = make(0)
    ref_opt = torch.optim.Adam(reference.parameters(), **ADAM)
    ref_losses = [step(reference, ref_opt, 10 + i) for i in range(N + M)]
    close(torch.tensor(losses), torch.tensor(ref_losses), "losses against plain PyTorch")
    state = w.state_dict()
    for k, v in reference.state_dict().items():
        close(state[k], v, f"{k} against plain PyTorch")
    if a.exact:
        straight = torch.load(a.exact)
        close(torch.tensor(losses), torch.tensor(straight["losses"]), "losses", exact=True)
        for k, v in straight["state"].items():
            close(state[k], v, k, exact=True)
    print(f"rank {rank}: losses {[round(x, 5) for x in losses]}", flush=True)

elif a.phase == "weights":
    w, opt = wrapped_model(7)
    assert w.load_checkpoint(a.dir) is None
    reference = make(0)
    ref_opt = torch.optim.Adam(reference.parameters(), **ADAM)
    for i in range(M):
        close(torch.tensor(step(w, opt, 20 + i)), torch.tensor(step(reference, ref_opt, 20 + i)),
              f"loss at step {i}")
    state = w.state_dict()
    for k, v in reference.state_dict().items():
        close(state[k], v, f"{k} against plain PyTorch")

print(f"OK rank {rank}", flush=True)
