"""RaNNCModule's API besides training: clip_grad_norm over all stages, state_dict gathered
under the original names, load_state_dict, save_plan/load_plan, options from the
environment, unknown options, arguments of other shapes than traced."""
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
# [Note: fixed shapes] in module.py: a sequence of another length than traced is an error
# that every rank raises together, naming the argument; the module goes on afterwards
for length in (6, 10):
    try:
        again(ids[rows][:, :length].repeat(1, 2)[:, :length], targets[rows][:, :length].repeat(1, 2)[:, :length])
        raise AssertionError(f"a sequence of {length} tokens ran on a plan traced at 8")
    except rannc.Error as e:
        assert f"argument args[0] is torch.int64 [*, {length}] in this call but was torch.int64 [*, 8]" in str(e), e
        assert "only the batch dimension may change" in str(e), e
loss = again(ids[rows], targets[rows])
torch.testing.assert_close(loss.detach(), reference(ids, targets).detach(), rtol=1e-4, atol=1e-6)
print(f"OK rank {rank}", flush=True)
