"""Hugging Face transformers models (tests/python/hf_zoo.py: BERT, GPT-2, Llama, T5, ViT,
Swin, ConvBERT, Mixtral, Funnel; small configs, random weights), as a user passes them: planned from real
profiles into several stages, the stages chained equal to the model; trained with
RaNNCModule under mpirun equal to plain PyTorch on the global batch (loss, gradients,
parameters after Adam steps, logits, eval)."""
import pytest
import torch

import rannc
import hf_zoo
from rannc.planning import rows_coupled
from mpirun import mpirun

FAST = dict(profile_warmup=0, profile_repetitions=1)


@pytest.mark.parametrize("name", hf_zoo.NAMES)
def test_hf_models_plan_from_profiles_into_stages_that_run_like_the_model(name):
    model, args, kwargs = hf_zoo.make(name, batch=4)
    model.train()
    plan = rannc.plan(model, args, kwargs, world_size=4, devices_per_node=4,
                      device_memory="1GiB", num_stages=3, **FAST)
    plan.validate()
    d = plan.deployment
    assert d.feasible and d.num_stages == 3
    # none of them couples its rows ([Note: rows coupled]; Funnel's x.new_ones did)
    assert not rows_coupled(plan.graph), rows_coupled(plan.graph)
    g = plan.graph
    flat = g._flat_inputs(args, kwargs)
    torch.manual_seed(0)
    whole = g._trace.traced.run(flat)
    torch.manual_seed(0)
    chained = g._trace.traced.run_chained(plan.stage_pieces(), flat)
    for a, b in zip(whole, chained):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    ref = model(*args, **kwargs)
    torch.testing.assert_close(g(*args, **kwargs).loss, ref.loss)


# (ranks, model, stages, micro-batches, extra arguments of train_check.py)
HF_LAYOUTS = [
    (2, "hf_gpt2", 2, 2, ["--eval"]),                        # 2 stages, tied embeddings
    (2, "hf_bert", 1, 2, ["--opt", "replicas=2"]),           # 1 stage x 2 replicas, padding mask
    (2, "hf_vit", 2, 2, []),
    (2, "hf_llama", 2, 2, []),
    (2, "hf_t5", 2, 2, []),                                  # encoder-decoder, relative buckets
    (2, "hf_gpt2", 2, 2, ["--opt", "schedule=fill_drain"]),
    (2, "hf_swin", 2, 2, []),                                # shifted windows, x * x
    (2, "hf_convbert", 2, 2, []),                            # x += bias: in-place writes
    (2, "hf_mixtral", 2, 2, []),                             # mixture of experts (batched_mm)
    (2, "hf_gpt_oss", 2, 2, []),                             # sinks, sliding windows, grouped_mm
    (2, "hf_deepseek_v3", 1, 2, ["--opt", "replicas=2"]),    # latent attention, experts, replicas
    (2, "hf_qwen3_next", 2, 2, ["--lengths", "16,12,20"]),   # linear attention at new lengths
    (2, "hf_wav2vec2_ctc", 2, 2, []),                        # CTC over masked labels, a sum
    (2, "hf_t5", 2, 2, ["--lengths", "16,12,20"]),           # dynamic padding: new lengths
    (2, "hf_llama", 2, 2, ["--lengths", "16,9,20"]),
    (2, "hf_funnel", 2, 2, []),                              # pooled along the sequence
    (2, "hf_llama_cls", 2, 2, []),                           # padding mask: no longer one task
]


@pytest.mark.parametrize("ranks,model,stages,micro,extra", HF_LAYOUTS,
                         ids=[f"{r}ranks-{m}-{s}st-{mb}mb" + ("-fd" if "schedule=fill_drain" in e else "")
                              + ("-lengths" if "--lengths" in e else "")
                              for r, m, s, mb, e in HF_LAYOUTS])
