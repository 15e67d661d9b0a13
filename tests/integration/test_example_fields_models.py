"""Hugging Face models fed named fields end to end (issue 25, item 3): a BERT classifier on input_ids and
attention_mask from a dataset saved with save_to_disk, and a GPT-2 language model on padded token ids from Parquet,
each scored by the flow as the library scores the same stored model and data; padding provably not scored."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import yaml
from typer.testing import CliRunner

from flows.cli import app
from flows.influence_run import influence_run
from influence_core import CgInfluence
from influence_core.task import IGNORE_INDEX, LanguageModelling
from tests.helpers import read_outputs, small_params, stored_model_and_data
from tests.plugin_models import gpt2_fields

pytest.importorskip("transformers", reason="transformers is in the dev extra")
datasets = pytest.importorskip("datasets", reason="datasets is in the data extra")
pa = pytest.importorskip("pyarrow", reason="pyarrow is in the data extra")
pytestmark = pytest.mark.usefixtures("prefect_api")

CG = {"name": "cg", "regularization": 1e-1, "rtol": 1e-6, "second_order_mode": "gauss_newton", "batch_size": 64}


def padded_tokens(n: int, length: int, vocab: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Random token ids (1..vocab-1) right-padded with 0 after a random length of at least 3, and their 0/1 mask."""
    rng = np.random.default_rng(seed)
    mask = (np.arange(length)[None, :] < rng.integers(3, length + 1, n)[:, None]).astype(np.int64)
    return rng.integers(1, vocab, (n, length)) * mask, mask


def library_scores(model, task, data):  # type: ignore[no-untyped-def]
    """CG's scores of the stored model on the stored arrays (inputs a dict of fields), with the run's settings."""
    train = (data["x_train"], data["y_train"])
    options = {k: v for k, v in CG.items() if k not in ("name", "regularization")}
    return CgInfluence(model, task, CG["regularization"], **options).fit(train).influences(data["x_test"], data["y_test"], *train).numpy()


def assert_scores_equal(scores: np.ndarray, expected: np.ndarray) -> None:
    assert np.isfinite(scores).all() and np.abs(scores).max() > 0
    np.testing.assert_allclose(scores, expected, rtol=1e-5, atol=1e-5 * float(np.abs(scores).max()))


def test_bert_on_fields_of_a_saved_hf_dataset_equals_the_library(tmp_path):
    """input_ids + attention_mask + label columns of a DatasetDict; the model is trained by fit_model."""
    ids, mask = padded_tokens(46, 10, 64, 0)
    labels = ids[:, 0] % 3
    rows = {"input_ids": ids.tolist(), "attention_mask": mask.tolist(), "label": labels.tolist()}
    splits = {name: datasets.Dataset.from_dict({k: v[part] for k, v in rows.items()}) for name, part in (("train", slice(0, 40)), ("test", slice(40, None)))}
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "hf"))
    params = small_params(
        str(tmp_path / "bert"), dataset={"source": "hf_disk", "path": str(tmp_path / "hf"), "inputs": ["input_ids", "attention_mask"], "target": "label", "chunk_rows": 16},
        model={"factory": "tests.plugin_models:bert_fields", "options": {"hidden": 16, "layers": 1}}, training={"epochs": 2, "learning_rate": 1e-3},
        method=CG, compute={"cluster": "sequential", "train_chunk_rows": 16},
    )
    influence_run(**params.sections())
    group, arrays = read_outputs(params.store())
    model, data = stored_model_and_data(params.store(), group)
    assert set(data["x_train"]) == {"input_ids", "attention_mask"} and data["x_train"]["input_ids"].dtype == torch.int64
    np.testing.assert_array_equal(data["x_test"]["attention_mask"].numpy(), mask[40:])
    assert_scores_equal(arrays["scores"], library_scores(model, "cross_entropy", data))


def gpt2_run(tmp_path, name: str, ids: np.ndarray, mask: np.ndarray, checkpoint: str) -> np.ndarray:  # type: ignore[no-untyped-def]
    """The flow's scores of the checkpointed GPT-2 on one Parquet file of padded windows (the last 4 held out), in
    this process, checked against the library's."""
    import pyarrow.parquet as pq

    folder = tmp_path / name
    folder.mkdir()
    for split, part in (("train", slice(0, -4)), ("test", slice(-4, None))):
        pq.write_table(pa.table({"input_ids": ids[part].tolist(), "attention_mask": mask[part].tolist()}), folder / f"{split}.parquet")
    params = small_params(
        str(tmp_path / f"out-{name}"), dataset={"source": "parquet", "path": str(folder), "inputs": ["input_ids", "attention_mask"], "target": "input_ids", "chunk_rows": 8},
        model={"factory": "tests.plugin_models:gpt2_fields", "options": {"n_layer": 1, "n_embd": 16, "n_positions": 8}, "task": "language_modelling", "checkpoint": checkpoint},
        method=CG, compute={"cluster": "sequential", "train_chunk_rows": 8}, aggregate={"top_k": 3, "report_queries": 2},
    )
    influence_run(**params.sections())
    group, arrays = read_outputs(params.store())
    model, data = stored_model_and_data(params.store(), group)
    np.testing.assert_array_equal(data["y_train"].numpy(), np.where(mask[:-4] == 0, IGNORE_INDEX, ids[:-4]))
    assert_scores_equal(arrays["scores"], library_scores(model, LanguageModelling(), data))
    return arrays["scores"]


