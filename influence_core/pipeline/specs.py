"""Typed, validated settings for every stage; the pipeline's parameter form is built from these.

Every field has a title, a description and a default, so the Prefect UI renders a real form and the server
refuses values out of range.
"""

from __future__ import annotations

import dataclasses
import math
import re
from enum import Enum
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, ClassVar, Literal, Union, get_args, get_origin, get_type_hints

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError
import torch
from torch import nn

from .score.knn_prefilter import IndexKind, resolve_module
from .store import storage
from .sources.dotted import DOTTED, make_from
from ..errors import ConfigError
from .model.losses import LossName
from .model.transformer import TokenTransformer
from ..index_projection import MAX_SIDE
from ..projection import Projection
from ..task import BUILTIN, Classification, Task
from ..training import AdamRecipe, LrDecay
from ..methods import METHODS, InfluenceFunctionModel
from ..methods.options import group_fields


def plain_optional(schema: dict[str, Any]) -> None:
    """An optional scalar or list that defaults to empty is shown in a form as a plain input left blank, not as a
    choice of types reading 'Property is type "None"': `anyOf: [X, null], default: null` becomes X. Leaving it out
    still means None (pydantic's default), and JSON Schema validators (Prefect's server) accept a null for a
    property that is neither required nor has a default."""
    for prop in schema.get("properties", {}).values():
        options = prop.get("anyOf", [])
        kept = [option for option in options if option != {"type": "null"}]
        if "default" in prop and prop["default"] is None and len(kept) == 1 == len(options) - 1 and "type" in kept[0]:
            del prop["anyOf"], prop["default"]
            prop.update(kept[0])


class _AnyOfSchema:
    """Render a tagged union as `anyOf` in JSON schema: Prefect's form offers a choice among `anyOf` variants
    (it shows nothing for `oneOf`), while validation still dispatches on the tag (`name`, `source`) and reports errors per field.
    An unknown tag also fails a `not` beside the `anyOf` whose description lists the valid tags as the CLI does: a
    JSON Schema validator (Prefect's server, its UI) reports that error, not the `anyOf`'s generic one."""

    def __get_pydantic_json_schema__(self, core_schema: Any, handler: Any) -> dict[str, Any]:
        schema = handler(core_schema)
        if "oneOf" in schema:
            schema["anyOf"] = schema.pop("oneOf")
            discriminator = schema.pop("discriminator")
            schema["not"] = unknown_tag(discriminator["propertyName"], list(discriminator["mapping"]))
        return schema


def unknown_tag(tag: str, tags: list[str]) -> dict[str, Any]:
    """The JSON schema of an object whose `tag` is present and none of `tags`, described by the valid ones."""
    listed = ", ".join(f"'{value}'" for value in tags)
    return {
        "description": f"{tag} does not match any of the expected tags: {listed}. Fix: set {tag} to one of the values listed",
        "required": [tag],
        "properties": {tag: {"not": {"enum": tags}}},
    }


BOUND_SIGNS = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<"}


def _bounds(metadata: Any) -> list[str]:
    """The numeric bounds among a field's constraints (annotated_types' Ge, Gt, Le, Lt, or a Field's), as '≥ 0'."""
    found = []
    for item in metadata:
        inner = getattr(item, "metadata", None)
        if isinstance(inner, list):  # a Field(ge=...) inside Annotated
            found += _bounds(inner)
        for attribute, sign in BOUND_SIGNS.items():
            if hasattr(item, attribute):
                found.append(f"{sign} {getattr(item, attribute)}")
    return found


def _is_finite(value: Any) -> bool:
    """Whether a float (or a text pydantic would read as one, 'inf', 'nan') is finite; anything else is left to pydantic."""
    try:
        number = float(value) if isinstance(value, (float, str)) else 0.0
    except ValueError:
        return True
    return math.isfinite(number)


def misfit_number(value: Any, hint: Any, bounds: tuple[str, ...] = ()) -> str | None:
    """What `value` should have been where `hint` takes a number and pydantic's lax mode would read it into one
    wrongly or into one that means nothing: a bool (true would be 1), a fractional float for an integer, a NaN or
    infinity. Returns the number wanted ('a whole number ≥ 1', 'a finite number ≥ 0'), or None when it fits."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is Annotated:
        return misfit_number(value, args[0], (*bounds, *_bounds(args[1:])))
    if origin in (Union, UnionType):
        if isinstance(value, bool) and bool in args:
            return None
        return next((wanted for arg in args if (wanted := misfit_number(value, arg, bounds))), None)
    if origin is list and isinstance(value, list):
        return next((wanted for item in value if (wanted := misfit_number(item, args[0], bounds))), None)
    if origin is dict and isinstance(value, dict):
        return next((wanted for item in value.values() if (wanted := misfit_number(item, args[1], bounds))), None)
    limits = "".join(f" {bound}" if i == 0 else f" and {bound}" for i, bound in enumerate(bounds))
    if hint is int and (isinstance(value, bool) or (isinstance(value, float) and math.isfinite(value) and not value.is_integer())):
        return f"a whole number{limits}"
    if hint is float and (isinstance(value, bool) or not _is_finite(value)):
        return f"a finite number{limits}"
    return None


def auto_or_count(value: Any, field: str, low: int, high: int | None = None) -> Any:
    """A setting that is "auto" or a whole number in [low, high] (no bound when high is None), else one line naming
    the field (pydantic reports a union's members one line each)."""
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= low and (high is None or value <= high)):
        return value
    numbers = f"a whole number from {low} to {high}" if high is not None else f"a whole number, {low} or more"
    raise ConfigError(field, f"the value is neither auto nor {numbers}", f"set {field} to auto or {numbers}")


