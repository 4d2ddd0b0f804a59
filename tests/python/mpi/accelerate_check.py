"""accelerate's own training loop (no Trainer) over a RaNNCModule on several ranks, against
the same loop over the plain model in one process on the same global batches.

    python accelerate_check.py reference OUT [--bf16] [--cuda]   # one process, the plain model
    mpirun -np N python accelerate_check.py rannc OUT STAGES [--bf16] [--cuda]

The loop a user of accelerate writes: `accelerator.prepare(model, optimizer, dataloader,
scheduler)` (the dataloader sharded over the ranks), `accumulate(model)` over 2 batches per
step (DDP's no_sync between), `accelerator.backward(loss)`, `clip_grad_norm_`, the
optimizer and scheduler steps, `save_state` after step 2; at the end `get_state_dict`,
`unwrap_model(...).save_pretrained(..., save_function=accelerator.save)`. Then a new
RaNNCModule over other weights, prepared by a new Accelerator, `load_state`s the step-2
checkpoint and trains steps 3-4 again. Every loss and gradient norm, the saved files and
the resumed run's end must equal the reference's. --bf16: Accelerator(mixed_precision="bf16").
--cuda: accelerate on the GPU (tests/gpu; ranks share it), the reference on the same GPU,
neither with TF32.
"""
import json
import os
import sys

import torch

torch.set_num_threads(1)

import rannc  # noqa: E402

mode, out = sys.argv[1], sys.argv[2]
stages = int(sys.argv[3]) if mode == "rannc" else 1
bf16 = "--bf16" in sys.argv
cuda = "--cuda" in sys.argv
if mode == "rannc":
    rannc.init_process_group()  # before the Accelerator: it reads the process group

import accelerate  # noqa: E402
import safetensors.torch  # noqa: E402

import hf_zoo  # noqa: E402
import zoo  # noqa: E402

zoo.full_fp32()  # the GPU in full float32 (no TF32), as the reference

GLOBAL_BATCH, STEPS, ACCUMULATE = 8, 4, 2
world = rannc.get_world_size() if mode == "rannc" else 1
tolerance = dict(rtol=2e-2, atol=2e-2) if bf16 else dict(rtol=1e-4, atol=1e-5)


class Texts(torch.utils.data.Dataset):
    """Token rows; a third of the labels ignored (-100)."""

    def __len__(self):
        return GLOBAL_BATCH * ACCUMULATE * STEPS

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, hf_zoo.VOCAB, (16,), generator=g)
        return {"input_ids": ids,
                "labels": ids.masked_fill(torch.rand(16, generator=g) < 0.3, -100)}


def prepared(seed):
    """A fresh Accelerator and what it prepared: model, optimizer, scheduler, dataloader."""
    accelerator = accelerate.Accelerator(gradient_accumulation_steps=ACCUMULATE, cpu=not cuda,
                                         mixed_precision="bf16" if bf16 else "no")
    model, _, _ = hf_zoo.make("hf_gpt2", batch=GLOBAL_BATCH, seed=seed)
    if mode == "rannc":
        model = rannc.RaNNCModule(model, num_stages=stages)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # accelerate steps the scheduler once per process at each step (a schedule written for
    # the batches of one process), as under DDP
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (s // world + 1))
    loader = torch.utils.data.DataLoader(Texts(), batch_size=GLOBAL_BATCH // world)
    return (accelerator, *accelerator.prepare(model, optimizer, scheduler, loader))


def train(accelerator, model, optimizer, scheduler, loader, first_step, checkpoint=None):
    """Steps first_step..STEPS; returns each batch's loss (the global batch's) and each
    step's gradient norm."""
    losses, norms, step = [], [], 0
    for i, batch in enumerate(loader):
        if i < (first_step - 1) * ACCUMULATE:
            continue
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            # a DDP rank's loss is its own rows': the mean over the ranks is the global one
            losses.append(accelerator.reduce(loss.detach(), "mean").item() if mode == "reference"
                          else loss.item())
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            step = first_step + len(norms) - 1
            if step == 2 and checkpoint:
                accelerator.save_state(checkpoint)
    return losses, norms


def saved(accelerator, model, directory):
    """The model saved as accelerate's docs write it: on the main process, from the
    state_dict every process gathered."""
    accelerator.wait_for_everyone()
    state = accelerator.get_state_dict(model)
    accelerator.unwrap_model(model).save_pretrained(
        directory, is_main_process=accelerator.is_main_process, save_function=accelerator.save,
        state_dict=state)
    accelerator.wait_for_everyone()
    return safetensors.torch.load_file(os.path.join(directory, "model.safetensors"))


accelerator, model, optimizer, scheduler, loader = prepared(0)
losses, norms = train(accelerator, model, optimizer, scheduler, loader, 1,
                      os.path.join(out, mode + "-checkpoint"))
weights = saved(accelerator, model, os.path.join(out, mode))
if mode == "reference":
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump({"losses": losses, "norms": norms}, f)
    sys.exit(0)

rank = rannc.get_rank()
with open(os.path.join(out, "reference.json")) as f:
    reference = json.load(f)


def same(got, want, what):
    torch.testing.assert_close(torch.as_tensor(got), torch.as_tensor(want), **tolerance,
                               msg=lambda m: f"rank {rank}, {what}: {m}")


def same_weights(got, what):
    want = safetensors.torch.load_file(os.path.join(out, "reference", "model.safetensors"))
    # the reference's file drops the tied lm_head.weight; the module's state_dict under
    # accelerate gives it a copy ([Note: accelerate] in module.py), so it is saved too
    assert set(want) <= set(got) <= set(want) | {"lm_head.weight"}, (what, set(got) ^ set(want))
    for name, value in want.items():
        same(got[name], value, f"{what}, {name}")


assert type(model).__name__.startswith("RaNNCModule"), type(model)  # not wrapped in DDP
# the Accelerator's mixed precision reaches the stages ([Note: accelerate] in module.py)
assert (model._deployed[True].amp == torch.bfloat16) == bf16, model._deployed[True].amp
same(losses, reference["losses"], "losses")
same(norms, reference["norms"], "gradient norms")
same_weights(weights, "the saved model")
# accelerate's checkpoint: its model file and the whole optimizer, saved by the main process
ours, theirs = (torch.load(os.path.join(out, m + "-checkpoint", "optimizer.bin"))
                for m in ("rannc", "reference"))
assert ours["param_groups"] == theirs["param_groups"], (ours["param_groups"], theirs["param_groups"])
assert ours["state"].keys() == theirs["state"].keys()
for index, state in theirs["state"].items():
    for key, value in state.items():
        same(ours["state"][index][key], value, f"optimizer state {index}.{key}")

# resumed: other weights, a new Accelerator; load_state before the first call
accelerator, model, optimizer, scheduler, loader = prepared(5)
accelerator.load_state(os.path.join(out, "rannc-checkpoint"))
losses, norms = train(accelerator, model, optimizer, scheduler, loader, 3)
same(losses, reference["losses"][2 * ACCUMULATE:], "resumed losses")
same(norms, reference["norms"][2:], "resumed gradient norms")
same_weights(saved(accelerator, model, os.path.join(out, "resumed")), "the resumed model")
print(f"OK rank {rank}", flush=True)
