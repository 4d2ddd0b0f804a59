"""Runtime benchmark: RaNNCModule against plain PyTorch on one rank, and a 2-stage
pipeline on 2 CPU ranks against the plan's prediction and against one rank.

    python bench/runtime.py [--repeats 20]

Both parts alternate the measured variants in one run (the machine is shared and noisy:
read the ratios). Writes bench/results/runtime.json.
"""
import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [os.path.join(ROOT, "python"), os.path.join(ROOT, "examples")]
import rannc  # noqa: E402
from models import GPT, TransformerConfig  # noqa: E402

CFG = dict(vocab=1000, hidden=256, heads=8, layers=8, max_len=64, dropout=0.0)
BATCH = 8


def data(rows, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, CFG["vocab"], (rows, CFG["max_len"]), generator=g),
            torch.randint(0, CFG["vocab"], (rows, CFG["max_len"]), generator=g))


def step(fn, opt, batch):
    start = time.perf_counter()
    loss = fn(*batch)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - start


def one_rank(repeats):
    torch.manual_seed(0)
    plain = GPT(TransformerConfig(**CFG))
    ours = copy.deepcopy(plain)
    opt_plain = torch.optim.Adam(plain.parameters(), lr=1e-4)
    opt_ours = torch.optim.Adam(ours.parameters(), lr=1e-4)
    wrapped = rannc.RaNNCModule(ours, opt_ours, log_level="warn")
    batch = data(BATCH, 0)
    for _ in range(3):  # warm-up (and the first call's trace and plan)
        step(plain, opt_plain, batch)
        step(wrapped, opt_ours, batch)
    t_plain, t_ours = [], []
    for _ in range(repeats):
        t_plain.append(step(plain, opt_plain, batch))
        t_ours.append(step(wrapped, opt_ours, batch))
    p, o = statistics.median(t_plain), statistics.median(t_ours)
    return dict(plain_step_s=p, rannc_step_s=o, ratio=o / p)


def worker(repeats, stages):
    """Runs under mpirun: times RaNNCModule steps; rank 0 prints one JSON line."""
    torch.manual_seed(0)
    model = GPT(TransformerConfig(**CFG))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    wrapped = rannc.RaNNCModule(model, opt, num_stages=stages, log_level="warn")
    batch = data(BATCH, rannc.get_rank())
    for _ in range(3):
        step(wrapped, opt, batch)
    times = []
    for _ in range(repeats):
        rannc.barrier(60)
        times.append(step(wrapped, opt, batch))
    if rannc.get_rank() == 0:
        d = wrapped._deployed[True].deployment
        print("RESULT " + json.dumps(dict(
            ranks=rannc.get_world_size(), stages=d.num_stages, micro_batches=d.micro_batches,
            measured_step_s=statistics.median(times), predicted_iteration_s=d.iteration_time)),
            flush=True)


def launch(ranks, stages, repeats, **extra_env):
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMP_NUM_THREADS="1", **extra_env)
    out = subprocess.run(
        ["mpirun", "--oversubscribe", "-np", str(ranks), "--mca", "btl", "self,vader",
         "--mca", "btl_vader_single_copy_mechanism", "none", sys.executable, __file__,
         "--worker", str(stages), "--repeats", str(repeats)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=900)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(out.stdout[-3000:])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--worker", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.worker:
        return worker(a.repeats, a.worker)
    single = one_rank(a.repeats)
    print(f"one rank: PyTorch {single['plain_step_s'] * 1e3:.1f} ms, RaNNCModule "
          f"{single['rannc_step_s'] * 1e3:.1f} ms per step, ratio {single['ratio']:.3f} (goal <= 1.05)")
    # one rank as the baseline of the pipeline: the same local batch per rank
    base = launch(1, 1, a.repeats)
    pipe = launch(2, 2, a.repeats)
    # the same with the MPI progress thread forced on ([Note: progress thread] in
    # csrc/comm/world.h; by default it runs only where a core is spare)
    progress = launch(2, 2, a.repeats, RANNC_MPI_PROGRESS="1")
    err = pipe["measured_step_s"] / pipe["predicted_iteration_s"] - 1
    print(f"2 ranks, 2 stages, {pipe['micro_batches']} micro-batches: measured "
          f"{pipe['measured_step_s'] * 1e3:.1f} ms, predicted {pipe['predicted_iteration_s'] * 1e3:.1f} ms "
          f"({err:+.0%}; goal within 15%); one rank on its local batch: {base['measured_step_s'] * 1e3:.1f} ms")
    print(f"  with the MPI progress thread forced on: measured {progress['measured_step_s'] * 1e3:.1f} ms, "
          f"predicted {progress['predicted_iteration_s'] * 1e3:.1f} ms")
    out = os.path.join(HERE, "results", "runtime.json")
    with open(out, "w") as f:
        json.dump(dict(model=CFG, local_batch=BATCH, one_rank=single, pipeline_1rank=base,
                       pipeline_2ranks=pipe, pipeline_2ranks_progress_thread=progress),
                  f, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
