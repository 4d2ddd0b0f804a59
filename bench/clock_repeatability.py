"""The investigation behind [Note: CPU clock] (csrc/profile/device_meter.h): BERT-base, a
4-stage plan at 1 row x 64 tokens; each stage run alone by StageExecutor, timed with the
wall clock and with the thread's CPU time, over TRIALS interleaved trials (CLOCKS=1), or
profiler against StageExecutor back to back with the process's CPU share (default).

    OMP_NUM_THREADS=1 CLOCKS=1 TRIALS=4 python bench/clock_repeatability.py bert
Output of the runs on the shared 2-vCPU build machine: bench/results/clock_repeatability.txt
"""
import os, sys, time, statistics, json
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT + "/python"); sys.path.insert(0, ROOT + "/bench"); sys.path.insert(0, ROOT + "/examples")
import torch, rannc
from rannc import _C
from profile_bench import build
torch.set_num_threads(1)
name = sys.argv[1] if len(sys.argv) > 1 else "bert"
model, args, vocab = build(name, 64, 1)
opts = dict(world_size=8, devices_per_node=4, device_memory="16GiB", num_blocks=8,
            profile_warmup=1, profile_repetitions=3, progress=False, num_stages=4, probe_bandwidth=False)
cache = f"/tmp/rannc_{name}_profiles.bin"
t0 = time.time()
plan = rannc.plan(model, args, profile_cache=cache, **opts)
print("planned", time.time() - t0, flush=True)
d = plan.deployment
tg = plan.graph
ir, traced = tg.ir, tg._trace.traced
g = torch.Generator().manual_seed(2)
rows = 1
a2 = (torch.randint(0, vocab, (rows, 64), generator=g), torch.randint(0, vocab, (rows, 64), generator=g))
flat = tg._flat_inputs(a2, {})
values = dict(zip(ir.inputs, flat))
state = {v: t for v, t in values.items() if ir.value(v).role in ("param", "buffer")}
pieces = plan.stage_pieces()
stages = [_C.StageExecutor(traced, p, {v: state[v] for v in p.inputs if v in state}) for p in pieces]
inputs = []
avail = {v: t for v, t in values.items() if v not in state}
with torch.no_grad():
    for s in stages:
        ins = [avail[v] for v in s.input_ids]; inputs.append(ins)
        avail.update(zip(s.output_ids, s.forward(0, ins, False, False)))
def execute(i, reps=5, clock=time.perf_counter):
    s = stages[i]; f = []; b = []
    for rep in range(reps + 1):
        t0 = clock(); outs = s.forward(0, inputs[i], True, False); f.append(clock() - t0)
        gr = [torch.ones_like(o) if isinstance(o, torch.Tensor) and o.is_floating_point() else None for o in outs]
        t0 = clock(); s.backward(0, gr); b.append(clock() - t0)
        for t in state.values(): t.grad = None
    return statistics.median(f[1:]), statistics.median(b[1:])
if os.environ.get("CLOCKS"):
    for trial in range(int(os.environ.get("TRIALS", "3"))):
        for i in range(len(stages)):
            w = sum(execute(i)) * 1e3
            c = sum(execute(i, clock=time.thread_time)) * 1e3
            print(f"trial {trial} stage {i}: wall {w:.1f} thread {c:.1f} load {os.getloadavg()[0]:.1f}", flush=True)
    sys.exit()
res = []
for trial in range(int(os.environ.get("TRIALS", "3"))):
    for i, p in enumerate(pieces):
        w0, c0 = time.perf_counter(), time.process_time()
        r = _C.profile_piece(traced, flat, p, rows, warmup=1, repetitions=3)
        w1, c1 = time.perf_counter(), time.process_time()
        f, b = execute(i)
        w2, c2 = time.perf_counter(), time.process_time()
        pred = (d.stages[i].forward_time + d.stages[i].backward_time) * 1e3
        prof = (r["forward_time"] + r["backward_time"]) * 1e3
        ex = (f + b) * 1e3
        print(f"trial {trial} stage {i}: plan {pred:.1f} prof {prof:.1f} ({r['forward_time']*1e3:.1f}/{r['backward_time']*1e3:.1f}) "
              f"exec {ex:.1f} ({f*1e3:.1f}/{b*1e3:.1f}) cpu/wall prof {(c1-c0)/(w1-w0):.2f} exec {(c2-c1)/(w2-w1):.2f} load {os.getloadavg()[0]:.1f}", flush=True)
        res.append(dict(trial=trial, stage=i, plan=pred, prof=prof, exec=ex))

