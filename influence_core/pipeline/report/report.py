"""What people look at: the top-k table per query and a PNG of queries beside their top training examples."""

from __future__ import annotations

import io
import json
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ...task.base import byte_text


@dataclass(frozen=True)
class Neighbour:
    index: int
    label: Any
    score: float
    tokens: tuple[tuple[str, float], ...] = ()  # (text, score) of each token, where the run stored per-token scores


@dataclass(frozen=True)
class QueryRow:
    query: int
    label: Any
    helpful: list[Neighbour]
    harmful: list[Neighbour]

    def first(self, k: int) -> QueryRow:
        """This query with its k most helpful and k most harmful examples."""
        return replace(self, helpful=self.helpful[:k], harmful=self.harmful[:k])


TEXT_CHARS = 48  # decoded text shown per example in the table and the report


Decode = Callable[[list[int]], str]  # token ids to text: the task's `decode` (a tokenizer; byte-level by default)


def decode_bytes(ids: Any, limit: int = TEXT_CHARS, decode: Decode = byte_text) -> str:
    """Text of token ids by `decode` (byte-level by default): unscored ids (negative) dropped, line breaks shown as ⏎,
    other control characters as �, cut to `limit` characters."""
    values = np.asarray(ids).ravel()
    text = printable(decode([int(v) for v in values[values >= 0]]))
    return text if len(text) <= limit else text[: limit - 1] + "…"


def printable(text: str) -> str:
    """Line breaks as ⏎, tabs as spaces, other control characters as �."""
    text = text.replace("\n", "⏎").replace("\t", " ")
    return "".join(c if c.isprintable() or c == " " else "\ufffd" for c in text)


def token_pieces(ids: Any, scores: Any, decode: Decode = byte_text) -> tuple[tuple[str, float], ...]:
    """Each token of a passage (padding, id -1, dropped) as its printable text beside its score."""
    return tuple((printable(decode([int(i)])), float(s)) for i, s in zip(np.asarray(ids).ravel(), np.asarray(scores).ravel()) if i >= 0)


HELPFUL_RGB, HARMFUL_RGB = (0.16, 0.63, 0.17), (0.84, 0.15, 0.16)


def shade(score: float, scale: float) -> tuple[float, float, float]:
    """A token's background: white blended towards green (positive) or red (negative) by |score| / scale."""
    weight = 0.85 * min(1.0, abs(score) / scale) if scale > 0 else 0.0
    target = HELPFUL_RGB if score > 0 else HARMFUL_RGB
    return tuple(1.0 - weight * (1.0 - c) for c in target)  # type: ignore[return-value]


def passage_scale(pieces: tuple[tuple[str, float], ...]) -> float:
    """The largest |token score| of a passage: its strongest token is shaded fully."""
    return max((abs(score) for _, score in pieces), default=0.0)


TABLE_COLUMNS = 12  # features up to this many per example are a table row: the report shows the values


def row_text(features: Any) -> str:
    """A table row as the report shows it: one `column value` line per feature."""
    return "\n".join(f"x{i:<2d} {v:.4g}" for i, v in enumerate(np.asarray(features, dtype=np.float64).ravel()))


def _label(value: Any, decode: Decode = byte_text) -> Any:
    """A class index, a rounded target, or the text of a sequence of token labels."""
    array = np.asarray(value)
    if array.size > 1:
        return decode_bytes(array, decode=decode)
    return int(value) if np.issubdtype(array.dtype, np.integer) else round(float(value), 4)


def prompted_text(ids: Any, labels: Any, decode: Decode = byte_text) -> str:
    """A query of token ids as 'prompt|completion': the completion is the span its labels score (the prompt and any
    padding are unscored); the whole text when every label of a token (not padding, -1) is scored."""
    ids, scored = np.asarray(ids).ravel(), np.flatnonzero(np.asarray(labels).ravel() >= 0)
    if len(scored) in (0, int((ids >= 0).sum())):
        return decode_bytes(ids, decode=decode)
    start, stop = scored[0], scored[-1] + 1
    return decode_bytes(ids[:start], decode=decode) + "|" + decode_bytes(ids[start:stop], decode=decode)


class MaskedIds:
    """Rows of token ids with the positions whose attention_mask is 0 as -1, which decoding drops."""

    def __init__(self, ids: Any, mask: Any) -> None:
        self.ids, self.mask = ids, mask

    def __getitem__(self, rows: Any) -> np.ndarray:
        ids = np.asarray(self.ids[rows])
        return ids if self.mask is None else np.where(np.asarray(self.mask[rows]) == 0, -1, ids)


