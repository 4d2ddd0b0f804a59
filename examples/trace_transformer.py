"""Traces a GPT-style transformer into rannc's IR and prints what rannc sees.

    python examples/trace_transformer.py [--layers 4 --hidden 64 --batch 8 --seq 32 --pieces 4]

It prints the IR summary (tasks, values, parameters, batch values), checks that the IR
run whole and cut into convex pieces gives the model's loss and gradients, and lists the
pieces. Later this becomes a training run under mpirun.
"""
import argparse
import time

import torch

import rannc
from models import GPT, TransformerConfig


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--pieces", type=int, default=4)
    a = p.parse_args()

    torch.manual_seed(0)
    model = GPT(TransformerConfig(vocab=a.vocab, hidden=a.hidden, heads=a.heads, layers=a.layers,
                          max_len=a.seq, dropout=0.0))
    ids = torch.randint(0, a.vocab, (a.batch, a.seq))
    targets = torch.randint(0, a.vocab, (a.batch, a.seq))

    start = time.perf_counter()
    g = rannc.trace(model, (ids, targets))
    print(f"traced in {time.perf_counter() - start:.2f} s")
    print(g.summary())

    # The IR runs like the model, whole and in pieces, at another batch size too.
    half = a.batch // 2 or 1
    for name, fn in (("whole graph", g), (f"{a.pieces} pieces", g.split(a.pieces))):
        model.zero_grad()
        loss = fn(ids[:half], targets[:half])
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        ref = model(ids[:half], targets[:half])
        ref.backward()
        same = loss.item() == ref.item() and all(
            torch.equal(x, p.grad) for x, p in zip(grads, model.parameters()))
        print(f"{name:>12}: loss {loss.item():.6f} (model {ref.item():.6f}), "
              f"gradients {'identical' if same else 'DIFFER'}")
        if not same:
            raise SystemExit("the IR does not reproduce the model")

    ir = g.ir
    print(f"\n{a.pieces} convex pieces in topological order:")
    for i, piece in enumerate(g.split(a.pieces).pieces):
        scopes = sorted({ir.task(t).scope.split(".")[0] + "." + ir.task(t).scope.split(".")[1]
                         if ir.task(t).scope.count(".") else ir.task(t).scope or "<root>"
                         for t in piece.tasks})
        print(f"  piece {i}: {len(piece.tasks):4d} tasks, {len(piece.inputs):3d} inputs, "
              f"{len(piece.outputs):2d} outputs; modules {', '.join(scopes)}")


if __name__ == "__main__":
    main()