def test_padded_gpt2_from_parquet_equals_the_library_and_ignores_padding(tmp_path):
    """Labels are the ids with padding masked; other token ids under mask 0 give the same scores, while a changed
    token under mask 1 changes them (the runs in this process: GPT-2 on a local cluster is
    test_real_models.py's)."""
    torch.manual_seed(0)
    torch.save(gpt2_fields(n_layer=1, n_embd=16, n_positions=8).state_dict(), tmp_path / "gpt2.pt")
    ids, mask = padded_tokens(20, 8, 64, 1)
    scores = gpt2_run(tmp_path, "padded", ids, mask, str(tmp_path / "gpt2.pt"))
    other = np.where(mask == 0, (ids * 7 + 5) % 63 + 1, ids)
    assert (other != ids).any()
    np.testing.assert_allclose(gpt2_run(tmp_path, "other-padding", other, mask, str(tmp_path / "gpt2.pt")), scores, rtol=1e-6, atol=1e-6 * float(np.abs(scores).max()))
    changed = ids.copy()
    changed[0, 0] = changed[0, 0] % 63 + 1
    assert not np.allclose(gpt2_run(tmp_path, "changed-token", changed, mask, str(tmp_path / "gpt2.pt")), scores, rtol=1e-3)


def test_a_language_model_without_model_task_is_attributed_as_one(tmp_path):
    """Issue 35, item 1: GPT-2 on an hf_disk dataset whose target names its input_ids, model.task left out (auto), is
    language modelling: the CLI and summary.json state it, and the scores are the library's LanguageModelling scores
    (next-token prediction, not a classifier of the current token)."""
    ids, mask = padded_tokens(24, 8, 64, 3)
    datasets.Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": mask.tolist()}).save_to_disk(str(tmp_path / "hf"))
    config = {
        "output_url": str(tmp_path / "out"),
        "dataset": {"source": "hf_disk", "path": str(tmp_path / "hf"), "inputs": ["input_ids", "attention_mask"], "target": "input_ids", "n_test": 4, "chunk_rows": 8},
        "model": {"factory": "tests.plugin_models:gpt2_fields", "options": {"n_layer": 1, "n_embd": 16, "n_positions": 8}},
        "training": {"epochs": 1, "learning_rate": 1e-3},
        "method": CG, "compute": {"cluster": "sequential", "train_chunk_rows": 8}, "aggregate": {"top_k": 3, "report_queries": 2},
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    result = CliRunner().invoke(app, ["run", "--config", str(tmp_path / "run.yaml")])
    assert result.exit_code == 0, result.output
    params = small_params(**config)  # type: ignore[arg-type]
    group, arrays = read_outputs(params.store())
    model, data = stored_model_and_data(params.store(), group)
    assert_scores_equal(arrays["scores"], library_scores(model, LanguageModelling(), data))
    assert "Task:                  language_modelling" in result.output
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["task"] == "language_modelling" and summary["config"]["model"]["task"] == "language_modelling"


def fields_run(tmp_path, name: str, **sections):  # type: ignore[no-untyped-def]
    """A flow run of the small named-fields model on padded token ids from an npz file."""
    ids, mask = padded_tokens(60, 6, 64, 2)
    np.savez(tmp_path / "fields.npz", input_ids=ids, attention_mask=mask, labels=ids[:, 0] % 3)
    params = small_params(
        str(tmp_path / name), dataset={"source": "npz", "path": str(tmp_path / "fields.npz"), "inputs": ["input_ids", "attention_mask"], "target": "labels", "n_test": 6, "chunk_rows": 16},
        model={"factory": "tests.plugin_models:mean_embedding"}, training={"epochs": 3, "learning_rate": 1e-2}, method={"name": "direct", "regularization": 1e-2}, **sections,
    )
    influence_run(**params.sections())
    return params


def test_named_fields_through_fastif(tmp_path):
    """FastIF's kNN features read named fields too: the candidate scores are the library's scores of those pairs."""
    from influence_core import DirectInfluence

    params = fields_run(tmp_path, "fastif", candidates={"knn_k": 5})
    group, arrays = read_outputs(params.store())
    model, data = stored_model_and_data(params.store(), group)
    full = DirectInfluence(model, "cross_entropy", 1e-2).fit((data["x_train"], data["y_train"])).influences(data["x_test"], data["y_test"], data["x_train"], data["y_train"]).numpy()
    expected = np.take_along_axis(full, arrays["candidate_indices"], axis=1)
    np.testing.assert_allclose(arrays["candidate_scores"], expected, rtol=1e-5, atol=1e-5 * float(np.abs(expected).max()))


def test_named_fields_through_validation(tmp_path):
    """The LDS retrainings train on the named fields and measure the queries' fields."""
    fields_run(tmp_path, "lds", validation={"subsets": 3, "queries": 4})
    validation = json.loads((tmp_path / "lds" / "summary.json").read_text())["validation"]
    assert validation["subsets"] == 3 and len(validation["lds_per_query"]) == 4
