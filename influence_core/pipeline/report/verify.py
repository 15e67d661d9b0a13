"""Integrity of a finished run: the output layout's arrays are there with the right shapes, complete, and the
aggregates agree with the scores they were computed from. Streams over the scores; usable without the CLI."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import dask
import dask.array as da
import numpy as np
import zarr

from ..store import damage, storage
from ..store.binding import check_stages
from ..store.publish import read_attrs, stored_refs, with_recorded_cache
from ..store.run_store import RunStore
from ...errors import ConfigError

RTOL = 1e-5  # float32 scores: stored aggregates may differ from a recomputation by a few ulps
TOKEN_RTOL = 1e-4  # per-token scores, recomputed in float32 and summed in another order: of Σ_t |token score|


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


def expected_arrays(n_test: int, n_train: int, k: int, knn_k: int | None = None, reranked: int | None = None) -> dict[str, tuple[tuple[int, ...], str]]:
    """The output layout of DESIGN.md: name -> (shape, dtype); self_influence is optional. With FastIF's candidates
    (knn_k), candidate_indices and candidate_scores replace scores, and there is no self_influence. Re-ranked over a
    compressed index, reranked_indices and reranked_scores (`reranked` a query) sit beside the scores."""
    scores: dict[str, tuple[tuple[int, ...], str]] = (
        {"scores": ((n_test, n_train), "float32")} if knn_k is None else {"candidate_indices": ((n_test, knn_k), "int64"), "candidate_scores": ((n_test, knn_k), "float32")}
    )
    if reranked is not None:
        scores |= {"reranked_indices": ((n_test, reranked), "int64"), "reranked_scores": ((n_test, reranked), "float32")}
    return {
        **scores,
        "topk_helpful_indices": ((n_test, k), "int64"),
        "topk_helpful_scores": ((n_test, k), "float32"),
        "topk_harmful_indices": ((n_test, k), "int64"),
        "topk_harmful_scores": ((n_test, k), "float32"),
        "argmax": ((n_test,), "int64"),
        "train_totals": ((n_train,), "float32"),
        **({"self_influence": ((n_train,), "float32")} if knn_k is None else {}),
    }


def verify_run(store: RunStore) -> list[Check]:
    """Every check of the run at `store`; the run is sound when all pass."""
    damaged = damage.damaged_nodes(store.influence_url, store.options)
    if damaged:
        return [Check("metadata", False, damage.describe(store.influence_url, damaged)), _summary(store)]
    try:
        group = storage.open_group(store.influence_url, store.options, mode="r")
    except FileNotFoundError:
        return [Check("influence.zarr", False, f"no influence.zarr under {store.output_url!r}")]
    attrs = dict(group.attrs)
    status = attrs.get("status")
    checks = [Check("status", status == "complete", f"status={status!r}")]
    missing = [name for name in ("schema_version", "config", "fingerprints", "refs") if name not in attrs]
    checks.append(Check("attributes", not missing, f"missing {missing}" if missing else "schema_version, config, fingerprints, refs"))
    checks.append(_summary(store))
    try:
        data = attrs["refs"]["prepare_data"]["arrays"]
        n_test, n_train, k = data["y_test"]["shape"][0], data["y_train"]["shape"][0], attrs["config"]["aggregate"]["top_k"]
        config = attrs["config"]
        switched_off = config["aggregate"].get("self_influence") == "off" or config.get("method", {}).get("name") == "magic"  # magic computes none
        optional = {"self_influence"} if switched_off else set()
        knn_k = (config.get("candidates") or {}).get("knn_k")
        reranked = attrs["refs"]["rerank"]["shape"][1] if "rerank" in attrs["refs"] else None
    except (KeyError, TypeError, IndexError):
        return [*checks, Check("layout", False, "the attributes do not say n_test, n_train and top_k: cannot check shapes")]
    arrays: dict[str, zarr.Array] = {}
    for name, (shape, dtype) in expected_arrays(n_test, n_train, k, knn_k, reranked).items():
        node = group.get(name)
        if node is None:
            checks.append(Check(name, name in optional, "absent (switched off)" if name in optional else "missing"))
            continue
        found = (tuple(node.shape), str(node.dtype))
        ok = isinstance(node, zarr.Array) and found == (shape, dtype)
        checks.append(Check(name, ok, f"{found[0]} {found[1]}" if ok else f"{found[0]} {found[1]}, expected {shape} {dtype}"))
        if ok:
            arrays[name] = node
    checks.append(_fingerprints(attrs, arrays))
    checks += _stages(store, attrs)
    checks += [_token_sums(group, kind, arrays) for kind in ("helpful", "harmful") if f"topk_{kind}_token_scores" in group]
    if knn_k is not None:
        if not {"candidate_indices", "candidate_scores"} <= set(arrays):
            return [*checks, Check("aggregates", False, "no valid candidate arrays to check them against")]
        return [*checks, *_against_candidates(arrays, k, n_train)]
    if "scores" not in arrays or (reranked is not None and not {"reranked_indices", "reranked_scores"} <= set(arrays)):
        return [*checks, Check("aggregates", False, "no valid scores (or re-ranked candidates) to check them against")]
    return [*checks, *_against_scores(arrays, k, reranked is not None)]


def _stages(store: RunStore, attrs: dict[str, Any]) -> list[Check]:
    """Every stage the run recorded: complete, each byte of its output hashed again and equal to its manifest's record,
    and made from the run's other stages (`binding.check_stages`)."""
    store = with_recorded_cache(store, attrs)
    try:
        refs = stored_refs(store, attrs)
    except (KeyError, TypeError, ValueError):
        return [Check("stages", False, "the attributes' refs cannot be read")]
    return [Check(f"stage {name}", not wrong, wrong[0] if wrong else "complete; every object hashed again, as recorded") for name, wrong in check_stages(store, refs, list(refs), deep=True).items()]


