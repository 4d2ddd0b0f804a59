"""How long a user waits before training: the first step of a one-stage plan against plain
PyTorch, and rannc.plan for 8 devices, cold and from the profile cache, with each plan's
simulated iteration time. The table the plans-in-seconds work is measured by.

    OMP_NUM_THREADS=1 python bench/plan_time.py [--models gpt2,bert] [--seq 64] [--batch 8]
        [--plan-batch 1] [--layers 12] [--blocks 8] [--device cpu|cuda] [--skip-whole]

Models: BERT-base-sized and GPT-2-small-sized (bench/profile_bench.py builds them), and
bert_large (24 layers, hidden 1024: the issue's GPU cases, with --world 32 --device-memory
80GiB --seq 128 --batch 16 on a GPU; --layers does not apply to it).
  first step   one rank, local batch --batch, each case in a fresh process (what a user
               waits for, page faults and all): plain PyTorch's first step (forward,
               backward, Adam) and RaNNCModule(num_stages=1)'s first call (trace, plan,
               deploy, step) plus backward and Adam; also with profiling forced on. The
               goal is an extra of about one forward and backward: `extra / fwd+bwd` is
               (rannc - plain) over plain PyTorch's forward and backward in later steps
  plan cold    rannc.plan(world_size=8), --plan-batch rows per device, with a fresh
               profile cache: traces, profiles (blocks measured, ranges composed, row
               counts fitted: [Note: composed costs], [Note: fitted rows]), plans
  plan cached  the same again, every measurement answered by the cache
  whole        the plan as before session 8 (compose_costs=False, profile_fit_tolerance=0:
               every candidate range measured whole at every row count), fresh cache;
               the same plan hash means the faster planning found the same plan
The defaults are the configuration of the issue's table (bench/results/profile_bench.md):
seq 64, one row per device, 8 blocks. Writes bench/results/plan_time.{json,md} (plan_time_cuda.* with --device cuda).
"""
import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [os.path.join(ROOT, "python"), os.path.join(ROOT, "examples"), HERE]
import torch  # noqa: E402

import rannc  # noqa: E402
from profile_bench import FIXED_LAYERS, build  # noqa: E402
from rannc import module as rannc_module  # noqa: E402


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def first_step(fn, params, args, device):
    opt = torch.optim.Adam(params, lr=1e-4)
    sync(device)
    start = time.perf_counter()
    loss = fn(opt)(*args)
    loss.backward()
    opt.step()
    sync(device)
    return time.perf_counter() - start


def steady_forward_backward(model, args, device, steps=3):
    """Median seconds of plain PyTorch's forward and backward after a first step."""
    times = []
    for _ in range(steps + 1):
        sync(device)
        start = time.perf_counter()
        model(*args).backward()
        sync(device)
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return sorted(times[1:])[len(times[1:]) // 2]


def first_step_child(case, name, a):
    """One case of first_steps, in this fresh process."""
    model, args, _ = build(name, a.seq, a.batch, a.layers, a.device)
    if case == "plain":
        out = {"plain_s": first_step(lambda opt: model, model.parameters(), args, a.device)}
        out["plain_fwd_bwd_s"] = steady_forward_backward(model, args, a.device)
        return out
    if case == "profiled":  # profile even one stage, as before session 7
        rannc_module._Deployed._profiled = staticmethod(lambda o, world: o.cost_model == "profile")
    seconds = first_step(lambda opt: rannc.RaNNCModule(model, opt, num_stages=1),
                         model.parameters(), args, a.device)
    return {"rannc_s" if case == "rannc" else "rannc_profiled_s": seconds}


def first_steps(name, a):
    """Seconds of the first step: plain, rannc one stage, rannc one stage profiled, each in
    its own process (the first of several cases in one process paid its page faults)."""
    out = {}
    for case in ("plain", "rannc", "profiled"):
        cmd = [sys.executable, os.path.abspath(__file__), "--first-step-child", case, "--models", name,
               "--seq", str(a.seq), "--batch", str(a.batch), "--layers", str(a.layers), "--device", a.device]
        done = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True)
        out.update(json.loads(done.stdout.strip().splitlines()[-1]))
    out["extra_over_fwd_bwd"] = (out["rannc_s"] - out["plain_s"]) / out["plain_fwd_bwd_s"]
    return out


