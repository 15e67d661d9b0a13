"""Method magic in the pipeline: its scores equal the library's metagradients of the same recipe (the flow on a real
Prefect API and a real LocalCluster), blocks resume like score chunks, and what cannot be replayed is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy.stats import pearsonr, spearmanr

from flows.influence_run import influence_run
from flows.parameters import RunParameters
from influence_core.errors import ConfigError
from influence_core.magic import metagradients
from influence_core.magic.replay import Replay
from influence_core.pipeline.stages import metagradients as magic_stage, prepare, training
from influence_core.pipeline.store import storage
from influence_core.pipeline.runtime.cluster import dask_client
from influence_core.pipeline.stages.validation import subset_mask
from influence_core.pipeline.report.verify import verify_run
from tests.helpers import latest_task_runs, read_outputs, small_params

OVERRIDES = {
    "dataset": {"n_train": 48, "n_test": 6, "chunk_rows": 16},
    "model": {"hidden": [4], "dtype": "float64"},
    "training": {"epochs": 2, "batch_size": 16, "seed": 3},
    "method": {"name": "magic", "query_block": 4},  # blocks of 4 and 2 queries
}


def _library_scores(params: RunParameters, arrays: dict[str, np.ndarray]) -> np.ndarray:
    """The reference: the library's metagradients for the run's recipe, from the initial weights of its seed."""
    torch.manual_seed(params.training.seed)
    model = params.model.build(64, 10, (64,)).to(getattr(torch, params.model.dtype))
    x, y, xq, yq = (torch.from_numpy(arrays[name]) for name in ("x_train", "y_train", "x_test", "y_test"))
    return metagradients(model, params.model.make_task(), params.training.recipe(), x, y, xq, yq).scores.numpy()


def _weights_lds(params: RunParameters, arrays: dict[str, np.ndarray], scores: np.ndarray) -> tuple[list[float], float, float]:
    """Per query, the LDS of `scores` against models retrained by the replay with each subset's removed rows weighted
    0, their query losses by F.cross_entropy, ranked by scipy; and the slope (numpy's least squares through 0) and
    scipy's Pearson correlation of the actual loss changes (from all weights 1) on the predicted ones."""
    spec, n = params.validation, len(arrays["y_train"])
    masks = [subset_mask(spec, i, n) for i in range(spec.subsets)]
    measured = []
    for mask in [np.ones(n, dtype=bool), *masks]:
        torch.manual_seed(params.training.seed)
        replay = Replay(params.model.build(64, 10, (64,)).double(), params.model.make_task(), params.training.recipe(), arrays["x_train"], arrays["y_train"])
        final = replay.checkpoints(torch.from_numpy(mask).double())[1].params
        logits = torch.func.functional_call(replay.objective.model, final, (torch.from_numpy(arrays["x_test"][: spec.queries]).double(),))
        measured.append(F.cross_entropy(logits, torch.from_numpy(arrays["y_test"][: spec.queries]), reduction="none").detach().numpy())
    full, table, rows = measured[0], np.stack(measured[1:]), scores[: spec.queries].astype(np.float64)
    predicted = -(np.stack(masks).astype(np.float64) @ rows.T)
    lds = [spearmanr(predicted[:, q], table[:, q]).statistic for q in range(spec.queries)]
    change = np.stack([rows[:, ~mask].sum(axis=1) / n for mask in masks]).ravel()  # removing the rest: about score / n each
    actual = (table - full).ravel()
    return lds, float(np.linalg.lstsq(change[:, None], actual, rcond=None)[0][0]), float(pearsonr(change, actual).statistic)


def test_flow_scores_equal_the_library_metagradients(tmp_path, prefect_api, caplog):
    validation = {"subsets": 4, "fraction": 0.9, "queries": 6, "counterfactual": "weights"}
    params = small_params(str(tmp_path / "run"), compute={"cluster": "local", "n_workers": 2}, validation=validation, **OVERRIDES)
    summary = influence_run(**params.sections())
    warned = [r.getMessage() for r in caplog.records if "full Adam step" in r.getMessage()]  # no training.warmup: said once, in one line
    assert len(warned) == 1 and "\n" not in warned[0] and "set training.warmup" in warned[0]
    magnitudes = np.abs(read_outputs(params.store())[1]["scores"])
    assert summary["stages"]["compute_influences"]["spread"] == pytest.approx(float(magnitudes.max()) / float(np.median(magnitudes)), rel=1e-6)
    _, outputs = read_outputs(params.store())
    arrays = {name: np.asarray(a[...]) for name, a in storage.open_group(summary["stages"]["prepare_data"]["url"], {}, mode="r").arrays()}
    expected = _library_scores(params, arrays)
    np.testing.assert_allclose(outputs["scores"], expected, rtol=1e-5, atol=1e-6 * np.abs(expected).max())
    np.testing.assert_array_equal(outputs["argmax"], outputs["scores"].argmax(axis=1))
    np.testing.assert_allclose(outputs["train_totals"], outputs["scores"].sum(axis=0), rtol=1e-5, atol=1e-5)
    assert "self_influence" not in outputs
    stage = summary["stages"]["compute_influences"]
    steps = params.training.recipe().steps(48)  # 2 epochs of 3 batches
    assert stage["n_chunks"] == stage["chunks_computed"] == 2 and stage["self_influence"]["mode"] == "off"
    assert stage["work"]["replayed_steps"] == 2 * (steps + (steps - 2) + steps)  # per block: T forward, T - T/k recomputed (k = ⌈√6⌉ = 3), T reverse
    assert [check.name for check in verify_run(params.store()) if not check.ok] == []  # self_influence absent, as switched off
    lds, slope, pearson = _weights_lds(params, arrays, outputs["scores"])
    np.testing.assert_allclose(summary["validation"]["lds_per_query"], lds, rtol=1e-9, atol=1e-9)
    assert summary["validation"]["slope"] == pytest.approx(slope, rel=1e-6) and summary["validation"]["pearson"] == pytest.approx(pearson, rel=1e-6)
    assert summary["stages"]["validate"]["work"]["training_rows"] == 4 * 48 * 2  # every row, every epoch, in each retraining
    assert "fit_preconditioner" not in summary["stages"] and summary["parameters"]["included"]["tensors"] == 4


def test_a_stopped_run_recomputes_only_its_missing_blocks(tmp_path):
    params = small_params(str(tmp_path / "run"), **OVERRIDES)
    store = params.store()
    data = prepare.run(prepare.PrepareInput(params.dataset, store))
    model = training.run(training.TrainingInput(params.model, params.training, data, store, params.compute.torch_threads))
    stage = magic_stage.MagicInput(params.compute, params.method, params.model, params.training, data, model, store)  # type: ignore[arg-type]
    factory = lambda: dask_client(params.compute, False)  # noqa: E731
    first = magic_stage.run(stage, factory)
    _, before = read_outputs(store)
    storage.remove(storage.join(stage.call.location.url, "manifest.json"), {})
    storage.remove(storage.join(stage.call.location.url, "done", "1"), {})
    again = magic_stage.run(stage, factory)
    _, after = read_outputs(store)
    assert first.chunks_computed == 2 and again.chunks_computed == 1
    np.testing.assert_array_equal(after["scores"], before["scores"])


@pytest.mark.parametrize("section, value, field", [
    ("model", {"checkpoint": __file__}, "model.checkpoint"),
    ("training", {"ensemble": 2}, "training.ensemble"),
    ("aggregate", {"self_influence": "exact"}, "aggregate.self_influence"),
])
def test_what_cannot_be_replayed_is_refused_in_one_line(tmp_path, section, value, field):
    with pytest.raises(ConfigError) as refused:
        RunParameters.from_sections(output_url=str(tmp_path / "run"), **{**OVERRIDES, section: {**OVERRIDES.get(section, {}), **value}})
    assert refused.value.field == field and "\n" not in str(refused.value)


def test_scores_that_overflow_fail_their_stage_in_one_line_and_are_never_served(tmp_path, prefect_api):
    """Issue 52: 400 steps at learning rate 1 in float32 overflow the metagradients (the issue's digits run: 1,024
    epochs). The block's task fails naming the stage, how many scores, the cause and the fix; compute_influences
    writes no manifest and no Prefect cache entry, so the same parameters are refused again, not served broken
    scores, and fewer epochs then run to the library's scores (in the same output, which the refused run held)."""
    over = {
        **OVERRIDES, "dataset": {"n_train": 16, "n_test": 4, "chunk_rows": 16}, "model": {"hidden": [4]}, "compute": {"cluster": "sequential", "torch_threads": 1},
        "training": {"epochs": 400, "batch_size": 16, "learning_rate": 1.0, "seed": 3}, "method": {"name": "magic", "query_block": 2}, "aggregate": {"top_k": 2, "report_queries": 2},
    }
    url = str(tmp_path / "run")
    params = small_params(url, **over)
    for attempt in range(2):
        with pytest.raises(ConfigError) as refused:
            influence_run(**params.sections())
        error = refused.value
        assert error.field == "compute_influences" and "scores of query block 0 are NaN or infinite" in error.problem and "\n" not in str(error)
        assert "overflowed in the reverse pass through 400 training steps" in error.problem and "fewer training.epochs" in error.fix and "model.dtype: float64" in error.fix
        assert latest_task_runs(url, "compute_influences") == {"prepare_data": "COMPLETED", "fit_model": "COMPLETED", "compute_influences": "FAILED"}, attempt  # fit_model cached the second time: COMPLETED
        assert not list((tmp_path / "run" / "stages" / "compute_influences").glob("*/manifest.json"))
    fixed = small_params(url, overwrite=True, **{**over, "training": {**over["training"], "epochs": 40}})  # the refused run holds the output: replaced
    summary = influence_run(**fixed.sections())
    _, outputs = read_outputs(fixed.store())
    arrays = {name: np.asarray(a[...]) for name, a in storage.open_group(summary["stages"]["prepare_data"]["url"], {}, mode="r").arrays()}
    expected = _library_scores(fixed, arrays)
    assert np.isfinite(outputs["scores"]).all()
    np.testing.assert_allclose(outputs["scores"], expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())
