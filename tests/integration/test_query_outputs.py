"""`influence-pipeline query` and the question flow against real stores (local Zarr, moto S3, a real Prefect API),
issue 52: an answer never writes over a run (item 1); it is an answer group of its own that `show` and `verify`
read (item 15); a bad queries file or an unreachable location is one line before any work (item 11); the question
flow has no default run that holds none (item 16); and the messages call the run argument `run` (item 17)."""

from __future__ import annotations

import shutil
import socket
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from typer.testing import CliRunner

from flows.cli import app
from flows.influence_run import influence_run
from flows.question import influence_question
from influence_core.errors import ConfigError
from influence_core.pipeline.report.verify import verify_answer
from influence_core.pipeline.specs import StorageSpec
from influence_core.pipeline.store import storage
from influence_core.pipeline.store.loading import open_data
from influence_core.pipeline.store.publish import stored_refs
from influence_core.pipeline.store.run_store import RunStore
from tests.helpers import read_outputs, shown_indices, small_params, tree_hashes

pytestmark = pytest.mark.usefixtures("prefect_api")
runner = CliRunner()


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, prefect_api: None) -> tuple[Path, Path]:
    """A finished local run (small_params: 240 training rows, top_k 4) and its own 12 queries saved as an .npz, so
    the run's stored top-k is the reference for an answer."""
    root = tmp_path_factory.mktemp("query")
    params = small_params(str(root / "run"))
    influence_run(**params.sections())
    store = params.store()
    data = open_data(stored_refs(store, storage.open_group(store.influence_url, {}, mode="r").attrs)["prepare_data"], {})  # type: ignore[arg-type]
    np.savez(root / "q.npz", x=np.asarray(data["x_test"][:]), y=np.asarray(data["y_test"][:]))
    return root / "run", root / "q.npz"


def invoke(*args: Any) -> Any:
    return runner.invoke(app, [str(arg) for arg in args], terminal_width=400)


def one_line(result: Any, code: int, field: str) -> str:
    """The command exited `code` having printed one line, `field: ... Fix: ...`, and no traceback."""
    lines = result.output.strip().splitlines()
    assert result.exit_code == code and len(lines) == 1, result.output
    assert lines[0].startswith(f"{field}: ") and ". Fix: " in lines[0], lines[0]
    return lines[0]


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- item 1: never over a run --------------------------------------------------------------------------------------
def test_an_answer_is_never_written_over_a_run(run: tuple[Path, Path], tmp_path: Path) -> None:
    """--output-url at another finished run, at the run asked, or at a run's leftovers (stages/ only) is refused in one
    line, before the queries are even read (a missing queries file is not what is refused); every file stays
    byte-identical, and the other run still shows and verifies."""
    source, queries = run
    other, leftovers = tmp_path / "other", tmp_path / "leftovers"
    shutil.copytree(source, other)
    shutil.copytree(source / "stages", leftovers / "stages")
    before = {path: tree_hashes(path) for path in (source, other, leftovers)}
    for target in (other, source, leftovers):
        for asked in (queries, tmp_path / "no-such.npz"):
            line = one_line(invoke("query", source, "--queries", asked, "--output-url", target), 1, "--output-url")
            assert line.startswith(f"--output-url: {target} holds ") and "a run's output" in line and f"{target}/questions/<name>" in line, line
    assert {path: tree_hashes(path) for path in (source, other, leftovers)} == before
    assert invoke("show", other).exit_code == 0
    assert invoke("verify", other).exit_code == 0
    inside = one_line(invoke("query", source, "--queries", queries, "--output-url", other / "influence.zarr" / "scores"), 1, "--output-url")
    assert "is a Zarr node" in inside and tree_hashes(other) == before[other]


