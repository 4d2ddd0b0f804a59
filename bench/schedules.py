"""Schedules measured: the GPT of bench/runtime.py on 2 CPU ranks, trained with
schedule=1f1b and schedule=zb_h1 over 2 stages and schedule=interleaved over 4 stages (2
chunks per rank), at the same micro-batch count, each against the plan's prediction.

    python bench/schedules.py [--repeats 20] [--rounds 2] [--micro 4]

The schedules alternate (rounds) in one run, as the machine is shared and noisy: read
the ratios. Over copy in/out unless CMA works (bench/runtime.py, single_copy_works).
Writes bench/results/schedules.{json,md}.
"""
import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import runtime  # noqa: E402  (bench/runtime.py: the model, the worker, mpirun)

SCHEDULES = {"1f1b": 2, "zb_h1": 2, "interleaved": 4}  # schedule: stages on the 2 ranks


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    a = ap.parse_args()
    cma = runtime.single_copy_works()
    runs = {s: [] for s in SCHEDULES}
    for _ in range(a.rounds):
        for s in SCHEDULES:
            runs[s].append(runtime.launch(2, SCHEDULES[s], a.repeats, single_copy=cma, RANNC_SCHEDULE=s,
                                          RANNC_NUM_MICROBATCHES=str(a.micro)))
    rows = []
    for s in SCHEDULES:
        measured = statistics.median(r["measured_step_s"] for r in runs[s])
        predicted = statistics.median(r["predicted_iteration_s"] for r in runs[s])
        rows.append(dict(schedule=s, stages=SCHEDULES[s], micro_batches=runs[s][0]["micro_batches"],
                         measured_step_s=measured, predicted_iteration_s=predicted,
                         measured_over_predicted=measured / predicted,
                         transport=runs[s][0]["transport"]))
    one = rows[0]
    summary = dict(rows=rows)
    for r in rows[1:]:
        summary[f"{r['schedule']}_over_1f1b_measured"] = r["measured_step_s"] / one["measured_step_s"]
        summary[f"{r['schedule']}_over_1f1b_predicted"] = r["predicted_iteration_s"] / one["predicted_iteration_s"]
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "schedules.json"), "w") as f:
        json.dump(summary, f, indent=2)
    lines = ["| schedule | stages | M | measured step | predicted | measured / predicted |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['schedule']} | {r['stages']} | {r['micro_batches']} | "
                     f"{r['measured_step_s'] * 1e3:.1f} ms | {r['predicted_iteration_s'] * 1e3:.1f} ms | "
                     f"{r['measured_over_predicted']:.3f} |")
    lines.append("")
    for r in rows[1:]:
        name = r["schedule"]
        lines.append(f"{name} / 1f1b: measured {summary[name + '_over_1f1b_measured']:.3f}, predicted "
                     f"{summary[name + '_over_1f1b_predicted']:.3f} ({one['transport']}, 2 CPU ranks)")
    text = "\n".join(lines)
    with open(os.path.join(a.out, "schedules.md"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
