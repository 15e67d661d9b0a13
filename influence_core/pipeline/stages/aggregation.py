"""Stage 6: top-k helpful and harmful, argmax and train totals, written beside the scores."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..store import storage
from ..score.score_reductions import Aggregates, aggregate_candidates, aggregate_scores, candidate_top_k
from ...errors import ConfigError, NumericalError
from ..score.layout import DIMENSIONS
from ..store.refs import StageRef
from ..specs import AggregateSpec
from ..store.stage import StageCall, StageInput, StageLocation
from ..store.run_store import RunStore
from ..score.score_input import ScoringInput
from ..score.token_scores import topk_token_scores


@dataclass(frozen=True)
class AggregationInput(StageInput[StageRef]):
    """The aggregate spec and the scores (or candidate scores) it reduces, and the re-ranked candidates its top-k come
    from when the scores are a compressed index's; with `token_scores`, the scoring stage's input, whose model,
    curvature and query factors score the top-k rows per token."""

    spec: AggregateSpec
    scores: StageRef
    store: RunStore
    scoring: ScoringInput | None = None
    reranked: StageRef | None = None  # the rerank stage's exact candidate scores: the top-k come from them

    def plan(self) -> StageCall[StageRef]:
        config: dict[str, Any] = {"top_k": self.spec.top_k}
        inputs: dict[str, Any] = {"scores": self.scores}
        if self.reranked is not None:  # keys of runs without it are unchanged
            inputs["reranked"] = self.reranked
        if self.spec.token_scores:  # keys of runs without it are unchanged
            assert self.scoring is not None, "token scores need the scoring stage's input"
            config["token_scores"] = True
            for index, member in enumerate(self.scoring.members):
                inputs.update(member.inputs(index))
        return StageCall("aggregate", StageRef, config, inputs, self.store)


def check_top_k(spec: AggregateSpec, n_train: int) -> None:
    if spec.top_k > n_train:
        raise ConfigError("aggregate.top_k", f"top_k={spec.top_k} exceeds the {n_train} training examples", f"set aggregate.top_k to at most {n_train}")


def _aggregate(stage: AggregationInput, loc: StageLocation) -> dict[str, Any]:
    spec, scores_ref, store = stage.spec, stage.scores, stage.store
    group = storage.open_group(store.influence_url, store.options, mode="a")
    group.attrs["status"] = "running"  # the top-k arrays are about to be replaced
    if scores_ref.url.endswith("candidate_scores"):
        result, totals = _from_candidates(spec, group, int(group["candidate_indices"].attrs["n_train"]))
    else:
        result, totals = _from_scores(spec, group, storage.open_array(scores_ref.url, store.options))
    if result.missing:
        raise NumericalError(f"{result.missing} scores are NaN: the scores are incomplete or the model diverged; rerun compute_influences")
    if stage.reranked is not None:  # the top-k of each query's candidates, scored exactly; the totals stay the scores'
        result = candidate_top_k(np.asarray(group["reranked_indices"][...]), np.asarray(group["reranked_scores"][...]), spec.top_k)
    outputs = {
        "topk_helpful_indices": result.helpful_indices,
        "topk_helpful_scores": result.helpful_scores,
        "topk_harmful_indices": result.harmful_indices,
        "topk_harmful_scores": result.harmful_scores,
        "argmax": result.helpful_indices[:, 0],
    }
    if spec.token_scores:
        assert stage.scoring is not None
        helpful, harmful = topk_token_scores(stage.scoring, result.helpful_indices, result.harmful_indices)
        outputs |= {"topk_helpful_token_scores": helpful, "topk_harmful_token_scores": harmful}
    else:
        for stale in ("topk_helpful_token_scores", "topk_harmful_token_scores"):
            if stale in group:
                del group[stale]  # of an earlier configuration: never beside top-k they do not describe
    for name, values in outputs.items():
        array = storage.create_array(group, name, shape=values.shape, dtype=values.dtype, chunks=values.shape, overwrite=True, dimension_names=DIMENSIONS[name])
        array[...] = values
        array.attrs["fingerprint"] = loc.key
    totals.attrs["fingerprint"] = loc.key  # last: its fingerprint marks the stage complete
    return {"url": storage.join(store.influence_url, "train_totals"), "fingerprint": loc.key, "shape": result.helpful_indices.shape, "dtype": "int64"}


def _from_scores(spec: AggregateSpec, group: Any, scores: Any) -> tuple[Aggregates, Any]:
    """Streamed over the stored scores in blocks of whole column shards (`aggregate_scores`); the totals go straight
    into their array, chunked like the shards."""
    check_top_k(spec, scores.shape[1])
    columns = (scores.shards or scores.chunks)[1]
    totals = storage.create_array(group, "train_totals", shape=(scores.shape[1],), chunks=(columns,), dtype="float32", fill_value=np.nan, overwrite=True, dimension_names=DIMENSIONS["train_totals"])
    return aggregate_scores(scores, spec.top_k, totals), totals


def _from_candidates(spec: AggregateSpec, group: Any, n_train: int) -> tuple[Aggregates, Any]:
    """From each query's candidates (FastIF): top-k among them, totals over the candidate entries."""
    indices, scores = np.asarray(group["candidate_indices"][...]), np.asarray(group["candidate_scores"][...])
    check_top_k(spec, scores.shape[1])
    result, values = aggregate_candidates(indices, scores, spec.top_k, n_train)
    totals = storage.create_array(group, "train_totals", shape=values.shape, dtype="float32", overwrite=True, dimension_names=DIMENSIONS["train_totals"])
    totals[...] = values
    return result, totals


def run(stage: AggregationInput) -> StageRef:
    """Reduce the scores to top-k, argmax and totals, or return the stored reduction."""
    return stage.call.run(lambda loc: _aggregate(stage, loc))
