"""Model factories the pipeline's tests name by dotted path (`model.factory: tests.plugin_models:...`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def dropout_batchnorm_mlp(in_features: int, classes: int, hidden: int = 16, dropout: float = 0.5) -> nn.Module:
    """An MLP with BatchNorm and Dropout: random in train mode, deterministic in eval mode."""
    return nn.Sequential(nn.Flatten(), nn.Linear(in_features, hidden), nn.BatchNorm1d(hidden), nn.Tanh(), nn.Dropout(dropout), nn.Linear(hidden, classes))


class Logits(nn.Module):
    """A Hugging Face model called on token ids (stored as numbers, cast to integers), returning its logits."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids.long()).logits


def gpt2_lm(n_layer: int = 2, n_embd: int = 64, n_head: int = 2, vocab_size: int = 256, n_positions: int = 32, dropout: float = 0.1) -> nn.Module:
    """transformers' GPT-2 (Conv1D projections, lm_head tied to the token embedding), random weights: no download.
    `dropout`: GPT-2's embedding, attention and residual dropout (its default 0.1)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab_size, n_positions=n_positions, bos_token_id=0, eos_token_id=0,
                        embd_pdrop=dropout, attn_pdrop=dropout, resid_pdrop=dropout)
    return Logits(GPT2LMHeadModel(config))


def bert_classifier(hidden: int = 32, layers: int = 2, heads: int = 2, vocab_size: int = 256, classes: int = 3, max_len: int = 32) -> nn.Module:
    """transformers' BERT sequence classifier (nn.Linear layers, embeddings, LayerNorm, a pooler), random weights."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=2 * hidden, max_position_embeddings=max_len, num_labels=classes)
    return Logits(BertForSequenceClassification(config))


class ResidualBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels)
        self.conv2, self.bn2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.relu(h + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(h))))))


def resnet(side: int = 8, channels: int = 8, blocks: int = 1, classes: int = 10) -> nn.Module:
    """A ResNet-style CNN for flat (side·side) grey images: a convolution stem with BatchNorm, residual blocks,
    global average pooling and a linear head."""
    return nn.Sequential(
        nn.Unflatten(1, (1, side, side)),
        nn.Conv2d(1, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU(),
        *(ResidualBlock(channels) for _ in range(blocks)),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, classes),
    )


def additive_mask(attention_mask: torch.Tensor, dtype: torch.dtype, causal: bool) -> torch.Tensor:
    """The 2-D 0/1 padding mask as the 4-D additive mask (batch, 1, query, key) attention takes as it is: transformers
    reads a 2-D mask's values to pick a kernel (`mask.all()`), which per-example vmap cannot trace."""
    keep = attention_mask[:, None, None, :].bool()
    if causal:
        length = attention_mask.shape[-1]
        keep = keep & torch.ones(length, length, dtype=torch.bool, device=attention_mask.device).tril()
    return torch.zeros(keep.shape, dtype=dtype, device=attention_mask.device).masked_fill(~keep, torch.finfo(dtype).min)


class FieldsModel(nn.Module):
    """A Hugging Face model called with named fields, `model(input_ids=..., attention_mask=...)`, returning logits."""

    def __init__(self, model: nn.Module, causal: bool) -> None:
        super().__init__()
        self.model, self.causal = model, causal

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        dtype = next(self.model.parameters()).dtype
        return self.model(input_ids=input_ids, attention_mask=additive_mask(attention_mask, dtype, self.causal)).logits


def bert_fields(hidden: int = 32, layers: int = 2, heads: int = 2, vocab_size: int = 64, classes: int = 3, max_len: int = 32) -> nn.Module:
    """bert_classifier's BERT, called on input_ids and attention_mask."""
    return FieldsModel(bert_classifier(hidden, layers, heads, vocab_size, classes, max_len).model, causal=False)


