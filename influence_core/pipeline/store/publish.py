"""The two ends of a run: claiming the output (status=running, the run's fingerprint) and publishing it
(report.png, summary.json, stale arrays removed, the group attributes, with status=complete written last)."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from . import damage, storage
from .binding import require_stages
from ...errors import ConfigError
from ..score.layout import ANSWER_KIND, SCORE_CONVENTION
from .refs import DataRef, FactorsRef, IndexRef, ModelRef, StageRef, ValidationRef
from ..specs import METHOD_CLASSES, MagicMethod, ModelSpec
from ..report.report import Decode, QueryRow, example_view, lds_line, render_report, topk_rows
from ...version import CODE_VERSION, source_commit
from .loading import open_data
from .run_store import RunStore

SCHEMA_VERSION = 1
REPAIR_FIX = "run the pipeline there again with the same parameters (it recomputes what is damaged), or replace the run with --overwrite"
VALIDATION_FIELDS = ("lds_mean", "lds_stderr", "lds_per_query", "slope", "pearson", "subsets", "subsets_computed", "fraction", "queries", "concurrent_retrainings")
PACKAGES = ("influence-pipeline", "torch", "numpy", "zarr", "dask", "distributed", "s3fs", "prefect")


def package_versions() -> dict[str, str]:
    found = {}
    for name in PACKAGES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            continue
    return found


def check_owner(store: RunStore, fingerprint: str, overwrite: bool) -> None:
    """Refuse an output that holds a run of other parameters, complete or not, unless `overwrite`: one output never
    mixes arrays of two configurations. Reads only; nothing is written before this passes."""
    if overwrite or not storage.exists(storage.join(store.influence_url, "zarr.json"), store.options):
        return
    if "" in damage.damaged_nodes(store.influence_url, store.options):
        return  # its owner cannot be read: begin_run repairs it, and every array not of this run is recomputed
    attrs = storage.open_group(store.influence_url, store.options, mode="r").attrs
    if attrs.get("run_fingerprint") != fingerprint:
        raise ConfigError(
            "output_url",
            f"{store.output_url} holds a {attrs.get('status', 'foreign')} run of other parameters (run fingerprint {attrs.get('run_fingerprint')}, this run's {fingerprint})",
            "choose another output_url, or replace that run with --overwrite (overwrite: true)",
        )


def begin_run(store: RunStore, fingerprint: str, overwrite: bool) -> None:
    """Under the run lock, just before scoring: check the owner again, then claim the output for this run's
    parameters. A new or replaced output is flagged running at once (the replaced run's attributes go now, its
    arrays when this run publishes); an output of these same parameters stays as it is, and the scoring or
    aggregation stage that rewrites part of it flags it. Stages before this write only their own content-addressed
    outputs, so a run refused for bad input leaves an earlier run as it was."""
    check_owner(store, fingerprint, overwrite)
    with store.writing("the run's start", "a few kB for influence.zarr's metadata"):
        repaired = damage.repair(store.influence_url, store.options)  # damaged metadata: those arrays are recomputed
        group = storage.open_group(store.influence_url, store.options, mode="a")
        if group.attrs.get("run_fingerprint") != fingerprint:
            group.attrs.put({"status": "running", "run_fingerprint": fingerprint})
        elif repaired:
            group.attrs["status"] = "running"


def prune(store: RunStore, refs: dict[str, StageRef]) -> None:
    """Delete the arrays no stage of this run wrote (every stage marks its arrays with its fingerprint): what a
    replaced run left behind never survives into this one."""
    group = storage.open_group(store.influence_url, store.options, mode="a")
    for name in set(group.array_keys()) - set(run_arrays(group, refs)):
        del group[name]


def run_arrays(group: Any, refs: dict[str, StageRef]) -> list[str]:
    """The output's arrays a stage of this run wrote (marked with its fingerprint)."""
    mine = {ref.fingerprint for ref in refs.values()}
    return sorted(name for name, array in group.arrays() if array.attrs.get("fingerprint") in mine)


COMPRESSED_TOP_K = ("topk_helpful_indices", "topk_helpful_scores", "topk_harmful_indices", "topk_harmful_scores", "argmax")


