"""Checkpoint times: sharded save_checkpoint / load_checkpoint against writing one rank's
share of the bytes (the goal: a save takes about that, every rank writing at once) and
against the gathered path (state_dict() and optimizer_state_dict() on every rank, then
torch.save on rank 0), for 1, 2 and 4 CPU ranks, one stage per rank.

    python bench/checkpoint.py [--ranks 1 2 4] [--layers 32] [--width 1024] [--dir /tmp]

The model: `layers` Linear(width, width) with Adam (32 x 1024^2: 128 MiB of weights and
256 MiB of optimizer state). Medians of 3. Writes bench/results/checkpoint.{json,md}.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def worker(a):
    import torch
    import torch.nn as nn
    sys.path.insert(0, os.path.join(ROOT, "python"))
    import rannc
    torch.set_num_threads(1)
    rank, world = rannc.get_rank(), rannc.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(a.width, a.width) for _ in range(a.layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    w = rannc.RaNNCModule(model, opt, num_stages=world, num_microbatches=1,
                          cost_model="analytic")
    w(torch.randn(2, a.width)).square().mean().backward()
    opt.step()
    held = [*model.parameters(), *model.buffers()]  # this rank's share: the rest is empty
    share = sum(t.numel() * t.element_size() for t in held)
    share += sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor))
    total = a.layers * (a.width + 1) * a.width * 4 * 3
    base = os.path.join(a.dir, f"rannc_bench_ckpt_{world}")

    def timed(fn):
        times = []
        for _ in range(3):
            rannc.barrier()
            t0 = time.perf_counter()
            fn()
            rannc.barrier()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def write_share():  # the same bytes to a new plain file per rank, fsynced
        if os.path.exists(f"{base}.raw{rank}"):
            os.remove(f"{base}.raw{rank}")
        with open(f"{base}.raw{rank}", "wb") as f:
            for t in [t.detach() for t in held] + [
                    v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]:
                if t.numel():
                    f.write(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))
            f.flush()
            os.fsync(f.fileno())

    def gathered():
        state, osd = w.state_dict(), w.optimizer_state_dict()
        if rank == 0:
            with open(f"{base}.pt", "wb") as f:
                torch.save({"model": state, "optimizer": osd}, f)
                f.flush()
                os.fsync(f.fileno())

    share_s = timed(write_share)
    save_s = timed(lambda: w.save_checkpoint(base))
    load_s = timed(lambda: w.load_checkpoint(base))
    gathered_s = timed(gathered)
    from rannc.transport import all_gather_objects
    shares = all_gather_objects(share)
    if rank == 0:
        print("RESULT " + json.dumps({
            "ranks": world, "total_mib": total / 2**20, "largest_share_mib": max(shares) / 2**20,
            "write_share_s": share_s, "save_s": save_s, "save_over_write_share": save_s / share_s,
            "load_s": load_s, "gathered_save_s": gathered_s,
            "gathered_over_save": gathered_s / save_s}), flush=True)
        shutil.rmtree(base, ignore_errors=True)
        for f in os.listdir(a.dir):
            if f.startswith(os.path.basename(base)) and not os.path.isdir(os.path.join(a.dir, f)):
                os.remove(os.path.join(a.dir, f))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--worker", action="store_true")
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    rows = []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMPI_ALLOW_RUN_AS_ROOT": "1",
           "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    for n in a.ranks:
        cmd = ["mpirun", "--oversubscribe", "-np", str(n), "--mca", "btl", "self,vader",
               "--mca", "btl_vader_single_copy_mechanism", "none", sys.executable, __file__,
               "--worker", "--layers", str(a.layers), "--width", str(a.width), "--dir", a.dir]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env)
        line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            sys.exit(f"{n} ranks failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        rows.append(json.loads(line[len("RESULT "):]))
        print(rows[-1], flush=True)
    results = os.path.join(HERE, "results")
    with open(os.path.join(results, "checkpoint.json"), "w") as f:
        json.dump({"layers": a.layers, "width": a.width, "rows": rows}, f, indent=1)
    lines = [f"# Checkpoint times ({a.layers} x Linear({a.width}, {a.width}) + Adam, one stage "
             "per CPU rank, medians of 3; `python bench/checkpoint.py`)", "",
             "| ranks | state MiB | largest share MiB | write share s | save s | save / write share "
             "| load s | gathered save s | gathered / sharded |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['ranks']} | {r['total_mib']:.0f} | {r['largest_share_mib']:.0f} | "
                     f"{r['write_share_s']:.3f} | {r['save_s']:.3f} | {r['save_over_write_share']:.2f} | "
                     f"{r['load_s']:.3f} | {r['gathered_save_s']:.3f} | {r['gathered_over_save']:.2f} |")
    with open(os.path.join(results, "checkpoint.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
