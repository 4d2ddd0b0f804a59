"""RaNNCModule under real mpirun on CPU ranks equals single-process PyTorch on the
concatenated global batch: the loss at every step, every gradient, every parameter after
Adam steps, batch-shaped outputs, eval()/no_grad; over 1..4 ranks and several layouts."""
import os
import re
import subprocess
import sys
import time

import pytest
import torch

import rannc
import zoo
from mpirun import mpirun
from rannc.options import Options
from rannc.transport import resolve_device, uses_nccl

# (ranks, model, stages, micro-batches, extra arguments)
LAYOUTS = [
    (1, "mlp", 1, 1, ["--eval"]),
    (1, "gpt", 1, 2, []),
    (2, "mlp", 2, 2, ["--eval", "--opt", "replicas=1,1"]),       # 2 stages x 1 replica
    (2, "transformer_loss", 1, 2, ["--opt", "replicas=2"]),      # 1 stage x 2 replicas
    (2, "resnet", 2, 1, []),                      # batch norm: one share per stage
    (3, "gpt", 3, 3, []),                         # 3 stages
    (3, "transformer_loss", 2, 3, ["--opt", "replicas=1,2"]),    # 2 stages, replicas 1/2
    (4, "gpt", 2, 2, ["--eval", "--opt", "replicas=2,2"]),       # 2 stages x 2 replicas
    (4, "gpt", 3, 4, ["--opt", "replicas=2,1,1"]),               # 3 stages, replicas 2/1/1
    (4, "gpt", 4, 3, []),                                        # 4 stages
    (4, "mlp", 2, 2, ["--opt", "replicas=1,1"]),                 # 2 pipeline copies of 2 stages
    (4, "multi_io", 2, 2, ["--eval"]),            # kwargs, dict output, batch-shaped rows
    (2, "bert_mlm", 2, 2, ["--eval"]),            # a mean over the masked tokens only
]

# ZB-H1: each backward split into its input and weight parts, the weight part deferred
ZB_H1 = [
    (2, "gpt", 2, 4, ["--opt", "schedule=zb_h1"]),                        # 2 stages
    (3, "transformer_loss", 3, 3, ["--opt", "schedule=zb_h1"]),           # 3 stages
    (4, "gpt", 3, 4, ["--opt", "schedule=zb_h1", "replicas=2,1,1"]),      # replicas 2/1/1
    (4, "gpt", 4, 5, ["--opt", "schedule=zb_h1", "recompute=always"]),    # 4 stages, recomputing
    (4, "mlp", 2, 2, ["--opt", "schedule=zb_h1", "replicas=1,1"]),        # 2 pipeline copies
    (2, "resnet", 2, 1, ["--opt", "schedule=zb_h1"]),                     # batch norm, convolutions
    # the planner plans both schedules and keeps the faster ([Note: schedule choice])
    (4, "gpt", 4, 4, ["--opt", "schedule=auto"]),
]

# Interleaved 1F1B: stages c x G + g on device group g ([Note: chunks on a rank] in
# csrc/runtime/engine.h); values between chunks of a rank pass locally
INTERLEAVED = [
    (2, "gpt", 4, 2, ["--opt", "schedule=interleaved"]),                  # 2 chunks on 2 ranks
    (3, "gpt", 6, 3, ["--opt", "schedule=interleaved"]),                  # 3 device groups
    (4, "gpt", 4, 4, ["--eval", "--opt", "schedule=interleaved"]),        # 2 replicas per stage
    (2, "transformer_loss", 6, 2, ["--opt", "schedule=interleaved", "chunks=3"]),
    (1, "resnet", 2, 1, ["--opt", "schedule=interleaved"]),               # every value local
    (4, "mlp", 4, 2, ["--opt", "schedule=interleaved", "replicas=1,1,1,1"]),  # 2 pipeline copies
    (3, "gpt", 4, 2, ["--opt", "schedule=interleaved", "replicas=2,1,2,1"]),  # groups of 2 and 1
]


def _case_id(ranks, model, stages, micro, extra):
    kind = ("-zb" if "schedule=zb_h1" in extra else "-auto" if "schedule=auto" in extra
            else "-interleaved" if "schedule=interleaved" in extra else "")
    return f"{ranks}ranks-{model}-{stages}st-{micro}mb{kind}"


@pytest.mark.parametrize("ranks,model,stages,micro,extra", LAYOUTS + ZB_H1 + INTERLEAVED,
                         ids=[_case_id(*case) for case in LAYOUTS + ZB_H1 + INTERLEAVED])
def test_training_equals_pytorch(ranks, model, stages, micro, extra):
    res = mpirun("train_check.py", ranks, model, "--stages", stages, "--micro", micro, *extra,
                 timeout=300, env={"RANNC_COMM_TIMEOUT": "60"})
    assert res.returncode == 0, res.stdout[-4000:]
    for r in range(ranks):
        assert f"OK rank {r}" in res.stdout, res.stdout[-4000:]
    if "schedule=zb_h1" in extra:
        assert "zb-h1" in res.stdout, res.stdout[-4000:]  # the plan report names the schedule
    if "schedule=interleaved" in extra:
        chunks = next((int(e.split("=")[1]) for e in extra if e.startswith("chunks=")), 2)
        assert f"interleaved, {chunks} chunks per device" in res.stdout, res.stdout[-4000:]
    if "schedule=auto" in extra:  # both schedules planned, their times in the report
        assert re.search(r"schedule auto: 1f1b [\d.]+ ms \(bubble [\d.]+%\)( chosen)?; zb-h1 [\d.]+ ms",
                         res.stdout), res.stdout[-4000:]


@pytest.mark.parametrize("ranks,model,stages,micro,extra", [
    (2, "gpt", 2, 2, ["--clip-by", "torch"]),
    (4, "gpt", 2, 2, ["--clip-by", "torch_subset", "--opt", "replicas=1,3"]),
    (3, "gpt", 3, 3, ["--clip-by", "torch", "--opt", "schedule=zb_h1"]),
    (2, "transformer", 2, 2, ["--clip-by", "torch", "--mode", "outside"]),  # fill-drain
    (2, "gpt", 2, 2, ["--clip-by", "total_norm"]),
    (3, "gpt", 2, 2, ["--clip-by", "groups"]),
    (3, "gpt", 3, 2, ["--clip-by", "filtered"]),
])
def test_torchs_clip_grad_norm_clips_by_the_models_norm(ranks, model, stages, micro, extra):
    """torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm), as training loops and
    transformers' Trainer write it, measures the norm over every stage (before, each stage
    was clipped by its own): gradients and parameters equal PyTorch's, with a max_norm that
    clips every step, over all parameters and over a subset that spans the stages
    ([Note: torch's clip_grad_norm_] in clipping.py); likewise get_total_norm followed by
    clip_grads_with_norm_ ([Note: torch's get_total_norm]; it measured each stage's), and
    each param group by its own norm, where a rank's share of a group is empty ([Note:
    clipping a param group]; the ranks' collectives paired one group with another), and
    lists filtered on `p.grad is not None`, which differ by rank ([Note: the parameters
    meant]; a rank that held none of a layer's gradients measured 0 alone, and the others'
    collective paired with its next one)."""
    res = mpirun("train_check.py", ranks, model, "--stages", stages, "--micro", micro,
                 "--steps", 3, "--clip", 0.05, *extra, timeout=300,
                 env={"RANNC_COMM_TIMEOUT": "60"})
    assert res.returncode == 0, res.stdout[-4000:]
    for r in range(ranks):
        assert f"OK rank {r}" in res.stdout, res.stdout[-4000:]


def test_torchs_clip_grad_norm_imported_before_rannc_is_named():
    """A script that bound torch's clip_grad_norm_ before `import rannc` replaced it would
    clip each stage by its own norm: RaNNCModule says so. Outside a RaNNCModule's
    parameters the replacement is torch's function."""
    res = _single_process("""
import torch
from torch.nn.utils import clip_grad_norm_
import rannc, zoo
assert torch.nn.utils.clip_grad_norm_ is not clip_grad_norm_
plain = torch.nn.Linear(3, 2)
plain(torch.ones(4, 3)).sum().backward()
norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.1)
print("plain norm", float(norm), float(torch.cat([p.grad.flatten() for p in plain.parameters()]).norm()))
model, args, kwargs = zoo.make("gpt", batch=4)
module = rannc.RaNNCModule(model, torch.optim.SGD(model.parameters(), lr=0.1))
module(*args, **kwargs).backward()
extra = torch.nn.Parameter(torch.ones(3))  # outside the RaNNCModule: this rank's own norm
extra.grad = torch.full((3,), 2.0)
grads = [p.grad for p in module.parameters() if p.grad is not None] + [extra.grad]
expected = float(torch.cat([g.flatten() for g in grads]).norm())
norm = torch.nn.utils.clip_grad_norm_(list(module.parameters()) + [extra], 0.1)
print("mixed norm", float(norm), expected, float(extra.grad[0]), 2.0 * 0.1 / expected)
extra.grad[0] = float("inf")
try:
    torch.nn.utils.clip_grad_norm_(list(module.parameters()) + [extra], 0.1, error_if_nonfinite=True)
except RuntimeError as e:
    print("refused:", e)
""")
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert "imported torch's clip_grad_norm_ as 'clip_grad_norm_' before `import rannc`" in res.stderr
    norm, clipped = map(float, re.search(r"plain norm (\S+) (\S+)", res.stdout).groups())
    assert norm > 0.1 and abs(clipped - 0.1) < 1e-5, res.stdout
    norm, expected, scaled, expected_scaled = map(
        float, re.search(r"mixed norm (\S+) (\S+) (\S+) (\S+)", res.stdout).groups())
    assert abs(norm - expected) < 1e-4 * expected and abs(scaled - expected_scaled) < 1e-6, res.stdout
    assert "refused: The total norm of order 2.0 for gradients from `parameters` is non-finite" in res.stdout


