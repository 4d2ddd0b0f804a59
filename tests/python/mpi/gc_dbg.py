import copy, sys, torch, rannc, hf_zoo
torch.set_num_threads(1)
rank, world = rannc.get_rank(), rannc.get_world_size()
B = 2; mine = slice(rank * B, (rank + 1) * B)
model, _, batch = hf_zoo.make(sys.argv[2], batch=B * world)
reference = copy.deepcopy(model)
wrapped = rannc.RaNNCModule(model, num_stages=2, replicas=sys.argv[1])
wrapped.eval(); reference.eval()
g = torch.Generator().manual_seed(1)
prompts = torch.randint(1, hf_zoo.VOCAB, (B * world, 32), generator=g)
mask = torch.ones_like(prompts); mask[::2, :3] = 0; mask[:, 12:] = 0
with torch.no_grad():
    o = wrapped(input_ids=prompts[mine], attention_mask=mask[mine])
    r = reference(input_ids=prompts, attention_mask=mask)
    d = (o.logits[:, :12] - r.logits[mine][:, :12]).abs().amax(dim=(1, 2))
    print(rank, d.tolist(), flush=True)
