"""The traced IR runs exactly like the model: outputs and gradients of every parameter
and input, at the traced batch size and another, whole and cut into convex pieces."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree

import rannc
import zoo

EXACT = dict(rtol=0, atol=0)  # the interpreter runs the same aten ops as eager PyTorch


def _with_grad_inputs(args, kwargs):
    """Copies of the arguments whose float tensors require grad."""
    def prep(x):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.detach().clone().requires_grad_(True)
        return x
    return pytree.tree_map(prep, (args, kwargs))


def run(fn, model, args, kwargs, seed=123):
    """Runs fn (the model or its traced graph), backpropagates a weighted sum of all float
    outputs, and returns outputs, parameter grads, input grads and buffers."""
    model.zero_grad(set_to_none=True)
    args, kwargs = _with_grad_inputs(args, kwargs)
    torch.manual_seed(seed)
    out = fn(*args, **kwargs)
    leaves = [t for t in pytree.tree_leaves(out)
              if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
    gen = torch.Generator().manual_seed(7)
    total = sum((t * torch.randn(t.shape, generator=gen)).sum() for t in leaves)
    total.backward()
    in_grads = [t.grad for t in pytree.tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor) and t.requires_grad]
    grads = {n: p.grad for n, p in model.named_parameters()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    return pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out), \
        grads, in_grads, buffers


def assert_same(a, b):
    out_a, grads_a, in_a, buf_a = a
    out_b, grads_b, in_b, buf_b = b
    assert pytree.tree_structure(out_a) == pytree.tree_structure(out_b)
    torch.testing.assert_close(out_a, out_b, **EXACT)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        assert grads_a[name] is not None, f"no gradient for {name}"
        torch.testing.assert_close(grads_a[name], grads_b[name], **EXACT, msg=name)
    assert len(in_a) == len(in_b)  # integer inputs (token ids) have no gradient
    for x, y in zip(in_a, in_b):
        torch.testing.assert_close(x, y, **EXACT)
    torch.testing.assert_close(buf_a, buf_b, **EXACT)


@pytest.fixture(params=zoo.NAMES)
def zoo_entry(request):
    model, args, kwargs = zoo.make(request.param, batch=4)
    return request.param, model, args, kwargs


@pytest.mark.parametrize("batch", [4, 3, 6])
def test_graph_equals_model_at_any_batch_size(zoo_entry, batch):
    name, model, args, kwargs = zoo_entry
    reference = copy.deepcopy(model)
    g = rannc.trace(model, args, kwargs)
    _, args_b, kwargs_b = zoo.make(name, batch=batch, seed=1)
    assert_same(run(g, model, args_b, kwargs_b), run(reference, reference, args_b, kwargs_b))
    # twice: buffers (batch-norm statistics) keep evolving the same way
    assert_same(run(g, model, args_b, kwargs_b, seed=5),
                run(reference, reference, args_b, kwargs_b, seed=5))


@pytest.mark.parametrize("k", [2, 3, 4])
def test_split_graph_equals_model(zoo_entry, k):
    name, model, args, kwargs = zoo_entry
    reference = copy.deepcopy(model)
    g = rannc.trace(model, args, kwargs)
    split = g.split(k)
    assert len(split) == k
    covered = sorted(t for p in split.pieces for t in p.tasks)
    assert covered == list(range(g.ir.num_tasks))
    for p in split.pieces:
        assert g.ir.is_convex(p.tasks)
    for batch in (4, 5):
        _, args_b, kwargs_b = zoo.make(name, batch=batch, seed=2)
        assert_same(run(split, model, args_b, kwargs_b),
                    run(reference, reference, args_b, kwargs_b))


class ReadsTwice(nn.Module):
    """Ops that take one value as two of their arguments: x * x, add(x, x), a square
    matmul with itself, and where(m, x, x) (once they failed: a task reads each value
    once, and the op popped an argument that was never pushed)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        h = self.lin(x)
        sq = h * h + torch.add(h, h)
        gram = torch.matmul(h.unsqueeze(2), h.unsqueeze(1))  # [b, 6, 6]
        pick = torch.where(h > 0, sq, sq)
        return pick.sum(1) + torch.matmul(gram, gram).sum((1, 2))


@pytest.mark.parametrize("batch", [4, 3])
def test_an_op_that_reads_one_value_twice_runs_like_the_model(batch):
    torch.manual_seed(0)
    model = ReadsTwice()
    reference = copy.deepcopy(model)
    g = rannc.trace(model, (torch.randn(4, 6),))
    x = torch.randn(batch, 6)
    assert_same(run(g, model, (x,), {}), run(reference, reference, (x,), {}))
    split = g.split(2)
    assert_same(run(split, model, (x,), {}), run(reference, reference, (x,), {}))


class WritesInPlace(nn.Module):
    """In-place writes as models make them: a bias added into a fresh result (ConvBERT,
    MobileBERT), an in-place ReLU, a value read before it is written, and a copy into a
    slice of a zeros buffer."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(8, 4)
        self.bias = nn.Parameter(torch.randn(4))

    def forward(self, x):
        h = self.a(x)
        h += self.bias
        before = h * 2          # reads h before the write below
        torch.relu_(h)
        out = h.new_zeros(h.size(0), 8)
        out[:, 4:] = before
        out[:, :4] = h
        return self.b(out).sum(1)


def test_a_value_written_in_place_never_leaves_the_task_of_its_producer_and_readers():
    """[Note: in-place writes] in csrc/frontend/convert.cpp: a stage would receive the value
    as a leaf that requires grad, which no op may write into, and readers before the write
    could be ordered after it."""
    torch.manual_seed(0)
    model = WritesInPlace()
    reference = copy.deepcopy(model)
    g = rannc.trace(model, (torch.randn(4, 4),))
    ops = [g.ir.task(t).op for t in range(g.ir.num_tasks)]
    written = [op for op in ops if any(p in ("aten::add_", "aten::relu_", "aten::copy_")
                                       for p in op.split("+"))]
    assert written and all("+" in op for op in written), ops
    x = torch.randn(3, 4)
    for k in range(1, g.ir.num_tasks + 1):
        assert_same(run(g.split(k), model, (x,), {}), run(reference, reference, (x,), {}))
    plan = rannc.plan(model, (torch.randn(4, 4),), world_size=2, device_memory="1GiB",
                      num_stages=2, profile_warmup=0, profile_repetitions=1)
    assert plan.deployment.num_stages == 2


def same_outputs_and_gradients(g, model, args, atol):
    """The traced graph's outputs and parameter gradients (run) equal the model's."""
    mine, ref = run(g, model, args, {}), run(model, model, args, {})
    torch.testing.assert_close(mine[0], ref[0], rtol=1e-6, atol=atol)
    for name in ref[1]:
        torch.testing.assert_close(mine[1][name], ref[1][name], rtol=1e-5, atol=atol, msg=name)


class MaskedTokenLoss(nn.Module):
    """A loss over the tokens a boolean mask selects, as older transformers' token
    classification wrote it; `how` varies what may be read as ignore_index targets."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.emb = nn.Embedding(12, 8)
        self.head = nn.Linear(8, 5)

    def forward(self, ids, labels, attention):
        logits = self.head(torch.tanh(self.emb(ids)))
        active = attention.view(-1) == 1
        flat, flat_labels = logits.view(-1, 5), labels.view(-1)
        if self.how == "mean":
            return nn.functional.cross_entropy(flat[active], flat_labels[active])
        if self.how == "sum_2d":  # a 2-D mask over (batch, tokens)
            mask = attention == 1
            return nn.functional.cross_entropy(logits[mask], labels[mask], reduction="sum")
        if self.how == "selected_mean":  # per token, then the mean over the selected
            each = nn.functional.cross_entropy(flat, flat_labels, reduction="none")
            return each[active].mean()
        if self.how == "mse":
            return nn.functional.mse_loss(flat[:, 0][active], flat_labels.float()[active])
        if self.how == "bce_sum":
            mask = attention == 1
            return nn.functional.binary_cross_entropy_with_logits(
                logits[..., 1][mask], (labels > 2).float()[mask], reduction="sum")
        if self.how == "none":  # a value per selected token: kept as written
            return nn.functional.cross_entropy(flat[active], flat_labels[active], reduction="none")
        # scores and targets selected by different masks: kept as written
        return nn.functional.cross_entropy(flat[active], flat_labels[flat_labels.ne(0)])


@pytest.mark.parametrize("how,rewritten", [
    ("mean", True), ("sum_2d", True), ("selected_mean", True), ("mse", True), ("bce_sum", True),
    ("none", False), ("two_masks", False)])
def test_a_loss_over_a_masks_tokens_reads_as_ignore_index_targets(how, rewritten):
    """[Note: masked losses] in csrc/frontend/masked_losses.h: cross_entropy(logits[mask],
    labels[mask]) becomes cross_entropy over all tokens with the unselected ones' targets
    set to ignore_index, a loss op of its own (so token means make it exact); x[mask].mean()
    and mse_loss(p[mask], t[mask]) a sum where the mask is on over mask.sum(); outputs and
    gradients stay those of the model."""
    torch.manual_seed(0)
    model = MaskedTokenLoss(how)

    def batch(n):
        ids = torch.randint(0, 12, (n, 6))
        attention = (torch.rand(n, 6) < 0.6).long()
        attention[:, 0] = 1
        labels = torch.randint(0, 5, (n, 6)) if how != "two_masks" else attention * 2
        return ids, labels, attention

    g = rannc.trace(model, batch(4))
    ops = [t.op for t in g.ir.tasks()]
    # no task left that selects by the mask, and the mask's where on its own
    assert (not any("aten::index" in op.split("+") for op in ops)) == rewritten, ops
    assert ("aten::where" in ops) == rewritten, ops
    args = batch(3)
    same_outputs_and_gradients(g, model, args, atol=1e-7)


class MaskedCtc(nn.Module):
    """CTC over the labels a mask selects, as transformers' Wav2Vec2ForCTC writes it."""

    def __init__(self, lengths_from_mask=True):
        super().__init__()
        self.lengths_from_mask = lengths_from_mask
        self.emb = nn.Linear(3, 6)

    def forward(self, frames, labels):
        log_probs = nn.functional.log_softmax(self.emb(frames), -1).transpose(0, 1)
        mask = (labels >= 0) & (labels != 0)
        lengths = mask.sum(-1) if self.lengths_from_mask else (labels > 0).sum(-1)
        return nn.functional.ctc_loss(log_probs, labels.masked_select(mask), (frames[..., 0] == frames[..., 0]).sum(-1),
                                      lengths, reduction="sum", zero_infinity=True)


