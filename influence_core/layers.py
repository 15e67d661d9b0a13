"""Tracked Linear and Conv2d layers: their inputs and output gradients captured by hooks, per example.

A layer's per-example gradient is Σ_t g_t a_tᵀ over positions t (one position for a plain Linear input, every
patch for a convolution), with a = the layer input (unfolded patches for Conv2d, a trailing 1 for the bias) and
g = ∂ℓ/∂(layer output). Kronecker-factored curvature and Kronecker-structured projections work on (a, g) directly.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from .blocks import ROOT_BLOCK
from .errors import ConfigError
from .losses import LOSSES, LossFn
from .noise import ExampleNoise

SUPPORTED = (nn.Linear, nn.Conv2d)
FisherKind = Literal["auto", "sampled", "exact"]
EXACT_FISHER_MAX_OUTPUTS = 64  # "auto" takes the exact expectation up to this many outputs per example, samples above


@dataclass(frozen=True)
class TrackedLayer:
    name: str
    module: nn.Module

    @property
    def has_bias(self) -> bool:
        return self.module.bias is not None

    @property
    def out_dim(self) -> int:
        return self.module.weight.shape[0]

    @property
    def in_dim(self) -> int:
        """Columns of the layer's gradient matrix: inputs (times kernel size), plus one for the bias."""
        return self.module.weight[0].numel() + int(self.has_bias)

    @property
    def param_names(self) -> list[str]:
        prefix = f"{self.name}." if self.name else ""
        return [f"{prefix}weight"] + ([f"{prefix}bias"] if self.has_bias else [])

    @property
    def block(self) -> str:
        """The name of this layer's parameter block (see `blocks.layer_blocks`)."""
        return self.name or ROOT_BLOCK

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        """The layer input as (batch, positions, in_dim), bias column included."""
        m = self.module
        if isinstance(m, nn.Conv2d):
            patches = F.unfold(x, m.kernel_size, dilation=m.dilation, padding=m.padding, stride=m.stride)
            a = patches.transpose(1, 2)
        else:
            a = x.reshape(x.shape[0], -1, x.shape[-1])
        if self.has_bias:
            a = torch.cat([a, a.new_ones(*a.shape[:-1], 1)], dim=-1)
        return a

    def output_grads(self, g: torch.Tensor) -> torch.Tensor:
        """∂ℓ/∂output as (batch, positions, out_dim)."""
        if isinstance(self.module, nn.Conv2d):
            return g.flatten(2).transpose(1, 2)
        return g.reshape(g.shape[0], -1, g.shape[-1])

    def to_matrix(self, flat: torch.Tensor) -> torch.Tensor:
        """Parameter-ordered vectors (weight flattened, then bias) → gradient matrices (n, out, in_dim)."""
        n, w = flat.shape[0], self.module.weight.numel()
        weight = flat[:, :w].reshape(n, self.out_dim, -1)
        return torch.cat([weight, flat[:, w:, None]], dim=2) if self.has_bias else weight

    def to_flat(self, matrix: torch.Tensor) -> torch.Tensor:
        """Inverse of `to_matrix`."""
        n = matrix.shape[0]
        if not self.has_bias:
            return matrix.reshape(n, -1)
        return torch.cat([matrix[:, :, :-1].reshape(n, -1), matrix[:, :, -1]], dim=1)


def select_layers(model: nn.Module, names: Iterable[str] | None = None) -> list[TrackedLayer]:
    """Layers by module name or by type name ("Linear", "Conv2d"), or every Linear and Conv2d; unsupported
    choices fail with the field named."""
    modules = dict(model.named_modules())
    supported = [n for n, m in modules.items() if isinstance(m, SUPPORTED)]
    trainable = [n for n in supported if any(t.requires_grad for t in modules[n].parameters(recurse=False))]
    if names is None:
        chosen = trainable  # frozen layers (requires_grad=False) are never attributed
    else:
        types = {t.__name__: t for t in SUPPORTED}
        chosen = []
        for name in names:
            if name in modules:
                chosen.append(name)
            elif name in types:
                chosen += [n for n in supported if isinstance(modules[n], types[name])]
            else:
                raise ConfigError("method.modules", f"no module or layer type named {name!r}", f"pick from {supported} or {sorted(types)}")
        chosen = list(dict.fromkeys(chosen))
        unsupported = [f"{n} ({type(modules[n]).__name__})" for n in chosen if not isinstance(modules[n], SUPPORTED)]
        if unsupported:
            raise ConfigError("method.modules", f"{unsupported} are not Linear or Conv2d", "track Linear and Conv2d modules only")
    frozen = [n for n in chosen if n not in trainable]
    if frozen:
        raise ConfigError(
            "method.modules", f"{frozen} are frozen (requires_grad=False); influence is taken over trainable parameters only",
            f"set method.modules to trainable layers, e.g. {trainable}, or set requires_grad=True on those layers",
        )
    for n in chosen:
        m = modules[n]
        if isinstance(m, nn.Conv2d) and (m.groups != 1 or m.padding_mode != "zeros"):
            raise ConfigError("method.modules", f"{n} uses groups={m.groups}, padding_mode={m.padding_mode!r}", "track plain convolutions (groups=1, zero padding) only")
    if not chosen:
        raise ConfigError("method.modules", "no Linear or Conv2d layer is selected", "select Linear or Conv2d modules, or use a method without Kronecker factors, e.g. cg")
    return [TrackedLayer(n, modules[n]) for n in chosen]


