"""An on-demand question against a finished run's training index: new queries scored with no training gradient.

Everything but the queries comes from the run's store: its model, its curvature and its training index (the stage
refs `influence.zarr` records). The queries' factors are solved here, then the index is streamed chunk by chunk, one
GEMM each, keeping each query's running top-k helpful and harmful examples, so memory is bounded by one chunk and
the answer holds (n_queries, k) arrays, never (n_queries, n_train). With `search.kind: faiss`, a FAISS
inner-product index over the stored rows (`faiss_search.py`) gives each query's candidates instead of the scan, and
the candidates are scored as the scan scores them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from pydantic import TypeAdapter

from ..store import integrity, storage
from ... import examples
from ...errors import ConfigError
from ...work import Work
from ...methods import InfluenceFunctionModel
from ...methods.scorer import Scorer
from ...objective import Objective
from ..sources.data import check_block
from . import faiss_search
from .score_reductions import TIE_MARGIN, RunningTopK, candidate_top_k, read_ahead, rerank_candidates
from .layout import ANSWER_KIND, ANSWER_SCHEMA_VERSION, DIMENSIONS
from ..model.models import check_queries, probe_forward
from ..store.loading import index_projection, load_influence_model, open_data
from ..store.publish import is_answer, read_attrs, shown_top, stored_refs, task_decode, with_recorded_cache
from ..store.refs import DataRef, IndexRef, ModelRef
from ..report.report import QueryRow, topk_rows
from ..store.binding import require_stages
from ..store.run_store import RunStore
from ..specs import RERANK_PER_TOP_K, MethodSpec, ModelSpec, SearchSpec

ANSWERING = ("prepare_data", "fit_model", "fit_preconditioner", "index_training")  # the stages a question reads
TOPK = ("topk_helpful_indices", "topk_helpful_scores", "topk_harmful_indices", "topk_harmful_scores")


@dataclass
class Answer:
    """Each query's top-k helpful and harmful training examples (arrays by the output layout's names), and the work."""

    arrays: dict[str, np.ndarray]
    work: Work = field(default_factory=Work)
    config: dict[str, Any] = field(default_factory=dict)  # the run's recorded parameters
    data: DataRef | None = None  # the run's data (its training labels name the examples)
    search: dict[str, Any] = field(default_factory=lambda: {"kind": "scan"})  # how the top-k was found (`faiss_search.describe`)

    def rows(self, y_train: Any, x: Any, y: np.ndarray, decode: Any, n_show: int) -> list[QueryRow]:
        return topk_rows(self.arrays, y_train, y, len(y), n_show, x, decode)


def run_index(store: RunStore) -> tuple[dict[str, Any], ModelRef, Any, IndexRef, DataRef]:
    """A finished run's config, model, curvature, training index and data refs; refused in one line when the run
    has no usable index, is an ensemble, or any of them is damaged or not what the index was built from."""
    attrs = read_attrs(store)
    store = with_recorded_cache(store, attrs)
    refs = stored_refs(store, attrs)
    index = refs.get("index_training")
    if not isinstance(index, IndexRef) or not index.usable:
        why = "has no training index" if not isinstance(index, IndexRef) else f"has no training index ({index.skipped})"
        raise ConfigError("run", f"the run at {store.output_url} {why}", "rerun it with compute.index_budget_gb large enough (its summary.json says how large), then ask again")
    if any(name.startswith("fit_model[") for name in refs):
        raise ConfigError("run", f"the run at {store.output_url} is an ensemble (training.ensemble > 1); questions take a single model", "ask a run of one model, or run the pipeline with the new queries (storage.cache_url shared: the members' indexes are reused)")
    require_stages(store, refs, list(ANSWERING))  # complete, intact, and the ones the index was built from
    model, data = refs["fit_model"], refs["prepare_data"]
    assert isinstance(model, ModelRef) and isinstance(data, DataRef)
    return attrs["config"], model, refs["fit_preconditioner"], index, data


def answer(store: RunStore, x: Any, y: np.ndarray, top_k: int, device: str = "cpu", search: SearchSpec | None = None, rerank: int | None = None) -> Answer:
    """The top-k of queries (x, y) against the run at `store`: factors solved from its curvature, scores streamed over
    its training index (or its FAISS index's candidates scored, with `search.kind: faiss`); over a compressed index,
    each query's `rerank` most helpful and most harmful candidates (None: RERANK_PER_TOP_K × top_k; 0: none)
    scored again exactly, as the run's rerank stage scores them, and the top-k taken from those."""
    search = search or SearchSpec()
    if rerank is not None and 0 < rerank < top_k:
        raise ConfigError("--rerank", f"{rerank} candidates a side cannot hold --top {top_k}", f"give --rerank {top_k} or more, or 0 to take the top-k from the compressed scores")
    asked = solve(store, x, y, top_k, device)
    per_side = (RERANK_PER_TOP_K * top_k if rerank is None else rerank) if asked.index.compression == "logra" else 0
    wide = max(top_k, min(2 * per_side, asked.data.n_train))
    if search.kind == "faiss":
        arrays, described = faiss_top_k(asked.index, asked.factors, wide, search, store.options, asked.work)
    else:
        arrays, described = scan_top_k(asked.index, asked.factors, wide, store.options, asked.work), {"kind": "scan"}
    if per_side:
        arrays, described["rerank"] = rerank_top_k(asked, arrays, per_side, top_k, store.options)
    return Answer(arrays, asked.work, asked.config, asked.data, described)


@dataclass
class Question:
    """Queries solved against a run: their factors in its index's coordinates, the run's config, index and data, the
    work so far, and the run's fitted influence model with the queries as it takes them (for exact re-scoring)."""

    factors: torch.Tensor
    config: dict[str, Any]
    index: IndexRef
    data: DataRef
    work: Work
    im: InfluenceFunctionModel
    queries: tuple[Any, torch.Tensor]


def solve(store: RunStore, x: Any, y: np.ndarray, top_k: int, device: str = "cpu") -> Question:
    """The factors of queries (x, y) from the run's model and curvature, projected as its index is (LoGra); refused
    in one line when the queries or top_k do not fit the run."""
    config, model, curvature, index, data = run_index(store)
    if top_k > data.n_train:
        raise ConfigError("--top", f"{top_k} exceeds the run's {data.n_train} training examples", f"give --top {data.n_train} or less")
    method = TypeAdapter(MethodSpec).validate_python(config["method"])
    im = load_influence_model(method, model, data, curvature, store.options, device)
    check_question(ModelSpec.model_validate(config["model"]), data, im.objective, x, y)
    xq, yq = im.objective.to_model(x, torch.as_tensor(y))
    if index.compression == "logra":  # a whitened method's queries straight from their captures
        factors = index_projection(im, data, store.options, index.side or 0, index.whitening_url).queries(im, xq, yq)
    else:
        factors = im.influence_factors(xq, yq)
    return Question(factors, config, index, data, im.work.copy(), im, (xq, yq))


def rerank_top_k(asked: Question, found: dict[str, np.ndarray], per_side: int, top_k: int, options: dict[str, Any]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The top-k of each query's candidates (its `per_side` first of `found`'s helpful and harmful lists, by the
    compressed scores) scored exactly: the queries' factors in the method's coordinates against the candidate rows'
    captured gradients, the rows' union captured once (`Scorer.entries`). The top-k arrays and what was done."""
    candidates = rerank_candidates(found["topk_helpful_indices"], found["topk_harmful_indices"], per_side, asked.data.n_train)
    rows, where = np.unique(candidates, return_inverse=True)
    arrays = open_data(asked.data, options)
    before = asked.im.work.copy()
    exact = asked.im.influence_factors(*asked.queries)
    queries = torch.arange(len(candidates)).repeat_interleave(candidates.shape[1])
    scores = Scorer(asked.im, exact, None).entries(examples.read(arrays["x_train"], rows), torch.as_tensor(examples.read(arrays["y_train"], rows)), queries, torch.from_numpy(where.reshape(-1)))
    asked.work += asked.im.work - before
    top = candidate_top_k(candidates, scores.reshape(candidates.shape).float().cpu().numpy(), top_k)
    arrays_out = {"topk_helpful_indices": top.helpful_indices, "topk_helpful_scores": top.helpful_scores, "topk_harmful_indices": top.harmful_indices, "topk_harmful_scores": top.harmful_scores}
    return arrays_out, {"per_side": per_side, "per_query": candidates.shape[1], "rows": len(rows), "entries": candidates.size}


def scan_top_k(index: IndexRef, factors: torch.Tensor, top_k: int, options: dict[str, Any], work: Work) -> dict[str, np.ndarray]:
    """Each query's exact top-k: every row of the index scored, a chunk at a time (one GEMM each)."""
    features = storage.open_array(index.array("features"), options)
    best = RunningTopK(len(factors), top_k)
    with integrity.chunk_reads("index_training", index.url, "run the pipeline again with the run's parameters: the damaged index chunks are computed again"):
        for lo, block in read_ahead(features):
            work.index_rows += len(block)
            work.index_bytes += block.nbytes
            work.score_flops += 2.0 * factors.shape[0] * block.shape[0] * block.shape[1]
            best.add((factors @ torch.from_numpy(block).to(device=factors.device, dtype=factors.dtype).T).float(), lo)
    return best.arrays()


QUERY_BLOCK = 1024  # queries whose candidates' vectors are read back and scored at once


def faiss_top_k(index: IndexRef, factors: torch.Tensor, top_k: int, search: SearchSpec, options: dict[str, Any], work: Work) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Each query's top-k among its FAISS candidates (top_k + TIE_MARGIN a side), scored as the scan scores them: the
    query factors times the rows' stored vectors. With a flat index the answer is the scan's; the search as recorded."""
    found = faiss_search.open_index(index, search, options, torch.get_num_threads())
    if found.built:  # the build read the whole index once
        work.index_rows += found.index.ntotal
        work.index_bytes += found.index.ntotal * index.bytes_per_row
    wide = min(found.index.ntotal, top_k + TIE_MARGIN)
    parts = []
    for lo in range(0, len(factors), QUERY_BLOCK):
        block = factors[lo : lo + QUERY_BLOCK]
        best = RunningTopK(len(block), top_k)
        sides = faiss_search.candidates(found, block.float().cpu().numpy(), wide, search.nprobe)
        for rows, largest in zip((np.sort(side, axis=1) for side in sides), (True, False)):  # rows in index order: ties go to the lower index, as in the scan
            vectors = torch.from_numpy(faiss_search.vectors(found, rows)).to(device=factors.device, dtype=factors.dtype)
            best.offer((vectors @ block.unsqueeze(-1)).squeeze(-1).float(), torch.from_numpy(rows), largest)
            work.score_flops += 2.0 * rows.size * factors.shape[1]
        parts.append(best.arrays())
    return {name: np.concatenate([part[name] for part in parts]) for name in TOPK}, faiss_search.describe(found, wide)


def check_question(spec: ModelSpec, data: DataRef, objective: Objective, x: Any, y: np.ndarray) -> None:
    """The queries fit the run's model, or one line naming --queries before any solve: one row of the model's input
    shape and one label per query, finite values, token ids and labels the model takes."""
    shape, rows = tuple(data.feature_shape), np.asarray(x)
    if tuple(rows.shape[1:]) != shape or len(y) != len(rows):
        raise ConfigError("--queries", f"x of shape {rows.shape} and {len(y)} labels; the run's model takes one row of shape {shape} and one label per query", f"save x as (n_queries, {', '.join(map(str, shape))}) and y with n_queries rows")
    try:
        check_block(rows, y, "test", 0)
        check_queries(spec, {"x_test": rows})
        probe_forward(objective, spec, x[:64], torch.as_tensor(y[:64]))
        objective.check_outputs(torch.as_tensor(x), torch.as_tensor(y))
    except ConfigError as exc:
        raise ConfigError("--queries", f"the queries do not fit the run's model ({exc.field}): {exc.problem}", "ask with inputs and labels encoded as the run's training data is (its dataset and model settings are in its summary.json)") from None


def write_answer(output: RunStore, answer: Answer, labels: np.ndarray, asked: dict[str, Any]) -> None:
    """The answer as a Zarr v3 group of the top-k arrays (the run's output layout) and the queries' labels, marked
    kind: answer with its schema version, naming the run it asked (`asked`: run, run_fingerprint, queries) and how the
    top-k was found; status complete is written last. Replaces an earlier answer there, never anything else
    (`check_output` ran before any work)."""
    group = storage.open_group(output.influence_url, output.options, mode="w")
    group.attrs.put({"kind": ANSWER_KIND, "schema_version": ANSWER_SCHEMA_VERSION, "status": "running"})
    for name in TOPK:
        storage.create_array(group, name, data=answer.arrays[name], dimension_names=DIMENSIONS[name])
    storage.create_array(group, "argmax", data=answer.arrays["topk_helpful_indices"][:, 0], dimension_names=DIMENSIONS["argmax"])
    storage.create_array(group, "query_labels", data=labels, dimension_names=("query", *[None] * (labels.ndim - 1)))
    assert answer.data is not None
    top_k = answer.arrays["topk_helpful_indices"].shape[1]
    group.attrs.update({**asked, "top_k": top_k, "n_train": answer.data.n_train, "method": answer.config["method"]["name"], "work": answer.work.as_dict(), "search": answer.search})
    group.attrs["status"] = "complete"


def ask(store: RunStore, queries: str, top_k: int, output: RunStore | None = None, search: SearchSpec | None = None, endpoint_field: str = "--endpoint-url", rerank: int | None = None) -> tuple[Answer, list[QueryRow], str]:
    """The whole question: the queries of the .npz file `queries` answered from the run at `store` (by `search`, and
    over a compressed index re-ranked with `rerank` candidates a side, `answer`), written under `output` when given. Every location is checked first, in seconds (`endpoint_field` names where the
    S3 endpoint was given). Returns the answer, its top-k rows (labels read as the run's task reads them) and the
    method."""
    check_locations(store, queries, output, endpoint_field)
    fingerprint = read_attrs(store, "run").get("run_fingerprint")
    x, y = query_arrays(queries, store.options)
    found = answer(store, x, y, top_k, search=search, rerank=rerank)
    config, data = found.config, found.data
    assert data is not None
    if output is not None:
        write_answer(output, found, y, {"run": store.output_url, "run_fingerprint": fingerprint, "queries": queries})
    rows = found.rows(open_data(data, store.options)["y_train"], x, y, task_decode(config["model"]), top_k)
    return found, rows, config["method"]["name"]


def check_locations(run: RunStore, queries: str, output: RunStore | None, endpoint_field: str) -> None:
    """Before any work, each in seconds: the run's and the queries' S3 locations answer (not after botocore's
    retries), and the answer's location holds at most an earlier answer (checked before its write probe) and can be
    written."""
    storage.check_reachable(run.output_url, run.options, "run", endpoint_field)
    storage.check_reachable(queries, run.options, "--queries", endpoint_field)
    if output is not None:
        storage.check_reachable(output.output_url, output.options, "--output-url", endpoint_field)
        check_output(output)
        storage.check_writable(output.output_url, output.options, "--output-url", endpoint_field)


TAKEN = ("influence.zarr", "summary.json", "report.png", "stages", "run.lock", "zarr.json")  # a run's entries, or a Zarr node itself


def check_output(output: RunStore) -> None:
    """The answer's location holds nothing or an earlier answer (which the new one replaces): a run there, finished
    or not, its files, any other group at influence.zarr, or a Zarr node (inside a run's group) is refused, never
    written over."""
    if is_answer(output):
        return
    held = sorted(set(storage.list_names(output.output_url, output.options)) & set(TAKEN))
    if "zarr.json" in held:
        raise ConfigError("--output-url", f"{output.output_url} is a Zarr node (inside a run's or another group), which the answer would write into", "give a folder of its own, outside any influence.zarr")
    if held:
        raise ConfigError(
            "--output-url", f"{output.output_url} holds {', '.join(held)}: a run's output (or another group), which the answer would overwrite",
            f"give a location of its own, e.g. {storage.join(output.output_url, 'questions', '<name>')}, or an earlier answer to replace",
        )


def read_answer(store: RunStore, n_queries: int, n_show: int | None = None) -> tuple[dict[str, Any], list[QueryRow]]:
    """A question's answer as `show` prints it: its attributes and its first queries' rows, `n_show` examples each
    (None: all it stores), the training examples' labels read from the run it names."""
    group = storage.open_group(store.influence_url, store.options, mode="r")
    attrs = dict(group.attrs)
    if attrs.get("status") != "complete":
        raise ConfigError("output_url", f"the answer at {store.output_url!r} is not complete (status={attrs.get('status')!r})", "ask the question again with --output-url there")
    shown = shown_top(group["topk_helpful_indices"].shape[1], n_show, "answer", f"ask again with --top {n_show}")
    run = RunStore(output_url=attrs["run"], storage=store.storage)
    run_attrs = read_attrs(run, "run")
    run = with_recorded_cache(run, run_attrs)
    refs = stored_refs(run, run_attrs)
    require_stages(run, refs, ["prepare_data"])
    data = refs["prepare_data"]
    assert isinstance(data, DataRef)
    decode = task_decode(run_attrs["config"]["model"])
    return attrs, topk_rows(group, open_data(data, run.options)["y_train"], group["query_labels"], n_queries, shown, None, decode)


QUERIES_FIX = "save the queries' inputs and labels as numeric arrays, one row per query: numpy.savez(FILE, x=inputs, y=labels) (or x_test, y_test)"
NPY_MAGIC, ZIP_MAGIC = b"\x93NUMPY", b"PK\x03\x04"


def query_arrays(path: str, options: dict[str, Any]) -> tuple[Any, np.ndarray]:
    """Queries from an .npz file: x_test and y_test, or x and y (every row a query). Read without unpickling, ever:
    an empty file, a single .npy array, any other file, object arrays or no rows are refused in one line."""
    try:
        raw = storage.read_bytes(path, options)
    except FileNotFoundError:
        raise ConfigError("--queries", f"no file at {path!r}", "give the path of an .npz file of the queries") from None
    if not raw.startswith(ZIP_MAGIC):
        what = "is empty" if not raw else "is a single .npy array" if raw.startswith(NPY_MAGIC) else f"begins {raw[:8]!r}"
        raise ConfigError("--queries", f"{path} {what}, not an .npz of the queries' inputs and labels", QUERIES_FIX)
    x, y = npz_queries(path, raw)
    if y.ndim == 0 or len(y) == 0:
        raise ConfigError("--queries", f"{path} holds no query (x of shape {x.shape}, y of shape {y.shape})", QUERIES_FIX)
    return examples.read(x), y


def npz_queries(path: str, raw: bytes) -> tuple[np.ndarray, np.ndarray]:
    """The inputs and labels of an .npz file's bytes, with allow_pickle=False; one line for a damaged zip, missing
    names or object arrays."""
    import io
    import zipfile

    try:
        with np.load(io.BytesIO(raw), allow_pickle=False) as npz:
            names = ("x_test", "y_test") if "x_test" in npz else ("x", "y")
            if not set(names) <= set(npz.files):
                raise ConfigError("--queries", f"{path} holds {sorted(npz.files)}, not x_test and y_test (or x and y)", "save the queries' inputs and labels under those names")
            return npz[names[0]], npz[names[1]]
    except ConfigError:
        raise
    except (zipfile.BadZipFile, EOFError, OSError, ValueError) as exc:  # numpy refuses object arrays (ValueError) without allow_pickle
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        what = "holds object arrays, which are never unpickled" if "Object arrays" in why else "is a damaged .npz"
        raise ConfigError("--queries", f"{path} {what} ({why})", QUERIES_FIX) from None