@pytest.mark.parametrize("lengths_from_mask", [True, False])
def test_ctc_over_a_masks_labels_reads_as_padded_targets(lengths_from_mask):
    """[Note: masked losses]: ctc_loss(lp, labels.masked_select(mask), lengths, mask.sum(-1))
    becomes ctc_loss over labels with each row's selected labels moved to its front (holes
    in the mask too), a loss op of its own whose reduction reads; target lengths made
    otherwise keep the op as written. Outputs and gradients stay the model's."""
    torch.manual_seed(0)
    model = MaskedCtc(lengths_from_mask)

    def batch(n):
        labels = torch.randint(1, 6, (n, 4))
        labels[0, 1] = -100  # a hole, not only padding at the end
        labels[1:, 3] = -100
        labels[2:, 2] = -100  # rows of other counts: the selection cannot be cut by rows
        return torch.randn(n, 9, 3), labels

    g = rannc.trace(model, batch(4))
    ops = [t.op for t in g.ir.tasks()]
    assert ("aten::ctc_loss" in ops) == lengths_from_mask, ops
    assert any("aten::masked_select" in op for op in ops) != lengths_from_mask, ops
    assert (g.ir.batch_reduction(g.ir.outputs[0]) == "sum") == lengths_from_mask
    args = batch(3)
    same_outputs_and_gradients(g, model, args, atol=1e-6)


class KeepsTokens(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 8)

    def forward(self, x, keep):
        h = torch.tanh(self.a(x))
        return torch.zeros_like(h).index_put((keep,), self.b(h[keep])).sum(-1)


def test_values_sized_by_a_selection_stay_in_one_task_though_the_example_selects_evenly():
    """[Note: data-sized values]: x[keep] over a mask that keeps two tokens of every row reads
    as a batch value (8 rows at 4, 4 at 2); it and the layer over the kept tokens are glued
    into the task that scatters them back, so no stage receives it cut by rows; the batch
    values around it stay (and the model runs at uneven selections)."""
    keep = torch.zeros(4, 6, dtype=torch.bool)
    keep[:, :2] = True
    model = KeepsTokens()
    g = rannc.trace(model, (torch.randn(4, 6, 4), keep))
    ops = [t.op for t in g.ir.tasks()]
    glued = [op for op in ops if "aten::index+" in op]
    assert len(glued) == 1 and "aten::linear" in glued[0] and "aten::index_put" in glued[0], ops
    assert ops.count("aten::linear") == 1, ops  # the first layer, on all tokens
    uneven = torch.rand(3, 6) < 0.5
    x = torch.randn(3, 6, 4)
    torch.testing.assert_close(g(x, uneven), model(x, uneven))


class PoolsLastToken(nn.Module):
    """A classifier's pooling as transformers' GPT2ForSequenceClassification writes it:
    logits[torch.arange(batch_size), last_token]."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x, last):
        h = self.b(torch.tanh(self.a(x)))
        rows = torch.arange(x.shape[0])
        return h[rows, last]


@pytest.mark.parametrize("batch", [2, 3, 8])
def test_a_value_that_holds_row_positions_stays_in_the_tasks_that_read_it(batch):
    """[Note: row positions]: torch.arange(batch_size) that indexes rows is no batch value
    (cut from a whole batch's, a share of rows 3-5 read 3, 4, 5 instead of 0, 1, 2): it is
    glued into the task that indexes with it, and the rows around it stay batch values."""
    x, last = torch.randn(batch, 5, 4), torch.arange(batch) % 5
    model = PoolsLastToken()
    g = rannc.trace(model, (x, last))
    ops = [t.op for t in g.ir.tasks()]
    assert any("aten::arange" in op and "aten::index" in op for op in ops), ops
    for v in g.ir.values():
        if v.kind == "Tensor" and v.dtype == "Int64" and v.batch_dim >= 0:
            assert v.role == "input", v  # only the argument `last`
    torch.testing.assert_close(g(x[1:], last[1:]), model(x[1:], last[1:]))


class AccumulatedLoss(nn.Module):
    """A loss whose terms are added in place, as training code writes them."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 5)

    def forward(self, x, y, items):
        logits = self.lin(x)
        loss = torch.nn.functional.cross_entropy(logits, y, reduction="sum") / items
        loss += 0.1 * logits.pow(2).mean()
        loss -= 0.01 * self.lin.weight.abs().sum()
        total = torch.zeros((), dtype=loss.dtype)
        total += loss
        total *= 2
        return total


def test_a_loss_accumulated_in_place_is_read_term_by_term():
    """[Note: scalar updates]: `loss += term` on a 0-dim loss becomes a functional add, so
    the loss op stays an op of its own and the output reads as a sum over the batch whose
    mean and fixed terms scale by the share's rows ([Note: mixed terms]); the outputs and
    gradients stay those of the model."""
    torch.manual_seed(0)
    model = AccumulatedLoss()

    def batch(n):
        return torch.randn(n, 6), torch.randint(0, 5, (n,)), torch.tensor(float(3 * n))

    g = rannc.trace(model, batch(4))
    ops = [t.op for t in g.ir.tasks()]
    assert not any(op.endswith("_") or "+" in op for op in ops), ops  # no in-place op, none glued
    assert "aten::cross_entropy_loss" in ops, ops
    out = g.ir.outputs[0]
    assert g.ir.batch_reduction(out) == "unknown"  # not one reduction...
    assert g.ir.output_reduction(out) == "sum"  # ...but a sum plus a mean and a fixed term
    args = batch(3)
    same_outputs_and_gradients(g, model, args, atol=1e-7)


class LoopsOverHits(nn.Module):
    """A loop over the columns that data selects (as transformers' mixture-of-experts
    models loop over the experts their tokens hit): the trace unrolls it."""

    def forward(self, x):
        out = x.sum(1)
        for i in (x.abs().sum(0) > 1.0).nonzero():
            out = out + x[:, i[0]]
        return out


def test_a_loop_whose_length_the_data_sets_is_an_error_naming_the_op_and_the_cure():
    x = torch.zeros(4, 5)
    x[:, :2] = 10.0  # two columns hit at every batch size
    g = rannc.trace(LoopsOverHits(), (x,))
    torch.testing.assert_close(g(x), LoopsOverHits()(x))
    x[:, 2] = 10.0  # three
    # the task that unbinds the hits holds the nonzero that selects them ([Note: data-sized
    # values] in csrc/frontend/convert.cpp: the count is 2 at both traced batch sizes)
    with pytest.raises(rannc.Error, match=r"aten::nonzero in module '<root>' \(LoopsOverHits\).*"
                                          r"unpacks 3 values where the trace unpacked 2.*batched_mm"):
        g(x)


class LayerDrop(nn.Module):
    """Skips its second layer when a random number says so, in Python (as transformers'
    wav2vec2, HuBERT and M2M100 do in training with layerdrop > 0)."""

    def __init__(self, noise=False, p=0.5):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.noise, self.p = noise, p

    def forward(self, x):
        h = self.a(x)
        if self.noise:  # random values that only mix with activations: nothing decided on them
            h = h + 0.1 * torch.randn_like(h)
            assert torch.isfinite(h).all()
        else:  # transformers 4's form: `skip = self.training and torch.rand([]) < p`
            skip = self.training and torch.rand([]) < self.p
            if skip:
                return h.sum(1)
        return self.b(h).sum(1)


def test_a_python_decision_on_a_random_number_is_an_error_naming_the_line():
    """[Note: random decisions] in python/rannc/_trace.py: both traces may draw alike, so
    only watching the draw catches it."""
    with pytest.raises(rannc.TraceError, match=r"decides in Python on a random number "
                                               r"\(__bool__ of a random value at .*test_frontend.py:\d+\)"):
        rannc.trace(LayerDrop(), (torch.randn(4, 4),))
    g = rannc.trace(LayerDrop(noise=True), (torch.randn(4, 4),))  # noise on activations is fine
    assert g.ir.num_tasks > 0
    # a draw in [0, 1) against p = 0 or 1 decides alike at every draw (transformers 4's
    # wav2vec2 with layerdrop=0.0 failed here); the whole model or the short path
    x = torch.randn(4, 4)
    for p, layers in ((0.0, 2), (1.0, 1), (-0.5, 2)):
        m = LayerDrop(p=p)
        g = rannc.trace(m, (x,))
        assert sum(t.op == "aten::linear" for t in g.ir.tasks()) == layers, p
        torch.testing.assert_close(g(x), m(x))
    for p in (0.01, 0.99):
        with pytest.raises(rannc.TraceError, match="decides in Python on a random number"):
            rannc.trace(LayerDrop(p=p), (x,))


class Reversal(nn.Module):
    """A domain-adversarial gradient reversal, written as a hook or as a Function."""

    class _Negate(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            return -g

    def __init__(self, how):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 1)
        self.how = how

    def forward(self, x):
        h = self.a(x)
        if self.how == "tensor_hook":
            h.register_hook(lambda g: -g)
        elif self.how == "function":
            h = Reversal._Negate.apply(h)
        return self.b(h).square().mean()


def test_hooks_a_trace_cannot_record_are_errors_naming_them():
    """[Note: hooks] in _trace.py: a gradient hook on a tensor in forward, or a module's
    backward hook, would be lost from the trace (the tensor hook without a word); an
    autograd Function doing the same is recorded and runs."""
    x = torch.randn(8, 4)
    with pytest.raises(rannc.TraceError, match=r"gradient hook on a tensor in its forward "
                                               r"\(register_hook at .*test_frontend.py:\d+\)"):
        rannc.trace(Reversal("tensor_hook"), (x,))
    hooked = Reversal("function")
    hooked.a.register_full_backward_hook(lambda m, gi, go: None)
    with pytest.raises(rannc.TraceError, match=r"backward hooks on a \(register_full_backward_hook"):
        rannc.trace(hooked, (x,))
    model = Reversal("function")
    reference = copy.deepcopy(model)
    rannc.trace(model, (x,))(x).backward()
    reference(x).backward()
    torch.testing.assert_close(model.a.weight.grad, reference.a.weight.grad, rtol=0, atol=0)
    assert model.a.weight.grad.abs().sum() > 0


def test_tracing_leaves_model_and_rng_untouched():
    model, args, kwargs = zoo.make("resnet")
    before = copy.deepcopy(model.state_dict())
    torch.manual_seed(99)
    state = torch.get_rng_state()
    rannc.trace(model, args, kwargs)
    assert torch.equal(torch.get_rng_state(), state)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_ir_knows_batch_values_parameters_and_loss():
    model, args, kwargs = zoo.make("gpt", batch=4)
    g = rannc.trace(model, args, kwargs)
    ir = g.ir
    inputs = [ir.value(v) for v in ir.inputs]
    params = [v for v in inputs if v.role == "param"]
    # tied embedding: one parameter, under its first name
    assert [p.name for p in params].count("tok.weight") == 1
    assert "lm_head.weight" not in [p.name for p in params]
    ids = [v for v in inputs if v.role == "input"]
    assert [v.batch_dim for v in ids] == [0, 0]
    (loss,) = [ir.value(v) for v in ir.outputs]
    assert loss.is_loss and loss.shape == [] and loss.batch_dependent
    # the flattened logits (batch*seq, vocab) scale with the batch by a factor of seq
    flat = [v for v in ir.values() if v.batch_dim == 0 and v.batch_multiple == 8
            and v.kind == "Tensor"]
    assert flat, "expected values whose dimension 0 is 8 * batch"
    # the causal mask does not depend on the batch
    masks = [v for v in ir.values() if v.dtype == "Bool" and v.shape == [8, 8]]
    assert masks and all(not m.batch_dependent for m in masks)
    summary = g.summary()
    assert "tasks" in summary and "batch values" in summary and "parameters" in summary
    assert f"batch size 4" in summary


def _ir_per_row(g):
    """Each value of a traced IR with its sizes and integers along the batch given per row."""
    b = g.batch_size
    rows = []
    for v in g.ir.values():
        shape = list(v.shape)
        if v.batch_dim >= 0:
            assert shape[v.batch_dim] == v.batch_multiple * b, (v, b)
            shape[v.batch_dim] = "batch"
        ints = [x - k * b for x, k in zip(v.int_values, v.int_batch_multiples)]
        rows.append((v.name, v.kind, v.dtype, shape, v.batch_dim, v.batch_multiple, ints,
                     list(v.int_batch_multiples), v.batch_dependent, v.requires_grad, v.is_loss))
    return [(t.op, list(t.inputs), list(t.outputs)) for t in g.ir.tasks()], rows


@pytest.mark.parametrize("name", zoo.NAMES + ["transformer_loss", "late_input", "hf_bert", "hf_t5"])
def test_values_observed_at_fewer_rows_than_traced_give_the_same_ir(name):
    """[Note: smaller observations] At batch 12 the values are observed at 6 and 3 rows and
    extrapolated to 12; at batch 4 they are observed at 4 and 2 rows, as traced. Both IRs
    are the same program with the same values per row."""
    big = rannc.trace(*_model_at(name, 12))
    small = rannc.trace(*_model_at(name, 4))
    assert _ir_per_row(big) == _ir_per_row(small)


def _model_at(name, batch):
    model, args, kwargs = zoo.make(name, batch=batch)
    return model, args, kwargs


class RowPlusOne(nn.Module):
    """A value of batch + 1 rows: it does not scale with the batch by a whole factor."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.cat([self.lin(x), x[:1]])


def test_a_value_that_does_not_scale_with_the_batch_is_observed_at_the_traced_batch():
    model, x = RowPlusOne(), torch.randn(12, 4)
    g = rannc.trace(model, (x,))
    cat = [v for v in g.ir.values() if v.kind == "Tensor" and v.shape[:1] == [13]]
    assert cat, "the concatenated value has 13 rows at batch 12"
    assert all(v.batch_dim == -1 and v.batch_dependent for v in cat)
    torch.testing.assert_close(g(x), model(x), **EXACT)


class FirstRows(nn.Module):
    """`x[:4]` has 4 rows at batch 12 and 6, but 3 at 3: extrapolated from 6 and 3 rows it
    would read 8, not the 4 the trace at 12 recorded."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x).sum() + self.lin(x[:4]).sum()


def test_a_value_whose_extrapolated_shape_differs_from_the_trace_is_observed_at_the_traced_batch():
    model, x = FirstRows(), torch.randn(12, 4)
    g = rannc.trace(model, (x,))
    shapes = [v.shape for v in g.ir.values() if v.kind == "Tensor"]
    assert [4, 4] in shapes and [8, 4] not in shapes, shapes
    torch.testing.assert_close(g(x), model(x), **EXACT)


def test_scopes_name_modules():
    model, args, kwargs = zoo.make("gpt")
    g = rannc.trace(model, args, kwargs)
    scopes = {t.scope for t in g.ir.tasks()}
    assert "blocks.1.attn" in scopes
    assert any(t.source.endswith(".py:" + t.source.rsplit(":", 1)[-1]) for t in g.ir.tasks())


def test_ir_file_round_trip_and_corruption(tmp_path):
    model, args, kwargs = zoo.make("transformer")
    g = rannc.trace(model, args, kwargs)
    path = tmp_path / "model.ir"
    g.save_ir(str(path))
    back = rannc.load_ir(str(path))
    assert back.content_hash() == g.ir.content_hash()
    assert back.num_tasks == g.ir.num_tasks
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(rannc.SerializationError, match="corrupt"):
        rannc.load_ir(str(path))


def test_hash_is_stable_across_traces_and_changes_with_the_model():
    m1, args, kwargs = zoo.make("mlp")
    m2, _, _ = zoo.make("mlp")
    h1 = rannc.trace(m1, args, kwargs).ir.content_hash()
    assert h1 == rannc.trace(m2, args, kwargs).ir.content_hash()
    m3 = zoo.MLP(hidden=48)
    assert h1 != rannc.trace(m3, args, kwargs).ir.content_hash()


# ---- bad input ------------------------------------------------------------------------

class Gate(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # control flow on tensor data
            return x * 2
        return x - 1


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = Gate()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(self.gate(x))


class BakedHead(nn.Module):
    def forward(self, x):
        n = int(x.shape[0])  # a Python int: the trace records the batch size as a constant
        return x + torch.zeros(n, x.shape[1])


class Baked(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.head = BakedHead()

    def forward(self, x):
        return self.head(self.lin(x))


class FixedView(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x).view(4, 2, 2)  # 4 is the batch size, written by hand


def test_control_flow_on_tensor_data_is_an_error_naming_the_module():
    x = torch.ones(4, 4)
    with pytest.raises(rannc.TraceError, match=r"depends on the input values.*'gate' \(Gate\)"):
        rannc.trace(DataDependent(), (x,))


def test_batch_size_baked_into_a_shape_is_an_error_naming_the_op():
    with pytest.raises(rannc.TraceError,
                       match=r"batch size is baked into a shape, or a number made from it: op aten::zeros in module 'head' \(BakedHead\)"):
        rannc.trace(Baked(), (torch.randn(4, 4),))


def test_model_that_fails_at_another_batch_size_says_where():
    with pytest.raises(rannc.TraceError, match=r"fails when run at batch size 2.*test_frontend.py"):
        rannc.trace(FixedView(), (torch.randn(4, 4),))


def test_untraceable_argument_is_named():
    model = zoo.MultiIO()
    x = torch.randn(4, 8)
    with pytest.raises(rannc.TraceError, match=r"argument kwargs\['pair'\]\[1\] has type object"):
        rannc.trace(model, (x, x), {"pair": (torch.randn(4), object())})


def test_changed_constant_argument_is_an_error():
    model, args, kwargs = zoo.make("multi_io")
    g = rannc.trace(model, args, kwargs)
    with pytest.raises(rannc.TraceError, match=r"kwargs\['scale'\] was 0.5 when traced"):
        g(*args, **{**kwargs, "scale": 2.0})


class _Recurrent(torch.nn.Module):
    def __init__(self, batch_first):
        super().__init__()
        self.lstm = torch.nn.LSTM(6, 8, batch_first=batch_first)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.lstm(x)[0])


class _Encoder(torch.nn.Module):
    def __init__(self, batch_first):
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=batch_first)
        self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.encoder(x))


