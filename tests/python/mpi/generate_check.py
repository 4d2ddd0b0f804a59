"""transformers' generate() on a RaNNCModule under mpirun ([Note: generation through the
pipeline] in python/rannc/generation.py): after AdamW steps, every rank generates from its
own left-padded prompts after an evaluation with labels, greedy and sampled (each rank to its own length: the ranks done
keep the forwards going), equal to the plain model's generate() on those prompts; an
encoder-decoder's generate() is an error naming why.

    generate_check.py MODEL STAGES [REPLICAS]      MODEL: a decoder of tests/python/hf_zoo.py
"""
import copy
import sys

import torch

import rannc
import hf_zoo
import zoo

torch.set_num_threads(1)
zoo.full_fp32()  # tests/gpu runs it with the stages on the GPU, against the CPU
rank, world = rannc.get_rank(), rannc.get_world_size()
name, stages = sys.argv[1], int(sys.argv[2])
replicas = sys.argv[3] if len(sys.argv) > 3 else None
B = 2
mine = slice(rank * B, (rank + 1) * B)

model, _, batch = hf_zoo.make(name, batch=B * world)
model.config.pad_token_id = 0
reference = copy.deepcopy(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
wrapped = rannc.RaNNCModule(model, opt, num_stages=stages, replicas=replicas)
for step in range(2):
    wrapped(**{k: v[mine] for k, v in batch.items()}).loss.backward()
    reference(**batch).loss.backward()
    for o in (opt, ref_opt):
        o.step()
        o.zero_grad()

g = torch.Generator().manual_seed(1)
prompts = torch.randint(1, hf_zoo.VOCAB, (B * world, 8), generator=g)
mask = torch.ones_like(prompts)
mask[::2, :3] = 0  # left padding, as a tokenizer pads prompts for generation
# an evaluation with labels first: generate()'s forwards take other arguments, another
# program beside it ([Note: other arguments] in module.py)
wrapped.eval()
reference.eval()
with torch.no_grad():
    loss = wrapped(**{k: v[mine] for k, v in batch.items()}).loss
    ref_loss = sum(reference(**{k: v[r * B:(r + 1) * B] for k, v in batch.items()}).loss
                   for r in range(world)) / world
torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
# what a user (and diffusers' pipelines) read of a model: its dtype and device, trained
assert (wrapped.dtype, wrapped.device) == (reference.dtype, reference.device), (wrapped.dtype, wrapped.device)
wrapped.train()  # generate() runs in eval mode and returns the module to training mode
for sample in (False, True):
    new = (16 if rank % 2 else 5) if sample else 12  # sampled: each rank to its own length
    torch.manual_seed(7)
    mine_out = wrapped.generate(prompts[mine], attention_mask=mask[mine], max_new_tokens=new,
                                do_sample=sample, top_k=10)
    torch.manual_seed(7)
    ref_out = reference.generate(prompts[mine], attention_mask=mask[mine], max_new_tokens=new,
                                 do_sample=sample, top_k=10, use_cache=False)
    assert mine_out.shape == (B, 8 + new), (mine_out.shape, new)
    assert torch.equal(mine_out, ref_out), f"rank {rank}, sample={sample}:\n{mine_out}\n{ref_out}"
    assert wrapped.training

# an encoder-decoder generates with its encoder alone: refused, naming it
t5, _, _ = hf_zoo.make("hf_t5", batch=B)
try:
    rannc.RaNNCModule(t5, num_stages=stages).generate(prompts[mine], max_new_tokens=2)
    raise AssertionError(f"rank {rank}: T5's generate() did not fail")
except rannc.Error as e:
    assert "an encoder-decoder model" in str(e), e
print(f"OK rank {rank}", flush=True)
