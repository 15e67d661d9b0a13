"""Every parameter of the run form has a title, a description and a default, so the Prefect UI shows a real form."""

from __future__ import annotations

import json

from flows.parameters import RunParameters


def walk(schema: dict, defs: dict, path: str = "params"):  # type: ignore[no-untyped-def]
    for name, prop in schema.get("properties", {}).items():
        yield f"{path}.{name}", prop
        for ref in [prop.get("$ref")] + [v.get("$ref") for v in prop.get("anyOf", [])]:
            if ref:
                yield from walk(defs[ref.split("/")[-1]], defs, f"{path}.{name}")


def test_every_field_has_title_description_and_default():
    schema = RunParameters.model_json_schema()
    defs = schema["$defs"]
    missing = []
    for path, prop in walk(schema, defs):
        ref = prop.get("$ref", "").split("/")[-1]
        title = prop.get("title") or defs.get(ref, {}).get("title")  # pydantic drops a title equal to the enum's own
        if not title or not prop.get("description"):
            missing.append(f"{path}: title/description")
    for name, definition in defs.items():
        if "properties" in definition:
            required = set(definition.get("required", []))
            missing += [f"{name}.{field}: no default" for field in required]
    assert not missing, missing
    assert len(list(walk(schema, defs))) > 60


def test_methods_and_cluster_kinds_are_choices():
    schema = RunParameters.model_json_schema()
    defs = schema["$defs"]
    names = sorted(defs[v["$ref"].split("/")[-1]]["properties"]["name"]["const"] for v in schema["properties"]["method"]["anyOf"])
    assert names == ["arnoldi", "cg", "datainf", "direct", "ekfac", "identity", "kfac", "lissa", "magic", "nystroem"]
    assert defs["ClusterKind"]["enum"] == ["local", "cuda", "address", "sequential"]


def test_an_unknown_method_or_source_fails_a_check_that_lists_the_valid_ones():
    """Beside each tagged union's choices, a `not` that only an unknown tag fails, described by the valid tags as the
    CLI lists them: the error a JSON Schema validator (Prefect's server) reports, instead of the union's generic one."""
    schema = RunParameters.model_json_schema()
    defs = schema["$defs"]
    for section, tag in (("method", "name"), ("dataset", "source")):
        tags = [defs[v["$ref"].split("/")[-1]]["properties"][tag]["const"] for v in schema["properties"][section]["anyOf"]]
        check = schema["properties"][section]["not"]
        assert check["properties"] == {tag: {"not": {"enum": tags}}} and check["required"] == [tag]
        assert check["description"] == f"{tag} does not match any of the expected tags: {', '.join(repr(t) for t in tags)}. Fix: set {tag} to one of the values listed"


DATASET_DEFS = ["DigitsDataset", "SyntheticClassificationDataset", "SyntheticRegressionDataset", "NpzDataset", "NpyDataset", "ZarrDataset", "TorchFactoryDataset", "HfDiskDataset", "ParquetDataset", "PythonDocsDataset"]


def test_dataset_sources_are_choices_each_with_its_own_fields():
    """The dataset is one model per source: the form offers the sources as choices, and each holds only the fields
    that source reads (a digits run records no synthetic settings)."""
    schema = RunParameters.model_json_schema()
    defs = schema["$defs"]
    assert [v["$ref"].split("/")[-1] for v in schema["properties"]["dataset"]["anyOf"]] == DATASET_DEFS
    sources = {defs[name]["properties"]["source"]["const"]: set(defs[name]["properties"]) for name in DATASET_DEFS}
    common = {"source", "n_train", "n_test", "seed", "chunk_rows", "query_offset"}
    assert sources == {
        "digits": common | {"test_fraction"},
        "synthetic_classification": common | {"n_features", "noise", "n_classes"},
        "synthetic_regression": common | {"n_features", "noise"},
        **{name: common | {"test_fraction", "path", "inputs", "target"} for name in ("npz", "npy", "zarr", "torch", "hf_disk", "parquet")},
        "python_docs": common | {"window", "train_offset", "queries"},
    }
    demo = RunParameters().public_config()["dataset"]
    assert demo == {"source": "digits", "n_train": None, "n_test": None, "seed": 0, "chunk_rows": 4096, "query_offset": 0, "test_fraction": 0.2}


def test_the_server_accepts_each_source_with_its_own_fields_only():
    """Prefect's server-side validation (enforce_parameter_schema) against the flow's schema, as the deployment
    stores it: a source's own fields pass, another source's are refused."""
    from prefect.utilities.callables import parameter_schema
    from prefect.utilities.schema_tools.validation import validate

    from flows.influence_run import influence_run

    schema = parameter_schema(influence_run).model_dump_for_openapi()
    assert validate({"dataset": RunParameters().public_config()["dataset"]}, schema) == []
    assert validate({"dataset": {"source": "synthetic_classification", "n_features": 5, "n_classes": 3, "noise": 0.2}}, schema) == []
    assert validate({"dataset": {"source": "npz", "path": "data.npz", "test_fraction": 0.3}}, schema) == []
    assert validate({"dataset": {"source": "digits", "n_classes": 3}}, schema) != []
    assert validate({"dataset": {"source": "synthetic_regression", "n_classes": 3}}, schema) != []
    assert validate({"dataset": {"source": "csv"}}, schema) != []


