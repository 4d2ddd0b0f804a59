"""The same BERT piece (3 encoder layers, 1 row x 64 tokens) measured by the profiler in a
fresh process, then again after profiling other pieces of the model (a planning-like
history), with the minor page faults of each call. Repro of the phase effect in
docs/profile.md (Measured).

    OMP_NUM_THREADS=1 python bench/profile_history.py
"""
import sys, os, time, resource
HERE = os.path.dirname(os.path.abspath(__file__))
for d in ("../python", ".", "../examples"):
    sys.path.insert(0, os.path.join(HERE, d))
import torch; torch.set_num_threads(1)
import rannc
from rannc import _C
from profile_bench import build
model, args, vocab = build("bert", 64, 1)
g = rannc.trace(model, args)
flat = g._flat_inputs(args, {})
pieces = g.ir.split(4)
p = pieces[1]
def m(tag):
    vals = []
    for _ in range(3):
        f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        r = _C.profile_piece(g._trace.traced, flat, p, 1, warmup=1, repetitions=3)
        f1 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        vals.append(((r["forward_time"] + r["backward_time"]) * 1e3, f1 - f0))
    print(tag, " ".join(f"{v:.1f}ms/{f}flt" for v, f in vals), flush=True)
m("fresh")
for q in g.ir.split(16):
    for rows in (1, 2, 4):
        _C.profile_piece(g._trace.traced, flat, q, rows, warmup=0, repetitions=1)
m("after history")
