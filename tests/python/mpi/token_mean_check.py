"""Losses averaged over a count the data decides ([Note: token-mean losses] in
csrc/frontend/token_means.h), trained with RaNNCModule in float64 and compared with plain
PyTorch on the concatenated global batch: loss, this rank's gradients and parameters after
each SGD step, all to 1e-10. Exits non-zero on the first mismatch.

    token_mean_check.py CASE --stages S --micro M [--opt key=value ...]

    mlm_nsp   BERT pretraining's loss: cross entropy over the masked tokens (labels -100
              elsewhere; some rows mask none) plus a sentence loss over the rows
    weighted  nn.CrossEntropyLoss with class weights (a buffer) and label smoothing: its mean
              divides by the weights the labels draw
    nll_nd    log_softmax + nll_loss over (N, C, T) scores, ignore_index=0
    teacher   the target comes from a parameter (a teacher's argmax): no count can be made
              before the step, so the shares stay weighted by rows (as DDP does); rank 0
              logs why, and the loss is the rows-weighted mean of the micro-batches

Sums over the batch (option loss_reduction, csrc/ir/reduction.h), added up over the shares:
    items     cross entropy with reduction="sum" divided by the global count of kept labels,
              which the caller passes in (transformers' num_items_in_batch)
    einsum    a sum the graph does not show (einsum), with --opt loss_reduction=sum

A sum divided by a count of the batch (a masked mean written by hand):
    masked    per-token cross entropy (reduction="none") times a float mask, summed, over
              mask.sum().clamp(min=1)
    counted   cross entropy with reduction="sum" over (labels != -100).sum(), an integer
    dot       a weighted mean written torch.dot(per_token, weights) / weights.sum() (read as
              a term of no known kind before session 35: each share divided by its own weights)
    fairseq   fairseq's label-smoothed loss: its nll and smoothing sums weighed by
              eps / (lprobs.size(-1) - 1), over the count of kept labels (the vocabulary's
              size read as a value of the rows: weighted by rows before session 35)

Losses over the tokens a boolean mask selects ([Note: masked losses]):
    selected  cross_entropy(scores.view(-1, V)[active], labels.view(-1)[active]), a mean
    selected_sum  cross_entropy(scores[mask], ids[mask], reduction="sum") over a 2-D mask
    selected_mean  per-token cross entropy (reduction="none")[active].mean()
    mse_selected  mse_loss(scores[..., 0][mask], ids[mask]) over a 2-D mask
    aux       cross entropy plus terms of the embeddings: a mean over rows and a masked sum
              over its count, on stages with other replica counts
    unread    the mean of a function of the selected rows (logsumexp of scores[active]):
              not read as a mask, so weighted by rows like teacher, and rank 0 says why

Terms of several kinds in one loss, added in place ([Note: mixed terms], [Note: scalar
updates]):
    penalty   `loss = ce(sum) / items; loss += 0.01 * weight.pow(2).sum()`: a sum plus a term
              the same for any rows, which the shares must not count once each
    items_aux `loss = ce(sum) / items; loss += 0.1 * h.pow(2).mean()`: a sum plus a mean (a
              router's auxiliary loss next to transformers' num_items_in_batch)
    inplace   mlm_nsp written `loss = ce; loss += ce_sentence; loss += 0.5`: both still
              counted exactly, not glued into one op
    forced_mean  items_aux with --opt loss_reduction=mean: the sum term divided by the rows
    product   a mean plus a product of means (no known reduction, as a router's
              load-balancing loss): a mean weighted by rows, the product term logged

CTC over the labels a mask selects (transformers' Wav2Vec2ForCTC and its kin), read as the
padded form of the same targets ([Note: masked losses]):
    ctc       reduction="sum" (wav2vec2's default): added up over the shares
    ctc_mean  reduction="mean": each row's loss over its target length, weighted by rows
"""
import argparse
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import rannc

ap = argparse.ArgumentParser()
ap.add_argument("case", choices=["mlm_nsp", "weighted", "nll_nd", "teacher", "items", "einsum",
                                    "masked", "counted", "fairseq", "dot",
                                    "selected", "selected_sum", "selected_mean",
                                    "mse_selected", "unread", "aux",
                                    "penalty", "items_aux", "inplace", "forced_mean", "ctc", "ctc_mean",
                                    "product", "shaped", "shaped_selected", "scaled_count"])
ap.add_argument("--stages", type=int, default=1)
ap.add_argument("--micro", type=int, default=2)
ap.add_argument("--steps", type=int, default=3)
ap.add_argument("--opt", nargs="*", default=[])
a = ap.parse_args()
options = dict(o.split("=", 1) for o in a.opt)
rank, world = rannc.get_rank(), rannc.get_world_size()
torch.set_num_threads(1)
VOCAB, HIDDEN, LENGTH, LOCAL = 20, 16, 6, 4


