"""Where a pipelined step's time goes, per rank, against the plan: forward and backward
compute (the stage executor's calls), waits for transfers and the all-reduce (as the C++
engine measures them, `last_step_times`), the optimizer step, and the rest (the engine's
own work and RaNNCModule's). The model and batch are bench/runtime.py's.

    python bench/pipeline_breakdown.py [--ranks 2] [--stages 2] [--single-copy] [--repeats 15]

Launches itself under mpirun (copy in/out unless --single-copy, see
bench/runtime.py:single_copy_works); each rank prints one line. This is how the session-3
gap between the runtime and its prediction was taken apart (docs/status.md).
"""
import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE]
from runtime import ROOT, mpirun_command, mpirun_env, warmed_up_pipeline  # noqa: E402

import rannc  # noqa: E402  (runtime put python/ on the path)


def worker(stages, repeats):
    wrapped, opt, batch = warmed_up_pipeline(stages)
    deployed = wrapped._deployed[True]
    rows = {k: [] for k in ("step", "F", "B", "wait", "update")}
    for _ in range(repeats):
        rannc.barrier(60)
        start = time.perf_counter()
        wrapped(*batch).backward()
        before_update = time.perf_counter()
        opt.step()
        opt.zero_grad()
        end = time.perf_counter()
        times = deployed.engine.last_step_times  # measured by the C++ engine
        rows["F"].append(times["forward"])
        rows["B"].append(times["backward"])
        rows["wait"].append(times["wait"])
        rows["update"].append(end - before_update)
        rows["step"].append(end - start)
    med = {k: statistics.median(v) * 1e3 for k, v in rows.items()}
    d = deployed.deployment
    s = d.stage_of_rank(rannc.get_rank())
    st, M = d.stages[s], d.micro_batches
    rest = med["step"] - med["F"] - med["B"] - med["wait"] - med["update"]
    print(f"rank {rannc.get_rank()} stage {s} (M={M}): step {med['step']:.1f} ms "
          f"(predicted {d.iteration_time * 1e3:.1f}); forward {med['F']:.1f} "
          f"(predicted {st.forward_time * M * 1e3:.1f}), backward {med['B']:.1f} "
          f"(predicted {st.backward_time * M * 1e3:.1f}), waits {med['wait']:.1f} "
          f"(predicted idle {(st.bubble_time - st.update_time) * 1e3:.1f}), optimizer step {med['update']:.1f} "
          f"(predicted {st.update_time * 1e3:.1f}), rest {rest:.1f}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--single-copy", action="store_true", help="Open MPI's CMA transport")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.worker:
        return worker(a.stages, a.repeats)
    cmd = mpirun_command(a.ranks, a.single_copy, [__file__, "--worker", "--stages", str(a.stages),
                                                  "--repeats", str(a.repeats)])
    return subprocess.run(cmd, env=mpirun_env(PYTHONPATH=os.path.join(ROOT, "python"))).returncode


if __name__ == "__main__":
    sys.exit(main())
