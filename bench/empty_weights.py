"""Host memory per rank of a model that never exists whole ([Note: models built on the meta
device] in python/rannc/placement.py): a GPT built with `rannc.empty_weights()` and its
weights read with `load_checkpoint`, against the same model built on the CPU on every rank
as usual. Each run trains two steps, evaluates once (a new mode: traced from stand-ins, no
rank gathers the model) and trains once at a new sequence length (new shapes, the same).

    python bench/empty_weights.py [--ranks 4] [--layers 8] [--hidden 1024]

Per rank and way of building: the peak resident memory above what the process held after
importing torch and rannc (VmHWM - VmRSS at start, from /proc), the bytes of the
parameters the rank holds, and the difference of the peaks against the bytes of the
parameters a rank holds beyond its share when the model is built on the CPU. Writes
bench/results/empty_weights.{json,md}.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [os.path.join(ROOT, "python"), os.path.join(ROOT, "examples")]


def status_kib(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def build(a):
    from models import GPT, TransformerConfig
    torch.manual_seed(0)
    cfg = TransformerConfig(vocab=512, hidden=a.hidden, heads=max(1, a.hidden // 64),
                            layers=a.layers, max_len=64, dropout=0.0)
    return GPT(cfg)


def batch(rows, length, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 512, (rows, length), generator=g)
    return ids, ids


def worker(a):
    import rannc
    torch.set_num_threads(1)
    start = status_kib("VmRSS")
    rank = rannc.get_rank()
    if a.worker == "empty":
        with rannc.empty_weights():
            model = build(a)
    else:
        model = build(a)
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    wrapped = rannc.RaNNCModule(model, opt, num_stages=a.ranks, num_microbatches=2)
    if a.worker == "empty":
        wrapped.load_checkpoint(a.checkpoint)
    for step in range(2):
        wrapped(*batch(2, 32, step)).backward()
        opt.step()
        opt.zero_grad()
    wrapped.eval()
    with torch.no_grad():
        wrapped(*batch(2, 32, 10))
    wrapped.train()
    wrapped(*batch(2, 48, 11)).backward()
    opt.step()
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    peak = status_kib("VmHWM") - start
    from rannc.transport import all_gather_objects
    rows = all_gather_objects({"rank": rank, "peak_mib": peak / 1024, "held_mib": held / 2**20,
                               "whole_mib": whole / 2**20})
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump(rows, f)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--worker", choices=["built", "empty"])
    ap.add_argument("--checkpoint")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        a.checkpoint = os.path.join(tmp, "gpt.pt")
        torch.save(build(a).state_dict(), a.checkpoint)
        env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                   OMP_NUM_THREADS="1", RANNC_LOG_LEVEL="warn")
        for way in ("built", "empty"):
            out = os.path.join(tmp, f"{way}.json")
            cmd = ["mpirun", "--oversubscribe", "-np", str(a.ranks), sys.executable, __file__,
                   "--worker", way, "--checkpoint", a.checkpoint, "--out", out,
                   "--ranks", str(a.ranks), "--layers", str(a.layers), "--hidden", str(a.hidden)]
            subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
            with open(out) as f:
                results[way] = json.load(f)
    whole = results["built"][0]["whole_mib"]
    lines = [f"# Host memory per rank (`python bench/empty_weights.py --ranks {a.ranks} "
             f"--layers {a.layers} --hidden {a.hidden}`)", "",
             f"GPT, {a.layers} layers, hidden {a.hidden}: parameters {whole:.1f} MiB; one stage "
             "per rank, Adam; two training steps, an eval call, a step at a new length. Peak: "
             "resident memory above the process's after importing torch and rannc. A rank's "
             "training state is about 4x the parameters it holds (weights, gradients, Adam's "
             "two moments); built on the CPU, the whole model comes on top. The difference of "
             "the peaks against the parameters the built model holds beyond the rank's share "
             "shows whether any whole copy remains.", "",
             "| rank | parameters held MiB | built on the CPU: peak MiB | empty_weights + "
             "load_checkpoint: peak MiB | built - empty MiB | whole - held MiB |",
             "|---|---|---|---|---|---|"]
    for built, empty in zip(results["built"], results["empty"]):
        lines.append(f"| {built['rank']} | {empty['held_mib']:.1f} | {built['peak_mib']:.1f} | "
                     f"{empty['peak_mib']:.1f} | {built['peak_mib'] - empty['peak_mib']:.1f} | "
                     f"{whole - empty['held_mib']:.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "empty_weights.json"), "w") as f:
        json.dump({"args": vars(a), "whole_mib": whole, **results}, f, indent=1)
    with open(os.path.join(HERE, "results", "empty_weights.md"), "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