def exactness(arrays: list[str], refs: dict[str, StageRef]) -> dict[str, list[str]]:
    """Which of the output's arrays are exact (as the method computes them without a training index) and which come
    from a compressed index: its scores and their totals, and its top-k unless re-ranked (self-influences are
    always exact: the index pass takes them from the captures)."""
    compressed = any(isinstance(ref, IndexRef) and ref.compression == "logra" for ref in refs.values())
    approximate = ({"scores", "train_totals"} | (set() if "rerank" in refs else set(COMPRESSED_TOP_K))) if compressed else set()
    return {"exact": [name for name in arrays if name not in approximate], "from_compressed_index": [name for name in arrays if name in approximate]}


def query_rows(store: RunStore, arrays: dict[str, Any], decode: Decode, n_queries: int, n_show: int) -> list[QueryRow]:
    """The first `n_queries` queries with their `n_show` most helpful and most harmful training examples, token ids
    read as text by `decode` (the run's task's)."""
    group = storage.open_group(store.influence_url, store.options, mode="r")
    return topk_rows(group, arrays["y_train"], arrays["y_test"], n_queries, n_show, example_view(arrays["x_test"]), decode, example_view(arrays["x_train"]))


def task_decode(model: dict[str, Any]) -> Decode:
    """The run's task's `decode` (its tokenizer, or the byte-level default), for the table and the report."""
    return ModelSpec.model_validate(model).make_task().decode


def report_heading(config: dict[str, Any], n_show: int) -> str:
    """The report's first line: the method that made the scores, and how many of top_k each row shows."""
    name, top_k = config["method"]["name"], config["aggregate"]["top_k"]
    shown = f"top {top_k}" if n_show == top_k else f"top {n_show} of top_k={top_k} (all are in influence.zarr)"
    projection = config["method"].get("projection")
    projected = f", gradients projected ({projection['kind']}, dim {projection['dim']})" if projection else ""
    title = METHOD_CLASSES[name].title if name in METHOD_CLASSES else str(MagicMethod.model_config.get("title"))
    return f"Influence by {title.split(' (')[0]} (method {name}{projected}), {shown}"  # the form's title without its aside


def publish(
    store: RunStore, refs: dict[str, StageRef], config: dict[str, Any], stages: dict[str, dict[str, Any]], n_queries: int, n_show: int, started: datetime
) -> tuple[dict[str, Any], list[QueryRow]]:
    """Write report.png and summary.json, then the group attributes; `status` becomes complete last. Returns the
    summary and the first queries' rows with `n_show` examples each, for the table and the report.
    `started`: when the run's flow began; the summary's wall_seconds run from there to the summary."""
    data = refs["prepare_data"]
    assert isinstance(data, DataRef)
    arrays, spec = open_data(data, store.options), ModelSpec.model_validate(config["model"])
    decode = spec.make_task().decode
    rows = query_rows(store, arrays, decode, n_queries, n_show)
    validation = refs.get("validate")
    validated = validation.model_dump(include=set(VALIDATION_FIELDS)) if isinstance(validation, ValidationRef) else None
    text = spec.token_inputs or (isinstance(arrays["x_test"], dict) and "input_ids" in arrays["x_test"])  # token ids: shown as text
    note = None if validated is None else lds_line(validated)
    png = render_report(rows, example_view(arrays["x_test"]), example_view(arrays["x_train"]), data.image_shape, report_heading(config, n_show), note, text, decode)
    finished = datetime.now(timezone.utc)
    written = run_arrays(storage.open_group(store.influence_url, store.options, mode="r"), refs)
    summary = {
        "status": "complete",
        "started_at": started.isoformat(),
        "finished_at": finished.isoformat(),
        "wall_seconds": round((finished - started).total_seconds(), 3),
        "output_url": store.output_url,
        "influence": store.influence_url,
        "report": store.url("report.png"),
        "n_train": data.n_train,
        "n_test": data.n_test,
        "task": spec.attributed_task,  # resolved: never auto
        "parameters": refs.get("fit_preconditioner", refs["compute_influences"]).parameters,  # which of the model's parameters the scores are over (magic: its scoring stage)
        **({} if validated is None else {"validation": validated}),
        "stages": stages,
        "exactness": exactness(written, refs),
        "config": config,
        "code_version": CODE_VERSION,
        "commit": source_commit(),
        "versions": package_versions(),
    }
    stored = portable_summary(store, summary)
    need = f"{storage.megabytes(len(png) + len(json.dumps(stored, default=str)))} for report.png and summary.json"
    with store.writing("publish", need):  # a full disk here is one line too, and status stays running
        storage.write_bytes(store.url("report.png"), png, store.options)
        storage.write_json(store.url("summary.json"), stored, store.options)
        prune(store, refs)
        group = storage.open_group(store.influence_url, store.options, mode="a")
        group.attrs.update(
            {
                "schema_version": SCHEMA_VERSION,
                **SCORE_CONVENTION,
                "config": portable_config(config),
                "fingerprints": {name: ref.fingerprint for name, ref in refs.items()},
                "refs": {name: ref.moved(store.relative).model_dump(mode="json") for name, ref in refs.items()},
                "versions": summary["versions"],
                "stage_timings": {name: stage["seconds"] for name, stage in stages.items()},
            }
        )
        group.attrs["status"] = "complete"
    return summary, rows


