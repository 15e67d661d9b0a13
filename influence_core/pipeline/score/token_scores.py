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
from ..store.loading import load_influence_model, open_data, read_factors, train_batches
from .score_input import ScoringInput
from ..runtime.threads import TASK_THREADS, torch_threads


def token_positions(data: dict[str, Any]) -> int:
    """T of the training inputs' token ids; refused for inputs without token positions."""
    x = data["x_train"]
    ids = x.get("input_ids") if isinstance(x, dict) else x
    if ids is None or len(ids.shape) != 2 or np.dtype(ids.dtype).kind not in "iu":
        raise ConfigError("aggregate.token_scores", "the training inputs are not (n, T) integer token ids", "switch aggregate.token_scores off for data without tokens")
    return int(ids.shape[1])


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
