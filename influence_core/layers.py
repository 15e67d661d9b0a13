"""Tracked Linear, Conv2d, Conv1D and Embedding layers: their inputs and output gradients captured by hooks, per example.

A layer's per-example gradient is Σ_t g_t a_tᵀ over positions t (one position for a plain Linear input, every
patch for a convolution), with a = the layer input (unfolded patches for Conv2d, a trailing 1 for the bias) and
g = ∂ℓ/∂(layer output). Kronecker-factored curvature and Kronecker-structured projections work on (a, g) directly.
An `nn.Embedding` is captured as its token ids a (batch, positions), integers, and g (batch, positions, width): its
gradient is the scatter Σ_t e_{id_t} g_tᵀ (vocabulary × width), kept as its nonzero rows (contraction.py); positions
holding `padding_idx` get g = 0, as torch gives that row no gradient. Embeddings are no Kronecker layer (K-FAC
leaves them out, see `select_layers`). An embedding whose weight an output Linear shares (`tied_embeddings`) is
captured with that Linear: the weight's gradient is the sum of both captures' shares (contraction.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from . import examples
from .blocks import ROOT_BLOCK
from .errors import ConfigError
from .noise import ExampleNoise
from .task import Task
from .task.base import resolve_fisher

LAYER_TYPES = ("Linear", "Conv2d", "Conv1D")  # Conv1D: transformers' transposed linear layer (GPT-2's projections)
FisherKind = Literal["auto", "exact", "sampled"]


def layer_type(module: nn.Module) -> str | None:
    """'Linear', 'Conv2d' or 'Conv1D' for a layer whose gradient is Σ_t g_t a_tᵀ, else None. Conv1D (transformers'
    y = x W + b, W of shape (in, out)) is recognised by its class name and `nf` attribute, so the library never
    imports transformers."""
    if isinstance(module, nn.Linear):
        return "Linear"
    if isinstance(module, nn.Conv2d):
        return "Conv2d"
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf") and getattr(module, "weight", None) is not None and module.weight.ndim == 2:
        return "Conv1D"
    return None


def contractible(module: nn.Module) -> bool:
    """A supported layer in a form the captures cover: convolutions only with groups=1 and zero padding; embeddings
    without max_norm (which rewrites rows in the forward pass) and scale_grad_by_freq (which scales by counts
    across the whole batch, so no example has a gradient of its own)."""
    if isinstance(module, nn.Conv2d):
        return module.groups == 1 and module.padding_mode == "zeros"
    if isinstance(module, nn.Embedding):
        return module.max_norm is None and not module.scale_grad_by_freq
    return layer_type(module) is not None


@dataclass(frozen=True)
class TrackedLayer:
    name: str
    module: nn.Module

    @property
    def has_bias(self) -> bool:
        return getattr(self.module, "bias", None) is not None

    @property
    def embedding(self) -> bool:
        """Whether this is an `nn.Embedding`: out_dim is its vocabulary, in_dim its width, its a the token ids."""
        return isinstance(self.module, nn.Embedding)

    @property
    def transposed(self) -> bool:
        """Whether the weight is stored (in, out), as in Conv1D, rather than (out, in, ...)."""
        return layer_type(self.module) == "Conv1D"

    @property
    def out_dim(self) -> int:
        return self.module.weight.shape[1 if self.transposed else 0]

    @property
    def in_dim(self) -> int:
        """Columns of the layer's gradient matrix: inputs (times kernel size), plus one for the bias."""
        return self.module.weight.numel() // self.out_dim + int(self.has_bias)

    @property
    def param_names(self) -> list[str]:
        prefix = f"{self.name}." if self.name else ""
        return [f"{prefix}weight"] + ([f"{prefix}bias"] if self.has_bias else [])

    @property
    def block(self) -> str:
        """The name of this layer's parameter block (see `blocks.layer_blocks`)."""
        return self.name or ROOT_BLOCK

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        """The layer input as (batch, positions, in_dim), bias column included; an embedding's ids as (batch, positions)."""
        m = self.module
        if self.embedding:
            return x.reshape(x.shape[0], -1)
        if isinstance(m, nn.Conv2d):
            patches = F.unfold(x, m.kernel_size, dilation=m.dilation, padding=m.padding, stride=m.stride)
            a = patches.transpose(1, 2)
        else:
            a = x.reshape(x.shape[0], -1, x.shape[-1])
        if self.has_bias:
            a = torch.cat([a, a.new_ones(*a.shape[:-1], 1)], dim=-1)
        return a

    def output_grads(self, g: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """∂ℓ/∂output as (batch, positions, out_dim), given the captured input a; an embedding's as (batch,
        positions, width), zero where a holds `padding_idx` (torch leaves that row without gradient)."""
        if isinstance(self.module, nn.Conv2d):
            return g.flatten(2).transpose(1, 2)
        g = g.reshape(g.shape[0], -1, g.shape[-1])
        padding = getattr(self.module, "padding_idx", None)
        return g.masked_fill((a == padding)[..., None], 0) if self.embedding and padding is not None else g

    def to_matrix(self, flat: torch.Tensor) -> torch.Tensor:
        """Parameter-ordered vectors (weight flattened, then bias) → gradient matrices (n, out, in_dim)."""
        n, w = flat.shape[0], self.module.weight.numel()
        weight = flat[:, :w].reshape(n, -1, self.out_dim).transpose(1, 2) if self.transposed else flat[:, :w].reshape(n, self.out_dim, -1)
        return torch.cat([weight, flat[:, w:, None]], dim=2) if self.has_bias else weight

    def to_flat(self, matrix: torch.Tensor) -> torch.Tensor:
        """Inverse of `to_matrix`."""
        n = matrix.shape[0]
        weight = matrix[:, :, :-1] if self.has_bias else matrix
        weight = (weight.transpose(1, 2) if self.transposed else weight).reshape(n, -1)
        return torch.cat([weight, matrix[:, :, -1]], dim=1) if self.has_bias else weight


def select_layers(model: nn.Module, names: Iterable[str] | None = None) -> list[TrackedLayer]:
    """Layers by module name or by type name ("Linear", "Conv2d", "Conv1D"), or every such layer; unsupported
    choices fail with the field named."""
    modules = dict(model.named_modules())
    supported = [n for n, m in modules.items() if layer_type(m) is not None]
    trainable = [n for n in supported if any(t.requires_grad for t in modules[n].parameters(recurse=False))]
    tied = tied_layers(model, modules, supported)
    if names is None:
        chosen = [n for n in trainable if n not in tied]  # frozen layers (requires_grad=False) are never attributed
    else:
        chosen = []
        for name in names:
            if name in modules:
                chosen.append(name)
            elif name in LAYER_TYPES:
                chosen += [n for n in supported if layer_type(modules[n]) == name]
            else:
                raise ConfigError("method.modules", f"no module or layer type named {name!r}", f"pick from {supported} or {list(LAYER_TYPES)}")
        chosen = list(dict.fromkeys(chosen))
        unsupported = [f"{n} ({type(modules[n]).__name__})" for n in chosen if layer_type(modules[n]) is None]
        if unsupported:
            raise ConfigError("method.modules", f"{unsupported} are not Linear or Conv2d (or Conv1D)", "track Linear, Conv2d and Conv1D modules only")
    shared = [n for n in chosen if n in tied]
    if shared:
        raise ConfigError(
            "method.modules", f"{shared} share their weight with another module (tied embeddings, as GPT-2's lm_head), so they are no layer of their own",
            "leave them out of method.modules (the default does): the shared weight is attributed through the module that owns it by methods without Kronecker factors, e.g. cg",
        )
    frozen = [n for n in chosen if n not in trainable]
    if frozen:
        raise ConfigError(
            "method.modules", f"{frozen} are frozen (requires_grad=False); influence is taken over trainable parameters only",
            f"set method.modules to trainable layers, e.g. {trainable}, or set requires_grad=True on those layers",
        )
    for n in chosen:
        if not contractible(modules[n]):
            m = modules[n]
            raise ConfigError("method.modules", f"{n} uses groups={m.groups}, padding_mode={m.padding_mode!r}", "track plain convolutions (groups=1, zero padding) only")
    if not chosen:
        raise ConfigError("method.modules", "no Linear, Conv2d or Conv1D layer is selected", "select such modules, or use a method without Kronecker factors, e.g. cg")
    return [TrackedLayer(n, modules[n]) for n in chosen]


def tied_layers(model: nn.Module, modules: dict[str, nn.Module], supported: list[str]) -> set[str]:
    """Layers whose weight another module registered first (GPT-2's lm_head shares the token embedding's):
    `named_parameters` lists a shared tensor once, under its first name, so it cannot be a Kronecker block here."""
    owned = {name for name, _ in model.named_parameters()}
    return {n for n in supported if any(p not in owned for p in TrackedLayer(n, modules[n]).param_names)}


def listed_names(model: nn.Module) -> dict[int, str]:
    """Each parameter tensor's name, by the tensor's id, as `named_parameters` lists it (a shared tensor once, under
    the name of the module that registers it first)."""
    return {id(p): n for n, p in model.named_parameters()}


def module_param_names(model: nn.Module, modules: Iterable[str] | None) -> list[str] | None:
    """The parameter names of the chosen modules (None: every trainable parameter). A weight shared by two modules
    (GPT-2's lm_head and wte) goes by the name `named_parameters` lists it under, whichever module names it, once."""
    if modules is None:
        return None
    named = dict(model.named_modules())
    missing = [m for m in modules if m not in named]
    if missing:
        raise ConfigError("method.modules", f"no modules named {missing}", f"pick from {[n for n in named if n]}")
    listed = listed_names(model)
    return list(dict.fromkeys(listed[id(t)] for m in modules for t in named[m].parameters(recurse=False) if t.requires_grad))


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


def per_example_layers(model: nn.Module, layers: list[TrackedLayer], x: examples.Inputs) -> set[str]:
    """The layers a capture holds per example: each runs once per forward pass (a shared layer runs more often) on
    an input whose first dimension is the batch, checked at two batch sizes (a position embedding of arange(T)
    serves every example at once, so its output gradient is their sum)."""
    sizes: dict[str, list[int]] = {layer.name: [] for layer in layers}
    handles = [layer.module.register_forward_hook(lambda _, args, __, name=layer.name: sizes[name].append(args[0].shape[0] if args[0].ndim else -1)) for layer in layers]
    try:
        with torch.no_grad():
            for batch in (x, examples.concat([x, x])):
                examples.call(model, batch)
    finally:
        for handle in handles:
            handle.remove()
    n = examples.count(x)
    return {name for name, seen in sizes.items() if seen == [n, 2 * n]}


def _owners(model: nn.Module) -> dict[int, list[tuple[str, nn.Module]]]:
    """The modules (name, module) that register each parameter tensor, by the tensor's id."""
    owners: dict[int, list[tuple[str, nn.Module]]] = {}
    for name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), []).append((name, module))
    return owners