class Spec(BaseModel):
    """Base for settings: unknown keys are errors, so a typo never passes silently."""

    model_config = ConfigDict(extra="forbid", use_enum_values=True, validate_assignment=True, json_schema_extra=plain_optional)
    UNHASHED_AT: ClassVar[dict[str, Any]] = {}  # fields added after runs were stored, and the value that behaves as before

    @model_validator(mode="before")
    @classmethod
    def _plain_numbers(cls, data: Any) -> Any:
        """A number field never takes a bool (true would be 1), an integer one never a fractional float, and a
        float one never NaN or infinity (λ=inf scores every example 0): refused, each at its field, naming the
        number wanted. (A model validator: pydantic allows no field validator before a union's tag field.)"""
        if not isinstance(data, dict):
            return data
        misfits = [
            InitErrorDetails(type=PydanticCustomError("number_wanted", "Input should be {wanted}", {"wanted": wanted}), loc=(name,), input=value)
            for name, value in data.items()
            if name in cls.model_fields and (wanted := misfit_number(value, cls.model_fields[name].annotation, tuple(_bounds(cls.model_fields[name].metadata))))
        ]
        if misfits:
            raise ValidationError.from_exception_data(cls.__name__, misfits)
        return data

    def hashed_dump(self) -> dict[str, Any]:
        """The settings as keys hash them: each field of UNHASHED_AT left out at its value there, so the stages and
        runs stored before the field existed keep their keys."""
        return {name: value for name, value in self.model_dump(mode="json").items() if name not in self.UNHASHED_AT or value != self.UNHASHED_AT[name]}

    def key_config(self) -> dict[str, Any]:
        """The settings as stage keys and the run fingerprint hash them: `hashed_dump`, unless a spec says otherwise."""
        return self.hashed_dump()


# -- dataset -----------------------------------------------------------------------------------------
# The flat dataset spec's defaults of the fields that a source no longer has: stage keys and run fingerprints still
# hash them, so the cached stages and the stored runs of existing configs keep their keys.
RETIRED_DATASET_DEFAULTS: dict[str, Any] = {"path": None, "test_fraction": 0.2, "n_features": 20, "n_classes": 2, "noise": 0.1}


class DatasetBase(Spec):
    source: str  # each source's model narrows it to its own tag, a Literal with that default; declared here to come first
    n_train: int | None = Field(None, ge=1, title="Training examples", description="Keep at most this many training examples (all when empty; synthetic: how many to generate).")
    n_test: int | None = Field(None, ge=1, title="Query examples", description="Keep at most this many query examples (all when empty; synthetic: how many to generate); a source holding fewer keeps them all, and the run warns.")
    seed: int = Field(0, title="Seed", description="Seed of the split and of generated data.")
    chunk_rows: int = Field(4096, ge=1, title="Rows per chunk", description="Rows per Zarr chunk of the stored arrays.")
    query_offset: int = Field(
        0, ge=0, title="Query offset",
        description="Skip this many query examples before keeping n_test: a later run asks other held-out examples of the same split, "
        "with the same training rows, so it reuses the training side. Refused where the held-out rows depend on n_test (one set held out at random) and for listed queries.",
    )

    def key_config(self) -> dict[str, Any]:
        """The settings as the prepare_data key and the run fingerprint hash them (see RETIRED_DATASET_DEFAULTS);
        `query_offset` only when set, so the runs stored before it existed keep their keys."""
        config = {**RETIRED_DATASET_DEFAULTS, **self.model_dump(mode="json")}
        if not self.query_offset:
            del config["query_offset"]
        return config

    @property
    def labels_are_inputs(self) -> bool:
        """Whether the labels are an input's own values (token ids to predict one ahead), not labels of their own."""
        return False


class HeldOutDataset(DatasetBase):
    test_fraction: float = Field(0.2, gt=0, lt=1, title="Query fraction", description="Share of the data held out as queries when the source has no split.")


class DigitsDataset(HeldOutDataset):
    model_config = ConfigDict(title="Digits (scikit-learn)")

    source: Literal["digits"] = Field("digits", title="Source", description="scikit-learn's 8x8 digits: 1,797 images of 10 classes.")


class SyntheticDataset(DatasetBase):
    n_features: int = Field(20, ge=1, title="Features", description="Input dimension of the generated data.")
    noise: float = Field(0.1, ge=0, title="Noise", description="Noise scale: on the teacher's logits (classification, so label noise) or on the targets (regression).")


class SyntheticClassificationDataset(SyntheticDataset):
    model_config = ConfigDict(title="Synthetic classification")

    source: Literal["synthetic_classification"] = Field("synthetic_classification", title="Source", description="Seeded Gaussian inputs, labels from a fixed random linear teacher.")
    n_classes: int = Field(2, ge=2, title="Classes", description="Number of classes.")


class SyntheticRegressionDataset(SyntheticDataset):
    model_config = ConfigDict(title="Synthetic regression")

    source: Literal["synthetic_regression"] = Field("synthetic_regression", title="Source", description="Seeded Gaussian inputs, targets from a fixed random linear teacher.")


