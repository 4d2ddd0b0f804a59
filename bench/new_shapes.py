"""What a new input shape costs ([Note: new input shapes] in python/rannc/deployed.py): a
transformers BERT trained with sequences whose length changes between calls (dynamic
padding). The first call at each new length traces the model again and runs the plan made
at the first length; later calls at that length are ordinary steps. Plain PyTorch runs the
same batches in the same process, steps alternating.

    python bench/new_shapes.py [--layers 4] [--hidden 768] [--batch 8] [--lengths 128,64,96,128,64]
    mpirun -np 2 python bench/new_shapes.py --stages 2      # the same on 2 ranks

Per length: plain PyTorch's step (median), rannc's steady step (median) and their ratio,
rannc's first call at that length and what it costs above a steady step (the new trace,
once per length). Writes bench/results/new_shapes.{json,md} (rank 0).
"""
import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [os.path.join(ROOT, "python")]
import rannc  # noqa: E402


def bert(layers, hidden, max_len):
    import transformers as tf
    tf.logging.set_verbosity_error()
    cfg = tf.BertConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=4 * hidden,
                        num_attention_heads=max(1, hidden // 64), max_position_embeddings=max_len,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    return tf.BertForMaskedLM(cfg)


def batch(rows, length, seed, vocab=30522):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, length), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def step(model, opt, kwargs):
    t0 = time.perf_counter()
    loss = model(**kwargs).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--batch", type=int, default=8, help="local rows per call")
    ap.add_argument("--lengths", default="128,64,96,128,64", help="one length per phase")
    ap.add_argument("--steps", type=int, default=3, help="steady steps per phase")
    ap.add_argument("--stages", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    a = ap.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, rannc.get_world_size())))
    rank = rannc.get_rank()
    lengths = [int(n) for n in a.lengths.split(",")]
    model = bert(a.layers, a.hidden, max(lengths))
    plain = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-4)
    wrapped = rannc.RaNNCModule(model, opt, num_stages=a.stages)

    rows, seen = [], set()
    for phase, length in enumerate(lengths):
        seed = 1000 * phase
        first = step(wrapped, opt, batch(a.batch, length, seed + rank))
        ours, theirs = [], []
        for s in range(a.steps):
            kwargs = batch(a.batch, length, seed + 10 * (s + 1) + rank)
            theirs.append(step(plain, plain_opt, kwargs))
            ours.append(step(wrapped, opt, kwargs))
        ours_ms, theirs_ms = statistics.median(ours) * 1e3, statistics.median(theirs) * 1e3
        rows.append({"length": length, "new": length not in seen, "plain_ms": theirs_ms,
                     "rannc_ms": ours_ms, "ratio": ours_ms / theirs_ms, "first_call_ms": first * 1e3,
                     "first_call_extra_ms": first * 1e3 - ours_ms})
        seen.add(length)
        if rank == 0:
            r = rows[-1]
            print(f"length {length:4d} ({'new' if r['new'] else 'seen'}): plain {theirs_ms:8.1f} ms, "
                  f"rannc {ours_ms:8.1f} ms ({r['ratio']:.3f}), first call {r['first_call_ms']:8.1f} ms "
                  f"(+{r['first_call_extra_ms']:.1f} ms)", flush=True)
    if rank != 0:
        return
    later_new = [r for r in rows[1:] if r["new"]]
    result = {"model": f"transformers BertForMaskedLM, {a.layers} layers, hidden {a.hidden}",
              "local_batch": a.batch, "ranks": rannc.get_world_size(), "stages": a.stages,
              "phases": rows,
              "new_shape_extra_over_plain_step": statistics.median(
                  r["first_call_extra_ms"] / r["plain_ms"] for r in later_new) if later_new else None}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "new_shapes.json"), "w") as f:
        json.dump(result, f, indent=2)
    lines = [f"# New input shapes: {result['model']}, {a.batch} rows per rank, "
             f"{result['ranks']} rank(s), {a.stages} stage(s)", "",
             "`python bench/new_shapes.py " + " ".join(sys.argv[1:]) + "`", "",
             "| length | shape | plain step ms | rannc step ms | ratio | first call ms | first call extra ms |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['length']} | {'new' if r['new'] else 'seen'} | {r['plain_ms']:.1f} | "
                     f"{r['rannc_ms']:.1f} | {r['ratio']:.3f} | {r['first_call_ms']:.1f} | "
                     f"{r['first_call_extra_ms']:.1f} |")
    if later_new:
        lines += ["", f"A new length after the first costs {result['new_shape_extra_over_plain_step']:.2f} "
                  "plain steps once (median over the new lengths after the first call)."]
    with open(os.path.join(a.out, "new_shapes.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
