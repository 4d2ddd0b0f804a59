"""Frontend benchmark: tracing time, and the interpreter's step time against eager PyTorch.

    python bench/frontend.py [--repeats 20]

For GPT-style models of growing size it traces the model (two traces + two observation
runs), then times forward+backward of the model and of the traced IR alternately in the
same process (the machine is shared and noisy: the ratio of medians is what to read).
Writes bench/results/frontend.json.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import rannc  # noqa: E402
from models import GPT, TransformerConfig  # noqa: E402

CASES = [
    dict(layers=2, hidden=64, heads=4, seq=32, batch=8),
    dict(layers=6, hidden=128, heads=4, seq=64, batch=8),
    dict(layers=12, hidden=256, heads=8, seq=64, batch=8),
]


def step_time(fn, args, params, repeats):
    times = []
    for _ in range(repeats):
        for p in params:
            p.grad = None
        start = time.perf_counter()
        fn(*args).backward()
        times.append(time.perf_counter() - start)
    return times


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                  "frontend.json"))
    a = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    print(f"{'layers':>6} {'hidden':>6} {'tasks':>6} {'trace s':>8} {'eager ms':>9} "
          f"{'ir ms':>8} {'ir/eager':>8}")
    for case in CASES:
        torch.manual_seed(0)
        cfg = TransformerConfig(vocab=1000, hidden=case["hidden"], heads=case["heads"],
                        layers=case["layers"], max_len=case["seq"], dropout=0.0)
        model = GPT(cfg)
        args = (torch.randint(0, 1000, (case["batch"], case["seq"])),
                torch.randint(0, 1000, (case["batch"], case["seq"])))
        start = time.perf_counter()
        g = rannc.trace(model, args)
        trace_s = time.perf_counter() - start
        params = list(model.parameters())
        step_time(model, args, params, 3)  # warm-up
        step_time(g, args, params, 3)
        eager, ir = [], []
        for _ in range(a.repeats):  # alternate so both see the same machine load
            eager += step_time(model, args, params, 1)
            ir += step_time(g, args, params, 1)
        e, i = statistics.median(eager), statistics.median(ir)
        row = dict(case, tasks=g.ir.num_tasks, trace_seconds=trace_s, eager_step_s=e,
                   ir_step_s=i, ratio=i / e)
        rows.append(row)
        print(f"{case['layers']:>6} {case['hidden']:>6} {g.ir.num_tasks:>6} {trace_s:>8.2f} "
              f"{e * 1e3:>9.2f} {i * 1e3:>8.2f} {i / e:>8.3f}")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(rows, f, indent=2)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
