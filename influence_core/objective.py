"""A model and its task (loss, measurement) as pure functions of the chosen parameters, for torch.func transforms."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.func import functional_call, grad, jvp, vjp, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import examples
from .errors import ConfigError, raised
from .task import LossFn, Task, resolve_task
from .params import ParamSpace
from .solvers import MatMat
from .work import Work

Params = dict[str, torch.Tensor]


class Objective:
    """Model outputs, mean loss, per-sample gradients and curvature-vector products at fixed parameters."""

    def __init__(self, model: nn.Module, loss: Task | LossFn | str, param_names: Iterable[str] | None = None) -> None:
        self.model = model.eval()
        self.task = resolve_task(loss)
        self.space = ParamSpace(model, param_names)
        self.work = Work()  # what was evaluated with this objective: gradients, curvature products, solves, flops

    @property
    def params(self) -> Params:
        return self.space.params

    def to_model(self, x: examples.Inputs, y: torch.Tensor) -> tuple[examples.Inputs, torch.Tensor]:
        """Move a batch to the parameters' device, and floating inputs and targets to their dtype."""
        return examples.map_inputs(x, self._to_space), self._to_space(y)

    def _to_space(self, t: torch.Tensor) -> torch.Tensor:
        dtype = self.space.dtype if t.is_floating_point() else t.dtype
        return t.to(device=self.space.device, dtype=dtype)

    def activation_bytes(self, x: examples.Inputs) -> int:
        """Bytes of all leaf modules' outputs per example, from a forward pass of `x` (sizes curvature-product calls)."""
        x = examples.map_inputs(x, self._to_space)
        total = 0

        def count(module: nn.Module, args: object, output: object) -> None:
            nonlocal total
            total += sum(t.numel() * t.element_size() for t in (output if isinstance(output, (tuple, list)) else (output,)) if isinstance(t, torch.Tensor))

        leaves = [m for m in self.model.modules() if not any(True for _ in m.children())]
        handles = [m.register_forward_hook(count) for m in leaves]
        try:
            with torch.no_grad():
                self.outputs(self.params, x)
        finally:
            for h in handles:
                h.remove()
        return total // max(1, examples.count(x))

    def outputs(self, params: Params, x: examples.Inputs) -> torch.Tensor:
        args, kwargs = examples.call_args(x)
        return self.task.output(functional_call(self.model, self.space.full_state(params), args, kwargs))

    def batch_loss(self, params: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.task.mean_loss(self.outputs(params, x), y)

    def _sample_loss(self, params: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.batch_loss(params, examples.single(x), y.unsqueeze(0))

    def _sample_measurement(self, params: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.task.measurement(self.outputs(params, examples.single(x)), y.unsqueeze(0))[0]

    def per_sample_grads(self, x: torch.Tensor, y: torch.Tensor, measure: bool = False) -> torch.Tensor:
        """Gradients of each example's loss (of its measurement with `measure`, for queries), shape (n, p),
        vectorised with vmap over grad."""
        x, y = self.to_model(x, y)
        self.work.gradient_rows += examples.count(x)
        with traceable():
            grads = vmap(grad(self._sample_measurement if measure else self._sample_loss), in_dims=(None, 0, 0))(self.params, x, y)
        return self.space.flatten(grads, batch_dims=1)

    def gauss_newton_rows(self, x: examples.Inputs, y: torch.Tensor) -> torch.Tensor:
        """Rows R (n·K, p) with RᵀR = Σ_i J_iᵀ ∇²ℓ_i(f) J_i, this batch's summed Gauss-Newton matrix: J_iᵀ L_ik for
        each example i and each of the K columns L_ik of the task's exact square root of its output Hessian
        (`Task.exact_fisher`), by vmap over examples and columns of the gradient of ⟨f(x_i), L_ik⟩; counted as n·K
        gradient rows."""
        x, y = self.to_model(x, y)
        with torch.no_grad():
            columns = torch.stack(self.task.exact_fisher(self.outputs(self.params, x), y), dim=1)  # (n, K, *output)

        def pseudo_loss(params: Params, xi: examples.Inputs, column: torch.Tensor) -> torch.Tensor:
            return (self.outputs(params, examples.single(xi))[0] * column).sum()

        with traceable():
            grads = vmap(vmap(grad(pseudo_loss), in_dims=(None, None, 0)), in_dims=(None, 0, 0))(self.params, x, columns)
        self.work.gradient_rows += columns.shape[0] * columns.shape[1]
        return self.space.flatten(grads, batch_dims=2).reshape(-1, self.space.dim)

    def hessian_product(self, x: torch.Tensor, y: torch.Tensor) -> MatMat:
        """`V ↦ V·H` for the Hessian of this batch's mean loss, applied to rows of V (k, p) as often as needed.

        Reverse-over-reverse: the gradient's graph is built once here and pulled back per vector under vmap. (torch
        2.13's forward-over-reverse fails on some losses with "ZeroTensors are immutable".)
        """
        x, y = self.to_model(x, y)
        _, pullback = vjp(lambda p: grad(self.batch_loss)(p, x, y), self.params)

        def apply(vectors: torch.Tensor) -> torch.Tensor:
            self.work.product_rows += len(vectors) * examples.count(x)
            out = vmap(lambda v: pullback(v)[0])(self.space.unflatten(vectors))
            return self.space.flatten(out, batch_dims=1).detach()

        return apply

    def gauss_newton_product(self, x: torch.Tensor, y: torch.Tensor) -> MatMat:
        """`V ↦ V·G` for the generalised Gauss-Newton matrix Jᵀ ∇²ℓ(f) J of this batch; the forward pass and the
        output Hessian are set up once here, the Jacobian products run per call under vmap."""
        x, y = self.to_model(x, y)

        def forward(p: Params) -> torch.Tensor:
            return self.outputs(p, x)

        out, pullback = vjp(forward, self.params)
        _, loss_hessian = vjp(grad(lambda o: self.task.mean_loss(o, y)), out.detach())  # ∇²ℓ(f) is symmetric

        def single(v: Params) -> Params:
            with sdpa_kernel(SDPBackend.MATH):  # the fused CPU/GPU attention kernels have no forward-mode derivative
                jv = jvp(forward, (self.params,), (v,))[1]
            return pullback(loss_hessian(jv)[0])[0]

        def apply(vectors: torch.Tensor) -> torch.Tensor:
            self.work.product_rows += len(vectors) * examples.count(x)
            return self.space.flatten(vmap(single)(self.space.unflatten(vectors)), batch_dims=1).detach()

        return apply

    def check_outputs(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Fail early, naming the field, when the task cannot interpret the outputs against the labels `y` (pass them
        all) or when the loss does not depend differentiably on the parameters; returns the outputs of the probe
        batch (the first 64 rows of `x`), detached."""
        xs, ys = self.to_model(examples.take(x, slice(0, 64)), y[:64])
        live = {name: p.detach().requires_grad_(True) for name, p in self.params.items()}
        out = self.outputs(live, xs)
        self.check_alone(xs)
        self.task.check(out.detach(), self._to_space(y))
        value = self.task.mean_loss(out, ys)
        if value.ndim != 0:
            raise ConfigError("model.loss", f"the loss returned shape {tuple(value.shape)}", "return the mean loss, a scalar")
        self._check_per_example(out.detach(), ys)
        grads = torch.autograd.grad(value, list(live.values()), allow_unused=True) if value.grad_fn is not None else [None]
        if all(g is None or not bool(g.any()) for g in grads):
            raise ConfigError(
                "model",
                "the loss is not differentiable in the model parameters (its gradient is cut or identically zero)",
                "remove detach()/argmax/round from the forward pass and the loss",
            )
        return out.detach()

    def check_alone(self, x: examples.Inputs) -> None:
        """Refuse a model that cannot take one example of `x` by itself, as per-example gradients, scores and
        self-influences evaluate each: batch norm without running statistics normalises by the batch, which one
        example of one value per channel does not have."""
        try:
            with torch.no_grad():
                self.outputs(self.params, examples.take(x, slice(0, 1)))
        except Exception as exc:  # the user's model code failed
            norms = [name for name, m in self.model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and not m.track_running_stats]
            if not norms:
                raise ConfigError("model", f"its forward pass fails on one example alone ({raised(exc)}), which per-example gradients evaluate", "make the forward pass take a batch of one example") from None
            raise ConfigError(
                "model", f"its forward pass fails on one example alone ({type(exc).__name__}: {' '.join(str(exc).split())[:200]}): batch norm {norms} keeps no running statistics (track_running_stats=False), "
                "so it normalises each example by its batch, and an example's own loss, which influence attributes, is not defined",
                "keep batch norm's running statistics (track_running_stats=True, the default; eval mode then normalises each example with them), or use LayerNorm or GroupNorm",
            ) from None

    def summed_gradient(self, x: examples.Inputs, y: torch.Tensor) -> torch.Tensor:
        """The flat gradient of the sum of the examples' own losses (each row's loss computed alone), by plain autograd:
        torch.func.grad's first call in a process imports torch._dynamo (~1 s), which a query-only run need not pay."""
        live = {name: p.detach().requires_grad_(True) for name, p in self.params.items()}
        total = sum(self.batch_loss(live, examples.take(x, slice(i, i + 1)), y[i : i + 1]) for i in range(examples.count(x)))
        grads = torch.autograd.grad(total, list(live.values()), allow_unused=True)
        return self.space.flatten({name: torch.zeros_like(p) if g is None else g for (name, p), g in zip(live.items(), grads)})

    def _check_per_example(self, out: torch.Tensor, y: torch.Tensor) -> None:
        """The task's loss and measurement give one value per example of the batch (a batch's scalar would scale the
        scores by 1/n and leave self-influence inconsistent with them); refused naming the `task` otherwise."""
        n = len(out)
        for name, values in (("loss", self.task.loss(out, y)), ("measurement", self.task.measurement(out, y))):
            if tuple(values.shape) != (n,):
                raise ConfigError(
                    "task", f"its {name} returned shape {tuple(values.shape)} for a batch of {n} examples, not one value per example ({n},)",
                    f"return the per-example {name}s of the batch, shape (batch,), e.g. F.cross_entropy(outputs, targets, reduction='none') (Task.mean_loss averages them)",
                )


class UntraceableModel(ConfigError):
    """vmap's refusal of a forward pass that branches on an example's values, told as the model's fix (Hugging Face's
    SDPA mask is skipped when `attention_mask.all()`)."""

    def __init__(self) -> None:
        super().__init__(
            "model", "its forward pass branches on the values of one example's inputs (a Python `if` on a tensor or `.item()`; Hugging Face's "
            "sdpa/flash attention does so on a 2-D attention_mask), which per-example gradients (vmap) cannot trace",
            'load a transformers model with attn_implementation="eager", or compute the branch with tensor ops (torch.where)',
        )


@contextmanager
def traceable() -> Iterator[None]:
    """Per-example vmap over the model, its refusal of data-dependent control flow raised as `UntraceableModel`."""
    try:
        yield
    except RuntimeError as error:
        if "data-dependent control flow" in str(error):
            raise UntraceableModel() from error
        raise