# -- item 15: the answer's own layout, shown and verified ------------------------------------------------------------
def test_an_answer_is_shown_and_verified_by_its_own_layout_and_may_be_replaced(run: tuple[Path, Path], tmp_path: Path) -> None:
    """The run's own queries asked again: the answer (kind answer, schema_version 1, naming the run and its
    fingerprint) holds the run's stored top-k; `show` prints it as the run's table, `verify` passes its 12 checks,
    and asking again at the same --output-url replaces it."""
    source, queries = run
    group, expected = read_outputs(RunStore(output_url=str(source)))
    out = tmp_path / "answer"
    asked = invoke("query", source, "--queries", queries, "--top", 4, "--output-url", out)
    assert asked.exit_code == 0, asked.output
    answer = zarr.open_group(str(out / "influence.zarr"), mode="r")
    attrs = dict(answer.attrs)
    assert (attrs["kind"], attrs["schema_version"], attrs["status"], attrs["run"], attrs["queries"]) == ("answer", 1, "complete", str(source), str(queries))
    assert attrs["run_fingerprint"] == group.attrs["run_fingerprint"] and (attrs["top_k"], attrs["n_train"]) == (4, 240)
    for side in ("helpful", "harmful"):
        np.testing.assert_array_equal(answer[f"topk_{side}_indices"][:], expected[f"topk_{side}_indices"], err_msg=side)
        np.testing.assert_allclose(answer[f"topk_{side}_scores"][:], expected[f"topk_{side}_scores"], rtol=1e-5, atol=1e-6 * np.abs(expected["scores"]).max())
    np.testing.assert_array_equal(answer["argmax"][:], expected["argmax"])
    np.testing.assert_array_equal(answer["query_labels"][:], np.load(queries)["y"])

    shown = invoke("show", out, "--queries", 3)
    assert shown.exit_code == 0 and "Traceback" not in shown.output, shown.output
    assert f"answer from {source}'s index (method=direct)" in " ".join(shown.output.split())
    assert shown_indices(shown.output, 2) == expected["topk_helpful_indices"][:3].tolist()
    assert shown_indices(shown.output, 3) == expected["topk_harmful_indices"][:3].tolist()
    assert one_line(invoke("show", out, "--top", 5), 1, "--top").startswith("--top: 5 is more than the 4 examples per query the answer stores (its top_k). Fix: give --top 4 or less, or ask again with --top 5")
    verified = invoke("verify", out)
    assert verified.exit_code == 0 and "All 12 checks passed." in verified.output, verified.output

    again = invoke("query", source, "--queries", queries, "--top", 2, "--output-url", out)
    assert again.exit_code == 0, again.output
    answer = zarr.open_group(str(out / "influence.zarr"), mode="r")
    np.testing.assert_array_equal(answer["topk_helpful_indices"][:], expected["topk_helpful_indices"][:, :2])
    assert answer.attrs["top_k"] == 2 and invoke("verify", out).exit_code == 0


def _set(name: str, change: Any) -> Any:
    def corrupt(group: zarr.Group) -> None:
        values = np.asarray(group[name][...])
        group[name][...] = change(values)

    return corrupt


@pytest.mark.parametrize(
    ("corrupt", "failed"),
    [
        (_set("argmax", lambda a: (a + 1) % 240), ["argmax"]),
        (_set("topk_helpful_indices", lambda a: np.where(np.arange(a.size).reshape(a.shape) == 1, 240, a)), ["top-k helpful"]),
        (_set("topk_harmful_scores", lambda a: a[:, ::-1]), ["top-k harmful"]),
        (lambda group: group.attrs.update({"run_fingerprint": "another"}), ["run"]),
        (lambda group: group.attrs.update({"status": "running"}), ["status"]),
        (lambda group: group.__delitem__("topk_harmful_scores"), ["topk_harmful_scores"]),
    ],
    ids=["argmax", "index-out-of-range", "harmful-unsorted", "another-run", "unfinished", "array-deleted"],
)
def test_verify_reports_each_fault_of_an_answer_by_its_check(run: tuple[Path, Path], tmp_path: Path, corrupt: Any, failed: list[str]) -> None:
    """Each fault fails the check it concerns and only it; `verify` then says to ask the question again."""
    source, queries = run
    out = tmp_path / "answer"
    assert invoke("query", source, "--queries", queries, "--output-url", out).exit_code == 0
    corrupt(zarr.open_group(str(out / "influence.zarr"), mode="a"))
    checks = verify_answer(RunStore(output_url=str(out)))
    assert [check.name for check in checks if not check.ok] == failed, checks
    line = invoke("verify", out).output.strip().splitlines()[-1]
    assert line.startswith(f"output_url: 1 of {len(checks)} checks failed: {failed[0]}. Fix: ask the question again with --output-url there"), line


def test_the_question_flow_s_answer_is_shown_and_verified(run: tuple[Path, Path]) -> None:
    """The question deployment's flow writes its answer under the run (questions/<flow run name>): `show` prints
    its table and `verify` passes it."""
    source, queries = run
    found = influence_question(run_url=str(source), queries=str(queries), top_k=3)
    where = str(Path(found["answer"]).parent)
    assert where.startswith(f"{source}/questions/")
    shown = invoke("show", where, "--queries", 2)
    assert shown.exit_code == 0, shown.output
    _, expected = read_outputs(RunStore(output_url=str(source)))
    assert shown_indices(shown.output, 2) == expected["topk_helpful_indices"][:2, :3].tolist()
    assert invoke("verify", where).exit_code == 0


