"""RaNNCModule with its stages on the GPU ([Note: placement] in python/rannc/module.py):
training equals plain PyTorch (on the CPU, float32 without TF32) step by step, one rank
with the NCCL data plane's collectives, two ranks sharing the one GPU over MPI through host
memory (NCCL refuses two ranks on one device); recomputation restores the CUDA generator
so dropout masks repeat; the NCCL communicator's collectives on one rank."""
import copy

import pytest
import torch

import rannc
from rannc import _C
from mpirun import mpirun
from test_runtime_stage import run_pipeline
import zoo


def _ok(res, ranks):
    assert res.returncode == 0, res.stdout
    for r in range(ranks):
        assert f"OK rank {r}" in res.stdout, res.stdout


@pytest.mark.parametrize("model", zoo.NAMES)
def test_one_rank_on_cuda_equals_pytorch(model):
    res = mpirun("train_check.py", 1, model, "--stages", 1, "--micro", 2, "--eval",
                 "--opt", "device=cuda", timeout=300)
    _ok(res, 1)


@pytest.mark.parametrize("model,stages", [("gpt", 2), ("mlp", 2), ("transformer", 2)])
def test_two_ranks_share_the_gpu_over_mpi(model, stages):
    res = mpirun("train_check.py", 2, model, "--stages", stages, "--micro", 2, "--eval",
                 "--opt", "device=cuda", "data_plane=mpi", timeout=300)
    _ok(res, 2)


def test_two_replicas_share_the_gpu_with_outside_gradients():
    res = mpirun("train_check.py", 2, "multi_io", "--stages", 1, "--micro", 2,
                 "--mode", "outside", "--opt", "device=cuda", "data_plane=mpi", timeout=300)
    _ok(res, 2)


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_recompute_restores_the_cuda_generator(name):
    model, args, kwargs = zoo.make(name, batch=6)  # dropout active
    model = model.cuda()
    args = tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)
    g = rannc.trace(model, args, kwargs)
    results = []
    for recompute in (False, True):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(11)
        loss = run_pipeline(g, model, 3, 3, args, kwargs, recompute=recompute, device="cuda:0")
        results.append((loss, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (l0, g0), (l1, g1) = results
    torch.testing.assert_close(l0, l1, rtol=0, atol=0)
    for n in g0:
        torch.testing.assert_close(g0[n], g1[n], rtol=0, atol=0, msg=n)


def test_stages_traced_on_the_cpu_run_on_the_gpu():
    """Constants the trace baked on the CPU (devices, captured tensors) move with the stage."""
    model, args, kwargs = zoo.make("gpt", batch=4)
    zoo.no_dropout(model)
    reference = copy.deepcopy(model)
    g = rannc.trace(model, args, kwargs)  # on the CPU
    model = model.cuda()
    args = tuple(a.cuda() for a in args)
    loss = run_pipeline(g, model, 2, 2, args, kwargs, device="cuda:0")
    assert loss.device.type == "cuda"
    ref = reference(*[a.cpu() for a in args])
    torch.testing.assert_close(loss.cpu(), ref.detach(), rtol=1e-4, atol=1e-5)


def test_nccl_collectives_on_one_rank():
    assert _C.has_nccl, "rannc was built without NCCL"
    comm = _C.Communicator.world_cuda()
    assert comm.size == 1 and comm.rank == 0
    t = torch.arange(4.0, device="cuda")
    comm.all_reduce(t).wait()
    assert torch.equal(t.cpu(), torch.arange(4.0))
    b = torch.full((3,), 2.0, device="cuda")
    comm.broadcast(b, 0).wait()
    out = torch.empty(1, 3, device="cuda")
    comm.all_gather(b, out).wait()
    assert torch.equal(out.cpu(), torch.full((1, 3), 2.0))
    sub = comm.subgroup([0])
    s = torch.ones(2, device="cuda")
    sub.all_reduce(s).wait()
    assert torch.equal(s.cpu(), torch.ones(2))
    with pytest.raises(_C.CommError, match="moves CUDA tensors"):
        comm.all_reduce(torch.ones(2))