class PathDataset(HeldOutDataset):
    path: str | None = Field(None, title="Path", description="The file, directory, Zarr URL, or `package.module:factory` of the source.")
    inputs: list[str] | None = Field(
        None, title="Input fields",
        description="Named input fields (e.g. input_ids, attention_mask, pixel_values), each its own array, passed to the model as keyword arguments: model(**fields). "
        "Empty: one input array x, passed as model(x).",
    )
    target: str = Field("y", title="Target field", description="The field of the labels (e.g. labels); naming an input (input_ids) makes it the labels too, with IGNORE_INDEX where attention_mask is 0.")

    @field_validator("inputs")
    @classmethod
    def _distinct_names(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and (not value or len(set(value)) != len(value) or not all(re.fullmatch(r"\w+", name) for name in value)):
            raise ConfigError("dataset.inputs", f"{value} is not a list of distinct field names", "list each input field once, e.g. [input_ids, attention_mask], or leave it empty for one array x")
        return value

    @property
    def labels_are_inputs(self) -> bool:
        """Whether `target` names an input field (input_ids: labels for language modelling)."""
        return self.target in (self.inputs or ["x"])

    def key_config(self) -> dict[str, Any]:
        """As DatasetBase's, without the field names left at their defaults: existing configs keep their keys."""
        config = super().key_config()
        if self.inputs is None:
            del config["inputs"]
        if self.target == "y":
            del config["target"]
        return config

    @model_validator(mode="after")
    def _path_fits_source(self) -> "PathDataset":
        needs = {
            "npz": "a .npz file", "npy": "a directory of .npy files", "zarr": "a Zarr group URL", "torch": "a `package.module:factory`",
            "hf_disk": "a directory written by datasets' save_to_disk", "parquet": "a Parquet/Arrow file or a directory with train and test files",
        }
        if not self.path:
            raise ConfigError("dataset.path", f"source={self.source} needs a path", f"give {needs[self.source]}")
        if self.source == "torch":
            if not re.fullmatch(r"[\w.]+:\w+", self.path):
                raise ConfigError("dataset.path", f"{self.path!r} is not `package.module:factory`", "name an importable module and a factory in it, e.g. mypackage.data:make_dataset")
        elif "://" not in self.path and not Path(self.path.removeprefix("file://")).expanduser().exists():
            raise ConfigError("dataset.path", f"{self.path!r} does not exist", f"give {needs[self.source]} that exists")
        return self


class NpzDataset(PathDataset):
    model_config = ConfigDict(title=".npz file")

    source: Literal["npz"] = Field("npz", title="Source", description="A .npz file of x_train, y_train, x_test, y_test, or x, y split by test_fraction.")


class NpyDataset(PathDataset):
    model_config = ConfigDict(title=".npy directory")

    source: Literal["npy"] = Field("npy", title="Source", description="A directory of .npy files (memory-mapped), named as for npz.")


class ZarrDataset(PathDataset):
    model_config = ConfigDict(title="Zarr group")

    source: Literal["zarr"] = Field("zarr", title="Source", description="A Zarr group, local or s3://, of arrays named as for npz.")


class TorchFactoryDataset(PathDataset):
    model_config = ConfigDict(title="Torch dataset factory")

    source: Literal["torch"] = Field("torch", title="Source", description="A `package.module:factory` returning a torch Dataset of (x, y) pairs, or a (train, test) pair.")


class HfDiskDataset(PathDataset):
    model_config = ConfigDict(title="Hugging Face dataset on disk")

    source: Literal["hf_disk"] = Field(
        "hf_disk", title="Source",
        description="A datasets.Dataset (split by test_fraction) or DatasetDict (train and test splits) saved with save_to_disk; columns are fields, fixed-length lists become dimensions.",
    )


class ParquetDataset(PathDataset):
    model_config = ConfigDict(title="Parquet / Arrow files")

    source: Literal["parquet"] = Field(
        "parquet", title="Source",
        description="A local .parquet, .arrow or .feather file (split by test_fraction), or a directory with train.* and test.* files; columns are fields, fixed-length lists become dimensions.",
    )


class PythonDocsDataset(DatasetBase):
    model_config = ConfigDict(title="Python docstrings (text)")

    source: Literal["python_docs"] = Field(
        "python_docs", title="Source",
        description="Byte windows of the docstrings of Python's standard library (shipped with Python): token ids 0-255, labels the same ids, for language modelling.",
    )
    window: int = Field(64, ge=4, le=4096, title="Window (bytes)", description="Bytes per example: the model's context.")
    train_offset: int = Field(
        0, ge=0, title="Training offset",
        description="Skip this many of the seeded shuffled training windows before keeping n_train: runs with other offsets train on disjoint windows "
        "(e.g. pretrain on the first 2,000, fine-tune on the next 600).",
    )
    queries: list[str] = Field(
        [], title="Queries",
        description="Texts 'prompt|completion': each query's measurement is the completion's log-probability after the prompt. Empty: n_test held-out windows.",
    )

    @property
    def labels_are_inputs(self) -> bool:
        """The windows' labels are their own byte ids."""
        return True

    def key_config(self) -> dict[str, Any]:
        """As DatasetBase's, `train_offset` only when set: the runs stored before it existed keep their keys."""
        config = super().key_config()
        if not self.train_offset:
            del config["train_offset"]
        return config

    @field_validator("queries")
    @classmethod
    def _prompt_and_completion(cls, value: list[str]) -> list[str]:
        for text in value:
            if text.count("|") != 1 or not text.split("|")[1]:
                raise ConfigError("dataset.queries", f"{text!r} is not 'prompt|completion'", "mark where the completion starts with one '|', e.g. 'Return the| absolute value'")
        return value

    @model_validator(mode="after")
    def _queries_fit(self) -> "PythonDocsDataset":
        too_long = [text for text in self.queries if len(text.replace("|", "").encode()) > self.window]
        if too_long:
            raise ConfigError("dataset.queries", f"{too_long[0]!r} is longer than window={self.window} bytes", f"shorten it, or raise dataset.window to at least {len(too_long[0].replace('|', '').encode())}")
        return self


def _digits_by_default(value: Any) -> Any:
    """A dataset section without `source` is the digits (the demo's dataset), as when the spec was flat."""
    return {"source": "digits", **value} if isinstance(value, dict) else value


DatasetSpec = Annotated[
    Union[DigitsDataset, SyntheticClassificationDataset, SyntheticRegressionDataset, NpzDataset, NpyDataset, ZarrDataset, TorchFactoryDataset, HfDiskDataset, ParquetDataset, PythonDocsDataset],
    Field(discriminator="source"),
    BeforeValidator(_digits_by_default),
    _AnyOfSchema(),
]


# -- model and training --------------------------------------------------------------------------------
class Architecture(str, Enum):
    mlp = "mlp"
    linear = "linear"
    cnn = "cnn"
    transformer = "transformer"


def float_inputs(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """A forward pre-hook: integer inputs cast to the module's parameter dtype (a module-level function, so a model
    carrying it still pickles)."""
    dtype = next(module.parameters()).dtype
    return tuple(a.to(dtype) if isinstance(a, torch.Tensor) and not a.is_floating_point() else a for a in args)


TRANSFORMER_FIELDS = {"d_model", "heads", "layers", "vocab_size"}
ARCHITECTURE_FIELDS = {"mlp": {"hidden", "activation"}, "linear": set(), "cnn": {"channels", "activation", "pooling"}, "transformer": TRANSFORMER_FIELDS}  # each one's own settings
LOSS_TASKS = {"cross_entropy": "classification", "mse": "regression"}


class Activation(str, Enum):
    tanh = "tanh"
    relu = "relu"
    gelu = "gelu"


class ModelSpec(Spec):
    architecture: Architecture = Field(
        Architecture.mlp, title="Architecture",
        description="mlp: fully connected with `hidden` layers; linear: one linear layer (linear/logistic regression); cnn: 3x3 convolutions with `channels`, for images; "
        "transformer: token ids (n, T) through `layers` blocks of width `d_model`, a causal language model with task language_modelling, else an encoder classifier.",
    )
    hidden: list[Annotated[int, Field(ge=1)]] = Field([32], title="Hidden widths", description="Width of each hidden layer of the MLP.")
    activation: Activation = Field(Activation.tanh, title="Activation", description="Nonlinearity between MLP layers (tanh keeps the Hessian smooth).")
    output_dim: int | None = Field(None, ge=1, title="Outputs", description="Output width; empty means one per class (classification) or 1 (regression).")
    channels: list[Annotated[int, Field(ge=1)]] = Field([8, 16], title="Channels (cnn)", description="Output channels of each 3x3 convolution of the cnn (each followed by the activation and a 2x2 pool while the image is at least 2x2).")
    pooling: Literal["max", "avg"] = Field(
        "max", title="Pooling (cnn)",
        description="The cnn's 2x2 pools: max, or avg (smooth in the weights: MAGIC's metagradients then follow retraining far better, docs/methods.md).",
    )
    d_model: int = Field(64, ge=1, title="Width (transformer)", description="Embedding width of the transformer; a multiple of `heads`.")
    heads: int = Field(2, ge=1, title="Attention heads (transformer)", description="Attention heads per transformer block.")
    layers: int = Field(2, ge=1, title="Blocks (transformer)", description="Transformer blocks (attention and feed-forward, pre-norm).")
    vocab_size: int = Field(256, ge=2, title="Vocabulary (transformer)", description="Token ids run from 0 to vocab_size - 1 (256: bytes); a language model emits one logit per token.")
    factory: str | None = Field(None, title="Model factory", description="`package.module:callable` that returns your torch.nn.Module, called with `options`; replaces architecture, hidden, activation, channels and output_dim.")
    options: dict[str, Any] = Field({}, title="Factory options", description="Keyword arguments of the model factory.")
    loss: LossName = Field("cross_entropy", title="Loss", description="Training loss, also the loss whose influence is measured (cross_entropy: the classification task, mse: regression).")
    task: Literal["auto", "classification", "regression", "language_modelling"] = Field(
        "auto", title="Task",
        description="What is attributed, a built-in task (influence_core.task); auto: language_modelling when dataset.target names an input field "
        "(python_docs: always), else the loss's task (a classification's (batch, positions, vocabulary) outputs are refused as ambiguous). Training uses the task's loss.",
    )
    measurement: Literal["loss", "margin"] = Field("loss", title="Query measurement", description="What the queries' scores are the gradient of: the loss, or (classification) minus the margin of the true class.")
    task_class: str | None = Field(
        None, title="Task class",
        description="`package.module:callable` returning your influence_core.task.Task (a Task subclass, or a factory), called with `task_options`: "
        "its loss is trained and attributed and its measurement scored, replacing the built-in task's; `task` still sets a built-in architecture's outputs.",
    )
    task_options: dict[str, Any] = Field({}, title="Task options", description="Keyword arguments of the task class.")
    checkpoint: str | None = Field(None, title="Checkpoint", description="A state_dict file (local or s3://) to load instead of training: .safetensors, or a torch.save file read with torch.load(weights_only=True).")
    dtype: Literal["float32", "float64"] = Field("float32", title="Precision", description="Parameter dtype; results follow it.")

    @model_validator(mode="after")
    def _plug_ins(self) -> "ModelSpec":
        if self.factory is not None and not DOTTED.fullmatch(self.factory):
            raise ConfigError("model.factory", f"{self.factory!r} is not `package.module:callable`", "name an importable module and a callable in it, e.g. mypackage.models:make_model")
        if self.architecture == Architecture.transformer.value and self.d_model % self.heads:
            raise ConfigError("model.heads", f"d_model={self.d_model} does not split into {self.heads} heads", f"use a d_model that is a multiple of heads, e.g. {self.heads * max(1, self.d_model // self.heads)}")
        if self.task_class is not None and not DOTTED.fullmatch(self.task_class):
            raise ConfigError("model.task_class", f"{self.task_class!r} is not `package.module:callable`", "name an importable module and a Task class in it, e.g. mypackage.tasks:MyTask")
        if self.task_class is not None and self.measurement != "loss":
            raise ConfigError("model.measurement", f"{self.measurement} is a built-in task's measurement, but model.task_class defines its own", "leave model.measurement at loss, or define the measurement in your Task")
        if self.measurement == "margin" and self.task_name != "classification":
            raise ConfigError("model.measurement", f"the margin needs the classification task, not {self.task_name}", "set model.measurement: loss, or model.task: classification")
        return self

    UNHASHED_AT: ClassVar[dict[str, Any]] = {"pooling": "max"}  # the pools the cnn always had

    def key_config(self) -> dict[str, Any]:
        """The settings as the run fingerprint hashes them: the stages' less the transformer's (but for a transformer)
        and a task class's when not given, so the runs stored before those fields existed keep their fingerprints."""
        excluded = set() if self.architecture == Architecture.transformer.value else set(TRANSFORMER_FIELDS)
        if self.task_class is None:
            excluded |= {"task_class", "task_options"}
        return {name: value for name, value in self.hashed_dump().items() if name not in excluded}

    def applied_config(self) -> dict[str, Any]:
        """The settings that shape this model, as a run records them: a factory's and its options, or the built-in
        architecture's own fields (hidden widths for mlp, channels for cnn, the transformer's sizes); the task class's
        only when given."""
        used = {"factory", "options"} if self.factory is not None else {"architecture", "output_dim", *ARCHITECTURE_FIELDS[self.architecture]}
        task = {"task_class", "task_options"} if self.task_class is not None else set()
        common = {"loss", "task", "measurement", "checkpoint", "dtype"}
        return self.model_dump(mode="json", include=used | task | common)

    @property
    def token_inputs(self) -> bool:
        """Whether the inputs are token ids (a language model, or the built-in transformer): shown as text."""
        return self.task_name == "language_modelling" or (self.architecture == Architecture.transformer.value and self.factory is None)

    @property
    def task_name(self) -> str:
        """The built-in task in force: `task`, or for auto the loss's (RunParameters first resolves auto to
        language_modelling where the labels are the inputs' ids)."""
        return LOSS_TASKS[self.loss] if self.task == "auto" else self.task

    @property
    def attributed_task(self) -> str:
        """What the scores attribute, as summaries state it: the task class, else the built-in task, never `auto`."""
        return self.task_class or self.task_name

    def make_task(self) -> Task:
        """The Task influence attributes, and training minimises: the task class's, or the built-in task's."""
        if self.task_class is not None:
            fix = "subclass influence_core.task.Task (loss, measurement, Fisher targets)"
            return make_from(self.task_class, self.task_options, "model.task_class", "model.task_options", Task, "an influence_core.task.Task", fix)
        return Classification(self.measurement) if self.task_name == "classification" else BUILTIN[self.task_name]()

    def build(self, in_features: int, out_features: int, feature_shape: tuple[int, ...] | None = None) -> nn.Module:
        """Construct the module described here (weights random until trained or loaded): the factory's, or a built-in
        architecture for inputs of `feature_shape` (flat `in_features`)."""
        if self.factory is not None:
            return make_from(self.factory, self.options, "model.factory", "model.options", nn.Module, "a torch.nn.Module", "return the model itself")
        if self.architecture == Architecture.transformer.value:
            if feature_shape and len(feature_shape) != 1:
                raise ConfigError("model.architecture", f"transformer needs token ids of shape (n, T), not features of shape {tuple(feature_shape)}", "store one row of token ids per example, or use architecture cnn or mlp")
            context = feature_shape[0] if feature_shape else in_features
            causal = self.task_name == "language_modelling"
            return TokenTransformer(self.vocab_size, context, self.d_model, self.heads, self.layers, out_features, causal)
        module = self._numeric(in_features, out_features, feature_shape)
        module.register_forward_pre_hook(float_inputs)  # integer features (pixel counts) enter as the weights' dtype
        return module

    def _numeric(self, in_features: int, out_features: int, feature_shape: tuple[int, ...] | None) -> nn.Module:
        """The built-in architectures on numeric features: linear, mlp or cnn."""
        if self.architecture == Architecture.linear.value:
            return nn.Sequential(nn.Flatten(), nn.Linear(in_features, out_features))
        act = {"tanh": nn.Tanh, "relu": nn.ReLU, "gelu": nn.GELU}[self.activation]
        if self.architecture == Architecture.cnn.value:
            return self._cnn(feature_shape or (in_features,), out_features, act)
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for h in self.hidden:
            layers += [nn.Linear(width, h), act()]
            width = h
        layers.append(nn.Linear(width, out_features))
        return nn.Sequential(*layers)


    def _cnn(self, shape: tuple[int, ...], out_features: int, act: type[nn.Module]) -> nn.Module:
        """3x3 convolutions (padding 1) with the activation and 2x2 max- or average-pooling, then a linear head."""
        if len(shape) not in (2, 3):
            raise ConfigError("model.architecture", f"cnn needs images, (C, H, W) or (H, W) features, not {tuple(shape)}", "store images with their shape, or use architecture mlp")
        layers: list[nn.Module] = [] if len(shape) == 3 else [nn.Unflatten(1, (1, shape[0]))]  # (B, H, W) → (B, 1, H, W)
        channels, height, width = shape if len(shape) == 3 else (1, *shape)
        for out in self.channels:
            layers += [nn.Conv2d(channels, out, 3, padding=1), act()]
            if min(height, width) >= 2:
                layers.append(nn.MaxPool2d(2) if self.pooling == "max" else nn.AvgPool2d(2))
                height, width = height // 2, width // 2
            channels = out
        return nn.Sequential(*layers, nn.Flatten(), nn.Linear(channels * height * width, out_features))


class LoraSpec(Spec):
    """LoRA adapters (peft) on the named modules: only they are trained, and attribution works in their parameters."""

    model_config = ConfigDict(title="LoRA adapters")

    rank: int = Field(8, ge=1, title="Rank", description="Rank r of each adapter: lora_B (out × r) · lora_A (r × in) is added to the module's weight.")
    alpha: float = Field(16.0, gt=0, title="Alpha", description="Scaling: the adapter's update is multiplied by alpha / rank.")
    target_modules: list[Annotated[str, Field(min_length=1)]] = Field(
        ["query", "value"], min_length=1, title="Target modules",
        description="Names (or name endings) of the nn.Linear modules that get adapters: by default the built-in transformer's attention queries and values; e.g. [c_attn] for GPT-2.",
    )
    dropout: float = Field(
        0.0, ge=0, lt=1, title="Adapter dropout",
        description="Dropout on each adapter's input while training (0: off). Method magic refuses it: its random masks cannot be replayed.",
    )

    def config(self) -> dict[str, Any]:
        """peft's LoraConfig arguments for these adapters."""
        return {"r": self.rank, "lora_alpha": self.alpha, "target_modules": list(self.target_modules), "lora_dropout": self.dropout, "bias": "none"}


class TrainingSpec(Spec):
    epochs: int = Field(60, ge=0, title="Epochs", description="Passes over the training data.")
    batch_size: int = Field(64, ge=1, title="Batch size", description="Mini-batch size of the optimiser.")
    learning_rate: float = Field(1e-2, gt=0, title="Learning rate", description="Adam step size (the first step's, when it decays).")
    lr_decay: LrDecay = Field(
        "constant", title="Learning-rate decay",
        description="constant: the same step size throughout; linear or cosine: decayed from learning_rate towards 0 over the training's steps (MAGIC's metagradients follow the trained run more closely when late steps are small).",
    )
    warmup: float = Field(
        0.0, ge=0, lt=1, title="Warm-up share",
        description="The first round(warmup × T) of the T steps rise linearly from a step size of exactly 0 to learning_rate; the decay runs over the rest. "
        "Method magic needs it (docs/methods.md): without it, Adam's first step moves every weight by ±learning_rate, whatever its gradient's size.",
    )
    weight_decay: float = Field(1e-3, ge=0, title="Weight decay", description="L2 penalty added to the training loss.")
    seed: int = Field(0, title="Seed", description="Seed of initialisation and batch order.")
    ensemble: int = Field(
        1, ge=1, le=64, title="Ensemble members",
        description="Train this many models (member m with seed + m) and average their scores and self-influences, as TRAK's ensemble does. "
        "Each member's model, curvature and query factors are cached stages of their own; training, curvature and scoring cost this many times a single model's.",
    )
    init: str | None = Field(
        None, title="Initial weights",
        description="Fine-tune: a state_dict (local or s3://; .safetensors, or a torch.save file read with weights_only=True) that fit_model starts from "
        "and trains with this recipe (so do validation's retrainings and method magic's replay). Empty: the seeded initialisation, or a model factory's own (pretrained) weights.",
    )
    lora: LoraSpec | None = Field(None, title="LoRA adapters", description="Train LoRA adapters (peft) on the named modules instead of every weight; empty: every weight is trained.")

    UNHASHED_AT: ClassVar[dict[str, Any]] = {"ensemble": 1, "lr_decay": "constant", "init": None, "lora": None, "warmup": 0.0}  # as before each existed

    @field_validator("init")
    @classmethod
    def _supported_init(cls, value: str | None) -> str | None:
        if value is not None:
            storage.validate_url(value, "training.init")  # the scheme only: the path is kept as given, as model.checkpoint's
        return value

    def recipe_config(self) -> dict[str, Any]:
        """The settings as the keys of trained models hash them: `key_config` less where training.init lies (its
        content is hashed instead, models.training_key: a moved file trains nothing again, a replaced one retrains)."""
        return {name: value for name, value in self.key_config().items() if name != "init"}

    def recipe(self) -> AdamRecipe:
        """The library's recipe that fit_model trains with (and MAGIC replays)."""
        return AdamRecipe(self.epochs, self.batch_size, self.learning_rate, self.weight_decay, self.seed, decay=self.lr_decay, warmup=self.warmup)

    def member(self, index: int) -> "TrainingSpec":
        """How ensemble member `index` is trained: alone, with seed + index (member 0 is the single model)."""
        return self.model_copy(update={"seed": self.seed + index, "ensemble": 1})


# -- curvature methods ---------------------------------------------------------------------------------
class ProjectionSpec(Spec):
    model_config = ConfigDict(title="Projection")

    kind: Literal["gaussian", "rademacher", "logra"] = Field("logra", title="Projection", description="gaussian or rademacher: seeded random projection of each layer's gradient, built in blocks; logra: Kronecker-structured (Φ_out ⊗ Φ_in), never materialises per-example gradients.")
    dim: int = Field(256, ge=1, title="Dimension per layer", description="Coordinates each tracked layer is projected to (logra: a square, k×k).")
    seed: int = Field(0, title="Seed", description="Seed of the projection matrices.")
    block_mb: float = Field(256.0, gt=0, title="Block budget (MB)", description="Largest block of a random projection matrix ever built.")

    def build(self) -> Projection:
        return Projection(self.kind, self.dim, self.seed, self.block_mb)


class MethodBase(Spec):
    """A method's settings: each method's spec is derived from its library class's options (`method_spec`)."""

    def build(self, model: nn.Module, loss: Task | str) -> InfluenceFunctionModel:
        """The influence model for these settings, not yet fitted."""
        options = self.model_dump(exclude={"name", "projection"})
        projection = getattr(self, "projection", None)
        if projection is not None:
            options["projection"] = projection.build()
        return METHOD_CLASSES[self.name](model, loss, **options)  # type: ignore[attr-defined]


SPEC_TYPES: dict[Any, Any] = {Projection: ProjectionSpec}  # library option types the form shows as settings of their own


def option_type(hint: Any, bounds: dict[str, Any]) -> Any:
    """The pydantic type of a library option: library types as their specs, the bounds on every number it holds."""
    if hint in SPEC_TYPES:
        return SPEC_TYPES[hint]
    if hint in (int, float):
        return Annotated[hint, Field(**bounds)] if bounds else hint
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, UnionType):
        return Union[tuple(option_type(arg, bounds) for arg in args)]
    if origin is dict:
        return dict[args[0], option_type(args[1], bounds)]  # type: ignore[valid-type]
    return hint


def method_spec(method: type[InfluenceFunctionModel]) -> type[MethodBase]:
    """The spec of a library method, derived from its options dataclass: the shared groups' fields, the `name` tag,
    then the method's own fields, each with the dataclass field's default, title, description and bounds."""
    hints, shared = get_type_hints(method.Options), group_fields()
    tag = Field(method.name, title="Method", description=method.summary)
    annotations: dict[str, Any] = {}
    namespace: dict[str, Any] = {}
    for option in dataclasses.fields(method.Options):
        if option.name not in shared and "name" not in annotations:
            annotations["name"], namespace["name"] = Literal[method.name], tag
        bounds = {k: v for k, v in option.metadata.items() if k not in ("title", "description")}
        annotations[option.name] = option_type(hints[option.name], bounds)
        namespace[option.name] = Field(option.default, title=option.metadata["title"], description=option.metadata["description"])
    if "name" not in annotations:
        annotations["name"], namespace["name"] = Literal[method.name], tag
    class_name = method.Options.__name__.removesuffix("Options") + "Method"
    body = {"__annotations__": annotations, "__module__": __name__, "__qualname__": class_name, "model_config": ConfigDict(title=method.title), **namespace}
    return type(class_name, (MethodBase,), body)


METHOD_CLASSES: dict[str, type[InfluenceFunctionModel]] = {method.name: method for method in METHODS}
METHOD_SPECS: dict[str, type[MethodBase]] = {method.name: method_spec(method) for method in METHODS}
# The specs by name, for importers (the classes are built above, so these names are what pickle finds).
DirectMethod = METHOD_SPECS["direct"]
CgMethod = METHOD_SPECS["cg"]
LissaMethod = METHOD_SPECS["lissa"]
ArnoldiMethod = METHOD_SPECS["arnoldi"]
NystroemMethod = METHOD_SPECS["nystroem"]
DataInfMethod = METHOD_SPECS["datainf"]
IdentityMethod = METHOD_SPECS["identity"]
KfacMethod = METHOD_SPECS["kfac"]
EkfacMethod = METHOD_SPECS["ekfac"]



class MagicMethod(Spec):
    """MAGIC: exact metagradients through the pipeline's own training (influence_core.magic), no curvature at all."""

    model_config = ConfigDict(title="MAGIC (metagradients through training)")

    name: Literal["magic"] = Field(
        "magic", title="Method",
        description="Exact metagradients: each query's measurement differentiated in every training example's loss weight by reverse mode "
        "through every Adam step of fit_model's training, replayed from its seed. Needs the pipeline's own training (no model.checkpoint).",
    )
    query_block: int = Field(16, ge=1, title="Queries per block", description="Queries whose cotangents one reverse pass carries together: one Dask task each, cached and resumed like a score chunk.")
    checkpoint_every: int | None = Field(
        None, ge=1, title="Checkpoint every (steps)",
        description="Keep the training state every this many steps and recompute the steps in between; empty: ⌈√T⌉ for T steps, so memory grows as √T.",
    )


MethodSpec = Annotated[Union[(*METHOD_SPECS.values(), MagicMethod)], Field(discriminator="name"), _AnyOfSchema()]


# -- compute ---------------------------------------------------------------------------------------------
class ClusterKind(str, Enum):
    local = "local"
    cuda = "cuda"
    address = "address"
    sequential = "sequential"


class ComputeSpec(Spec):
    cluster: ClusterKind = Field(ClusterKind.local, title="Cluster", description="local: a LocalCluster here; cuda: one worker per GPU (gpu extra); address: an existing scheduler; sequential: no Dask.")
    address: str | None = Field(None, title="Scheduler address", description="For cluster=address, e.g. tcp://host:8786.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", title="Device",
        description="Where models, curvature, query factors and scores compute: cuda (each Dask worker's GPU; the flow process's for its own stages), cpu, or auto: cuda with cluster=cuda, else cpu.",
    )
    n_workers: int = Field(2, ge=1, title="Workers", description="Worker processes of a local cluster.")
    torch_threads: int = Field(
        2, ge=1, le=256, title="Torch threads per stage",
        description="Intra-op threads of the stages that compute in the flow process (training, curvature, query factors); "
        "every Dask task uses 1. Fixed, not taken from the machine, so a stage gives bit-identical results in any process.",
    )
    in_process_gflop: float | None = Field(
        None, ge=0, title="In-process work (GFLOP)",
        description="A stage's tasks (factor passes, the index pass, scoring) whose estimated work is under this many GFLOP run in the "
        "flow's process, on as many threads as a local cluster has workers, with the workers' arithmetic (the same bits), and start no "
        "cluster. Empty: automatic (100; with a local cluster not yet started, what its workers do in 5× its ~3 s start, 2,550 for 2 "
        "workers). 0: every task on the cluster's workers.",
    )
    allow_multithreaded_workers: bool = Field(False, title="Allow multi-threaded workers", description="Accept workers with several threads although the method is not thread-safe.")
    train_chunk_rows: int | None = Field(None, ge=1, title="Train rows per task", description="Training examples scored per task and written as one shard (empty: from target_shard_mb, and at least 8 tasks).")
    target_shard_mb: float = Field(64.0, gt=0, title="Shard size (MB)", description="Target size of one shard of the scores array.")
    index_budget_gb: float = Field(
        1.0, ge=0, title="Training index budget (GB)",
        description="Index once, query many: every training example's features (its gradient in the method's coordinates) are "
        "stored once (index_training) when n_train × dimension fits this many GB, and every later run scores its queries against "
        "them without a training gradient; larger, it is compressed (LoGra: index_side² numbers per layer, stored as index_dtype, the side "
        "the largest that fits by default). "
        "0: no index (each run recomputes the training gradients).",
    )
    index_side: Annotated[int, Field(ge=1, le=MAX_SIDE)] | Literal["auto"] = Field(
        "auto", title="Compressed index side",
        description="A compressed index projects each layer's gradient matrix to side × side numbers (Φ_out G Φ_inᵀ, the same on the "
        "query side; a layer smaller than the side is kept whole). auto: the largest side whose index fits index_budget_gb; a number "
        "fixes it. Larger is closer to the exact scores and costs side² numbers per layer and example.",
    )
    index_probe: int = Field(
        16, ge=0, le=256, title="Index probe rows",
        description="A compressed index is checked in its own pass: this many training rows (seeded) are scored against every "
        "training row exactly and through the index, and summary.json reports the recall@10 and Pearson of the two. 0: no check.",
    )
    index_dtype: Literal["auto", "float32", "float16"] = Field(
        "auto", title="Index storage dtype",
        description="auto: the model's dtype for an exact index, float16 for a compressed one; or float32, float16.",
    )

    @field_validator("index_side", mode="before")
    @classmethod
    def _side(cls, value: Any) -> Any:
        return auto_or_count(value, "compute.index_side", 1, MAX_SIDE)

    @property
    def torch_device(self) -> str:
        """The torch device the stages compute on: 'cuda' or 'cpu'."""
        return "cuda" if self.device == "cuda" or (self.device == "auto" and self.cluster == ClusterKind.cuda.value) else "cpu"

    @model_validator(mode="after")
    def _address_given(self) -> "ComputeSpec":
        if self.cluster == ClusterKind.address.value and not self.address:
            raise ConfigError("compute.address", "cluster=address needs the scheduler's address", "set compute.address, e.g. tcp://127.0.0.1:8786")
        return self


RERANK_PER_TOP_K = 8  # re-ranking's candidates a side at auto, per top-k example: W3's exact top 10 lie in its compressed (auto side) top 80 for 97% (helpful) and 95% (harmful)


class AggregateSpec(Spec):
    top_k: int = Field(5, ge=1, title="Top k", description="How many most helpful and most harmful training examples to keep per query.")
    self_influence: Literal["auto", "exact", "lowrank", "off"] = Field(
        "auto", title="Self-influence",
        description="exact: ∇ℓᵀ(C+λI)⁻¹∇ℓ per training example (for cg, lissa and datainf one solve per example: expensive); "
        "lowrank: exact in the curvature's top eigenspace, the rest at its mean eigenvalue; "
        "auto: exact where it costs at most about half of scoring (direct with few parameters, arnoldi, nystroem, identity, "
        "K-FAC/EK-FAC, projections), else lowrank; off: not computed. Method magic computes none (auto means off there).",
    )
    self_influence_rank: int = Field(32, ge=1, title="Self-influence rank", description="Rank of the lowrank estimate (auto without a training index uses at most half the number of queries, at least 4; with one, this rank).")
    report_queries: int = Field(6, ge=1, le=50, title="Queries in report", description="Queries shown in report.png and in the top-k table.")
    token_scores: bool = Field(
        False, title="Per-token scores",
        description="Language models: also store each query's top-k helpful and harmful examples' scores per training token "
        "(topk_helpful_token_scores, topk_harmful_token_scores, (n_test, k, T)), by one extra gradient pass over only those rows; "
        "the report shades each token by its score.",
    )
    rerank: Annotated[int, Field(ge=0)] | Literal["auto"] = Field(
        "auto", title="Re-ranked candidates",
        description="With a compressed training index: each query's this many most helpful and most harmful candidates by the "
        "index's scores are scored again exactly (one gradient pass over their union), so the top-k carry exact scores. "
        f"auto: {RERANK_PER_TOP_K} × top_k; 0: off (the top-k are the compressed scores').",
    )

    @field_validator("rerank", mode="before")
    @classmethod
    def _rerank(cls, value: Any) -> Any:
        return auto_or_count(value, "aggregate.rerank", 0)

    @model_validator(mode="after")
    def _rerank_holds_top_k(self) -> "AggregateSpec":
        if self.rerank != "auto" and 0 < self.rerank < self.top_k:
            raise ConfigError("aggregate.rerank", f"rerank={self.rerank} candidates a side cannot hold top_k={self.top_k}", f"set aggregate.rerank to at least {self.top_k}, to auto, or to 0 (off)")
        return self

    @property
    def rerank_per_side(self) -> int:
        """Candidates a side that re-ranking scores exactly (0: none)."""
        return RERANK_PER_TOP_K * self.top_k if self.rerank == "auto" else self.rerank


class ValidationSpec(Spec):
    """The run's own linear datamodeling score (LDS): retrain on random subsets, and see how well the summed scores
    rank the retrained models' query measurements. Off (0 subsets) unless asked for: it costs `subsets` trainings."""

    model_config = ConfigDict(title="Validation (LDS)")

    subsets: int = Field(
        0, ge=0, le=1000, title="Retrained subsets",
        description="0: no validation. Else retrain the model on this many random training subsets (one Dask task each, "
        "cached and resumed) and report the run's LDS; at least 3, 64 or more for a stable mean.",
    )
    fraction: float = Field(0.5, gt=0, lt=1, title="Subset fraction", description="Share of the training examples in each subset.")
    queries: int = Field(20, ge=1, title="Queries", description="The first this many queries are measured (all if fewer).")
    seed: int = Field(0, ge=0, title="Seed", description="Seed of the subsets' draw (training itself uses training.seed).")
    counterfactual: Literal["rebatch", "weights"] = Field(
        "rebatch", title="Subset training",
        description="How a subset is retrained: rebatch, its rows alone in the batch schedule of a training set of that size; "
        "weights, every batch of the full run kept with the removed rows' losses weighted 0 (the counterfactual method magic linearises).",
    )

    UNHASHED_AT: ClassVar[dict[str, Any]] = {"counterfactual": "rebatch"}  # the retraining validate always did

    @field_validator("subsets")
    @classmethod
    def _enough(cls, value: int) -> int:
        if value in (1, 2):
            raise ConfigError("validation.subsets", f"{value} subsets give no rank correlation", "use 0 (no validation) or 3 or more (64+ for a stable mean)")
        return value


class CandidatesSpec(Spec):
    model_config = ConfigDict(title="Candidates (FastIF)")

    knn_k: int | None = Field(
        None, title="Candidates per query (k)",
        description="FastIF's prefilter: each query scores only its k nearest training examples in the feature space of `module` "
        "(candidate_indices and candidate_scores, shape (n_test, k), replace scores). Empty: every training example (the full computation).",
    )
    module: str | None = Field(None, title="Feature module", description="The module whose output is the feature (a name from model.named_modules(), e.g. '2'); empty: the penultimate layer (the input of the last layer).")
    index: Literal["auto", "flat", "ivf", "hnsw"] = Field("auto", title="kNN index", description="FAISS index of the training features: flat (exact), ivf or hnsw (approximate, for large sets); auto: flat up to 100,000 training examples, ivf above.")

    @field_validator("knn_k")
    @classmethod
    def _positive(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ConfigError("candidates.knn_k", f"knn_k={value} leaves a query without candidates", "set candidates.knn_k to 1 or more, or null to score every training example")
        return value

    def check_model(self, model: "ModelSpec") -> None:
        """An unknown `module` fails here, before anything runs (module names depend only on the architecture)."""
        if self.knn_k is not None:
            resolve_module(model.build(1, 1), self.module)


class SearchSpec(Spec):
    """How a question against a run's training index finds each query's top-k."""

    model_config = ConfigDict(title="Search")

    kind: Literal["scan", "faiss"] = Field(
        "scan", title="Search",
        description="scan: every row of the run's index scored (exact). faiss: a FAISS inner-product index over the index's rows (built by the first such "
        "question, kept beside the index for later ones) gives each query's candidates, which are then scored exactly, for indexes too large to scan per question.",
    )
    index: IndexKind = Field("auto", title="FAISS index", description="flat (exact), ivf or hnsw (approximate, for large indexes); auto: flat up to 100,000 training examples, ivf above.")
    nprobe: int | None = Field(None, ge=1, title="IVF lists probed", description="Lists an ivf index searches per query: more is slower and finds more of the exact top-k. Empty: 1/16 of the lists, at least 8.")

    @model_validator(mode="after")
    def _nprobe_needs_ivf(self) -> "SearchSpec":
        if self.nprobe is not None and (self.kind != "faiss" or self.index in ("flat", "hnsw")):
            searched = "the exact scan" if self.kind != "faiss" else f"a {self.index} index"
            raise ConfigError("search.nprobe", f"nprobe={self.nprobe} applies to an ivf index, not to {searched}", "leave nprobe out, or search with faiss over an ivf (or auto) index")
        return self


# -- storage -----------------------------------------------------------------------------------------------
S3_ATTEMPTS = 12  # per S3 request, with capped exponential backoff: rides out an endpoint gone for about a minute


class StorageSpec(Spec):
    endpoint_url: str | None = Field(None, title="S3 endpoint", description="S3-compatible endpoint, e.g. http://127.0.0.1:9000 (empty: AWS). Credentials come from the environment, never from here.")
    region: str | None = Field(None, title="S3 region", description="Region name for S3.")
    cache_url: str | None = Field(None, title="Stage cache", description="Where stage outputs (data, model, curvature, factors) are kept; share it between runs to reuse them. Empty: the stages folder under the output URL.")

    @field_validator("endpoint_url")
    @classmethod
    def _no_credentials_in_url(cls, value: str | None) -> str | None:
        if value and "@" in value.split("://", 1)[-1].split("/", 1)[0]:
            raise ConfigError("storage.endpoint_url", "must not carry credentials", "give the endpoint without user:password@ and set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY in the environment")
        return value

    def fsspec_options(self) -> dict[str, Any]:
        """Options for fsspec/s3fs; listings are never cached, so completion checks see other writers, and dropped
        or refused connections are retried with capped exponential backoff (botocore's standard mode)."""
        client: dict[str, Any] = {}
        if self.endpoint_url:
            client["endpoint_url"] = self.endpoint_url
        if self.region:
            client["region_name"] = self.region
        options: dict[str, Any] = {"use_listings_cache": False, "config_kwargs": {"retries": {"max_attempts": S3_ATTEMPTS, "mode": "standard"}}}
        return {"client_kwargs": client, **options} if client else options