ANSWER_ATTRIBUTES = ("schema_version", "run", "run_fingerprint", "queries", "top_k", "n_train")
ANSWER_ARRAYS = ("topk_helpful_indices", "topk_helpful_scores", "topk_harmful_indices", "topk_harmful_scores", "argmax")  # of a run's layout; and query_labels


def verify_answer(store: RunStore) -> list[Check]:
    """Every check of a question's answer at `store` (`query --output-url`, the question flow; `is_answer`): status,
    its attributes, each array of its layout with its shape and dtype, the top-k tables (indices distinct, within
    the run's training rows, scores finite and sorted), argmax = topk_helpful_indices[:, 0], and the run it names:
    still there, complete, and the run it asked (the same run fingerprint)."""
    group = storage.open_group(store.influence_url, store.options, mode="r")
    attrs = dict(group.attrs)
    checks = [Check("status", attrs.get("status") == "complete", f"status={attrs.get('status')!r}")]
    missing = [name for name in ANSWER_ATTRIBUTES if name not in attrs]
    checks.append(Check("attributes", not missing, f"missing {missing}" if missing else f"kind answer, schema_version {attrs['schema_version']}, {', '.join(ANSWER_ATTRIBUTES[1:])}"))
    checks.append(_asked_run(store, attrs))
    labels = group.get("query_labels")
    if missing or not isinstance(labels, zarr.Array) or not labels.shape:
        return [*checks, Check("layout", False, "no query_labels or attributes to say n_queries, top_k and n_train: cannot check shapes")]
    n, k, n_train = labels.shape[0], attrs["top_k"], attrs["n_train"]
    arrays = {}
    layout = {name: spec for name, spec in expected_arrays(n, n_train, k).items() if name in ANSWER_ARRAYS}
    for name, (shape, dtype) in {**layout, "query_labels": ((n, *labels.shape[1:]), str(labels.dtype))}.items():
        node = group.get(name)
        found = None if node is None else (tuple(node.shape), str(node.dtype))
        ok = isinstance(node, zarr.Array) and found == (shape, dtype)
        checks.append(Check(name, ok, "missing" if found is None else f"{found[0]} {found[1]}" + ("" if ok else f", expected {shape} {dtype}")))
        if ok:
            arrays[name] = np.asarray(node[...])
    for kind, order in (("helpful", -1), ("harmful", 1)):
        indices, values = arrays.get(f"topk_{kind}_indices"), arrays.get(f"topk_{kind}_scores")
        if indices is not None and values is not None:
            wrong = "scores hold NaN or inf" if not np.isfinite(values).all() else _topk_form(indices, values, n_train, order, 0.0)
            checks.append(Check(f"top-k {kind}", wrong is None, wrong or f"{k} per query: distinct, within the run's {n_train} training examples, sorted"))
    if "argmax" in arrays and "topk_helpful_indices" in arrays:
        differs = np.flatnonzero(arrays["argmax"] != arrays["topk_helpful_indices"][:, 0])
        detail = f"query {differs[0]}: argmax {arrays['argmax'][differs[0]]} but topk_helpful_indices[:, 0] is {arrays['topk_helpful_indices'][differs[0], 0]}" if differs.size else "= topk_helpful_indices[:, 0]"
        checks.append(Check("argmax", not differs.size, detail))
    return checks


