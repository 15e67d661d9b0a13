"""Scores of training examples against fixed query factors, and their self-influences, batch by batch.

Each batch is captured once; scores and self-influences come from the same captures. Methods that contract
(features = the gradient or its rotation) never form per-sample gradients; the others form their small features.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

import torch

from .. import examples
from ..contraction import Batch, GradientSplit, RowOrder, Rows, contract, factor_rows, weighted_squares
from ..projection import Projector
from ..self_influence import Diagonal, SelfInfluencePlan, Sketch, Solve
from ..work import Work

DENSE_SHARE = 4  # `entries`: a batch whose entries fill this share of its (query, example) pairs scores them all at once


class ScoredModel(Protocol):
    """What the scorer needs of a fitted influence model (`InfluenceFunctionModel` has it): declared here, so the
    scorer depends on an interface and the model on the scorer, not both on each other."""

    batch_size: int
    projector: Projector | None
    row_order: RowOrder
    query_rank: int | None
    _split: GradientSplit | None

    @property
    def work(self) -> Work: ...

    def _require_fitted(self) -> None: ...

    def gradient_batch(self, x: torch.Tensor, y: torch.Tensor, measure: bool = False, in_basis: bool = True) -> Batch: ...

    def to_basis(self, batch: Batch) -> Batch: ...

    def rows_as_captured(self, rows: Rows, batch: Batch, n: int) -> Rows | None: ...

    def contracts(self) -> bool: ...

    def batch_features(self, batch: Batch) -> torch.Tensor: ...

    def check_per_token(self) -> None: ...

    def token_features(self, batch: Batch) -> torch.Tensor: ...

    def projected_token_rows(self, factors: torch.Tensor) -> Rows: ...

    def block_norms(self, batch: Batch, features: torch.Tensor | None) -> torch.Tensor: ...

    def precondition(self, features: torch.Tensor) -> torch.Tensor: ...


class Scorer:
    """Callable on (x, y): (scores (n_queries, n), or (n_queries, n, T) per training token with `per_token`, or None
    without factors; self-influences (n,) or None when off)."""

    def __init__(self, im: ScoredModel, factors: torch.Tensor | Rows | None, plan: SelfInfluencePlan, per_token: bool = False) -> None:
        """`factors`: flat (n_queries, p') as `influence_factors` returns them, or (for methods that contract) already
        as per-layer rows. `per_token` scores have no self-influence beside them (`plan` None)."""
        im._require_fitted()
        assert not (per_token and plan is not None), "per-token scores come without self-influence"
        self.im, self.plan, self.per_token = im, plan, per_token
        self.scoring = factors is not None
        self.factors = factors if isinstance(factors, torch.Tensor) else None
        self._rows: Rows | None = factors if isinstance(factors, Rows) else None
        self._sketch_rows: Rows | None = None
        # scores alone, from a method that rotates its captures: the query rows may go back to the captures' basis
        # once instead; decided at the first batch (None until then), when the rows and the positions are known
        self.as_captured: bool | None = None if plan is None and self.scoring and im.contracts() else False

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        scores, values = [], []
        for batch in self._batches(x, y):
            s, v = self.batch(batch)
            scores.append(s)
            values.append(v)
        return (torch.cat(scores, dim=1) if self.scoring else None), (None if self.plan is None else torch.cat(values))

    def entries(self, x: torch.Tensor, y: torch.Tensor, queries: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Scores of chosen (query, example) entries only: query queries[e]'s factor against example rows[e] of (x, y),
        (E,), or per training token (E, T). Each example is captured once, in the method's basis, and each query
        meets only its own examples: one contraction per query and batch, so the work follows the entries, not
        queries × examples; a batch whose entries fill at least 1/DENSE_SHARE of its (query, example) pairs is
        scored against all its queries at once, then picked."""
        out: torch.Tensor | None = None
        for lo in range(0, examples.count(x), self.im.batch_size):
            inside = torch.nonzero((rows >= lo) & (rows < lo + self.im.batch_size)).flatten()
            if len(inside):
                batch = self.im.gradient_batch(examples.take(x, slice(lo, lo + self.im.batch_size)), y[lo : lo + self.im.batch_size])
                values = self._batch_entries(batch, queries[inside], rows[inside] - lo)
                out = values.new_zeros(len(queries), *values.shape[1:]) if out is None else out
                out[inside] = values
        assert out is not None, "no entries to score"
        return out

    def _batch_entries(self, batch: Batch, queries: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """`entries` of one captured batch (rows: its positions): every query of the batch at once when its entries
        fill 1/DENSE_SHARE of the pairs, else each query against its own examples."""
        asked = torch.unique(queries)
        if not self.per_token and len(rows) * DENSE_SHARE >= len(asked) * batch.n:
            scores = self._for(asked).batch(batch)[0]
            assert scores is not None
            return scores[torch.searchsorted(asked, queries), rows]
        values = None
        for query in asked.tolist():
            mine = torch.nonzero(queries == query).flatten()
            scores = self._for(torch.tensor([query])).batch(batch.take(rows[mine]))[0]
            assert scores is not None
            values = scores.new_empty(len(rows), *scores.shape[2:]) if values is None else values
            values[mine] = scores[0]
        assert values is not None
        return values

    def _for(self, queries: torch.Tensor) -> "Scorer":
        """A scorer of these queries' factors alone (no self-influence), sharing this one's model."""
        factors = self.rows().take(queries) if self.im.contracts() else self.factors[queries]  # type: ignore[index]
        return Scorer(self.im, factors, None, self.per_token)

    def features(self, x: torch.Tensor, y: torch.Tensor, project: Callable[[Batch], torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-example features (n, p') of (x, y), what scores contract with the query factors (the training index's
        rows), or with `project` a compressed image of them taken from the captures, and their (exact)
        self-influences (None when off), from the same captures."""
        rows, values = [], []
        for batch in self._batches(x, y):
            features = self.im.batch_features(batch) if project is None else None
            rows.append(project(batch) if project is not None else features)
            values.append(None if self.plan is None else self._self_influences(batch, features))
        return torch.cat(rows), (None if self.plan is None else torch.cat(values))

    def _batches(self, x: torch.Tensor, y: torch.Tensor) -> Iterator[Batch]:
        """The captured batches of (x, y), in the basis the scores are taken in (chosen at the first batch)."""
        for lo in range(0, examples.count(x), self.im.batch_size):
            rows = slice(lo, lo + self.im.batch_size)
            batch = self.im.gradient_batch(examples.take(x, rows), y[rows], in_basis=self.as_captured is False)
            if self.as_captured is None:
                self._choose_basis(batch, examples.count(x))
                if not self.as_captured:
                    batch = self.im.to_basis(batch)
            yield batch

    def _choose_basis(self, batch: Batch, n: int) -> None:
        """Score in the captures' basis when the method maps the rows there for less than rotating these n examples."""
        mapped = self.im.rows_as_captured(self.rows(), batch, n)
        self.as_captured = mapped is not None
        if mapped is not None:
            self._rows = mapped

    def batch(self, batch: Batch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Scores and self-influences of one captured batch."""
        if self.per_token:
            return self._token_scores(batch), None
        features = None if self.im.contracts() else self.im.batch_features(batch)
        scores = None
        if self.scoring:
            scores = contract(self.rows(), batch, self.im.work) if features is None else self._gemm(self.factors, features)
        return scores, (None if self.plan is None else self._self_influences(batch, features))

    def _token_scores(self, batch: Batch) -> torch.Tensor:
        """Scores per training position (n_queries, n, T): the contraction before its sum over positions, with the
        query rows, with projected factors mapped back to the gradients' space, or with a basis's rows and then the
        factors."""
        self.im.check_per_token()
        if self.im.contracts():
            return contract(self.rows(), batch, self.im.work, per_token=True)
        assert self.factors is not None
        if self.im.projector is not None:
            if self._rows is None:
                self._rows = self.im.projected_token_rows(self.factors)
            return contract(self._rows, batch, self.im.work, per_token=True)
        features = self.im.token_features(batch)  # (p', n, T)
        self.im.work.score_flops += 2.0 * self.factors.shape[0] * features.numel()
        return torch.einsum("mk,knt->mnt", self.factors.to(features.dtype), features)

    def rows(self) -> Rows:
        """The factors as per-layer rows, built at the first batch (the split needs one); the flat copy is then
        dropped, so a worker holds the factors once."""
        if self._rows is None:
            assert self.factors is not None and self.im._split is not None
            self._rows = factor_rows(self.factors, self.im._split, self.im.row_order, self.im.query_rank)
            self.factors = None
        return self._rows

    def _gemm(self, left: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        self.im.work.score_flops += 2.0 * left.shape[0] * features.shape[0] * features.shape[1]
        return left.to(features.dtype) @ features.T

    def _self_influences(self, batch: Batch, features: torch.Tensor | None) -> torch.Tensor:
        plan = self.plan
        if isinstance(plan, Diagonal):
            if "features" in plan.weights:
                assert features is not None
                return (features**2) @ plan.weights["features"].to(features.dtype)
            return weighted_squares(plan.weights, batch, self.im.work)
        if isinstance(plan, Sketch):
            return plan.evaluate(self._sketch_coordinates(plan, batch, features), self.im.block_norms(batch, features))
        assert isinstance(plan, Solve)
        full = features if features is not None else self.im.batch_features(batch)
        return (full * self.im.precondition(full)).sum(1)

    def _sketch_coordinates(self, plan: Sketch, batch: Batch, features: torch.Tensor | None) -> torch.Tensor:
        """u_kᵀφ for the sketch's rows: a GEMM on formed features, else a contraction with the captures."""
        if len(plan.rows) == 0:
            return torch.zeros(0, batch.n, dtype=batch.dtype, device=batch.device)
        if features is not None:
            return self._gemm(plan.rows, features)
        if self._sketch_rows is None:
            assert self.im._split is not None
            self._sketch_rows = Rows.from_flat(plan.rows.to(batch.dtype), self.im._split, self.im.row_order)
        return contract(self._sketch_rows, batch, self.im.work)
