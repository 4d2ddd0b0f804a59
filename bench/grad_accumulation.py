"""Gradient accumulation with and without no_sync() ([Note: unsynced steps] in
csrc/runtime/engine.h): a GPT trained data-parallel (one stage, a replica per rank), each
optimizer step accumulating the gradients of several calls. Synced, every call sums its
gradients over the replicas; with the first calls under `model.no_sync()`, as
DistributedDataParallel users write it, only the last call of the window does (it also sums
what the others left in .grad: two sums per window instead of one per call).

    mpirun -np 4 python bench/grad_accumulation.py [--layers 8] [--hidden 512] [--calls 4]

Windows of both kinds alternate in one run; per kind the median window time. Writes
bench/results/grad_accumulation.{json,md} (rank 0).
"""
import argparse
import contextlib
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


def window(model, opt, batches, unsynced):
    t0 = time.perf_counter()
    for i, (ids, targets) in enumerate(batches):
        hold = unsynced and i < len(batches) - 1
        with model.no_sync() if hold else contextlib.nullcontext():
            loss = model(ids, targets)
        (loss / len(batches)).backward()
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--batch", type=int, default=2, help="local rows per call")
    ap.add_argument("--length", type=int, default=32)
    ap.add_argument("--calls", type=int, default=4, help="calls per optimizer step")
    ap.add_argument("--windows", type=int, default=6, help="windows of each kind")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    a = ap.parse_args()
    torch.set_num_threads(1)
    rank, world = rannc.get_rank(), rannc.get_world_size()
    cfg = TransformerConfig(vocab=1000, hidden=a.hidden, heads=max(1, a.hidden // 64),
                            layers=a.layers, max_len=a.length, dropout=0.0)
    torch.manual_seed(0)
    model = GPT(cfg)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    wrapped = rannc.RaNNCModule(model, opt, num_stages=1)
    g = torch.Generator().manual_seed(rank)

    def batches():
        return [(torch.randint(0, cfg.vocab, (a.batch, a.length), generator=g),) * 2
                for _ in range(a.calls)]

    window(wrapped, opt, batches(), False)  # deploy, warm up
    times = {"synced": [], "no_sync": []}
    for _ in range(a.windows):
        for kind in times:
            times[kind].append(window(wrapped, opt, batches(), kind == "no_sync"))
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    if rank != 0:
        return
    result = {"model": f"GPT {a.layers} layers, hidden {a.hidden} ({params / 1e6:.1f} M parameters)",
              "ranks": world, "replicas": world, "local_batch": a.batch, "length": a.length,
              "calls_per_step": a.calls, "windows": a.windows, "torch": torch.__version__,
              "synced_window_ms": med["synced"], "no_sync_window_ms": med["no_sync"],
              "ratio": med["no_sync"] / med["synced"]}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "grad_accumulation.json"), "w") as f:
        json.dump(result, f, indent=2)
    lines = [f"# Gradient accumulation over {a.calls} calls: {result['model']}, "
             f"{world} replicas, {a.batch} x {a.length} tokens per rank and call", "",
             f"`mpirun -np {world} python bench/grad_accumulation.py " + " ".join(sys.argv[1:]) + "`", "",
             "| every call summed, ms per step | no_sync() but the last call, ms per step | ratio |",
             "|---|---|---|",
             f"| {med['synced']:.1f} | {med['no_sync']:.1f} | {result['ratio']:.3f} |"]
    with open(os.path.join(a.out, "grad_accumulation.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