def plans(name, a):
    model, args, _ = build(name, a.seq, a.plan_batch, a.layers, a.device)
    opts = dict(world_size=a.world, devices_per_node=8, device_memory=a.device_memory, num_blocks=a.blocks)
    out = {}
    cache = rannc.ProfileCache()
    runs = [("cold", cache, {}), ("cached", cache, {})]
    if not a.skip_whole:
        runs.append(("whole", rannc.ProfileCache(), dict(compose_costs=False, profile_fit_tolerance=0)))
    for key, c, extra in runs:
        plan = rannc.plan(model, args, profile_cache=c, **opts, **extra)
        t = plan.times
        out[f"plan_{key}_s"] = plan.planning_time
        out[f"plan_{key}_split"] = dict(tracing=t.tracing, profiling=t.profiling, search=t.search,
                                        measured=t.pieces_measured, fitted=t.records_fitted,
                                        composed=t.unions_composed)
        out[f"iteration_{key}_ms"] = plan.deployment.iteration_time * 1e3
        out[f"plan_{key}_hash"] = plan.hash
        print(f"{name} {key}: {plan.times.line()}; plan {plan.hash}, "
              f"{plan.deployment.iteration_time * 1e3:.1f} ms", flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="gpt2,bert")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--plan-batch", type=int, default=1, help="rows per device of the 8-device plans")
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--world", type=int, default=8, help="devices of the plans (8 per node)")
    ap.add_argument("--device-memory", default="16GiB", help="memory per device of the plans")
    ap.add_argument("--skip-whole", action="store_true", help="no plan measured the old way")
    ap.add_argument("--report-only", action="store_true", help="rewrite the table from the json")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--skip-plans", action="store_true", help="only the first steps")
    ap.add_argument("--first-step-child", choices=["plain", "rannc", "profiled"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.first_step_child:
        print(json.dumps(first_step_child(a.first_step_child, a.models, a)), flush=True)
        return
    rows = []
    for name in ([] if a.report_only else a.models.split(",")):
        row = {"model": name, "layers": FIXED_LAYERS.get(name, a.layers), "seq": a.seq, "batch": a.batch,
               "world": a.world}
        row.update(first_steps(name, a))
        if not a.skip_plans:
            row.update(plans(name, a))
        rows.append(row)
        print(json.dumps(row), flush=True)
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    # the CPU cases are the table (plan_time.*); the GPU cases sit beside them
    base = os.path.join(HERE, "results", "plan_time" if a.device == "cpu" else f"plan_time_{a.device}")
    if os.path.exists(base + ".json"):  # keep the rows of models not run this time, and
        with open(base + ".json") as f:  # columns not run (--skip-whole)
            old = {r["model"]: r for r in json.load(f).get("rows", [])}
        for r in rows:
            for key, value in old.pop(r["model"], {}).items():
                r.setdefault(key, value)
        rows = list(old.values()) + rows
    with open(base + ".json", "w") as f:
        json.dump({"device": a.device, "torch": torch.__version__, "rows": rows}, f, indent=2)
    with open(base + ".md", "w") as f:
        f.write(f"# Plan time ({a.device}, torch {torch.__version__}; `bench/plan_time.py`)\n\n")
        f.write("| model | first step plain s | rannc 1 stage s | extra / fwd+bwd | 1 stage profiled s "
                "| plan cold s | cached s | whole s (before) | iteration ms cold / cached / whole "
                "| same plan |\n|---|---|---|---|---|---|---|---|---|---|\n")
        for r in rows:
            if "plan_cold_s" in r:
                fmt = lambda key: "-" if key not in r else f"{r[key]:.1f}"  # noqa: E731
                same = ("-" if "plan_whole_hash" not in r
                        else "yes" if r["plan_whole_hash"] == r["plan_cold_hash"] else "no")
                plan = (f"{fmt('plan_cold_s')} | {fmt('plan_cached_s')} | {fmt('plan_whole_s')} | "
                        f"{fmt('iteration_cold_ms')} / {fmt('iteration_cached_ms')} / "
                        f"{fmt('iteration_whole_ms')} | {same} |")
            else:
                plan = "- | - | - | - | - |"
            extra = "-" if "extra_over_fwd_bwd" not in r else f"{r['extra_over_fwd_bwd']:.2f}"
            f.write(f"| {r['model']} {r['layers']}L seq {r['seq']}, "
                    f"{r.get('world', 8)} dev | {r['plain_s']:.2f} | "
                    f"{r['rannc_s']:.2f} | {extra} | {r['rannc_profiled_s']:.1f} | {plan}\n")
        f.write("\nTime split of the cold plans (tracing / profiling / search, s; pieces measured, "
                "records fitted, unions composed):\n\n")
        for r in rows:
            for key in ("cold", "cached", "whole"):
                sp = r.get(f"plan_{key}_split")
                if sp:
                    f.write(f"- {r['model']} {key}: {sp['tracing']:.2f} / {sp['profiling']:.2f} / "
                            f"{sp['search']:.2f}; {sp['measured']} measured, {sp['fitted']} fitted, "
                            f"{sp['composed']} composed\n")
    print(open(base + ".md").read())


if __name__ == "__main__":
    main()
