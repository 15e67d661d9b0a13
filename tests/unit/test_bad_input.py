"""Bad input fails early with an error that names the field and says what to do."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from flows.parameters import RunParameters
from influence_core import ConfigError, DirectInfluence
from influence_core.pipeline.stages import prepare, training
from influence_core.pipeline.store import storage
from influence_core.pipeline.stages.aggregation import check_top_k
from influence_core.pipeline.store.run_store import RunStore
from influence_core.pipeline.specs import AggregateSpec, DigitsDataset, HfDiskDataset, ModelSpec, TrainingSpec


def error_fields(exc: ValidationError) -> list[str]:
    return [".".join(str(p) for p in err["loc"]) for err in exc.errors()]


def test_unknown_method_name_names_the_field():
    with pytest.raises(ValidationError) as info:
        RunParameters.model_validate({"method": {"name": "newton"}})
    assert error_fields(info.value) == ["method"]
    assert "'direct'" in str(info.value) and "'cg'" in str(info.value)  # lists what is allowed


def test_unknown_method_option_is_refused():
    with pytest.raises(ValidationError) as info:
        RunParameters.model_validate({"method": {"name": "direct", "rtol": 1e-3}})
    assert error_fields(info.value) == ["method.direct.rtol"]


def test_missing_dataset_path_names_the_field(tmp_path):
    with pytest.raises(ValidationError, match=r"dataset.path: .*does not exist"):
        RunParameters.model_validate({"dataset": {"source": "npz", "path": str(tmp_path / "nope.npz")}})


@pytest.mark.parametrize("url", ["gs://bucket/run", "ftp://host/x", "s3://"])
def test_unsupported_output_url_names_the_field(url):
    with pytest.raises(ValidationError) as info:
        RunParameters.model_validate({"output_url": url})
    assert error_fields(info.value) == ["output_url"]
    assert "s3://bucket/prefix" in str(info.value)


def test_top_k_above_n_train_is_refused():
    with pytest.raises(ConfigError, match=r"aggregate.top_k: top_k=50 exceeds the 40 training examples.*at most 40"):
        check_top_k(AggregateSpec(top_k=50), 40)


def test_model_output_not_fitting_labels(tmp_path):
    store = RunStore(output_url=str(tmp_path))
    data = prepare.run(prepare.PrepareInput(DigitsDataset(n_train=50, n_test=5), store))
    with pytest.raises(ConfigError, match=r"model.output_dim: the model emits 5 columns but the labels go up to 9.*10 outputs"):
        training.run(training.TrainingInput(ModelSpec(hidden=[4], output_dim=5), TrainingSpec(epochs=1), data, store, threads=1))
    assert not list((tmp_path / "stages" / "fit_model").glob("*/manifest.json"))  # nothing half-done looks complete


def test_credentials_in_endpoint_url_are_refused():
    with pytest.raises(ValidationError, match="must not carry credentials"):
        RunParameters.model_validate({"storage": {"endpoint_url": "http://key:secret@127.0.0.1:9000"}})


def test_negative_regularization_names_the_field():
    with pytest.raises(ConfigError, match="method.regularization"):
        DirectInfluence(nn.Linear(2, 1), "mse", -1.0, second_order_mode="hessian")


def test_non_differentiable_model_output():
    class Rounded(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x).detach()

    with pytest.raises(ConfigError, match="not differentiable"):
        DirectInfluence(Rounded(), "cross_entropy", second_order_mode="hessian").fit((torch.randn(4, 3), torch.tensor([0, 1, 0, 1])))


def test_weights_only_checkpoint_loading_refuses_pickled_objects(tmp_path):
    from influence_core.pipeline.model.models import load_state

    path = tmp_path / "evil.pt"
    torch.save({"model": nn.Linear(2, 2)}, path)  # a whole module: needs full unpickling, refused
    with pytest.raises(ConfigError, match="weights-only state_dict"):
        load_state(str(path), {})


def test_validate_url_normalises_local_paths(tmp_path):
    assert storage.validate_url(f"file://{tmp_path}/x/") == f"{tmp_path}/x"
    assert storage.validate_url("s3://bucket/prefix/") == "s3://bucket/prefix"


def test_a_language_models_missing_labels_name_dataset_target(tmp_path):
    """hf_disk token ids without a label column: the fix is dataset.target, not 'provide y_train' (issue 35, item 18)."""
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"input_ids": [[1, 2, 3]] * 20, "attention_mask": [[1, 1, 1]] * 20}).save_to_disk(str(tmp_path / "hf"))
    spec = HfDiskDataset(path=str(tmp_path / "hf"), inputs=["input_ids", "attention_mask"], n_test=4)
    with pytest.raises(ConfigError, match=r"^dataset.target: .*without the labels 'y'. Fix: set dataset.target .*dataset.target: input_ids"):
        prepare.run(prepare.PrepareInput(spec, RunStore(output_url=str(tmp_path / "out"))))


def test_token_scores_with_magic_are_refused_in_one_line():
    """Method magic has no per-token split of a score: refused while parsing, naming the field and the fix."""
    from flows.parameters import RunParameters
    from influence_core import ConfigError

    with pytest.raises(ConfigError, match=r"^aggregate.token_scores: method magic .* Fix: set aggregate.token_scores to false"):
        RunParameters.from_sections(method={"name": "magic"}, aggregate={"top_k": 3, "token_scores": True})


def test_a_refusal_pickled_to_or_from_a_dask_worker_keeps_its_field_and_line():
    """Dask ships a task's exception by pickle: the default rebuild passed the one formatted line to an __init__
    that takes three parts (or a λ), and failed on the driver."""
    import pickle

    from influence_core.errors import RegularizationError

    for refusal in (ConfigError("dataset.source", "no such file", "give a path that exists"), RegularizationError("CG did not converge", 1e-7, 6.2e-4)):
        back = pickle.loads(pickle.dumps(refusal))
        assert type(back) is type(refusal) and back.field == refusal.field and str(back) == str(refusal)
