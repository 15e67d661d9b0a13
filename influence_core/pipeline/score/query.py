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
from ...objective import Objective
from ..sources.data import check_block
from . import faiss_search
from .score_reductions import TIE_MARGIN, RunningTopK, read_ahead
from .layout import DIMENSIONS
from ..model.models import check_queries, probe_forward
from ..store.loading import index_projection, load_influence_model, open_data
from ..store.publish import read_attrs, stored_refs, task_decode, with_recorded_cache
from ..store.refs import DataRef, IndexRef, ModelRef
from ..report.report import QueryRow, topk_rows
from ..store.binding import require_stages
from ..store.run_store import RunStore
from ..specs import MethodSpec, ModelSpec, SearchSpec

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


def answer(store: RunStore, x: Any, y: np.ndarray, top_k: int, device: str = "cpu", search: SearchSpec | None = None) -> Answer:
    """The top-k of queries (x, y) against the run at `store`: factors solved from its curvature, scores streamed over
    its training index (or its FAISS index's candidates scored, with `search.kind: faiss`)."""
    search = search or SearchSpec()
    asked = solve(store, x, y, top_k, device)
    if search.kind == "faiss":
        arrays, described = faiss_top_k(asked.index, asked.factors, top_k, search, store.options, asked.work)
        return Answer(arrays, asked.work, asked.config, asked.data, described)
    return Answer(scan_top_k(asked.index, asked.factors, top_k, store.options, asked.work), asked.work, asked.config, asked.data)


@dataclass
class Question:
    """Queries solved against a run: their factors in its index's coordinates, the run's config, index and data, and
    the work so far."""

    factors: torch.Tensor
    config: dict[str, Any]
    index: IndexRef
    data: DataRef
    work: Work


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
    return Question(factors, config, index, data, im.work.copy())


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


def write_answer(url: str, answer: Answer, run_url: str, options: dict[str, Any]) -> None:
    """The answer as a Zarr v3 group of the top-k arrays (the run's output layout), naming the run it asked and how
    the top-k was found."""
    group = storage.open_group(url, options, mode="w")
    for name in TOPK:
        storage.create_array(group, name, data=answer.arrays[name], dimension_names=DIMENSIONS[name])
    storage.create_array(group, "argmax", data=answer.arrays["topk_helpful_indices"][:, 0], dimension_names=DIMENSIONS["argmax"])
    group.attrs.update({"status": "complete", "run": run_url, "work": answer.work.as_dict(), "search": answer.search})


def ask(store: RunStore, queries: str, top_k: int, output: RunStore | None = None, search: SearchSpec | None = None) -> tuple[Answer, list[QueryRow], str]:
    """The whole question: the queries of the .npz file `queries` answered from the run at `store` (by `search`),
    written under `output` when given. Returns the answer, its top-k rows (labels read as the run's task reads them)
    and the method."""
    x, y = query_arrays(queries, store.options)
    found = answer(store, x, y, top_k, search=search)
    config, data = found.config, found.data
    assert data is not None
    if output is not None:
        write_answer(output.influence_url, found, store.output_url, output.options)
    rows = found.rows(open_data(data, store.options)["y_train"], x, y, task_decode(config["model"]), top_k)
    return found, rows, config["method"]["name"]


def query_arrays(path: str, options: dict[str, Any]) -> tuple[Any, np.ndarray]:
    """Queries from an .npz file: x_test and y_test, or x and y (every row a query)."""
    import io

    try:
        with np.load(io.BytesIO(storage.read_bytes(path, options)), allow_pickle=False) as npz:
            names = ("x_test", "y_test") if "x_test" in npz else ("x", "y")
            if not set(names) <= set(npz.files):
                raise ConfigError("--queries", f"{path} holds {sorted(npz.files)}, not x_test and y_test (or x and y)", "save the queries' inputs and labels under those names")
            x, y = npz[names[0]], npz[names[1]]
    except FileNotFoundError:
        raise ConfigError("--queries", f"no file at {path!r}", "give the path of an .npz file of the queries") from None
    return examples.read(x), y
