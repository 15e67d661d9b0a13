"""NaN or infinity in a stage's output is refused where it is computed, before it is written: the task fails, so its
chunk gets no marker and its stage no manifest (nor a Prefect cache entry), and a rerun with fixed parameters is not
served the broken output."""

from __future__ import annotations

import numpy as np
import torch

from ...errors import ConfigError, NumericalError

# What makes an influence method's scores overflow, and what to change (the chunk cannot tell which it was).
INFLUENCE_CAUSE = (
    "their gradients or the curvature solve are not finite: a gradient the model makes infinite (√ or log at 0), "
    "features of a far larger scale than the training rows', or λ far too small for the curvature"
)
INFLUENCE_FIX = "standardise the features of the training rows and the queries alike (and keep the model differentiable there), raise method.regularization, or set model.dtype: float64; then run again"


class NonFiniteOutput(ConfigError, NumericalError):
    """A stage's output holds NaN or infinity: a numerical failure whose fix is a setting or the data, told in one line
    naming the stage (its `field`) and never retried."""


def check_finite(stage: str, values: torch.Tensor | np.ndarray, what: str, cause: str = INFLUENCE_CAUSE, fix: str = INFLUENCE_FIX, rows: str = "", first: int = 0) -> None:
    """Refuse `values` (a chunk of `stage`'s output: `what`) holding NaN or infinity, saying how many, the largest
    finite value, the likely cause and the fix; with `rows` (what axis 0 counts, from `first`: 'queries'), which of
    them are not finite anywhere."""
    values = torch.as_tensor(values)
    finite = torch.isfinite(values)
    if bool(finite.all()):
        return
    kept = values[finite]
    largest = f" (the largest finite one {float(kept.abs().max()):.2g})" if kept.numel() else ""
    whole = (torch.nonzero(~finite.any(dim=1)).flatten() + first).tolist() if rows and values.ndim == 2 else []
    named = f", all those of {rows} {whole[:5]}{' ...' if len(whole) > 5 else ''}" if whole else ""
    raise NonFiniteOutput(stage, f"{int((~finite).sum()):,} of {values.numel():,} {what} are NaN or infinite{largest}{named}: {cause}", fix)


def stored_scores(values: np.ndarray, what: str, rows: str = "", stage: str = "compute_influences") -> np.ndarray:
    """A chunk of a scoring stage's scores (compute_influences', or rerank's) as float32, as the output stores them,
    refused (`check_finite`) in `stage`'s name when it holds NaN or infinity, a value beyond float32's range included."""
    narrowed = values.astype(np.float32)
    check_finite(stage, narrowed, what, rows=rows)
    return narrowed
