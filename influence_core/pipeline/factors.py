"""Stage 4: the query factors (C + λI)⁻¹ ∇ℓ(z_test), computed once per run and stored."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .. import storage
from ..refs import DataRef, ModelRef, StageRef
from ..specs import MethodSpec
from .loading import load_influence_model, open_data
from .stage import StageCall, StageLocation
from .store import RunStore

SOLVE_BLOCK_BYTES = 256 * 2**20  # queries solved together: more rows share each pass over the training data


def plan(method: MethodSpec, model: ModelRef, data: DataRef, curvature: StageRef, store: RunStore, threads: int) -> StageCall[StageRef]:
    inputs = {"model": model, "data": data, "curvature": curvature}
    return StageCall("compute_test_factors", StageRef, {"method": method.model_dump(mode="json")}, inputs, store, threads)


def _compute(method: MethodSpec, model: ModelRef, data: DataRef, curvature: StageRef, store: RunStore, loc: StageLocation) -> dict[str, Any]:
    im = load_influence_model(method, model, data, curvature, store.options)
    arrays = open_data(data, store.options)
    x_test, y_test = arrays["x_test"], arrays["y_test"]
    n_test = y_test.shape[0]
    block = max(1, min(n_test, SOLVE_BLOCK_BYTES // (8 * im.objective.space.dim)))
    url = loc.path("factors.zarr")
    out = None
    for lo in range(0, n_test, block):
        hi = min(lo + block, n_test)
        f = im.influence_factors(torch.from_numpy(np.asarray(x_test[lo:hi])), torch.from_numpy(np.asarray(y_test[lo:hi])))
        if out is None:
            group = storage.open_group(url, store.options, mode="w")
            # uncompressed: solved factors are dense floats that zstd shrinks by ~15% but slows every worker's read 3×
            out = group.create_array("factors", shape=(n_test, f.shape[1]), chunks=(block, f.shape[1]), dtype=str(f.dtype).removeprefix("torch."), compressors=None)
        out[lo:hi] = f.cpu().numpy()
    assert out is not None
    out.attrs["fingerprint"] = loc.key
    return {"url": storage.join(url, "factors"), "fingerprint": loc.key, "shape": out.shape, "dtype": str(out.dtype), "work": im.work.as_dict()}


def run(method: MethodSpec, model: ModelRef, data: DataRef, curvature: StageRef, store: RunStore, threads: int) -> StageRef:
    """Solve for the query factors with `threads` torch threads, or return the stored ones."""
    return plan(method, model, data, curvature, store, threads).run(lambda loc: _compute(method, model, data, curvature, store, loc))
