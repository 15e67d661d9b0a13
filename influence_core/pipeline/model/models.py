"""Model construction, training, and state-dict storage (always read back with weights_only=True)."""

from __future__ import annotations

import hashlib
import io
import math
from typing import Any

import numpy as np
import torch
from torch import nn

from ..store import integrity, storage
from ... import examples
from ...batches import ArrayBatches
from ...training import SHUFFLE_BLOCK_ROWS, train as fit
from ...errors import ConfigError
from ...objective import Objective
from ...task import Task
from ..sources.dotted import user_error
from ..store.refs import DataRef, ModelRef
from ..specs import LoraSpec, ModelSpec, TrainingSpec


def output_width(spec: ModelSpec, data: DataRef) -> int:
    """Explicit width, else one output per class, else one regression target."""
    if spec.output_dim is not None:
        return spec.output_dim
    if spec.task_name == "language_modelling":
        return spec.vocab_size
    return data.n_classes if (spec.task_name == "classification" and data.n_classes) else 1


Shape = tuple[int, int, tuple[int, ...] | None]  # what ModelSpec.build takes: in_features, out_features, feature_shape


def module_shape(spec: ModelSpec, source: DataRef | ModelRef) -> Shape:
    """The module's input and output sizes: those of this data (a built-in architecture takes one input array, so
    named fields need a model factory), or those a stored model was built with."""
    if isinstance(source, ModelRef):
        return source.in_features, source.out_features, tuple(source.feature_shape) if source.feature_shape is not None else None
    if spec.factory is None and any("/" in name for name in source.arrays):
        raise ConfigError("dataset.inputs", f"the built-in {spec.architecture} takes one input array, not the named fields of dataset.inputs", "set model.factory to a model taking the fields as keyword arguments, or store one input array x")
    return math.prod(source.feature_shape), output_width(spec, source), tuple(source.feature_shape)


def build_model(spec: ModelSpec, source: DataRef | ModelRef, device: str = "cpu", lora: LoraSpec | None = None) -> nn.Module:
    """The module (weights: the global generator's draw, or a factory's own), in the spec's dtype, on `device`, with
    `lora`'s adapters: the structure a state_dict of the run's model loads into."""
    module = spec.build(*module_shape(spec, source)).to(device=device, dtype=getattr(torch, spec.dtype))
    return with_lora(module, lora)


def initial_model(spec: ModelSpec, training: TrainingSpec, source: DataRef | ModelRef, options: dict[str, Any], device: str = "cpu") -> nn.Module:
    """The weights a run's training starts from, wherever they are needed (fit_model, validation's retrainings,
    MAGIC's replay): the module built after seeding torch's global generator with training.seed (callers fork it),
    then training.init's weights (strict: a state_dict of another model is refused naming training.init), then the
    LoRA adapters (their own initialisation drawn from the same seeded generator)."""
    torch.manual_seed(training.seed)
    model = build_model(spec, source, device)
    if training.init:
        load_into(model, load_state(training.init, options, "training.init", device), "training.init")
    return with_lora(model, training.lora)


def with_lora(model: nn.Module, lora: LoraSpec | None) -> nn.Module:
    """The model with peft's LoRA adapters on `lora.target_modules` (in place; every other weight frozen), or as it is."""
    if lora is None:
        return model
    from peft import LoraConfig, inject_adapter_in_model  # imports transformers (seconds): only for a run with adapters

    try:
        wrapped = inject_adapter_in_model(LoraConfig(**lora.config()), model)
    except ValueError as exc:  # no module of the model matches, or one that peft cannot adapt
        names = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
        raise ConfigError("training.lora.target_modules", f"{lora.target_modules} do not name modules peft can adapt ({str(exc).splitlines()[0]})", f"name nn.Linear modules of the model, e.g. among {names[:8]}") from None
    return wrapped  # the adapters take their base layer's dtype and device