class Model(nn.Module):
    def __init__(self, case):
        super().__init__()
        self.case = case
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.body = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN),
                                  nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh())
        self.tokens = nn.Linear(HIDDEN, VOCAB)
        self.sentence = nn.Linear(HIDDEN, 2)
        self.weighted_loss = nn.CrossEntropyLoss(weight=torch.linspace(0.2, 3.0, VOCAB),
                                                 label_smoothing=0.1)
        self.teacher = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids, labels, next_sentence, items):
        h = self.body(self.emb(ids))
        scores = self.tokens(h)
        if self.case == "mlm_nsp":
            return (F.cross_entropy(scores.view(-1, VOCAB), labels.view(-1))
                    + F.cross_entropy(self.sentence(h[:, 0]), next_sentence))
        if self.case == "weighted":
            return self.weighted_loss(scores.flatten(0, 1), ids.flatten())
        if self.case == "nll_nd":
            return F.nll_loss(F.log_softmax(scores, -1).transpose(1, 2), ids * (labels >= 0),
                              ignore_index=0)
        if self.case == "items":
            return F.cross_entropy(scores.flatten(0, 1), labels.flatten(), reduction="sum") / items
        if self.case == "masked":
            mask = (labels >= 0).float()
            each = F.cross_entropy(scores.flatten(0, 1), labels.clamp(min=0).flatten(), reduction="none")
            return (each * mask.flatten()).sum() / mask.sum().clamp(min=1)
        if self.case == "counted":
            return (F.cross_entropy(scores.flatten(0, 1), labels.flatten(), reduction="sum")
                    / (labels != -100).sum())
        if self.case == "scaled_count":  # the mask's count times the channels
            mask = (labels >= 0).to(scores.dtype)[..., None]
            se = (scores - 0.1 * ids[..., None].to(scores.dtype)) ** 2
            return (se * mask).sum() / (mask.sum().clamp(min=1) * se.shape[-1])
        if self.case in ("shaped", "shaped_selected"):  # an inpainting loss over the masked
            # positions of every channel: counts written over the shape of what the model made
            mask = (labels >= 0).to(scores.dtype)[..., None]  # [B, T, 1]
            se = (scores - 0.1 * ids[..., None].to(scores.dtype)) ** 2  # [B, T, V]
            if self.case == "shaped_selected":
                return se[mask.expand_as(se).bool()].mean()
            return ((se * mask).sum() / mask.expand_as(se).sum().clamp(min=1)
                    + (se * mask).sum() / (mask * torch.ones_like(se)).sum().clamp(min=1))
        if self.case == "dot":
            each = F.cross_entropy(scores.flatten(0, 1), labels.clamp(min=0).flatten(), reduction="none")
            w = ((labels.flatten() >= 0) * (1 + ids.flatten() % 3)).to(each.dtype)
            return torch.dot(each, w) / w.sum()
        if self.case == "fairseq":
            lprobs = F.log_softmax(scores, -1).view(-1, scores.size(-1))
            target = labels.view(-1, 1)
            pad = target.eq(-100)
            nll = -lprobs.gather(-1, target.masked_fill(pad, 0)).masked_fill(pad, 0.0)
            smooth = -lprobs.sum(-1, keepdim=True).masked_fill(pad, 0.0)
            eps_i = 0.1 / (lprobs.size(-1) - 1)
            return ((1.0 - 0.1 - eps_i) * nll.sum() + eps_i * smooth.sum()) / target.ne(-100).sum()
        if self.case == "selected":
            active = labels.view(-1) >= 0
            return F.cross_entropy(scores.view(-1, VOCAB)[active], labels.view(-1)[active])
        if self.case == "selected_sum":
            mask = ids % 3 != 0
            return F.cross_entropy(scores[mask], ids[mask], reduction="sum")
        if self.case == "selected_mean":
            active = labels.view(-1) >= 0
            each = F.cross_entropy(scores.view(-1, VOCAB), labels.clamp(min=0).view(-1), reduction="none")
            return each[active].mean()
        if self.case == "mse_selected":
            mask = labels >= 0
            return F.mse_loss(scores[..., 0][mask], ids.to(scores.dtype)[mask])
        if self.case == "unread":
            return scores.view(-1, VOCAB)[labels.view(-1) >= 0].logsumexp(-1).mean()
        if self.case == "aux":
            e = self.emb(ids)
            aux = e.pow(2).mean() + (e.sum(-1) * (labels >= 0)).sum() / (labels >= 0).sum().clamp(min=1)
            return F.cross_entropy(scores.view(-1, VOCAB), labels.view(-1)) + 0.1 * aux
        if self.case == "penalty":
            loss = F.cross_entropy(scores.flatten(0, 1), labels.flatten(), reduction="sum") / items
            loss += 0.01 * self.tokens.weight.pow(2).sum()
            return loss
        if self.case in ("items_aux", "forced_mean"):
            loss = F.cross_entropy(scores.flatten(0, 1), labels.flatten(), reduction="sum") / items
            loss += 0.1 * h.pow(2).mean()
            return loss
        if self.case == "product":
            return F.mse_loss(scores[..., 0], ids.to(scores.dtype) / VOCAB) + 0.1 * h.mean() * h.pow(2).mean()
        if self.case == "inplace":
            loss = F.cross_entropy(scores.view(-1, VOCAB), labels.view(-1))
            loss += F.cross_entropy(self.sentence(h[:, 0]), next_sentence)
            loss += 0.5
            return loss
        if self.case in ("ctc", "ctc_mean"):
            mask = (labels >= 0) & (labels != 0)  # blank (0) is never a target
            log_probs = F.log_softmax(scores, -1).transpose(0, 1)
            return F.ctc_loss(log_probs, labels.masked_select(mask), (ids >= 0).sum(-1), mask.sum(-1),
                              reduction="sum" if self.case == "ctc" else "mean", zero_infinity=True)
        if self.case == "einsum":
            return torch.einsum("btv,btv->", scores, scores) / 100
        target = torch.where(labels >= 0, self.teacher(self.emb(ids)).argmax(-1), labels)
        return F.cross_entropy(scores.flatten(0, 1), target.flatten())