def _asked_run(store: RunStore, attrs: dict[str, Any]) -> Check:
    """The run an answer names is there, complete, and the one it asked: its run fingerprint is the recorded one."""
    url = attrs.get("run")
    if not isinstance(url, str):
        return Check("run", False, "the answer names no run")
    try:
        found = read_attrs(RunStore(output_url=url, storage=store.storage), "run").get("run_fingerprint")
    except ConfigError as exc:
        return Check("run", False, exc.problem)
    same = found == attrs.get("run_fingerprint")
    return Check("run", same, f"{url}: complete, the run asked" if same else f"{url} now holds another run (run fingerprint {found}, the answer's {attrs.get('run_fingerprint')})")


def _token_sums(group: zarr.Group, kind: str, arrays: dict[str, zarr.Array]) -> Check:
    """Each top-k row's per-token scores sum to its sequence score (float32: within TOKEN_RTOL of Σ_t |s_t|)."""
    name, scores = f"topk_{kind}_token_scores", arrays.get(f"topk_{kind}_scores")
    tokens = group[name]
    if scores is None or tuple(tokens.shape[:2]) != tuple(scores.shape) or str(tokens.dtype) != "float32":
        return Check(name, False, f"{tuple(tokens.shape)} {tokens.dtype}, expected (n_test, k, T) float32 beside topk_{kind}_scores")
    values, expected = np.asarray(tokens[...], dtype=np.float64), np.asarray(scores[...], dtype=np.float64)
    error = np.abs(values.sum(2) - expected)
    bad = np.argwhere(~(error <= TOKEN_RTOL * np.abs(values).sum(2) + RTOL * np.abs(expected) + np.finfo(np.float32).tiny))
    if bad.size:
        q, j = bad[0]
        return Check(name, False, f"query {q}, rank {j}: tokens sum to {values[q, j].sum():.6g}, score {expected[q, j]:.6g} ({len(bad)} rows differ)")
    return Check(name, True, f"{tuple(tokens.shape)}: every row sums to its score (worst {error.max(initial=0):.2g})")


def _summary(store: RunStore) -> Check:
    try:
        summary = storage.read_json(store.url("summary.json"), store.options)
    except FileNotFoundError:
        return Check("summary.json", False, "missing")
    except ValueError as exc:
        return Check("summary.json", False, f"damaged ({str(exc).splitlines()[0][:160]})")
    if not isinstance(summary, dict):
        return Check("summary.json", False, "damaged (not a JSON object)")
    return Check("summary.json", summary.get("status") == "complete", f"status={summary.get('status')!r}")


def _fingerprints(attrs: dict[str, Any], arrays: dict[str, zarr.Array]) -> Check:
    """Scores and aggregates carry the fingerprints of the stage runs the attributes name (not a stale run's)."""
    refs = attrs.get("refs", {})
    stale = []
    for stage, names in (("compute_influences", ("scores", "candidate_scores", "candidate_indices")), ("rerank", ("reranked_scores", "reranked_indices")), ("aggregate", ("train_totals", "argmax", "topk_helpful_indices", "topk_harmful_indices"))):
        wanted = refs.get(stage, {}).get("fingerprint")
        stale += [name for name in names if name in arrays and arrays[name].attrs.get("fingerprint") != wanted]
    return Check("fingerprints", not stale, f"do not match the recorded stages: {stale}" if stale else "match the recorded stages")