def example_view(x: Any) -> Any:
    """What the table and the report show of each example: its one input array, or of named fields the token ids
    (padding dropped) when there are input_ids, else the images (pixel_values, or the first field of examples
    shaped (H, W) or (C, H, W)), else the first field."""
    if not isinstance(x, dict):
        return x
    if "input_ids" in x:
        return MaskedIds(x["input_ids"], x.get("attention_mask"))
    if "pixel_values" in x:
        return x["pixel_values"]
    return next((a for a in x.values() if len(a.shape) in (3, 4)), next(iter(x.values())))


def image_of(features: np.ndarray, image_shape: tuple[int, ...] | None) -> np.ndarray | None:
    """An example as imshow draws it: reshaped to the source's image shape, an (H, W) array as is, or (C, H, W)
    with 1, 3 or 4 channels as (H, W) or (H, W, C) scaled to [0, 1]; None when it is no image."""
    if image_shape:
        return features.reshape(image_shape)
    if features.ndim == 2:
        return features
    if features.ndim != 3 or features.shape[0] not in (1, 3, 4) or min(features.shape[1:]) < 2:
        return None
    if features.shape[0] == 1:
        return features[0]
    low, high = float(features.min()), float(features.max())
    return np.moveaxis((features - low) / (high - low if high > low else 1.0), 0, -1)


def topk_rows(group: Any, y_train: Any, y_test: Any, n_queries: int, n_show: int = 3, x_test: Any = None, decode: Decode = byte_text, x_train: Any = None) -> list[QueryRow]:
    """The first `n_queries` queries with their `n_show` most helpful and most harmful training examples; with
    sequence labels (language modelling) a query reads as its 'prompt|completion' text from `x_test`, token ids
    decoded by `decode`; with `x_train` (token ids) and stored per-token scores, each example's tokens and scores."""
    n = min(n_queries, y_test.shape[0])
    names = ["topk_helpful_indices", "topk_helpful_scores", "topk_harmful_indices", "topk_harmful_scores"]
    tokens = x_train is not None and "topk_helpful_token_scores" in group
    names += ["topk_helpful_token_scores", "topk_harmful_token_scores"] if tokens else []
    arrays = {name: np.asarray(group[name][:n, :n_show]) for name in names}
    needed = np.unique(np.concatenate([arrays["topk_helpful_indices"].ravel(), arrays["topk_harmful_indices"].ravel()]))
    train_labels = dict(zip(needed.tolist(), np.asarray(y_train[needed])))
    train_ids = dict(zip(needed.tolist(), np.asarray(x_train[needed]))) if tokens else {}
    test_labels = np.asarray(y_test[:n])

    def neighbours(kind: str, q: int) -> list[Neighbour]:
        idx, val = arrays[f"topk_{kind}_indices"][q], arrays[f"topk_{kind}_scores"][q]
        pieces = [token_pieces(train_ids[int(i)], arrays[f"topk_{kind}_token_scores"][q, j], decode) if tokens else () for j, i in enumerate(idx)]
        return [Neighbour(int(i), _label(train_labels[int(i)], decode), float(s), p) for i, s, p in zip(idx, val, pieces)]

    if test_labels.ndim > 1 and x_test is not None:
        queries = np.asarray(x_test[:n])
        labels = [prompted_text(queries[q], test_labels[q], decode) for q in range(n)]
    else:
        labels = [_label(value, decode) for value in test_labels]
    return [QueryRow(q, labels[q], neighbours("helpful", q), neighbours("harmful", q)) for q in range(n)]


