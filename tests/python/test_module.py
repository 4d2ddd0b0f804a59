"""RaNNCModule under real mpirun on CPU ranks equals single-process PyTorch on the
concatenated global batch: the loss at every step, every gradient, every parameter after
Adam steps, batch-shaped outputs, eval()/no_grad; over 1..4 ranks and several layouts."""
import time

import pytest
import torch

import rannc
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
]


@pytest.mark.parametrize("ranks,model,stages,micro,extra", LAYOUTS,
                         ids=[f"{r}ranks-{m}-{s}st-{mb}mb" for r, m, s, mb, _ in LAYOUTS])
def test_training_equals_pytorch(ranks, model, stages, micro, extra):
    res = mpirun("train_check.py", ranks, model, "--stages", stages, "--micro", micro, *extra,
                 timeout=300, env={"RANNC_COMM_TIMEOUT": "60"})
    assert res.returncode == 0, res.stdout[-4000:]
    for r in range(ranks):
        assert f"OK rank {r}" in res.stdout, res.stdout[-4000:]


@pytest.mark.parametrize("mode,ranks,model,stages,micro", [
    ("accum", 4, "gpt", 2, 2),      # gradient accumulation over 2 calls
    ("scale2", 2, "mlp", 2, 2),     # (2 * loss).backward()
])
def test_backward_semantics(mode, ranks, model, stages, micro):
    res = mpirun("train_check.py", ranks, model, "--stages", stages, "--micro", micro,
                 "--steps", 3, "--mode", mode, timeout=300, env={"RANNC_COMM_TIMEOUT": "60"})
    assert res.returncode == 0, res.stdout[-4000:]
    assert "OK rank 0" in res.stdout


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
