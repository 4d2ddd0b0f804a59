"""A parameter read by two stages, only one of which computes its gradient, trains as in
PyTorch: tests/python/test_module.py. The plan comes from the fake timer, which cuts the
model where the two reads fall on both stages (each mode checks that it did).
Modes:
  detach      the head reads the embedding detached (a tied weight that only the first
              stage's gradient reaches): [Note: gradients reached elsewhere]
  zeros_like  the last stage reads the first layer's weight for its type only
  shape       nanoGPT's LayerNorm, `F.layer_norm(x, self.weight.shape, ...)`: the size is a
              constant ([Note: shapes of the model's state]), and no parameter is shared
After 4 Adam steps every rank's state_dict() and optimizer.state_dict() equal PyTorch's."""
import copy
import sys

import torch
import torch.nn as nn

import rannc

torch.set_num_threads(1)
rank, world = rannc.get_rank(), rannc.get_world_size()
mode = sys.argv[1]
# the fake timer cuts 5 of these layers between a norm's size read and the norm (before its fold)
LAYERS = 5 if mode == "shape" else 6


class ShapeReadingLayerNorm(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.bias = nn.Parameter(torch.zeros(n))

    def forward(self, x):
        return nn.functional.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(LAYERS))
        self.norms = nn.ModuleList(ShapeReadingLayerNorm(16) for _ in range(LAYERS))

    def forward(self, x, y):
        h = self.emb(x)
        for layer, norm in zip(self.layers, self.norms):
            h = torch.tanh(layer(norm(h) if mode == "shape" else h))
        if mode == "detach":
            logits = h @ self.emb.weight.detach().t()
        elif mode == "zeros_like":
            logits = h @ self.emb.weight.t() + torch.zeros_like(self.layers[0].weight).sum()
        else:
            logits = h @ self.emb.weight.t()
        return nn.functional.cross_entropy(logits.reshape(-1, 32), y.reshape(-1))


torch.manual_seed(0)
model = Model()
reference = copy.deepcopy(model)
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
wrapped = rannc.RaNNCModule(model, opt, num_stages=2, num_microbatches=2, profile_fake_timer=True)
g = torch.Generator().manual_seed(1)
for step in range(4):
    x = torch.randint(0, 32, (4 * world, 8), generator=g)
    y = torch.randint(0, 32, (4 * world, 8), generator=g)
    ref_loss = reference(x, y)
    ref_loss.backward()
    ref_opt.step()
    ref_opt.zero_grad()
    mine = slice(rank * 4, (rank + 1) * 4)
    loss = wrapped(x[mine], y[mine])
    loss.backward()
    opt.step()
    opt.zero_grad()
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item()), \
        f"rank {rank}: loss {loss.item()} vs {ref_loss.item()} at step {step}"

deployed = wrapped._deployed[True]
shared = sorted(deployed.graph.ir.value(v).name for ranks, vids in deployed.engine.grad_groups()
                if len(ranks) == 2 for v in vids)
expected = {"detach": ["emb.weight"], "zeros_like": ["emb.weight", "layers.0.weight"],
            "shape": ["emb.weight"]}[mode]  # the head ties it, with gradients on both
assert shared == expected, f"rank {rank}: the plan shares {shared} across the stages, not {expected}"

state, ref_state = wrapped.state_dict(), reference.state_dict()
for name, value in ref_state.items():
    torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6,
                               msg=lambda m: f"rank {rank}: state_dict()[{name!r}]: {m}")
opt_state, ref_opt_state = opt.state_dict()["state"], ref_opt.state_dict()["state"]
assert sorted(opt_state) == sorted(ref_opt_state), \
    f"rank {rank}: optimizer state of parameters {sorted(opt_state)}, not {sorted(ref_opt_state)}"
for index, entry in ref_opt_state.items():
    for key, value in entry.items():
        torch.testing.assert_close(opt_state[index][key].float(), value.float(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"rank {rank}: optimizer state [{index}][{key}]: {m}")
print(f"OK rank {rank}", flush=True)