def gpt2_fields(n_layer: int = 2, n_embd: int = 32, n_head: int = 2, vocab_size: int = 64, n_positions: int = 16) -> nn.Module:
    """gpt2_lm's GPT-2, called on input_ids and attention_mask."""
    return FieldsModel(gpt2_lm(n_layer, n_embd, n_head, vocab_size, n_positions).model, causal=True)


class MeanEmbedding(nn.Module):
    """The mean of the unmasked token embeddings through a tanh layer and a linear head, called with input_ids and
    attention_mask: a model of named fields small enough for every stage's options."""

    def __init__(self, vocab_size: int, width: int, classes: int) -> None:
        super().__init__()
        self.embedding, self.hidden, self.head = nn.Embedding(vocab_size, width), nn.Linear(width, width), nn.Linear(width, classes)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        mask = attention_mask[..., None].to(self.embedding.weight.dtype)
        return self.head(torch.tanh(self.hidden((self.embedding(input_ids) * mask).sum(1) / mask.sum(1).clamp_min(1))))


def mean_embedding(vocab_size: int = 64, width: int = 8, classes: int = 3) -> nn.Module:
    return MeanEmbedding(vocab_size, width, classes)


def raising(in_features: int = 64, classes: int = 10) -> nn.Module:
    """A factory that fails, as user code does."""
    raise RuntimeError("no pretrained weights for this size")


class WithHidden(nn.Module):
    """Returns a tuple (logits, hidden), as many research models do."""

    def __init__(self, in_features: int, classes: int) -> None:
        super().__init__()
        self.hidden, self.head = nn.Linear(in_features, 8), nn.Linear(8, classes)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = torch.tanh(self.hidden(x))
        return self.head(hidden), hidden


def tuple_output(in_features: int = 64, classes: int = 10) -> nn.Module:
    return WithHidden(in_features, classes)


class RandomForward(nn.Module):
    """An MLP whose forward pass draws random numbers without a dropout module: F.dropout in training mode
    (`kind='dropout'`) or Gaussian noise from torch.randn (`kind='noise'`); `kind='none'` draws nothing."""

    def __init__(self, in_features: int, classes: int, kind: str) -> None:
        super().__init__()
        self.kind, self.hidden, self.head = kind, nn.Linear(in_features, 8), nn.Linear(8, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.hidden(x.flatten(1)))
        if self.kind == "dropout":
            h = F.dropout(h, 0.3, self.training)
        elif self.kind == "noise":
            h = h + 0.01 * torch.randn_like(h)
        return self.head(h)


def random_forward(in_features: int = 64, classes: int = 10, kind: str = "dropout") -> nn.Module:
    return RandomForward(in_features, classes, kind)


def batch_statistics_mlp(in_features: int = 64, classes: int = 10, hidden: int = 16) -> nn.Module:
    """An MLP whose BatchNorm1d keeps no running statistics: it normalises every batch by that batch's own."""
    return nn.Sequential(nn.Flatten(), nn.Linear(in_features, hidden), nn.BatchNorm1d(hidden, track_running_stats=False), nn.Tanh(), nn.Linear(hidden, classes))


class RootOfLayer(nn.Module):
    """√|W x| through a linear head: its gradient is infinite where W x = 0, as at an all-zero input."""

    def __init__(self, in_features: int, classes: int) -> None:
        super().__init__()
        self.hidden, self.head = nn.Linear(in_features, 8, bias=False), nn.Linear(8, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.hidden(x.flatten(1)).abs().sqrt())


def root_of_layer(in_features: int = 64, classes: int = 10) -> nn.Module:
    return RootOfLayer(in_features, classes)


def pretrained_mlp(weights: str, hidden: int = 6) -> nn.Module:
    """A digits MLP (64-hidden-10, float64) whose weights the factory reads from a file itself, as a
    `from_pretrained` does: the pipeline never sees the file, only the weights it builds."""
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.Tanh(), nn.Linear(hidden, 10)).double()
    model.load_state_dict(torch.load(weights, weights_only=True))
    return model