@pytest.mark.parametrize("layout", ["batch_first", "sequence_first", "ambiguous"])
def test_a_sequence_first_transformer_has_its_batch_in_dimension_1(capfd, layout):
    """[Note: batch dimensions]: an nn.TransformerEncoder without batch_first fed [sequence,
    batch, features] traces with its batch in dimension 1 and its layers in tasks of their
    own (before, everything from the first attention on was one task: one stage); batch
    first, in dimension 0, traced once. Where the sizes cannot tell, dimension 0 stays and
    rank 0 says the layers stay in one task, naming the op."""
    model = _Encoder(layout == "batch_first")
    x = {"batch_first": torch.randn(4, 7, 8), "sequence_first": torch.randn(7, 4, 8),
         "ambiguous": torch.randn(4, 4, 8)}[layout]
    g = rannc.trace(model, (x,))
    err = capfd.readouterr().err
    assert err.count("traced:") == (2 if layout == "sequence_first" else 1), err
    dim = g.ir.value(g.ir.inputs[-1]).batch_dim
    assert dim == (1 if layout == "sequence_first" else 0), (layout, dim)
    assert g.batch_size == 4
    tasks = len(list(g.ir.tasks()))  # 173 batch first, 169 sequence first
    assert (tasks > 150) == (layout != "ambiguous"), (layout, tasks)
    torch.testing.assert_close(g(x), model(x))
    said = "mixes the rows of dimension 0" in err and "stay in one task" in err
    assert said == (layout == "ambiguous"), err


@pytest.mark.parametrize("layout", ["batch_first", "sequence_first", "ambiguous"])
def test_a_sequence_first_recurrence_has_its_batch_in_dimension_1(capfd, layout):
    """[Note: batch dimensions]: a sequence-first nn.LSTM fed [sequence, batch, features]
    traces with its batch in dimension 1 (cut along dimension 0, the sequence, it trained
    wrongly without a word); batch first, in dimension 0. Where the sizes cannot tell (as
    many steps as rows) the trace keeps dimension 0 and warns, naming the op."""
    model = _Recurrent(layout == "batch_first")
    x = {"batch_first": torch.randn(4, 7, 6), "sequence_first": torch.randn(7, 4, 6),
         "ambiguous": torch.randn(4, 4, 6)}[layout]
    g = rannc.trace(model, (x,))
    err = capfd.readouterr().err
    dim = g.ir.value(g.ir.inputs[-1]).batch_dim
    assert dim == (1 if layout == "sequence_first" else 0), (layout, dim)
    assert g.batch_size == 4
    torch.testing.assert_close(g(x), model(x))
    warned = "aten::lstm in 'lstm'" in err and "tracing with the batch in dimension 1 did not help" in err
    assert warned == (layout == "ambiguous"), err


class _Holder:
    """An output object pytree does not flatten, holding tensors (as transformers'
    DynamicCache holds past_key_values)."""

    def __init__(self, keys):
        self.layers = [{"keys": keys}]


class _CachingModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 37), nn.Linear(37, 1)

    def forward(self, x):
        h = torch.tanh(self.a(x))  # [rows, 37]: a shape nothing else has
        return {"loss": self.b(h).pow(2).mean(), "cache": _Holder(h * 2), "note": "kept"}


