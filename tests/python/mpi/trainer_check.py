"""transformers' Trainer training a RaNNCModule on several ranks, against Trainer training
the plain model in one process on the same global batches.

    python trainer_check.py reference OUT [FLAGS]       # one process, the plain model
    mpirun -np N python trainer_check.py rannc OUT STAGES [FLAGS]

FLAGS: --bf16, --accumulate, --smooth, --checkpointing, --lora, --dynamic, --cuda.

--accumulate: 2 accumulated batches per step, whose tokens Trainer counts over all of them
(num_items_in_batch); a third of the labels are -100, so the batches weigh unlike.
--smooth: Trainer's label smoother makes the loss from the logits (rannc's fill-drain,
gradients from outside), shifting a causal LM's labels.
--checkpointing: gradient_checkpointing=True, which makes every stage recompute.
--lora: PEFT's LoRA adapters over the frozen GPT-2 (Trainer keeps the columns that the base
model's forward names; its checkpoints and saved model are PEFT's adapter directories, which
PeftModel.from_pretrained reads and a resume loads; with --smooth the label smoother shifts
the base causal LM's labels, as for a PeftModel in one process).
--dynamic: rows of 6 to 16 tokens, which a collator pads to each batch's longest, in a
DataLoader worker under rannc: the ranks' lengths differ, and the module pads each call to
the longest of the call (option pad_values="transformers", [Note: padding calls]).
--cuda: Trainer on the GPU (tests/gpu), the reference on the same GPU; no TF32 in either.
Trainer moves the model to its device and the batches there; the stages run on each rank's
GPU, ranks sharing one ([Note: a DDP script's environment on GPUs] in process_group.py,
[Note: moving a wrapped model] in module.py).

The rannc run trains 4 steps with a checkpoint every 2 and an evaluation every 2 (loss,
and accuracy by compute_metrics over the gathered logits), loads the best checkpoint at the
end, saves the model (from_pretrained loads it: Trainer writes config.json beside a
RaNNCModule's weights since session 31), then trains again from checkpoint-2 in a new
Trainer over a differently initialised model. Both must log the reference's losses, gradient norms and evaluation losses, and end
with its weights: Trainer saves each checkpoint on rank 0 alone (model and optimizer
state_dict(), which the other ranks serve) and reads it back on every rank.
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
accumulate = 2 if "--accumulate" in sys.argv else 1
smoothing = 0.1 if "--smooth" in sys.argv else 0.0
checkpointing = "--checkpointing" in sys.argv
lora = "--lora" in sys.argv
dynamic = "--dynamic" in sys.argv
cuda = "--cuda" in sys.argv
if mode == "rannc":
    rannc.init_process_group()  # before TrainingArguments: accelerate reads the group

import safetensors.torch  # noqa: E402
import transformers as tf  # noqa: E402

import hf_zoo  # noqa: E402
import zoo  # noqa: E402

zoo.full_fp32()  # the GPU in full float32 (no TF32), as the reference

GLOBAL_BATCH, STEPS = 8, 4
world = rannc.get_world_size() if mode == "rannc" else 1


class Texts(torch.utils.data.Dataset):
    """Token rows; a third of the labels ignored (-100), as padding gives them."""

    def __init__(self, n, offset=0):
        self.n, self.offset = n, offset

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(self.offset + i)
        length = 6 + (self.offset + i) * 7 % 11 if dynamic else 16
        ids = torch.randint(0, hf_zoo.VOCAB, (length,), generator=g)
        labels = ids.masked_fill(torch.rand(length, generator=g) < 0.3, -100)
        return {"input_ids": ids, "labels": labels}


def pad_to_longest(rows):
    """A collator's dynamic padding: to the batch's longest row, masked, labels ignored."""
    longest = max(len(r["input_ids"]) for r in rows)

    def padded(key, value):
        return torch.stack([torch.nn.functional.pad(r[key], (0, longest - len(r[key])), value=value)
                            for r in rows])
    mask = torch.stack([(torch.arange(longest) < len(r["input_ids"])).long() for r in rows])
    return {"input_ids": padded("input_ids", 0), "attention_mask": mask,
            "labels": padded("labels", -100)}


def make_model(seed, adapter_seed=None):
    """GPT-2 from `seed`; with --lora, its LoRA adapters from `adapter_seed` (default seed)."""
    model, _, _ = hf_zoo.make("hf_gpt2", batch=GLOBAL_BATCH, seed=seed)
    if lora:
        import peft
        torch.manual_seed((seed if adapter_seed is None else adapter_seed) + 1)
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0, fan_in_fan_out=True))
        with torch.no_grad():  # LoRA's B starts at zero: so that the first step moves A too
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.02)
    return model


def trainer(model, directory):
    args = tf.TrainingArguments(
        output_dir=directory, per_device_train_batch_size=GLOBAL_BATCH // world,
        per_device_eval_batch_size=GLOBAL_BATCH // world, max_steps=STEPS, logging_steps=1,
        gradient_accumulation_steps=accumulate, label_smoothing_factor=smoothing,
        gradient_checkpointing=checkpointing,
        eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2,
        load_best_model_at_end=True, metric_for_best_model="eval_loss",  # a barrier, a load
        learning_rate=1e-3, max_grad_norm=1.0, warmup_steps=1, report_to=[], use_cpu=not cuda,
        dataloader_drop_last=True, bf16=bf16, disable_tqdm=True,
        # the collator in a worker process, where no collective may run
        dataloader_num_workers=1 if dynamic and mode == "rannc" else 0)
    return tf.Trainer(model=model, args=args, train_dataset=Texts(64),
                      eval_dataset=Texts(16, offset=1000), compute_metrics=accuracy,
                      data_collator=pad_to_longest if dynamic else None)


def accuracy(prediction):
    """compute_metrics: over the logits and labels Trainer gathered from every rank."""
    guess = prediction.predictions[:, :-1].argmax(-1)
    labels = prediction.label_ids[:, 1:]
    counted = labels != -100
    return {"accuracy": float((guess[counted] == labels[counted]).mean()),
            "rows": float(len(labels))}


def logs(t):
    """Per step: (loss, grad_norm) of training; per evaluation: loss, accuracy, rows."""
    train = [(h["loss"], h["grad_norm"]) for h in t.state.log_history if "loss" in h]
    evals = [[h["eval_loss"], h["eval_accuracy"], h["eval_rows"]]
             for h in t.state.log_history if "eval_loss" in h]
    return train, evals


if mode == "reference":
    t = trainer(make_model(0), os.path.join(out, "reference"))
    # before training: accelerate prepares the model for evaluation only (train() then
    # starts a new log history)
    before = t.evaluate()["eval_loss"]
    t.train()
    train, evals = logs(t)
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump({"train": train, "evals": evals, "before": before}, f)
    safetensors.torch.save_file({k: v.detach().cpu().clone()
                                 for k, v in t.model.state_dict().items()},
                                os.path.join(out, "reference.safetensors"))
    sys.exit(0)

rank = rannc.get_rank()
with open(os.path.join(out, "reference.json")) as f:
    reference = json.load(f)
expected = safetensors.torch.load_file(os.path.join(out, "reference.safetensors"))
tolerance = dict(rtol=2e-2, atol=2e-2) if bf16 else dict(rtol=1e-4, atol=1e-5)


def same_logs(t, what):
    train, evals = logs(t)
    want = reference["train"]
    assert len(train) == len(want), (what, train, want)
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(train, want)):
        torch.testing.assert_close(torch.tensor([loss, norm]), torch.tensor([ref_loss, ref_norm]),
                                   **tolerance, msg=lambda m: f"{what}, step {step}: {m}")
    torch.testing.assert_close(torch.tensor(evals), torch.tensor(reference["evals"]), **tolerance)


def model_layers():
    return make_model(0).config.n_layer


def same_weights(directory, what):
    """The model Trainer saved in `directory` (on rank 0) holds the reference's weights.
    With --lora it is PEFT's adapter directory, as Trainer writes for a PeftModel in one
    process ([Note: Trainer's saved models]): the adapters alone, read over the base."""
    files = set(os.listdir(directory))
    if lora:
        import peft
        assert {"adapter_config.json", "adapter_model.safetensors"} <= files \
            and "model.safetensors" not in files, (what, files)
        saved = safetensors.torch.load_file(os.path.join(directory, "adapter_model.safetensors"))
        assert all("lora_" in k for k in saved) and len(saved) == 2 * model_layers(), \
            (what, sorted(saved))
        model = peft.PeftModel.from_pretrained(make_model(0, adapter_seed=7).get_base_model(),
                                               directory)
    else:
        saved = safetensors.torch.load_file(os.path.join(directory, "model.safetensors"))
        model = make_model(7)
        missing, unexpected = model.load_state_dict(saved, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (what, missing, unexpected)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, expected[name], **tolerance,
                                   msg=lambda m: f"{what}, {name}: {m}")


directory = os.path.join(out, "rannc")
padding = {"pad_values": "transformers"} if dynamic else {}
t = trainer(rannc.RaNNCModule(make_model(0), num_stages=stages, **padding), directory)
# evaluated before training: its loss was N times the loss on N ranks before session 30
# (accelerate prepares the model for evaluation without telling it, [Note: accelerate])
torch.testing.assert_close(torch.tensor(t.evaluate()["eval_loss"]), torch.tensor(reference["before"]),
                           **tolerance)
t.train()
# the stages run on each rank's GPU (local rank modulo the GPUs), as Trainer's batches do
assert t.model.device == (t.args.device if cuda else torch.device("cpu")), \
    (t.model.device, t.args.device)
# Trainer's bf16=True reaches the stages through accelerate's state ([Note: accelerate])
assert (t.model._deployed[True].amp == torch.bfloat16) == bf16
# Trainer builds its AdamW before the first call: the plan counted its state
assert t.model._planned_optimizer_kind == "adam", t.model._planned_optimizer_kind
# Trainer's gradient_checkpointing=True: every stage recomputes ([Note: activation checkpointing])
recomputed = [s.recompute for s in t.model._deployed[True].deployment.stages]
assert all(recomputed) if checkpointing else not any(recomputed), recomputed
same_logs(t, "trained")
t.save_model(os.path.join(out, "final"))  # rank 0 alone gathers and writes
# the other ranks serve rank 0's gather from inside torch's barrier
torch.distributed.barrier()
same_weights(os.path.join(out, "final"), "the saved model")
if not lora:  # from_pretrained reads Trainer's directories ([Note: Trainer's saved models])
    for where in ("final", os.path.join("rannc", "checkpoint-2")):
        assert os.path.exists(os.path.join(out, where, "config.json")), where
    loaded = tf.AutoModelForCausalLM.from_pretrained(os.path.join(out, "final"))
    assert type(loaded).__name__ == "GPT2LMHeadModel", type(loaded)
    for name, value in loaded.state_dict().items():
        torch.testing.assert_close(value, expected[name], **tolerance,
                                   msg=lambda m: f"from_pretrained, {name}: {m}")
optimizer = torch.load(os.path.join(directory, "checkpoint-2", "optimizer.pt"))
count = sum(len(g["params"]) for g in optimizer["param_groups"])
assert count == len([p for p in make_model(0).parameters() if p.requires_grad]) and len(optimizer["state"]) == count, \
    "the checkpoint's optimizer state is not the whole optimizer's"
# resumed: a new model (other weights; with --lora, other adapters over the same frozen
# base, which PEFT's checkpoints do not hold) and Trainer read checkpoint-2 on every rank
resumed = make_model(0, adapter_seed=5) if lora else make_model(5)
t = trainer(rannc.RaNNCModule(resumed, num_stages=stages, **padding), directory)
t.train(resume_from_checkpoint=os.path.join(directory, "checkpoint-2"))
same_logs(t, "resumed")  # steps 1-2 from the checkpoint's history, 3-4 run again
t.save_model(os.path.join(out, "resumed"))
torch.distributed.barrier()
same_weights(os.path.join(out, "resumed"), "the resumed model")
print(f"OK rank {rank}", flush=True)
