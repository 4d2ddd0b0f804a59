"""The model zoo the tests run over: each entry builds a model and example arguments.

Every model computes something a user would train: an MLP, a residual CNN with batch
norm, nn.TransformerEncoder, a GPT-style decoder (tied embeddings, causal mask, loss
inside), and a model with several inputs, kwargs and a dict output.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree

from models import BERT, GPT, ResNet  # examples/models.py: the tests run the example models


class MLP(nn.Module):
    def __init__(self, d_in=16, hidden=32, d_out=4, dropout=0.1):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.GELU(), nn.Dropout(dropout),
                                 nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, d_out))

    def forward(self, x, y):
        return F.mse_loss(self.net(x), y)


class TinyLossMLP(MLP):
    """An MLP whose loss is 2^-16 of the MSE: under fp16 autocast its activation
    gradients fall below fp16's normal range unless the loss scaler's factor seeds the
    backward ([Note: scaled seeds] in rannc/amp.py)."""

    def forward(self, x, y):
        return super().forward(x, y) * 2.0 ** -16


class Encoder(nn.Module):
    def __init__(self, d_model=16, heads=2, layers=2, classes=3):
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model, heads, 2 * d_model, dropout=0.1,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, classes)

    def forward(self, x, labels=None):
        logits = self.head(self.encoder(x).mean(dim=1))
        return logits if labels is None else F.cross_entropy(logits, labels)


class MultiIO(nn.Module):
    """Several inputs, kwargs (a tensor, a tuple, a dict of lists, a constant) and a dict
    output holding a tuple."""

    def __init__(self, d=8):
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)
        self.gate = nn.Parameter(torch.ones(d))

    def forward(self, x, y, *, mask=None, pair=(None, None), extra=None, scale=1.0):
        h = torch.tanh(self.a(x)) * self.gate + self.b(y) * scale
        if mask is not None:
            h = h * mask
        first, second = pair
        h = h + first.unsqueeze(1) - second
        for bias in extra["biases"]:
            h = h + bias
        return {"hidden": h, "score": h.pow(2).mean(), "aux": (x.sum(dim=1), y * 2)}


class Batches:
    """Global batches of a zoo entry and this rank's rows of them: with `local_batch` rows
    per rank, rank r owns global rows [r * local_batch, (r + 1) * local_batch).

    Which arguments carry the batch is found by building them at two batch sizes: a
    tensor whose first dimension only happens to equal the global batch (multi_io's
    feature vector of 8 on 2 ranks x 4 rows) is not cut."""

    def __init__(self, name, world, rank):
        self.name, self.world, self.rank = name, world, rank
        sizes = []
        for b in (4 * world, 4 * world + 1):
            _, args, kwargs = make(name, batch=b, seed=0)
            sizes.append([t.shape[0] if isinstance(t, torch.Tensor) and t.dim() else None
                          for t in pytree.tree_leaves((args, kwargs))])
        self.batch_leaves = [x is not None and x != y for x, y in zip(*sizes)]
        self.start, self.stop = 4 * rank, 4 * (rank + 1)

    def rows(self, t):
        """This rank's rows of a batch-shaped tensor of the last call."""
        return t[self.start:self.stop]

    def __call__(self, seed, local_batch=4, input_grad=False, length=None):
        """((global args, kwargs), (this rank's args, kwargs)) of batch `seed` (sequences of
        `length`, default the entry's). With `input_grad`, the floating arguments are leaves
        that require grad, the global ones and this rank's apart (its rows, or its own copy
        of a tensor without a batch)."""
        self.start, self.stop = local_batch * self.rank, local_batch * (self.rank + 1)
        _, args, kwargs = make(self.name, batch=local_batch * self.world, seed=seed, length=length)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if input_grad:
            leaves = [t.detach().requires_grad_() if _floating(t) else t for t in leaves]
        mine = []
        for t, is_batch in zip(leaves, self.batch_leaves):
            if _floating(t) and input_grad:
                t = (self.rows(t) if is_batch else t).detach().clone().requires_grad_()
            elif is_batch:
                t = self.rows(t)
            mine.append(t)
        return pytree.tree_unflatten(leaves, spec), pytree.tree_unflatten(mine, spec)


def _floating(t):
    return isinstance(t, torch.Tensor) and t.is_floating_point()


def loss_of(out):
    """The loss among a model's outputs: a transformers ModelOutput's, multi_io's score,
    or the output itself."""
    if hasattr(out, "loss"):
        return out.loss
    return out["score"] if isinstance(out, dict) else out


def full_fp32():
    """Float32 matmuls and convolutions in full precision on the GPU: cuDNN convolutions
    use TF32 by default (ResNet's loss read 0.8% off the CPU's at step 0)."""
    if hasattr(torch.backends, "fp32_precision"):  # torch >= 2.9
        torch.backends.cuda.matmul.fp32_precision = "ieee"
    else:
        torch.backends.cuda.matmul.allow_tf32 = False
    # cuDNN by its one flag: with conv and rnn set apart (the newer API),
    # torch.backends.cudnn.flags(), which transformers' CTC loss enters, raises
    torch.backends.cudnn.allow_tf32 = False


