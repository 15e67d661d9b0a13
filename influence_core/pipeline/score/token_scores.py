"""Per-token scores of each query's top-k helpful and harmful training rows, (n_test, k, T) each: one extra gradient
pass over only the union of those rows (never the whole training set), each contracted before the sum over positions
with the factors of the queries it is shown for alone (`Scorer.entries`; an ensemble: the members' mean)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ... import examples
from ...errors import ConfigError
from ...methods.scorer import Scorer
from ..model.models import build_model
from ..specs import MethodSpec, ModelSpec
from ..store.loading import load_influence_model, open_data, read_factors, train_batches
from ..store.refs import DataRef
from .score_input import ScoringInput
from ..runtime.threads import TASK_THREADS, torch_threads


def token_positions(data: dict[str, Any]) -> int:
    """T of the training inputs' token ids; refused for inputs without token positions."""
    x = data["x_train"]
    ids = x.get("input_ids") if isinstance(x, dict) else x
    if ids is None or len(ids.shape) != 2 or np.dtype(ids.dtype).kind not in "iu":
        raise ConfigError("aggregate.token_scores", "the training inputs are not (n, T) integer token ids", "switch aggregate.token_scores off for data without tokens")
    return int(ids.shape[1])


def check_token_scores(method: MethodSpec, model: ModelSpec, data: DataRef, arrays: dict[str, Any]) -> None:
    """Before training, for a run with aggregate.token_scores (a language model's: RunParameters checks the task): the
    inputs are token ids, and the method around the untrained model attributes only parameters whose gradients the
    contraction splits by position (`Scorer`'s per-token scores), each layer at every token: else `method.modules`
    is named, with the layers that would do."""
    positions = token_positions(arrays)
    im = method.build(build_model(model, data), model.make_task())
    split = im.gradient_split(examples.read(arrays["x_train"], slice(0, 8)), examples.read(arrays["y_train"], slice(0, 8)))
    everywhere = [cut.name for cut in split.cuts if split.positions.get(cut.name, positions) == positions]  # an embedding's capture is its ids, one per token
    shown = ", ".join(everywhere[:8]) + (", ..." if len(everywhere) > 8 else "")
    fix = f"set method.modules to layers applied at every token (Linear, Conv1D, Embedding): [{shown}], or use method.name: kfac or ekfac, which track only Linear layers"
    vmapped = [] if split.rest is None else split.rest.space.names
    if vmapped:
        shown = ", ".join(vmapped[:4]) + (", ..." if len(vmapped) > 4 else "")
        raise ConfigError("method.modules", f"per-token scores split each parameter's gradient by token position, but {shown} take per-example gradients by vmap, which keep no positions (position embeddings of arange(T), norms)", fix)
    fewer = {name: t for name, t in split.positions.items() if t != positions}
    if fewer:
        raise ConfigError("method.modules", f"per-token scores split each layer's gradient over the T={positions} token positions, but layers {fewer} run at other numbers of positions (pooled, or applied once)", fix)


def topk_token_scores(stage: ScoringInput, helpful: np.ndarray, harmful: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-token scores (n_test, k, T) float32 of the rows `helpful` and `harmful` (n_test, k) name, for their own
    query; each row sums over T to that query's score. The rows' union is captured once (`Scorer.entries`)."""
    options = stage.store.options
    arrays = open_data(stage.data, options)
    positions = token_positions(arrays)
    n_test, k = helpful.shape
    union, where = np.unique(np.concatenate([helpful, harmful], axis=1), return_inverse=True)
    x, y = examples.read(arrays["x_train"], union), examples.read(arrays["y_train"], union)
    queries = torch.arange(n_test).repeat_interleave(2 * k)
    total = None
    with torch_threads(TASK_THREADS):  # as the chunk tasks scored them
        train = train_batches(stage.data, options, stage.method.batch_size)
        for member in stage.members:
            im = load_influence_model(stage.method, member.model, stage.data, member.preconditioner, options, stage.compute.torch_device, train)
            factors = read_factors(im, member.factors.url, options, arrays["x_train"], arrays["y_train"])
            scores = Scorer(im, factors, None, per_token=True).entries(x, y, queries, torch.from_numpy(where.reshape(-1)))
            total = scores if total is None else total + scores
    assert total is not None
    out = (total / len(stage.members)).detach().cpu().numpy().astype(np.float32).reshape(n_test, 2, k, positions)
    return out[:, 0], out[:, 1]
