"""Draws each pipeline schedule as a timeline from the simulator's events (the same
schedule lists and simulator the planner and the runtime use), one PNG per schedule, for
docs/partition.md ("Schedules"). Needs matplotlib (`pip install matplotlib`).

    python bench/schedule_timelines.py [--devices 4] [--micro-batches 8] [--out docs/images]

Stage times are uniform and in units of one forward: F = 1, a backward B = 2 of which the
weight part W = 1 (a linear layer's backward is two matrix products of the forward's
size), sends 0.05. Interleaved 1F1B cuts the same model into 2 chunks per device, each
stage half as long (lighter boxes: chunk 1). The title gives the iteration time and the
bubble, the fraction of the devices' time spent idle.
"""
import argparse
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))
from rannc import _C  # noqa: E402

# (option value, title, chunks per device)
SCHEDULES = [("fill_drain", "fill-drain (GPipe)", 1), ("1f1b", "1F1B", 1), ("zb_h1", "ZB-H1", 1),
             ("interleaved", "interleaved 1F1B, 2 chunks per device", 2)]
COLOURS = {"F": "#4c72b0", "B": "#55a868", "Bi": "#55a868", "W": "#dd8452"}


def draw(kind, title, devices, micro_batches, chunks, out_dir):
    stage = {"forward": 1.0 / chunks, "backward": 2.0 / chunks, "weight": 1.0 / chunks,
             "send_forward": 0.05, "send_backward": 0.05}
    timeline, iteration = _C.simulate_timeline(kind, [stage] * (devices * chunks), micro_batches, chunks)
    busy = sum(end - start for actions in timeline for *_, start, end in actions)
    bubble = 1.0 - busy / (devices * iteration)
    fig, ax = plt.subplots(figsize=(12, 0.5 * devices + 1.2))
    for i, actions in enumerate(timeline):
        for name, m, chunk, start, end in actions:
            ax.broken_barh([(start, end - start)], (i - 0.4, 0.8), facecolors=COLOURS[name],
                           edgecolors="white", linewidth=0.8, alpha=1.0 if chunk == 0 else 0.6)
            ax.text((start + end) / 2, i, f"{name}{m}", ha="center", va="center",
                    fontsize=7 if chunks == 1 else 5, color="white" if chunk == 0 else "black")
    label = "stage" if chunks == 1 else "device"
    ax.set_yticks(range(devices), [f"{label} {i}" for i in range(devices)])
    ax.invert_yaxis()
    ax.set_xlim(0, iteration)
    ax.set_xlabel("time (one forward = 1)")
    ax.set_title(f"{title}: {devices} devices, {micro_batches} micro-batches, iteration {iteration:.2f}, "
                 f"bubble {bubble:.1%}")
    fig.tight_layout()
    path = os.path.join(out_dir, f"schedule_{kind}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path, iteration, bubble


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "images"))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    for kind, title, chunks in SCHEDULES:
        path, iteration, bubble = draw(kind, title, a.devices, a.micro_batches, chunks, a.out)
        print(f"{kind:>10}: iteration {iteration:6.2f}, bubble {bubble:6.1%}  -> {os.path.relpath(path, ROOT)}")


if __name__ == "__main__":
    main()
