"""Sequence-first recurrent models ([Note: batch dimensions] in _trace.py), against PyTorch
on the global batch.

    mpirun -np N python seq_first_check.py STAGES [REPLICAS]

classifier: nn.LSTM without batch_first over x [sequence, batch, features], labels [batch],
the loss inside (1F1B). lm: PyTorch's word language model, tokens [sequence, batch], the
hidden state [layers, batch, hidden] passed in and carried to the next call detached
(truncated backpropagation through time), the loss made outside (fill-drain); its last
chunk is as long as the LSTM has layers (word_language_model's get_batch cuts it short), so
dimension 0 of every argument has as many rows: traced again, it failed, taking the
sequence as the batch. batch_first_lm: an LSTM with batch_first=True, whose hidden state is
[layers, batch, hidden] all the same, passed in: it failed, as its batch is in dimension 1.
transformer_lm: PyTorch's language-model tutorial (nn.TransformerEncoder without
batch_first, a causal mask, tokens [sequence, batch], the loss inside). Each trains 3 SGD
steps equal to PyTorch on the rows of every rank, in 2 micro-batches; the batch is
dimension 1 of the arguments that have it there. Before session 30 the sequence was cut
into micro-batches and each piece trained on something else without an error; before
session 31 the transformer's layers were glued into one task (right, but one stage).
"""
import math
import copy
import sys

import torch
import torch.nn.functional as F

torch.set_num_threads(1)

import rannc  # noqa: E402

stages = int(sys.argv[1])
replicas = sys.argv[2] if len(sys.argv) > 2 else None
rank, world = rannc.get_rank(), rannc.get_world_size()
ROWS, SEQ, VOCAB = 4, 6, 20


class Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(5, 16)
        self.lstm = torch.nn.LSTM(16, 16, num_layers=2)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x, labels):
        h, _ = self.lstm(torch.tanh(self.inp(x)))
        return F.cross_entropy(self.head(h[-1]), labels)


class WordLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.Embedding(VOCAB, 16)
        self.rnn = torch.nn.LSTM(16, 16, num_layers=2)
        self.decoder = torch.nn.Linear(16, VOCAB)

    def forward(self, tokens, hidden):
        out, hidden = self.rnn(self.encoder(tokens), hidden)
        return self.decoder(out), hidden


class BatchFirstLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.Embedding(VOCAB, 16)
        self.rnn = torch.nn.LSTM(16, 16, num_layers=2, batch_first=True)
        self.decoder = torch.nn.Linear(16, VOCAB)

    def forward(self, tokens, hidden, targets):
        out, hidden = self.rnn(self.encoder(tokens), hidden)
        return F.cross_entropy(self.decoder(out).reshape(-1, VOCAB), targets.reshape(-1)), hidden


class TransformerLM(torch.nn.Module):
    """PyTorch's tutorial language model ("Language modeling with nn.Transformer"):
    sequence first, sinusoidal positions, a causal mask."""

    def __init__(self, d_model=16):
        super().__init__()
        position = torch.arange(32).unsqueeze(1)
        div = torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
        pe = torch.zeros(32, 1, d_model)
        pe[:, 0, 0::2], pe[:, 0, 1::2] = torch.sin(position * div), torch.cos(position * div)
        self.register_buffer("pe", pe)
        self.embedding = torch.nn.Embedding(VOCAB, d_model)
        layer = torch.nn.TransformerEncoderLayer(d_model, 2, 32, dropout=0.0)
        self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.linear = torch.nn.Linear(d_model, VOCAB)
        self.d_model = d_model

    def forward(self, tokens, targets):
        mask = torch.nn.Transformer.generate_square_subsequent_mask(tokens.size(0))
        x = self.embedding(tokens) * math.sqrt(self.d_model) + self.pe[:tokens.size(0)]
        out = self.linear(self.encoder(x, mask, is_causal=True))
        return F.cross_entropy(out.view(-1, VOCAB), targets.reshape(-1))


def check(name, make, step, batch_dim=1):
    torch.manual_seed(0)
    model = make()
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    wrapped = rannc.RaNNCModule(model, opt, num_stages=stages, num_microbatches=2,
                                replicas=replicas)
    state = None
    for i in range(3):
        state = step(wrapped, reference, i, state)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    got = wrapped.state_dict()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-6,
                                   msg=lambda m: f"rank {rank}, {name}, {key}: {m}")
    traced = wrapped._deployed[True].graph
    dims = [traced.ir.value(v).batch_dim for v in traced.ir.inputs if traced.ir.value(v).role == "input"]
    assert dims[0] == batch_dim, (name, dims)
    if name == "transformer_lm":  # no task glues every layer together (14 tasks then)
        sizes = [len(s.tasks) for s in wrapped.deployments["train"].stages]
        assert len(sizes) == stages and sum(sizes) > 100, (name, sizes)