def report_figure(
    rows: list[QueryRow], x_test: Any, x_train: Any, image_shape: tuple[int, ...] | None, heading: str, note: str | None = None, text: bool = False, decode: Decode = byte_text
) -> Any:
    """The report's matplotlib figure: one line per query: the query, then every most helpful and most harmful
    training example the rows hold, under `heading` (the method) and `note` (the run's LDS, when validated).

    Images are drawn when the data are images, the decoded text when the features are token ids (`text`);
    otherwise each example's first features are plotted. A constrained layout keeps the title clear of the first row.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n_show = len(rows[0].helpful) if rows else 0
    cols = 1 + 2 * n_show
    fig, axes = plt.subplots(len(rows), cols, figsize=(1.6 * cols, 1.8 * len(rows) + 0.6), squeeze=False, layout="constrained")
    for r, row in enumerate(rows):
        cells = [("query", row.query, row.label, None, x_test)]
        cells += [("helpful", n.index, n.label, n.score, x_train) for n in row.helpful]
        cells += [("harmful", n.index, n.label, n.score, x_train) for n in row.harmful]
        for c, (kind, index, label, score, source) in enumerate(cells):
            ax = axes[r, c]
            ax.set_xticks([])
            ax.set_yticks([])
            colour = {"query": "black", "helpful": "tab:green", "harmful": "tab:red"}[kind]
            features = np.asarray(source[index])
            neighbour = row.helpful[c - 1] if 0 < c <= n_show else row.harmful[c - 1 - n_show] if c > n_show else None
            if neighbour is not None and neighbour.tokens:  # each token on a background shaded by its score
                _draw_tokens(ax, neighbour.tokens)
            elif text:  # a query reads 'prompt|completion' (its label), a training example its whole window
                shown_text = label if kind == "query" and isinstance(label, str) else decode_bytes(features, 4 * TEXT_CHARS, decode)
                ax.text(0.03, 0.97, "\n".join(textwrap.wrap(shown_text, 18, replace_whitespace=False)[:8]), fontsize=5.5, family="monospace", va="top", transform=ax.transAxes)
            elif (image := image_of(features, image_shape)) is not None:
                ax.imshow(image, cmap="gray_r")
            elif features.size <= TABLE_COLUMNS:  # a table row: its values
                ax.text(0.03, 0.97, row_text(features), fontsize=5.5, family="monospace", va="top", transform=ax.transAxes)
            else:
                ax.plot(features.ravel()[:64], color=colour, linewidth=0.8)
            shown = "" if isinstance(label, str) else f"\ny={label}"  # a text label: the cell already shows it
            title = f"{kind} #{index}{shown}" + ("" if score is None else f"\ns={score:.3g}" if text else f" s={score:.3g}")
            ax.set_title(title, fontsize=7, color=colour)
            for spine in ax.spines.values():
                spine.set_edgecolor(colour)
    lines = [heading, "Queries (left), most helpful (green) and most harmful (red) training examples", *([] if note is None else [note])]
    if any(n.tokens for row in rows for n in row.helpful + row.harmful):
        lines.insert(2, "each token shaded by its score: green raised the query's completion, red lowered it (strongest token of each passage fully shaded)")
    fig.suptitle("\n".join(lines), fontsize=9)
    return fig


def render_report(rows: list[QueryRow], x_test: Any, x_train: Any, image_shape: tuple[int, ...] | None, heading: str, note: str | None = None, text: bool = False, decode: Decode = byte_text) -> bytes:
    """report.png (see `report_figure`); its PNG Title is the heading."""
    import matplotlib.pyplot as plt

    fig = report_figure(rows, x_test, x_train, image_shape, heading, note, text, decode)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, metadata={"Title": heading})
    plt.close(fig)
    return buffer.getvalue()


TOKEN_COLUMNS, TOKEN_LINES = 16, 8  # a passage's grid of characters in its cell


def _draw_tokens(ax: Any, pieces: tuple[tuple[str, float], ...]) -> None:
    """A passage as a grid of characters, each on its token's shade (`shade`), wrapped at TOKEN_COLUMNS."""
    from matplotlib.patches import Rectangle

    scale, cells = passage_scale(pieces), [(char, score) for text, score in pieces for char in text]
    lines = min(TOKEN_LINES, -(-len(cells) // TOKEN_COLUMNS))
    width, height = 1 / TOKEN_COLUMNS, 1 / max(lines, 4)
    for k, (char, score) in enumerate(cells[: lines * TOKEN_COLUMNS]):
        x, y = (k % TOKEN_COLUMNS) * width, 1 - (k // TOKEN_COLUMNS + 1) * height
        ax.add_patch(Rectangle((x, y), width, height, facecolor=shade(score, scale), edgecolor="none", transform=ax.transAxes))
        ax.text(x + width / 2, y + height / 2, char, ha="center", va="center", fontsize=8, family="monospace", transform=ax.transAxes)


def lds_line(validation: dict[str, Any]) -> str:
    """The run's LDS in one line, as the report, the summary and the CLI show it."""
    mean, stderr = validation["lds_mean"], validation["lds_stderr"]
    value = "undefined (no query's measurement varied)" if mean is None else f"{mean:.3f}" + ("" if stderr is None else f" ± {stderr:.3f}")
    return f"LDS {value} over {validation['subsets']} retrainings on {validation['fraction']:.0%} subsets, {validation['queries']} queries"


def validation_markdown(validation: dict[str, Any]) -> str:
    """The LDS with its per-query values, for the Prefect artifact."""
    rows = [f"| {q} | {'—' if v is None else f'{v:.3f}'} |" for q, v in enumerate(validation["lds_per_query"])]
    return "\n".join([f"# {lds_line(validation)}", "", "| query | LDS (Spearman over retrainings) |", "|---|---|", *rows])


def _cell(n: Neighbour) -> str:
    return f"#{n.index} (y={n.label}) {n.score:+.3g}"


def table_records(rows: list[QueryRow]) -> list[dict[str, Any]]:
    """Flat records of the top-k table, one per query, for artifacts and CSV-like views."""
    return [
        {
            "query": row.query,
            "label": row.label,
            **{f"helpful_{i + 1}": _cell(n) for i, n in enumerate(row.helpful)},
            **{f"harmful_{i + 1}": _cell(n) for i, n in enumerate(row.harmful)},
        }
        for row in rows
    ]


def stage_note(stage: dict[str, Any]) -> str:
    """What a stage's outcome says beyond its time: the model's losses and accuracies (fit_model), a compressed
    index's side and probe check, what re-ranking scored, and for a stage not computed by this run, what computing
    it cost when it was."""
    metrics = stage.get("metrics", {})
    shown = [f"{name.replace('_', ' ')} {value:.1%}" if name.endswith("accuracy") else f"{name.replace('_', ' ')} {value:.4g}" for name, value in metrics.items()]
    earlier = [] if stage["outcome"] == "computed" else [f"computed earlier in {stage['seconds']:.2f} s"]
    return ", ".join(shown + _index_notes(stage) + _rerank_notes(stage) + earlier)


def _index_notes(stage: dict[str, Any]) -> list[str]:
    """A compressed index's side and share of the exact dimensions, and its probe check (recall@10, Pearson, cost)."""
    if stage.get("compression") != "logra":
        return []
    kept = stage["dim"] / stage["exact_dim"] if stage.get("exact_dim") else None
    notes = [f"compressed at side {stage['side']}" + (f" ({kept:.1%} of the exact dimensions, {stage['total_bytes'] / 1e6:,.0f} MB)" if kept else "")]
    probe = stage.get("probe") or {}
    if probe:
        recall = probe["recall_at_10"]
        share = f", {probe['share']:.0%} of the pass" if probe.get("share") is not None else ""
        below = f" BELOW {probe['floor']}: see the warning" if "warning" in probe else ""
        notes.append(f"probe of {probe['rows']} rows: recall@10 {recall['helpful']:.2f} helpful / {recall['harmful']:.2f} harmful, Pearson {probe['pearson']:.3f}{below} ({probe['seconds']:.2f} s{share})")
    return notes


def _rerank_notes(stage: dict[str, Any]) -> list[str]:
    """What re-ranking scored exactly: candidates a side, their rows' gradients."""
    candidates = stage.get("candidates") or {}
    if "per_side" not in candidates:
        return []
    return [f"{candidates['per_side']} candidates a side re-scored exactly: {candidates['rows']:,} training rows' gradients, {candidates['entries']:,} scores"]


def summary_markdown(summary: dict[str, Any]) -> str:
    """The run summary as markdown: outputs, stage outcomes, what each cost this run, the model's losses and
    accuracies, the run's wall time, configuration."""
    lines = [
        "# Influence run",
        f"- status: **{summary['status']}**",
        f"- scores and aggregates: `{summary['influence']}`",
        f"- report: `{summary['report']}`",
        f"- {summary['n_test']} queries x {summary['n_train']} training examples",
        f"- task: {summary['task']}",
        *[f"- parameters {kind}: {group['tensors']} tensors, {group['elements']:,} elements" for kind, group in summary.get("parameters", {}).items()],
        *([f"- {lds_line(summary['validation'])}"] if "validation" in summary else []),
        *([f"- from the compressed training index: {', '.join(summary['exactness']['from_compressed_index'])}; exact: {', '.join(summary['exactness']['exact'])}"] if summary.get("exactness", {}).get("from_compressed_index") else []),
        "",
        "| stage | outcome | seconds this run | notes |",
        "|---|---|---|---|",
    ]
    lines += [f"| {name} | {s['outcome']} | {s['wall_seconds']:.2f} | {stage_note(s)} |" for name, s in summary["stages"].items()]
    lines += [f"| **whole run** | wall time | {summary['wall_seconds']:.2f} | from the flow's start to its summary |"]
    lines += ["", "## Configuration", "```json", json.dumps(summary["config"], indent=2, sort_keys=True), "```"]
    return "\n".join(lines)