@pytest.mark.parametrize("ranks,case,stages,micro,extra", [
    (1, "mlm_nsp", 1, 2, []),
    (2, "mlm_nsp", 2, 2, ["--opt", "schedule=zb_h1", "recompute=always"]),
    (4, "mlm_nsp", 4, 4, ["--opt", "schedule=interleaved"]),
    (4, "weighted", 2, 2, ["--opt", "replicas=2,2"]),
    (3, "nll_nd", 2, 3, ["--opt", "schedule=fill_drain"]),
    (1, "teacher", 1, 2, []),
    # sums over the batch add up over the shares (csrc/ir/reduction.h, option loss_reduction)
    (4, "items", 2, 2, ["--opt", "replicas=2,2"]),
    (3, "items", 2, 3, ["--opt", "schedule=fill_drain"]),
    (2, "einsum", 2, 2, ["--opt", "loss_reduction=sum"]),
    # a mean written by hand: a sum over a count of the batch ([Note: token-mean losses])
    (4, "masked", 2, 2, ["--opt", "replicas=1,3", "schedule=zb_h1", "recompute=always"]),
    (3, "counted", 3, 3, ["--opt", "schedule=fill_drain"]),
    # its count over the shape of what the model made ([Note: shapes read by counts])
    (3, "shaped", 2, 2, ["--opt", "replicas=1,2"]),
    (2, "shaped_selected", 2, 2, []),
    (3, "scaled_count", 2, 3, ["--opt", "schedule=fill_drain"]),
    (2, "fairseq", 2, 2, []),
    (2, "dot", 1, 2, ["--opt", "replicas=2"]),
    # over the tokens a boolean mask selects ([Note: masked losses])
    (4, "selected", 2, 2, ["--opt", "replicas=2,2"]),
    (2, "selected_sum", 2, 2, []),
    (3, "selected_mean", 2, 3, ["--opt", "schedule=fill_drain"]),
    (2, "mse_selected", 1, 2, []),
    (1, "unread", 1, 2, []),
    (3, "aux", 2, 2, ["--opt", "replicas=2,1"]),
    # the profile that cut the auxiliary mean of the replicated embedding from its reader
    # ([Note: share scalars] in csrc/partition/atomic/atomic.h): 0.2% off before
    (3, "aux", 2, 2, ["--opt", "replicas=2,1", "profile_fake_timer=True",
                      "profile_fake_noise=0.8", "profile_fake_seed=1"]),
    (4, "penalty", 2, 2, ["--opt", "replicas=1,3"]),
    (2, "items_aux", 2, 3, ["--opt", "schedule=zb_h1", "recompute=always"]),
    (3, "inplace", 3, 2, ["--opt", "schedule=fill_drain"]),
    (2, "forced_mean", 1, 2, ["--opt", "loss_reduction=mean"]),
    (2, "ctc", 2, 2, []),
    (3, "ctc_mean", 1, 2, ["--opt", "replicas=3"]),
    (1, "product", 1, 2, []),
])
def test_a_mean_over_the_targets_that_count_equals_pytorch(ranks, case, stages, micro, extra):
    """[Note: token-mean losses] in csrc/frontend/token_means.h: cross entropy over masked
    tokens (plus a loss over rows), with class weights, nll_loss with another ignore_index:
    equal to PyTorch on the global batch in float64 (to 1e-10) though each micro-batch and
    replica counts other targets; a target made from parameters keeps the rows' weights,
    and rank 0 says so. A loss that is a sum over the batch (a sum divided by a count the
    caller passes, as transformers' num_items_in_batch; a sum the graph does not show, with
    loss_reduction=sum) adds up over the shares. A mean written by hand, a masked sum over
    the mask's sum (clamped) or over the count of kept labels, is exact as well, and so is
    cross entropy over the tokens a boolean mask selects (logits[mask], labels[mask]), and a
    count written over the shape of what the model computed (mask.expand_as(se).sum(),
    (mask * torch.ones_like(se)).sum(); it was weighted by rows, 3.1% off), or as a count
    times numbers the same for any rows (mask.sum() * channels)."""
    res = mpirun("token_mean_check.py", ranks, case, "--stages", stages, "--micro", micro, *extra,
                 timeout=300, env={"RANNC_COMM_TIMEOUT": "60"})
    assert res.returncode == 0, res.stdout[-4000:]
    for r in range(ranks):
        assert f"OK rank {r}" in res.stdout, res.stdout[-4000:]
    if case == "unread":  # a composite task: its reduction is not in the graph either
        assert "the graph does not show whether it is a mean or a sum" in res.stdout, res.stdout[-4000:]
    if case in ("teacher", "unread"):
        assert "micro-batches and replicas weigh it by their rows" in res.stdout, res.stdout[-4000:]
    if case == "product":  # the one term, not the whole output
        assert "of output #0" in res.stdout, res.stdout[-4000:]
        assert "] output #0: the graph" not in res.stdout, res.stdout[-4000:]
    if case in ("items", "selected_sum", "penalty", "items_aux", "ctc"):  # found in the graph, and said
        assert "is a sum over the batch" in res.stdout, res.stdout[-4000:]


@pytest.mark.parametrize("mode,ranks,model,stages,micro,extra", [
    ("accum", 4, "gpt", 2, 2, []),      # gradient accumulation over 2 calls
    ("scale2", 2, "mlp", 2, 2, []),     # (2 * loss).backward()
    # the first call under no_sync() keeps each replica's share; the second sums both
    # ([Note: unsynced steps] in csrc/runtime/engine.h)
    ("accum_no_sync", 4, "gpt", 2, 2, ["--opt", "replicas=2,2"]),
    ("accum_no_sync", 4, "gpt", 1, 2, ["--opt", "replicas=4", "schedule=zb_h1"]),
    ("accum_no_sync", 2, "gpt", 2, 2, []),  # no replicas: nothing to hold back
    ("outside_accum_no_sync", 3, "transformer", 2, 2, ["--opt", "replicas=1,2"]),  # fill-drain
])
def test_backward_semantics(mode, ranks, model, stages, micro, extra):
    res = mpirun("train_check.py", ranks, model, "--stages", stages, "--micro", micro,
                 "--steps", 3, "--mode", mode, *extra, timeout=300, env={"RANNC_COMM_TIMEOUT": "60"})
    assert res.returncode == 0, res.stdout[-4000:]
    for r in range(ranks):
        assert f"OK rank {r}" in res.stdout, res.stdout[-4000:]


@pytest.mark.parametrize("ranks,model,stages,micro,extra", [
    (4, "transformer", 2, 2, ["--eval", "--opt", "replicas=2,2"]),  # logits, loss outside
    (3, "multi_io", 2, 3, ["--eval", "--opt", "schedule=fill_drain", "replicas=1,2"]),
    (2, "transformer", 2, 2, ["--mode", "outside_accum"]),  # accumulation over two calls
    # 2 replicas: the global batch (8) equals multi_io's feature size, which is no batch
    (2, "multi_io", 1, 2, ["--opt", "schedule=fill_drain", "replicas=2"]),
])
def test_fill_drain_with_gradients_from_outside(ranks, model, stages, micro, extra):
    """Outputs that need gradients from outside: forwards in forward(), backwards in
    backward() with the user's output gradients; equal to PyTorch on the global batch."""
    mode = [] if "--mode" in extra else ["--mode", "outside"]
    res = mpirun("train_check.py", ranks, model, "--stages", stages, "--micro", micro,
                 "--steps", 3, *mode, *extra, timeout=300, env={"RANNC_COMM_TIMEOUT": "60"})
    assert res.returncode == 0, res.stdout[-4000:]
    for r in range(ranks):
        assert f"OK rank {r}" in res.stdout, res.stdout[-4000:]


def test_recomputation_equals_pytorch():
    res = mpirun("train_check.py", 3, "gpt", "--stages", 3, "--micro", 3, "--steps", 3,
                 "--opt", "recompute=always", timeout=300, env={"RANNC_COMM_TIMEOUT": "60"})
    assert res.returncode == 0, res.stdout[-4000:]
    assert "OK rank 2" in res.stdout


def test_a_failing_stage_ends_every_rank_naming_it():
    start = time.monotonic()
    res = mpirun("stage_failure.py", 2, timeout=200)
    assert res.returncode != 0
    assert "FAILED on rank 0" in res.stdout, res.stdout[-3000:]
    assert "aten::embedding" in res.stdout and "'tok'" in res.stdout, res.stdout[-3000:]
    # the arguments it ran on, against the trace's (a dtype autocast left, a device)
    assert "its arguments: #0 Float32[50, 16] on cpu (traced Float32[50, 16]), #1 Int64[" \
        in res.stdout, res.stdout[-3000:]
    assert "rank 1 stops because rank 0 failed: rank 0 | stage 0 failed" in res.stdout, \
        res.stdout[-3000:]
    assert time.monotonic() - start < 150


@pytest.mark.parametrize("ranks", [2, 4])
def test_module_api(ranks):
    res = mpirun("module_api_check.py", ranks, timeout=300, env={"RANNC_COMM_TIMEOUT": "60"})
    assert res.returncode == 0, res.stdout[-4000:]
    for r in range(ranks):
        assert f"OK rank {r}" in res.stdout, res.stdout[-4000:]


@pytest.mark.parametrize("ranks,model,micro", [(2, "gpt", 2), (4, "gpt", 2), (2, "resnet", 1)],
                         ids=["2ranks-gpt", "4ranks-gpt", "2ranks-resnet-buffers"])
def test_checkpoints_are_whole_though_each_rank_keeps_only_its_stage(ranks, model, micro):
    res = mpirun("checkpoint_check.py", ranks, model, "--stages", 2, "--micro", micro,
                 timeout=300, env={"RANNC_COMM_TIMEOUT": "60"})
    assert res.returncode == 0, res.stdout[-4000:]
    for r in range(ranks):
        assert f"OK rank {r}" in res.stdout, res.stdout[-4000:]


@pytest.mark.parametrize("ranks,model,stages,micro,load",
                         [(2, "gpt", 2, 2, "checkpoint"), (4, "gpt", 2, 2, "state_dict"),
                          (2, "resnet", 2, 1, "checkpoint"), (3, "transformer_loss", 2, 2, "checkpoint")],
                         ids=["2ranks-gpt", "4ranks-gpt-replicas-state_dict", "2ranks-resnet-buffers",
                              "3ranks-transformer"])
def test_a_model_built_on_meta_holds_only_its_stages_and_equals_pytorch(tmp_path, ranks, model,
                                                                        stages, micro, load):
    """[Note: models built on the meta device] and [Note: stand-in parameters]."""
    res = mpirun("empty_weights_check.py", ranks, model, "--stages", stages, "--micro", micro,
                 "--dir", tmp_path, "--load", load, timeout=300, env={"RANNC_COMM_TIMEOUT": "60"})
    assert res.returncode == 0, res.stdout[-4000:]
    for r in range(ranks):
        assert f"OK rank {r}" in res.stdout, res.stdout[-4000:]


@pytest.mark.parametrize("schedule", ["1f1b", "fill_drain"])
def test_larger_batches_and_longer_sequences_run_in_micro_batches_that_fit(schedule):
    """[Note: memory at other batches] in csrc/runtime/batch_memory.h."""
    res = mpirun("batch_memory_check.py", 2, "--schedule", schedule, timeout=300)
    assert res.returncode == 0, res.stdout[-4000:]
    for r in range(2):
        assert f"OK rank {r}" in res.stdout, res.stdout[-4000:]
    if schedule == "1f1b":
        assert "8 micro-batches instead of the plan's 2, to stay within" in res.stdout, res.stdout[-4000:]
    else:
        assert "it may run out of memory" in res.stdout, res.stdout[-4000:]


def test_device_and_data_plane_options_are_checked():
    model = torch.nn.Linear(2, 2)
    assert resolve_device("cpu", model) == torch.device("cpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto", model) == torch.device("cpu")
        with pytest.raises(rannc.Error, match="sees no CUDA device"):
            resolve_device("cuda", model)
    with pytest.raises(rannc.Error, match="runs stages on cpu or cuda"):
        resolve_device("meta", model)
    with pytest.raises(rannc.Error, match="data_plane is 'gloo'"):
        Options.resolve({"data_plane": "gloo"})
    # CPU stages always talk over MPI, whatever data_plane says
    assert not uses_nccl(torch.device("cpu"), "nccl")
    assert Options.resolve({}, environ={"RANNC_DEVICE": "cpu"}).device == "cpu"