def test_hf_training_equals_pytorch(ranks, model, stages, micro, extra):
    res = mpirun("train_check.py", ranks, model, "--stages", stages, "--micro", micro,
                 "--steps", 3, *extra, timeout=300, env={"RANNC_COMM_TIMEOUT": "60"})
    assert res.returncode == 0, res.stdout[-4000:]
    for r in range(ranks):
        assert f"OK rank {r}" in res.stdout, res.stdout[-4000:]


# (ranks, stages, precision): 2 stages with Trainer's label smoothing; 2 stages x 2
# replicas with 2 accumulated batches per step; bf16 through TrainingArguments, with
# gradient checkpointing; PEFT's LoRA
TRAINER_LAYOUTS = [(2, 2, "fp32-smooth"), (4, 2, "fp32-accumulate"),
                   (2, 2, "bf16-checkpointing"), (2, 2, "fp32-lora"), (2, 2, "fp32-dynamic")]


@pytest.mark.parametrize("ranks,stages,precision", TRAINER_LAYOUTS,
                         ids=[f"{r}ranks-{s}st-{p}" for r, s, p in TRAINER_LAYOUTS])
def test_transformers_trainer_on_several_ranks_equals_one_process(tmp_path, ranks, stages,
                                                                  precision):
    """transformers' Trainer over a RaNNCModule under mpirun logs the losses, gradient norms
    and evaluation losses of Trainer over the plain model in one process, saves checkpoints
    on rank 0 alone that hold the whole model and optimizer, and resumes from one to the same
    end (mpi/trainer_check.py). With gradient accumulation Trainer weighs the accumulated
    batches by their tokens (num_items_in_batch) and its label smoother shifts the causal
    LM's labels, as in one process ([Note: accelerate]); with gradient_checkpointing=True every
    stage recomputes ([Note: activation checkpointing]). With a collator's dynamic padding
    (in a DataLoader worker) the ranks' lengths differ, and the module pads each call
    (pad_values="transformers", [Note: padding calls])."""
    flags = {"bf16-checkpointing": ["--bf16", "--checkpointing"],
             "fp32-accumulate": ["--accumulate"],
             "fp32-smooth": ["--smooth"], "fp32-lora": ["--lora", "--smooth"],
             "fp32-dynamic": ["--dynamic"]}[precision]
    run_trainer_check(tmp_path, ranks, stages, flags)


def run_trainer_check(tmp_path, ranks, stages, flags):
    """mpi/trainer_check.py: the reference in one process, then Trainer over a RaNNCModule
    on `ranks` ranks (also tests/gpu's, with --cuda)."""
    run_against_one_process(tmp_path, "trainer_check.py", ranks, stages, flags)


def run_against_one_process(tmp_path, script, ranks, stages, flags):
    """mpi/<script> `reference` in one process (no MPI launcher: accelerate sees one
    process), then `rannc` over `ranks` ranks, which compares with the reference's files."""
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [here, os.path.join(here, "..", "..", "python"), os.path.join(here, "..", "..", "examples"),
         os.environ.get("PYTHONPATH", "")]))
    # the reference: one process, no MPI launcher (accelerate sees one process)
    for key in [k for k in env if k.startswith(("OMPI_", "PMI", "PMIX"))]:
        del env[key]
    ref = subprocess.run([sys.executable, os.path.join(here, "mpi", script),
                          "reference", str(tmp_path), *flags], env=env, capture_output=True,
                         text=True, timeout=300)
    assert ref.returncode == 0, (ref.stdout + ref.stderr)[-4000:]
    res = mpirun(script, ranks, "rannc", str(tmp_path), stages, *flags,
                 timeout=400, env={"RANNC_COMM_TIMEOUT": "60"})
    assert res.returncode == 0, res.stdout[-4000:]
    for r in range(ranks):
        assert f"OK rank {r}" in res.stdout, res.stdout[-4000:]


@pytest.mark.parametrize("ranks,stages,flags", [(2, 2, []), (4, 2, ["--bf16"])],
                         ids=["2ranks-2st-fp32", "4ranks-2st-bf16"])
