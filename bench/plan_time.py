"""How long a user waits before training: the first step of a one-stage plan against plain
PyTorch, and rannc.plan for 8 devices, cold and from the profile cache, with each plan's
simulated iteration time. The table the plans-in-seconds work is measured by.

    OMP_NUM_THREADS=1 python bench/plan_time.py [--models gpt2,bert] [--seq 64] [--batch 8]
        [--layers 12] [--device cpu|cuda]

Models: BERT-base-sized and GPT-2-small-sized (bench/profile_bench.py builds them).
  first step   one rank: plain PyTorch's first step (forward, backward, Adam) and
               RaNNCModule(num_stages=1)'s first call (trace, plan, deploy, step) plus
               backward and Adam; also with profiling forced on (what one stage cost
               before it planned from shapes, session 7)
  plan cold    rannc.plan(world_size=8) with a fresh profile cache (traces, profiles, plans)
  plan cached  the same again, every piece answered by the cache
Writes bench/results/plan_time_<device>.json and .md.
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
        original = rannc_module._Deployed._profiled
        if profiled:  # profile even one stage, as before session 7
            rannc_module._Deployed._profiled = staticmethod(lambda o: o.cost_model == "profile")
        try:
            out[key] = first_step(lambda opt: rannc.RaNNCModule(m, opt, num_stages=1),
                                  m.parameters(), args, a.device)
        finally:
            rannc_module._Deployed._profiled = original
    return out


def plans(name, a):
    model, args, _ = build(name, a.seq, a.batch, a.layers, a.device)
    cache = rannc.ProfileCache()
    opts = dict(world_size=8, devices_per_node=8, device_memory="16GiB", profile_cache=cache,
                num_blocks=a.blocks)
    out = {}
    for key in ("cold", "cached"):
        start = time.perf_counter()
        plan = rannc.plan(model, args, **opts)
        out[f"plan_{key}_s"] = time.perf_counter() - start
        out[f"iteration_{key}_ms"] = plan.deployment.iteration_time * 1e3
        out[f"plan_{key}_hash"] = plan.hash
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="gpt2,bert")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--blocks", type=int, default=32)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--skip-plans", action="store_true", help="only the first steps")
    a = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for name in a.models.split(","):
        row = {"model": name, "layers": a.layers, "seq": a.seq, "batch": a.batch}
        row.update(first_steps(name, a))
        if not a.skip_plans:
            row.update(plans(name, a))
        rows.append(row)
        print(json.dumps(row), flush=True)
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    base = os.path.join(HERE, "results", f"plan_time_{a.device}")
    with open(base + ".json", "w") as f:
        json.dump({"device": a.device, "torch": torch.__version__, "rows": rows}, f, indent=2)
    with open(base + ".md", "w") as f:
        f.write(f"# Plan time ({a.device}, torch {torch.__version__}; `bench/plan_time.py`)\n\n")
        f.write("| model | first step plain s | rannc 1 stage s | 1 stage profiled s | plan 8 dev cold s "
                "| cached s | iteration ms (cold / cached) |\n|---|---|---|---|---|---|---|\n")
        for r in rows:
            plan = (f"{r['plan_cold_s']:.1f} | {r['plan_cached_s']:.1f} | "
                    f"{r['iteration_cold_ms']:.1f} / {r['iteration_cached_ms']:.1f}"
                    if "plan_cold_s" in r else "- | - | -")
            f.write(f"| {r['model']} {r['layers']}L seq {r['seq']} x{r['batch']} | {r['plain_s']:.2f} | "
                    f"{r['rannc_s']:.2f} | {r['rannc_profiled_s']:.1f} | {plan} |\n")
    print(open(base + ".md").read())


if __name__ == "__main__":
    main()
