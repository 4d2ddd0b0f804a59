"""How long a user waits before training: the first step of a one-stage plan against plain
PyTorch, and rannc.plan for 8 devices, cold and from the profile cache, with each plan's
simulated iteration time. The table the plans-in-seconds work is measured by.

    OMP_NUM_THREADS=1 python bench/plan_time.py [--models gpt2,bert] [--seq 64] [--batch 8]
        [--plan-batch 1] [--layers 12] [--blocks 8] [--device cpu|cuda] [--skip-whole]

Models: BERT-base-sized and GPT-2-small-sized (bench/profile_bench.py builds them).
  first step   one rank, local batch --batch: plain PyTorch's first step (forward,
               backward, Adam) and RaNNCModule(num_stages=1)'s first call (trace, plan,
               deploy, step) plus backward and Adam; also with profiling forced on
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
import copy
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [os.path.join(ROOT, "python"), os.path.join(ROOT, "examples"), HERE]
import torch  # noqa: E402

import rannc  # noqa: E402
from profile_bench import build  # noqa: E402
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


def first_steps(name, a):
    """Seconds of the first step: plain, rannc one stage, rannc one stage profiled."""
    model, args, _ = build(name, a.seq, a.batch, a.layers, a.device)
    out = {"plain_s": first_step(lambda opt: model, model.parameters(), args, a.device)}
    for key, profiled in (("rannc_s", None), ("rannc_profiled_s", True)):
        m = copy.deepcopy(model)
        original = rannc_module._Deployed.__dict__["_profiled"]  # the staticmethod itself
        if profiled:  # profile even one stage, as before session 7
            rannc_module._Deployed._profiled = staticmethod(lambda o: o.cost_model == "profile")
        try:
            out[key] = first_step(lambda opt: rannc.RaNNCModule(m, opt, num_stages=1),
                                  m.parameters(), args, a.device)
        finally:
            rannc_module._Deployed._profiled = original
    return out


def plans(name, a):
    model, args, _ = build(name, a.seq, a.plan_batch, a.layers, a.device)
    opts = dict(world_size=8, devices_per_node=8, device_memory="16GiB", num_blocks=a.blocks)
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
    ap.add_argument("--skip-whole", action="store_true", help="no plan measured the old way")
    ap.add_argument("--report-only", action="store_true", help="rewrite the table from the json")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--skip-plans", action="store_true", help="only the first steps")
    a = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for name in ([] if a.report_only else a.models.split(",")):
        row = {"model": name, "layers": a.layers, "seq": a.seq, "batch": a.batch}
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
        f.write("| model | first step plain s | rannc 1 stage s | 1 stage profiled s | plan 8 dev cold s "
                "| cached s | whole s (before) | iteration ms cold / cached / whole | same plan |\n"
                "|---|---|---|---|---|---|---|---|---|\n")
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
            f.write(f"| {r['model']} {r['layers']}L seq {r['seq']} | {r['plain_s']:.2f} | "
                    f"{r['rannc_s']:.2f} | {r['rannc_profiled_s']:.1f} | {plan}\n")
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
