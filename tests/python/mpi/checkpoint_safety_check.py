"""What a sharded checkpoint survives, and what it costs in memory, under real mpirun:

    fail --dir D --rank R     a save whose writes fail on rank R raises on every rank, naming
                              rank R and the cause, and leaves the previous checkpoint in D
    die --dir D --rank R      rank R dies in the middle of a save (the job ends; the test then
                              loads D with `load` and finds the previous checkpoint)
    load --dir D --step S     D loads (read at the first call), holds the state after S steps
                              (plain PyTorch's); with --error TEXT, loading or the first call
                              fails on every rank with TEXT instead
    memory --dir D            peak resident memory of each rank while saving and loading
                              (prints it; asserts the bound of [Note: checkpoint memory])

Exits non-zero on the first mismatch.
"""
import argparse
import glob
import json
import os
import sys

import torch
import torch.nn as nn

import rannc
import rannc.safetensors_io
import zoo

ap = argparse.ArgumentParser()
ap.add_argument("phase", choices=["fail", "die", "load", "memory"])
ap.add_argument("--dir", required=True)
ap.add_argument("--rank", type=int, default=1)
ap.add_argument("--step", type=int, default=1)
ap.add_argument("--error")
a = ap.parse_args()
rank, world = rannc.get_rank(), rannc.get_world_size()
torch.set_num_threads(1)
batches = zoo.Batches("mlp", world, rank)
ADAM = dict(lr=1e-2, eps=1e-5)


def wrapped_mlp(seed):
    m, _, _ = zoo.make("mlp", batch=8, seed=seed)
    m = zoo.no_dropout(m)
    opt = torch.optim.Adam(m.parameters(), **ADAM)
    return rannc.RaNNCModule(m, opt, num_stages=2, num_microbatches=2, cost_model="analytic"), opt


def step(m, opt, seed):
    both = batches(seed, local_batch=8 // world)
    args, kwargs = both[1] if isinstance(m, rannc.RaNNCModule) else both[0]
    opt.zero_grad()
    m(*args, **kwargs).backward()
    opt.step()


def metadata():
    return json.load(open(os.path.join(a.dir, "rannc_checkpoint.json")))


def leftovers():
    return glob.glob(glob.escape(os.path.abspath(a.dir)) + ".*")


if a.phase in ("fail", "die"):
    w, opt = wrapped_mlp(0)
    step(w, opt, 10)
    parent = os.path.dirname(os.path.abspath(a.dir))
    if rank == 0:
        open(os.path.join(parent, "notes.txt"), "w").write("the user's file")
    rannc.barrier()
    try:  # a directory that holds something else is never replaced
        w.save_checkpoint(parent)
        raise AssertionError(f"rank {rank}: save_checkpoint replaced a directory of other files")
    except rannc.Error as e:
        assert "exists and is not a rannc checkpoint" in str(e), e
    assert open(os.path.join(parent, "notes.txt")).read() == "the user's file"
    w.save_checkpoint(a.dir)
    step(w, opt, 11)
    if rank == a.rank:
        def broken(path, tensors, metadata=None):
            if a.phase == "die":
                print(f"rank {rank} dies while saving", flush=True)
                os._exit(3)
            raise OSError(28, "No space left on device", path)
        rannc.safetensors_io.write_file = broken
    try:
        w.save_checkpoint(a.dir)
        raise AssertionError(f"rank {rank}: a save whose writes failed on rank {a.rank} passed")
    except rannc.Error as e:
        assert f"rank {a.rank}: OSError" in str(e) and "No space left" in str(e), e
        print(f"rank {rank}: {e}", flush=True)
    assert metadata()["optimizer_step"] == 1, "the previous checkpoint was replaced"
    assert not leftovers(), f"left behind: {leftovers()}"

elif a.phase == "load":
    w, opt = wrapped_mlp(5)
    try:
        w.load_checkpoint(a.dir)
        # the first call deploys, and only then are the tensors of this rank's stage read
        both = batches(99, local_batch=8 // world)
        w(*both[1][0], **both[1][1]).backward()
        opt.zero_grad()
        assert a.error is None, f"rank {rank}: loading a damaged checkpoint passed"
    except rannc.Error as e:
        if a.error is None or a.error not in str(e):
            raise
        print(f"rank {rank}: {e}", flush=True)
        print(f"OK rank {rank}", flush=True)
        sys.exit(0)
    reference, _, _ = zoo.make("mlp", batch=8, seed=0)
    reference = zoo.no_dropout(reference)
    ref_opt = torch.optim.Adam(reference.parameters(), **ADAM)
    for s in range(a.step):
        step(reference, ref_opt, 10 + s)
    state = w.state_dict()
    for k, v in reference.state_dict().items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6)
    osd = w.optimizer_state_dict()
    assert all(int(s["step"]) == a.step for s in osd["state"].values()), osd["state"]

elif a.phase == "memory":
    # 16 layers of 1024 x 1024 (4 MiB each): 64 MiB of weights and 128 MiB of Adam state
    WIDTH, LAYERS = 1024, 16

    class Deep(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])

        def forward(self, x):
            return self.layers(x).square().mean()

    def vm(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024

    def peak_while(action):
        """Bytes of resident memory above the start at the peak while `action` runs."""
        open("/proc/self/clear_refs", "w").write("5")  # resets VmHWM to the current RSS
        before = vm("VmRSS")
        action()
        return vm("VmHWM") - before

    def build(seed):
        torch.manual_seed(seed)
        m = Deep()
        opt = torch.optim.Adam(m.parameters(), lr=1e-3)
        w = rannc.RaNNCModule(m, opt, num_stages=world, num_microbatches=1, cost_model="analytic")
        w(torch.randn(2, WIDTH)).backward()
        opt.step()  # the optimizer holds its state, as in training
        return w, opt

    w, opt = build(0)
    own = sum(t.numel() * t.element_size() for t in [*w.module.parameters(), *w.module.buffers()])
    own += sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
               if isinstance(v, torch.Tensor))
    largest = WIDTH * WIDTH * 4
    whole = LAYERS * (WIDTH * WIDTH + WIDTH) * 4 * 3
    save = peak_while(lambda: w.save_checkpoint(a.dir))
    w2, opt2 = build(1)
    load = peak_while(lambda: w2.load_checkpoint(a.dir))
    gathered = peak_while(lambda: w.state_dict())
    mib = 2 ** 20
    print(f"rank {rank}: own state {own / mib:.1f} MiB of {whole / mib:.1f} MiB; peak above "
          f"the start while saving {save / mib:.1f} MiB, loading {load / mib:.1f} MiB, "
          f"gathering state_dict() {gathered / mib:.1f} MiB", flush=True)
    bound = largest + 8 * mib  # one tensor (a GPU tensor passes the host once) and slack
    assert save <= bound and load <= bound, \
        f"rank {rank}: saving took {save / mib:.1f} MiB, loading {load / mib:.1f} MiB above " \
        f"the start; the bound is {bound / mib:.1f} MiB"
    for (n, p), (_, q) in zip(w.module.named_parameters(), w2.module.named_parameters()):
        assert torch.equal(p, q), f"rank {rank}: {n} was not loaded"

print(f"OK rank {rank}", flush=True)