def _against_scores(arrays: dict[str, zarr.Array], k: int, reranked: bool = False) -> list[Check]:
    """Recompute, in one streamed pass, what the aggregates summarise, and compare; `reranked`: the top-k and argmax
    against the re-ranked candidates' exact scores, the totals against the scores."""
    scores = arrays["scores"]
    columns = (scores.shards or scores.chunks)[1]
    s = da.from_zarr(scores, chunks=(scores.shape[0], columns))
    with dask.config.set(scheduler="threads"):
        nonfinite, top, bottom, totals, magnitudes = dask.compute(
            (~da.isfinite(s)).sum(), da.topk(s, k, axis=1), da.topk(s, -k, axis=1), s.sum(axis=0, dtype=np.float64), abs(s).sum(axis=0, dtype=np.float64)
        )
    checks = [Check("scores complete", int(nonfinite) == 0, f"{int(nonfinite)} NaN or inf of {scores.size}")]
    if nonfinite:
        return [*checks, Check("aggregates", False, "not checked: the scores are incomplete")]
    at = lambda rows, cols: np.asarray(scores.vindex[rows, cols])  # noqa: E731
    if reranked:
        checks.append(_candidate_form(np.asarray(arrays["reranked_indices"][...]), np.asarray(arrays["reranked_scores"][...]), scores.shape[1], "re-ranked"))
        at, top, bottom = _candidate_reference(np.asarray(arrays["reranked_indices"][...]), np.asarray(arrays["reranked_scores"][...]), scores.shape[1], k)
    checks += _aggregate_checks(arrays, at, scores.shape[1], top, bottom, totals, magnitudes, "scores.sum(axis=0)")
    if "self_influence" in arrays:
        values = np.asarray(arrays["self_influence"][...])
        bad = np.flatnonzero(~np.isfinite(values))
        checks.append(Check("self_influence finite", not bad.size, f"all {values.size} finite" if not bad.size else f"{bad.size} NaN or inf, first at {bad[0]}"))
    return checks


def _against_candidates(arrays: dict[str, zarr.Array], k: int, n_train: int) -> list[Check]:
    """The same checks on FastIF's layout: the aggregates against each query's candidates (in memory: (n_test, k))."""
    indices, scores = np.asarray(arrays["candidate_indices"][...]), np.asarray(arrays["candidate_scores"][...])
    checks = [_candidate_form(indices, scores, n_train, "candidate")]
    nonfinite = int((~np.isfinite(scores)).sum())
    checks.append(Check("scores complete", nonfinite == 0, f"{nonfinite} NaN or inf of {scores.size} candidate scores"))
    if nonfinite or not checks[0].ok:
        return [*checks, Check("aggregates", False, "not checked: the candidates are invalid or incomplete")]
    at, top, bottom = _candidate_reference(indices, scores, n_train, k)
    totals = np.bincount(indices.ravel(), weights=scores.ravel().astype(np.float64), minlength=n_train)
    magnitudes = np.bincount(indices.ravel(), weights=np.abs(scores.ravel().astype(np.float64)), minlength=n_train)
    return [*checks, *_aggregate_checks(arrays, at, n_train, top, bottom, totals, magnitudes, "the sum over its candidate entries")]


def _candidate_form(indices: np.ndarray, scores: np.ndarray, n_train: int, kind: str) -> Check:
    """Each query's candidates are distinct training rows, with finite scores."""
    repeated = [q for q, row in enumerate(indices) if len(np.unique(row)) != len(row)]
    valid = indices.size == 0 or (indices.min() >= 0 and indices.max() < n_train)
    detail = f"indices outside [0, {n_train})" if not valid else f"query {repeated[0]} lists a training example twice" if repeated else f"{indices.shape[1]} distinct per query, in range"
    return Check(f"{kind} indices", valid and not repeated, detail)