def test_dataset_keys_are_those_of_the_flat_spec():
    """prepare_data's key config and the run fingerprint hash the dataset as the flat spec dumped it (these dicts
    and fingerprints were taken from commit 98cf5ce, before the split), so existing runs keep their keys."""
    flat_digits = {"source": "digits", "path": None, "n_train": None, "n_test": None, "test_fraction": 0.2, "n_features": 20, "n_classes": 2, "noise": 0.1, "seed": 0, "chunk_rows": 4096}
    assert RunParameters().dataset.key_config() == flat_digits
    assert RunParameters().run_fingerprint() == "e6badfa7dc6a04ce7ebe6bdd"
    synthetic = {"source": "synthetic_classification", "n_train": 100, "n_features": 5, "n_classes": 3}
    assert RunParameters.model_validate({"dataset": synthetic}).run_fingerprint() == "e3a0c5c179ad0bd8ed11a2cf"
    assert RunParameters.model_validate({"dataset": {"source": "synthetic_regression", "noise": 0.5}}).run_fingerprint() == "0edfbe72dca4d36ccaf73d7a"


def test_the_ensemble_is_a_bounded_number_that_a_single_model_does_not_hash():
    """training.ensemble is a form field of at least 1 (the server refuses 0); at 1 it is left out of the keys, so
    the runs stored before it existed keep their fingerprints."""
    from prefect.utilities.callables import parameter_schema
    from prefect.utilities.schema_tools.validation import validate

    from flows.influence_run import influence_run

    field = RunParameters.model_json_schema()["$defs"]["TrainingSpec"]["properties"]["ensemble"]
    assert field.items() >= {"type": "integer", "default": 1, "minimum": 1, "title": "Ensemble members"}.items()
    schema = parameter_schema(influence_run).model_dump_for_openapi()
    assert validate({"training": {"ensemble": 4}}, schema) == [] and validate({"training": {"ensemble": 0}}, schema) != []
    assert "ensemble" not in RunParameters().training.key_config()
    assert RunParameters.model_validate({"training": {"ensemble": 2}}).training.key_config()["ensemble"] == 2


def test_a_constant_learning_rate_is_not_hashed_and_a_decay_is():
    """training.lr_decay is a choice of the form; constant (the default) is left out of the keys, so the runs stored
    before it existed keep their fingerprints, and a decay is a different training (another model, another key)."""
    field = RunParameters.model_json_schema()["$defs"]["TrainingSpec"]["properties"]["lr_decay"]
    assert field["enum"] == ["constant", "linear", "cosine"] and field["default"] == "constant"
    plain, decayed = RunParameters(), RunParameters.model_validate({"training": {"lr_decay": "cosine"}})
    assert "lr_decay" not in plain.training.key_config() and decayed.training.key_config()["lr_decay"] == "cosine"
    assert plain.run_fingerprint() != decayed.run_fingerprint()
    assert (plain.training.recipe().decay, decayed.training.recipe().decay) == ("constant", "cosine")


def test_max_pooling_is_not_hashed_and_avg_pooling_is():
    """model.pooling (the cnn's) is left out of the run fingerprint at max, the pools the cnn always had, so the runs
    stored before it existed keep their fingerprints; avg is another model."""
    cnn = {"architecture": "cnn"}
    plain, smooth = (RunParameters.model_validate({"model": {**cnn, **extra}}) for extra in ({}, {"pooling": "avg"}))
    assert "pooling" not in plain.model.key_config() and smooth.model.key_config()["pooling"] == "avg"
    assert plain.run_fingerprint() != smooth.run_fingerprint()
    assert smooth.model.applied_config()["pooling"] == "avg" and "pooling" not in RunParameters().model.applied_config()


def test_empty_optional_settings_are_plain_inputs():
    """An optional number, string or list left empty is a plain input, not a type switch offering "None"; the
    values still validate as None, and Prefect's server-side validator accepts a null for them."""
    from prefect.utilities.schema_tools.validation import validate

    schema = RunParameters.model_json_schema()
    defs = schema["$defs"]
    switches = [path for path, prop in walk(schema, defs) if {"type": "null"} in prop.get("anyOf", []) and "$ref" not in str(prop["anyOf"])]
    assert not switches, switches
    for source in DATASET_DEFS:
        assert defs[source]["properties"]["n_train"] == {**defs[source]["properties"]["n_train"], "type": "integer", "minimum": 1}
    assert RunParameters.model_validate({"dataset": {"n_train": None}}).dataset.n_train is None
    definitions = {**defs, "RunParameters": {k: v for k, v in schema.items() if k != "$defs"}}
    flat = {"type": "object", "properties": {"dataset": schema["properties"]["dataset"]}, "definitions": definitions}
    flat = json.loads(json.dumps(flat).replace("#/$defs/", "#/definitions/"))  # Prefect's layout of a flow's schema
    assert validate({"dataset": {"n_train": None, "path": None}}, flat) == []
    assert validate({"dataset": {"n_train": 0}}, flat) != []


def test_descriptions_hold_no_angle_brackets():
    """The UI renders descriptions as markdown, where `<output_url>` is an HTML tag and disappears."""
    schema = RunParameters.model_json_schema()
    bracketed = [path for path, prop in walk(schema, schema["$defs"]) if "<" in prop.get("description", "")]
    assert not bracketed, bracketed


def test_the_flow_takes_one_parameter_per_section():
    """influence_run's parameters are RunParameters' fields, with the same defaults, so a deployment's defaults
    and a run's parameters merge per section; from_sections and sections() are inverse."""
    import inspect

    from flows.influence_run import influence_run

    signature = inspect.signature(influence_run.fn).parameters
    assert list(signature) == list(RunParameters.model_fields)
    defaults = RunParameters()
    assert {name: p.default for name, p in signature.items()} == defaults.sections()
    params = RunParameters.model_validate({"output_url": "runs/x", "method": {"name": "cg"}, "aggregate": {"top_k": 3}})
    again = RunParameters.from_sections(**params.sections())
    assert again == params and again.method is not params.method
