"""Stage 3: the fitted curvature state of the chosen method (matrix factor, eigenbasis, ...)."""

from __future__ import annotations

from typing import Any

from ..refs import DataRef, ModelRef, StageRef
from ..specs import MethodSpec, ModelSpec
from .loading import load_model, save_tensors, train_batches
from .stage import StageCall, StageLocation
from .store import RunStore


def plan(method: MethodSpec, model: ModelRef, data: DataRef, store: RunStore) -> StageCall[StageRef]:
    return StageCall("fit_preconditioner", StageRef, {"method": method.model_dump(mode="json")}, {"model": model, "data": data}, store)


def _fit(method: MethodSpec, model: ModelRef, data: DataRef, store: RunStore, loc: StageLocation) -> dict[str, Any]:
    im = method.build(load_model(model, store.options), ModelSpec.model_validate(model.spec).loss)
    im.fit(train_batches(data, store.options, method.batch_size))
    url = loc.path("curvature.pt")
    save_tensors(url, im.state_dict(), store.options)
    return {"url": url, "fingerprint": loc.key, "shape": (im.objective.space.dim,), "dtype": model.dtype}


def run(method: MethodSpec, model: ModelRef, data: DataRef, store: RunStore) -> StageRef:
    return plan(method, model, data, store).run(lambda loc: _fit(method, model, data, store, loc))
