"""Stages with the autograd graph cut at their boundary, run micro-batch by micro-batch as
a pipeline would (in one process): loss and gradients equal plain PyTorch on the whole
batch; recomputation gives the same gradients as stashing, with dropout active."""
import copy

import pytest
import torch

import rannc
from rannc import _C
import zoo


def run_pipeline(g, model, k, microbatches, args, kwargs, recompute=False, device="cpu"):
    """Forward every micro-batch through k stages, then backward in reverse, as 1F1B
    would; returns the loss (mean over the batch). The model's state and inputs must be
    on `device` already."""
    ir = g.ir
    traced = g._trace.traced
    flat = g._flat_inputs(args, kwargs)
    values = {vid: t for vid, t in zip(ir.inputs, flat)}
    state = {vid: t for vid, t in values.items() if ir.value(vid).role in ("param", "buffer")}
    pieces = ir.split(k)
    stages = [_C.StageExecutor(traced, p, {v: state[v] for v in p.inputs if v in state}, device)
              for p in pieces]
    batch = next(t for vid, t in values.items() if ir.value(vid).role == "input").shape[0]
    bounds = [batch * m // microbatches for m in range(microbatches + 1)]
    (loss_id,) = ir.outputs
    assert ir.value(loss_id).is_loss

    def rows(vid, t, m):
        if ir.value(vid).role == "input" and ir.value(vid).batch_dim == 0:
            return t[bounds[m]:bounds[m + 1]]
        return t

    env = []
    for m in range(microbatches):
        avail = {vid: rows(vid, t, m) for vid, t in values.items() if vid not in state}
        for s in stages:
            outs = s.forward(m, [avail[v] for v in s.input_ids], True, recompute)
            avail.update(zip(s.output_ids, outs))
        env.append(avail)
    loss = sum(env[m][loss_id] * (bounds[m + 1] - bounds[m]) / batch for m in range(microbatches))
    for m in reversed(range(microbatches)):
        grads = {loss_id: torch.tensor((bounds[m + 1] - bounds[m]) / batch, device=device)}
        for s in reversed(stages):
            in_grads = s.backward(m, [grads.get(v) for v in s.output_ids])
            for v, gr in zip(s.input_ids, in_grads):
                if gr is not None:
                    grads[v] = grads[v] + gr if v in grads else gr
    assert all(s.stashed == 0 for s in stages)
    return loss


LAYOUTS = [(1, 1), (2, 2), (3, 4), (4, 3)]


# Batch norm normalises each micro-batch on its own, so the ResNet equals the model only
# without micro-batches (k stages, one micro-batch).
@pytest.mark.parametrize("name,k,microbatches",
                         [(n, k, m) for n in ("mlp", "gpt") for k, m in LAYOUTS]
                         + [("resnet", k, 1) for k in (1, 2, 3, 4)])
def test_pipelined_stages_equal_the_model(name, k, microbatches):
    model, args, kwargs = zoo.make(name, batch=6)
    zoo.no_dropout(model)
    reference = copy.deepcopy(model)
    g = rannc.trace(model, args, kwargs)
    loss = run_pipeline(g, model, k, microbatches, args, kwargs)
    ref = reference(*args, **kwargs)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
    for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_recompute_gives_the_same_gradients_with_dropout(name):
    model, args, kwargs = zoo.make(name, batch=6)  # dropout active
    g = rannc.trace(model, args, kwargs)
    results = []
    for recompute in (False, True):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(11)
        loss = run_pipeline(g, model, 3, 3, args, kwargs, recompute=recompute)
        results.append((loss, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (l0, g0), (l1, g1) = results
    torch.testing.assert_close(l0, l1, rtol=0, atol=0)
    for n in g0:
        torch.testing.assert_close(g0[n], g1[n], rtol=0, atol=0, msg=n)