# -- item 16: the question flow's run ----------------------------------------------------------------------------------
def test_the_question_flow_needs_a_run_and_names_the_runs_of_a_folder(run: tuple[Path, Path], tmp_path: Path) -> None:
    """run_url has no default (runs/on-demand held none: its runs are runs/on-demand/{fingerprint}), so the form asks
    for it; a folder of runs given as run_url is refused in one line naming the runs below it, before any work."""
    from prefect.utilities.callables import parameter_schema

    source, queries = run
    assert "run_url" in parameter_schema(influence_question).model_dump_for_openapi()["required"]
    folder = tmp_path / "on-demand"
    shutil.copytree(source, folder / "a1b2c3")
    with pytest.raises(ConfigError) as info:
        influence_question(run_url=str(folder), queries=str(queries))
    assert info.value.field == "run" and f"'{folder}' holds no run itself but 1 run below it: '{folder}/a1b2c3'" in info.value.problem
    assert not (folder / "questions").exists()


# -- item 17: the run argument is `run` -------------------------------------------------------------------------------
def test_query_s_messages_name_its_run_argument_run(run: tuple[Path, Path], tmp_path: Path) -> None:
    """A missing, unfinished or foreign run, or an answer given as the run, is refused naming `run`, and a bad answer
    location naming `--output-url`, never `output_url` (the name of neither)."""
    source, queries = run
    unfinished = tmp_path / "unfinished"
    shutil.copytree(source, unfinished)
    storage.open_group(str(unfinished / "influence.zarr"), {}, mode="a").attrs["status"] = "running"
    assert invoke("query", source, "--queries", queries, "--output-url", tmp_path / "answer").exit_code == 0
    cases = {
        (tmp_path / "none",): (1, "run", "no influence.zarr under"),
        (unfinished,): (1, "run", "is not complete (status='running')"),
        (tmp_path / "answer",): (1, "run", f"holds the answer to a question, not a run. Fix: give the run it asked, '{source}'"),
        ("gs://bucket/run",): (2, "run", "unsupported scheme 'gs'"),
        (source, "--output-url", "gs://bucket/answer"): (2, "--output-url", "unsupported scheme 'gs'"),
    }
    for (target, *more), (code, field, words) in cases.items():
        line = one_line(invoke("query", target, "--queries", queries, *more), code, field)
        assert words in line, line


