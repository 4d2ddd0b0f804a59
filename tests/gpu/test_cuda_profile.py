"""The device profiler on a CUDA device: CUDA-event times that repeat, caching-allocator
peaks that grow with the micro-batch, and an allocation the device cannot hold reported
as an infeasible piece (not a crash, and nothing left allocated). Also: a model traced on
the CPU is profiled on the GPU ([Note: traced devices] in csrc/profile/profiler.h), and
CPU and GPU profiles do not share cache entries."""
import math

import pytest
import torch
import torch.nn as nn

import rannc
from rannc import _C, planning
import zoo

DEVICE = "cuda:0"


def _traced(name="transformer", batch=8):
    model, args, kwargs = zoo.make(name, batch=batch)
    g = rannc.trace(model, args, kwargs)
    return g, g._flat_inputs(args, kwargs)


def _whole(g):
    return g.ir.split(1)[0]


def test_default_profile_device_is_cuda():
    assert planning.profile_device().startswith("cuda:")
    assert _C.profile_device_kind("cuda") == "cuda:" + torch.cuda.get_device_name()


def test_times_are_positive_and_repeat_within_noise():
    g, flat = _traced()
    piece = _whole(g)
    runs = [_C.profile_piece(g._trace.traced, flat, piece, 512, warmup=3, repetitions=9,
                             device=DEVICE) for _ in range(2)]
    a, b = runs
    for key in ("forward_time", "backward_time"):
        assert a[key] > 0 and b[key] > 0, (key, a, b)
        # Medians of CUDA events on a dedicated device: within 30%.
        assert max(a[key], b[key]) / min(a[key], b[key]) < 1.3, (key, a, b)
    # The caching allocator's counts of the same runs: equal up to its block rounding.
    assert a["activation_bytes"] > 0 and a["peak_bytes"] > 0
    assert b["activation_bytes"] == pytest.approx(a["activation_bytes"], rel=0.01)
    assert b["peak_bytes"] == pytest.approx(a["peak_bytes"], rel=0.01)


def test_peak_memory_grows_with_rows():
    g, flat = _traced()
    piece = _whole(g)
    peaks = [_C.profile_piece(g._trace.traced, flat, piece, rows, warmup=1, repetitions=1,
                              device=DEVICE)["peak_bytes"] for rows in (8, 64, 512)]
    assert peaks[0] < peaks[1] < peaks[2], peaks
    assert peaks[2] > 8 * peaks[0], peaks  # activations are linear in the rows (64x here)


class Outer(nn.Module):
    """rows x 4096 x 4096 floats in the middle (64 MiB a row) from a small input."""

    def __init__(self, d=4096):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        h = self.fc(x)
        return (h.unsqueeze(2) * h.unsqueeze(1)).sum()


def test_an_allocation_the_device_cannot_hold_marks_the_piece_infeasible():
    model = Outer()
    x = torch.randn(2, 4096)
    g = rannc.trace(model, (x,))
    flat = g._flat_inputs((x,), {})
    piece = _whole(g)
    total = torch.cuda.get_device_properties(0).total_memory
    rows = int(2 * total // (4096 * 4096 * 4)) + 1  # twice the device's memory
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(0)
    r = _C.profile_piece(g._trace.traced, flat, piece, rows, warmup=0, repetitions=1, device=DEVICE)
    assert r["out_of_memory"] and math.isinf(r["forward_time"]), r
    assert torch.cuda.memory_allocated(0) == before  # the failed run left nothing behind
    ok = _C.profile_piece(g._trace.traced, flat, piece, 2, warmup=0, repetitions=1, device=DEVICE)
    assert not ok["out_of_memory"] and math.isfinite(ok["forward_time"]), ok
    # Past the planned device's memory (smaller than this GPU): infeasible too.
    small = _C.profile_piece(g._trace.traced, flat, piece, 4, warmup=0, repetitions=1,
                             device=DEVICE, memory_limit=64 << 20)
    assert small["out_of_memory"], small


class Positions(nn.Module):
    """torch.arange(..., device=x.device): the trace keeps the device as a constant."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(100, 32)
        self.pos = nn.Embedding(64, 32)
        self.fc = nn.Linear(32, 32)

    def forward(self, ids):
        pos = torch.arange(ids.size(1), device=ids.device)
        return self.fc(self.tok(ids) + self.pos(pos)).pow(2).mean()


@pytest.mark.parametrize("traced_on", ["cpu", "cuda"])
def test_a_model_traced_on_either_device_is_profiled_on_the_gpu(traced_on):
    model = Positions().to(traced_on)
    ids = torch.randint(0, 100, (4, 16), device=traced_on)
    g = rannc.trace(model, (ids,))
    flat = g._flat_inputs((ids,), {})
    for piece in g.ir.split(3):
        r = _C.profile_piece(g._trace.traced, flat, piece, 8, warmup=1, repetitions=2, device=DEVICE)
        assert not r["out_of_memory"] and r["forward_time"] > 0, r
    plan = rannc.plan(model, (ids,), world_size=2, device_memory="1GiB",
                      profile_cache=rannc.ProfileCache(), profile_device=DEVICE)
    plan.validate()


def test_cpu_and_gpu_profiles_are_cached_apart():
    model, args, kwargs = zoo.make("mlp", batch=4)
    cache = rannc.ProfileCache()
    opts = dict(world_size=2, device_memory="1GiB", profile_cache=cache, profile_warmup=0,
                profile_repetitions=1, profile_fake_timer=True)
    rannc.plan(model, args, kwargs, profile_device="cpu", **opts)
    cpu_entries = len(cache)
    # Deterministic times (profile_fake_timer): both plans ask for the same pieces, which
    # the GPU must measure again (another device kind), not read from the CPU's entries.
    rannc.plan(model, args, kwargs, profile_device=DEVICE, **opts)
    assert len(cache) == 2 * cpu_entries
    assert _C.profile_device_kind(DEVICE) != _C.profile_device_kind("cpu")
