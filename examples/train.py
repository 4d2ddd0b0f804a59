"""Trains an example model with rannc on CPU (or GPU) ranks.

    mpirun -np 4 python examples/train.py --model gpt [--steps 40 --batch 8 --layers 4 --hidden 64]

Every rank builds the same model and reads its own shard of a synthetic task that can be
learned (GPT: sequences that follow a fixed permutation of the vocabulary; BERT: the same
sequences with masked tokens to recover; ResNet: images whose class is the brightest
channel-quadrant). rannc traces, plans (rank 0 prints the plan) and trains; rank 0 prints
the loss, which falls.
"""
import argparse
import time

import torch

import rannc
from models import BERT, GPT, ResNet, TransformerConfig


def task(model_name, cfg, batch, seq, generator):
    if model_name == "resnet":
        images = torch.rand(batch, 3, 16, 16, generator=generator)
        labels = torch.randint(0, 5, (batch,), generator=generator)
        images[torch.arange(batch), labels % 3, :8, :8] += 1.0 + labels[:, None, None] * 0.2
        return images, labels
    perm = torch.randperm(cfg.vocab, generator=torch.Generator().manual_seed(1234))
    start = torch.randint(0, cfg.vocab, (batch, 1), generator=generator)
    seqs = [start]
    for _ in range(seq):
        seqs.append(perm[seqs[-1]])
    tokens = torch.cat(seqs, dim=1)
    if model_name == "gpt":
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    ids = tokens[:, :-1].clone()
    mask = torch.rand(ids.shape, generator=generator) < 0.2
    labels = torch.where(mask, ids, torch.full_like(ids, -100))
    ids[mask] = 0  # token 0 plays [MASK]
    return ids, labels


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["gpt", "bert", "resnet"], default="gpt")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=8, help="rows per rank")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--stages", type=int, default=0, help="fix the number of stages (0: search)")
    p.add_argument("--microbatches", type=int, default=0)
    a = p.parse_args()
    torch.set_num_threads(1)
    rank, world = rannc.get_rank(), rannc.get_world_size()

    torch.manual_seed(0)  # the same initial model on every rank
    cfg = TransformerConfig(vocab=a.vocab, hidden=a.hidden, heads=4, layers=a.layers,
                            max_len=a.seq, dropout=0.0)
    if a.model == "gpt":
        model = GPT(cfg)
    elif a.model == "bert":
        model = BERT(cfg)
    else:
        model = ResNet(channels=16, blocks=a.layers)
    opt = torch.optim.Adam(model.parameters(), lr=a.lr)
    model = rannc.RaNNCModule(model, opt, num_stages=a.stages, num_microbatches=a.microbatches)

    data = torch.Generator().manual_seed(1000 + rank)  # each rank reads its own shard
    if rank == 0:
        print(f"training {a.model} on {world} rank(s), {a.batch} rows per rank", flush=True)
    start = time.perf_counter()
    for step in range(a.steps):
        x, y = task(a.model, cfg, a.batch, a.seq, data)
        loss = model(x, y)
        loss.backward()
        model.clip_grad_norm(1.0)
        opt.step()
        opt.zero_grad()
        if rank == 0 and (step % 5 == 0 or step == a.steps - 1):
            print(f"step {step:4d}  loss {loss.item():.4f}  "
                  f"({(time.perf_counter() - start) / (step + 1):.3f} s/step)", flush=True)


if __name__ == "__main__":
    main()
