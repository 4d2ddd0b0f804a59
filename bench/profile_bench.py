"""Planning with the device profiler: planning time with and without the profile cache
and over 1, 2, 4 ranks, and predicted stage times against each planned stage run.

    OMP_NUM_THREADS=1 python bench/profile_bench.py [--models bert,gpt2] [--ranks 1,2,4]
        [--seq 64] [--blocks 8] [--device cpu|cuda]

Models: BERT-base-sized (12 layers, hidden 768, 12 heads, FFN 3072, vocab 30522, MLM loss)
and GPT-2-small-sized (12 layers, hidden 768, 12 heads, vocab 50257, LM loss), both at
sequence length --seq. Each rank count runs under `mpirun --oversubscribe -np N` (the
machine's cores are shared: more ranks than cores cannot speed up). For every model:
  plan_s        first rannc.plan (fresh cache: traces, profiles, plans)
  cached_s      second rannc.plan of the same model (the cache answers every piece)
  speedup       plan_s / cached_s
and with one rank the error table: per stage, predicted forward+backward (the plan's
StagePlan) against forward+backward of that stage measured with the runtime's
StageExecutor, each stage alone (its inputs captured from one chained forward), one
micro-batch of the planned rows, median of 5 after a warm-up (median of 3 such trials
interleaved over the stages), timed with the profiler's
clock (CPU: the thread's CPU time when single-threaded, see [Note: CPU clock] in
csrc/profile/device_meter.h; CUDA: events), and with the wall clock alongside.
Writes bench/results/profile_bench_<device>.json and .md (--out to rename).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402


class Bert(nn.Module):
    def __init__(self, vocab=30522, hidden=768, heads=12, ffn=3072, layers=12, max_len=512):
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(max_len, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.layers = nn.ModuleList([
            nn.TransformerEncoderLayer(hidden, heads, ffn, dropout=0.1, activation="gelu",
                                       batch_first=True) for _ in range(layers)])
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids, labels):
        pos = torch.arange(ids.size(1), device=ids.device)
        h = self.norm(self.tok(ids) + self.pos(pos))
        for layer in self.layers:
            h = layer(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


# Models whose depth is fixed (the --layers of the benchmarks does not apply).
FIXED_LAYERS = {"bert_large": 24}


def build(name, seq, batch, layers=12, device="cpu"):
    torch.manual_seed(0)
    if name == "bert":
        model, vocab = Bert(layers=layers), 30522
    elif name == "bert_large":  # the plans-in-seconds issue's BERT-large-like model: 24 layers
        model, vocab = Bert(hidden=1024, heads=16, ffn=4096, layers=FIXED_LAYERS[name]), 30522
    else:
        from models import GPT, TransformerConfig
        model, vocab = GPT(TransformerConfig(vocab=50257, hidden=768, heads=12, layers=layers,
                                             max_len=seq)), 50257
    g = torch.Generator().manual_seed(1)
    args = (torch.randint(0, vocab, (batch, seq), generator=g),
            torch.randint(0, vocab, (batch, seq), generator=g))
    return model.to(device), tuple(a.to(device) for a in args), vocab


def timer(device):
    """A stopwatch with the profiler's clock on `device`: CUDA events (synchronised); on the
    CPU the calling thread's CPU time when torch runs one intra-op thread, else the wall
    clock (rannc's default, [Note: CPU clock] in csrc/profile/device_meter.h)."""
    from rannc import _C
    if str(device).startswith("cuda"):
        def run(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            end.synchronize()
            return out, start.elapsed_time(end) * 1e-3
        return run
    clock = time.thread_time if _C.profile_cpu_clock("auto") == "thread" else time.perf_counter

    def run(fn):
        t0 = clock()
        out = fn()
        return out, clock() - t0
    return run


class StageRunner:
    """Each stage of a plan run alone by the runtime's StageExecutor at the planned rows,
    with its inputs captured from one chained forward (no grad): forward (stashing,
    recomputing where planned) and backward with dense gradients, adding into the
    parameters' .grad after the first run as the runtime's later micro-batches do (and the
    profiler, [Note: accumulating backward] in csrc/profile/profiler.cpp)."""

    def __init__(self, plan, vocab, seq, device="cpu"):
        from rannc import _C
        d = self.deployment = plan.deployment
        self.device = device
        rows = max(s.micro_batch_rows for s in d.stages)
        g = torch.Generator().manual_seed(2)
        args = (torch.randint(0, vocab, (rows, seq), generator=g).to(device),
                torch.randint(0, vocab, (rows, seq), generator=g).to(device))
        tg = plan.graph
        ir, self.traced = tg.ir, tg._trace.traced
        self.flat = tg._flat_inputs(args, {})
        values = dict(zip(ir.inputs, self.flat))
        self.state = {v: t for v, t in values.items() if ir.value(v).role in ("param", "buffer")}
        self.pieces = plan.stage_pieces()
        self.stages = [_C.StageExecutor(self.traced, p, {v: self.state[v] for v in p.inputs if v in self.state})
                       for p in self.pieces]
        self.inputs = []
        avail = {v: t for v, t in values.items() if v not in self.state}
        with torch.no_grad():
            for s in self.stages:
                ins = [avail[v] for v in s.input_ids]
                self.inputs.append(ins)
                avail.update(zip(s.output_ids, s.forward(0, ins, False, False)))

    def measure(self, i, repeats=5, wall=False):
        """Median forward and backward seconds of stage i after one warm-up run, with the
        profiler's clock (wall=True: the wall clock, synchronised on CUDA)."""
        s, recompute = self.stages[i], self.deployment.stages[i].recompute
        if wall:
            sync = torch.cuda.synchronize if str(self.device).startswith("cuda") else (lambda: None)

            def run(fn):
                sync()
                t0 = time.perf_counter()
                out = fn()
                sync()
                return out, time.perf_counter() - t0
        else:
            run = timer(self.device)
        fwd, bwd = [], []
        for _ in range(repeats + 1):
            outs, f = run(lambda: s.forward(0, self.inputs[i], True, recompute))
            grads = [torch.ones_like(o) if isinstance(o, torch.Tensor) and o.is_floating_point() else None
                     for o in outs]
            _, b = run(lambda: s.backward(0, grads))
            fwd.append(f)
            bwd.append(b)
        for t in self.state.values():
            t.grad = None
        return statistics.median(fwd[1:]), statistics.median(bwd[1:])

    def profile(self, i, **kw):
        """The profiler on stage i's piece now, as planning measures it."""
        from rannc import _C
        rows = self.deployment.stages[i].micro_batch_rows
        return _C.profile_piece(self.traced, self.flat, self.pieces[i], rows,
                                recompute=self.deployment.stages[i].recompute,
                                device=str(self.device), **kw)


def stage_errors(plan, name, seq, repeats=5, device="cpu", trials=3):
    """Per stage: predicted fwd+bwd vs measured with StageExecutor at the planned rows, with
    the profiler's clock (and the wall clock alongside): the median over `trials` trials
    interleaved over the stages, so that a burst of load on a shared machine spoils one
    trial of a stage, not its result."""
    _, _, vocab = build(name, seq, 1, layers=1)
    runner = StageRunner(plan, vocab, seq, device)
    stages = runner.deployment.stages
    measured = [[] for _ in stages]
    wall = [[] for _ in stages]
    for _ in range(trials):
        for i in range(len(stages)):
            measured[i].append(sum(runner.measure(i, repeats)))
            wall[i].append(sum(runner.measure(i, repeats, wall=True)))
    table = []
    for i, st in enumerate(stages):
        m = statistics.median(measured[i])
        predicted = st.forward_time + st.backward_time
        table.append(dict(stage=i, tasks=len(st.tasks), rows=st.micro_batch_rows,
                          recompute=st.recompute, predicted_ms=predicted * 1e3,
                          measured_ms=m * 1e3, measured_wall_ms=statistics.median(wall[i]) * 1e3,
                          trials_ms=[x * 1e3 for x in measured[i]],
                          error=abs(predicted - m) / m))
    return table


def worker(a):
    import rannc
    from rannc import _C
    torch.set_num_threads(1)
    model, args, _ = build(a.model, a.seq, a.batch, device=a.device)
    opts = dict(world_size=a.world_size, devices_per_node=4, device_memory="16GiB",
                num_blocks=a.blocks, profile_warmup=1, profile_repetitions=3, progress=False,
                profile_device=a.device)
    cache = rannc.ProfileCache()
    t0 = time.perf_counter()
    plan = rannc.plan(model, args, profile_cache=cache, **opts)
    t1 = time.perf_counter()
    again = rannc.plan(model, args, profile_cache=cache, **opts)
    t2 = time.perf_counter()
    out = dict(model=a.model, ranks=_C.get_world_size(), plan_s=t1 - t0, cached_s=t2 - t1,
               cache_entries=len(cache), stages=plan.num_stages,
               micro_batches=plan.micro_batches, same_plan=again.deployment.to_bytes() == plan.deployment.to_bytes(),
               summary=plan.summary())
    if _C.get_world_size() == 1 and a.errors:
        out["stage_errors"] = stage_errors(plan, a.model, a.seq, device=a.device)
        # A pipeline too (the searched plan may be pure data parallelism at this batch).
        four = rannc.plan(model, args, profile_cache=cache, **dict(opts, num_stages=4))
        out["stage_errors_4"] = stage_errors(four, a.model, a.seq, device=a.device)
        out["summary_4"] = four.summary()
    if _C.get_rank() == 0:
        print("RESULT " + json.dumps(out), flush=True)


def run(model, ranks, a):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--model", model,
           "--seq", str(a.seq), "--blocks", str(a.blocks), "--batch", str(a.batch),
           "--world-size", str(a.world_size), "--device", a.device] + (["--errors"] if ranks == 1 else [])
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    if ranks > 1:
        cmd = ["mpirun", "--oversubscribe", "-np", str(ranks), "--mca", "btl", "self,vader",
               "--mca", "btl_vader_single_copy_mechanism", "none"] + cmd
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{model} on {ranks} rank(s) failed:\n{r.stdout[-4000:]}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="bert,gpt2")
    p.add_argument("--ranks", default="1,2,4")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--batch", type=int, default=1, help="traced (per-rank) batch")
    p.add_argument("--world-size", type=int, default=8, help="devices planned for")
    p.add_argument("--worker", action="store_true")
    p.add_argument("--errors", action="store_true")
    p.add_argument("--model", default="")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]: where pieces are profiled and stages run")
    p.add_argument("--out", default="", help="results file name without extension "
                   "(default profile_bench_<device>)")
    a = p.parse_args()
    a.out = a.out or f"profile_bench_{a.device.replace(':', '')}"
    if a.worker:
        return worker(a)
    results = []
    for model in a.models.split(","):
        for ranks in map(int, a.ranks.split(",")):
            res = run(model, ranks, a)
            results.append(res)
            print(f"{model:5s} ranks {ranks}: plan {res['plan_s']:.1f} s, cached {res['cached_s']:.2f} s "
                  f"(x{res['plan_s'] / res['cached_s']:.1f}), {res['stages']} stages, "
                  f"{res['micro_batches']} micro-batches", flush=True)
            for e in res.get("stage_errors", []) + res.get("stage_errors_4", []):
                print(f"   stage {e['stage']}: predicted {e['predicted_ms']:.1f} ms, measured "
                      f"{e['measured_ms']:.1f} ms, error {e['error']:.1%}", flush=True)
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    from rannc import _C
    clock = ("CUDA events" if a.device.startswith("cuda") else
             f"{_C.profile_cpu_clock('auto')} clock (profiler and StageExecutor alike)")
    meta = dict(args=vars(a), torch=torch.__version__, cpus=os.cpu_count(), clock=clock,
                device=(torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu"),
                date=time.strftime("%Y-%m-%d %H:%M"))
    with open(os.path.join(HERE, "results", a.out + ".json"), "w") as f:
        json.dump(dict(meta=meta, results=results), f, indent=1)
    with open(os.path.join(HERE, "results", a.out + ".md"), "w") as f:
        f.write(f"# profile_bench ({meta['date']}, {meta['device']}, {meta['cpus']} CPUs shared, "
                f"torch {meta['torch']}, {meta['clock']})\n\n")
        f.write(f"`OMP_NUM_THREADS=1 python bench/profile_bench.py --models {a.models} --ranks {a.ranks} "
                f"--seq {a.seq} --blocks {a.blocks} --batch {a.batch} --world-size {a.world_size} "
                f"--device {a.device} --out {a.out}`\n\n")
        f.write("| model | ranks | plan s (no cache) | plan s (cached) | speed-up | stages | micro-batches |\n")
        f.write("|---|---|---|---|---|---|---|\n")
        for r in results:
            f.write(f"| {r['model']} | {r['ranks']} | {r['plan_s']:.1f} | {r['cached_s']:.2f} | "
                    f"{r['plan_s'] / r['cached_s']:.1f}x | {r['stages']} | {r['micro_batches']} |\n")
        for r in results:
            for key, skey, what in (("stage_errors", "summary", "searched plan"),
                                    ("stage_errors_4", "summary_4", "plan with num_stages=4")):
                if key not in r:
                    continue
                f.write(f"\n## {r['model']}, {what}: predicted vs measured stage forward+backward (1 rank)\n\n")
                f.write("| stage | tasks | rows | recompute | predicted ms | measured ms | error | wall ms |\n")
                f.write("|---|---|---|---|---|---|---|---|\n")
                for e in r[key]:
                    f.write(f"| {e['stage']} | {e['tasks']} | {e['rows']} | {e['recompute']} | "
                            f"{e['predicted_ms']:.1f} | {e['measured_ms']:.1f} | {e['error']:.1%} | "
                            f"{e['measured_wall_ms']:.1f} |\n")
                f.write("\n```\n" + r[skey] + "\n```\n")


if __name__ == "__main__":
    main()
