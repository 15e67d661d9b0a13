"""Faults a run survives: an S3 endpoint that drops connections mid-run, and stage outputs that are partly gone
(a deleted score shard, truncated files and chunks, damaged Zarr metadata) which are detected and recomputed, never
served stale or NaN; show and verify name damaged metadata in one line."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import s3fs
import yaml
from typer.testing import CliRunner

from flows.cli import app
from flows.influence_run import influence_run
from influence_core.pipeline.store import storage
from influence_core.pipeline.specs import StorageSpec
from tests.helpers import assert_same_outputs, read_outputs, small_params
from tests.proxy import FlakyProxy

OUTAGE_SECONDS = 6.0


@pytest.fixture
def s3_proxy(s3_endpoint):
    """A TCP proxy in front of the moto server that can be told to drop every connection for a while."""
    host, port = s3_endpoint.removeprefix("http://").split(":")
    proxy = FlakyProxy((host, int(port)))
    yield proxy
    proxy.close()


def _stage_run_counts(flow_run_id) -> dict[str, int]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {r.name.rsplit("-", 1)[0]: r.run_count for r in runs}


@pytest.mark.usefixtures("prefect_api")
@pytest.mark.slow
def test_s3_outage_mid_run_completes_with_the_same_scores(s3_endpoint, s3_bucket, s3_proxy, tmp_path):
    reference = small_params(str(tmp_path / "reference"))  # uninterrupted; the store does not change the bits
    influence_run(**reference.sections())
    _, expected = read_outputs(reference.store())

    params = small_params(f"s3://{s3_bucket}/flaky", storage={"endpoint_url": s3_proxy.url})
    direct = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint}, skip_instance_cache=True, use_listings_cache=False)
    markers = f"{s3_bucket}/flaky/stages/compute_influences"
    cut: dict[str, int] = {}
    stop = threading.Event()

    def cut_when_scoring() -> None:
        """Drop the endpoint as soon as the first score chunk is recorded, while the others are being computed."""
        while not stop.wait(0.02):
            done = [p for p in direct.find(markers) if "/done/" in p] if direct.exists(markers) else []
            if done:
                cut["chunks_done"] = len(done)
                s3_proxy.outage(OUTAGE_SECONDS)
                return

    watcher = threading.Thread(target=cut_when_scoring, daemon=True)
    watcher.start()
    try:
        state = influence_run(**params.sections(), return_state=True)
    finally:
        stop.set()
        watcher.join()
    assert state.is_completed(), state.message
    assert cut and cut["chunks_done"] < 4, "the outage did not start during scoring"
    assert not s3_proxy.is_down(), "the run finished during the outage, without S3"
    # the storage client rode out the outage: no stage had to be retried by Prefect
    counts = _stage_run_counts(state.state_details.flow_run_id)
    assert len(counts) == 8 and set(counts.values()) == {1}, counts  # seven stages (the training index too) and publish
    assert assert_same_outputs(params.store(), expected).attrs["status"] == "complete"


@pytest.mark.slow
def test_storage_options_ride_out_a_long_outage(s3_bucket, s3_proxy):
    """A write and a read during a 30 s outage succeed with the pipeline's options (botocore's default retries
    give up after 15 to 25 s)."""
    options = StorageSpec(endpoint_url=s3_proxy.url).fsspec_options()
    url = f"s3://{s3_bucket}/outage/object"
    storage.write_bytes(url, b"before", options)
    s3_proxy.outage(30)
    storage.write_bytes(url, b"during", options)
    assert storage.read_bytes(url, options) == b"during"
    assert not s3_proxy.is_down()  # the write waited out the outage


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _scramble(path: Path) -> None:
    """Same size, other bytes: only the content hash can tell."""
    raw = bytearray(path.read_bytes())
    middle = len(raw) // 2
    raw[middle : middle + 64] = bytes(255 - b for b in raw[middle : middle + 64])
    path.write_bytes(bytes(raw))


def _garbage(path: Path) -> None:
    """Not JSON at all, of the same size: only parsing the metadata can tell."""
    path.write_bytes(b"#" * path.stat().st_size)


# (what is damaged, relative to the output directory; how; the stage that must compute again (None: no stage, the
# metadata is rewritten); how many train chunks compute_influences redoes)
DAMAGE = {
    "score shard deleted": ("influence.zarr/scores/c/0/1", Path.unlink, "compute_influences", 1),
    "self-influence chunk deleted": ("influence.zarr/self_influence/c/2", Path.unlink, "compute_influences", 1),
    "training index chunk deleted": ("stages/index_training/*/index.zarr/features/c/1/0", Path.unlink, "index_training", 0),
    "model.pt truncated": ("stages/fit_model/*/model.pt", _truncate, "fit_model", 0),
    "model.pt overwritten in place": ("stages/fit_model/*/model.pt", _scramble, "fit_model", 0),
    "curvature.pt truncated": ("stages/fit_preconditioner/*/curvature.pt", _truncate, "fit_preconditioner", 0),
    "query factors chunk truncated": ("stages/compute_test_factors/*/factors.zarr/factors/c/0/0", _truncate, "compute_test_factors", 0),
    "training data chunk deleted": ("stages/prepare_data/*/data.zarr/x_train/c/1/0", Path.unlink, "prepare_data", 0),
    "top-k array chunk deleted": ("influence.zarr/topk_harmful_scores/c/0/0", Path.unlink, "aggregate", 0),
    "scores metadata garbage": ("influence.zarr/scores/zarr.json", _garbage, "compute_influences", 4),
    "scores metadata truncated": ("influence.zarr/scores/zarr.json", _truncate, "compute_influences", 4),
    "top-k metadata garbage": ("influence.zarr/topk_helpful_scores/zarr.json", _garbage, "aggregate", 0),
    "group metadata garbage": ("influence.zarr/zarr.json", _garbage, None, 0),
    "group metadata truncated": ("influence.zarr/zarr.json", _truncate, None, 0),
    "training data metadata garbage": ("stages/prepare_data/*/data.zarr/x_train/zarr.json", _garbage, "prepare_data", 0),
    "query factors group metadata truncated": ("stages/compute_test_factors/*/factors.zarr/zarr.json", _truncate, "compute_test_factors", 0),
}


@pytest.mark.usefixtures("prefect_api")
@pytest.mark.parametrize("case", DAMAGE)
def test_damaged_output_is_detected_and_recomputed(case, tmp_path):
    pattern, damage, stage, chunks = DAMAGE[case]
    params = small_params(str(tmp_path / "run"))
    influence_run(**params.sections())
    _, expected = read_outputs(params.store())
    [target] = (tmp_path / "run").glob(pattern)
    damage(target)

    summary = influence_run(**params.sections())
    outcomes = {name: s["outcome"] for name, s in summary["stages"].items()}
    if stage is not None:
        assert outcomes.pop(stage) == "computed"
    assert set(outcomes.values()) <= {"cached", "found complete"}  # only the damaged stage ran again
    if stage == "compute_influences":
        assert summary["stages"][stage]["chunks_computed"] == chunks  # the chunk whose shard was gone, despite its marker (all: the array's metadata)
        work = summary["stages"][stage]["work"]  # the rows come from the training index: none's gradient is evaluated
        assert summary["stages"][stage]["gradient_rows"] == 0 and work["index_rows"] == 64 * chunks - 16 * (chunks == 4)  # 240 rows in chunks of 64
    assert assert_same_outputs(params.store(), expected).attrs["status"] == "complete"  # identical, never NaN or stale


@pytest.mark.usefixtures("prefect_api")
@pytest.mark.slow
def test_damage_on_s3_is_detected_and_recomputed(s3_endpoint, s3_bucket):
    """The same checks against S3 objects (ETags instead of modification times): a shorter model.pt and a lost shard."""
    params = small_params(f"s3://{s3_bucket}/run", storage={"endpoint_url": s3_endpoint})
    influence_run(**params.sections())
    _, expected = read_outputs(params.store())
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint}, skip_instance_cache=True, use_listings_cache=False)
    [model] = fs.glob(f"{s3_bucket}/run/stages/fit_model/*/model.pt")
    fs.pipe_file(model, fs.cat_file(model)[:100])
    fs.rm(f"{s3_bucket}/run/influence.zarr/scores/c/0/2")

    summary = influence_run(**params.sections())
    outcomes = {name: s["outcome"] for name, s in summary["stages"].items()}
    assert outcomes.pop("fit_model") == outcomes.pop("compute_influences") == "computed"
    assert set(outcomes.values()) <= {"cached", "found complete"}
    assert summary["stages"]["compute_influences"]["chunks_computed"] == 1
    assert_same_outputs(params.store(), expected)


@pytest.mark.usefixtures("prefect_api")
@pytest.mark.parametrize("node", ["influence.zarr/zarr.json", "influence.zarr/scores/zarr.json", "influence.zarr/argmax/zarr.json"])
def test_damaged_metadata_is_one_line_in_show_and_verify_and_overwrite_works(node, tmp_path):
    """show and verify name the damaged file in one line, without a traceback; --overwrite replaces the run."""
    params = small_params(str(tmp_path / "run"))
    influence_run(**params.sections())
    _, expected = read_outputs(params.store())
    _garbage(tmp_path / "run" / node)
    runner = CliRunner()
    for command in (["show", str(tmp_path / "run")], ["verify", str(tmp_path / "run")]):
        result = runner.invoke(app, command, terminal_width=400)
        assert result.exit_code == 1 and "Traceback" not in result.output, result.output
        assert f"{node} is damaged" in result.output
        assert result.output.strip().splitlines()[-1].startswith("output_url: ")
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(params.model_dump(mode="json")))
    result = runner.invoke(app, ["run", "--config", str(config), "--overwrite"])
    assert result.exit_code == 0, result.output
    assert assert_same_outputs(params.store(), expected).attrs["status"] == "complete"
    assert runner.invoke(app, ["verify", str(tmp_path / "run")]).exit_code == 0
