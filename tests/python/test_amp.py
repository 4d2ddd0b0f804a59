"""Mixed precision ([Note: mixed precision] in python/rannc/_trace.py, rannc.GradScaler in
python/rannc/amp.py) on CPU ranks, which run torch.autocast too: the traced program
computes in the precision of the call it was traced in, the planner sees 2-byte
activations, bf16 and fp16 training equal PyTorch under the same autocast, and an overflow
on one stage skips the step on every rank."""
import pytest
import torch

import rannc
import zoo
from mpirun import mpirun


def test_tracing_under_autocast_records_its_casts():
    """The first call under autocast used to fail in the tracer (autocast's weight cache);
    now the casts are ops of the graph, which then computes in bf16 without autocast."""
    model, args, _ = zoo.make("gpt", batch=4)
    zoo.no_dropout(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        g = rannc.trace(model, args)
        expected = model(*args)
    dtypes = {v.dtype for v in g.ir.values()}
    assert "BFloat16" in dtypes and "Float32" in dtypes  # fp32 parameters, bf16 matmuls
    got = g(*args)  # no autocast now: the recorded casts do it
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    fp32 = rannc.trace(model, args)
    assert "BFloat16" not in {v.dtype for v in fp32.ir.values()}


class MaskFromBf16(torch.nn.Module):
    """A mask computed from a bf16 value (transformers 4's GPT-2 under bf16 has one)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)

    def forward(self, x):
        h = self.a(x)
        return self.b(h.masked_fill(h <= 0, 0)).float().sum(1)


def test_a_mask_made_from_a_bf16_value_traces_under_autocast():
    """[Note: rows in low precision] in csrc/frontend/convert.cpp: the observations of a
    bool value computed from bf16 values are compared exactly (before: "abs_cpu not
    implemented for 'Bool'" in the trace's row analysis)."""
    model, x = MaskFromBf16(), torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        g = rannc.trace(model, (x,))
        expected = model(x)
    torch.testing.assert_close(g(x), expected, rtol=0, atol=0)
    assert "Bool" in {v.dtype for v in g.ir.values()}


def test_the_planner_sees_two_byte_activations():
    model, args, _ = zoo.make("gpt", batch=8)
    opts = dict(world_size=2, device_memory="1GiB", num_stages=2, cost_model="analytic")
    fp32 = rannc.plan(model, args, **opts).deployment
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = rannc.plan(model, args, **opts).deployment
    # the activations the stages keep for backward are mostly bf16: clearly less memory
    assert sum(s.memory_bytes for s in bf16.stages) < 0.9 * sum(s.memory_bytes for s in fp32.stages)


@pytest.mark.parametrize("ranks,model,stages,micro,extra", [
    (2, "gpt", 2, 2, ["--amp", "bf16", "--eval"]),
    (3, "transformer_loss", 2, 3, ["--amp", "bf16", "--opt", "replicas=1,2"]),
    (2, "gpt", 1, 2, ["--amp", "bf16", "--opt", "replicas=2", "recompute=always"]),
    (2, "transformer", 2, 2, ["--amp", "bf16", "--mode", "outside"]),           # fill-drain
    (2, "mlp", 2, 2, ["--amp", "fp16"]),
    (2, "mlp", 2, 2, ["--amp", "fp16", "--inject-inf", "1"]),   # overflow on the last stage
    (2, "mlp_tiny_loss", 2, 2, ["--amp", "fp16"]),   # activation gradients need the scale
    (3, "gpt", 3, 3, ["--amp", "fp16", "--inject-inf", "2"]),
    (2, "mlp", 2, 2, ["--amp", "bf16", "--opt", "precision=bf16"]),  # the option, no autocast
    (2, "hf_bert", 1, 2, ["--amp", "bf16", "--opt", "replicas=2"]),  # failed to trace before
    (2, "gpt", 2, 2, ["--amp", "fp16", "--clip", "0.5"]),        # clipping unscales first
    # torch.amp.GradScaler and torch's clip_grad_norm_, as training loops write them
    # ([Note: agreed steps], [Note: torch's clip_grad_norm_])
    (3, "gpt", 3, 3, ["--amp", "fp16", "--inject-inf", "2", "--scaler", "torch"]),
    (2, "mlp_tiny_loss", 2, 2, ["--amp", "fp16", "--scaler", "torch"]),
    (2, "gpt", 2, 2, ["--amp", "fp16", "--clip", "0.5", "--clip-by", "torch", "--scaler", "torch"]),
])
def test_mixed_precision_training_equals_pytorch_under_autocast(ranks, model, stages, micro, extra):
    """The reference runs under the same torch.autocast (with the option precision, only
    the reference does); fp16 with loss scaling, rannc.GradScaler against torch's."""
    res = mpirun("train_check.py", ranks, model, "--stages", stages, "--micro", micro,
                 "--steps", 4, *extra, timeout=300, env={"RANNC_COMM_TIMEOUT": "60"})
    assert res.returncode == 0, res.stdout[-4000:]
    for r in range(ranks):
        assert f"OK rank {r}" in res.stdout, res.stdout[-4000:]
    if "--inject-inf" in extra:
        # every rank, also those without the inf (ranks' lines may interleave: count)
        assert res.stdout.count("skipped step") == ranks, res.stdout[-3000:]


@pytest.mark.parametrize("variant,ranks,stages,micro,extra", [
    ("matmul", 1, 1, 1, []),
    ("matmul", 2, 2, 2, ["recompute=always"]),
    ("matmul", 3, 2, 2, ["cost_model=analytic"]),
    ("cast_inputs", 2, 2, 2, ["cost_model=analytic"]),
    ("island", 2, 2, 2, ["cost_model=analytic"]),
    ("island", 3, 3, 2, ["recompute=always"]),
])
def test_autograd_functions_and_fp32_islands_run_in_the_precision_of_plain_pytorch(
        variant, ranks, stages, micro, extra):
    """A torch.amp.custom_fwd Function whose matmul mixes a bf16 activation with an fp32
    weight trains under bf16 autocast equal to PyTorch: its ops, which the trace does not
    see, run under the program's autocast, in forward and in a recompute ([Note: autocast
    in Python ops] in csrc/bind/module.cpp; "expected m1 and m2 to have the same dtype").
    A Function that casts its inputs to fp32 and a block under autocast(enabled=False)
    return fp32 values, which cross stage boundaries as such (recorded as bf16, they
    failed with MPI_ERR_TRUNCATE)."""
    res = mpirun("amp_function_check.py", ranks, variant, stages, micro, *extra, timeout=300,
                 env={"RANNC_COMM_TIMEOUT": "60"})
    assert res.returncode == 0, res.stdout[-4000:]
    for r in range(ranks):
        assert f"OK rank {r}" in res.stdout, res.stdout[-4000:]


@pytest.mark.parametrize("probe", ["mixed_dtypes", "two_scalers"])
def test_loops_with_several_precisions_equal_pytorch(probe):
    """mixed_dtypes: a model cast in part to bf16 by the user, on a replicated stage: each
    gradient comes back in its parameter's dtype and AdamW steps as in PyTorch ([Note:
    buckets of one dtype] in runtime/grad_buckets.cpp; the bf16 gradients came back fp32
    and AdamW failed). two_scalers: a second GradScaler made for an auxiliary model: the
    module's backward is seeded by the scaler of its optimizer, and the scale follows
    PyTorch's ([Note: scaled seeds]; the newest scaler's overflowed every later step)."""
    res = mpirun("loop_probes.py", 2, probe, timeout=300, env={"RANNC_COMM_TIMEOUT": "60"})
    assert res.returncode == 0, res.stdout[-4000:]
    for r in range(2):
        assert f"OK rank {r}" in res.stdout, res.stdout[-4000:]
