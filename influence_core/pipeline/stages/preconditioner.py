"""Stage 3: the fitted curvature state of the chosen method (matrix factor, eigenbasis, Kronecker factors, ...).

K-FAC and EK-FAC factors are sums over examples, computed on equal blocks of at most FACTOR_ROWS training rows
and FACTOR_POSITIONS loss positions, one task each (on the Dask cluster, or here on as many threads as a local
cluster has workers when the passes are small: `runtime.cluster.place`), with one torch thread, and added in a fixed pairwise
tree over the blocks (on the cluster, as tasks).
The partition depends on nothing but the data's shape, and sampled labels are tied to example indices, so every
cluster kind gives the same bits. Every other method fits in this process with `compute.torch_threads` threads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from distributed import Client

from ... import examples
from ...batches import ArrayBatches
from ...magic import check_deterministic, check_replayable
from ...methods import KfacInfluence
from ...methods.kfac import Sums, factor_bases, merge
from ..model.models import build_model, probe_forward
from ...objective import Objective
from ...reduction import pairwise_sum, summed_tasks
from ...work import forward_flops
from ..runtime.cluster import place
from ..store.refs import DataRef, ModelRef, StageRef
from ..specs import ComputeSpec, MagicMethod, MethodSpec, ModelSpec, TrainingSpec
from ..runtime.threads import TASK_THREADS, in_threads, torch_threads
from ..store.loading import load_model, open_data, save_tensors, train_batches
from ..store.stage import StageCall, StageInput, StageLocation
from ..store.run_store import RunStore

FACTOR_ROWS = 4096  # training rows per factor task, at most
FACTOR_POSITIONS = 65_536  # and at most this many loss positions (a language model's row is one per token)


@dataclass(frozen=True)
class PreconditionerInput(StageInput[StageRef]):
    """The method, the trained model, the data, and the compute spec (its cluster runs K-FAC's factor passes)."""

    method: MethodSpec
    model: ModelRef
    data: DataRef
    store: RunStore
    compute: ComputeSpec

    def plan(self) -> StageCall[StageRef]:
        """The curvature depends on method, model, the training rows and the torch threads of this process; not on the
        queries, nor on the cluster."""
        inputs = {"model": self.model, "train": self.data.training}
        return StageCall("fit_preconditioner", StageRef, {"method": self.method.model_dump(mode="json")}, inputs, self.store, self.compute.torch_threads)


@dataclass(frozen=True)
class FactorJob:
    """What a factor task needs, by reference."""

    method: MethodSpec
    model: ModelRef
    data: DataRef
    options: dict[str, Any]
    device: str = "cpu"

    def influence_model(self) -> KfacInfluence:
        im = self.method.build(load_model(self.model, self.options, self.device), ModelSpec.model_validate(self.model.spec).make_task())
        assert isinstance(im, KfacInfluence)
        return im

    def rows(self, lo: int, hi: int) -> ArrayBatches:
        arrays = open_data(self.data, self.options)
        return ArrayBatches(arrays["x_train"], arrays["y_train"], self.method.batch_size, lo, hi)


def factor_blocks(n: int, positions: int = 1) -> list[tuple[int, int]]:
    """Row ranges of equal size (to one row), as few as hold at most FACTOR_ROWS rows and FACTOR_POSITIONS loss
    positions each (`positions` per row), so no task waits on a short last block: W3's 5,000 rows as 2 × 2,500, not
    4,096 + 904 (its fit_preconditioner 4.39/4.53 s -> 3.78/3.69 s on two workers), and W4's 2,000 windows of 64
    tokens as 2 × 1,000, not one task that leaves the second worker idle."""
    rows = max(1, min(FACTOR_ROWS, FACTOR_POSITIONS // positions))
    count = -(-n // rows)
    return [(i * n // count, (i + 1) * n // count) for i in range(count)]


def on_device(tree: Any, device: str) -> Any:
    """Every tensor of nested dicts and tuples (sums, bases) moved to `device`: block sums travel and add up on the
    CPU, whatever device computed them."""
    if isinstance(tree, dict):
        return {key: on_device(value, device) for key, value in tree.items()}
    if isinstance(tree, tuple):
        return tuple(on_device(value, device) for value in tree)
    return tree.to(device) if hasattr(tree, "to") else tree


def covariance_chunk(job: FactorJob, lo: int, hi: int) -> Sums:
    with torch_threads(TASK_THREADS):
        return on_device(job.influence_model().covariance_sums(job.rows(lo, hi), offset=lo), "cpu")


def correction_chunk(job: FactorJob, lo: int, hi: int, bases: dict[str, Any]) -> Sums:
    with torch_threads(TASK_THREADS):
        return on_device(job.influence_model().correction_sums(job.rows(lo, hi), on_device(bases, job.device), offset=lo), "cpu")


def _block_sums(client: Client | None, fn: Callable[..., Sums], job: FactorJob, threads: int, **shared: Any) -> Sums:
    """The blocks' sums added in one pairwise tree (`reduction.py`): the same order on every cluster kind, and the
    driver holds the total only, not every block's sums (for W3's model ~37 MB per block: 245 blocks for a million
    rows); without a client, the blocks run here on `threads` threads."""
    calls = [(job, lo, hi) for lo, hi in factor_blocks(job.data.n_train, job.data.label_positions)]
    if client is None:
        return pairwise_sum(in_threads(partial(fn, **shared), calls, threads), merge)
    shared = {name: client.scatter(value, broadcast=True) for name, value in shared.items()}
    return summed_tasks(client, fn, calls, merge, shared)


def kronecker_factors(im: KfacInfluence, job: FactorJob, client: Client | None, threads: int = 1) -> dict[str, dict[str, Any]]:
    """K-FAC/EK-FAC state from block sums: covariances, their eigenbases, then (EK-FAC) the corrected eigenvalues."""
    sums = _block_sums(client, covariance_chunk, job, threads)
    bases = {name: factor_bases(values) for name, values in sums.items()}
    corrected = _block_sums(client, correction_chunk, job, threads, bases=bases) if im.eigen_correction else None
    return im.factor_state(sums, bases, corrected)


FACTOR_PASS_FORWARDS = 6  # a factor pass costs about 6 forward passes: forward and backward (3), the factors' products (~3)


def factor_flops(im: KfacInfluence, x: Any, n_rows: int) -> float:
    """The factor passes' estimated FLOPs over n_rows, from one forward over the rows x (`forward_flops`)."""
    passes = 2 if im.eigen_correction else 1
    return passes * FACTOR_PASS_FORWARDS * forward_flops(im.objective.model, x) * n_rows / examples.count(x)


def check_method(method: MethodSpec, model: ModelSpec, training: TrainingSpec, data: DataRef, arrays: dict[str, Any]) -> None:
    """Before training: build the method around the untrained model (with its LoRA adapters), so that what depends
    only on the model's structure (module names in `method.modules` or a per-layer λ, λ > 0 where the method needs it)
    is refused in seconds, not after training; method magic, that the model's training can be replayed (no dropout
    modules nor running statistics, and a forward pass in training mode that draws no random numbers on the first
    training rows; a forward pass that fails there is told as fit_model's probe tells it)."""
    structure = build_model(model, data, lora=training.lora)
    if isinstance(method, MagicMethod):
        check_replayable(structure)
        x, y = examples.read(arrays["x_train"], slice(0, 64)), examples.read(arrays["y_train"], slice(0, 64))
        probe_forward(Objective(structure, model.make_task()), model, x, y)
        check_deterministic(structure, x)
        return
    method.build(structure, model.loss)


def _fit(stage: PreconditionerInput, client_factory: Callable[[], Any], loc: StageLocation) -> dict[str, Any]:
    method, model, data, store = stage.method, stage.model, stage.data, stage.store
    im = method.build(load_model(model, store.options, stage.compute.torch_device), ModelSpec.model_validate(model.spec).make_task())
    batches = train_batches(data, store.options, method.batch_size)
    if isinstance(im, KfacInfluence):
        batch = next(iter(batches))
        im.objective.check_outputs(*batch)
        placement = place(stage.compute, factor_flops(im, examples.take(batch[0], slice(0, 1)), data.n_train))
        with placement.client(client_factory) as client:
            state = kronecker_factors(im, FactorJob(method, model, data, store.options, stage.compute.torch_device), client, placement.threads)
        ran = placement.ran
        state = on_device(state, stage.compute.torch_device)
        im.load_state_dict({f"{block}/{key}": value for block, values in state.items() for key, value in values.items()}, train=batches)
        im.check_regularization()  # as the library's fit does, from the factors' eigenvalues
    else:
        im.fit(batches)
        ran = "in the flow's process"
    url = loc.path("curvature.pt")
    save_tensors(url, im.state_dict(), store.options)
    return {"url": url, "fingerprint": loc.key, "shape": (im.objective.space.dim,), "dtype": model.dtype, "work": im.work.as_dict(), "parameters": im.attributed_parameters(), "ran": ran}


def run(stage: PreconditionerInput, client_factory: Callable[[], Any]) -> StageRef:
    """Fit and store the curvature; `client_factory()` (a context manager yielding a Dask client or None) is used
    for the methods whose passes split into blocks."""
    return stage.call.run(lambda loc: _fit(stage, client_factory, loc))