def _candidate_reference(indices: np.ndarray, scores: np.ndarray, n_train: int, k: int) -> tuple[Callable[[np.ndarray, np.ndarray], np.ndarray], np.ndarray, np.ndarray]:
    """What the top-k of each query's candidates must be: a reader of the candidates' scores (NaN off them), and
    each row's k largest and k smallest."""
    order = np.argsort(indices, axis=1)
    keys = (np.arange(len(indices))[:, None] * n_train + np.take_along_axis(indices, order, 1)).ravel()  # sorted: one lookup for all
    values = np.take_along_axis(scores, order, 1).ravel()

    def at(rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        wanted = rows * n_train + cols
        position = np.minimum(np.searchsorted(keys, wanted), len(keys) - 1)
        return np.where(keys[position] == wanted, values[position], np.nan)

    return at, -np.sort(-scores, axis=1)[:, :k], np.sort(scores, axis=1)[:, :k]


def _aggregate_checks(
    arrays: dict[str, zarr.Array], at: Callable[[np.ndarray, np.ndarray], np.ndarray], n_train: int, top: np.ndarray, bottom: np.ndarray,
    totals: np.ndarray, magnitudes: np.ndarray, totals_mean: str,
) -> list[Check]:
    """Top-k, argmax and train totals against the reference recomputed from the scores; `at(rows, cols)` reads scores."""
    checks = []
    atol = RTOL * float(max(np.abs(top).max(initial=0), np.abs(bottom).max(initial=0), np.finfo(np.float32).tiny))
    for kind, reference, order in (("helpful", top, -1), ("harmful", bottom, 1)):
        if f"topk_{kind}_indices" in arrays and f"topk_{kind}_scores" in arrays:
            checks.append(Check(f"top-k {kind}", *_topk(at, n_train, arrays[f"topk_{kind}_indices"], arrays[f"topk_{kind}_scores"], reference, order, atol)))
    if "argmax" in arrays and "topk_helpful_indices" in arrays:
        checks.append(Check("argmax", *_argmax(at, n_train, np.asarray(arrays["argmax"][...]), np.asarray(arrays["topk_helpful_indices"][:, 0]), top[:, 0], atol)))
    if "train_totals" in arrays:
        stored = np.asarray(arrays["train_totals"][...], dtype=np.float64)
        bad = np.flatnonzero(~(np.abs(stored - totals) <= RTOL * magnitudes + np.finfo(np.float32).tiny))
        checks.append(Check("train_totals", not bad.size, f"= {totals_mean} for all {stored.size}" if not bad.size else f"column {bad[0]}: stored {stored[bad[0]]:.6g}, scores sum to {totals[bad[0]]:.6g} ({bad.size} differ)"))
    return checks


def _topk(at: Callable[[np.ndarray, np.ndarray], np.ndarray], n_train: int, indices_array: zarr.Array, values_array: zarr.Array, reference: np.ndarray, order: int, atol: float) -> tuple[bool, str]:
    """Indices distinct and in range, values sorted, each value the score at its index, and the values those of a
    true top-k. Ties may be broken either way: only the values of the set are compared, not which tied index."""
    indices, values = np.asarray(indices_array[...]), np.asarray(values_array[...])
    wrong_form = _topk_form(indices, values, n_train, order, atol)
    if wrong_form:
        return False, wrong_form
    at_index = at(np.repeat(np.arange(len(indices)), indices.shape[1]), indices.ravel()).reshape(indices.shape)
    wrong = np.argwhere(~np.isclose(at_index, values, rtol=RTOL, atol=atol))
    if wrong.size:
        q, j = wrong[0]
        return False, f"query {q}, rank {j}: index {indices[q, j]} has score {at_index[q, j]:.6g}, stored {values[q, j]:.6g}"
    wrong = np.argwhere(~np.isclose(values, reference, rtol=RTOL, atol=atol))
    if wrong.size:
        q, j = wrong[0]
        return False, f"query {q}, rank {j}: stored {values[q, j]:.6g}, but the scores' rank-{j} value is {reference[q, j]:.6g}"
    return True, f"{indices.shape[1]} per query agree with the scores"


def _topk_form(indices: np.ndarray, values: np.ndarray, n_train: int, order: int, atol: float) -> str | None:
    """What is wrong with a top-k table on its own (None: nothing): indices out of range or repeated in a row, values
    not sorted (order -1: descending, 1: ascending) beyond `atol`."""
    if indices.min(initial=0) < 0 or indices.max(initial=0) >= n_train:
        return f"indices outside [0, {n_train})"
    repeated = [q for q, row in enumerate(indices) if len(set(row.tolist())) != len(row)]
    if repeated:
        return f"query {repeated[0]} lists a training example twice"
    if (np.diff(values, axis=1) * order < -atol).any():
        return f"scores not sorted {'descending' if order < 0 else 'ascending'}"
    return None


def _argmax(at: Callable[[np.ndarray, np.ndarray], np.ndarray], n_train: int, argmax: np.ndarray, first: np.ndarray, best: np.ndarray, atol: float) -> tuple[bool, str]:
    """argmax equals the first helpful index and points at a maximal score of its row."""
    if argmax.min(initial=0) < 0 or argmax.max(initial=0) >= n_train:
        return False, f"indices outside [0, {n_train})"
    differs = np.flatnonzero(argmax != first)
    if differs.size:
        return False, f"query {differs[0]}: argmax {argmax[differs[0]]} but topk_helpful_indices[:, 0] is {first[differs[0]]}"
    found = at(np.arange(len(argmax)), argmax)
    below = np.flatnonzero(~np.isclose(found, best, rtol=RTOL, atol=atol))
    if below.size:
        return False, f"query {below[0]}: score at argmax {found[below[0]]:.6g} < row maximum {best[below[0]]:.6g}"
    return True, "= topk_helpful_indices[:, 0], at each row's maximum"