def global_batch(step):
    g = torch.Generator().manual_seed(step)
    n = LOCAL * world
    ids = torch.randint(0, VOCAB, (n, LENGTH), generator=g)
    masked = torch.rand(ids.shape, generator=g) < 0.3
    masked[::3] = False  # rows that mask nothing: the count differs between shares
    labels = torch.where(masked, ids, torch.full_like(ids, -100))
    # the count of the global batch's kept labels, the same on every rank
    items = (labels != -100).sum().double()
    return ids, labels, torch.randint(0, 2, (n,), generator=g), items


torch.manual_seed(0)
model = Model(a.case).double()
reference = copy.deepcopy(model)
opt = torch.optim.SGD(model.parameters(), lr=0.5)
ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
wrapped = rannc.RaNNCModule(model, opt, num_stages=a.stages, num_microbatches=a.micro, **options)
mine = slice(LOCAL * rank, LOCAL * (rank + 1))
names = {id(p): n for n, p in model.named_parameters()}
ref_params = dict(reference.named_parameters())


# fairseq's eps_i is Python arithmetic on a size, which the trace computes on a 0-dim
# float32 tensor (the tracer's NumToTensor), PyTorch in double: 1e-8 apart, as
# torch.jit.trace of the model is; weighted by rows instead of the count, it was 3% off
RTOL, ATOL = (1e-7, 1e-9) if a.case == "fairseq" else (1e-10, 1e-12)


def close(x, y, what):
    torch.testing.assert_close(x.detach(), y.detach(), rtol=RTOL, atol=ATOL,
                               msg=lambda m: f"rank {rank}: {what}: {m}")


def rows_weighted_reference(batch):
    """The mean of the micro-batches' losses weighted by their rows (one rank: halves)."""
    assert world == 1
    cuts = torch.tensor_split(torch.arange(LOCAL), a.micro)
    return sum(reference(*(t[c] for t in batch[:3]), batch[3]) * len(c) / LOCAL for c in cuts)


for step in range(a.steps):
    batch = global_batch(step)
    loss = wrapped(*(t[mine] for t in batch[:3]), batch[3])
    by_rows = a.case in ("teacher", "unread", "product")
    ref_loss = rows_weighted_reference(batch) if by_rows else reference(*batch)
    close(loss, ref_loss, f"loss at step {step}")
    loss.backward()
    ref_loss.backward()
    for p in model.parameters():
        if p.grad is not None:  # this rank's stage
            ref_grad = ref_params[names[id(p)]].grad  # None: no gradient reaches it (the teacher)
            close(p.grad, ref_grad if ref_grad is not None else torch.zeros_like(p.grad),
                  f"gradient of {names[id(p)]} at step {step}")
    for o in (opt, ref_opt):
        o.step()
        o.zero_grad()
    for p in model.parameters():
        if p.numel():
            close(p, ref_params[names[id(p)]], f"{names[id(p)]} after step {step}")
    if rank == 0:
        print(f"step {step}: loss {loss.item():.12f} (reference {ref_loss.item():.12f})", flush=True)

means = wrapped._deployed[True].engine.token_means
expected = {"teacher": 0, "mlm_nsp": 2, "aux": 2, "items": 0, "einsum": 0, "selected_sum": 0, "unread": 0,
            "penalty": 0, "items_aux": 0, "inplace": 2, "forced_mean": 0, "ctc": 0, "ctc_mean": 0,
            "product": 0, "shaped": 2}.get(a.case, 1)
assert len(means["exact"]) == expected, means
# [Note: mixed terms]: the terms scaled by the share's rows (1) or divided by them (-1)
scaled = {"penalty": [1], "items_aux": [1], "forced_mean": [-1]}.get(a.case, [])
assert sorted(power for _, power in means["scaled_terms"]) == scaled, means
if a.case == "teacher":
    assert any("its target depends on '" in why for why in means["row_weighted"]), means
if a.case == "unread":
    assert any("a boolean mask selects" in why for why in means["row_weighted"]), means
if a.case == "product":
    assert len(means["unknown_terms"]) == 1 and "aten::mul" in means["unknown_terms"][0], means
print(f"OK rank {rank}", flush=True)
