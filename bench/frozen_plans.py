"""Plans of a model whose base is frozen (PEFT's LoRA) against the same model with every
parameter trained: what the planner charged a LoRA model before session 32, when frozen
parameters were counted with a gradient and optimizer state ([Note: frozen parameters'
memory] in csrc/partition/cost/cost_model.h).

    python bench/frozen_plans.py [--layers 24 --hidden 1024 --seq 128 --world 8 --memory 4GiB]

A transformers GPT-2 built on the meta device (rannc.empty_weights()), planned from shapes
(cost_model="analytic") for `--world` devices of `--memory` each, AdamW. Writes
bench/results/frozen_plans.{json,md}: per case, the stages, replicas, micro-batches, the
predicted iteration time and the largest stage memory.
"""
import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))
import rannc  # noqa: E402


def build(args, lora: bool):
    import transformers as tf
    cfg = tf.GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=args.hidden // 64,
                        n_positions=max(args.seq, 128), vocab_size=50257, use_cache=False)
    with rannc.empty_weights():
        model = tf.GPT2LMHeadModel(cfg)
    if lora:
        import peft
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=16, target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True))
    return model


def plan(args, lora: bool) -> dict:
    model = build(args, lora)
    params = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    ids = torch.zeros(args.world, args.seq, dtype=torch.long)
    start = time.perf_counter()
    p = rannc.plan(model, (), dict(input_ids=ids, labels=ids), world_size=args.world,
                   device_memory=args.memory, cost_model="analytic", optimizer="adam")
    d = p.deployment
    return {"case": "LoRA (frozen base)" if lora else "every parameter trained",
            "parameters": params, "trained": trained, "stages": d.num_stages,
            "replicas": [len(s.ranks) // d.pipelines for s in d.stages],
            "pipelines": d.pipelines, "micro_batches": d.micro_batches,
            "iteration_ms": d.iteration_time * 1e3, "feasible": d.feasible,
            "max_stage_memory_gib": max(s.memory_bytes for s in d.stages) / 2**30,
            "plan_s": time.perf_counter() - start}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--memory", default="4GiB")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    rows = [plan(args, lora=False), plan(args, lora=True)]
    head = (f"GPT-2 {args.layers} layers, hidden {args.hidden}, {args.seq} tokens, one row per "
            f"device, {args.world} devices of {args.memory}, AdamW, analytic costs")
    lines = [f"# Frozen parameters in the plan\n\n{head}\n",
             "| case | parameters | trained | stages | replicas | pipelines | micro-batches | "
             "predicted iteration ms | largest stage GiB | feasible |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['parameters'] / 1e6:.1f} M | {r['trained'] / 1e6:.2f} M | "
                     f"{r['stages']} | {r['replicas']} | {r['pipelines']} | {r['micro_batches']} | "
                     f"{r['iteration_ms']:.1f} | {r['max_stage_memory_gib']:.2f} | {r['feasible']} |")
    lines.append(f"\nratio of predicted iteration times (every parameter trained / LoRA): "
                 f"{rows[0]['iteration_ms'] / rows[1]['iteration_ms']:.2f}")
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "frozen_plans.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "frozen_plans.json"), "w") as f:
        json.dump({"setup": head, "cases": rows}, f, indent=1)


if __name__ == "__main__":
    main()
