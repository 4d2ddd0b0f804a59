"""Planning with the device profiler on CPU: planning time with and without the profile
cache and over 1, 2, 4 ranks, and predicted stage times against each planned stage run.

    python bench/profile_bench.py [--models bert,gpt2] [--ranks 1,2,4] [--seq 64] [--blocks 8]

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
micro-batch of the planned rows, median of 5 after a warm-up.
Writes bench/results/profile_bench.json and profile_bench.md.
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


def build(name, seq, batch):
    torch.manual_seed(0)
    if name == "bert":
        model, vocab = Bert(), 30522
    else:
        from models import GPT, GPTConfig
        model, vocab = GPT(GPTConfig(vocab=50257, hidden=768, heads=12, layers=12, max_len=seq)), 50257
    g = torch.Generator().manual_seed(1)
    args = (torch.randint(0, vocab, (batch, seq), generator=g),
            torch.randint(0, vocab, (batch, seq), generator=g))
    return model, args, vocab


def stage_errors(plan, name, seq, repeats=5):
    """Per stage: predicted fwd+bwd vs measured with StageExecutor at the planned rows."""
    from rannc import _C
    d = plan.deployment
    rows = max(s.micro_batch_rows for s in d.stages)
    model, _, vocab = build(name, seq, 1)
    g = torch.Generator().manual_seed(2)
    args = (torch.randint(0, vocab, (rows, seq), generator=g),
            torch.randint(0, vocab, (rows, seq), generator=g))
    tg = plan.graph
    # Rebind the traced graph to the same weights (the plan's graph traced the same model).
    ir, traced = tg.ir, tg._trace.traced
    flat = tg._flat_inputs(args, {})
    values = dict(zip(ir.inputs, flat))
    state = {v: t for v, t in values.items() if ir.value(v)["role"] in ("param", "buffer")}
    pieces = plan.stage_pieces()
    stages = [_C.StageExecutor(traced, p, {v: state[v] for v in p.inputs if v in state})
              for p in pieces]
    # The inputs of every stage from one chained forward (no grad), then each stage alone:
    # forward (stashing, recomputing where planned) and backward with dense gradients.
    inputs = []
    avail = {v: t for v, t in values.items() if v not in state}
    with torch.no_grad():
        for s in stages:
            ins = [avail[v] for v in s.input_ids]
            inputs.append(ins)
            avail.update(zip(s.output_ids, s.forward(0, ins, False, False)))
    fwd = [[] for _ in stages]
    bwd = [[] for _ in stages]
    for i, s in enumerate(stages):
        for rep in range(repeats + 1):
            t0 = time.perf_counter()
            outs = s.forward(0, inputs[i], True, d.stages[i].recompute)
            fwd[i].append(time.perf_counter() - t0)
            grads = [torch.ones_like(o) if isinstance(o, torch.Tensor) and o.is_floating_point() else None
                     for o in outs]
            t0 = time.perf_counter()
            s.backward(0, grads)
            bwd[i].append(time.perf_counter() - t0)
            for t in state.values():
                t.grad = None
    table = []
    for i, st in enumerate(d.stages):
        measured = statistics.median(fwd[i][1:]) + statistics.median(bwd[i][1:])
        predicted = st.forward_time + st.backward_time
        table.append(dict(stage=i, tasks=len(st.tasks), rows=st.micro_batch_rows,
                          recompute=st.recompute, predicted_ms=predicted * 1e3,
                          measured_ms=measured * 1e3,
                          error=abs(predicted - measured) / measured))
    return table


def worker(a):
    import rannc
    from rannc import _C
    torch.set_num_threads(1)
    model, args, _ = build(a.model, a.seq, a.batch)
    opts = dict(world_size=a.world_size, devices_per_node=4, device_memory="16GiB",
                num_blocks=a.blocks, profile_warmup=1, profile_repetitions=3, progress=False)
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
        out["stage_errors"] = stage_errors(plan, a.model, a.seq)
        # A pipeline too (the searched plan may be pure data parallelism at this batch).
        four = rannc.plan(model, args, profile_cache=cache, **dict(opts, num_stages=4))
        out["stage_errors_4"] = stage_errors(four, a.model, a.seq)
        out["summary_4"] = four.summary()
    if _C.get_rank() == 0:
        print("RESULT " + json.dumps(out), flush=True)


def run(model, ranks, a):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--model", model,
           "--seq", str(a.seq), "--blocks", str(a.blocks), "--batch", str(a.batch),
           "--world-size", str(a.world_size)] + (["--errors"] if ranks == 1 else [])
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
    p.add_argument("--out", default="profile_bench", help="results file name (without extension)")
    a = p.parse_args()
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
    meta = dict(args=vars(a), torch=torch.__version__, cpus=os.cpu_count(),
                date=time.strftime("%Y-%m-%d %H:%M"))
    with open(os.path.join(HERE, "results", a.out + ".json"), "w") as f:
        json.dump(dict(meta=meta, results=results), f, indent=1)
    with open(os.path.join(HERE, "results", a.out + ".md"), "w") as f:
        f.write(f"# profile_bench ({meta['date']}, {meta['cpus']} CPUs shared, torch {meta['torch']})\n\n")
        f.write(f"`python bench/profile_bench.py --models {a.models} --ranks {a.ranks} --seq {a.seq} "
                f"--blocks {a.blocks} --batch {a.batch} --world-size {a.world_size} --out {a.out}`\n\n")
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
                f.write("| stage | tasks | rows | recompute | predicted ms | measured ms | error |\n")
                f.write("|---|---|---|---|---|---|---|\n")
                for e in r[key]:
                    f.write(f"| {e['stage']} | {e['tasks']} | {e['rows']} | {e['recompute']} | "
                            f"{e['predicted_ms']:.1f} | {e['measured_ms']:.1f} | {e['error']:.1%} |\n")
                f.write("\n```\n" + r[skey] + "\n```\n")


if __name__ == "__main__":
    main()
