"""Stage 5's input: the specs and refs that scoring and candidate scoring both plan from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .layout import ScoreLayout, score_layout
from ..store.refs import DataRef, FactorsRef, IndexRef, ModelRef, Ref, ScoresRef, StageRef
from ..store.run_store import RunStore
from ..specs import AggregateSpec, CandidatesSpec, ComputeSpec, MethodSpec
from ..store.stage import StageCall, StageInput


def output_bytes(data: DataRef, aggregate: AggregateSpec) -> int:
    """The float32 scores and self-influences, as stored uncompressed: what compute_influences needs on disk."""
    return 4 * data.n_test * data.n_train + (0 if aggregate.self_influence == "off" else 4 * data.n_train)


@dataclass(frozen=True)
class Member:
    """One model of an ensemble: its trained model, its fitted curvature, its query factors and its training index
    (None: scoring computes the training gradients)."""

    model: ModelRef
    preconditioner: StageRef
    factors: FactorsRef
    index: IndexRef | None = None

    def inputs(self, index: int) -> dict[str, Ref]:
        """Its refs as stage-key inputs; member 0's under the names a single model's have always had."""
        suffix = f"[{index}]" if index else ""
        # "curvature" names the preconditioner in stage keys and manifests already written: kept, so they still match
        refs: dict[str, Ref] = {f"model{suffix}": self.model, f"curvature{suffix}": self.preconditioner, f"factors{suffix}": self.factors}
        if self.index is not None and self.index.usable:
            refs[f"index{suffix}"] = self.index
        return refs


@dataclass(frozen=True)
class ScoringInput(StageInput[ScoresRef]):
    """The compute, method, aggregate and candidate specs, the model, data, curvature and query factors: what the
    stage, and each of its chunk tasks, is given (by reference, never data)."""

    compute: ComputeSpec
    method: MethodSpec
    aggregate: AggregateSpec
    model: ModelRef
    data: DataRef
    preconditioner: StageRef
    factors: FactorsRef
    store: RunStore
    candidates: CandidatesSpec | None = None
    others: tuple[Member, ...] = ()  # the ensemble's members 1.. (member 0 is model, preconditioner and factors)

    index: IndexRef | None = None  # member 0's training index

    @property
    def members(self) -> tuple[Member, ...]:
        """Every member whose scores are averaged, member 0 first (a single model: one)."""
        return (Member(self.model, self.preconditioner, self.factors, self.index), *self.others)

    @property
    def indexed(self) -> bool:
        """Scores come from every member's stored training index: a GEMM per chunk, no training gradient."""
        return not self.prefiltered and all(m.index is not None and m.index.usable for m in self.members)

    @property
    def prefiltered(self) -> bool:
        """FastIF: only each query's k nearest training examples are scored."""
        return self.candidates is not None and self.candidates.knn_k is not None

    @property
    def layout(self) -> ScoreLayout:
        """How the training rows split into chunk tasks (and the scores into shards)."""
        return score_layout(self.data.n_test, self.data.n_train, self.compute.target_shard_mb, self.compute.train_chunk_rows)

    def plan(self) -> StageCall[ScoresRef]:
        config: dict[str, Any] = {
            "train_chunk_rows": self.compute.train_chunk_rows,
            "target_shard_mb": self.compute.target_shard_mb,
            "method": self.method.model_dump(mode="json"),
            "self_influence": {"mode": self.aggregate.self_influence, "rank": self.aggregate.self_influence_rank},
        }
        if self.prefiltered:  # FastIF: candidate scores, no self-influence
            assert self.candidates is not None
            config.update(self_influence={"mode": "off"}, candidates=self.candidates.model_dump(mode="json"))
        inputs: dict[str, Ref] = {"data": self.data}
        for index, member in enumerate(self.members):
            inputs.update(member.inputs(index))
        return StageCall("compute_influences", ScoresRef, config, inputs, self.store, self.compute.torch_threads, output_bytes=output_bytes(self.data, self.aggregate))
