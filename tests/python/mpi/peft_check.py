"""PEFT's LoRA over transformers GPT-2 in a RaNNCModule, against the same PeftModel in one
process on the whole batch: the frozen base weights and the trained adapters.

    mpirun -np N python peft_check.py OUT

3 AdamW steps over the adapters only: the losses and the whole state equal PyTorch's; then
adapter_state_dict() gathers the adapters alone; model.save_pretrained(OUT) on rank 0 alone
(which gathers them alone too, the other ranks serving from their next call) writes PEFT's adapter files (adapter_config.json
and the adapters' weights, not the base model's), which PeftModel.from_pretrained loads
over the base model to the trained adapters; after another step, load_adapter on every
rank reads them back into the stages (an adapter the model lacks is an error).
"""
import copy
import os
import sys

import torch

torch.set_num_threads(1)

import peft  # noqa: E402

import hf_zoo  # noqa: E402
import rannc  # noqa: E402

out = sys.argv[1]
rank, world = rannc.get_rank(), rannc.get_world_size()
base, _, kwargs = hf_zoo.make("hf_gpt2", batch=8)
pristine = copy.deepcopy(base)
torch.manual_seed(1)
config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"],
                         lora_dropout=0.0, fan_in_fan_out=True)
model = peft.get_peft_model(base, config)
with torch.no_grad():  # LoRA's B starts at zero: so that the first step moves A too
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.normal_(0, 0.02)
reference = copy.deepcopy(model)
trained = [p for p in model.parameters() if p.requires_grad]
opt = torch.optim.AdamW(trained, lr=1e-2)
ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2)
wrapped = rannc.RaNNCModule(model, opt)
rows = 8 // world
mine = slice(rank * rows, (rank + 1) * rows)
for step in range(3):
    loss = wrapped(input_ids=kwargs["input_ids"][mine], labels=kwargs["labels"][mine]).loss
    ref_loss = reference(**kwargs).loss
    torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=1e-5, atol=1e-6,
                               msg=lambda m: f"rank {rank}, step {step}: {m}")
    loss.backward()
    ref_loss.backward()
    for o in (opt, ref_opt):
        o.step()
        o.zero_grad()
state = wrapped.state_dict()
for name, value in reference.state_dict().items():
    torch.testing.assert_close(state[name], value, rtol=1e-4, atol=1e-6,
                               msg=lambda m: f"rank {rank}, {name}: {m}")
# the adapters alone, on every rank: the base model's weights move nowhere
adapters = wrapped.adapter_state_dict()
assert set(adapters) == {n for n, p in reference.named_parameters() if p.requires_grad}, sorted(adapters)
for name, value in adapters.items():
    torch.testing.assert_close(value, state[name], rtol=0, atol=0)
if rank == 0:
    wrapped.save_pretrained(out)  # the other ranks serve the gather from their next call
wrapped.eval()
wrapped(input_ids=kwargs["input_ids"][mine])
files = sorted(os.listdir(out))
assert "adapter_config.json" in files and "adapter_model.safetensors" in files, files
loaded = peft.PeftModel.from_pretrained(pristine, out)
expected = reference.state_dict()
for name, value in loaded.state_dict().items():
    torch.testing.assert_close(value, expected[name], rtol=1e-4, atol=1e-6,
                               msg=lambda m: f"rank {rank}, loaded {name}: {m}")
# load_adapter reads the saved adapters back into the stages on every rank (as Trainer
# resumes from an adapter checkpoint): after one more step it holds the saved ones again
wrapped.train()
wrapped(input_ids=kwargs["input_ids"][mine], labels=kwargs["labels"][mine]).loss.backward()
opt.step()
opt.zero_grad()
result = wrapped.load_adapter(out, "default", is_trainable=True)
assert not result.missing_keys and not result.unexpected_keys, result
state = wrapped.state_dict()
for name, value in expected.items():
    torch.testing.assert_close(state[name], value, rtol=1e-4, atol=1e-6,
                               msg=lambda m: f"rank {rank}, load_adapter {name}: {m}")
try:
    wrapped.load_adapter(out, "second")
except ValueError as e:
    assert "no adapter 'second'" in str(e), e
else:
    raise AssertionError("load_adapter of an adapter the model lacks did not fail")
print(f"OK rank {rank}", flush=True)