def shared_parameters(model: nn.Module) -> set[int]:
    """ids of parameter tensors registered by more than one module (tied weights, as GPT-2's lm_head and wte): a
    capture of one module misses the other's share of the gradient."""
    return {key for key, found in _owners(model).items() if len(found) > 1}


def tied_embeddings(model: nn.Module) -> list[tuple[TrackedLayer, TrackedLayer]]:
    """(embedding, output Linear) pairs whose weight (V × d) is one tensor that these two modules alone register
    (GPT-2's lm_head.weight is wte.weight), in either order: its gradient is the sum of both modules' shares."""
    pairs = []
    for found in _owners(model).values():
        embedding = [TrackedLayer(*owner) for owner in found if isinstance(owner[1], nn.Embedding)]
        output = [TrackedLayer(*owner) for owner in found if isinstance(owner[1], nn.Linear)]
        if len(found) == 2 and len(embedding) == len(output) == 1 and embedding[0].module.weight is output[0].module.weight:
            pairs.append((embedding[0], output[0]))
    return pairs


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
    task: Task,
    x: torch.Tensor,
    y: torch.Tensor,
    mode: Literal["labels", "measurement", "auto", "sampled", "exact"] = "labels",
    noise: ExampleNoise | None = None,
    offset: int = 0,
    samples: int = 1,
) -> Capture:
    """One forward pass and the gradients with respect to every tracked layer's output, recording (a, g).

    - labels: g = ∂ℓ(f(x), y)/∂output, the true per-example gradient of the task's training loss;
    - measurement: the same for the task's query measurement;
    - sampled: g from `samples` targets per example drawn from the model's predictive distribution (the true
      Fisher), each scaled by 1/√samples, with the noise of examples offset, offset+1, ... so the draws do not
      depend on batching;
    - exact: one backward pass per column of a square root of ∇²ℓ(f), so Σ_columns g gᵀ is the exact
      Gauss-Newton factor;
    - auto: exact up to EXACT_FISHER_MAX_PASSES backward passes per example, else sampled.
    Parameters' .grad are never touched.
    """
    inputs: dict[str, torch.Tensor] = {}
    outputs: dict[str, torch.Tensor] = {}
    with torch.enable_grad(), _recording(layers, inputs, outputs):
        out = task.output(examples.call(model, x))
    names = [layer.name for layer in layers]
    if any(not outputs[n].requires_grad for n in names):
        raise ConfigError("method.modules", "tracked layers produce outputs without gradients", "list only layers with requires_grad=True parameters in method.modules")
    if mode == "labels":
        roots = [task.mean_loss(out, y) * examples.count(x)]  # the sum over examples: each gets its own gradient
    elif mode == "measurement":
        roots = [task.measurement(out, y).sum()]
    else:
        # ⟨out, c⟩ has the gradient of a backward from out with cotangent c, bit for bit; a tensor cotangent would make
        # autograd import torch.fx's symbolic shapes (sympy: 0.2 s, once per process, on every worker)
        roots = [(out * c).sum() for c in fisher_cotangents(task, out.detach(), y, mode, noise, offset, samples)]
    grads: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    for i, root in enumerate(roots):
        found = torch.autograd.grad(root, [outputs[n] for n in names], retain_graph=i + 1 < len(roots))
        for layer, g in zip(layers, found):
            grads[layer.name].append(layer.output_grads(g.detach(), inputs[layer.name]))
    return Capture(inputs, grads)


def fisher_cotangents(task: Task, out: torch.Tensor, y: torch.Tensor, kind: str, noise: ExampleNoise | None, offset: int, samples: int) -> list[torch.Tensor]:
    """Output cotangents whose outer products sum to each example's output Hessian of the loss: exactly (the columns
    of a square root), or in expectation over targets sampled from the model."""
    task.check(out, y)
    if resolve_fisher(kind, task.fisher_passes(out)) == "exact":
        return task.exact_fisher(out, y)
    assert noise is not None
    return task.sampled_fisher(out, y, noise, offset, samples)
