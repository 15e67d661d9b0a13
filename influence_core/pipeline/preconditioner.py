"""Stage 3: the fitted curvature state of the chosen method (matrix factor, eigenbasis, Kronecker factors, ...).

K-FAC and EK-FAC factors are sums over examples: on a Dask cluster each chunk of training rows is one task,
and the chunk sums are added (ExampleNoise ties sampled labels to example indices, so the partition does not
change the result). Every other method fits in this process.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from distributed import Client

from ..batches import ArrayBatches
from ..methods import KfacInfluence
from ..methods.kfac import Sums, factor_bases, merge
from ..refs import DataRef, ModelRef, StageRef
from ..specs import ComputeSpec, MethodSpec, ModelSpec
from .loading import load_model, open_data, save_tensors, train_batches
from .stage import StageCall, StageLocation
from .store import RunStore

FACTOR_TASKS_PER_WORKER = 4


def plan(method: MethodSpec, model: ModelRef, data: DataRef, store: RunStore, compute: ComputeSpec | None = None) -> StageCall[StageRef]:
    """The curvature depends on method, model and data; where it is computed does not change it."""
    return StageCall("fit_preconditioner", StageRef, {"method": method.model_dump(mode="json")}, {"model": model, "data": data}, store)


@dataclass(frozen=True)
class FactorJob:
    """What a factor task needs, by reference."""

    method: MethodSpec
    model: ModelRef
    data: DataRef
    options: dict[str, Any]

    def influence_model(self) -> KfacInfluence:
        im = self.method.build(load_model(self.model, self.options), ModelSpec.model_validate(self.model.spec).loss)
        assert isinstance(im, KfacInfluence)
        return im

    def rows(self, lo: int, hi: int) -> ArrayBatches:
        arrays = open_data(self.data, self.options)
        return ArrayBatches(arrays["x_train"], arrays["y_train"], self.method.batch_size, lo, hi)


def covariance_chunk(job: FactorJob, lo: int, hi: int) -> Sums:
    return job.influence_model().covariance_sums(job.rows(lo, hi), offset=lo)


def correction_chunk(job: FactorJob, lo: int, hi: int, bases: dict[str, Any]) -> Sums:
    return job.influence_model().correction_sums(job.rows(lo, hi), bases, offset=lo)


def distributed_factors(im: KfacInfluence, job: FactorJob, client: Client) -> dict[str, dict[str, Any]]:
    """K-FAC/EK-FAC state from chunk sums computed as Dask tasks."""
    n = job.data.n_train
    step = math.ceil(n / (FACTOR_TASKS_PER_WORKER * max(1, len(client.scheduler_info()["workers"]))))
    starts = list(range(0, n, step))
    stops = [min(lo + step, n) for lo in starts]
    sums = merge(*client.gather(client.map(covariance_chunk, [job] * len(starts), starts, stops, pure=False)))
    bases = {name: factor_bases(values) for name, values in sums.items()}
    corrected = None
    if im.eigen_correction:
        shared = client.scatter(bases, broadcast=True)
        corrected = merge(*client.gather(client.map(correction_chunk, [job] * len(starts), starts, stops, bases=shared, pure=False)))
    return im.factor_state(sums, bases, corrected)


def _fit(method: MethodSpec, model: ModelRef, data: DataRef, store: RunStore, client_factory: Callable[[], Any] | None, loc: StageLocation) -> dict[str, Any]:
    im = method.build(load_model(model, store.options), ModelSpec.model_validate(model.spec).loss)
    batches = train_batches(data, store.options, method.batch_size)
    if isinstance(im, KfacInfluence) and client_factory is not None:
        with client_factory() as client:
            if client is None:
                im.fit(batches)
            else:
                state = distributed_factors(im, FactorJob(method, model, data, store.options), client)
                im.load_state_dict({f"{block}/{key}": value for block, values in state.items() for key, value in values.items()}, train=batches)
    else:
        im.fit(batches)
    url = loc.path("curvature.pt")
    save_tensors(url, im.state_dict(), store.options)
    return {"url": url, "fingerprint": loc.key, "shape": (im.objective.space.dim,), "dtype": model.dtype}


def run(method: MethodSpec, model: ModelRef, data: DataRef, store: RunStore, compute: ComputeSpec | None = None, client_factory: Callable[[], Any] | None = None) -> StageRef:
    """Fit and store the curvature; `client_factory()` (a context manager yielding a Dask client or None) is used
    for the methods whose passes split into chunks."""
    return plan(method, model, data, store, compute).run(lambda loc: _fit(method, model, data, store, client_factory, loc))
