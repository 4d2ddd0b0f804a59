"""The model zoo the tests run over: each entry builds a model and example arguments.

Every model computes something a user would train: an MLP, a residual CNN with batch
norm, nn.TransformerEncoder, a GPT-style decoder (tied embeddings, causal mask, loss
inside), and a model with several inputs, kwargs and a dict output.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from models import GPT, ResNet  # examples/models.py: the tests run the example models


class MLP(nn.Module):
    def __init__(self, d_in=16, hidden=32, d_out=4, dropout=0.1):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.GELU(), nn.Dropout(dropout),
                                 nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, d_out))

    def forward(self, x, y):
        return F.mse_loss(self.net(x), y)


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


def no_dropout(model):
    """Switches dropout off (in place; returns the model): its masks differ between a
    pipelined run and a single process."""
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        if isinstance(m, nn.MultiheadAttention):
            m.dropout = 0.0
    return model


def make(name, batch=4, seed=0):
    """Returns (model, args, kwargs) for a zoo entry at the given batch size."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    if name == "mlp":
        return MLP(), (torch.randn(batch, 16, generator=g), torch.randn(batch, 4, generator=g)), {}
    if name == "resnet":
        return ResNet(), (torch.randn(batch, 3, 8, 8, generator=g),
                          torch.randint(0, 5, (batch,), generator=g)), {}
    if name == "transformer":
        return Encoder(), (torch.randn(batch, 6, 16, generator=g),), {}
    if name == "transformer_loss":
        return Encoder(), (torch.randn(batch, 6, 16, generator=g),), {
            "labels": torch.randint(0, 3, (batch,), generator=g)}
    if name == "gpt":
        return GPT(), (torch.randint(0, 50, (batch, 8), generator=g),
                       torch.randint(0, 50, (batch, 8), generator=g)), {}
    if name == "multi_io":
        x, y = torch.randn(batch, 8, generator=g), torch.randn(batch, 8, generator=g)
        kwargs = {"mask": (torch.rand(batch, 8, generator=g) > 0.2).float(),
                  "pair": (torch.randn(batch, generator=g), torch.randn(8, generator=g)),
                  "extra": {"biases": [torch.randn(8, generator=g), torch.randn(batch, 1, generator=g)]},
                  "scale": 0.5}
        return MultiIO(), (x, y), kwargs
    raise KeyError(name)


NAMES = ["mlp", "resnet", "transformer", "gpt", "multi_io"]
