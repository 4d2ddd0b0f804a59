"""transformers' Trainer with NEFTune (neftune_noise_alpha) over a RaNNCModule.

    mpirun -np N python neftune_check.py OUT

NEFTune adds uniform noise to the input embeddings in training, as a forward hook that
Trainer registers on `model.get_input_embeddings()` when training starts and removes at its
end (an AttributeError on a RaNNCModule before session 30). The hook is traced into the
training graph (its noise drawn on the stage at each step, as dropout's masks are) and not
into evaluation's; the noise scale follows the traced length. Its random values once glued
the whole model into one task, which no plan could cut ([Note: random values] in
csrc/frontend/convert.cpp). Trained losses differ from a run without it. The group rannc.init_process_group() made
is destroyed at exit, which the script never asks for (gloo's threads aborted the
interpreter's teardown now and then).
"""
import atexit
import sys

import torch
import torch.distributed as dist

torch.set_num_threads(1)

import rannc  # noqa: E402

# runs after rannc's own exit handler (last registered, first run): the group it made is
# gone by then ([Note: the group ends before the interpreter] in process_group.py)
atexit.register(lambda: print(f"at exit rank {rannc.get_rank()}: group initialized "
                              f"{dist.is_initialized()}", flush=True))
rannc.init_process_group()

import transformers as tf  # noqa: E402

import hf_zoo  # noqa: E402

out = sys.argv[1]
rank, world = rannc.get_rank(), rannc.get_world_size()


class Texts(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, hf_zoo.VOCAB, (16,), generator=g)
        return {"input_ids": ids, "labels": ids}


def trained(alpha):
    model, _, _ = hf_zoo.make("hf_gpt2", batch=8)
    wrapped = rannc.RaNNCModule(model, num_stages=2)
    args = tf.TrainingArguments(f"{out}/{alpha}", per_device_train_batch_size=8 // world,
                                per_device_eval_batch_size=8 // world, max_steps=2,
                                logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
                                neftune_noise_alpha=alpha, disable_tqdm=True)
    trainer = tf.Trainer(model=wrapped, args=args, train_dataset=Texts(), eval_dataset=Texts())
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return trainer, wrapped, model, losses


trainer, wrapped, model, noisy = trained(5.0)
ir = wrapped._deployed[True].graph.ir
noise = [t.op for t in ir.tasks() if "aten::uniform_" in t.op.split("+")]
# the noise is drawn in a task of its own: its random values did not glue the model into one
# task ([Note: random values] in csrc/frontend/convert.cpp), so stages can be cut
assert noise == ["aten::zeros_like+aten::uniform_"], noise
assert ir.num_tasks > 100, ir.num_tasks
assert wrapped._deployed[True].deployment.stages[0].tasks and wrapped._deployed[True].deployment.stages[1].tasks
assert not model.get_input_embeddings()._forward_hooks  # Trainer removed its hook
trainer.evaluate()  # noise-free: evaluation's trace draws none
assert not any("aten::uniform_" in t.op.split("+") for t in wrapped._deployed[False].graph.ir.tasks())
_, _, _, clean = trained(None)
assert noisy[0] != clean[0], (noisy, clean)  # the noise is in the training step
print(f"OK rank {rank}", flush=True)
