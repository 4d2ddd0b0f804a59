"""Host overhead per step: RaNNCModule (one rank, one stage, one micro-batch) against plain
PyTorch on a model whose kernels are nearly free (a GPT with hidden size 16 and 12 layers,
batch 2 x 8 tokens), so that what rannc adds per operation and per step dominates. On the
CPU this is the proxy every session can measure (goal: ratio <= 1.05); with --device cuda
it shows what a GPU step pays on the host.

    python bench/host_overhead.py [--steps 300] [--device cpu|cuda]

Steps alternate between the two (the machine is shared and noisy: read the ratio). The
rannc step is also split into its phases (forward, i.e. the 1F1B step; loss.backward();
optimizer step). Writes bench/results/host_overhead.json with `ratio` (rannc step / eager
step, medians) at the top level.
"""
import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [os.path.join(ROOT, "python"), os.path.join(ROOT, "examples")]
import rannc  # noqa: E402
from models import GPT, TransformerConfig  # noqa: E402

CFG = dict(vocab=64, hidden=16, heads=2, layers=12, max_len=8, dropout=0.0)
ROWS = 2


def timed_step(fn, opt, batch, sync, phases=None):
    sync()
    t0 = time.perf_counter()
    loss = fn(*batch)
    sync()
    t1 = time.perf_counter()
    loss.backward()
    sync()
    t2 = time.perf_counter()
    opt.step()
    opt.zero_grad()
    sync()
    t3 = time.perf_counter()
    if phases is not None:
        phases["forward"].append(t1 - t0)
        phases["backward"].append(t2 - t1)
        phases["optimizer"].append(t3 - t2)
    return t3 - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    a = ap.parse_args()
    torch.set_num_threads(1)
    device = torch.device(a.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    plain = GPT(TransformerConfig(**CFG)).to(device)
    model = copy.deepcopy(plain)
    plain_opt = torch.optim.Adam(plain.parameters(), lr=1e-3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    wrapped = rannc.RaNNCModule(model, opt, num_stages=1, num_microbatches=1,
                                cost_model="analytic", device=a.device)
    g = torch.Generator().manual_seed(0)
    batch = tuple(torch.randint(0, CFG["vocab"], (ROWS, CFG["max_len"]), generator=g).to(device)
                  for _ in range(2))
    times = {"eager": [], "rannc": []}
    phases = {"eager": {k: [] for k in ("forward", "backward", "optimizer")},
              "rannc": {k: [] for k in ("forward", "backward", "optimizer")}}
    for i in range(a.warmup + a.steps):
        for name, fn, o in (("eager", plain, plain_opt), ("rannc", wrapped, opt)):
            t = timed_step(fn, o, batch, sync, phases[name] if i >= a.warmup else None)
            if i >= a.warmup:
                times[name].append(t)
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "ratio": med["rannc"] / med["eager"],
        "device": a.device if a.device == "cpu" else torch.cuda.get_device_name(),
        "model": f"GPT hidden {CFG['hidden']}, {CFG['layers']} layers, batch {ROWS} x {CFG['max_len']}",
        "steps": a.steps,
        "eager_step_ms": med["eager"] * 1e3,
        "rannc_step_ms": med["rannc"] * 1e3,
        "phases_ms": {k: {p: statistics.median(v) * 1e3 for p, v in ph.items()}
                      for k, ph in phases.items()},
        "torch": torch.__version__,
    }
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "host_overhead.json" if a.device == "cpu" else "host_overhead_cuda.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"eager {result['eager_step_ms']:.3f} ms, rannc {result['rannc_step_ms']:.3f} ms, "
          f"ratio {result['ratio']:.3f} ({a.device})")
    for k, ph in result["phases_ms"].items():
        print(f"  {k:6s} " + "  ".join(f"{p} {v:.3f} ms" for p, v in ph.items()))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