def train_mode(name):
    """How train_check.py trains a zoo entry: "outside" for a model without a loss (the
    loss is made from its outputs; fill-drain), else "plain" (loss.backward())."""
    return "outside" if name == "transformer" else "plain"


class LateInput(nn.Module):
    """A second input consumed only by the last layers (with several stages it goes
    straight to a later stage), and a tensor without a batch dimension (`bias`)."""

    def __init__(self, d=16):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Linear(d, d), nn.Tanh(),
                                  nn.Linear(d, d), nn.Tanh(), nn.Linear(d, d))
        self.late = nn.Linear(d, d)
        self.head = nn.Linear(d, 4)

    def forward(self, x, z, y, bias):
        h = self.body(x) * torch.sigmoid(self.late(z)) + bias
        return F.mse_loss(self.head(h), y)


class LateScalar(nn.Module):
    """torch.arange of a 0-dim tensor: the trace makes the tensor a Scalar argument
    (aten::ScalarImplicit, kind other) right before the arange; a stage boundary between the
    two gives the later stage that Scalar to compute from its rows (a shape value)."""

    def __init__(self, d=64):
        super().__init__()
        self.first = nn.Sequential(*[nn.Linear(d, d) for _ in range(3)])
        self.second = nn.Sequential(*[nn.Linear(d, d) for _ in range(3)])

    def forward(self, x, y):
        h = self.first(x)
        r = torch.arange(torch.tensor(h.size(1)))
        return F.mse_loss(self.second(h + r), y)


def no_dropout(model):
    """Switches dropout off (in place; returns the model): its masks differ between a
    pipelined run and a single process."""
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        if isinstance(m, nn.MultiheadAttention):
            m.dropout = 0.0
    return model


def make(name, batch=4, seed=0, length=None):
    """Returns (model, args, kwargs) for a zoo entry at the given batch size; `length`: the
    sequence length of the models that take sequences (gpt, transformer, hf_ language models)."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    if name in ("mlp", "mlp_tiny_loss"):
        model = MLP() if name == "mlp" else TinyLossMLP()
        return model, (torch.randn(batch, 16, generator=g), torch.randn(batch, 4, generator=g)), {}
    if name == "resnet":
        return ResNet(), (torch.randn(batch, 3, 8, 8, generator=g),
                          torch.randint(0, 5, (batch,), generator=g)), {}
    if name == "transformer":
        return Encoder(), (torch.randn(batch, length or 6, 16, generator=g),), {}
    if name == "transformer_loss":
        return Encoder(), (torch.randn(batch, length or 6, 16, generator=g),), {
            "labels": torch.randint(0, 3, (batch,), generator=g)}
    if name == "gpt":
        return GPT(), (torch.randint(0, 50, (batch, length or 8), generator=g),
                       torch.randint(0, 50, (batch, length or 8), generator=g)), {}
    if name == "bert_mlm":
        # a masked-language-model loss: the mean over the masked tokens only (labels -100
        # elsewhere), so each micro-batch's count differs; every third row masks nothing
        ids = torch.randint(0, 50, (batch, length or 8), generator=g)
        masked = torch.rand(ids.shape, generator=g) < 0.3
        masked[::3] = False
        model = BERT()
        for layer in model.encoder.layers:
            # the key bias's gradient is zero in exact arithmetic; Adam would make its float
            # noise (1e-8 here) into steps that differ by more than the comparison allows
            layer.self_attn.in_proj_bias.requires_grad_(False)
        return model, (ids, torch.where(masked, ids, torch.full_like(ids, -100))), {}
    if name == "multi_io":
        x, y = torch.randn(batch, 8, generator=g), torch.randn(batch, 8, generator=g)
        kwargs = {"mask": (torch.rand(batch, 8, generator=g) > 0.2).float(),
                  "pair": (torch.randn(batch, generator=g), torch.randn(8, generator=g)),
                  "extra": {"biases": [torch.randn(8, generator=g), torch.randn(batch, 1, generator=g)]},
                  "scale": 0.5}
        return MultiIO(), (x, y), kwargs
    if name == "late_input":
        return LateInput(), (torch.randn(batch, 16, generator=g), torch.randn(batch, 16, generator=g),
                             torch.randn(batch, 4, generator=g), torch.randn(16, generator=g)), {}
    if name == "late_scalar":
        return LateScalar(), (torch.randn(batch, 64, generator=g), torch.randn(batch, 64, generator=g)), {}
    if name.startswith("hf_"):
        import hf_zoo  # transformers models (tests/python/hf_zoo.py)
        return hf_zoo.make(name, batch=batch, seed=seed, length=length)
    raise KeyError(name)


NAMES = ["mlp", "resnet", "transformer", "gpt", "multi_io"]