def test_tracing_keeps_no_activation_and_no_output_object_of_its_run(capfd):
    """[Note: outputs kept from tracing] in _trace.py: the trace's outputs held its autograd
    graph (every activation of the model, on its device, for the module's life: 1.6 GiB per
    trace of a 1.3B-parameter GPT-2 at 256 tokens), and an output object holding tensors
    (transformers' DynamicCache) came back from every call as the trace's object with its
    stand-in values. Now no tensor of the run outlives tracing, the object comes back as
    None (rank 0 says so), and outputs that hold no tensor come back as they were."""
    import gc
    model = _CachingModel()
    x = torch.randn(6, 8)
    g = rannc.trace(model, (x,))
    gc.collect()
    alive = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.dim() == 2
             and o.shape[-1] == 37 and o.shape[0] > 1]  # rows of activations, not b.weight
    assert not alive, [tuple(t.shape) for t in alive]
    out = g(x)
    assert out["cache"] is None and out["note"] == "kept"
    torch.testing.assert_close(out["loss"], model(x)["loss"])
    err = capfd.readouterr().err
    assert "the model's output cache (_Holder) holds tensors" in err, err[-2000:]


def test_an_argument_before_the_batch_is_named_in_the_error():
    """transformers' habit of a [1, S] position_ids broadcast over the batch, passed before
    input_ids: the batch size is taken from the first tensor argument (1 row), the second
    trace fails, and the error says which argument holds the batch and what to do."""
    class Embedded(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = torch.nn.Embedding(10, 4)
            self.pos = torch.nn.Embedding(8, 4)

        def forward(self, position_ids, input_ids):
            return (self.tok(input_ids) + self.pos(position_ids)).pow(2).mean()

    ids = torch.randint(0, 10, (4, 6))
    pos = torch.arange(6)[None]
    with pytest.raises(rannc.TraceError, match=r"Or is kwargs\['input_ids'\] the batch\?.*pass "
                                               r"the batch's tensors first"):
        rannc.trace(Embedded(), (), {"position_ids": pos, "input_ids": ids})
    rannc.trace(Embedded(), (), {"input_ids": ids, "position_ids": pos})  # the batch first


def test_outputs_that_are_parameters_buffers_or_arguments_are_returned():
    """[Note: outputs that are inputs] in _trace.py: a model returning a parameter (a
    temperature for a loss computed outside), a buffer or an argument as it came made no
    op's result of them, and every call failed with a KeyError."""
    class PassesThrough(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 3)
            self.temperature = torch.nn.Parameter(torch.tensor(2.0))
            self.register_buffer("center", torch.arange(3.0))

        def forward(self, x, labels):
            return self.lin(x), self.temperature, self.center, labels

    model = PassesThrough()
    x, labels = torch.randn(6, 4), torch.arange(6)
    g = rannc.trace(model, (x, labels))
    outputs = g(x, labels)
    for got, expected in zip(outputs, model(x, labels)):
        torch.testing.assert_close(got, expected)
    aliased = [t.op for t in g.ir.tasks() if t.op == "aten::alias"]
    assert len(aliased) == 3, [t.op for t in g.ir.tasks()]


def test_a_value_pairing_the_rows_of_the_batch_names_its_op():
    """[Note: rows paired] in csrc/frontend/traced_model.h: an in-batch contrastive loss
    makes a value with the batch in two dimensions; the trace names the op that makes it
    (the planner then plans one micro-batch), and a model computed row by row has none."""
    class InBatch(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            z = self.lin(x)
            similarity = z @ z.T  # the pairing op
            return torch.nn.functional.cross_entropy(similarity, torch.arange(x.shape[0]))

    x = torch.randn(6, 4)
    ops = rannc.trace(InBatch(), (x,))._trace.traced.pairing_ops
    assert len(ops) == 1 and ops[0].startswith("op aten::matmul") and "InBatch" in ops[0], ops
    assert rannc.trace(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()),
                       (x,))._trace.traced.pairing_ops == []


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_reentrant_checkpoint_in_forward_traces_as_its_ops(reentrant, capfd):
    """[Note: checkpoints in forward] in _trace.py: torch.utils.checkpoint with
    use_reentrant=True (the default where the argument is left out) made tracing fail with
    "unordered_map::at"; it is traced as the ops it runs, as the non-reentrant form is.
    Rank 0 says that the plan decides what recomputes (a probe's finding: the script's
    checkpoints were dropped without a word)."""
    from torch.utils.checkpoint import checkpoint
    from rannc import _trace
    _trace._CHECKPOINTS_SAID.clear()  # said once per process

    class Checkpointed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)

        def forward(self, x):
            h = checkpoint(lambda t: torch.relu(self.a(t)), x, use_reentrant=reentrant)
            return self.b(h).pow(2).mean()

    model = Checkpointed()
    x = torch.randn(6, 4)
    g = rannc.trace(model, (x,))
    torch.testing.assert_close(g(x), model(x))
    import torch.utils.checkpoint as checkpoints
    assert checkpoints.CheckpointFunction.__name__ == "CheckpointFunction"  # restored
    assert checkpoints._checkpoint_without_reentrant_generator.__name__ != "noted"
    err = capfd.readouterr().err
    assert err.count("the forward calls torch.utils.checkpoint: rannc traces through it") == 1, err


@pytest.mark.parametrize("norm", ["batch_norm_without_statistics", "instance_norm"])
def test_norms_without_running_statistics_trace(norm):
    """[Note: norms without running statistics] in csrc/frontend/convert.cpp: a batch norm
    built with track_running_stats=False (MAML's) and an instance norm (its default) have
    no running statistics, and tracing failed while observing the rows apart ("running_mean
    must be defined in evaluation mode"). They trace, and the graph computes the model's
    outputs and gradients in training mode."""
    torch.manual_seed(0)
    layer = (torch.nn.BatchNorm2d(4, track_running_stats=False) if norm.startswith("batch")
             else torch.nn.InstanceNorm2d(4, affine=True))
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), layer, torch.nn.ReLU(),
                                torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 2))
    x = torch.randn(6, 3, 8, 8)
    g = rannc.trace(model, (x,))
    torch.testing.assert_close(g(x), model(x))