def state_digest(model: nn.Module) -> str:
    """A digest of the module's state_dict (names, dtypes, shapes and bytes): what a factory's weights are keyed on."""
    digest = hashlib.sha256()
    for name, value in model.state_dict().items():
        tensor = value.detach().cpu().contiguous()
        digest.update(f"{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
        digest.update(tensor.view(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()[:24]


def training_key(spec: ModelSpec, training: TrainingSpec, data: DataRef, options: dict[str, Any]) -> dict[str, Any]:
    """A training as the keys of what it trains hash it (fit_model, validation's retrained models): the recipe, and
    where it starts: training.init's content (a replaced file retrains, a moved one does not), or for a model factory
    without an init the digest of the weights it builds (a factory may load pretrained weights from files the
    pipeline never sees, and no rule tells them from a random draw; a built-in architecture's draw is fixed by the
    seed and the code version, so its keys stay as they were)."""
    key: dict[str, Any] = {"training": training.recipe_config()}
    if training.init:
        key["init_content"] = checkpoint_content(training.init, options, "training.init")
    elif spec.factory is not None:
        with torch.random.fork_rng():
            key["initial_weights"] = state_digest(initial_model(spec, training, data, options))
    return key


def check_tokens(spec: ModelSpec, *splits: Any) -> None:
    """The built-in transformer reads features as token ids: whole numbers in [0, vocab_size), checked block by block
    over every split (an id out of range would fail deep inside a scoring task)."""
    for x in splits:
        n = x.shape[0]
        step = x.chunks[0] if hasattr(x, "chunks") else n
        for lo in range(0, n, step):
            block = np.asarray(x[lo : lo + step]).reshape(min(step, n - lo), -1)
            bad = (block != np.round(block)) | (block < 0) | (block >= spec.vocab_size)
            if bad.any():
                row, column = np.argwhere(bad)[0]
                raise ConfigError(
                    "model.vocab_size", f"row {lo + row} holds {block[row, column]:g} at position {column}, not a token id in [0, {spec.vocab_size})",
                    "store whole-number token ids below model.vocab_size, or raise model.vocab_size",
                )


def check_model_fits(model: nn.Module, spec: ModelSpec, arrays: dict[str, Any]) -> None:
    """Raise a ConfigError naming the model's field when its inputs or outputs cannot be scored against the labels by
    the task (model.options for a factory's model)."""
    if spec.factory is None and spec.architecture == "transformer":
        check_tokens(spec, arrays["x_train"])  # the queries' ids are checked by every run (check_queries): this stage is reused across query sets
    x, y = arrays["x_train"], arrays["y_train"]
    objective = Objective(model, spec.make_task())
    probe_forward(objective, spec, examples.read(x, slice(0, 64)), examples.read(y, slice(0, 64)))
    try:
        outputs = objective.check_outputs(examples.read(x, slice(0, 64)), examples.read(y))
    except ConfigError as exc:
        raise _setting_to_change(exc, spec) from None
    if spec.task == "auto" and spec.task_class is None:
        check_auto_unambiguous(outputs, examples.read(y, slice(0, len(outputs))))


def check_auto_unambiguous(outputs: torch.Tensor, labels: torch.Tensor) -> None:
    """`model.task: auto` reads (batch, positions, vocabulary) outputs for integer (batch, positions) labels as a
    classification of each position, though they are as likely a language model's next-token logits: refused."""
    if outputs.ndim == 3 and labels.ndim == 2 and not labels.is_floating_point():
        raise ConfigError(
            "model.task", f"auto cannot tell whether outputs of shape {tuple(outputs.shape)} for integer labels of shape {tuple(labels.shape)} "
            "classify each position or predict the next token",
            "set model.task: language_modelling (the labels are the token ids, each predicted from the tokens before it), or model.task: classification (one class per position)",
        )


def _setting_to_change(exc: ConfigError, spec: ModelSpec) -> ConfigError:
    """A refusal of the probe batch, named by the setting that fixes it: model.task_class for the task's own values,
    model.options for a factory's model, else as the library raised it."""
    if exc.field == "task" and spec.task_class is not None:
        return ConfigError("model.task_class", f"{spec.task_class}: {exc.problem}", exc.fix)
    if spec.factory is None:
        return exc
    return ConfigError("model.options", f"the model of {spec.factory} does not fit the {spec.task_name} task: {exc.problem}", exc.fix)


def check_queries(spec: ModelSpec, arrays: dict[str, Any]) -> None:
    """The queries fit the model: checked by every run, since the model is trained (and cached) on the training rows alone."""
    if spec.factory is None and spec.architecture == "transformer":
        check_tokens(spec, arrays["x_test"])


def check_query_labels(spec: ModelSpec, data: DataRef, y_test: Any) -> None:
    """A built-in classifier without `model.output_dim` has one output per training class (the training side is keyed
    on the training rows alone): a query label beyond them is refused before any stage computes, naming what to do."""
    if spec.factory is not None or spec.output_dim is not None or spec.task_name != "classification" or not np.issubdtype(y_test.dtype, np.integer):
        return
    labels = np.asarray(y_test[:])
    top, width = int(labels.max(initial=-1)), output_width(spec, data)
    if top >= width:
        raise ConfigError(
            "dataset",
            f"a query has label {top}, but the model has {width} outputs, one per class of the training rows (labels below {width})",
            f"leave out the queries of classes the training rows lack, or set model.output_dim: {top + 1} to train a model with an output for them",
        )


def probe_forward(objective: Objective, spec: ModelSpec, x: Any, y: torch.Tensor) -> None:
    """One forward pass on the first rows, before training: the model's own code failing (field names its forward does
    not take, token ids beyond its embeddings) or returning no tensor is told as one line naming the setting."""
    name = spec.factory or f"the built-in {spec.architecture}"
    xs, _ = objective.to_model(x, y)
    try:
        with torch.no_grad():
            out = objective.task.output(examples.call(objective.model, xs))
    except TypeError as exc:
        if not isinstance(xs, dict) or "unexpected keyword argument" not in str(exc):
            raise user_error("model", f"{name}'s forward", exc, "correct the model's forward pass, or give it inputs it takes") from None
        raise user_error("dataset.inputs", f"{name}'s forward", exc, f"name dataset.inputs ({', '.join(sorted(xs))}) after the arguments of the model's forward, or wrap the model to take them") from None
    except IndexError as exc:
        sizes = [m.num_embeddings for m in objective.model.modules() if isinstance(m, nn.Embedding)]
        raise user_error("model", f"{name}'s forward", exc, f"give token ids below the sizes of its embeddings {sizes} (vocabulary, positions): tokenize with the model's own tokenizer and cut sequences to its context") from None
    except Exception as exc:  # the user's model code failed: one line, and never retried
        raise user_error("model", f"{name}'s forward", exc, "correct the model's forward pass, or give it inputs it takes") from None
    if not isinstance(out, torch.Tensor):
        raise ConfigError("model", f"the forward pass of {name} returns a {type(out).__name__}, not a tensor", "return the outputs (e.g. the logits) as one tensor, or a Hugging Face output with .logits; wrap the model to pick them")
    objective.check_alone(xs)  # as every per-example gradient takes it


def train(model: nn.Module, spec: ModelSpec, training: TrainingSpec, x: Any, y: Any, weights: torch.Tensor | None = None) -> None:
    """Fit with the recipe of `training` (influence_core.training: Adam, L2 weight decay, the seeded batch schedule;
    `weights`: per-row loss weights), leaving the model in eval mode (`evaluate` measures it)."""
    fit(model, spec.make_task(), training.recipe(), x, y, weights)


def evaluate(model: nn.Module, task: Task, x: Any, y: Any, split: str) -> dict[str, float]:
    """`{split}_loss`, the mean loss over the rows of x, y, and `{split}_accuracy` where the task has an accuracy,
    in eval mode and block by block."""
    model.eval()
    objective = Objective(model, task)
    blocks = ArrayBatches(x, y, SHUFFLE_BLOCK_ROWS)
    total, right, made = 0.0, 0, 0
    with torch.no_grad():
        for xb, yb in blocks:
            xb, yb = objective.to_model(xb, yb)
            outputs = task.output(examples.call(model, xb))
            total += float(task.mean_loss(outputs, yb)) * len(yb)
            hits = task.correct(outputs, yb)
            right, made = (right + hits[0], made + hits[1]) if hits is not None else (right, made)
    accuracy = {f"{split}_accuracy": right / made} if made else {}
    return {f"{split}_loss": total / len(blocks), **accuracy}


def state_bytes(model: nn.Module) -> bytes:
    """The state_dict as stored: on the CPU, whatever device trained it, so it loads anywhere."""
    state = model.state_dict()
    for name, value in state.items():
        state[name] = value.cpu()  # in place: the OrderedDict keeps its version metadata
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def checkpoint_content(url: str, options: dict[str, Any], field: str = "model.checkpoint") -> str:
    """The checkpoint's content digest (part of fit_model's key: a replaced checkpoint is loaded again, whatever its
    size and stamps); a missing file or object is refused naming the field."""
    try:
        return storage.content_token(url, options)
    except FileNotFoundError:
        raise missing_weights(url, field) from None


def missing_weights(url: str, field: str) -> ConfigError:
    """A state_dict named by `field` (model.checkpoint, training.init) that is not there."""
    what = "initial weights" if field == "training.init" else "checkpoint"
    return ConfigError(field, f"no {what} at {url!r}", "give the path or s3:// URL of a saved state_dict")


def load_state(url: str, options: dict[str, Any], field: str = "model.checkpoint", device: str = "cpu") -> dict[str, torch.Tensor]:
    """Read a state_dict from a local path or URL with weights_only=True (no arbitrary code from pickles), onto `device`."""
    try:
        raw = storage.read_bytes(url, options)
    except FileNotFoundError:
        raise missing_weights(url, field) from None
    return parse_state(raw, url, field, device)


STORED_FIX = "run the pipeline again with the same parameters: the damaged stage is computed again"


def load_stored(url: str, options: dict[str, Any], field: str, device: str = "cpu") -> dict[str, torch.Tensor]:
    """A state_dict the pipeline wrote (`save_stored`), its bytes checked against their recorded sha256 first;
    FileNotFoundError when absent, integrity.DamagedError (one line naming `field`) when damaged."""
    return parse_state(integrity.read_checked(url, options, field, STORED_FIX), url, field, device)


def save_stored(url: str, raw: bytes, options: dict[str, Any]) -> None:
    """Store a serialized state_dict with its sha256, for `load_stored`."""
    integrity.write_checked(url, raw, options)


def parse_state(raw: bytes, url: str, field: str, device: str = "cpu") -> dict[str, torch.Tensor]:
    """A state_dict from its bytes: safetensors, or torch.load with weights_only=True."""
    if url.endswith(".safetensors"):
        return {name: value.to(device) for name, value in _safetensors(raw, url, field).items()}
    try:
        state = torch.load(io.BytesIO(raw), map_location=device, weights_only=True)
    except Exception as exc:  # torch raises UnpicklingError, RuntimeError, ... for foreign files
        raise ConfigError(
            field, f"{url!r} is not a weights-only state_dict: torch.load(weights_only=True) refused to unpickle it ({type(exc).__name__})", "save it with torch.save(model.state_dict(), path)"
        ) from None
    if not isinstance(state, dict):
        raise ConfigError(field, f"{url!r} holds a {type(state).__name__}, not a state_dict", "save model.state_dict(), not the model")
    return state


def _safetensors(raw: bytes, url: str, field: str) -> dict[str, torch.Tensor]:
    """A .safetensors state_dict (tensors only, by construction: nothing to unpickle)."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        return load(raw)
    except SafetensorError as exc:
        raise ConfigError(field, f"{url!r} is not a valid .safetensors file ({exc})", "save it with safetensors.torch.save_file(model.state_dict(), path)") from None


def load_into(model: nn.Module, state: dict[str, torch.Tensor], field: str = "model.checkpoint") -> nn.Module:
    """Load a state_dict, turning key or shape mismatches into an error that names the field."""
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        detail = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())  # the missing keys included
        if field == "training.init":
            raise ConfigError(field, f"the initial weights do not fit the model ({detail})", "give training.init the model's own state_dict (saved before any LoRA adapters), or match model.architecture/hidden/output_dim (or model.factory/options) to it") from None
        raise ConfigError(field, f"the checkpoint does not fit the model ({detail})", "match model.architecture/hidden/output_dim (or model.factory/options) to the checkpoint") from None
    return model.eval()
