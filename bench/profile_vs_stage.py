"""Predicted against measured stage time, and the repeatability of both: a model planned
into --stages stages (profiled costs), then every stage run alone by the runtime's
StageExecutor (bench/profile_bench.py: StageRunner) and measured again by the profiler
back to back, over --trials interleaved trials.

    OMP_NUM_THREADS=1 python bench/profile_vs_stage.py --device cpu
    python bench/profile_vs_stage.py --device cuda          # on a GPU machine

Columns per stage (medians over the trials, ms of forward + backward at the planned rows):
  plan       the plan's prediction (profiled while planning)
  profiler   the profiler on the stage's piece now (1 warm-up + 3 runs, as in planning)
  executor   StageExecutor, 1 warm-up + median of 5, with the profiler's clock
  spread     (max - min) / median of the executor over the trials
  wall       the executor on the wall clock (CPU: what the shared machine gave it)
Clock: CPU measurements use the profiler's clock on both sides (the thread's CPU time with
one intra-op thread: [Note: CPU clock] in csrc/profile/device_meter.h); CUDA uses events.
Writes bench/results/profile_vs_stage_<device>.md and .json.
"""
import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, HERE)
import torch  # noqa: E402

import rannc  # noqa: E402
from rannc import _C  # noqa: E402
from profile_bench import StageRunner, build  # noqa: E402


def spread(xs):
    return (max(xs) - min(xs)) / statistics.median(xs)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--model", default="bert", choices=["bert", "gpt2"])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=1, help="traced (per-device) batch")
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--profile-cache", default="", help="reuse measured pieces from this file")
    p.add_argument("--out", default="", help="results name (default profile_vs_stage_<device>)")
    a = p.parse_args()
    device = a.device
    out = a.out or f"profile_vs_stage_{device.replace(':', '')}"
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    cuda = device.startswith("cuda")
    clock = "CUDA events" if cuda else f"{_C.profile_cpu_clock('auto')} clock"

    model, args, vocab = build(a.model, a.seq, a.batch, layers=a.layers, device=device)
    t0 = time.perf_counter()
    plan = rannc.plan(model, args, world_size=a.world_size, devices_per_node=4,
                      device_memory="16GiB", num_blocks=a.blocks, num_stages=a.stages,
                      profile_warmup=1, profile_repetitions=3, profile_device=device,
                      probe_bandwidth=False, progress=False,
                      profile_cache=a.profile_cache or rannc.ProfileCache())
    plan_s = time.perf_counter() - t0
    print(f"planned in {plan_s:.1f} s (load {os.getloadavg()[0]:.1f})", flush=True)
    runner = StageRunner(plan, vocab, a.seq, device)
    stages = runner.deployment.stages
    prof = [[] for _ in stages]
    exe = [[] for _ in stages]
    wall = [[] for _ in stages]
    for trial in range(a.trials):
        for i in range(len(stages)):
            r = runner.profile(i, warmup=1, repetitions=3)
            prof[i].append(r["forward_time"] + r["backward_time"])
            exe[i].append(sum(runner.measure(i)))
            wall[i].append(sum(runner.measure(i, wall=True)))
            print(f"trial {trial} stage {i}: plan {(stages[i].forward_time + stages[i].backward_time) * 1e3:.1f} "
                  f"profiler {prof[i][-1] * 1e3:.1f} executor {exe[i][-1] * 1e3:.1f} "
                  f"wall {wall[i][-1] * 1e3:.1f} ms (load {os.getloadavg()[0]:.1f})", flush=True)
    rows = []
    for i, st in enumerate(stages):
        plan_ms = (st.forward_time + st.backward_time) * 1e3
        e = statistics.median(exe[i]) * 1e3
        pr = statistics.median(prof[i]) * 1e3
        rows.append(dict(stage=i, tasks=len(st.tasks), rows=st.micro_batch_rows, recompute=st.recompute,
                         plan_ms=plan_ms, profiler_ms=pr, executor_ms=e,
                         plan_error=abs(plan_ms - e) / e, profiler_error=abs(pr - e) / e,
                         executor_spread=spread(exe[i]), wall_ms=statistics.median(wall[i]) * 1e3,
                         wall_spread=spread(wall[i]), trials=dict(profiler=prof[i], executor=exe[i],
                                                                  wall=wall[i])))
    name = torch.cuda.get_device_name() if cuda else "cpu"
    meta = dict(args=vars(a), device=name, clock=clock, torch=torch.__version__,
                cpus=os.cpu_count(), threads=torch.get_num_threads(), plan_s=plan_s,
                date=time.strftime("%Y-%m-%d %H:%M"), summary=plan.summary())
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", out + ".json"), "w") as f:
        json.dump(dict(meta=meta, stages=rows), f, indent=1)
    cmd = (("" if cuda else "OMP_NUM_THREADS=1 ") + f"python bench/profile_vs_stage.py --device {device} "
           f"--model {a.model} --layers {a.layers} --seq {a.seq} --stages {a.stages} --blocks {a.blocks} "
           f"--world-size {a.world_size} --trials {a.trials}")
    with open(os.path.join(HERE, "results", out + ".md"), "w") as f:
        f.write(f"# profile_vs_stage ({meta['date']}, {name}, {meta['cpus']} CPUs, {meta['threads']} "
                f"intra-op thread(s), torch {meta['torch']}, {clock})\n\n`{cmd}`\n\n")
        f.write(f"{a.model}, {a.layers} layers, seq {a.seq}, {a.stages} stages; planned in {plan_s:.0f} s. "
                f"ms of forward + backward per micro-batch, medians over {a.trials} trials.\n\n")
        f.write("| stage | tasks | rows | plan ms | profiler ms | executor ms | plan error | "
                "profiler error | executor spread | wall ms | wall spread |\n")
        f.write("|---|---|---|---|---|---|---|---|---|---|---|\n")
        for r in rows:
            f.write(f"| {r['stage']} | {r['tasks']} | {r['rows']} | {r['plan_ms']:.1f} | "
                    f"{r['profiler_ms']:.1f} | {r['executor_ms']:.1f} | {r['plan_error']:.1%} | "
                    f"{r['profiler_error']:.1%} | {r['executor_spread']:.1%} | {r['wall_ms']:.1f} | "
                    f"{r['wall_spread']:.1%} |\n")
        f.write("\n```\n" + plan.summary() + "\n```\n")
    print(open(os.path.join(HERE, "results", out + ".md")).read())


if __name__ == "__main__":
    main()