def test_a_cumulative_batch_norm_moves_its_statistics_as_pytorch():
    """[Note: cumulative batch norm] in _trace.py: momentum=None (a cumulative average, as
    update_bn sets it) computed its factor in Python, fixed by the trace; the traced graph
    moves the statistics by 1 / num_batches_tracked at every run, as PyTorch does."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3, momentum=None))
    reference = copy.deepcopy(model)
    x = torch.randn(6, 4)
    g = rannc.trace(model, (x,))
    state = dict(model.named_buffers())
    for step in range(3):
        batch = torch.randn(6, 4, generator=torch.Generator().manual_seed(step)) * (step + 1)
        torch.testing.assert_close(g(batch), reference(batch))
    for name, buffer in reference.named_buffers():
        torch.testing.assert_close(state[name], buffer, msg=lambda m: f"{name}: {m}")
    assert int(state["1.num_batches_tracked"]) == 3


def test_a_python_number_of_the_data_in_the_outputs_is_named():
    """[Note: numbers in the outputs] in _trace.py: `return loss, loss.item()` returned the
    traced number at every call (each rank its own shard's), without a word."""
    class ReturnsItem(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def forward(self, x):
            loss = self.lin(x).pow(2).mean()
            return loss, loss.item(), 3  # the constant 3 is returned as traced

    with pytest.raises(rannc.TraceError, match=r"output 1 is a Python number computed from "
                                               r"the data .*loss.detach\(\), not loss.item\(\)"):
        rannc.trace(ReturnsItem(), (torch.randn(6, 4),))


def test_a_dataclass_output_is_traced_and_returned_as_its_class():
    """[Note: dataclass outputs] in _trace.py: a plain @dataclass output was one leaf that
    is no tensor, and planning failed with "cannot plan a graph without tasks"."""
    import dataclasses

    @dataclasses.dataclass
    class Result:
        loss: torch.Tensor
        logits: torch.Tensor
        note: str = "kept"

    class ReturnsDataclass(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 3)

        def forward(self, x):
            logits = self.lin(x)
            return Result(logits.pow(2).mean(), logits)

    model = ReturnsDataclass()
    x = torch.randn(6, 4)
    out = rannc.trace(model, (x,))(x)
    assert isinstance(out, Result) and out.note == "kept"
    torch.testing.assert_close(out.logits, model(x).logits)
    torch.testing.assert_close(out.loss, model(x).loss)


class _LossOverRows(torch.nn.Module):
    """A classifier whose loss reads the batch's rows in the way `case` says."""

    def __init__(self, case):
        super().__init__()
        self.case = case
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)
        self.bn = torch.nn.BatchNorm1d(16)

    def forward(self, x, y):
        h = torch.relu(self.a(x))
        if self.case == "batch_norm":
            h = self.bn(h)
        if self.case == "centered":
            h = (h - h.mean(0, keepdim=True)) / (h.std(0, keepdim=True) + 1e-3)
        if self.case == "new_ones":  # h's type, not its rows ([Note: the type of self])
            h = h * h.new_ones(h.shape[1]).cumsum(0)
        logits = self.b(h)
        losses = torch.nn.functional.cross_entropy(logits, y, reduction="none")
        if self.case == "max":
            return losses.max()
        if self.case == "logsumexp":
            return torch.logsumexp(losses, 0)
        if self.case == "hardest":
            return losses.topk(2).values.mean()
        if self.case == "load_balancing":  # a statistic that reaches the loss only
            share = torch.softmax(logits, -1).mean(0)
            return losses.mean() + 0.01 * (share * share).sum()
        if self.case == "masked":
            mask = (y != 0).float()
            return (losses * mask).sum() / mask.sum().clamp(min=1)
        if self.case == "class_balanced":  # the batch's classes counted into its weights
            weights = 1.0 / torch.bincount(y, minlength=4).clamp(min=1).float()
            return torch.nn.functional.cross_entropy(logits, y, weight=weights)
        return losses.mean()


@pytest.mark.parametrize("case,coupled", [
    ("mean", False), ("batch_norm", False), ("load_balancing", False), ("masked", False),
    ("new_ones", False), ("centered", True), ("max", True), ("logsumexp", True),
    ("hardest", True), ("class_balanced", True)])
def test_losses_that_couple_the_rows_are_planned_with_one_micro_batch(case, coupled):
    """[Note: rows coupled] in planning.py: a statistic over the batch that later rows are
    computed from, or a loss that is not a mean or a sum of the rows' terms (a max, a
    logsumexp, the hardest examples), was computed per micro-batch without a word (a max
    loss read 1.82 for PyTorch's 1.85; class weights counted from the batch's labels, 1.129
    for 1.454); such a model is planned with one micro-batch, and a
    loss of the rows' terms (a mean, batch norm's, a masked mean, a statistic reaching the
    loss only) still pipelines."""
    from rannc.planning import rows_coupled
    model = _LossOverRows(case)
    args = (torch.randn(16, 8), torch.randint(0, 4, (16,)))
    assert bool(rows_coupled(rannc.trace(model, args))) == coupled
    plan = rannc.plan(model, args, world_size=2, num_stages=2, cost_model="analytic")
    assert (plan.micro_batches == 1) == coupled, plan.micro_batches


def test_a_loss_divided_by_len_of_the_batch_names_the_batch_size():
    """`cross_entropy(..., reduction="sum") / len(x)`: the tracer makes len(x) a tensor
    constant, and the error read as values the program depends on; it names the baked
    batch size and len()."""
    class DividedByLen(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 3)

        def forward(self, x, y):
            return torch.nn.functional.cross_entropy(self.lin(x), y, reduction="sum") / len(x)

    # the tracer's 0-dim tensor of the Python int is named by its value (a hash before)
    with pytest.raises(rannc.TraceError, match=r"the batch size is baked into a shape.* uses the "
                                               r"constant tensor\(6\) when traced at batch size 6 "
                                               r"and tensor\(3\).*not len\(x\)"):
        rannc.trace(DividedByLen(), (torch.randn(6, 4), torch.randint(0, 3, (6,))))


def test_flex_attention_is_named_with_its_cure():
    """torch.jit.trace cannot follow flex_attention's vmap over its score_mod: torch's
    "Unsupported value kind: Tensor" named nothing; the error names the call and SDPA."""
    from torch.nn.attention.flex_attention import flex_attention

    class Flex(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(8, 24)

        def forward(self, x):
            q, k, v = self.qkv(x).view(x.size(0), x.size(1), 3, 2, 4).permute(2, 0, 3, 1, 4)
            causal = lambda score, b, h, qi, ki: torch.where(qi >= ki, score, -float("inf"))  # noqa: E731
            return flex_attention(q, k, v, score_mod=causal).pow(2).mean()

    with torch.no_grad(), pytest.raises(rannc.TraceError, match=r"calls torch.nn.attention.flex_attention "
                                                                r"\(at .*test_frontend.py:\d+\).*"
                                                                r"scaled_dot_product_attention"):
        rannc.trace(Flex().eval(), (torch.randn(4, 6, 8),))


def test_a_trace_at_one_row_that_differs_names_the_single_row_path():
    """transformers' masks without an attention_mask take a path of their own for one row,
    so a trace at one row differs from the one at two; the error says so and names the
    cure (it named control flow on data only)."""
    class OneRowPath(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            h = self.lin(x)
            if x.shape[0] != 1:  # as masking_utils expands position ids for several rows
                h = torch.tanh(h)
            return h.sum()

    with pytest.raises(rannc.TraceError, match="Traced at one row, a model may take a path of "
                                               "its own for a single row"):
        rannc.trace(OneRowPath(), (torch.randn(1, 4),))


@pytest.mark.parametrize("style", ["parametrization", "hook"])
def test_spectral_norm_with_several_micro_batches_is_named(style, capfd):
    """[Note: spectral norm per micro-batch] in planning.py: its power iteration runs once
    per micro-batch, so several micro-batches train another model than one process, without
    a word before; rank 0 says so, for the parametrization and the older hook form."""
    from torch.nn.utils import parametrizations, spectral_norm
    norm = parametrizations.spectral_norm if style == "parametrization" else spectral_norm
    model = torch.nn.Sequential(norm(torch.nn.Linear(8, 16)), torch.nn.ReLU(),
                                norm(torch.nn.Linear(16, 1)))
    args = (torch.randn(16, 8),)
    rannc.plan(model, args, world_size=2, num_stages=2, num_microbatches=2, cost_model="analytic")
    err = capfd.readouterr().err
    assert "spectral norm in 0, 2 runs its power iteration once per micro-batch" in err, err[-2000:]
    rannc.plan(model, args, world_size=2, num_stages=2, num_microbatches=1, cost_model="analytic")
    assert "spectral norm" not in capfd.readouterr().err


def test_extremes_over_the_rows_trace_alike_for_any_data():
    """[Note: extremes over the rows] in csrc/frontend/convert.cpp: after a max or min over
    the rows (a per-channel quantization observer's aminmax, a shift by the batch's max),
    the rows two observations share agreed or not as the data put the extreme rows, so the
    ops were glued otherwise for other data (2 ranks: "the ranks traced different graphs").
    They trace alike for any data."""
    import torch.ao.quantization as Q

    class PerChannel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 1)
            self.q = Q.FakeQuantize(observer=Q.MovingAveragePerChannelMinMaxObserver,
                                    quant_min=0, quant_max=255, ch_axis=1)

        def forward(self, x, y):
            return F.mse_loss(self.b(self.q(torch.relu(self.a(x)))), y)

    class Shifted(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 1)

        def forward(self, x, y):
            h = self.a(x)
            return F.mse_loss(self.b(torch.tanh(h - h.amax(0))), y)

    for make in (PerChannel, Shifted):
        torch.manual_seed(0)
        model = make()
        model(torch.randn(4, 8), torch.zeros(4, 1))  # the observer sizes its range
        programs = set()
        for seed in range(6):
            g = torch.Generator().manual_seed(seed)
            args = (torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g))
            programs.add(tuple(t.op for t in rannc.trace(model, args).ir.tasks()))
        assert len(programs) == 1, (make.__name__, programs)
        # still a statistic that couples the rows ([Note: rows coupled] in planning.py): one
        # micro-batch per step, each rank's over its own rows, as under DDP
        assert rannc.plan(model, args, world_size=2, cost_model="analytic").micro_batches == 1


def test_a_loss_over_rows_pooled_by_an_index_couples_them_and_is_named(capfd):
    """A DeepSets classifier (the rows pooled into one per set by index_add_ over a `batch`
    vector, a cross entropy over the sets) read as a mean of the rows: micro-batches each
    pooled part of a set (parameters 3.9e-3 off, without a word). Its loss is no mean of the
    rows' terms (ir::batchReduction), so it plans one micro-batch; on several ranks rank 0
    warns that set ids must name the same sets on every rank ([Note: rows grouped by an
    index] in planning.py)."""
    class DeepSets(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.phi, self.rho = torch.nn.Linear(6, 8), torch.nn.Linear(8, 3)

        def forward(self, x, sets, y):
            pooled = torch.zeros(y.size(0), 8).index_add_(0, sets, torch.relu(self.phi(x)))
            return F.cross_entropy(self.rho(pooled), y)

    args = (torch.randn(8, 6), torch.tensor([0] * 5 + [1] * 3), torch.tensor([0, 2]))
    graph = rannc.trace(DeepSets(), args)
    assert graph.ir.output_reduction(graph.ir.outputs[0]) == "unknown"
    capfd.readouterr()
    assert rannc.plan(DeepSets(), args, world_size=2, cost_model="analytic").micro_batches == 1
    err = capfd.readouterr().err
    assert "op aten::index_add_ in module '<root>'" in err, err[-2000:]
    assert "groups the rows of the batch by the values of an index" in err, err[-2000:]


def test_an_attribute_forward_sets_before_reading_it_is_neither_watched_nor_named(capfd):
    """[Note: attributes read] in _trace.py: Funnel Transformer sets `self.pooling_mult = 1`
    at each call and doubles it per block; it carries nothing between calls, but was named
    as a count forward keeps (1 -> 2). A count forward reads first is still named."""
    class SetThenRead(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.mult, self.calls = None, 0

        def forward(self, x):
            self.mult = 1
            for _ in range(2):
                x = self.lin(x) * self.mult
                self.mult *= 2
            self.calls += 1
            return x.sum()

    graph = rannc.trace(SetThenRead(), (torch.randn(6, 4),))
    watched = [attribute for _, _, attribute, _ in graph._trace.attributes]
    assert "mult" not in watched and "calls" not in watched, watched
    err = capfd.readouterr().err
    assert "the forward changes calls of the model" in err, err[-2000:]
    assert "mult" not in err, err[-2000:]


class _FlatWordLM(torch.nn.Module):
    """PyTorch's word language model: sequence first, its logits flattened to [T * B, V]."""

    def __init__(self, flat):
        super().__init__()
        self.flat = flat
        self.encoder, self.rnn = torch.nn.Embedding(20, 8), torch.nn.LSTM(8, 16)
        self.decoder = torch.nn.Linear(16, 20)

    def forward(self, tokens):
        out, _ = self.rnn(self.encoder(tokens))
        decoded = self.decoder(out)
        return (torch.log_softmax(decoded.view(-1, 20), 1) if self.flat else decoded), out


def test_an_output_that_grows_with_the_batch_without_its_rows_is_named():
    """[Note: outputs not cut into rows] in planning.py: the word language model's logits
    [T * B, V] interleave the sequence's and the batch's rows; it came back as micro-batch
    0's of the first replica on every rank (a loss made outside trained on rank 0's rows).
    With several ranks it is an error naming the output and the cure; with one, it is
    planned with one micro-batch; the unflattened [T, B, V] pipelines."""
    tokens = torch.randint(0, 20, (5, 8))
    with pytest.raises(rannc.TraceError, match=r"output #0 grows with the batch but holds no "
                                               r"dimension of its rows.*flatten it outside"):
        rannc.plan(_FlatWordLM(True), (tokens,), world_size=2, cost_model="analytic")
    with pytest.raises(rannc.TraceError, match="cannot be put together from 2 micro-batches"):
        rannc.plan(_FlatWordLM(True), (tokens,), world_size=1, num_microbatches=2,
                   cost_model="analytic")
    plan = rannc.plan(_FlatWordLM(True), (tokens,), world_size=1, cost_model="analytic")
    assert plan.micro_batches == 1
    plan = rannc.plan(_FlatWordLM(False), (tokens,), world_size=2, num_stages=2,
                      num_microbatches=2, cost_model="analytic")
    assert plan.micro_batches == 2


class _Similarities(torch.nn.Module):
    """CLIP's outputs: the loss and the similarities of every pair of rows [B, B]."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(6, 4), torch.nn.Linear(5, 4)

    def forward(self, x, y):
        sims = self.a(x) @ self.b(y).t()
        labels = torch.arange(sims.shape[0], device=sims.device)
        return torch.nn.functional.cross_entropy(sims, labels), sims


def test_an_output_pairing_the_rows_is_named_with_its_cure():
    """[Note: outputs not cut into rows] in planning.py: CLIP's logits_per_image [B, B] was
    named as "a batch flattened with another dimension" (a probe's finding); it pairs the
    rows, and the cure is to return the loss and the embeddings."""
    args = (torch.randn(6, 6), torch.randn(6, 5))
    with pytest.raises(rannc.TraceError, match=r"output #1 grows with the batch but holds no "
                                               r"dimension of its rows \(one that pairs the rows.*"
                                               r"Return the loss and what it is made from"):
        rannc.plan(_Similarities(), args, world_size=2, cost_model="analytic")


def test_timesteps_drawn_in_forward_are_rows_of_the_batch():
    """[Note: random values] in convert.cpp: a diffusion model's timesteps drawn inside
    forward, `torch.randint(0, T, (x.shape[0],))` (and `.long()` of them), returned beside
    the loss, are a batch value; they read as interleaved, so every rank got micro-batch
    0's of the first replica (garbage where the shapes differed, MPI_ERR_TRUNCATE with two
    stages). A permutation of the rows (randperm) still is not."""
    class Diffusion(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def forward(self, x):
            t = torch.randint(0, 100, (x.shape[0],)).long()
            perm = torch.randperm(x.shape[0])
            loss = self.lin(x * (t[:, None].float() / 100) + x[perm]).pow(2).mean()
            return loss, t, perm

    graph = rannc.trace(Diffusion(), (torch.randn(8, 4),))
    dims = [graph.ir.value(v).batch_dim for v in graph.ir.outputs]
    assert dims[1] == 0 and dims[2] < 0, dims


class _DrawsPerRow(torch.nn.Module):
    """Classifier-free guidance's label dropout and timesteps drawn from rand and
    multinomial inside forward; rows of the batch drawn from rand (bootstrap)."""

    def __init__(self):
        super().__init__()
        self.emb, self.lin = torch.nn.Embedding(6, 4), torch.nn.Linear(4, 1)

    def forward(self, x, y):
        n = x.shape[0]
        drop = torch.rand(n) < 0.3
        y = torch.where(drop, torch.full_like(y, 5), y)
        t = (torch.rand(n) * 100).long().to(x.device)
        k = torch.multinomial(torch.ones(10), n, replacement=True)
        rows = (torch.rand(n) * n).long()  # indices of rows: they pair the batch's rows
        h = x * (t[:, None].float() / 100) + self.emb(y) + k[:, None] + x[rows]
        return self.lin(h).pow(2).mean(), drop, t, k, rows


def test_draws_made_from_constants_are_rows_at_every_draw():
    """[Note: random values] in convert.cpp: a bool or integer made from rand and constants
    alone (`torch.rand(B) < p`, `(torch.rand(B) * T).long()`, multinomial over fixed
    weights) and what elementwise ops make of it with the data are rows whatever is drawn;
    their rows were compared, and some draws agreed by chance: the trace depended on the
    draw (the ranks traced different graphs), or a returned one read as holding no rows.
    Rows drawn from the batch's own size are not rows (they pair them)."""
    x, y = torch.randn(8, 4), torch.tensor([3, 1, 0, 2, 4, 1, 0, 3])
    shapes = set()
    for seed in range(6):
        torch.manual_seed(seed)
        graph = rannc.trace(_DrawsPerRow(), (x, y))
        dims = [graph.ir.value(v).batch_dim for v in graph.ir.outputs]
        assert dims[1:4] == [0, 0, 0] and dims[4] < 0, (seed, dims)
        shapes.add(graph.ir.num_tasks)
    assert len(shapes) == 1, shapes


class _DataWrites(torch.nn.Module):
    """Glow's ActNorm initialised from the first batch through .data, a codebook's counts
    kept by an EMA through .data, or .data only read (a detached copy for a statistic)."""

    def __init__(self, case):
        super().__init__()
        self.case = case
        self.loc = torch.nn.Parameter(torch.zeros(4))
        self.register_buffer("initialized", torch.tensor(0))
        self.register_buffer("counts", torch.zeros(4))
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        if self.case in ("actnorm", "actnorm_no_grad") and self.initialized.item() == 0:
            with torch.no_grad():
                if self.case == "actnorm":
                    self.loc.data.copy_(-x.mean(0))
                else:
                    self.loc.copy_(-x.mean(0))
                self.initialized.fill_(1)
        if self.case == "ema":
            self.counts.data.mul_(0.9).add_(x.detach().abs().mean(0), alpha=0.1)
        scale = x.data.abs().mean() * self.lin.weight.data.norm() if self.case == "read" else 1.0
        return self.lin(x + self.loc).pow(2).mean() * scale


@pytest.mark.parametrize("case", ["actnorm", "ema", "actnorm_no_grad"])
def test_writes_through_data_are_named_and_leave_the_model_as_it_was(case):
    """[Note: writes through .data] in _trace.py: a trace does not record them, so the
    steps never made them without a word (a VQ-VAE's codebook never moved), and the trace
    wrote the real parameters with its own inputs (ActNorm's loc). A TraceError names the
    tensor and the cure, and the parameters are put back. ActNorm written under no_grad
    decides on a buffer it writes, which the trace fixed (it initialised at every step)."""
    model = _DataWrites(case)
    before = model.loc.detach().clone()
    expected = {"actnorm": r"writes through .data: 'loc' at .*test_frontend.py:\d+.*torch.no_grad\(\)",
                "ema": r"writes through .data: 'counts' at .*test_frontend.py:\d+.*torch.no_grad\(\)",
                "actnorm_no_grad": r"decides in Python on 'initialized' at .*test_frontend.py:\d+, "
                                   r"which it also writes.*before RaNNCModule\(model\)"}[case]
    with pytest.raises(rannc.TraceError, match=expected):
        rannc.trace(model, (torch.randn(8, 4) + 3,))
    assert torch.equal(model.loc.detach(), before)
    # only read: traced as detach(), so it follows the weights (it was a constant)
    model = _DataWrites("read")
    x = torch.randn(8, 4)
    graph = rannc.trace(model, (x,))
    with torch.no_grad():
        model.lin.weight.mul_(2)
    torch.testing.assert_close(graph(x), model(x))


def test_a_gradient_penalty_inside_forward_is_named():
    """An R1 penalty computed in the discriminator's forward (torch.autograd.grad with
    create_graph=True) failed with torch.jit's "Cannot insert a Tensor that requires grad as
    a constant"; the TraceError names the call's line and the cure."""
    class Discriminator(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Softplus(),
                                           torch.nn.Linear(16, 1))

        def forward(self, real):
            real = real.detach().requires_grad_(True)
            d_real = self.net(real)
            g, = torch.autograd.grad(d_real.sum(), real, create_graph=True)
            return torch.nn.functional.softplus(-d_real).mean() + g.pow(2).sum(1).mean()

    with pytest.raises(rannc.TraceError, match=r"calls torch.autograd.grad in its forward "
                                               r"\(at .*test_frontend.py:\d+\).*outside the RaNNCModule"):
        rannc.trace(Discriminator(), (torch.randn(4, 8),))


def test_a_capacity_made_from_the_batch_size_is_named_as_such():
    """A Switch router's capacity, int(f * tokens / experts), is a number that scales with the
    batch; the error blamed the input values ("control flow on tensor data?"); it names the
    batch size and int()."""
    class Switch(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Linear(8, 4, bias=False)

        def forward(self, x):
            tok = x.reshape(-1, 8)
            mask = torch.nn.functional.one_hot(self.gate(tok).argmax(-1), 4).float()
            capacity = int(1.0 * tok.shape[0] / 4)
            keep = (torch.cumsum(mask, 0) * mask <= capacity).float() * mask
            return (keep.sum(-1, keepdim=True) * tok).pow(2).mean()

    with pytest.raises(rannc.TraceError, match=r"baked into a shape, or a number made from it: "
                                               r"op aten::le.*int\(\.\.\.\)"):
        rannc.trace(Switch(), (torch.randn(8, 6, 8),))


def test_an_autograd_function_of_two_outputs_runs():
    """[Note: Functions of several outputs] in csrc/frontend/convert.h: TorchScript's
    operator for a Function runs those of one output only (an internal assert otherwise);
    one returning two tensors now traces and runs, its backward too."""
    class SplitHalves(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, scale):
            ctx.scale = scale
            a, b = x.chunk(2, dim=-1)
            return a.clone() * scale, b.clone()

        @staticmethod
        def backward(ctx, ga, gb):
            return torch.cat([ga * ctx.scale, gb], dim=-1), None

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l1, self.l2 = torch.nn.Linear(8, 16), torch.nn.Linear(8, 1)

        def forward(self, x):
            a, b = SplitHalves.apply(self.l1(x), 2.0)
            return self.l2(a * b).pow(2).mean()

    model, x = Net(), torch.randn(4, 8)
    graph = rannc.trace(model, (x,))
    torch.testing.assert_close(graph(x), model(x))


def test_rows_that_index_each_other_are_named():
    """A graph neural network whose batch is the nodes of one graph, with an edge_index over
    them: the trace at half the nodes fails; the error said "Or is args[2] the batch?" and
    nothing of the cause; it names the index argument and the cure."""
    class Gnn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.out = torch.nn.Linear(6, 16), torch.nn.Linear(32, 1)

        def forward(self, x, edge_index, y):
            h = torch.relu(self.inp(x))
            agg = torch.zeros_like(h).index_add_(0, edge_index[1], h.index_select(0, edge_index[0]))
            return torch.nn.functional.mse_loss(self.out(torch.cat([h, agg], -1)).squeeze(-1), y)

    edges = torch.stack([torch.arange(8), torch.arange(8).roll(1)]).repeat(1, 2)
    with pytest.raises(rannc.TraceError, match=r"Or does args\[1\] hold indices of the batch's rows.*"
                                               r"cannot be cut"):
        rannc.trace(Gnn(), (torch.randn(8, 6), edges, torch.randn(8)))


class PerImageTargets(torch.nn.Module):
    """A detection model's loss over a list of per-image dicts (torchvision's convention)."""

    def __init__(self):
        super().__init__()
        self.box, self.cls = torch.nn.Linear(6, 4), torch.nn.Linear(6, 3)

    def forward(self, images, targets):
        loss = images.new_zeros(())
        for i, t in enumerate(targets):
            n = len(t["labels"])
            loss = loss + (self.box(images[i]) - t["boxes"].mean(0)).pow(2).sum()
            loss = loss + torch.nn.functional.cross_entropy(self.cls(images[i]).expand(n, 3), t["labels"])
        return loss / len(targets)


class ConcatenatedCtcTargets(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(6, 5)

    def forward(self, x, targets, input_lengths, target_lengths):
        log_probs = self.proj(x).log_softmax(-1).transpose(0, 1)
        return torch.nn.functional.ctc_loss(log_probs, targets, input_lengths, target_lengths)


class FlattenedPositions(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(10, 8), torch.nn.Linear(8, 1)

    def forward(self, ids, pos):
        return self.head(self.embed(ids).reshape(-1, 8)[pos]).mean()


def test_arguments_whose_rows_are_not_the_batchs_are_named():
    """Arguments laid out otherwise than [batch, ...] fail in the trace at fewer rows; the
    error named a graph's edge_index (per-image targets whose labels are small integers),
    nothing (CTC targets concatenated to the batch size), or advice about CTC (positions
    into the flattened batch), and a nested tensor was torch's internal error. Each names
    its layout and the cure."""
    targets = [{"boxes": torch.rand(n, 4), "labels": torch.randint(0, 3, (n,))} for n in (2, 3, 1, 2)]
    with pytest.raises(rannc.TraceError, match=r"Or is args\[1\] a list with one entry per row "
                                               r"of the batch \(4 entries"):
        rannc.trace(PerImageTargets(), (torch.randn(4, 6), targets))
    lengths = torch.tensor([2, 1, 1, 0])
    with pytest.raises(rannc.TraceError, match=r"Or does args\[1\] hold each row's items "
                                               r"concatenated \(4 items, that args\[3\] splits"):
        rannc.trace(ConcatenatedCtcTargets(), (torch.randn(4, 10, 6), torch.randint(1, 5, (4,)),
                                               torch.full((4,), 10), lengths))
    pos = torch.tensor([b * 6 + t for t in (2, 4) for b in range(4)])
    with pytest.raises(rannc.TraceError, match=r"Or does args\[1\] hold positions in the batch "
                                               r"flattened \(args\[0\] reshaped to \[24"):
        rannc.trace(FlattenedPositions(), (torch.randint(0, 10, (4, 6)), pos))
    class Weighted(torch.nn.Module):  # class weights passed beside the batch
        def __init__(self, classes):
            super().__init__()
            self.lin = torch.nn.Linear(6, classes)

        def forward(self, x, y, weight):
            return torch.nn.functional.cross_entropy(self.lin(x), y, weight=weight)

    x, y = torch.randn(4, 6), torch.tensor([0, 1, 2, 3])
    with pytest.raises(rannc.TraceError, match=r"Or is args\[2\] of a size of the model's own that "
                                               r"equals the batch size here \(4: class weights"):
        rannc.trace(Weighted(4), (x, y, torch.rand(4)))

    class WeightsFirst(Weighted):
        def forward(self, weight, x, y):
            return super().forward(x, y, weight)

    with pytest.raises(rannc.TraceError, match=r"Or is args\[0\] not the batch\? .* args\[1\], "
                                               r"args\[2\] have 4 rows: pass the batch's tensors first"):
        rannc.trace(WeightsFirst(5), (torch.rand(5), x, y))
    nested = torch.nested.nested_tensor([torch.randn(3, 6), torch.randn(5, 6)])
    with pytest.raises(rannc.TraceError, match=r"args\[0\] is a nested tensor.*to_padded_tensor"):
        rannc.trace(torch.nn.Linear(6, 2), (nested,))


class CheckedRegression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, x, y):
        if x.shape[1] != 4:  # a check of a size: each new shape is traced anew
            raise ValueError("4 features")
        if not torch.isfinite(x).all():
            raise ValueError("a non-finite input")
        assert (y >= 0).all(), "negative targets"
        return (self.lin(x).squeeze(-1) - y).pow(2).mean()


def test_checks_of_the_data_in_forward_are_named(capfd):
    """[Note: checks of the data]: a check in Python on the batch's values runs at tracing
    only, so a NaN batch trained on without a word; rank 0 names each such line (not the
    check of a size, and not twice)."""
    rannc._trace._CHECKS_SAID.clear()
    model, x, y = CheckedRegression(), torch.randn(4, 4), torch.rand(4)
    graph = rannc.trace(model, (x, y))
    err = capfd.readouterr().err
    line = CheckedRegression.forward.__code__.co_firstlineno
    assert f"checks tensor values in Python at {__file__}:{line + 3} (if not torch.isfinite" in err, err
    assert f"{__file__}:{line + 5} (assert (y >= 0).all()" in err, err
    assert f"{__file__}:{line + 1}" not in err, err
    x[0, 0] = float("nan")
    assert torch.isnan(graph(x, y))  # what the note is about: the steps run no check
    rannc.trace(model, (x[1:], y[1:]))
    assert "checks tensor values" not in capfd.readouterr().err


class PairScorer(torch.nn.Module):
    """Scores two halves of a batch concatenated in forward (a reward model's chosen and
    rejected), each at its last real token."""

    def __init__(self):
        super().__init__()
        self.emb, self.v = torch.nn.Embedding(32, 16), torch.nn.Linear(16, 1)

    def forward(self, ids_c, mask_c, ids_r, mask_r):
        ids, mask = torch.cat([ids_c, ids_r]), torch.cat([mask_c, mask_r])
        r = self.v(self.emb(ids)[torch.arange(ids.size(0)), mask.sum(-1) - 1]).squeeze(-1)
        return -torch.nn.functional.logsigmoid(r[:ids_c.size(0)] - r[ids_c.size(0):]).mean()


def test_rows_that_agree_by_chance_make_the_same_graph():
    """[Note: rows that agree by chance] in csrc/frontend/convert.cpp: the concatenated masks'
    rows are not the batch's, but agreed between the observations where two rows had the
    same lengths, so the graph (13 tasks or 10) depended on the data and two ranks traced
    different ones. Any lengths now give one graph, the concatenation glued to its readers."""
    def masks(lengths):
        return (torch.arange(8)[None, :] < torch.tensor(lengths)[:, None]).long()

    model, ids = PairScorer(), torch.randint(1, 32, (8, 8))
    hashes = set()
    for lc, lr in [([4, 7, 8, 7], [8, 7, 5, 6]), ([8, 8, 4, 4], [3, 8, 5, 7]), ([5] * 4, [5] * 4)]:
        args = (ids[:4], masks(lc), ids[4:], masks(lr))
        graph = rannc.trace(model, args)
        torch.testing.assert_close(graph(*args), model(*args))
        hashes.add(graph.ir.content_hash())
        cats = [t for t in graph.ir.tasks() if "aten::cat" in t.op]
        outs = [graph.ir.value(v) for t in cats for v in t.outputs]
        assert cats and not any(v.batch_dim >= 0 and v.batch_multiple > 1 for v in outs), \
            [(t.op, v.batch_dim) for t, v in zip(cats, outs)]
    assert len(hashes) == 1, hashes


class ShapeReadingLayerNorm(torch.nn.Module):
    """nanoGPT's LayerNorm: its normalized shape is read from its own weight."""

    def __init__(self, n):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n))
        self.bias = torch.nn.Parameter(torch.zeros(n))

    def forward(self, x):
        return torch.nn.functional.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


def test_sizes_of_parameters_are_constants_of_the_graph():
    """[Note: shapes of the model's state] in csrc/frontend/state_shapes.h: `self.weight.shape`
    read where the norm's shape list is built is a constant, so no task reads a parameter
    for its size (a stage cut between the size and the norm held the weight twice, and
    state_dict() served the copy that never trained). Sizes of the data stay ops."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), ShapeReadingLayerNorm(8), torch.nn.Linear(8, 2))
    x = torch.randn(4, 8)
    g = rannc.trace(model, (x,))
    ir = g.ir
    for t in ir.tasks():
        if t.op == "aten::size":
            roles = [ir.value(v).role for v in t.inputs]
            assert "param" not in roles, roles
    params_read = {ir.value(v).name for t in ir.tasks() for v in t.inputs if ir.value(v).role == "param"}
    assert {"1.weight", "1.bias"} <= params_read
    assert [t.op for t in ir.tasks()].count("aten::layer_norm") == 1
    torch.testing.assert_close(g(x), model(x))


class RoundsByTheBatch(torch.nn.Module):
    """A bf16 value that rounds one way at one batch size and the other way at the other,
    by an ulp: what a bf16 matmul blocked by the batch does (oneDNN with AMX)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        mid = torch.full_like(x, 1 + 2 ** -8)  # halfway between two bf16 values
        h = (mid + 1e-6 * x.mean()).to(torch.bfloat16)  # nudged down at 4 rows, up at 3
        return self.lin(h.float() * x).sum(-1)


def test_rows_in_low_precision_agree_within_its_rounding():
    """[Note: rows in low precision] in convert.cpp: the rows two observations share are
    compared within bf16's rounding where a value is half precision or made from one. At
    float32's tolerance the bf16 value and every float value made from it read as
    interleaved: glued into one task whose output was not cut into rows (on an H200's host
    BERT-large under bf16 autocast had 446 tasks against 1079 in fp32)."""
    x = torch.ones(4, 8)
    x[0] = -10  # the mean over the batch changes sign between 4 rows and the trailing 3
    model = RoundsByTheBatch()
    g = rannc.trace(model, (x,))
    ops = [t.op for t in g.ir.tasks()]
    assert not any("+" in op for op in ops), ops
    (out,) = [g.ir.value(v) for v in g.ir.outputs]
    assert out.batch_dim == 0
    torch.testing.assert_close(g(x), model(x))


class AutocastInside(torch.nn.Module):
    """A forward that enters torch.autocast itself, its cast-weight cache on (the default),
    with a layer used twice."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.b(torch.relu(self.a(x)))
            h = self.b(torch.relu(h))
        return h.float()


def test_autocast_entered_in_forward_traces():
    """[Note: autocast in forward] in _trace.py: the second trace met the first's cached
    bf16 weights ("Cannot insert a Tensor that requires grad as a constant", reported as a
    failure at another batch size); the traced program computes in bf16 as the model does."""
    model = AutocastInside()
    x = torch.randn(4, 8)
    g = rannc.trace(model, (x,))
    assert "BFloat16" in {v.dtype for v in g.ir.values()}
    torch.testing.assert_close(g(x), model(x))


def test_transformers_4_masks_are_built_by_broadcasting_the_same_as_by_vmap():
    """[Note: transformers 4 masks] in _trace.py: while tracing, transformers 4's vmapped
    mask builder is replaced by one call on broadcasting index tensors; both give the same
    mask for causal, padding and sliding-window functions written as transformers writes
    them (indexing a padding mask by batch and key indices)."""
    from rannc._trace import _broadcast_for_bhqkv
    padding = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1]], dtype=torch.bool)

    def causal(b, h, q, kv):
        return kv <= q

    def padded(b, h, q, kv):
        return padding[b, kv]

    def window(b, h, q, kv):
        return (q - kv < 2) & (kv <= q) & padding[b, kv]

    def vmapped(fn, bh_indices):
        dims = [(None, None, None, 0), (None, None, 0, None)]
        if bh_indices:
            dims += [(None, 0, None, None), (0, None, None, None)]
        for d in dims:
            fn = torch.vmap(fn, in_dims=d, out_dims=0)
        return fn

    b, h, q, kv = torch.arange(3), torch.arange(1), torch.arange(5), torch.arange(5)
    for fn in (causal, padded, window):
        expected = vmapped(fn, True)(b, h, q, kv)
        got = _broadcast_for_bhqkv(fn, True)(b, h, q, kv)
        assert got.shape == expected.shape == (3, 1, 5, 5) and torch.equal(got, expected), fn
    expected = vmapped(causal, False)(None, None, q, kv)
    assert torch.equal(_broadcast_for_bhqkv(causal, False)(None, None, q, kv), expected)


def test_outputs_of_classes_registered_without_key_names_trace():
    """transformers 4 registers ModelOutput with pytree without a function naming its
    children: tracing a model returning one failed in tree_flatten_with_path; the children
    are named by their keys."""
    import collections
    import torch.utils._pytree as pytree

    class Output(collections.OrderedDict):
        pass
    pytree.register_pytree_node(Output, lambda d: (list(d.values()), list(d.keys())),
                                lambda values, keys: Output(zip(keys, values)))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 3)

        def forward(self, x):
            h = self.a(x)
            return Output(logits=h, loss=h.pow(2).mean())
    model = Model()
    x = torch.randn(4, 4)
    g = rannc.trace(model, (x,))
    out = g(x)
    assert isinstance(out, Output) and list(out) == ["logits", "loss"]
    torch.testing.assert_close(out["loss"], model(x)["loss"])


class _CachedAttention(nn.Module):
    """Meta's Llama keeps its KV cache so: one row per row of the caller's batch, written in
    place in forward and read back by the next call."""

    def __init__(self, rows, keep_per_row=True):
        super().__init__()
        self.k = nn.Linear(8, 8)
        self.keep_per_row = keep_per_row
        self.register_buffer("cache_k", torch.zeros(rows, 6, 8), persistent=False)
        self.register_buffer("seen", torch.zeros(rows, 8), persistent=False)

    def forward(self, x, start: int):
        rows, tokens, _ = x.shape
        k = self.k(x)
        if self.keep_per_row:
            self.cache_k[:rows, start:start + tokens] = k
            keys = self.cache_k[:rows, :start + tokens]
        else:  # a statistic over the batch, as batch norm's: no row of it follows the batch
            self.seen.mul_(0.9).add_(0.1 * k.detach().mean((0, 1)))
            keys = k
        return (x + torch.softmax(x @ keys.transpose(1, 2), -1) @ keys).sum()


def test_rows_of_the_batch_kept_in_a_buffer_are_a_trace_error():
    """[Note: rows kept in buffers] in _trace.py: a buffer that keeps the rows of the
    caller's batch (a KV cache written in place, read by the next call) cannot be cut into
    micro-batches and replicas; on 2 stages its eval outputs were 1.27 off without a word.
    A buffer updated from a statistic over the batch traces as before."""
    x = torch.randn(4, 3, 8)
    with pytest.raises(rannc.TraceError, match=r"writes the rows of its batch into rows 0 to "
                                                r"B-1 of buffer cache_k in place"):
        rannc.trace(_CachedAttention(rows=8).eval(), (x, 0))
    rannc.trace(_CachedAttention(rows=8, keep_per_row=False), (x, 0))
    # kept in a plain attribute, as Meta's Llama keeps it: a constant of the trace, which
    # held each rank's data ("the ranks traced different graphs")
    attribute = _CachedAttention(rows=8).eval()
    attribute.cache_k = attribute._buffers.pop("cache_k")
    with pytest.raises(rannc.TraceError, match=r"the forward writes into the tensor cache_k of "
                                                r"the model in place"):
        rannc.trace(attribute, (x, 0))


class _RoutedBySign(nn.Module):
    """Two experts; each token goes to the one its first feature's sign picks (nonzero,
    index_select, index_add over the flattened tokens, as hand-written mixtures do)."""

    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        tokens = x.reshape(-1, 4)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            chosen = (tokens[:, 0] > 0 if e else tokens[:, 0] <= 0).nonzero(as_tuple=True)[0]
            out = out.index_add(0, chosen, expert(tokens.index_select(0, chosen)))
        return self.head(torch.tanh(out)).mean()


def test_an_experts_tokens_glue_alike_whatever_its_counts():
    """[Note: data-sized values] in csrc/frontend/convert.cpp: the rows tracing observes at
    the smaller batch are the larger's last ones, so an expert chosen by no token of the
    other rows had the same count at both batch sizes and its tokens were not glued into
    their tasks: the ranks, whose counts differ, traced different graphs ("the model's
    control flow depends on its input data", a third of the seeds of a top-2 mixture on
    2 ranks; a probe's finding)."""
    torch.manual_seed(0)
    model = _RoutedBySign()
    mixed = torch.randn(4, 3, 4)
    mixed[:, :, 0] = torch.tensor([[1.0, -1, 1], [-1, 1, -1], [1, 1, -1], [-1, -1, 1]])
    same = mixed.clone()  # expert 1 only in the rows both observations see: one count
    same[:2, :, 0] = -1.0
    graphs = [rannc.trace(model, (x,)) for x in (mixed, same)]
    ops = [[t.op for t in g.ir.tasks()] for g in graphs]
    assert ops[0] == ops[1], ops
    for g, x in zip(graphs, (mixed, same)):
        torch.testing.assert_close(g(x), model(x))


def test_functional_call_inside_forward_is_named():
    """torch.func.functional_call in forward (per-sample work, a hypernetwork) failed with
    torch's "The stateless API can't be used with Jitted modules", naming no cause of
    rannc's; the TraceError names the call, its line and the cures."""
    class Hyper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Linear(4, 4)

        def forward(self, x):
            params = {k: v * 2 for k, v in self.inner.named_parameters()}
            return torch.func.functional_call(self.inner, params, (x,)).sum()

    with pytest.raises(rannc.TraceError, match=r"calls torch.func.functional_call .* in its forward "
                                               r"\(at .*test_frontend.py:\d+\).*outside the RaNNCModule"):
        rannc.trace(Hyper(), (torch.randn(4, 4),))


def test_vmap_over_the_rows_names_vmap_in_its_batch_size_error():
    """vmap over the batch records its batched ops at the traced batch size (an einsum's
    view holds it): the error named a view the user never wrote, with a cure that cannot be
    followed inside vmap. It names vmap, its line and the batched op as the cure; vmap of a
    module, whose batched op has no size in it, traces equal to the model."""
    class Norms(torch.nn.Module):
        def __init__(self, einsum):
            super().__init__()
            self.inner = torch.nn.Linear(4, 4)
            self.einsum = einsum

        def forward(self, x):
            h = torch.func.vmap(self.inner)(x)
            if self.einsum:
                h = torch.func.vmap(lambda a: torch.einsum("i,i->", a, a))(h)[:, None] * h
            return h

    with pytest.raises(rannc.TraceError, match=r"(?s)baked into a shape.*inside torch.func.vmap "
                                               r"\(at .*test_frontend.py:\d+\).*whole batch") as e:
        rannc.trace(Norms(True), (torch.randn(4, 4),))
    assert "Converting a tensor to a Python boolean" not in str(e.value)
    model, x = Norms(False), torch.randn(4, 4)
    torch.testing.assert_close(rannc.trace(model, (x,))(x), model(x))


def test_uninitialised_memory_does_not_decide_the_graph():
    """[Note: uninitialised values] in convert.cpp: torch.empty passed to baddbmm with beta=0
    (diffusers' classic attention) held whatever the heap held, which the observations
    compared between batch sizes: it was glued to its reader by chance, so ranks traced
    different graphs. It is observed as zeros: its own task, on every trace, and the trace
    computes what the model does."""
    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.o = (torch.nn.Linear(8, 8) for _ in range(4))

        def forward(self, x):
            q, k, v = self.q(x), self.k(x), self.v(x)
            base = torch.empty(x.shape[0], x.shape[1], x.shape[1], dtype=q.dtype)
            scores = torch.baddbmm(base, q, k.transpose(-1, -2), beta=0, alpha=8 ** -0.5)
            return self.o(scores.softmax(-1) @ v)

    model, x = Attention(), torch.randn(4, 5, 8)
    for _ in range(3):
        junk = [torch.randn(4 * 5 * 5) * 1e30 for _ in range(16)]  # the heap, written
        del junk
        traced = rannc.trace(model, (x,))
        assert [t.op for t in traced.ir.tasks() if "empty" in t.op] == ["aten::empty"]
        torch.testing.assert_close(traced(x), model(x))


def test_control_flow_of_a_scripted_function_is_named_with_its_cure():
    """A function compiled by torch.jit.script with an if in it traces as a prim::If with
    blocks, which the message called something "a trace should not produce"; it names
    torch.jit.script and the cures. Without control flow such a function traces equal."""
    @torch.jit.script
    def gate(h):
        g = torch.sigmoid(h)
        if bool(g.mean() > 0.5):
            return h * g
        return h + g

    @torch.jit.script
    def plain(h):
        return h * torch.sigmoid(h)

    class Gated(torch.nn.Module):
        def __init__(self, f):
            super().__init__()
            self.lin, self.f = torch.nn.Linear(4, 4), f

        def forward(self, x):
            return self.f(self.lin(x))

    with pytest.raises(rannc.TraceError, match=r"control flow .* compiled by torch.jit.script.*"
                                               r"without torch.jit.script"):
        rannc.trace(Gated(gate), (torch.randn(4, 4),))
    model, x = Gated(plain), torch.randn(4, 4)
    torch.testing.assert_close(rannc.trace(model, (x,))(x), model(x))


@pytest.mark.parametrize("by_frequency", [False, True])
def test_an_embedding_scaled_by_token_frequency_couples_the_rows(by_frequency):
    """nn.Embedding(scale_grad_by_freq=True) divides each token's gradient by its count in
    the batch: each micro-batch counted its own tokens (the gradient 81% off with 2 micro-
    batches on 2 replicas), without a word. It couples the rows ([Note: rows coupled] in
    planning.py): named, planned with one micro-batch."""
    from rannc.planning import rows_coupled

    class Tokens(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 8, scale_grad_by_freq=by_frequency)
            self.head = torch.nn.Linear(8, 1)

        def forward(self, ids, y):
            return torch.nn.functional.mse_loss(self.head(self.emb(ids)).mean(1).squeeze(1), y)

    model, args = Tokens(), (torch.randint(0, 10, (16, 4)), torch.randn(16))
    said = rows_coupled(rannc.trace(model, args))
    assert bool(said) == by_frequency and all("scale_grad_by_freq=True" in s for s in said), said
    plan = rannc.plan(model, args, world_size=2, num_stages=2, cost_model="analytic")
    assert (plan.micro_batches == 1) == by_frequency, plan.micro_batches