def test_accelerate_training_loop_on_several_ranks_equals_one_process(tmp_path, ranks, stages,
                                                                      flags):
    """accelerate's own loop (prepare, accumulate, backward, clip_grad_norm_, save_state,
    get_state_dict and save_pretrained, load_state into a new module before its first call)
    over a RaNNCModule logs the losses and gradient norms of the same loop over the plain
    model in one process, saves the same files, and resumes to the same end
    (mpi/accelerate_check.py). load_state before the first call failed on the tied
    embedding: the module's state_dict gave it a copy only once deployed."""
    run_against_one_process(tmp_path, "accelerate_check.py", ranks, stages, flags)


def test_neftune_noise_is_traced_into_training_only(tmp_path):
    """Trainer's neftune_noise_alpha over a RaNNCModule on 2 ranks: the hook on
    get_input_embeddings() (an AttributeError before session 30) is traced into the
    training graph in a task of its own, the model still cut into 2 stages (its random
    values glued the whole model into one task: [Note: random values]), and not into
    evaluation's (mpi/neftune_check.py). The torch.distributed group that
    rannc.init_process_group() made is destroyed at exit, before the interpreter's teardown
    ([Note: the group ends before the interpreter]; gloo's threads aborted it, exit 134)."""
    res = mpirun("neftune_check.py", 2, str(tmp_path), timeout=300, env={"RANNC_COMM_TIMEOUT": "60"})
    assert res.returncode == 0, res.stdout[-4000:]
    for r in range(2):
        assert f"OK rank {r}" in res.stdout, res.stdout[-4000:]
        assert f"at exit rank {r}: group initialized False" in res.stdout, res.stdout[-4000:]


@pytest.mark.parametrize("ranks,model,stages,replicas", [(2, "hf_gpt2", 2, None),
                                                        (3, "hf_llama", 2, "2,1")])
def test_generate_through_the_pipeline_equals_the_plain_models(ranks, model, stages, replicas):
    """transformers' generate() on a RaNNCModule after AdamW steps and an evaluation with
    labels: every rank's sequences from its left-padded prompts, greedy and sampled (each
    rank to its own length), equal token for token to the plain model's generate() on
    them; T5's is an error naming why ([Note: generation through the pipeline],
    [Note: other arguments]). Llama's stages are replicated differently (2,1): its padding
    mask indexes rows by torch.arange(batch) ([Note: row positions]; it read the wrong rows)."""
    res = mpirun("generate_check.py", ranks, model, stages, *([replicas] if replicas else []),
                 timeout=300, env={"RANNC_COMM_TIMEOUT": "60"})
    assert res.returncode == 0, res.stdout[-4000:]
    for r in range(ranks):
        assert f"OK rank {r}" in res.stdout, res.stdout[-4000:]


@pytest.mark.parametrize("ranks", [1, 2])
def test_peft_lora_trains_and_saves_its_adapters(tmp_path, ranks):
    """PEFT's LoRA over GPT-2 (frozen base, adapters trained by AdamW) equals the same
    PeftModel in one process, and model.save_pretrained on rank 0 alone writes PEFT's
    adapter files, which PeftModel.from_pretrained loads to the trained adapters
    (mpi/peft_check.py)."""
    res = mpirun("peft_check.py", ranks, str(tmp_path), timeout=300,
                 env={"RANNC_COMM_TIMEOUT": "60"})
    assert res.returncode == 0, res.stdout[-4000:]
    for r in range(ranks):
        assert f"OK rank {r}" in res.stdout, res.stdout[-4000:]


@pytest.mark.parametrize("name", ["hf_llama_cls"])
def test_a_padding_mask_leaves_the_layers_apart(name):
    """transformers' masks index the padding mask by integer positions
    (padding_mask[batch_idx, kv_idx]); the boolean mask indexed read as a selection by the
    data, which glued every layer of a Llama given an attention_mask into one task (199 ops:
    one stage, nothing to pipeline)."""
    model, args, kwargs = hf_zoo.make(name, batch=4)
    graph = rannc.trace(model, args, kwargs)
    largest = max(len(t.op.split("+")) for t in graph.ir.tasks())
    assert largest < 20, largest
