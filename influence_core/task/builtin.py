"""The built-in tasks: classification (cross-entropy, or the margin as measurement), regression (MSE) and language
modelling (summed next-token cross-entropy; the completion's negative log-probability as measurement)."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from ..noise import ExampleNoise
from . import categorical
from .base import Task

IGNORE_INDEX = -100  # a label that is not scored (padding; a prompt), as in torch and Hugging Face


def _hits(logits: torch.Tensor, labels: torch.Tensor, scored: torch.Tensor) -> tuple[int, int]:
    """Positions where the argmax of `logits` (..., C) is `labels` (...), and positions, among the `scored` ones."""
    return int(((logits.argmax(-1) == labels) & scored).sum()), int(scored.sum())


def _unfit(outputs: torch.Tensor, targets: torch.Tensor, fix: str) -> ConfigError:
    return ConfigError("model", f"model outputs of shape {tuple(outputs.shape)} do not fit labels of shape {tuple(targets.shape)}", fix)


def _check_classes(outputs: torch.Tensor, targets: torch.Tensor, what: str) -> None:
    """Refuse the (B, C, ...) layout (classes in dimension 1) and labels (all rows) beyond the outputs."""
    head = targets[: len(outputs)]
    if outputs.shape[:-1] != head.shape:
        if outputs.ndim == head.ndim + 1 and outputs.ndim > 2 and outputs.shape[2:] == head.shape[1:]:
            raise ConfigError(
                "model",
                f"model outputs of shape {tuple(outputs.shape)} put the {what} in dimension 1 for labels of shape {tuple(head.shape)}",
                f"emit the {what} last, (batch, positions, {what}), e.g. return logits.transpose(1, 2)",
            )
        raise _unfit(outputs, head, f"emit one column per class, shape {tuple(head.shape)} + (classes,)")
    scored = targets[targets != IGNORE_INDEX]
    if len(scored) and int(scored.max()) >= outputs.shape[-1]:
        raise ConfigError(
            "model.output_dim",
            f"the model emits {outputs.shape[-1]} columns but the labels go up to {int(scored.max())}",
            f"give the model {int(scored.max()) + 1} outputs, one per class",
        )


class Classification(Task):
    """Cross-entropy over the last dimension: outputs (B, C) with class indices (B,) or class probabilities (B, C),
    or (B, ..., C) with labels (B, ...), an example's loss then the mean over its labels other than IGNORE_INDEX.
    measurement='margin' attributes −(f_y − logsumexp_{c≠y} f_c) (TRAK's, Kronfluence's) instead of the loss."""

    def __init__(self, measurement: Literal["loss", "margin"] = "loss", modules: tuple[str, ...] | None = None) -> None:
        if measurement not in ("loss", "margin"):
            raise ConfigError("task.measurement", f"unknown measurement {measurement!r}", "use 'loss' or 'margin'")
        self.kind, self.modules = measurement, modules

    def check(self, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        if targets.is_floating_point():
            if targets.shape[1:] == outputs.shape[1:] and self.kind == "loss":
                return  # soft labels
            raise ConfigError(
                "model.loss",
                f"cross_entropy takes integer class indices, but the labels are {str(targets.dtype).removeprefix('torch.')}",
                "store the labels as integers 0..C-1 (e.g. y.astype('int64')), or set model.loss to mse for real-valued targets",
            )
        _check_classes(outputs, targets, "classes")

    def _positions(self, outputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Logits (B, P, C), labels (B, P) and each position's weight in its example's mean (B, P)."""
        logits = outputs.reshape(len(outputs), -1, outputs.shape[-1])
        if targets.is_floating_point():  # soft labels (B, C): one position
            return logits, targets.reshape(logits.shape), torch.ones(len(outputs), 1, dtype=outputs.dtype, device=outputs.device)
        labels = targets.reshape(len(targets), -1)
        scored = (labels != IGNORE_INDEX).to(outputs.dtype)
        return logits, labels, scored / scored.sum(1, keepdim=True).clamp_min(1)

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits, labels, weights = self._positions(outputs, targets)
        ce = F.cross_entropy(logits.transpose(1, 2), labels.transpose(1, 2) if labels.is_floating_point() else labels, reduction="none", ignore_index=IGNORE_INDEX)
        return (ce * weights).sum(1)

    def correct(self, outputs: torch.Tensor, targets: torch.Tensor) -> tuple[int, int]:
        """The argmax class against the label (a soft label's argmax) at every scored position."""
        logits, labels, weights = self._positions(outputs, targets)
        truth = labels.argmax(-1) if labels.is_floating_point() else labels
        return _hits(logits, truth, weights > 0)

    def measurement(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.kind == "loss":
            return self.loss(outputs, targets)
        logits, labels, weights = self._positions(outputs, targets)
        own = torch.arange(logits.shape[-1], device=logits.device) == labels[..., None]
        margin = (logits * own).sum(-1) - logits.masked_fill(own, float("-inf")).logsumexp(-1)
        return -(margin * weights).sum(1)

    def exact_fisher(self, outputs: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
        logits, _, weights = self._positions(outputs, targets)
        return [c.reshape(outputs.shape) for c in categorical.exact_columns(logits, weights)]

    def sampled_fisher(self, outputs: torch.Tensor, targets: torch.Tensor, noise: ExampleNoise, offset: int, samples: int) -> list[torch.Tensor]:
        logits, _, weights = self._positions(outputs, targets)
        return [c.reshape(outputs.shape) for c in categorical.sampled_columns(logits, weights, noise, offset, samples)]


class Regression(Task):
    """Mean squared error over each example's outputs (a trailing singleton output fits 1-d targets)."""

    def __init__(self, modules: tuple[str, ...] | None = None) -> None:
        self.modules = modules

    def check(self, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        if outputs[0].numel() != targets[0].numel():
            raise _unfit(outputs, targets[: len(outputs)], "make the last layer emit one column per target (mse)")

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        flat = outputs.reshape(len(outputs), -1)
        return ((flat - targets.reshape(flat.shape).to(outputs.dtype)) ** 2).mean(1)

    def exact_fisher(self, outputs: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
        d = outputs[0].numel()  # ∇²ℓ = (2/d)·I
        basis = torch.eye(d, dtype=outputs.dtype, device=outputs.device) * (2.0 / d) ** 0.5
        return [basis[c].expand(outputs.shape[0], d).reshape(outputs.shape) for c in range(d)]

    def sampled_fisher(self, outputs: torch.Tensor, targets: torch.Tensor, noise: ExampleNoise, offset: int, samples: int) -> list[torch.Tensor]:
        n, d = len(outputs), outputs[0].numel()  # Gaussian noise with ∇²ℓ's covariance
        z = noise.normal(offset, offset + n, (n, samples, *outputs.shape[1:]), outputs)
        return [samples**-0.5 * (2.0 / d) ** 0.5 * z[:, k] for k in range(samples)]


class LanguageModelling(Task):
    """Next-token prediction. Outputs (B, T, V); targets (B, T) are the token ids aligned with the inputs (Hugging
    Face's `labels`), IGNORE_INDEX where not scored. An example's loss is Σ_t CE(f_t, y_{t+1}) over its scored tokens;
    the measurement is the same sum over the query's labels, −log p(completion | prompt) once `mask_prompt` has
    masked the prompt, so a positive score means the training example made the completion more likely."""

    def __init__(self, modules: tuple[str, ...] | None = None) -> None:
        self.modules = modules

    def check(self, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        if outputs.ndim != 3 or targets.ndim != 2 or targets.is_floating_point():
            raise _unfit(outputs, targets[: len(outputs)], "emit (batch, positions, vocabulary) logits for (batch, positions) integer token ids")
        _check_classes(outputs, targets, "vocabulary")

    def _next(self, outputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Logits that predict a next token (B, T-1, V), those tokens (B, T-1) and whether each is scored."""
        labels = targets[:, 1:]
        return outputs[:, :-1], labels, (labels != IGNORE_INDEX).to(outputs.dtype)

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits, labels, _ = self._next(outputs, targets)
        return F.cross_entropy(logits.transpose(1, 2), labels, reduction="none", ignore_index=IGNORE_INDEX).sum(1)

    def correct(self, outputs: torch.Tensor, targets: torch.Tensor) -> tuple[int, int]:
        """The argmax token against the next token, at every scored position."""
        logits, labels, scored = self._next(outputs, targets)
        return _hits(logits, labels, scored > 0)

    def fisher_passes(self, outputs: torch.Tensor) -> int:
        return (outputs.shape[1] - 1) * outputs.shape[2]

    def _padded(self, columns: list[torch.Tensor]) -> list[torch.Tensor]:
        """Cotangents on the T-1 predicting positions, zero at the last one (it predicts nothing)."""
        return [F.pad(c, (0, 0, 0, 1)) for c in columns]

    def exact_fisher(self, outputs: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
        logits, _, scored = self._next(outputs, targets)
        return self._padded(categorical.exact_columns(logits, scored))

    def sampled_fisher(self, outputs: torch.Tensor, targets: torch.Tensor, noise: ExampleNoise, offset: int, samples: int) -> list[torch.Tensor]:
        logits, _, scored = self._next(outputs, targets)
        return self._padded(categorical.sampled_columns(logits, scored, noise, offset, samples))


def mask_prompt(labels: torch.Tensor, prompt_lengths: torch.Tensor) -> torch.Tensor:
    """Query labels (B, T) with each example's first prompt_lengths[i] tokens set to IGNORE_INDEX: the measurement
    then scores the completion only."""
    prompt = torch.arange(labels.shape[1], device=labels.device) < prompt_lengths.to(labels.device)[:, None]
    return labels.masked_fill(prompt, IGNORE_INDEX)