def module_param_names(model: nn.Module, modules: Iterable[str] | None) -> list[str] | None:
    """The parameter names of the chosen modules (None: every trainable parameter)."""
    if modules is None:
        return None
    named = dict(model.named_modules())
    missing = [m for m in modules if m not in named]
    if missing:
        raise ConfigError("method.modules", f"no modules named {missing}", f"pick from {[n for n in named if n]}")
    return [f"{m}.{p}" for m in modules for p, t in named[m].named_parameters(recurse=False) if t.requires_grad]


@dataclass
class Capture:
    """Inputs a (batch, positions, in_dim) and output gradients g (batch, positions, out_dim) of every tracked layer."""

    a: dict[str, torch.Tensor]
    g: dict[str, list[torch.Tensor]]  # one entry per backward pass (several for the exact Fisher)

    def gradient(self, layer: str, column: int = 0) -> torch.Tensor:
        """Per-example gradient matrices Σ_t g_t a_tᵀ: (batch, out, in_dim)."""
        return outer_gradients(self.g[layer][column], self.a[layer])


def outer_gradients(g: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """Σ_t g_t a_tᵀ per example, (batch, out, in), from output gradients (batch, T, out) and inputs (batch, T, in),
    either side possibly already rotated or projected (g Q_S, a Q_A; Φ_out g, Φ_in a)."""
    return torch.einsum("bto,bti->boi", g, a)


def calls_per_layer(model: nn.Module, layers: list[TrackedLayer], x: torch.Tensor) -> dict[str, int]:
    """How often each layer runs in one forward pass of `x` (a shared layer runs more than once)."""
    counts = dict.fromkeys((layer.name for layer in layers), 0)
    handles = [layer.module.register_forward_hook(lambda *_, name=layer.name: counts.__setitem__(name, counts[name] + 1)) for layer in layers]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for handle in handles:
            handle.remove()
    return counts


@contextmanager
def _recording(layers: list[TrackedLayer], inputs: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor]) -> Iterator[None]:
    """Forward hooks that keep each tracked layer's input (as a) and its output tensor; a layer that runs twice
    in one pass (shared weights) cannot be captured and is refused."""
    handles = []
    for layer in layers:

        def hook(module: nn.Module, args: tuple, output: torch.Tensor, layer: TrackedLayer = layer) -> None:
            if layer.name in inputs:
                raise ConfigError("method.modules", f"{layer.name or 'the model'} runs more than once per forward pass (shared weights)", "leave it out of method.modules, or use a method without Kronecker factors such as cg")
            inputs[layer.name] = layer.inputs(args[0].detach())
            outputs[layer.name] = output

        handles.append(layer.module.register_forward_hook(hook))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def capture(
    model: nn.Module,
    layers: list[TrackedLayer],
    loss_fn: LossFn,
    x: torch.Tensor,
    y: torch.Tensor,
    mode: Literal["labels", "auto", "sampled", "exact"] = "labels",
    noise: ExampleNoise | None = None,
    offset: int = 0,
    samples: int = 1,
) -> Capture:
    """One forward pass and the gradients with respect to every tracked layer's output, recording (a, g).

    - labels: g = ∂ℓ(f(x), y)/∂output, the true per-example gradient;
    - sampled: g from `samples` targets per example drawn from the model's predictive distribution (the true
      Fisher), each scaled by 1/√samples, with the noise of examples offset, offset+1, ... so the draws do not
      depend on batching;
    - exact: one backward pass per column of a square root of ∇²ℓ(f), so Σ_columns g gᵀ is the exact
      Gauss-Newton factor;
    - auto: exact up to EXACT_FISHER_MAX_OUTPUTS outputs per example (or for a loss without a sampler), else sampled.
    Parameters' .grad are never touched.
    """
    inputs: dict[str, torch.Tensor] = {}
    outputs: dict[str, torch.Tensor] = {}
    with torch.enable_grad(), _recording(layers, inputs, outputs):
        out = model(x)
    names = [layer.name for layer in layers]
    if any(not outputs[n].requires_grad for n in names):
        raise ConfigError("method.modules", "tracked layers produce outputs without gradients", "list only layers with requires_grad=True parameters in method.modules")
    if mode == "labels":
        roots, cotangents = [loss_fn(out, y) * len(x)], [None]  # the sum over examples: each gets its own gradient
    else:
        cotangents = _fisher_cotangents(out.detach(), y, loss_fn, resolve_fisher(mode, loss_fn, out[0].numel()), noise, offset, samples)
        roots = [out] * len(cotangents)
    grads: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    for i, (root, cotangent) in enumerate(zip(roots, cotangents)):
        found = torch.autograd.grad(root, [outputs[n] for n in names], cotangent, retain_graph=i + 1 < len(roots))
        for layer, g in zip(layers, found):
            grads[layer.name].append(layer.output_grads(g.detach()))
    return Capture(inputs, grads)


