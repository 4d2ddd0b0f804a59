"""RaNNCModule's API besides training: clip_grad_norm over all stages, state_dict gathered
under the original names, load_state_dict, save_plan/load_plan, options from the
environment, unknown options, arguments of other shapes than traced (traced again)."""
import copy
import os
import sys
import tempfile

import torch

import rannc
import zoo

rank, world = rannc.get_rank(), rannc.get_world_size()
torch.set_num_threads(1)


local_batch = 4
model, (ids, targets), _ = zoo.make("gpt", batch=local_batch * world)
zoo.no_dropout(model)
reference = copy.deepcopy(model)
rows = slice(rank * local_batch, (rank + 1) * local_batch)

# unknown options are an error naming them
try:
    rannc.RaNNCModule(model, num_stagez=2)
    raise AssertionError("an unknown option was accepted")
except rannc.Error as e:
    assert "num_stagez" in str(e), e

# options from the environment: RANNC_NUM_STAGES
os.environ["RANNC_NUM_STAGES"] = "2"
plan_file = os.path.join(tempfile.gettempdir(), f"rannc_plan_{os.getppid()}.bin")
opt = torch.optim.SGD(model.parameters(), lr=0.1)
wrapped = rannc.RaNNCModule(model, opt, num_microbatches=2, save_plan=plan_file)
del os.environ["RANNC_NUM_STAGES"]
loss = wrapped(ids[rows], targets[rows])
loss.backward()
deployment = wrapped.deployments["train"]
assert deployment.num_stages == 2, deployment.report()

# clip_grad_norm: the global norm over all stages, as torch computes it on the whole model
ref_loss = reference(ids, targets)
ref_loss.backward()
# the inf norm: the largest gradient entry over all stages (max_norm too large to clip)
expected_inf = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9, norm_type=float("inf"))
total_inf = wrapped.clip_grad_norm(1e9, norm_type=float("inf"))
torch.testing.assert_close(total_inf, expected_inf.float(), rtol=1e-5, atol=1e-8)
expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
total = wrapped.clip_grad_norm(0.05)
torch.testing.assert_close(total, expected.float(), rtol=1e-4, atol=1e-6)
names = {id(p): n for n, p in model.named_parameters()}
ref = dict(reference.named_parameters())
for g in opt.param_groups:
    for p in g["params"]:
        torch.testing.assert_close(p.grad, ref[names[id(p)]].grad, rtol=1e-4, atol=1e-6)
opt.step()
torch.optim.SGD(reference.parameters(), lr=0.1).step()

# state_dict: every rank gets the whole, updated model under the original names
state = wrapped.state_dict()
assert set(state) == set(reference.state_dict()), sorted(set(state) ^ set(reference.state_dict()))
for k, v in reference.state_dict().items():
    torch.testing.assert_close(state[k], v, rtol=1e-4, atol=1e-6, msg=lambda m: f"{k}: {m}")

# load_state_dict then a step gives the reference's loss
fresh, _, _ = zoo.make("gpt", batch=local_batch * world, seed=5)
wrapped.load_state_dict(state)
loss = wrapped(ids[rows], targets[rows])
torch.testing.assert_close(loss.detach(), reference(ids, targets).detach(), rtol=1e-4, atol=1e-6)

# load_plan: a new module of the same model reuses the saved plan
rannc.barrier(60)
again = rannc.RaNNCModule(copy.deepcopy(reference), load_plan=plan_file)
again(ids[rows], targets[rows])
loaded = again.deployments["train"]
assert loaded.to_bytes() == deployment.to_bytes()
# [Note: new input shapes] in deployed.py: a sequence of another length than traced is traced
# again and runs the loaded plan, equal to PyTorch; a length seen before reuses its trace
def length(t, n):
    return t.repeat(1, 2)[:, :n].contiguous()


for n in (6, 10, 6):
    loss = again(length(ids[rows], n), length(targets[rows], n))
    torch.testing.assert_close(loss.detach(), reference(length(ids, n), length(targets, n)).detach(),
                               rtol=1e-4, atol=1e-6)
    assert again.deployments["train"].to_bytes() == deployment.to_bytes()
# ranks passing different lengths in one call: an error on every rank naming this rank's shapes;
# the module goes on afterwards
try:
    n = 6 + rank
    again(length(ids[rows], n), length(targets[rows], n))
    raise AssertionError("ranks with different sequence lengths ran")
except rannc.Error as e:
    assert "the ranks' arguments differ in dtype or in shape besides the batch dimension" in str(e), e
    assert f"this rank passed args[0] int64 [*, {n}], args[1] int64 [*, {n}]" in str(e), e
loss = again(ids[rows], targets[rows])
torch.testing.assert_close(loss.detach(), reference(ids, targets).detach(), rtol=1e-4, atol=1e-6)
print(f"OK rank {rank}", flush=True)
