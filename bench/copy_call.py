"""What a copy of a wrapped model costs per call: an EMA's eval call (AveragedModel of a
RaNNCModule, [Note: copies of a wrapped model]) against the module's own eval call, and
AveragedModel.update_parameters against the same on the plain model. One rank, the
host-overhead GPT of bench/host_overhead.py (kernels nearly free: what rannc adds per call
shows), or a larger one with --hidden.

    python bench/copy_call.py [--calls 300] [--hidden 16] [--device cpu|cuda]

Calls alternate between the two sides (the machine is shared and noisy: read the ratios).
Writes bench/results/copy_call.json and a table to stdout.
"""
import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [os.path.join(ROOT, "python"), os.path.join(ROOT, "examples")]
import rannc  # noqa: E402
from models import GPT, TransformerConfig  # noqa: E402


def median_ms(pairs, calls, sync):
    """Median milliseconds of each function in `pairs`, called alternately."""
    times = [[] for _ in pairs]
    for _ in range(calls):
        for k, fn in enumerate(pairs):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[k].append(time.perf_counter() - t0)
    return [statistics.median(t) * 1e3 for t in times]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--hidden", type=int, default=16)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    device = torch.device(a.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    cfg = TransformerConfig(vocab=64, hidden=a.hidden, heads=2, layers=12, max_len=8, dropout=0.0)
    model = GPT(cfg).to(device)
    plain = copy.deepcopy(model)
    ids = torch.randint(0, 64, (2, 8), device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    wrapped = rannc.RaNNCModule(model, opt)
    ema = AveragedModel(wrapped, multi_avg_fn=get_ema_multi_avg_fn(0.999))
    plain_ema = AveragedModel(plain, multi_avg_fn=get_ema_multi_avg_fn(0.999))
    wrapped(ids, ids).backward()
    opt.step()
    for m in (wrapped, ema, plain, plain_ema):
        m.eval()
    with torch.no_grad():
        for _ in range(10):
            wrapped(ids, ids), ema(ids, ids)
        module_ms, copy_ms = median_ms([lambda: wrapped(ids, ids), lambda: ema(ids, ids)],
                                       a.calls, sync)
        ours_ms, plain_ms = median_ms([lambda: ema.update_parameters(wrapped),
                                       lambda: plain_ema.update_parameters(plain)], a.calls, sync)
    result = {"device": a.device, "hidden": a.hidden, "calls": a.calls,
              "module_eval_ms": module_ms, "copy_eval_ms": copy_ms,
              "copy_over_module": copy_ms / module_ms,
              "update_ms": ours_ms, "plain_update_ms": plain_ms,
              "update_over_plain": ours_ms / plain_ms}
    print("| what | ms | ratio |\n|---|---|---|")
    print(f"| RaNNCModule eval call | {module_ms:.3f} | |")
    print(f"| its AveragedModel's eval call | {copy_ms:.3f} | {copy_ms / module_ms:.3f} |")
    print(f"| update_parameters, plain model | {plain_ms:.3f} | |")
    print(f"| update_parameters, RaNNCModule | {ours_ms:.3f} | {ours_ms / plain_ms:.3f} |")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "copy_call.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {os.path.join(a.out, 'copy_call.json')}")


if __name__ == "__main__":
    main()