def _samplable(loss_fn: LossFn) -> bool:
    """Whether targets can be drawn from the model's predictive distribution for this loss."""
    return loss_fn is F.cross_entropy or loss_fn is LOSSES["mse"]


def resolve_fisher(kind: str, loss_fn: LossFn, outputs: int) -> str:
    """'auto' → 'exact' for at most EXACT_FISHER_MAX_OUTPUTS outputs per example (or a loss without a sampler), else
    'sampled': the exact expectation costs one backward pass per output, sampling one per draw."""
    if kind != "auto":
        return kind
    return "exact" if outputs <= EXACT_FISHER_MAX_OUTPUTS or not _samplable(loss_fn) else "sampled"


def _fisher_cotangents(out: torch.Tensor, y: torch.Tensor, loss_fn: LossFn, mode: str, noise: ExampleNoise | None, offset: int, samples: int) -> list[torch.Tensor]:
    """Output cotangents whose outer products sum to the output Hessian of the loss per example: exactly (the columns
    of a square root), or in expectation over sampled targets."""
    if mode == "sampled":
        if not _samplable(loss_fn):
            raise ConfigError("method.fisher", "the sampled Fisher needs the cross_entropy or mse loss", "use fisher='exact' with a custom loss")
        assert noise is not None
        return _sampled_cotangents(out, loss_fn, noise, offset, samples)
    if loss_fn is F.cross_entropy:
        probs = torch.softmax(out, dim=-1)
        eye = torch.eye(out.shape[-1], dtype=out.dtype, device=out.device)
        return [probs[:, c : c + 1].sqrt() * (eye[c] - probs) for c in range(out.shape[-1])]
    if loss_fn is LOSSES["mse"]:
        d = out[0].numel()  # mean squared error over d outputs: ∇²ℓ = (2/d)·I
        basis = torch.eye(d, dtype=out.dtype, device=out.device) * (2.0 / d) ** 0.5
        return [basis[c].expand(out.shape[0], d).reshape(out.shape) for c in range(d)]
    return _exact_square_root(out, y, loss_fn)


def _sampled_cotangents(out: torch.Tensor, loss_fn: LossFn, noise: ExampleNoise, offset: int, samples: int) -> list[torch.Tensor]:
    """∂ℓ(f, ỹ)/∂f for `samples` targets ỹ ~ p(y | f) per example (a label from the softmax; for mse, Gaussian
    noise with ∇²ℓ's covariance), each scaled by 1/√samples so that the outer products average over the draws."""
    n, scale = len(out), samples**-0.5
    if loss_fn is F.cross_entropy:
        probs = torch.softmax(out, dim=-1)
        u = noise.uniform(offset, offset + n, probs, samples)
        labels = (probs.cumsum(-1)[:, None, :] < u[:, :, None]).sum(-1).clamp_max(out.shape[-1] - 1)  # inverse-CDF draws
        return [scale * (probs - F.one_hot(labels[:, k], out.shape[-1]).to(out.dtype)) for k in range(samples)]
    d = out[0].numel()  # mean squared error over d outputs: ∇²ℓ = (2/d)·I
    z = noise.normal(offset, offset + n, (n, samples, *out.shape[1:]), out)
    return [scale * (2.0 / d) ** 0.5 * z[:, k] for k in range(samples)]


def _exact_square_root(out: torch.Tensor, y: torch.Tensor, loss_fn: LossFn) -> list[torch.Tensor]:
    """Any loss: per-example output Hessians, eigendecomposed into columns L with L Lᵀ = ∇²ℓ (negative parts dropped)."""

    def single(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return loss_fn(o.unsqueeze(0), t.unsqueeze(0))

    b, c = out.shape[0], out[0].numel()
    hessians = torch.func.vmap(torch.func.hessian(single))(out, y).reshape(b, c, c)
    values, vectors = torch.linalg.eigh(hessians)
    roots = vectors * values.clamp_min(0).sqrt()[:, None, :]
    return [roots[:, :, k].reshape(out.shape) for k in range(c)]
