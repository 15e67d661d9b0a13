"""`training.ensemble`: a single model keeps every stage key it had, member m is keyed as the single model of seed
+ m, scoring is keyed on every member, and what an ensemble cannot do is refused while parsing the parameters."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
from pydantic import ValidationError

from flows.parameters import RunParameters
from influence_core import ConfigError
from influence_core.pipeline.store import stage as stage_module
from influence_core.pipeline.stages.preconditioner import PreconditionerInput
from influence_core.pipeline.stages.query_factors import QueryFactorsInput
from influence_core.pipeline.store.refs import DataRef, ModelRef, Ref, ScoresRef, StageRef
from influence_core.pipeline.store.run_store import RunStore
from influence_core.pipeline.score.score_input import Member, ScoringInput
from influence_core.pipeline.stages.training import TrainingInput
from influence_core.pipeline.stages.validation import ValidationInput
from tests.helpers import small_params

# Taken before training.ensemble existed (commit 6196765), with the code version pinned: a single model's stages
# and its run keep their keys, so the stages and runs stored before are still found.
KEYS = {
    "fit_model": "5b8452638a4461acbc74d24e",  # these two changed with issue 38: keyed on the training rows alone (DataRef.training)
    "fit_preconditioner": "87a52d2a7ff8a2aa90605f98",
    "compute_test_factors": "08f1c298dae72e105eb8c197",
    "compute_influences": "4fc5e40a65e914f10d63ba59",
    "validate": "ed33fea24a34600811c96096",
}
RUN_FINGERPRINT = "a4897ca6854148b11ccd6085"


def ref(cls, name, **fields):  # type: ignore[no-untyped-def]
    """A stage ref with fixed fields, as a key sees it (only its fingerprint enters)."""
    return cls(url=f"/x/{name}", fingerprint=f"fp-{name}", shape=(1,), dtype="float32", stage=name, created_at=datetime(2020, 1, 1, tzinfo=timezone.utc), seconds=0.0, producer="h:1", **fields)


@pytest.fixture
def refs(monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setattr(stage_module, "CODE_VERSION", "pinned")
    arrays = {"y_train": Ref(url="/x/y", fingerprint="y", shape=(240,), dtype="int64"), "y_test": Ref(url="/x/yt", fingerprint="yt", shape=(12,), dtype="int64")}
    data = ref(DataRef, "data", arrays=arrays, n_classes=10, image_shape=None)
    return data, ref(ModelRef, "model", spec={}, in_features=64, out_features=10, train_loss=None), ref(StageRef, "pre"), ref(StageRef, "fac")


def test_a_single_model_keeps_its_stage_keys(refs):
    data, model, pre, fac = refs
    params = small_params("/tmp/keys/out", validation={"subsets": 3})
    store = RunStore(output_url="/tmp/keys/out")
    scores = ref(ScoresRef, "scores", n_chunks=1, chunks_computed=1, gradient_rows=1, self_influence={})
    assert params.training.ensemble == 1
    keys = {
        "fit_model": TrainingInput(params.model, params.training.member(0), data, store, 2).call.key,
        "fit_preconditioner": PreconditionerInput(params.method, model, data, store, params.compute).call.key,
        "compute_test_factors": QueryFactorsInput(params.method, model, data, pre, store, 2, params.compute).call.key,
        "compute_influences": ScoringInput(params.compute, params.method, params.aggregate, model, data, pre, fac, store, params.candidates).call.key,
        "validate": ValidationInput(params.validation, params.model, params.training, data, model, scores, store, params.compute).call.key,
    }
    assert keys == KEYS
    assert params.run_fingerprint() == RUN_FINGERPRINT


def test_member_m_is_the_single_model_of_seed_plus_m(refs):
    data, *_ = refs
    params = small_params("/tmp/keys/out", training__seed=5, training__ensemble=3)
    store = RunStore(output_url="/tmp/keys/out")

    def key(training):  # type: ignore[no-untyped-def]
        return TrainingInput(params.model, training, data, store, 2).call.key

    members = [key(params.training.member(m)) for m in range(3)]
    assert members == [key(params.training.model_copy(update={"seed": 5 + m, "ensemble": 1})) for m in range(3)]
    assert len(set(members)) == 3
    assert params.run_fingerprint() != small_params("/tmp/keys/out", training__seed=5).run_fingerprint()


def test_scoring_is_keyed_on_every_member(refs):
    data, model, pre, fac = refs
    params = small_params("/tmp/keys/out")
    store = RunStore(output_url="/tmp/keys/out")
    other = Member(ref(ModelRef, "model1", spec={}, in_features=64, out_features=10, train_loss=None), ref(StageRef, "pre1"), ref(StageRef, "fac1"))
    pair = ScoringInput(params.compute, params.method, params.aggregate, model, data, pre, fac, store, params.candidates, (other,))
    assert set(pair.call.inputs) == {"data", "model", "curvature", "factors", "model[1]", "curvature[1]", "factors[1]"}
    assert pair.call.key != KEYS["compute_influences"]
    swapped = ScoringInput(params.compute, params.method, params.aggregate, model, data, pre, fac, store, params.candidates, (Member(other.model, other.preconditioner, fac),))
    assert swapped.call.key != pair.call.key  # each member's factors count


@pytest.mark.parametrize(
    ("config", "words"),
    [
        ({"model": {"checkpoint": "/models/net.safetensors"}}, ("training.ensemble: ensemble=2", "model.checkpoint (/models/net.safetensors)", "Fix: set training.ensemble to 1")),
        ({"candidates": {"knn_k": 10}}, ("training.ensemble: ensemble=2", "candidates.knn_k=10", "Fix: set training.ensemble to 1, or candidates.knn_k to null")),
    ],
    ids=["checkpoint", "knn prefilter"],
)
def test_what_an_ensemble_cannot_do_is_refused(config, words):
    with pytest.raises(ConfigError) as info:
        RunParameters.from_sections(training={"ensemble": 2}, **config)  # as the flow checks its parameters
    for word in words:
        assert word in str(info.value)


def test_ensemble_below_one_is_refused():
    with pytest.raises(ValidationError) as info:
        RunParameters.model_validate({"training": {"ensemble": 0}})
    assert [".".join(map(str, err["loc"])) for err in info.value.errors()] == ["training.ensemble"]
