"""Models whose precision autocast does not decide alone, trained under
torch.autocast("cpu", bfloat16) equal to one process under the same autocast:
  matmul: an autograd.Function written with torch.amp.custom_fwd / custom_bwd, a matmul of
      a bf16 activation and an fp32 weight inside ([Note: autocast in Python ops] in
      csrc/bind/module.cpp; it failed with "expected m1 and m2 to have the same dtype");
  cast_inputs: the same Function with custom_fwd(cast_inputs=torch.float32): it computes
      in fp32 and returns fp32;
  island: a block under torch.autocast(enabled=False) in forward (an fp32 island, as
      rotary embeddings are). The last two were recorded as bf16 values (the observation
      runs ran the graph under autocast again), so a stage boundary after them was sized
      for bf16: MPI_ERR_TRUNCATE.

    amp_function_check.py VARIANT STAGES MICRO [option=value ...]
"""
import copy
import sys

import torch

import rannc

torch.set_num_threads(1)


VARIANT = sys.argv[1]


class HalfScaled(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu",
                          cast_inputs=torch.float32 if VARIANT == "cast_inputs" else None)
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return torch.matmul(x, w.t()) * 0.5  # autocast casts w to x's bf16

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g = g * 0.5
        return g.matmul(w), g.t().matmul(x)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.w = torch.nn.Parameter(torch.randn(16, 16) * 0.2)
        self.b = torch.nn.Linear(16, 1)

    def forward(self, x, y):
        h = torch.relu(self.a(x))
        if VARIANT == "island":
            with torch.autocast("cpu", enabled=False):
                h = torch.relu(torch.matmul(h.float(), self.w.t()))
        else:
            h = HalfScaled.apply(h, self.w)
        h = h * 2.0  # a stage may start here, receiving h in the dtype it was made in
        return torch.nn.functional.mse_loss(self.b(h).float(), y)


stages, micro = int(sys.argv[2]), int(sys.argv[3])
options = dict(o.split("=", 1) for o in sys.argv[4:])
rank, world = rannc.get_rank(), rannc.get_world_size()
torch.manual_seed(0)
model = Model()
reference = copy.deepcopy(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
wrapped = rannc.RaNNCModule(model, opt, num_stages=stages, num_microbatches=micro, **options)
for step in range(3):
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(8 * world, 8, generator=gen), torch.randn(8 * world, 1, generator=gen)
    mine = slice(8 * rank, 8 * rank + 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = wrapped(x[mine], y[mine])
        ref_loss = reference(x, y)
    loss.backward()
    ref_loss.backward()
    opt.step()
    ref_opt.step()
    opt.zero_grad()
    ref_opt.zero_grad()
    # bf16: each micro-batch's matmul rounds on its own
    torch.testing.assert_close(loss, ref_loss, rtol=2e-2, atol=1e-3,
                               msg=lambda m: f"rank {rank}: loss at step {step}: {m}")
ref = dict(reference.named_parameters())
for name, p in model.named_parameters():
    if p.numel():  # the others are freed on this rank
        torch.testing.assert_close(p.detach(), ref[name].detach(), rtol=2e-2, atol=2e-3,
                                   msg=lambda m: f"rank {rank}: {name}: {m}")
print(f"OK rank {rank}", flush=True)