def rows(t, dim):
    return t.narrow(dim, rank * ROWS, ROWS)


def classifier_step(wrapped, reference, i, state):
    g = torch.Generator().manual_seed(i)
    x = torch.randn(SEQ, ROWS * world, 5, generator=g)
    labels = torch.randint(0, 3, (ROWS * world,), generator=g)
    loss = wrapped(rows(x, 1), rows(labels, 0))
    ref = reference(x, labels)
    torch.testing.assert_close(loss.detach(), ref.detach(), rtol=1e-5, atol=1e-6)
    loss.backward()
    ref.backward()


def lm_step(wrapped, reference, i, state):
    g = torch.Generator().manual_seed(10 + i)
    length = SEQ if i < 2 else 2  # the last chunk: as long as the LSTM has layers
    data = torch.randint(0, VOCAB, (length + 1, ROWS * world), generator=g)
    tokens, targets = data[:-1], data[1:]
    if state is None:
        state = [tuple(torch.zeros(2, ROWS * world, 16) for _ in range(2))] * 2
    mine, theirs = state
    out, hidden = wrapped(rows(tokens, 1), tuple(rows(h, 1) for h in mine))
    ref_out, ref_hidden = reference(tokens, theirs)
    torch.testing.assert_close(out, rows(ref_out, 1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(hidden[0], rows(ref_hidden[0], 1), rtol=1e-5, atol=1e-6)
    # each rank's loss over its own rows; DDP's averaging makes the global batch's
    F.cross_entropy(out.reshape(-1, VOCAB), rows(targets, 1).reshape(-1)).backward()
    F.cross_entropy(ref_out.reshape(-1, VOCAB), targets.reshape(-1)).backward()
    # truncated backpropagation through time: the hidden state goes on, detached; every
    # rank's rows of it in the next call, as the reference's whole
    full = tuple(torch.cat(rannc_all_gather(h.detach()), dim=1) for h in hidden)
    return [full, tuple(h.detach() for h in ref_hidden)]


def batch_first_lm_step(wrapped, reference, i, state):
    g = torch.Generator().manual_seed(30 + i)
    data = torch.randint(0, VOCAB, (ROWS * world, SEQ + 1), generator=g)
    tokens, targets = data[:, :-1], data[:, 1:]
    if state is None:
        state = [tuple(torch.zeros(2, ROWS * world, 16) for _ in range(2))] * 2
    mine, theirs = state
    loss, hidden = wrapped(rows(tokens, 0), tuple(rows(h, 1) for h in mine), rows(targets, 0))
    ref, ref_hidden = reference(tokens, theirs, targets)
    torch.testing.assert_close(loss.detach(), ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(hidden[0], rows(ref_hidden[0], 1), rtol=1e-5, atol=1e-6)
    loss.backward()
    ref.backward()
    full = tuple(torch.cat(rannc_all_gather(h.detach()), dim=1) for h in hidden)
    return [full, tuple(h.detach() for h in ref_hidden)]


def rannc_all_gather(t):
    """Every rank's `t` (rows of the global hidden state), in rank order."""
    comm = rannc._C.Communicator.world_cpu()
    out = torch.empty(world, *t.shape)
    comm.all_gather(t.contiguous(), out).wait()
    return list(out)


def transformer_step(wrapped, reference, i, state):
    g = torch.Generator().manual_seed(20 + i)
    data = torch.randint(0, VOCAB, (SEQ + 1, ROWS * world), generator=g)
    tokens, targets = data[:-1], data[1:]
    loss = wrapped(rows(tokens, 1), rows(targets, 1))
    ref = reference(tokens, targets)
    torch.testing.assert_close(loss.detach(), ref.detach(), rtol=1e-5, atol=1e-6)
    loss.backward()
    ref.backward()


check("classifier", Classifier, classifier_step)
check("lm", WordLM, lm_step)
check("batch_first_lm", BatchFirstLM, batch_first_lm_step, batch_dim=0)
check("transformer_lm", TransformerLM, transformer_step)
print(f"OK rank {rank}", flush=True)
