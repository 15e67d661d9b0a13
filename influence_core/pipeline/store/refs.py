"""Small descriptions of stage outputs; they travel between stages instead of tensors."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict
from typing_extensions import Self


class Ref(BaseModel):
    """Where a stage output lives and what it is; `fingerprint` identifies its content."""

    model_config = ConfigDict(frozen=True)

    url: str
    fingerprint: str
    shape: tuple[int, ...]
    dtype: str

    def moved(self, move: Callable[[str], str]) -> Self:
        """The same ref with every URL it holds passed through `move` (to make it relative to a root, or resolve it)."""
        return self.model_copy(update={"url": move(self.url)})

    @property
    def base(self) -> str:
        """The folder holding the output: its inventory names objects relative to it."""
        return self.url.rsplit("/", 1)[0]

    @property
    def identity(self) -> str:
        """What a stage key hashes of this input: its fingerprint (a content hash, or the key that made it)."""
        return self.fingerprint


class StageRef(Ref):
    """A stage output plus when it was made, by which process, how long that took, and the work it did."""

    stage: str
    created_at: datetime
    seconds: float
    producer: str  # host:pid of the process that computed it
    work: dict[str, float] = {}  # influence_core.work.Work counters of the computation (empty when it counts none)
    parameters: dict[str, Any] = {}  # fit_preconditioner: the parameters attributed, excluded and frozen (InfluenceFunctionModel.attributed_parameters)
    ran: str = ""  # where its tasks ran: the cluster's kind, or the flow's process (threads, the work's GFLOP, the bound)
    key: str = ""  # the stage key that made it: its manifest is {cache_url}/{stage}/{key}/manifest.json
    digest: str = ""  # the content digest of its objects (`integrity.content_digest` of its manifest's inventory)

    @property
    def identity(self) -> str:
        """Fingerprint and content digest: a stage over this output is keyed on what the output holds, so a
        recomputed output with other bytes (a nondeterministic fit) never meets a stage made from the old one. A ref
        without a digest (recorded before there were any) keys as it always did."""
        return f"{self.fingerprint}:{self.digest}" if self.digest else self.fingerprint


WHITENING_FILE = "whitening.pt"  # in a whitened compressed index's group: in its inventory, so a damaged one is found


class FactorsRef(StageRef):
    """The query factors (`url`: a Zarr array (n_test, dim)) in the method's feature coordinates ("parameters"), or
    projected into a compressed training index's ("index", `influence_core.index_projection`)."""

    coordinates: str = "parameters"


class DataRef(StageRef):
    """Train and query arrays in one Zarr group: x_train, y_train, x_test, y_test; inputs of named fields are one
    array per field, x_train/input_ids, x_train/attention_mask, ... (see docs/examples.md)."""

    arrays: dict[str, Ref]
    n_classes: int | None
    image_shape: tuple[int, ...] | None

    def moved(self, move: Callable[[str], str]) -> Self:
        return super().moved(move).model_copy(update={"arrays": {name: ref.moved(move) for name, ref in self.arrays.items()}})

    @property
    def n_train(self) -> int:
        return self.arrays["y_train"].shape[0]

    @property
    def training(self) -> Ref:
        """The training side alone, as a stage-key input: its fingerprint hashes the training arrays and the model
        shape they imply (classes, image shape), never the queries, so stages keyed on it (fit_model,
        fit_preconditioner, index_training, validation's retrainings) are reused by runs with other queries."""
        names = sorted(name for name in self.arrays if name.split("/")[0] in ("x_train", "y_train"))
        payload = "".join(self.arrays[name].fingerprint for name in names) + f"|{self.n_classes}|{self.image_shape}"
        x_train = self.arrays[names[0]]
        return Ref(url=self.url, fingerprint=hashlib.sha256(payload.encode()).hexdigest()[:24], shape=x_train.shape, dtype=x_train.dtype)

    @property
    def label_positions(self) -> int:
        """Entries of one training label: 1 for a class per row, T for a window of T tokens."""
        return math.prod(self.arrays["y_train"].shape[1:])

    @property
    def n_test(self) -> int:
        return self.arrays["y_test"].shape[0]

    @property
    def feature_shape(self) -> tuple[int, ...]:
        """The shape of one example's inputs (of its first field, for named fields)."""
        return next(ref for name, ref in self.arrays.items() if name.split("/")[0] == "x_train").shape[1:]