# -- item 11: the queries file and the locations ------------------------------------------------------------------------
class Payload:
    """Unpickling it creates the file `marker`: proof that a pickle ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


def _write(kind: str, path: Path, marker: Path) -> None:
    x, y = np.zeros((3, 64), np.float32), np.arange(3)
    if kind == "empty":
        path.write_bytes(b"")
    elif kind in ("npy", "object npy"):
        with open(path, "wb") as out:  # np.save would add .npy to the name
            np.save(out, x if kind == "npy" else np.array([Payload(marker)], dtype=object), allow_pickle=True)
    elif kind == "object in npz":
        np.savez(path, x=np.array([Payload(marker)] * 3, dtype=object), y=y)
    elif kind == "text":
        path.write_text("x,y\n0.5,1\n")
    elif kind == "no rows":
        np.savez(path, x=x[:0], y=y[:0])
    elif kind == "damaged npz":
        np.savez(path, x=x, y=y)
        path.write_bytes(path.read_bytes()[:100])


@pytest.mark.parametrize(
    ("kind", "words"),
    [
        ("empty", "is empty, not an .npz"),
        ("npy", "is a single .npy array, not an .npz"),
        ("object npy", "is a single .npy array, not an .npz"),
        ("object in npz", "holds object arrays, which are never unpickled"),
        ("text", "begins b'x,y\\n0.5,', not an .npz"),
        ("no rows", "holds no query (x of shape (0, 64), y of shape (0,))"),
        ("damaged npz", "is a damaged .npz"),
    ],
)
def test_a_bad_queries_file_is_one_line_and_never_unpickled(run: tuple[Path, Path], tmp_path: Path, kind: str, words: str) -> None:
    source, _ = run
    path, marker = tmp_path / "queries.npz", tmp_path / "pwned"
    _write(kind, path, marker)
    line = one_line(invoke("query", source, "--queries", path, "--output-url", tmp_path / "answer"), 1, "--queries")
    assert f"--queries: {path} {words}" in line and "numpy.savez" in line, line
    assert not marker.exists() and not (tmp_path / "answer").exists()
    if "object" in kind:  # the payload is live: a plain unpickle runs it
        loaded = np.load(path, allow_pickle=True)
        (loaded["x"] if kind == "object in npz" else loaded)[0]
        assert marker.exists()


@pytest.fixture
def s3_run(run: tuple[Path, Path], s3_endpoint: str, s3_bucket: str) -> str:
    """The finished run copied to a moto bucket (an output is portable: its refs are relative to its root)."""
    import s3fs

    s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint}).put(f"{run[0]}/", f"{s3_bucket}/run/", recursive=True)
    return f"s3://{s3_bucket}/run"


def s3_listing(url: str, endpoint: str) -> dict[str, Any]:
    import s3fs

    return {name: info["ETag"] for name, info in s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}, skip_instance_cache=True).find(url, detail=True).items()}


def test_on_s3_an_answer_is_written_beside_never_over_a_run(run: tuple[Path, Path], s3_run: str, s3_endpoint: str, tmp_path: Path) -> None:
    """On S3 as locally: --output-url at the run is refused and every object keeps its ETag; an answer of its own is
    written, shown and verified there."""
    _, queries = run
    before = s3_listing(s3_run, s3_endpoint)
    line = one_line(invoke("query", s3_run, "--queries", queries, "--endpoint-url", s3_endpoint, "--output-url", s3_run), 1, "--output-url")
    assert f"{s3_run} holds influence.zarr" in line
    assert s3_listing(s3_run, s3_endpoint) == before
    answer = s3_run.rsplit("/", 1)[0] + "/answer"
    asked = invoke("query", s3_run, "--queries", queries, "--endpoint-url", s3_endpoint, "--output-url", answer)
    assert asked.exit_code == 0, asked.output
    assert invoke("show", answer, "--endpoint-url", s3_endpoint).exit_code == 0
    verified = invoke("verify", answer, "--endpoint-url", s3_endpoint)
    assert verified.exit_code == 0 and "All 12 checks passed." in verified.output, verified.output


def test_s3_locations_are_checked_in_seconds_before_any_work(run: tuple[Path, Path], s3_run: str, s3_endpoint: str, tmp_path: Path) -> None:
    """A missing bucket for the answer (once computed, then failed), a missing bucket for the queries, and an
    endpoint where nothing answers (once 104-122 s of botocore retries, then a traceback) are each one line naming
    where they were given, before any work: no queries were read or answered."""
    source, queries = run
    missing = f"no-such-bucket-{uuid.uuid4().hex[:8]}"
    dead = f"http://127.0.0.1:{closed_port()}"
    cases = [
        ((source, "--queries", queries, "--endpoint-url", s3_endpoint, "--output-url", f"s3://{missing}/answer"), "--output-url", f"S3 bucket '{missing}' does not exist at {s3_endpoint}"),
        ((source, "--queries", f"s3://{missing}/q.npz", "--endpoint-url", s3_endpoint), "--queries", f"S3 bucket '{missing}' does not exist"),
        ((s3_run, "--queries", queries, "--endpoint-url", dead), "--endpoint-url", f"nothing answers at {dead}"),
        ((source, "--queries", queries, "--endpoint-url", dead, "--output-url", s3_run + "-answer"), "--endpoint-url", f"nothing answers at {dead}"),
    ]
    before = s3_listing(s3_run.rsplit("/", 1)[0], s3_endpoint)
    for args, field, words in cases:
        line = one_line(invoke("query", *args), 1, field)
        assert words in line, line
    assert s3_listing(s3_run.rsplit("/", 1)[0], s3_endpoint) == before  # nothing written to the bucket


def test_the_question_flow_names_its_endpoint_setting(run: tuple[Path, Path]) -> None:
    """Through the flow the endpoint is its storage.endpoint_url parameter, and the refusal says so."""
    source, queries = run
    dead = f"http://127.0.0.1:{closed_port()}"
    with pytest.raises(ConfigError) as info:
        influence_question(run_url="s3://some-bucket/run", queries=str(queries), storage=StorageSpec(endpoint_url=dead))
    assert info.value.field == "storage.endpoint_url" and dead in info.value.problem
