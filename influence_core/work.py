"""What a computation did, counted where it happens, so no cost hides behind a stage's wall time."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from torch import nn

from . import examples


@dataclass
class Work:
    """Counters of the units of work every method is made of; stages report their sums in summary.json.

    - gradient_rows: examples whose loss gradient was evaluated (per-sample gradients, or one captured
      forward/backward pass per example);
    - product_rows: (vector, example) pairs in curvature-vector products (a product with the mean curvature of n
      examples counts n);
    - solves: right-hand sides solved by an iterative method (CG, LiSSA, DataInf), and solver_iterations their
      iterations summed over solver calls;
    - score_flops: floating-point operations of the contractions that turn gradients into scores and
      self-influences (GEMMs and the reductions beside them);
    - curvature_flops: floating-point operations of the GEMMs that form an explicit curvature matrix from gradient
      rows (Direct's Gauss-Newton matrix);
    - index_rows, index_bytes: training rows (and their bytes) read back from a stored training index instead of
      evaluating their gradients;
    - replayed_steps: training steps replayed by MAGIC, forward recomputations and reverse steps through the
      optimiser together.
    """

    gradient_rows: int = 0
    product_rows: int = 0
    solves: int = 0
    solver_iterations: int = 0
    score_flops: float = 0.0
    curvature_flops: float = 0.0
    index_rows: int = 0
    index_bytes: int = 0
    replayed_steps: int = 0

    def __iadd__(self, other: "Work") -> "Work":
        for field in fields(self):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))
        return self

    def __sub__(self, other: "Work") -> "Work":
        return Work(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})

    def copy(self) -> "Work":
        return Work(**asdict(self))

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def forward_flops(model: nn.Module, x: Any) -> float:
    """FLOPs (2 per multiply-add) of the model's weight layers (Linear, convolutions, Hugging Face's Conv1D) in one
    forward pass over rows x, counted from their outputs' shapes by hooks: a stage's cheap estimate of a pass's work,
    made before it chooses where its tasks run (torch's FlopCounterMode imports torch._dynamo, 0.9 s)."""
    total = [0.0]

    def count(module: nn.Module, _: Any, out: Any) -> None:
        if isinstance(out, torch.Tensor):
            total[0] += 2.0 * out.numel() * _inputs_per_output(module)

    handles = [module.register_forward_hook(count) for module in model.modules() if _inputs_per_output(module)]
    training = model.training
    dtype = next(model.parameters()).dtype
    x = examples.map_inputs(x, lambda t: t.to(dtype) if t.is_floating_point() else t)  # float32 features, a float64 model: as Objective.to_model casts them
    try:
        with torch.no_grad():
            examples.call(model.eval(), x)  # eval: a counting pass must not move BatchNorm's running statistics
    finally:
        model.train(training)
        for handle in handles:
            handle.remove()
    return total[0]


def _inputs_per_output(module: nn.Module) -> int:
    """Multiply-adds per output number of a weight layer (0 for any other module): a Linear's or convolution's
    weight[0], a Conv1D's (in, out) weight's rows."""
    if isinstance(module, (nn.Linear, nn.modules.conv._ConvNd)):
        return module.weight[0].numel()
    weight = getattr(module, "weight", None)
    if type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor) and weight.ndim == 2:
        return int(weight.shape[0])
    return 0