class ModelRef(StageRef):
    """A stored state_dict and what is needed to rebuild the module around it."""

    spec: dict
    in_features: int
    out_features: int
    train_loss: float | None
    metrics: dict[str, float] = {}  # train_loss, and train_accuracy where the task has one (each run's summary adds its queries')
    feature_shape: list[int] | None = None  # the inputs' shape, for architectures that need more than their size (cnn)
    lora: dict[str, Any] | None = None  # training.lora's adapters (specs.LoraSpec): the stored state_dict is of the model wrapped with them


class ScoresRef(StageRef):
    """The scores array, and the work the run that finished it did: chunks computed and per-sample gradients
    evaluated (a resumed run counts only what it added), how self-influence was computed, and the candidate prefilter's
    figures when it ran (`url` is then candidate_scores)."""

    n_chunks: int
    chunks_computed: int
    gradient_rows: int
    self_influence: dict[str, Any]
    candidates: dict[str, Any] = {}  # FastIF's prefilter: k, index, scored rows, feature and index seconds (empty: full scores)
    spread: float | None = None  # method magic: the largest |score| over the median |score| (metagradients.score_spread)


class IndexRef(StageRef):
    """The training index (`url`: its Zarr group, with `features` (n_train, dim) and `self_influence` (n_train,)),
    how it is stored, and the work of the pass that wrote it. `compression` is "none" (exact), "logra" (each gradient
    matrix projected to side × side numbers, `influence_core.index_projection`), or "skipped", with the reason in
    `skipped`: scoring then recomputes training gradients."""

    bytes_per_row: int
    compression: str
    skipped: str | None = None
    side: int | None = None  # compression "logra": the projection's side per gradient matrix (seeded by `seed`)
    sides: dict[str, list[int]] = {}  # compression "logra": each layer's (k_out, k_in), its own size where smaller than the side
    total_bytes: int = 0  # the stored rows: n_train × bytes_per_row
    dim: int = 0  # numbers a stored row holds (shape[1])
    exact_dim: int = 0  # numbers an uncompressed row would hold
    probe: dict[str, Any] = {}  # compression "logra": the probe check (`index_probe.summarize`): recall@10, Pearson, cost, warning
    seed: int = 0
    rows_per_chunk: int | None = None
    n_chunks: int = 0
    chunks_computed: int = 0
    gradient_rows: int = 0
    self_influence: dict[str, Any] = {}

    @property
    def usable(self) -> bool:
        return self.compression != "skipped"

    def array(self, name: str) -> str:
        return f"{self.url}/{name}"

    @property
    def whitening_url(self) -> str:
        """In the index's group: a whitened (K-FAC/EK-FAC) compressed index's truncated-SVD factors of D^(-1/2)."""
        return f"{self.url}/{WHITENING_FILE}"


class ValidationRef(StageRef):
    """The validate stage: the run's LDS (mean, standard error, per query; None where undefined, e.g. a query whose
    measurement never changed) over `subsets` retrainings, and how many of them this run computed."""

    lds_mean: float | None
    lds_stderr: float | None
    lds_per_query: list[float | None]
    slope: float | None = None  # least-squares slope of the actual query-loss changes on the predicted ones (influence_core.lds.change_slope)
    pearson: float | None = None  # their Pearson correlation
    subsets: int
    subsets_computed: int
    fraction: float
    queries: int
    concurrent_retrainings: int = 0  # retrainings run at once on the cluster (runtime.cluster.task_slots); 0: none this run
