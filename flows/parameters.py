"""RunParameters: the flow's typed parameters, which Prefect renders as the run form and validates."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from influence_core.pipeline.store import storage
from influence_core.pipeline.store.run_store import RunStore
from influence_core.pipeline.stages.metagradients import check_magic
from influence_core.pipeline.stages.training import check_ensemble, check_start
from influence_core.pipeline.stages.validation import check_validate
from influence_core.errors import ConfigError
from influence_core.pipeline.specs import AggregateSpec, CandidatesSpec, ComputeSpec, DatasetSpec, DigitsDataset, DirectMethod, MagicMethod, MethodSpec, ModelSpec, StorageSpec, TrainingSpec, ValidationSpec


FINGERPRINT = "{fingerprint}"  # in output_url: the run's parameter fingerprint, so each question has its own output
PLACEMENT = {"compute": ("cluster", "address", "device", "n_workers", "in_process_gflop", "allow_multithreaded_workers"), "storage": ("endpoint_url", "region", "cache_url")}
INDEX_FIELDS = ("index_budget_gb", "index_side", "index_dtype", "index_probe")  # the training index's options: hashed when not at their defaults
MAX_TEXT_CHARS = 4096  # a path, URL, name or option longer than this is a mistake (PATH_MAX is 4096)
MAX_PARAMETERS_BYTES = 524_288  # Prefect's server refuses a flow run whose parameters' JSON is larger (server.api.max_parameter_size)



class RunParameters(BaseModel):
    """One influence run: data, model, curvature method, compute, aggregation and where results go."""

    model_config = ConfigDict(extra="forbid", title="Influence run")

    output_url: str = Field(
        "runs/demo", title="Output URL",
        description="Local directory or s3://bucket/prefix receiving influence.zarr, report.png and summary.json. "
        f"{FINGERPRINT} in it becomes the run's parameter fingerprint: each question gets its own output, and asking it again reuses it.",
    )
    dataset: DatasetSpec = Field(default_factory=DigitsDataset, title="Dataset", description="Where the training and query examples come from (a source, with only that source's settings), and how they are split and chunked.")
    model: ModelSpec = Field(default_factory=ModelSpec, title="Model", description="The PyTorch model whose predictions are attributed: built here and trained, or loaded from a checkpoint.")
    training: TrainingSpec = Field(default_factory=TrainingSpec, title="Training", description="How the model is trained in the fit_model stage (ignored with a checkpoint).")
    method: MethodSpec = Field(default_factory=DirectMethod, title="Curvature method", description="How (H + λI)⁻¹ is approximated: exact, iterative, low-rank, Kronecker-factored, or none.")
    compute: ComputeSpec = Field(default_factory=ComputeSpec, title="Compute", description="Which Dask cluster scores the training chunks, and how large a chunk is.")
    aggregate: AggregateSpec = Field(default_factory=AggregateSpec, title="Aggregation", description="Top-k helpful and harmful examples per query, and the report.")
    candidates: CandidatesSpec = Field(default_factory=CandidatesSpec, title="Candidates (FastIF)", description="Score each query against only its k nearest training examples in a layer's feature space (a FAISS index): much less gradient work when k·n_test is small against n_train.")
    validation: ValidationSpec = Field(default_factory=ValidationSpec, title="Validation (LDS)", description="Optionally measure this run's linear datamodeling score: retrain on random subsets and check how well the scores predict the retrained models' query measurements.")
    storage: StorageSpec = Field(default_factory=StorageSpec, title="Storage", description="S3 endpoint and region, and a stage cache shared between runs; never credentials.")
    overwrite: bool = Field(
        False, title="Overwrite another run",
        description="Replace a run of other parameters found at the output URL (otherwise the run is refused before computing anything). "
        "A run of the same parameters is resumed or reused either way.",
    )

    @model_validator(mode="before")
    @classmethod
    def _sizes_fit(cls, data: Any) -> Any:
        """No text value longer than MAX_TEXT_CHARS and parameters within Prefect's size limit, refused naming the
        field without echoing the value (it is not printed: it may be a pasted secret, and is too long to read)."""
        if not isinstance(data, dict):
            return data
        plain = {name: value.model_dump(mode="json") if isinstance(value, BaseModel) else value for name, value in data.items()}
        for field, text in _texts(plain):
            if len(text) > MAX_TEXT_CHARS:
                raise ConfigError(field, f"the value is {len(text):,} characters long, more than the {MAX_TEXT_CHARS:,} a text parameter may hold (not printed)", f"give {field} a short value")
        size = len(json.dumps(plain, default=str))
        if size > MAX_PARAMETERS_BYTES:
            biggest = max(plain, key=lambda name: len(json.dumps(plain[name], default=str)))
            raise ConfigError(biggest, f"the parameters are {size:,} bytes of JSON, more than the {MAX_PARAMETERS_BYTES:,} a Prefect flow run may hold", f"make {biggest} smaller, e.g. pass large data by path")
        return data

    @field_validator("output_url")
    @classmethod
    def _supported_url(cls, value: str) -> str:
        storage.validate_url(value, "output_url")
        unknown = set(re.findall(r"\{[^}]*\}", value)) - {FINGERPRINT}
        if unknown:
            raise ConfigError("output_url", f"{sorted(unknown)[0]} is not a placeholder", f"use {FINGERPRINT} (the run's parameter fingerprint), or no braces")
        return value

    @model_validator(mode="after")
    def _task_resolved(self) -> "RunParameters":
        """`model.task: auto` over labels that are an input's own token ids (dataset.target names an input field) is
        language modelling: next-token prediction, never a classifier of the current token. Resolved here, so every
        stage, key and summary sees the task that runs."""
        if self.model.task == "auto" and self.dataset.labels_are_inputs:
            self.model.task = "language_modelling"
        return self

    @model_validator(mode="after")
    def _trained_or_loaded(self) -> "RunParameters":
        check_start(self.training, self.model)
        return self

    @model_validator(mode="after")
    def _validation_can_retrain(self) -> "RunParameters":
        check_validate(self.validation, self.model)
        return self

    @model_validator(mode="after")
    def _magic_can_replay(self) -> "RunParameters":
        if self.method.name == "magic":
            check_magic(self.model, self.training, self.aggregate, self.candidates)
        return self

    @model_validator(mode="after")
    def _ensemble_can_train(self) -> "RunParameters":
        check_ensemble(self.training, self.model, self.candidates)
        return self

    @model_validator(mode="after")
    def _token_scores_need_gradients(self) -> "RunParameters":
        """Per-token scores split a language model's training-row score over the row's tokens, by the gradient
        contraction before its sum over positions: another task has no next tokens to split over, and method magic no
        contraction. (Which parameters can be split is checked on the model, before training: `check_token_scores`.)"""
        if not self.aggregate.token_scores:
            return self
        if isinstance(self.method, MagicMethod):
            raise ConfigError("aggregate.token_scores", "method magic differentiates through training and gives no per-token split of a score", "set aggregate.token_scores to false, or choose an influence method (e.g. ekfac)")
        if self.model.task_name != "language_modelling":
            raise ConfigError(
                "aggregate.token_scores", f"per-token scores split a language model's scores over the tokens of each training row, but the task is {self.model.attributed_task}",
                "set aggregate.token_scores to false, or model.task: language_modelling for a model that predicts each next token of its inputs",
            )
        return self

    @model_validator(mode="after")
    def _candidates_fit(self) -> "RunParameters":
        """The prefilter's settings against the model and the aggregates, before anything runs."""
        knn_k = self.candidates.knn_k
        if knn_k is None:
            return self
        self.candidates.check_model(self.model)
        if self.aggregate.top_k > knn_k:
            raise ConfigError("candidates.knn_k", f"knn_k={knn_k} is below aggregate.top_k={self.aggregate.top_k}", f"set candidates.knn_k to at least {self.aggregate.top_k}, or lower aggregate.top_k")
        if self.aggregate.self_influence in ("exact", "lowrank"):
            raise ConfigError(
                "aggregate.self_influence", f"self_influence={self.aggregate.self_influence} needs every training example's gradient, which the candidate prefilter avoids",
                "set aggregate.self_influence to auto or off (no self_influence with candidates), or candidates.knn_k to null",
            )
        return self

    @classmethod
    def from_sections(cls, **sections: Any) -> "RunParameters":
        """The run of the flow's parameters (one per section, each already valid): a check across sections that
        fails is raised as its own ConfigError, the one line `field: problem. Fix: ...` a user should read. Sections
        are copied: the flow's default instances are never shared with a run."""
        try:
            return cls.model_validate({name: value.model_copy(deep=True) if isinstance(value, BaseModel) else value for name, value in sections.items()})
        except ValidationError as exc:
            causes = [err["ctx"]["error"] for err in exc.errors() if isinstance((err.get("ctx") or {}).get("error"), ConfigError)]
            if causes:
                raise causes[0] from None
            raise

    def sections(self) -> dict[str, Any]:
        """The flow's keyword arguments: `influence_run(**params.sections())`."""
        return {name: getattr(self, name) for name in type(self).model_fields}

    def store(self) -> RunStore:
        """Where the run writes: output_url, its {fingerprint} replaced by the run's fingerprint."""
        return RunStore(output_url=self.output_url.replace(FINGERPRINT, self.run_fingerprint()), storage=self.storage)

    def run_fingerprint(self) -> str:
        """What the run writes: every parameter but where it runs and stores (those never change a result: every
        cluster kind gives the same bits) and `overwrite`; validation and per-token scores only when on (off, it writes nothing), the index's options only when not at their defaults. Two runs
        with equal fingerprints may share an output."""
        where = {"output_url": True, "overwrite": True, "compute": set(PLACEMENT["compute"]), "storage": set(PLACEMENT["storage"])}
        if not self.validation.subsets:
            where["validation"] = True
        where["aggregate"] = {"rerank"} if self.aggregate.rerank == AggregateSpec().rerank else set()  # at its default: fingerprints from before it are unchanged
        if not self.aggregate.token_scores:  # off, it writes nothing: fingerprints of runs without it are unchanged
            where["aggregate"].add("token_scores")
        defaults = ComputeSpec()
        where["compute"] |= {name for name in INDEX_FIELDS if getattr(self.compute, name) == getattr(defaults, name)}  # the index's defaults: fingerprints from before it are unchanged
        dumped = {**self.model_dump(mode="json", exclude=where), "dataset": self.dataset.key_config(), "model": self.model.key_config(), "training": self.training.key_config()}  # type: ignore[arg-type]
        if self.validation.subsets:
            dumped["validation"] = self.validation.key_config()
        payload = json.dumps(dumped, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:24]

    def public_config(self) -> dict[str, Any]:
        """The parameters as JSON, the model's only with the fields that apply to it; they hold no credentials by
        construction (those come from the environment)."""
        return {**self.model_dump(mode="json"), "model": self.model.applied_config()}


def _texts(value: Any, field: str = "") -> Iterator[tuple[str, str]]:
    """Every text in a parameters tree (keys included) with the dotted name of where it sits."""
    if isinstance(value, str):
        yield field or "(top level)", value
    elif isinstance(value, dict):
        for key, item in value.items():
            name = f"{field}.{key}" if field else str(key)
            yield from _texts(str(key), field or "(top level)")
            yield from _texts(item, name)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _texts(item, f"{field}.{index}")
