"""The Task: what influence attributes, for any model (Kronfluence's `Task`, shaped for this library's operators).

score[t, i] = ∇m(z_t)ᵀ (H + λI)⁻¹ ∇ℓ(z_i), with ℓ the per-example training loss and m the query measurement, a
quantity training lowers (the loss by default), so a positive score means training example i helped query t.
The Fisher (K-FAC, EK-FAC) needs output cotangents v with Σ v vᵀ = ∇²ℓ(f) per example: exactly (one backward pass
per column of a square root) or in expectation (targets drawn from the model, one backward pass per draw).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch.func import grad, vjp

from ..noise import ExampleNoise

LANCZOS_STEPS = 32  # Krylov dimension of the generic sampled Fisher's H^(1/2) z (exact up to this many outputs)
EXACT_FISHER_MAX_PASSES = 64  # "auto" takes the exact expectation up to this many backward passes per example, samples above


def resolve_fisher(kind: str, passes: int) -> str:
    """'auto' → 'exact' when the exact Fisher takes at most EXACT_FISHER_MAX_PASSES backward passes per example
    (one per column of its square root), else 'sampled' (one per draw); whatever the task, callable losses included."""
    if kind != "auto":
        return kind
    return "exact" if passes <= EXACT_FISHER_MAX_PASSES else "sampled"


class Task(ABC):
    """Subclass and give `loss` (per-example training losses); override the rest where the defaults do not fit.

    `modules`: the modules to track when a method is given none (module names; K-FAC/EK-FAC also take layer types
    such as "Conv1D"); None tracks every parameter (K-FAC/EK-FAC: every supported layer). The generic Fisher uses only `loss`: exact from the eigenvectors of each example's output
    Hessian, sampled as H^(1/2) z with z ~ N(0, I) by Lanczos; the built-in tasks give closed forms.
    """

    modules: tuple[str, ...] | None = None

    def output(self, raw: Any) -> torch.Tensor:
        """The tensor the loss reads from the model's return value: `.logits` of a Hugging Face output, else itself."""
        return getattr(raw, "logits", raw)

    def check(self, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        """Refuse (ConfigError naming the field) outputs whose layout this task cannot interpret; called before work.
        `targets` may hold more rows than `outputs` (all the labels, to check their range): the first rows match."""

    @abstractmethod
    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Per-example training losses (B,) of a batch of outputs and targets."""

    def mean_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The training objective of a batch: the mean of the per-example losses."""
        return self.loss(outputs, targets).mean()

    def measurement(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Per-example query measurements (B,), whose gradients the queries' scores take: by default the loss."""
        return self.loss(outputs, targets)

    def correct(self, outputs: torch.Tensor, targets: torch.Tensor) -> tuple[int, int] | None:
        """Predictions that are right and predictions made in a batch, for the accuracy the pipeline reports; None
        (by default): the task has no accuracy (regression, a loss given as a callable)."""
        return None

    def decode(self, ids: list[int]) -> str:
        """The text of token ids, as reports show it (padding and unscored ids already dropped): by default bytes of a
        byte-level vocabulary read as UTF-8; a task over a tokenizer's vocabulary returns `tokenizer.decode(ids)`."""
        return byte_text(ids)

    def fisher_passes(self, outputs: torch.Tensor) -> int:
        """Backward passes per example that the exact Fisher takes (one per column of its square root)."""
        return outputs[0].numel()

    def exact_fisher(self, outputs: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
        """Cotangents L_k (shaped like `outputs`) with Σ_k L_k L_kᵀ = ∇²ℓ(f) per example, negative parts dropped."""
        b, c = outputs.shape[0], outputs[0].numel()

        def single(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            return self.loss(o.unsqueeze(0), t.unsqueeze(0))[0]

        hessians = torch.func.vmap(torch.func.hessian(single))(outputs, targets).reshape(b, c, c)
        values, vectors = torch.linalg.eigh(hessians)
        roots = vectors * values.clamp_min(0).sqrt()[:, None, :]
        return [roots[:, :, k].reshape(outputs.shape) for k in range(c)]

    def sampled_fisher(self, outputs: torch.Tensor, targets: torch.Tensor, noise: ExampleNoise, offset: int, samples: int) -> list[torch.Tensor]:
        """`samples` cotangents per example whose outer products average to ∇²ℓ(f): H^(1/2) z / √samples with
        z ~ N(0, I) drawn for examples offset, offset+1, ... (so the draws do not depend on batching)."""
        n, c = outputs.shape[0], outputs[0].numel()
        _, product = vjp(grad(lambda o: self.loss(o, targets).sum()), outputs)  # each example's ∇²ℓ(f_i), batched
        apply = torch.func.vmap(lambda v: product(v)[0])  # over the draws

        def hvp(v: torch.Tensor) -> torch.Tensor:  # rows (draw, example) flattened
            return apply(v.reshape(samples, *outputs.shape)).reshape(samples * n, c)

        z = noise.normal(offset, offset + n, (n, samples, c), outputs).transpose(0, 1).reshape(samples * n, c)
        roots = lanczos_sqrt(hvp, z, LANCZOS_STEPS).reshape(samples, *outputs.shape)
        return list(samples**-0.5 * roots)


def byte_text(ids: list[int]) -> str:
    """Token ids of a byte-level vocabulary (0-255) as UTF-8 text, undecodable bytes as �."""
    return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


def lanczos_sqrt(hvp: Any, z: torch.Tensor, steps: int) -> torch.Tensor:
    """H^(1/2) z for each row z_i of `z` (n, c) and its own symmetric PSD H_i, applied by `hvp` (n, c) → (n, c):
    ‖z‖ Q √T e₁ from `steps` Lanczos steps with full reorthogonalisation (exact once steps reach the rank)."""
    norm = z.norm(dim=1, keepdim=True)
    basis = [z / norm.clamp_min(torch.finfo(z.dtype).tiny)]
    alphas: list[torch.Tensor] = []
    betas: list[torch.Tensor] = []
    for k in range(min(steps, z.shape[1])):
        w = hvp(basis[-1])
        alphas.append((w * basis[-1]).sum(1))
        q = torch.stack(basis, 1)
        w = w - torch.einsum("bk,bkc->bc", torch.einsum("bkc,bc->bk", q, w), q)  # full reorthogonalisation
        if k + 1 == min(steps, z.shape[1]):
            break
        beta = w.norm(dim=1)
        live = beta > 64 * torch.finfo(z.dtype).eps * torch.stack(alphas).abs().amax(0).clamp_min(1e-30)
        betas.append(torch.where(live, beta, 0.0))
        basis.append(torch.where(live[:, None], w / beta.clamp_min(torch.finfo(z.dtype).tiny)[:, None], 0.0))
    tri = torch.diag_embed(torch.stack(alphas, 1))
    if betas:
        off = torch.diag_embed(torch.stack(betas, 1), offset=1)
        tri = tri + off + off.transpose(1, 2)
    values, vectors = torch.linalg.eigh(tri)
    coefficients = vectors @ (values.clamp_min(0).sqrt() * vectors[:, 0, :]).unsqueeze(-1)
    return norm * torch.einsum("bk,bkc->bc", coefficients.squeeze(-1), torch.stack(basis, 1))