def portable_summary(store: RunStore, summary: dict[str, Any]) -> dict[str, Any]:
    """summary.json as stored: every location relative to the output's root, so a moved or copied output stays
    right; the flow returns the absolute form to its caller."""
    stages = {name: {**stage, "url": store.relative(stage["url"])} for name, stage in summary["stages"].items()}
    return {**summary, "output_url": ".", "influence": store.relative(summary["influence"]), "report": store.relative(summary["report"]), "stages": stages, "config": portable_config(summary["config"])}


def portable_config(config: dict[str, Any]) -> dict[str, Any]:
    """The parameters as recorded inside the output: `output_url` is the output's own root, '.'."""
    return {**config, "output_url": "."} if "output_url" in config else config


def recorded_parameters(store: RunStore) -> dict[str, Any]:
    """The parameters a run recorded, to run it again where it is (`repair`): its output_url this store's, its stage
    store this store's when it names one (it moved), else the recorded one. Refused in one line when the run
    recorded none."""
    try:
        config = storage.open_group(store.influence_url, store.options, mode="r").attrs.get("config")
    except (FileNotFoundError, ValueError, KeyError):
        config = None
    if not isinstance(config, dict):
        raise ConfigError("output_url", f"{store.output_url} holds no run whose parameters were recorded", "run the pipeline there with its configuration (`influence-pipeline run --config ...`)")
    given = store.storage.model_dump(include={"cache_url", "endpoint_url"}, exclude_none=True)
    storage_spec = {**config.get("storage", {}), **given}
    return {**config, "output_url": store.output_url, "storage": storage_spec}


def with_recorded_cache(store: RunStore, attrs: Any) -> RunStore:
    """The run's store with the stage store the run recorded (storage.cache_url), unless `store` names one itself
    (a stage store that moved: `--cache-url`)."""
    recorded = ((attrs.get("config") or {}).get("storage") or {}).get("cache_url")
    if store.storage.cache_url or not recorded:
        return store
    return store.model_copy(update={"storage": store.storage.model_copy(update={"cache_url": recorded})})


def stored_refs(store: RunStore, attrs: Any) -> dict[str, StageRef]:
    """The stage refs a published run records, resolved against where the output is now."""
    types = {"prepare_data": DataRef, "fit_model": ModelRef, "index_training": IndexRef, "compute_test_factors": FactorsRef}
    return {name: types.get(name.split("[")[0], StageRef).model_validate(ref).moved(store.resolve) for name, ref in attrs["refs"].items()}  # fit_model[1]: a ModelRef


