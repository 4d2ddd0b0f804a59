"""Training calls with other arguments than the first ([Note: other training arguments] in
python/rannc/module.py): what alternating programs cost. A language model with optional
image features (an MLP over them added to the token embeddings) trains either with images
in every step (one program) or with and without them in turn (two programs, each planned
on its own). Before each call of the second program after a step, the weights it places
on other ranks than their trainers move to it; after its backward, their gradients move
back.

    mpirun -np 2 python bench/other_arguments.py [--layers 4] [--hidden 256] [--steps 8]

Per kind the mean step time (forward, backward, AdamW step), their ratio, and the bytes
the second program moves per step (weights before, gradients after). Writes
bench/results/other_arguments.{json,md} (rank 0).
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(os.path.dirname(HERE), "python")]
import rannc  # noqa: E402


class ImageLM(nn.Module):
    """Tokens, optionally with an image's features added to every position."""

    def __init__(self, vocab, hidden, layers, image_features=512):
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.image = nn.Sequential(nn.Linear(image_features, 4 * hidden), nn.GELU(),
                                   nn.Linear(4 * hidden, hidden))
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(hidden, max(1, hidden // 64), 4 * hidden, dropout=0.0,
                                       batch_first=True) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids, targets, image=None):
        h = self.tok(ids)
        if image is not None:
            h = h + self.image(image).unsqueeze(1)
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


def moved_bytes(wrapped) -> tuple[int, int]:
    """Per step of the second program: the weight bytes sent to its ranks before its call
    and the gradient bytes sent to the trainers after it."""
    placement = wrapped.placement
    key = next(k for k in placement._users if isinstance(k, tuple) and k[0] is True)
    tensors, users = placement.tensors(), placement._users[key]
    weights = sum(placement.full_shape(i, t).numel() * t.element_size() * len(users[i] - trainers)
                  for i, (t, trainers) in enumerate(zip(tensors, placement._trainers))
                  if users[i] - trainers)
    grads = sum(placement.full_shape(i, tensors[i]).numel() * tensors[i].element_size()
                * len(receivers) for i, _, receivers in placement.gradient_routes(key))
    return weights, grads


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4, help="local rows per call")
    ap.add_argument("--length", type=int, default=32)
    ap.add_argument("--steps", type=int, default=8, help="timed steps of each kind")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    a = ap.parse_args()
    torch.set_num_threads(1)
    rank, world = rannc.get_rank(), rannc.get_world_size()
    vocab = 1000
    g = torch.Generator().manual_seed(rank)

    def batch(with_image):
        ids = torch.randint(0, vocab, (a.batch, a.length), generator=g)
        extra = {"image": torch.randn(a.batch, 512, generator=g)} if with_image else {}
        return (ids, ids), extra

    def step(wrapped, opt, with_image):
        args, kwargs = batch(with_image)
        t0 = time.perf_counter()
        wrapped(*args, **kwargs).backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t0

    times, moved = {}, None
    for kind in ("one program", "two programs"):
        torch.manual_seed(0)
        model = ImageLM(vocab, a.hidden, a.layers)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        wrapped = rannc.RaNNCModule(model, opt, num_stages=world)
        alternate = kind == "two programs"
        step(wrapped, opt, True)  # deploy and warm up each program
        if alternate:
            step(wrapped, opt, False)
            moved = moved_bytes(wrapped)
        times[kind] = [step(wrapped, opt, not (alternate and i % 2)) for i in range(a.steps)]
    med = {k: statistics.mean(v) * 1e3 for k, v in times.items()}
    if rank != 0:
        return
    params = sum(p.numel() for p in ImageLM(vocab, a.hidden, a.layers).parameters())
    result = {"model": f"ImageLM {a.layers} layers, hidden {a.hidden} ({params / 1e6:.1f} M "
                       "parameters)",
              "ranks": world, "stages": world, "local_batch": a.batch, "length": a.length,
              "steps": a.steps, "torch": torch.__version__,
              "one_program_step_ms": med["one program"], "two_programs_step_ms": med["two programs"],
              "ratio": med["two programs"] / med["one program"],
              "weight_bytes_per_second_program_step": moved[0],
              "gradient_bytes_per_second_program_step": moved[1]}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "other_arguments.json"), "w") as f:
        json.dump(result, f, indent=1)
    table = "\n".join([
        "# Training calls with other arguments: the cost of two programs",
        "",
        f"`mpirun -np {world} python bench/other_arguments.py --layers {a.layers} --hidden "
        f"{a.hidden} --steps {a.steps}`; {result['model']}, {world} stages, local batch "
        f"{a.batch} x {a.length}, torch {torch.__version__}, CPU ranks.",
        "",
        "| kind | mean step (ms) |",
        "|---|---|",
        f"| images in every step (one program) | {med['one program']:.1f} |",
        f"| with and without images in turn (two programs) | {med['two programs']:.1f} |",
        "",
        f"Ratio {result['ratio']:.3f}. The second program moves "
        f"{moved[0] / 2**20:.2f} MiB of weights before each of its calls and "
        f"{moved[1] / 2**20:.2f} MiB of gradients after it.",
    ])
    with open(os.path.join(a.out, "other_arguments.md"), "w") as f:
        f.write(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
