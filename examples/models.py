"""Example models, written as ordinary PyTorch with no hint of parallelism; each computes
its loss inside forward (the way rannc expects a training model to look).

GPT: a decoder with tied input/output embedding and a causal mask (next-token loss).
BERT: an encoder with a masked-language-model head on tied embeddings.
ResNet: a residual CNN with batch norm (classification loss).
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class TransformerConfig:
    """Sizes of the GPT and BERT examples."""
    vocab: int = 50
    hidden: int = 16
    heads: int = 2
    layers: int = 2
    max_len: int = 16
    dropout: float = 0.1


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.tril(torch.ones(t, t, dtype=torch.bool, device=x.device))
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, d)
        return self.proj(y)


class GPTBlock(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        d = cfg.hidden
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = CausalSelfAttention(cfg)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d),
                                 nn.Dropout(cfg.dropout))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: TransformerConfig = TransformerConfig()):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos = nn.Embedding(cfg.max_len, cfg.hidden)
        self.blocks = nn.ModuleList([GPTBlock(cfg) for _ in range(cfg.layers)])
        self.ln = nn.LayerNorm(cfg.hidden)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        self.lm_head.weight = self.tok.weight  # tied input/output embedding

    def forward(self, ids, targets):
        t = ids.size(1)
        pos = torch.arange(t, device=ids.device)
        x = self.tok(ids) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class BERT(nn.Module):
    def __init__(self, cfg: TransformerConfig = TransformerConfig()):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos = nn.Embedding(cfg.max_len, cfg.hidden)
        self.ln = nn.LayerNorm(cfg.hidden)
        layer = nn.TransformerEncoderLayer(cfg.hidden, cfg.heads, 4 * cfg.hidden, cfg.dropout,
                                           activation="gelu", batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, cfg.layers, enable_nested_tensor=False)
        self.head = nn.Sequential(nn.Linear(cfg.hidden, cfg.hidden), nn.GELU(),
                                  nn.LayerNorm(cfg.hidden))
        self.decoder = nn.Linear(cfg.hidden, cfg.vocab)
        self.decoder.weight = self.tok.weight  # tied

    def forward(self, ids, labels):
        """labels: the original token where the input is masked, -100 elsewhere."""
        pos = torch.arange(ids.size(1), device=ids.device)
        h = self.encoder(self.ln(self.tok(ids) + self.pos(pos)))
        logits = self.decoder(self.head(h))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1),
                               ignore_index=-100)


class ResidualBlock(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(h)))


class ResNet(nn.Module):
    def __init__(self, channels=8, blocks=2, classes=5):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1), nn.BatchNorm2d(channels),
                                  nn.ReLU())
        self.blocks = nn.Sequential(*[ResidualBlock(channels) for _ in range(blocks)])
        self.head = nn.Linear(channels, classes)

    def forward(self, images, labels):
        h = self.blocks(self.stem(images))
        logits = self.head(F.adaptive_avg_pool2d(h, 1).flatten(1))
        return F.cross_entropy(logits, labels)

