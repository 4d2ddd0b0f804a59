"""Profiler vs runtime, back to back: one piece measured by the profiler (rannc._C.
profile_piece, 1 warm-up + 3 runs, and 3 + 9) and by the runtime's StageExecutor alone
(median of 5 after a warm-up), for the 4 pieces of a 4-layer BERT-base-width encoder at
1 row x 64 tokens, twice each. Separates the profiler's own accuracy from drift of a
shared machine between planning and checking (bench/profile_bench.py).

    python bench/profile_vs_stage.py > bench/results/profile_vs_stage.txt
"""
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
sys.path.insert(0, HERE)
import torch  # noqa: E402
import rannc  # noqa: E402
from rannc import _C
from profile_bench import Bert
torch.set_num_threads(1); torch.manual_seed(0)
m = Bert(layers=4)
ids = torch.randint(0, 30522, (1, 64)); lab = torch.randint(0, 30522, (1, 64))
g = rannc.trace(m, (ids, lab))
ir, traced = g.ir, g._trace.traced
flat = g._flat_inputs((ids, lab), {})
pieces = ir.split(4)
values = dict(zip(ir.inputs, flat))
state = {v: t for v, t in values.items() if ir.value(v)["role"] in ("param", "buffer")}
avail = {v: t for v, t in values.items() if v not in state}
stages = [_C.StageExecutor(traced, p, {v: state[v] for v in p.inputs if v in state}) for p in pieces]
inputs = []
with torch.no_grad():
    for s in stages:
        ins = [avail[v] for v in s.input_ids]; inputs.append(ins)
        avail.update(zip(s.output_ids, s.forward(0, ins, False, False)))
for i, (p, s) in enumerate(zip(pieces, stages)):
    for trial in range(2):
        r = _C.profile_piece(traced, flat, p, 1, warmup=1, repetitions=3)
        r7 = _C.profile_piece(traced, flat, p, 1, warmup=3, repetitions=9)
        f, b = [], []
        for rep in range(6):
            t0 = time.perf_counter(); outs = s.forward(0, inputs[i], True, False); f.append(time.perf_counter()-t0)
            gr = [torch.ones_like(o) if isinstance(o, torch.Tensor) and o.is_floating_point() else None for o in outs]
            t0 = time.perf_counter(); s.backward(0, gr); b.append(time.perf_counter()-t0)
            for t in state.values(): t.grad = None
        print(i, "prof3 %.1f/%.1f prof9 %.1f/%.1f exec %.1f/%.1f ms" % (r["forward_time"]*1e3, r["backward_time"]*1e3, r7["forward_time"]*1e3, r7["backward_time"]*1e3, statistics.median(f[1:])*1e3, statistics.median(b[1:])*1e3), flush=True)
