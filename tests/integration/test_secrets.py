"""No secret leaks: with recognisable S3 credentials in the environment, a run to moto S3 under the real Prefect API
leaves them in no log, artifact, parameter, persisted result, block, Zarr attribute, summary or manifest, in plain
text or base64-, hex- or URL-encoded."""

from __future__ import annotations

import base64
import json
import logging
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote, quote_plus

import pytest
import s3fs
import zarr
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterFlowRunId
from prefect.logging.handlers import APILogWorker

from flows.influence_run import influence_run
from influence_core.pipeline.store import storage
from tests.helpers import small_params

pytestmark = pytest.mark.usefixtures("prefect_api")


def encodings(secret: str) -> set[bytes]:
    """The secret as it could appear: plain, URL-encoded, hex, and base64 (standard and URL-safe) at each of the
    three byte alignments it can have inside a longer encoded blob (only the characters it alone determines)."""
    raw = secret.encode()
    found = {raw, quote(secret).encode(), quote_plus(secret).encode(), raw.hex().encode()}
    for offset in range(3):
        start, stop = (4 if offset else 0), 4 * ((offset + len(raw)) // 3)
        for encode in (base64.b64encode, base64.urlsafe_b64encode):
            found.add(encode(b"\0" * offset + raw)[start:stop])
    return found


@pytest.fixture
def secrets(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, str]]:
    """Recognisable credentials in the environment (moto accepts any); filesystems built from older ones are dropped."""
    key, secret = f"KEYID-{uuid.uuid4().hex}", f"TOPSECRET-{uuid.uuid4().hex}"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    loggers = [logging.getLogger(name) for name in ("prefect.flow_runs", "prefect.task_runs")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:  # everything the flow and its tasks log reaches the API
        logger.setLevel(logging.DEBUG)
    s3fs.S3FileSystem.clear_instance_cache()
    yield key, secret
    s3fs.S3FileSystem.clear_instance_cache()
    for logger, level in zip(loggers, levels):
        logger.setLevel(level)


def zarr_attributes(fs: s3fs.S3FileSystem, bucket: str, options: dict) -> dict[str, dict]:
    """Attributes of every node of every Zarr hierarchy in the bucket: influence.zarr and the stage outputs."""
    roots = {key.split(".zarr/", 1)[0] + ".zarr" for key in fs.find(bucket) if ".zarr/" in key}
    found: dict[str, dict] = {}
    for root in sorted(roots):
        node = zarr.open(store=storage.zarr_store(f"s3://{root}", options, read_only=True), mode="r")
        found[root] = dict(node.attrs)
        if isinstance(node, zarr.Group):
            found |= {f"{root}/{path}": dict(member.attrs) for path, member in node.members(max_depth=None)}
    return found


def test_no_credential_reaches_any_output(secrets: tuple[str, str], s3_endpoint: str, s3_bucket: str, caplog: pytest.LogCaptureFixture) -> None:
    key, secret = secrets
    params = small_params(f"s3://{s3_bucket}/run", storage={"endpoint_url": s3_endpoint})
    caplog.set_level(logging.DEBUG, logger="prefect")
    state = influence_run(**params.sections(), return_state=True)
    summary = state.result()
    flow_run_id = state.state_details.flow_run_id
    APILogWorker.drain_all(timeout=30)

    # the run really used these credentials: every S3 filesystem it built signs with the new key
    connected = [fs for fs in s3fs.S3FileSystem._cache.values() if getattr(fs, "_s3", None) is not None]
    assert connected and {fs.s3._get_credentials().access_key for fs in connected} == {key}

    places: dict[str, bytes] = {}
    with get_client(sync_client=True) as client:
        by_run = FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
        artifacts = client.read_artifacts(flow_run_filter=by_run)
        flow_run = client.read_flow_run(flow_run_id)
        task_runs = client.read_task_runs(flow_run_filter=by_run)
        blocks = client.read_block_documents(include_secrets=True)
    places["prefect logs"] = "\n".join(log.message for log in logs).encode()
    places["process logs"] = "\n".join(f"{r.name} {r.getMessage()} {r.exc_text or ''}" for r in caplog.records).encode()
    places["artifacts"] = "\n".join(a.model_dump_json() for a in artifacts).encode()
    places["flow run and parameters"] = flow_run.model_dump_json().encode()
    places["task runs"] = "\n".join(t.model_dump_json() for t in task_runs).encode()
    places["blocks"] = "\n".join(b.model_dump_json() for b in blocks).encode()
    places["flow result"] = json.dumps(summary, default=str).encode()
    local_results = Path(os.environ["PREFECT_LOCAL_STORAGE_PATH"])
    places |= {f"local result {p.name}": p.read_bytes() for p in local_results.rglob("*") if p.is_file()}

    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint})
    objects = {name: fs.cat_file(name) for name in fs.find(s3_bucket)}  # every object the run wrote, results included
    places |= {f"s3://{name}": data for name, data in objects.items()}
    attributes = zarr_attributes(fs, s3_bucket, params.store().options)
    places |= {f"zarr attrs of {name}": json.dumps(attrs, default=str).encode() for name, attrs in attributes.items()}

    # the haystack is real: each kind of place was found and holds what it should
    assert "train chunks" in places["prefect logs"].decode()
    assert {a.key for a in artifacts} >= {"influence-topk", "influence-summary", "influence-progress"}
    assert s3_endpoint in flow_run.parameters["storage"]["endpoint_url"]
    results = [place for place in places if place.startswith("local result ")]  # the session's records: the stages' are JSON
    assert sum(_is_json(places[place]) for place in results) >= 6
    assert f"{s3_bucket}/run/summary.json" in objects and f"{s3_bucket}/run/report.png" in objects
    assert sum(name.endswith("manifest.json") for name in objects) == 7  # six stages and the training index
    assert f"{s3_bucket}/run/influence.zarr" in attributes and attributes[f"{s3_bucket}/run/influence.zarr"]["status"] == "complete"
    assert any("/data.zarr" in name for name in attributes)

    for secret_value in (key, secret):
        for encoded in encodings(secret_value):
            leaks = [place for place, data in places.items() if encoded in data]
            assert not leaks, f"{encoded!r} (from {secret_value[:10]}...) found in {leaks}"


def _is_json(data: bytes) -> bool:
    try:
        json.loads(data)
    except ValueError:
        return False
    return True


def test_the_search_finds_each_encoding() -> None:
    """The leak check is not blind: a secret hidden in each encoding, inside longer data, is found."""
    secret = f"TOPSECRET-{uuid.uuid4().hex}"
    hidden = [
        b"prefix " + secret.encode() + b" suffix",
        quote(f"a={secret}&b=1").encode(),
        base64.b64encode(b"x" + secret.encode() + b"y"),
        base64.b64encode(b"xy" + secret.encode()),
        base64.urlsafe_b64encode(b"user:" + secret.encode()),
        ("00" + secret.encode().hex()).encode(),
    ]
    for data in hidden:
        assert any(encoded in data for encoded in encodings(secret)), data
    assert not any(encoded in b"nothing secret here" for encoded in encodings(secret))
