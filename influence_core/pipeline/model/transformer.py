"""The built-in `transformer` architecture: a small pre-norm transformer over token ids, causal as a language model
(outputs (B, T, vocabulary)) or bidirectional as an encoder classifier (outputs (B, classes), mean-pooled).

Attention and the feed-forward layers are plain `nn.Linear` and the token embedding an untied `nn.Embedding`, so
influence contracts them without per-example gradients; the position embedding (of arange(T), shared by the batch)
and the layer norms go through `torch.func`.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class SelfAttention(nn.Module):
    """Multi-head scaled dot-product attention from four `nn.Linear` projections (causal when asked)."""

    def __init__(self, d_model: int, heads: int, causal: bool) -> None:
        super().__init__()
        self.heads, self.causal = heads, causal
        self.query, self.key, self.value, self.out = (nn.Linear(d_model, d_model) for _ in range(4))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        q, k, v = (proj(h).reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for proj in (self.query, self.key, self.value))
        logits = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)
        if self.causal:
            future = torch.ones(t, t, dtype=torch.bool, device=h.device).triu(1)
            logits = logits.masked_fill(future, float("-inf"))
        mixed = (logits.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d)
        return self.out(mixed)


class Block(nn.Module):
    """Pre-norm residual block: attention, then a GELU feed-forward layer four times wider."""

    def __init__(self, d_model: int, heads: int, causal: bool) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attention = SelfAttention(d_model, heads, causal)
        self.up, self.down = nn.Linear(d_model, 4 * d_model), nn.Linear(4 * d_model, d_model)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attention(self.norm1(h))
        return h + self.down(nn.functional.gelu(self.up(self.norm2(h))))


class TokenTransformer(nn.Module):
    """Token ids (B, T) → logits. `causal`: next-token logits at every position (a language model); else one row of
    class logits per example from the mean of the positions (an encoder classifier)."""

    def __init__(self, vocab_size: int, context: int, d_model: int, heads: int, layers: int, out_features: int, causal: bool) -> None:
        super().__init__()
        self.causal = causal
        self.tokens, self.positions = nn.Embedding(vocab_size, d_model), nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads, causal) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, out_features)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.long()  # integer sources store int64 ids; float sources hold them exactly below 2**24
        h = self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            h = block(h)
        h = self.norm(h)
        return self.head(h if self.causal else h.mean(1))
