"""The Fisher of weighted cross-entropies in closed form, at every position of (B, P, C) logits.

A per-example loss Σ_t w_t CE(f_t, y_t) has the output Hessian blockdiag_t w_t (diag p_t − p_t p_tᵀ), p_t = softmax(f_t).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..noise import ExampleNoise


def exact_columns(logits: torch.Tensor, weights: torch.Tensor) -> list[torch.Tensor]:
    """One cotangent per (position t, class c): √(w_t p_tc) (e_c − p_t) at t, zero elsewhere; their outer products
    sum to the Hessian exactly (P·C backward passes)."""
    probs = torch.softmax(logits, dim=-1)
    eye = torch.eye(logits.shape[-1], dtype=logits.dtype, device=logits.device)
    columns = []
    for t in range(logits.shape[1]):
        for c in range(logits.shape[-1]):
            column = torch.zeros_like(probs)
            column[:, t] = (weights[:, t, None] * probs[:, t, c : c + 1]).sqrt() * (eye[c] - probs[:, t])
            columns.append(column)
    return columns


def sampled_columns(logits: torch.Tensor, weights: torch.Tensor, noise: ExampleNoise, offset: int, samples: int) -> list[torch.Tensor]:
    """`samples` cotangents √(w_t / samples) (p_t − e_ỹ) with a label ỹ ~ p_t drawn at every position of every
    example (inverse CDF of uniforms tied to examples offset, offset+1, ...): E[v vᵀ] is the Hessian."""
    n, positions, classes = logits.shape
    probs = torch.softmax(logits, dim=-1)
    u = noise.uniform(offset, offset + n, probs, positions * samples).reshape(n, positions, samples)
    labels = (probs.cumsum(-1)[:, :, None, :] < u[..., None]).sum(-1).clamp_max(classes - 1)
    scale = (weights / samples).sqrt()[..., None]
    return [scale * (probs - F.one_hot(labels[:, :, k], classes).to(probs.dtype)) for k in range(samples)]