@pytest.mark.parametrize("gpus", [1, 2, 4])
def test_ranks_map_to_gpus_by_local_rank_modulo_the_devices(monkeypatch, gpus):
    """Several ranks on fewer GPUs share them (2 ranks on 1 GPU: both on cuda:0), and the
    stage's device and the profiling device agree (on the GPU machine, rank 1 profiled on
    a device it did not have)."""
    from rannc import _C, planning, transport
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(_C, "get_world_size", lambda: 8)
    model = torch.nn.Linear(2, 2)  # on the CPU: "auto" picks this rank's GPU
    for local in range(8):
        monkeypatch.setattr(_C, "get_local_rank", lambda: local)
        expected = torch.device("cuda", local % gpus)
        assert transport.local_cuda_device() == expected
        assert resolve_device("cuda", model) == expected
        assert resolve_device("auto", model) == expected
        assert planning.profile_device() == str(expected)
    assert resolve_device("cuda:0", model) == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(rannc.Error, match="sees no CUDA device"):
        transport.local_cuda_device()


def test_torch_distributed_runs_nccl_only_where_each_rank_has_its_own_gpu():
    """rannc.init_process_group's backend ([Note: a DDP script's environment on GPUs]): NCCL
    (with gloo for CPU tensors) where every rank has a GPU of its own, gloo where two ranks
    of a host share one (NCCL refuses them) or some rank has none."""
    from rannc.process_group import backend_for
    both = "cpu:gloo,cuda:nccl"
    assert backend_for([("a", 2), ("a", 2)]) == both
    assert backend_for([("a", 1), ("b", 1)]) == both  # one GPU per host, one rank each
    assert backend_for([("a", 1), ("a", 1)]) == "gloo"  # two ranks on one GPU
    assert backend_for([("a", 2), ("a", 2), ("b", 1), ("b", 1)]) == "gloo"
    assert backend_for([("a", 0), ("a", 0)]) == "gloo"
    assert backend_for([("a", 1), ("b", 0)]) == "gloo"


def test_several_ranks_take_their_own_gpu_under_auto_even_with_the_model_on_cuda0(monkeypatch):
    """A model moved with .cuda() on every rank without set_device sits on cuda:0 on all of
    them; under device=auto each rank's stages go to its own GPU (where its NCCL
    communicators are), and a lone rank keeps the model's GPU."""
    from types import SimpleNamespace

    from rannc import _C
    on_cuda0 = SimpleNamespace(parameters=lambda: [SimpleNamespace(device=torch.device("cuda", 0))],
                               buffers=lambda: [])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(_C, "get_local_rank", lambda: 3)
    monkeypatch.setattr(_C, "get_world_size", lambda: 4)
    assert resolve_device("auto", on_cuda0) == torch.device("cuda", 3)
    monkeypatch.setattr(_C, "get_world_size", lambda: 1)
    assert resolve_device("auto", on_cuda0) == torch.device("cuda", 0)


@pytest.mark.parametrize("keys, plane, expected", [
    ([("a", "gpu0"), ("a", "gpu1"), ("b", "gpu0"), ("b", "gpu1")], "auto", True),
    ([("a", "gpu0"), ("a", "gpu0"), ("a", "gpu1"), ("a", "gpu1")], "auto", False),
    ([("a", "gpu0"), ("a", "gpu1"), None, ("b", "gpu1")], "auto", False),
    ([("a", "gpu0"), ("a", "gpu0"), ("a", "gpu1"), ("a", "gpu1")], "nccl", r"ranks \[0, 1, 2, 3\] share GPUs"),
    ([("a", "gpu0"), ("a", "gpu1"), ("a", "gpu1"), ("a", "gpu2")], "nccl", r"ranks \[1, 2\] share GPUs"),
])
def test_ranks_that_share_a_gpu_all_talk_over_mpi(monkeypatch, keys, plane, expected):
    """NCCL runs one rank per GPU: where any two ranks share one (same host, same GPU), every
    rank decides on MPI together under data_plane=auto, and data_plane=nccl names them."""
    from rannc import _C, transport
    monkeypatch.setattr(_C, "has_nccl", True)
    monkeypatch.setattr(_C, "get_world_size", lambda: len(keys))
    monkeypatch.setattr(transport, "_device_key", lambda device: ("a", "gpu0"))
    monkeypatch.setattr(transport, "all_gather_objects", lambda mine: list(keys))
    if isinstance(expected, str):
        with pytest.raises(rannc.Error, match=expected):
            uses_nccl(torch.device("cuda", 0), plane)
    else:
        assert uses_nccl(torch.device("cuda", 0), plane) is expected
    assert not uses_nccl(torch.device("cuda", 0), "mpi")


def test_the_plan_fits_the_gpu_it_runs_on_unless_told_otherwise(monkeypatch):
    """device_memory=0 (the default): a GPU's memory shared by the ranks of its host on it
    (an H100's 80 GiB is not planned as 8), 8 GiB on the CPU."""
    from types import SimpleNamespace

    from rannc import _C, transport
    assert Options.resolve({}).device_memory == 0
    assert transport.device_memory_default(torch.device("cpu")) == 8 << 30
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(total_memory=80 << 30))
    monkeypatch.setattr(_C, "get_local_size", lambda: 2)
    assert transport.device_memory_default(torch.device("cuda", 1)) == 80 << 30
    monkeypatch.setattr(_C, "get_local_size", lambda: 4)  # ranks 1 and 3 share cuda:1
    assert transport.device_memory_default(torch.device("cuda", 1)) == 40 << 30