def read_attrs(store: RunStore, field: str = "output_url") -> Any:
    """A finished run's group attributes; a missing, damaged or unfinished run is refused with a ConfigError naming
    `field` (`query` names its run argument `run`)."""
    damaged = damage.damaged_nodes(store.influence_url, store.options)
    if damaged:
        raise ConfigError(field, damage.describe(store.influence_url, damaged), REPAIR_FIX)
    try:
        group = storage.open_group(store.influence_url, store.options, mode="r")
    except FileNotFoundError:
        raise missing_run(store, field) from None
    if group.attrs.get("kind") == ANSWER_KIND:
        raise ConfigError(field, f"{store.output_url!r} holds the answer to a question, not a run", f"give the run it asked, {group.attrs.get('run')!r}")
    status = group.attrs.get("status")
    if status != "complete":
        raise ConfigError(field, f"the run at {store.output_url!r} is not complete (status={status!r})", "run it again with the same parameters to finish it")
    if not {"config", "refs"} <= set(group.attrs):
        raise ConfigError(field, f"{store.influence_url!r} is not a run's output (its attributes lack config and refs)", "give the output URL of a run made by influence-pipeline run or demo")
    return group.attrs


def group_attributes(store: RunStore) -> dict[str, Any] | None:
    """The attributes of the output's influence.zarr group, read from its metadata alone; None when it is absent or
    damaged (not a Zarr group's metadata)."""
    try:
        meta = storage.read_json(storage.join(store.influence_url, "zarr.json"), store.options)
    except (FileNotFoundError, NotADirectoryError, ValueError):
        return None
    attributes = meta.get("attributes", {}) if isinstance(meta, dict) and meta.get("node_type") == "group" else None
    return attributes if isinstance(attributes, dict) else None


def is_answer(store: RunStore) -> bool:
    """The output holds a question's answer (`query --output-url`, the question flow), not a run: its group says
    kind: answer."""
    return (group_attributes(store) or {}).get("kind") == ANSWER_KIND


def holds_run(store: RunStore) -> bool:
    """The output holds a run's influence.zarr (finished or not), not an answer."""
    attributes = group_attributes(store)
    return attributes is not None and attributes.get("kind") != ANSWER_KIND


def shown_top(stored: int, n_show: int | None, holder: str, again: str) -> int:
    """How many examples per query to show: `n_show` (None: all `stored`); more than the `holder` (a run, an answer)
    stores is refused (`show --top`), with `again` saying how to store more."""
    if n_show is not None and n_show > stored:
        raise ConfigError("--top", f"{n_show} is more than the {stored} examples per query the {holder} stores (its top_k)", f"give --top {stored} or less, or {again}")
    return stored if n_show is None else n_show


RUNS_LOOKED_AT = 50  # entries of a folder checked for runs below it (a deployment's runs/on-demand/{fingerprint})


def missing_run(store: RunStore, field: str) -> ConfigError:
    """No run at `store`: the refusal names the runs one level below it, when it is a folder of runs (a deployment's
    `runs/on-demand`, whose runs are `runs/on-demand/{fingerprint}`)."""
    names = sorted(storage.list_names(store.output_url, store.options))[:RUNS_LOOKED_AT]
    runs = [store.url(name) for name in names if holds_run(RunStore(output_url=store.url(name), storage=store.storage))]
    if not runs:
        return ConfigError(field, f"no influence.zarr under {store.output_url!r}", "give the output URL of a finished run, or run the pipeline there first")
    shown = ", ".join(repr(url) for url in runs[:3]) + (f" and {len(runs) - 3} more" if len(runs) > 3 else "")
    return ConfigError(field, f"{store.output_url!r} holds no run itself but {len(runs)} run{'s' if len(runs) > 1 else ''} below it: {shown}", f"give one of them as {field} (a deployment writes each run to <its output_url>/<parameter fingerprint>)")


def read_run(store: RunStore, n_queries: int, n_show: int | None = None) -> tuple[dict[str, Any], list[QueryRow]]:
    """A finished run's attributes and top-k rows, `n_show` examples each (None: all the run stores); a missing or
    unfinished run, or more examples than it stores (`show --top`), is refused with a ConfigError."""
    attrs = read_attrs(store)
    store = with_recorded_cache(store, attrs)
    refs = stored_refs(store, attrs)
    require_stages(store, refs, ["prepare_data", "aggregate"])
    group = storage.open_group(store.influence_url, store.options, mode="r")
    shown = shown_top(group["topk_helpful_indices"].shape[1], n_show, "run", f"run again with aggregate.top_k={n_show}")
    data = refs["prepare_data"]
    assert isinstance(data, DataRef)
    decode = task_decode(attrs["config"]["model"])
    return dict(attrs), query_rows(store, open_data(data, store.options), decode, n_queries, shown)
