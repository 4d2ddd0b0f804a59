"""Stages with the autograd graph cut at their boundary, run micro-batch by micro-batch as
a pipeline would (in one process): loss and gradients equal plain PyTorch on the whole
batch; recomputation gives the same gradients as stashing, with dropout active."""
import copy

import pytest
import torch

import rannc
from rannc import _C
import zoo


def run_pipeline(g, model, k, microbatches, args, kwargs, recompute=False, device="cpu",
                 split=False):
    """Forward every micro-batch through k stages, then backward in reverse, as 1F1B
    would (with `split`, each backward's input part, and the weight parts after all of
    them, as ZB-H1 defers them); returns the loss (mean over the batch). The model's state
    and inputs must be on `device` already."""
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
    deferred = []
    for m in reversed(range(microbatches)):
        grads = {loss_id: torch.tensor((bounds[m + 1] - bounds[m]) / batch, device=device)}
        for s in reversed(stages):
            output_grads = [grads.get(v) for v in s.output_ids]
            in_grads = s.backward_input(m, output_grads) if split else s.backward(m, output_grads)
            deferred.append((s, m))
            for v, gr in zip(s.input_ids, in_grads):
                if gr is not None:
                    grads[v] = grads[v] + gr if v in grads else gr
    if split:
        assert all(s.stashed > 0 for s in stages)  # the weight parts are pending
        for s, m in deferred:
            s.backward_weight(m)
    assert all(s.stashed == 0 for s in stages)
    return loss


LAYOUTS = [(1, 1), (2, 2), (3, 4), (4, 3)]


# Batch norm normalises each micro-batch on its own, so the ResNet equals the model only
# without micro-batches (k stages, one micro-batch).
@pytest.mark.parametrize("name,k,microbatches",
                         [(n, k, m) for n in ("mlp", "gpt") for k, m in LAYOUTS]
                         + [("resnet", k, 1) for k in (1, 2, 3, 4)])
@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
def test_pipelined_stages_equal_the_model(name, k, microbatches, split):
    model, args, kwargs = zoo.make(name, batch=6)
    zoo.no_dropout(model)
    reference = copy.deepcopy(model)
    g = rannc.trace(model, args, kwargs)
    loss = run_pipeline(g, model, k, microbatches, args, kwargs, split=split)
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


def test_the_weight_part_of_a_split_backward_repeats_nothing_of_the_input_part():
    """[Note: split backward]: the weight part restarts where paths to parameters leave
    the paths to the inputs, so no activation function's backward (they have no
    parameters) runs in it; the input part runs them. Measured on the last of 2 stages of
    the MLP (linear, tanh, linear, MSE)."""
    model, args, kwargs = zoo.make("mlp", batch=6)
    zoo.no_dropout(model)
    g = rannc.trace(model, args, kwargs)
    ir, traced = g.ir, g._trace.traced
    values = dict(zip(ir.inputs, g._flat_inputs(args, kwargs)))
    state = {v: t for v, t in values.items() if ir.value(v).role in ("param", "buffer")}
    first, last = [_C.StageExecutor(traced, p, {v: state[v] for v in p.inputs if v in state})
                   for p in ir.split(2)]
    avail = {v: t for v, t in values.items() if v not in state}
    avail.update(zip(first.output_ids, first.forward(0, [avail[v] for v in first.input_ids])))
    last.forward(0, [avail[v] for v in last.input_ids])
    (loss_id,) = ir.outputs
    seed = [torch.tensor(1.0) if v == loss_id else None for v in last.output_ids]

    def ran(fn):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            fn()
        return {e.name.split(": ")[-1] for e in prof.events()
                if e.name.startswith("autograd::engine::evaluate_function")}

    activations = ("TanhBackward", "GeluBackward", "MseLossBackward")
    own = [state[v] for v in last.input_ids + list(ir.split(2)[1].inputs) if v in state]
    input_part = ran(lambda: last.backward_input(0, seed))
    assert own and all(t.grad is None for t in own)  # no parameter gradient yet
    weight_part = ran(lambda: last.backward_weight(0))
    assert all(t.grad is not None for t in own)
    assert any(n.startswith(activations) for n in input_part), input_part
    assert not any(n.startswith(activations) for n in weight_part), weight_part
    # (the input part "evaluates" the inputs' AccumulateGrad only to capture their gradients)
    assert any(n.endswith("AccumulateGrad") for n in weight_part), weight_part