def _single_process(script: str) -> subprocess.CompletedProcess:
    """Runs `script` in a fresh Python without mpirun (a singleton MPI world), with the
    checkout's package, the examples and this directory importable."""
    here = os.path.dirname(__file__)
    paths = [here, os.path.join(here, "..", "..", "python"), os.path.join(here, "..", "..", "examples")]
    return subprocess.run([sys.executable, "-c", f"import sys\nsys.path[:0] = {paths!r}\n{script}"],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_an_error_caught_by_a_single_process_leaves_its_exit_status_alone():
    """Without mpirun (a singleton MPI world) an error in forward has no peer to tell; the
    process that catches it exits 0 (it used to abort in MPI's shutdown, exit status 1)."""
    res = _single_process("""
import torch, rannc, zoo
model, args, kwargs = zoo.make("multi_io")
module = rannc.RaNNCModule(model, torch.optim.SGD(model.parameters(), lr=0.1))
module(*args, **kwargs)
try:  # a batch of other rows in each argument: an error on every rank (here one)
    module(args[0], args[1][:-1], **kwargs)
except rannc.Error as e:
    print("caught", type(e).__name__)
""")
    assert "caught" in res.stdout, res.stdout + res.stderr
    assert res.returncode == 0, res.stderr[-3000:]


def test_forward_shows_the_models_signature():
    """transformers' Trainer keeps the dataset columns that the model's forward names:
    RaNNCModule's forward shows the wrapped model's signature (it showed *args, **kwargs,
    and Trainer dropped every column)."""
    res = _single_process("""
import inspect, torch, rannc, zoo
model, args, kwargs = zoo.make("multi_io")
module = rannc.RaNNCModule(model, torch.optim.SGD(model.parameters(), lr=0.1))
print("signature", inspect.signature(module.forward), inspect.signature(model.forward))
""")
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    line = next(l for l in res.stdout.splitlines() if l.startswith("signature"))
    mine, theirs = line[len("signature "):].split(") (")
    assert mine + ")" == "(" + theirs and "scale" in mine, line


def test_the_class_shows_the_signature_and_checkpointing_requests_recompute():
    """transformers' find_labels reads the class's forward: each RaNNCModule's class shows
    its model's signature, and its name the model's (question answering: the start and
    end positions are labels). A model wrapped with its gradient checkpointing on plans every
    stage recomputed (traced, the checkpoints were plain ops keeping every activation), and
    so does a module that computes its loss around such a model (the request was lost),
    trained equal to PyTorch; an explicit recompute option wins; a request after the first
    training call, which planned the stages, is an error saying when to make it ([Note:
    activation checkpointing])."""
    res = _single_process("""
import copy, torch, rannc, hf_zoo
from transformers.utils.generic import find_labels
model, _, kwargs = hf_zoo.make("hf_gpt2", batch=4)
reference = copy.deepcopy(model)
model.gradient_checkpointing_enable()
model.enable_input_require_grads()  # as PEFT does: a forward hook rannc need not warn of
module = rannc.RaNNCModule(model, torch.optim.SGD(model.parameters(), lr=0.1))
assert isinstance(module, rannc.RaNNCModule) and repr(type(module)) == "<class 'rannc.module.RaNNCModule'>"
assert type(module).__name__ == "RaNNCModule[GPT2LMHeadModel]", type(module).__name__
print("labels", find_labels(type(module)))
# a question-answering model's labels by its class name, as for the model itself
import transformers as tf
qa = tf.BertForQuestionAnswering(tf.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                               num_attention_heads=2, intermediate_size=32))
print("qa labels", find_labels(type(rannc.RaNNCModule(qa))), find_labels(type(qa)))
loss = module(**kwargs).loss
torch.testing.assert_close(loss, reference(**kwargs).loss)
print("recompute", [s.recompute for s in module._deployed[True].deployment.stages])
try:
    module.gradient_checkpointing_enable()  # already "always": nothing to change
    rannc.RaNNCModule(copy.deepcopy(reference), recompute="never").activation_checkpointing_enable()
    late = rannc.RaNNCModule(copy.deepcopy(reference))
    late(**kwargs)
    late.activation_checkpointing_enable()
except rannc.Error as e:
    print("late:", e)
class LossOf(torch.nn.Module):  # the model inside the module that computes the loss
    def __init__(self, inner):
        super().__init__()
        self.inner = inner
    def forward(self, **kw):
        return self.inner(**kw).loss
outer = rannc.RaNNCModule(LossOf(copy.deepcopy(model)), torch.optim.SGD(model.parameters(), lr=0.1))
outer(**kwargs)
print("nested recompute", [s.recompute for s in outer._deployed[True].deployment.stages])
""")
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert "nested recompute [True]" in res.stdout, res.stdout
    assert "labels ['labels']" in res.stdout, res.stdout
    assert ("qa labels ['start_positions', 'end_positions'] ['start_positions', 'end_positions']"
            in res.stdout), res.stdout
    assert "recompute [True]" in res.stdout, res.stdout
    assert "forward hooks" not in res.stdout + res.stderr, res.stderr[-3000:]
    assert ("late: activation checkpointing was enabled after the first training call, which "
            "planned the stages (recompute='auto'): enable it before that call" in res.stdout), \
        res.stdout + res.stderr[-3000:]


def test_moving_a_wrapped_model_leaves_its_placement_to_rannc():
    """DDP scripts and transformers' Trainer call model.to(device) / .cuda() on the wrapped
    model. nn.Module's moved the whole model onto every rank's device, and after the first
    call would have moved the stages' tensors from under the engine ([Note: moving a wrapped
    model] in module.py): the stages' kind of device is a no-op, another kind an error naming
    the option device; a dtype converts the model before the first call (trained equal to
    PyTorch in float64) and is an error after it."""
    res = _single_process("""
import copy, torch, rannc
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
reference = copy.deepcopy(model).double()
module = rannc.RaNNCModule(model, torch.optim.SGD(model.parameters(), lr=0.1))
assert module.to("cpu") is module and module.cpu() is module
assert module.to(torch.float64) is module
print("dtype", next(model.parameters()).dtype)
x = torch.randn(6, 8, dtype=torch.float64)
loss = module(x).pow(2).mean()
loss.backward()
reference(x).pow(2).mean().backward()
torch.testing.assert_close(model[0].weight.grad, reference[0].weight.grad)
assert module.to(torch.device("cpu")) is module
for what, call in [("cuda", module.cuda), ("half", module.half),
                   ("float", lambda: module.to("cpu", torch.float32))]:
    try:
        call()
        print(what, "passed")
    except rannc.Error as e:
        print(f"{what}: {e}")
print("after", next(model.parameters()).dtype)
""")
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    out = res.stdout
    assert "dtype torch.float64" in out and "after torch.float64" in out, out
    assert "cuda: RaNNCModule.to('cuda') on rank 0: this rank's stages run on cpu (option " \
        "device='auto')" in out and "pass device='cuda' to RaNNCModule" in out, out
    for what in ("half", "float"):
        assert f"{what}: converting its tensors" in out, out
    assert "after a RaNNCModule's first call" in out, out


def test_copies_of_a_wrapped_model_run_on_its_plan_and_pickles_are_an_error():
    """copy.deepcopy of a RaNNCModule (AveragedModel, an EMA) failed on "cannot pickle
    'rannc._C.ProfileCache' object"; it is a copy run on the module's plan with weights of
    its own, equal to PyTorch's AveragedModel of the plain model ([Note: copies of a wrapped
    model] in copies.py; several ranks: test_errors_every_rank..[averaged_model]).
    torch.save(model) names the cause, and so does update_bn on a copy (the trace holds the
    model's batch-norm momentum)."""
    res = _single_process("""
import copy, io, torch, rannc
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
reference = copy.deepcopy(model)
opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, reference))
module = rannc.RaNNCModule(model, opt)
ema, ref_ema = (AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(0.5)) for m in (module, reference))
x = torch.randn(8, 8)
for step in range(3):
    for m, o in ((module, opt), (reference, ref_opt)):
        m(x).pow(2).mean().backward()
        o.step()
        o.zero_grad()
    ema.update_parameters(module)
    ref_ema.update_parameters(reference)
ema.eval(); ref_ema.eval()
with torch.no_grad():
    torch.testing.assert_close(ema(x), ref_ema(x))
    assert not torch.allclose(ema(x), module(x))  # the average, not the model
for k, v in ref_ema.state_dict().items():
    torch.testing.assert_close(ema.state_dict()[k], v)
print("averaged as PyTorch")
try:
    torch.save(module, io.BytesIO())
except rannc.Error as e:
    print("refused:", e)
normed = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
normed_module = rannc.RaNNCModule(normed, torch.optim.SGD(normed.parameters(), lr=0.1))
normed_module(x).pow(2).mean().backward()
try:  # its momentum None would be ignored: the trace holds the model's
    torch.optim.swa_utils.update_bn([x], AveragedModel(normed_module))
except rannc.Error as e:
    print("update_bn:", e)
""")
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert "averaged as PyTorch" in res.stdout, res.stdout[-3000:]
    refused = [l for l in res.stdout.splitlines() if l.startswith("refused: a RaNNCModule cannot "
                                                                  "be pickled")]
    assert len(refused) == 1 and "save_checkpoint(dir)" in refused[0], res.stdout[-3000:]
    assert "update_bn: the copy's batch norm 1 has momentum None" in res.stdout, res.stdout[-3000:]


def test_a_process_torchrun_started_is_told_to_launch_with_mpirun():
    """[Note: launched by another launcher] in process_group.py: under torchrun each process
    is an MPI world of one, and trained alone on its shard without a word (and
    init_process_group overwrote RANK and WORLD_SIZE). Both are an error naming mpirun."""
    script = """
import torch, rannc
model = torch.nn.Linear(4, 1)
for make in (lambda: rannc.RaNNCModule(model, torch.optim.SGD(model.parameters(), lr=0.1)),
             rannc.init_process_group):
    try:
        make()
    except rannc.Error as e:
        print("refused:", e)
import os
print("RANK", os.environ["RANK"])
"""
    here = os.path.dirname(__file__)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1", "RANK": "1",
                                           "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                                           "PYTHONPATH": os.path.join(here, "..", "..", "python")})
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    refused = [l for l in res.stdout.splitlines() if l.startswith("refused: ")]
    assert len(refused) == 2, res.stdout + res.stderr[-3000:]
    assert all("WORLD_SIZE=2" in l and "mpirun -np 2" in l for l in refused), refused
    assert "RANK 1" in res.stdout, res.stdout  # torchrun's variables left as they were


def test_ddp_methods_a_script_moved_from_ddp_calls_name_what_rannc_does_instead():
    """[Note: DDP's other methods] in module.py: join() and register_comm_hook() were
    AttributeErrors naming nothing; now errors saying what to do, and _set_static_graph()
    is accepted (the traced graph is static). Training goes on after them."""
    res = _single_process("""
import torch, rannc
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
module = rannc.RaNNCModule(model, opt)
module._set_static_graph()
for call in (lambda: module.join(), lambda: module.register_comm_hook(None, lambda s, b: b)):
    try:
        call()
    except rannc.Error as e:
        print("refused:", e)
module(torch.randn(4, 8)).pow(2).mean().backward()
opt.step()
print("trained")
""")
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    refused = [l for l in res.stdout.splitlines() if l.startswith("refused: ")]
    assert len(refused) == 2, res.stdout[-3000:]
    assert "no join()" in refused[0] and "drop_last=True" in refused[0], refused
    assert "no register_comm_hook()" in refused[1] and "<lambda>" in refused[1], refused
    assert "trained" in res.stdout, res.stdout[-3000:]


def test_the_plan_counts_copies_of_the_model_made_before_its_first_call():
    """An EMA made before the first call takes one more copy of each stage's parameters and
    buffers, which the plan's memory counts (the option model_copies for later ones); a
    copy made after it draws a warning naming the option."""
    res = _single_process("""
import torch, rannc
from torch.optim.swa_utils import AveragedModel
x = torch.randn(8, 64)
def planned_bytes(copy_first):
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    module = rannc.RaNNCModule(model, torch.optim.SGD(model.parameters(), lr=0.1))
    if copy_first:
        ema = AveragedModel(module)
    module(x).pow(2).mean().backward()
    if not copy_first:
        ema = AveragedModel(module)
    return module.deployments["train"].stages[0].memory_bytes
print("counted", planned_bytes(True) - planned_bytes(False))
""")
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    parameters = (64 * 64 + 64 + 64 + 1) * 4
    assert f"counted {parameters}" in res.stdout, res.stdout[-2000:]
    assert "pass the option model_copies=1" in res.stdout + res.stderr, res.stderr[-2000:]


def test_one_rank_is_planned_without_profiling():
    """A single rank's plan can only be one stage: nothing to search, so its first step
    costs no profiling run (74.6 s -> 10.2 s for a 12-layer GPT-2 on this CPU), as with
    num_stages=1."""
    res = _single_process("""
import torch, rannc, zoo
torch.set_num_threads(1)
model, args, kwargs = zoo.make("gpt", batch=4)
module = rannc.RaNNCModule(model, torch.optim.SGD(model.parameters(), lr=0.1))
module(*args, **kwargs).backward()
times = module._deployed[True].times
print("profiling", times.profiling, "pieces", times.pieces_measured)
""")
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert "one stage (one rank): nothing to search, so nothing is profiled" in res.stdout + res.stderr
    assert "profiling 0.0 pieces 0" in res.stdout, res.stdout[-2000:]


def test_frozen_parameters_are_planned_with_their_weights_only(tmp_path):
    """[Note: frozen parameters' memory] in csrc/partition/cost/cost_model.h: a model whose
    parameters are mostly frozen (a LoRA model's base, a frozen backbone) is planned with
    the weights of the frozen ones only, no gradient, Adam state or update (before, a
    frozen parameter was charged as a trained one: four times its weights under Adam).
    Unfreezing them after the plan charges them again, and where that no longer fits the
    plan's memory rank 0 says so, naming the cure."""
    res = _single_process("""
import torch, rannc, zoo
torch.set_num_threads(1)

def planned(frozen, **options):
    model, args, kwargs = zoo.make("gpt", batch=1)  # one row: no smaller micro-batches
    for name, p in model.named_parameters():
        p.requires_grad_(not (frozen and name.startswith("blocks.")))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    module = rannc.RaNNCModule(model, opt, num_stages=1, **options)
    module(*args, **kwargs).backward()
    opt.step(); opt.zero_grad()
    return model, module, args, kwargs

model, trained, _, _ = planned(False)
blocks = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n.startswith("blocks."))
model, frozen, args, kwargs = planned(True)
st, sf = trained._deployed[True].deployment.stages[0], frozen._deployed[True].deployment.stages[0]
assert st.param_bytes == sf.param_bytes, (st.param_bytes, sf.param_bytes)
assert st.static_bytes - sf.static_bytes == 3 * blocks, (st.static_bytes, sf.static_bytes, blocks)
assert sf.update_time < st.update_time, (sf.update_time, st.update_time)
# a plan that fits the frozen model alone: unfreezing the blocks goes over it
peak = frozen._deployed[True].engine.memory_fit.peak_bytes
model, tight, args, kwargs = planned(True, device_memory=peak, memory_margin=0.0)
assert tight._deployed[True].deployment.feasible
for p in model.parameters():
    p.requires_grad_(True)
tight(*args, **kwargs).backward()
print("thawed")
""")
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    log = res.stdout + res.stderr
    assert "thawed" in res.stdout, log[-3000:]
    assert "with the parameters unfrozen since the plan (their gradients and optimizer state) stage 0" \
        in log and "Wrap the model with every parameter it will train unfrozen" in log, log[-3000:]


def test_one_rank_with_one_stage_takes_sequences_of_any_length():
    """[Note: new input shapes] in deployed.py: one rank running one stage in one micro-batch
    (the plan of a single GPU) trains sequences of other lengths than traced as PyTorch."""
    res = _single_process("""
import copy
import torch, rannc, zoo
torch.set_num_threads(1)
model, _, _ = zoo.make("gpt", batch=4)
zoo.no_dropout(model)
reference = copy.deepcopy(model)
opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
module = rannc.RaNNCModule(model, opt)
g = torch.Generator().manual_seed(3)
for length in (8, 5, 12, 8):
    ids, targets = (torch.randint(0, 50, (4, length), generator=g) for _ in range(2))
    loss, ref_loss = module(ids, targets), reference(ids, targets)
    loss.backward(); ref_loss.backward()
    opt.step(); ref_opt.step(); opt.zero_grad(); ref_opt.zero_grad()
    torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
    print("length", length, "ok", flush=True)
""")
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert res.stdout.count(" ok") == 4, res.stdout


# ---- what real training loops do (issue: training survives them) ---------------------------
@pytest.mark.parametrize("stages", [1, 2])
def test_an_exception_between_steps_ends_every_rank_in_seconds(stages):
    """Rank 1 raises in the user's loop after step 2; rank 0 waits for it in step 3. With the
    default comm_timeout (600 s), the job still ends within 10 s of the raise, and rank 0's
    error names rank 1 and its exception."""
    res = mpirun("loop_probes.py", 2, "user_error", stages, timeout=300)
    ended = time.time()
    assert res.returncode != 0, res.stdout[-3000:]
    # ranks' lines may interleave: find the timestamp anywhere
    raised = [float(t) for t in re.findall(r"RAISING AT (\d+\.\d{3})", res.stdout)]
    assert raised, res.stdout[-3000:]
    assert ended - raised[0] < 10, f"ended {ended - raised[0]:.1f} s after the raise"
    assert ("rank 0 stops because rank 1 failed: rank 1: ValueError: user code failed after "
            "step 2 (at ") in res.stdout, res.stdout[-3000:]
    assert "finished though rank 1 failed" not in res.stdout


def test_a_rank_stopped_inside_a_call_by_a_signal_tells_the_others_at_once():
    """A preemption handler's SystemExit (SIGTERM -> sys.exit) inside a training call on rank
    0 left rank 1 waiting on rank 0's stage until comm_timeout (60 s here, 600 by default):
    only Exceptions were reported. Now rank 1's error names rank 0's SystemExit at once
    (loop_probes.py preempted); each rank caught its own and printed OK."""
    res = mpirun("loop_probes.py", 2, "preempted", timeout=300)
    for r in range(2):
        assert f"OK rank {r}" in res.stdout, res.stdout[-4000:]


def test_a_failure_while_tracing_new_shapes_says_so_with_both_shapes():
    """[Note: new input shapes]: the whole model runs again to trace it at a new length; an
    error there (here the model's own, which every rank raises: [Note: trace errors agreed]
    in module.py) names that step, the new shapes and the planned ones; uncaught, it ends
    the job."""
    res = mpirun("loop_probes.py", 2, "new_length_fails", timeout=300)
    assert res.returncode != 0, res.stdout[-3000:]
    assert ("ValueError: sequences longer than 6 are not supported" in res.stdout
            and "rannc: while tracing the model again for new input shapes args[0] float32 "
            "[*, 8, 8] (planned at args[0] float32 [*, 4, 8])" in res.stdout), res.stdout[-3000:]
    assert "finished though tracing failed" not in res.stdout


@pytest.mark.parametrize("probe", ["mismatched_rows", "data_branch", "different_models",
                                   "length_branch", "padded_lengths", "eval_after_new_length",
                                   "num_items_in_batch", "uneven_selection", "late_optimizer",
                                   "rank0_only", "process_group", "compiled", "sync_batch_norm",
                                   "module_state_dict", "forward_hook", "unfreeze", "eval_memory", "no_grad_forward", "module_modes", "optimizer_anew", "loss_view1", "buffer_replicas",
                                   "averaged_model", "save_pretrained", "two_calls", "pairs_rows", "recompute_buffers", "lbfgs", "attributes", "cumulative_bn", "count_output", "graphs_part", "edits_after_load", "sparse_embedding", "ema_state_dict",
                                   "param_hooks", "retained_graph", "adversarial",
                                   "add_param_group", "outside_parameter", "table_first",
                                   "shared_module", "skipped_backward", "call_layouts",
                                   "complex_values", "state_before_step", "stashed_buffer",
                                   "fused_fake_quant", "qat_resume", "shared_later", "eval_before_step", "grad_in_place",
                                   "assigned_after_call", "named_backward", "outputs_without_rows",
                                   "pairs_in_forward", "task_tensor", "failed_load"])
def test_errors_every_rank_agrees_on_name_their_cause_and_end_nothing(probe):
    """Ranks with different batch sizes in one call (on every such call), control flow on
    data that differs between ranks, different models, ranks whose batches have their own
    lengths: each rank raises the error naming the cause, and nothing else fails (the loop
    can catch it and go on; padded with rannc.pad_to_same_length, the ranks' batches train
    equal to PyTorch). length_branch: a sequence length for which the model is another
    program than planned was such an error; since session 40 it is planned on its own and
    trains equal to PyTorch ([Note: programs at other shapes] in module.py). table_first: a
    table passed before the batch made the batch's tensors shared ones, each rank's own,
    training wrongly without a word ([Note: shared arguments agree] in deployed.py).
    shared_module: two RaNNCModules sharing an encoder failed in torch on the rank whose
    tensors the first freed ([Note: modules wrapped twice] in module.py). skipped_backward: a
    rank that skipped a fill-drain backward left every rank waiting until comm_timeout, on
    every later call too. call_layouts: the same arguments passed positionally, by keyword,
    in another keyword order or mixed are one program ([Note: call layouts] in
    call_layout.py; each was traced and planned anew, warning of a changing number), while
    names that **kwargs takes keep their order. complex_values: an FFT layer's complex
    weights (rank 0's sent to every rank, gradients summed over replicas) failed ("MPI cannot
    move tensors of dtype ComplexFloat"), and a complex value crossing stages carried no
    gradient (the first stage never trained). state_before_step: rank 0 alone reading
    state_dict() between backward and step gets every parameter before the update (the
    others served it after their own step: [Note: a step is a collective]).
    stashed_buffer: a buffer written in place in forward and read by an op that saves it
    for backward failed on the first stage of a pipeline ("modified by an inplace
    operation"): the next micro-batch's forward wrote it under the stashed graph ([Note:
    buffers a stashed backward reads] in runtime/stage.cpp). fused_fake_quant: QAT's
    fused observers read as coupling the rows on one rank's data and not on another's (an
    error blaming control flow on the data); observed with them off ([Note: row-coupling
    flags] in convert.cpp), the ranks agree and train equal to PyTorch.
    failed_load: a load_state_dict with a wrong shape on either stage raises on every rank
    and changes nothing (each rank had copied its own stages' keys: half-loaded).
    task_tensor: a multi-task model whose head a 0-dim task id tensor chooses (int(task),
    `if task == 0`) trains each task's head as PyTorch: the trace fixed the first call's
    branch for every later task, without a word ([Note: tensors that choose the program]).
    pairs_in_forward: a reward model scoring chosen and rejected concatenated in forward
    trains as PyTorch on 1 and 2 stages; the rows of the concatenated masks agreed by chance
    on one rank's lengths and not on the other's, so the ranks traced different graphs,
    blamed on control flow ([Note: rows that agree by chance] in csrc/frontend/convert.cpp).
    shared_later: small tensor arguments without rows (a label per set beside the sets'
    rows) are compared at every call, not at the first alone (where they happened to agree
    there, later calls trained on rank 0's labels without a word: parameters 0.048 off).
    qat_resume: a per-channel observer's resize_ of its range to its own size made the
    range a constant of the trace (a TraceError at every first call), and a checkpoint
    resumed into a QAT model never called failed on the range's size; both train equal to
    PyTorch ([Note: resizes to the same size] in _trace.py, [Note: modules that resize
    their state at a load] in checkpoint.py).
    eval_before_step: an eval call between backward and step (evaluation under gradient
    accumulation) left the ranks that only evaluate a layer with its weights before the
    step, for the next eval calls and state_dict(): the step now marks them stale.
    grad_in_place: .grad was a view of the gradient bucket on one stage, so
    `p.grad.add_(p, alpha=wd)` outside no_grad and `p.grad.detach_()` failed where PyTorch
    takes them; it is the bucket's memory, detached. assigned_after_call: a buffer,
    parameter or submodule assigned (or a buffer registered) after the first call reached no
    stage, and state_dict() returned it untrained; it is refused where it is made, the
    module unchanged ([Note: tensors assigned after the first call] in placement.py).
    named_backward: loss.backward(inputs=[parameters]) ran nothing for a RaNNCModule's
    parameters (.grad stayed None); the named ones get the call's gradients ([Note: backward
    of named parameters] in named_backward.py). outputs_without_rows: a multi-task model's
    stack of losses, a feature mean and a confusion count came back as micro-batch 0's
    value, and a backward through the stack trained on that micro-batch alone; they are
    combined over the shares as scalars are ([Note: outputs without rows] in deployed.py).
    eval_after_new_length: a training call at a new length between evaluations
    leaves the weights of eval's ranks current (it had marked them so before the step).
    num_items_in_batch: transformers' sum over a count passed in adds up over the shares.
    uneven_selection: x[keep] selecting as many tokens from every row of the first batch
    does not make later, uneven batches fail ([Note: data-sized values]). late_optimizer:
    an optimizer built after wrapping becomes the module's at its first step; built before
    the first call (as Trainer builds it) its state is in the plan, built after it rank 0
    says the plan did not count its state ([Note: optimizers made after wrapping]).
    rank0_only: DDP's `if rank == 0: torch.save({model.state_dict(), optimizer.state_dict()})`
    writes the whole model and optimizer, which the other ranks serve from their next call
    or the end of their script ([Note: gathers asked by some ranks]), and every rank resumes
    from it; two different gathers, or an eval call on rank 0 alone, are an error on every
    rank naming what each called ([Note: named collectives]). process_group: rannc.init_process_group() gives a DDP script's
    torch.distributed (sampler, metrics) over the MPI ranks; its world collectives serve a
    gather that rank 0 asks alone, and beside a RaNNCModule call are a named error ([Note:
    torch.distributed agrees with rannc]). compiled: a model compiled before
    wrapping, and the wrapper compiled, train as PyTorch ([Note: compiled models]).
    sync_batch_norm: SyncBatchNorm with torch.distributed initialised runs as BatchNorm
    ([Note: SyncBatchNorm]); before, tracing failed (CPU) or recorded an all-gather (GPU).
    module_state_dict: model.module.state_dict() on a rank that lacks tensors is an error
    naming them (it returned empty tensors), as are model.module.load_state_dict() and
    model.module(x) (they failed in some op on a size of 0).
    forward_hook: a hook's returned value is traced; rank 0 warns of its side effects, and
    of hooks registered after the trace, which never run (no word before).
    unfreeze: parameters unfrozen or frozen between steps train as in PyTorch (the change
    was ignored: an unfrozen block never trained) ([Note: frozen parameters]).
    averaged_model: AveragedModel (an EMA made before the first call) and a frozen
    copy.deepcopy of a RaNNCModule evaluate, in eval and train mode, and give state_dict(),
    load_state_dict() and a checkpoint of the average (save_checkpoint, load_checkpoint) as
    PyTorch's copies of the plain model, where evaluation places
    layers on other ranks than training ([Note: copies of a wrapped model]).
    save_pretrained: transformers' model.save_pretrained(dir) on the wrapper, on every rank
    or rank 0 alone, writes config.json and the whole weights, loaded equal to PyTorch's;
    so does a model's save_pretrained that takes no state_dict and saves its own (diffusers'
    ModelMixin's: it was refused, pointing back at save_pretrained).
    two_calls: one backward of a loss over two 1F1B calls applies each call's gradients (it
    applied the second's twice), and a GAN trains as PyTorch: the discriminator's calls on
    real and fake rows await one backward under fill-drain (was an error), the generator
    learns through the discriminator's input gradients (was at half its gradient on 2
    ranks), a forward dropped without a backward frees its stashes ([Note: calls awaiting
    their backward] in csrc/runtime/engine.h, [Note: input gradients]).
    param_hooks: a parameter's hooks run once per backward on its whole gradient, on 3 ranks
    with a replicated stage: a clamp (it clamped each micro-batch's share) and a
    post-accumulate hook ([Note: parameter hooks] in deployed.py).
    retained_graph: backward(retain_graph=True), then another backward through the same
    outputs adds its gradients as in PyTorch: 1F1B's loss (the third added 4 times the
    gradients) and a fill-drain forward's two heads (was an error) ([Note: retained graphs]
    in csrc/runtime/engine.h).
    adversarial: FGSM adversarial training under 1F1B and fill-drain: torch.autograd.grad
    of the loss by the input (and backward(inputs=[x])) leaves .grad alone, as in PyTorch
    (the clean batch's gradients were added to the step's); create_graph=True is an error
    naming it ([Note: gradients without .grad] in deployed.py).
    add_param_group: a block unfrozen after 2 steps joins the optimizer by add_param_group;
    the new group is cut to the rank's share before the step (it kept every parameter, and
    optimizer.state_dict() dropped it), and training and the state equal PyTorch's.
    outside_parameter: a learnt temperature outside the wrapped model, in its optimizer,
    trains as PyTorch's (the optimizer's cut dropped it: it never trained), the gathered
    state holds its state, and save_checkpoint works, warning that it does not save it
    (it failed with a KeyError).
    pairs_rows: an in-batch contrastive loss inside forward is planned with one micro-batch
    (each micro-batch paired its own rows), equal to DDP on one stage given, and to one
    process on two and where the planner chooses, which keeps the loss's stage on one
    replica ([Note: rows kept together]; it replicated it, pairing each replica's rows);
    outside the module, the towers pipeline micro-batches ([Note: rows paired]).
    recompute_buffers: batch norm on recomputing stages moves its statistics once per
    forward, as PyTorch ([Note: buffers a recompute writes]; twice before).
    lbfgs: LBFGS is planned as one stage and trains as PyTorch; num_stages=2 with it (or with
    a class built on it) is an error on every rank, and so is an LBFGS built after the first
    call planned two stages (it stepped by each rank's stages alone) ([Note: optimizers
    that read every gradient]).
    attributes: a temperature and a flag set between steps train as PyTorch (they were
    ignored), and a count that forward keeps is named ([Note: attributes read]).
    cumulative_bn: swa_utils.update_bn recomputes batch norm's statistics as in PyTorch
    ([Note: cumulative batch norm]; momentum=None's factor was fixed by the trace).
    count_output: a count of the data beside the loss no longer makes the ranks' graphs
    differ ([Note: integers of sizes]).
    graphs_part: ranks whose graphs differ are told where: the op and each rank's sizes.
    sparse_embedding: nn.Embedding(sparse=True) with SparseAdam on a replicated stage trains
    as PyTorch ([Note: sparse gradients]; "reshape is not implemented for sparse tensors"),
    and on two stages planned from profiles (timing SparseAdam's step on dense scratch
    gradients failed the plan, a probe's finding of session 37).
    ema_state_dict: timm's ModelEmaV2 updating a copy through its state_dict() values
    averages as PyTorch's ([Note: writes into a copy's state_dict]; it never moved).
    edits_after_load: a new head and lr set after load_checkpoint, before the first call,
    are kept ([Note: edits after a load]; the checkpoint was read over them)."""
    ranks = 3 if probe == "param_hooks" else 2
    res = mpirun("loop_probes.py", ranks, probe, timeout=300, env={"RANNC_COMM_TIMEOUT": "60"})
    assert res.returncode == 0, res.stdout[-4000:]
    if probe == "call_layouts":  # the hint of a changing number only where one changed
        before, after = res.stdout.split("PROGRAMS OF OTHER STRUCTURES 0")
        assert "mixup's lam" not in before and "mixup's lam" in after, res.stdout[-4000:]
    for r in range(ranks):
        assert f"OK rank {r}" in res.stdout, res.stdout[-4000:]
    if probe == "late_optimizer":
        assert ("planned for the state of AdamW (adam), built after RaNNCModule over its "
                "parameters" in res.stdout), res.stdout[-3000:]
        assert res.stdout.count("AdamW was built after RaNNCModule's first training call and "
                                "steps its parameters: it is now the module's optimizer") == 1, \
            res.stdout[-3000:]  # the module with the plan from a file does not warn
    if probe == "unfreeze":
        assert "28 of 28 parameters now require grad (16 when planned): traced again" in \
            res.stdout, res.stdout[-3000:]
    if probe == "attributes":
        assert "the forward changes calls of the model (" in res.stdout, res.stdout[-3000:]
        assert "the attribute temperature of the model (1.0 -> 0.5) changed" in res.stdout, \
            res.stdout[-3000:]
    if probe == "forward_hook":
        assert "forward hooks on blocks.1 run while rannc traces the model" in res.stdout, \
            res.stdout[-3000:]
        for kind in ("forward", "backward"):
            assert res.stdout.count(f"{kind} hooks on blocks.0 were registered after rannc "
                                    "traced the model") == 1, res.stdout[-3000:]
    if probe == "sync_batch_norm":
        assert "SyncBatchNorm in stem.1, blocks.0.bn1, blocks.0.bn2 and 2 more: rannc" in res.stdout, res.stdout[-3000:]
    if probe == "compiled":
        assert ("torch.compile was applied to the model, blocks.1: rannc traces the model eagerly"
                in res.stdout), res.stdout[-3000:]


@pytest.mark.parametrize("ranks", [2, 3])
def test_training_calls_with_other_arguments_train_as_pytorch(ranks):
    """[Note: other training arguments] in module.py: training calls with and without image
    features and with another task's head (a string argument) are three more programs, each
    planned on its own. Every step's loss, torch's clip_grad_norm_ and AdamW's update of
    the parameters each rank trains equal PyTorch's, and so do batch norm's statistics,
    optimizer_state_dict(), eval calls, accumulating the first program's call under
    no_sync() with another's after it, and a resume from a checkpoint (2 ranks, 1F1B; 3
    ranks, replicas under fill-drain); a program whose stages hold a parameter on other
    ranks than its trainers sends them its gradient (checked to happen); another program's
    call under no_sync() is an error on every rank (was a TraceError for every such call)."""
    res = mpirun("loop_probes.py", ranks, "other_arguments", timeout=300,
                 env={"RANNC_COMM_TIMEOUT": "60"})
    assert res.returncode == 0, res.stdout[-4000:]
    for r in range(ranks):
        assert f"OK rank {r}" in res.stdout, res.stdout[-4000:]


@pytest.mark.parametrize("ranks", [2, 3])
def test_several_optimizers_train_save_and_resume_as_pytorch(ranks):
    """[Note: several optimizers] in optimizer_share.py: Muon's split (one optimizer for the
    blocks' matrices, AdamW for the rest), passed to RaNNCModule as a list or built after
    wrapping (each added at its first step): steps equal PyTorch's, each optimizer is cut to
    the rank's share, its own state_dict() on rank 0 alone is its whole state (the other
    ranks serve the gather), and a module resumed from those files or from save_checkpoint
    trains on equal to PyTorch. Before, a second optimizer's state_dict() held this rank's
    share only, and a resume lost the other ranks' state without a word."""
    res = mpirun("loop_probes.py", ranks, "several_optimizers", timeout=600,
                 env={"RANNC_COMM_TIMEOUT": "60"})
    assert res.returncode == 0, res.stdout[-4000:]
    for r in range(ranks):
        assert f"OK rank {r}" in res.stdout, res.stdout[-4000:]


@pytest.mark.parametrize("ranks,model,stages,micro,rows,extra", [
    (2, "gpt", 2, 4, "4,4,1,3", ["--eval"]),            # short last batch: fewer micro-batches
    (3, "transformer_loss", 2, 3, "4,2,5", ["--opt", "replicas=1,2"]),  # bigger than traced
    (4, "gpt", 2, 2, "4,1", ["--opt", "replicas=2,2"]),
    (2, "transformer", 2, 2, "4,3", ["--mode", "outside"]),   # fill-drain
])
def test_batch_size_may_change_between_calls(ranks, model, stages, micro, rows, extra):
    """The plan's stages and replicas stay; rows are re-split for each new size (the
    micro-batch count capped by the rows); equal to PyTorch on the concatenated batch."""
    res = mpirun("train_check.py", ranks, model, "--stages", stages, "--micro", micro,
                 "--steps", 4, "--rows", rows, *extra, timeout=300,
                 env={"RANNC_COMM_TIMEOUT": "60"})
    assert res.returncode == 0, res.stdout[-4000:]
    for r in range(ranks):
        assert f"OK rank {r}" in res.stdout, res.stdout[-4000:]
    if rows.startswith("4,4,1"):
        assert ("local batch of 1 rows (planned with 4): the plan's stages and replicas re-split "
                "the rows; 2 micro-batch(es) instead of the plan's 4") in res.stdout


@pytest.mark.parametrize("ranks,model,stages,micro,lengths,extra", [
    (2, "gpt", 2, 2, "8,5,12,5", ["--eval"]),
    (4, "gpt", 2, 2, "8,12,5,12", ["--opt", "replicas=2,2", "--rows", "4,3,4,2"]),  # rows too
    (2, "transformer", 2, 2, "6,4,9", ["--mode", "outside"]),   # fill-drain
    (2, "gpt", 2, 4, "8,5,12", ["--opt", "schedule=zb_h1"]),     # split backward
])
def test_sequence_length_may_change_between_calls(ranks, model, stages, micro, lengths, extra):
    """[Note: new input shapes] in deployed.py: each new length is traced again and runs the
    plan made at the first one (rank 0 logs it once per length); loss, gradients and
    parameters after every step equal PyTorch on the concatenated batch."""
    res = mpirun("train_check.py", ranks, model, "--stages", stages, "--micro", micro,
                 "--steps", len(lengths.split(",")), "--lengths", lengths, *extra, timeout=300,
                 env={"RANNC_COMM_TIMEOUT": "60"})
    assert res.returncode == 0, res.stdout[-4000:]
    for r in range(ranks):
        assert f"OK rank {r}" in res.stdout, res.stdout[-4000:]
    new = len(set(lengths.split(","))) - 1
    assert res.stdout.count("new input shapes") == new, res.stdout[-4000:]


def test_a_scalar_shape_value_crossing_stages_is_given_as_a_scalar():
    """A stage computes the sizes it takes from its own rows ([Note: shape values] in
    ir/value.h); a Scalar-typed one (aten::ScalarImplicit's result) was given as a tensor,
    and torch.arange failed ("IValue is not a Scalar", seen with transformers Gemma2 in one
    plan of four). Fake costs with seeded noise move the boundary of 2 stages x 4
    micro-batches; the seeds are tried until it falls between LateScalar's
    aten::ScalarImplicit and its aten::arange."""
    for seed in range(12):
        res = mpirun("train_check.py", 2, "late_scalar", "--stages", 2, "--micro", 4, "--steps", 2,
                     "--show-stages", "--opt", "profile_fake_timer=True", "profile_fake_noise=0.3",
                     f"profile_fake_seed={seed}", "probe_bandwidth=False",
                     timeout=300, env={"RANNC_COMM_TIMEOUT": "60"})
        stages = re.findall(r"stage (\d) ops: (.*)", res.stdout)
        cut = (len(stages) == 2 and stages[0][1].endswith("aten::ScalarImplicit")
               and stages[1][1].startswith("aten::arange"))
        if cut or res.returncode != 0:
            break
    assert res.returncode == 0, res.stdout[-4000:]
    for r in range(2):
        assert f"OK rank {r}" in res.stdout, res.stdout[-4000:]
    assert cut, f"no seed put the boundary before aten::arange: {stages}"


@pytest.mark.parametrize("ranks,stages,micro,extra", [
    (2, 2, 2, []),
    (3, 3, 3, ["--opt", "schedule=fill_drain"]),
    (4, 2, 2, ["--opt", "replicas=1,3"]),
    (1, 1, 2, []),
])
def test_gradients_flow_to_inputs_that_require_them(ranks, stages, micro, extra):
    """Arguments that require grad get PyTorch's gradient (this rank's rows of it; the sum
    for a tensor without a batch dimension), also an argument a later stage takes directly."""
    res = mpirun("train_check.py", ranks, "late_input", "--stages", stages, "--micro", micro,
                 "--steps", 3, "--input-grad", *extra, timeout=300,
                 env={"RANNC_COMM_TIMEOUT": "60"})
    assert res.returncode == 0, res.stdout[-4000:]
    for r in range(ranks):
        assert f"OK rank {r}" in res.stdout, res.stdout[-4000:]
    if stages > 1:
        assert "a later stage takes an argument directly" in res.stdout, res.stdout[-3000:]


def test_optimizer_state_made_before_the_first_call_follows_its_parameters():
    """Stages on another device than the model (device=cuda with the model on the CPU):
    optimizer state that exists before the first call (a loaded state_dict) moves with
    its parameters, `step` staying on the CPU as torch keeps it (the meta device stands
    in for a GPU here)."""
    from rannc.optimizer_share import OptimizerShare
    from rannc.placement import StatePlacement
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    placement = StatePlacement(model, torch.device("cpu"), torch.device("meta"),
                               OptimizerShare([opt]))
    for p in model.parameters():  # what _place does after moving p (set_data to meta: no)
        placement._place_optimizer_state(p)
        assert opt.state[p]["exp_avg"].device.type == "meta"
        assert opt.state[p]["exp_avg_sq"].device.type == "meta"
        assert opt.state[p]["step"].device.type == "cpu"


@pytest.mark.parametrize("device, crowded_ranks, expected", [
    ("cpu", [], True), ("cuda:0", [], True), ("cuda:0", [1], False), ("cpu", [1], False)])
def test_ranks_that_share_a_gpu_do_not_profile_beside_each_other(monkeypatch, device, crowded_ranks,
                                                                 expected):
    """Parallel profiling spreads pieces over the ranks; where ranks share a GPU (here:
    2 local ranks, 1 GPU, on this rank or another), their measurements would run side by
    side on one device, so rank 0 profiles alone. All ranks decide alike (a gather)."""
    from rannc import _C, planning, transport
    monkeypatch.setattr(_C, "get_world_size", lambda: 2)
    monkeypatch.setattr(_C, "get_local_size", lambda: 2)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(transport, "all_gather_objects",
                        lambda flag: [flag or r in crowded_ranks for r in range(2)])
    assert planning.profile_in_parallel(True, device) is expected
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # this rank crowded too
    assert planning.profile_in_parallel(True, device) is (not device.startswith("cuda") and expected)
    assert planning.profile_in_parallel(False, device) is False


@pytest.mark.parametrize("ranks,stages,replicas", [(2, 2, None), (3, 2, "2,1")])
def test_sequence_first_models_train_as_pytorch(ranks, stages, replicas):
    """[Note: batch dimensions] in _trace.py: an nn.LSTM classifier fed [sequence, batch,
    features] (loss inside, 1F1B), PyTorch's word language model (tokens [sequence,
    batch], the hidden state passed in and carried on, loss outside: fill-drain) and its
    nn.Transformer language-model tutorial (sequence first, causal mask; its layers were
    glued into one task before session 31) train equal to PyTorch with their batch in
    dimension 1, in 2 micro-batches (mpi/seq_first_check.py). The language model's last
    chunk is as long as its LSTM has layers, and a batch-first LSTM takes its hidden state
    [layers, batch, hidden]: both failed to trace before session 35."""
    res = mpirun("seq_first_check.py", ranks, stages, *([replicas] if replicas else []),
                 timeout=300, env={"RANNC_COMM_TIMEOUT": "60"})
    assert res.returncode == 0, res.stdout[-4000:]
    for r in range(ranks):
        assert f"OK rank {r}" in res.stdout, res.stdout[-4000:]


def test_a_shared_argument_of_the_batch_size_is_named():
    """[Note: rows alike on every rank] in deployed.py: a queue passed as an argument whose
    first size equals the local batch reads as rows of the batch and was cut into rows
    without a word (a probe's MoCo: loss 0.090 for 0.047); rank 0 names it, once, and not a
    queue of another size (mpi/loop_probes.py queue_alike)."""
    res = mpirun("loop_probes.py", 2, "queue_alike", timeout=300, env={"RANNC_COMM_TIMEOUT": "60"})
    assert res.returncode == 0, res.stdout[-4000:]
    for r in range(2):
        assert f"OK rank {r}" in res.stdout, res.stdout[-4000:]
    said = ("args[1] has the same values on every rank, unlike the other rows of the batch: "
            "rannc takes it as rows of the batch (a first size equal to the local batch's 4 rows)")
    assert res.stdout.count(said) == 1, res.stdout[-4000:]
    # one rank: its rows are trivially alike on every rank (each single-rank run warned)
    res = _single_process("""
import torch, rannc
class Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x, y):  # labels are too short to compare: x alone reads as alike
        return torch.nn.functional.cross_entropy(self.head(x), y)

model = Classifier()
module = rannc.RaNNCModule(model, torch.optim.SGD(model.parameters(), lr=0.1))
module(torch.randn(4, 8), torch.tensor([0, 1, 2, 0])).backward()
print("trained")
""")
    assert res.returncode == 0 and "trained" in res.stdout, res.stdout + res.stderr[-3000:]
    assert "the same values on every rank" not in res.stdout + res.stderr, res.stdout[-3000:]


def test_optimizers_rannc_cannot_share_are_refused_naming_the_cure():
    """[Note: optimizers rannc cannot share] in optimizer_share.py: ZeroRedundancyOptimizer
    (its consolidated state_dict() lost entries on one stage without a word; on two stages
    gloo aborted every rank) and a Lookahead that never ran Optimizer.__init__ (torch's
    AttributeError from a hook) are refused at wrapping, naming the cure; the model then
    trains with the optimizer they wrap."""
    res = _single_process("""
import torch, rannc
from torch.distributed.optim import ZeroRedundancyOptimizer
rannc.init_process_group()
m = torch.nn.Linear(4, 1)
zero = ZeroRedundancyOptimizer(m.parameters(), optimizer_class=torch.optim.AdamW, lr=0.1)
try:
    rannc.RaNNCModule(m, zero)
except rannc.Error as e:
    print("refused:", e)
class Lookahead(torch.optim.Optimizer):  # lonePatient/lookahead_pytorch's habit
    def __init__(self, inner):
        self.optimizer, self.param_groups, self.state = inner, inner.param_groups, inner.state
        self.defaults = inner.defaults
    def step(self, closure=None):
        return self.optimizer.step(closure)
inner = torch.optim.Adam(m.parameters(), lr=0.1)
try:
    rannc.RaNNCModule(m, Lookahead(inner))
except rannc.Error as e:
    print("refused:", e)
wrapped = rannc.RaNNCModule(m, inner)
before = m.weight.detach().clone()
wrapped(torch.randn(4, 4)).pow(2).mean().backward()
inner.step()
print("trained:", bool((wrapped.state_dict()["weight"] != before).all()))
""")
    assert res.returncode == 0, res.stdout + res.stderr
    assert ("refused: ZeroRedundancyOptimizer shards the optimizer state over the "
            "torch.distributed ranks" in res.stdout), res.stdout + res.stderr
    assert "Pass the optimizer it wraps" in res.stdout
    assert ("refused: Lookahead subclasses torch.optim.Optimizer without running "
            "Optimizer.__init__" in res.stdout), res.stdout + res.stderr
    assert "trained: True" in res.stdout, res.stdout + res.stderr


def test_quantization_aware_training_observers_train_as_pytorch_once_initialised():
    """[Note: writes through .data] in _trace.py: torch.ao.quantization's moving-average
    observer decides in Python on `min_val == inf`, a value made from the buffers it
    writes; the check saw only decisions on the buffer itself, so QAT overwrote the range
    with each batch's instead of averaging it, without a word (max_val 1.646 for 2.003).
    Uninitialised it is a TraceError naming the buffers and the cure; after one call of
    the plain model the written state decides as the trace did, and training, scale and
    range equal PyTorch's."""
    res = _single_process("""
import copy, torch, torch.nn as nn, torch.nn.functional as F, rannc
import torch.ao.quantization as Q
class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 1)
        self.fq = Q.FakeQuantize(observer=Q.MovingAverageMinMaxObserver, quant_min=0, quant_max=255)
    def forward(self, x, y):
        return F.mse_loss(self.l2(self.fq(torch.relu(self.l1(x)))), y)
torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
batches = [(torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)) for _ in range(4)]
m = M()
try:
    rannc.RaNNCModule(m, torch.optim.SGD(m.parameters(), lr=0.1))(*batches[0])
except rannc.TraceError as e:
    print("refused:", str(e)[:200])
m = M()
m(*batches[0])  # the observers hold a range: their decision no longer changes
ref = copy.deepcopy(m)
opt, ref_opt = (torch.optim.SGD(k.parameters(), lr=0.1) for k in (m, ref))
w = rannc.RaNNCModule(m, opt, num_microbatches=1)
for x, y in batches[1:]:
    loss, ref_loss = w(x, y), ref(x, y)
    torch.testing.assert_close(loss, ref_loss)
    loss.backward(); ref_loss.backward()
    for o in (opt, ref_opt): o.step(); o.zero_grad()
sd = w.state_dict()
for k, v in ref.state_dict().items():
    torch.testing.assert_close(sd[k], v, msg=lambda msg: f"{k}: {msg}")
print("trained as PyTorch", sd["fq.activation_post_process.max_val"].item())
""")
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert "refused: the forward decides in Python on 'fq.activation_post_process.min_val'" \
        in res.stdout, res.stdout[-3000:]
    assert "trained as PyTorch" in res.stdout, res.stdout + res.stderr[-3000:]


def test_buffers_a_forward_writes_with_several_micro_batches_are_named():
    """[Note: buffers written per micro-batch] in module.py: a VQ codebook kept by an EMA
    under no_grad moves once per micro-batch, unlike one process, without a word before;
    rank 0 names such buffers at the first training call, not batch norm's statistics, and
    nothing with one micro-batch; it says batch norm normalises per micro-batch."""
    res = _single_process("""
import torch, torch.nn.functional as F, rannc
class Codebook(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.bn = torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)
        self.register_buffer("embed", torch.randn(8, 4))
    def forward(self, x):
        z = self.bn(self.lin(x))
        onehot = F.one_hot(torch.cdist(z, self.embed).argmin(1), 8).float()
        with torch.no_grad():
            self.embed.mul_(0.9).add_(onehot.t() @ z, alpha=0.1)
        return (z - x).pow(2).mean()
for micro in (2, 1):
    model = Codebook()
    module = rannc.RaNNCModule(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               num_microbatches=micro, cost_model="analytic")
    module(torch.randn(8, 4)).backward()
    print("done", micro, flush=True)
""")
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert "writes the buffer(s) embed, which a stage writes once per micro-batch: with 2" \
        in res.stderr, res.stderr[-3000:]
    assert res.stderr.count("writes the buffer(s)") == 1, res.stderr[-3000:]
    assert "bn.running_mean" not in res.stderr, res.stderr[-3000:]
    # [Note: batch norm per micro-batch] in planning.py: said with 2, not with 1
    assert res.stderr.count("batch norm in bn normalises each micro-batch by its own "
                            "statistics: with 2 micro-batches") == 1, res.stderr[-3000:]


def test_what_users_do_after_training_is_said_or_done():
    """A CNN with batch norm on 2 replicas: rank 0 says each replica's share has its own
    statistics (as DDP's ranks; without a word before); `.float()` of an fp32 model after
    the first call is a no-op (refused before) while a real conversion stays refused; a
    copy called in training mode says it runs forward only (torch's "does not require grad"
    at backward was all) (mpi/loop_probes.py after_training)."""
    res = mpirun("loop_probes.py", 2, "after_training", timeout=300, env={"RANNC_COMM_TIMEOUT": "60"})
    assert res.returncode == 0, res.stdout[-4000:]
    for r in range(2):
        assert f"OK rank {r}" in res.stdout, res.stdout[-4000:]
    assert res.stdout.count("batch norm in 1 normalises each replica's share of the rows") == 1, \
        res.stdout[-4000:]
    assert res.stdout.count("a copy of a RaNNCModule (copy.deepcopy) runs forward only") == 1, \
        res.stdout[-4000:]


def test_evaluation_under_inference_mode_traces_new_programs():
    """timm's and torchvision's evaluation, `with torch.inference_mode(): model(x)`: a call
    that traces a new program (the first eval, a model with buffers called first under it)
    failed with "Inference tensors do not track version counter" (session 35's watch of
    writes through .data read their versions); equal to PyTorch's eval."""
    res = _single_process("""
import copy, torch, rannc
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                            torch.nn.Linear(8, 2))
reference = copy.deepcopy(model)
first = rannc.RaNNCModule(copy.deepcopy(model), cost_model="analytic")
first.eval()
x = torch.randn(6, 4)
with torch.inference_mode():
    out = first(x)
reference.eval()
torch.testing.assert_close(out, reference(x))
module = rannc.RaNNCModule(model, torch.optim.SGD(model.parameters(), lr=0.1), cost_model="analytic")
module(torch.randn(8, 4)).sum().backward()
module.eval()
with torch.inference_mode():
    print("eval", module(torch.randn(5, 4)).shape, flush=True)
""")
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert "eval torch.Size([5, 2])" in res.stdout, res.stdout + res.stderr[-3000:]


def test_a_small_first_evaluation_runs_fewer_micro_batches_than_fixed():
    """num_microbatches=4 fixed for training, then a first eval call of 2 rows: planning it
    failed on every rank ("num_microbatches=4 needs at least 4 rows"); an eval program runs
    as many as its batch allows, equal to PyTorch."""
    res = _single_process("""
import copy, torch, rannc
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
reference = copy.deepcopy(model)
module = rannc.RaNNCModule(model, torch.optim.SGD(model.parameters(), lr=0.1),
                           num_microbatches=4, cost_model="analytic")
module(torch.randn(8, 4)).sum().backward()
module.eval()
x = torch.randn(2, 4)
with torch.no_grad():
    torch.testing.assert_close(module(x), reference(x))
print("eval ok", flush=True)
""")
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert "eval ok" in res.stdout


@pytest.mark.parametrize("mode", ["detach", "zeros_like", "shape"])
def test_a_parameter_two_stages_read_trains_as_in_pytorch(mode):
    """mpi/shared_reads_check.py: a tied embedding the head reads detached (only the first
    stage's gradient reaches it; the head's stage kept it stale and trained another model),
    a weight the last stage reads for its type (torch.zeros_like), and nanoGPT's LayerNorm
    reading its weight's shape (the stage that read the size held a copy that never
    trained, which state_dict() served, and the optimizer's state_dict() lost its state):
    state_dict() and optimizer.state_dict() equal PyTorch's after 4 Adam steps."""
    res = mpirun("shared_reads_check.py", 2, mode, timeout=200, env={"RANNC_COMM_TIMEOUT": "60"})
    assert res.returncode == 0, res.stdout[-4000:]
    for r in range(2):
        assert f"OK rank {r}" in res.stdout, res.stdout[-4000:]


def test_the_option_precision_under_another_autocast_is_said():
    """precision="bf16" decides over the caller's torch.autocast(float16); rank 0 says so
    once (it ran bf16 without a word)."""
    res = _single_process("""
import torch, rannc
m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
w = rannc.RaNNCModule(m, torch.optim.SGD(m.parameters(), lr=0.1), precision="bf16")
for _ in range(2):
    with torch.autocast("cpu", dtype=torch.float16):
        w(torch.randn(4, 4)).sum().backward()
""")
    assert res.returncode == 0, res.stderr[-3000:]
    said = "the call runs under torch.autocast with torch.float16, but the option precision is 'bf16'"
    assert res.stderr.count(said) == 1, res.stderr[-3000:]


@pytest.mark.parametrize("probe", ["stand_in_traces", "adagrad_after_eval", "caught_trace_error",
                                   "caught_bad_batch", "lazy_cache", "optional_tensors",
                                   "first_token", "aliased_module", "draws_in_forward",
                                   "rank0_weights", "ndim_groups", "embeds_outside"])
def test_loops_found_failing_by_probes_equal_pytorch(probe):
    """Session 37's and 38's new-user probes.
    stand_in_traces: a new length and an eval call after training trace with stand-ins for
    the parameters ([Note: stand-in parameters] in _trace.py); with every matrix N(0, 0.02)
    the rows of a layer were all near its bias, the batch analysis read
    nn.MultiheadAttention's flattened rows otherwise than with the real weights, and the
    new length was "another program than the one planned" (the eval call: "the ranks
    traced different graphs").
    adagrad_after_eval: Adagrad makes its state in __init__; built after an eval call
    (Trainer's evaluate() before train()), it made it for this rank's freed, empty
    parameters and its step failed once training gave them storage ([Note: state made on
    freed parameters] in optimizer_share.py).
    caught_trace_error: a TraceError every rank raises at a module's first call is agreed,
    not a rank's failure: a script that catches it and goes on with another model trains
    ([Note: trace errors agreed] in module.py; the new module failed with "rank 0 stops
    because rank 1 failed").
    caught_bad_batch: an error the model raises while traced (int32 labels on one rank at
    the first call, a wrong feature size at a new shape) and a batch too small for the plan
    are errors on every rank; the loop that catches them trains on equal to PyTorch (the
    failing rank's notice broke every later call, and a receive cut short could write into
    freed memory).
    lazy_cache: a table the forward builds at its first call and rebuilds for a longer
    sequence was built by the trace's first run only, so the run at another batch size
    took the other branch ("the traced program depends on the input values", or a stale
    table: "the model fails when run at batch size 2"); each run now starts from the module
    as the call found it ([Note: tracing changes no attribute] in _trace.py), and rank 0
    names a tensor left in an attribute.
    optional_tensors: an optional argument traced as a tensor and passed as None later (or
    a 0-dim tensor, then a number) was taken for the traced program at new shapes ("another
    program than the one planned ... pad the inputs"); parametrize.cached() was torch's
    "Cannot trace a model while caching parametrizations" (probes' findings).
    first_token: greedy decoding from one token through nn.MultiheadAttention: length 2 is
    another program (a size of 1 traces otherwise), an error until session 40; it is planned
    on its own, later lengths run its plan, and training at lengths 1, 3, 1, 2 equals
    PyTorch ([Note: programs at other shapes] in module.py).
    aliased_module: a module reachable under two names (transformers 4's T5 embedding) kept
    the stand-ins of a trace at a new length as its weights: the loss 1.5% off, or, tied to
    the head, "Cannot insert a Tensor that requires grad as a constant" ([Note: modules
    under several names] in _trace.py).
    draws_in_forward: classifier-free guidance's label dropout drawn in forward
    (`torch.rand(B) < p`) had its rows compared between the trace's observations, which
    agreed by chance for some draws: the ranks traced different graphs, an error blaming
    control flow on the data ([Note: random values] in csrc/frontend/convert.cpp).
    rank0_weights: each rank seeding otherwise before building the model (timm's scripts),
    or weights loaded on rank 0 alone, trained each stage from its own rank's values (loss
    0.808 for 1.192 at step 0); the stages start from rank 0's, as DDP broadcasts them
    ([Note: rank 0's weights] in placement.py).
    ndim_groups: nanoGPT's AdamW groups (p.dim() >= 2) built after the first call read
    freed weights as 1-D: the ranks' groups differed and optimizer_state_dict() put one
    parameter's state under another ([Note: freed tensors keep their dimensions]).
    embeds_outside: inputs_embeds made outside from the model's own embedding (FreeLB) left
    each rank's copy with its own gradient (7.6e-3 off after 3 steps); the step averages it
    over the ranks, as DDP ([Note: gradients made outside] in optimizer_share.py)."""
    res = mpirun("loop_probes.py", 2, probe, timeout=300, env={"RANNC_COMM_TIMEOUT": "60"})
    assert res.returncode == 0, res.stdout[-4000:]
    for r in range(2):
        assert f"OK rank {r}" in res.stdout, res.stdout[-4000:]
    if probe == "lazy_cache":
        said = "the forward sets table of pos, cached of pos, aux of the model to a tensor"
        assert res.stdout.count(said) == 1, res.stdout[-3000:]


def test_one_optimizer_over_two_modules_is_named():
    """One optimizer over two RaNNCModules trains right, but its state_dict() holds part of
    its state (docs/checkpoints.md): rank 0 says so, once."""
    res = _single_process("""
import torch, rannc
enc, dec = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
opt = torch.optim.AdamW(list(enc.parameters()) + list(dec.parameters()))
a, b = rannc.RaNNCModule(enc, opt), rannc.RaNNCModule(dec, opt)
b(a(torch.randn(4, 4))).sum().backward()
opt.step()
""")
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stderr.count("AdamW steps the parameters of two RaNNCModules") == 1, res.stderr[-3000:]


def test_a_scripted_module_is_named_at_wrapping():
    """A submodule or model compiled by torch.jit.script failed inside RaNNCModule with
    torch's "register_forward_pre_hook is not supported on ScriptModules" (rannc's own
    hooks), or later with "not part of the active trace"; the error names the outermost
    scripted module and the cure."""
    res = _single_process("""
import torch, rannc
class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.gate = torch.jit.script(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sigmoid()))
    def forward(self, x):
        return self.gate(self.a(x)).sum()
for model in (Model(), torch.jit.script(torch.nn.Linear(4, 4))):
    try:
        rannc.RaNNCModule(model)
    except rannc.TraceError as e:
        print("refused:", e)
""")
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert "refused: submodule 'gate' is compiled by torch.jit.script" in res.stdout, res.stdout
    assert "refused: the model is compiled by torch.jit.script" in res.stdout, res.stdout
    assert "Pass the module before torch.jit.script" in res.stdout, res.stdout
