"""Stage 1: the dataset as row-chunked Zarr arrays, fingerprinted by content."""

from __future__ import annotations

from dataclasses import dataclass

from ..store import storage
from ..sources.data import open_source, write_dataset
from ..store.refs import DataRef
from ..specs import DatasetSpec, HfDiskDataset, NpyDataset, NpzDataset, ParquetDataset, ZarrDataset
from ..store.stage import StageCall, StageInput
from ..store.run_store import RunStore


FILE_SOURCES = (NpzDataset, NpyDataset, ZarrDataset, HfDiskDataset, ParquetDataset)


@dataclass(frozen=True)
class PrepareInput(StageInput[DataRef]):
    """The dataset spec and where the run writes."""

    spec: DatasetSpec
    store: RunStore

    def plan(self) -> StageCall[DataRef]:
        config = self.spec.key_config()
        if isinstance(self.spec, FILE_SOURCES):  # keyed by the files' content: replaced files never hit the cache of the old ones
            config["path_content"] = storage.content_token(storage.validate_url(self.spec.path or "", "dataset.path"), self.store.options)
        return StageCall("prepare_data", DataRef, config, {}, self.store)


def run(stage: PrepareInput) -> DataRef:
    """Write the dataset's arrays, or return the stored ones."""
    spec, options = stage.spec, stage.store.options
    return stage.call.run(lambda loc: write_dataset(open_source(spec, options), loc.path("data.zarr"), options, spec.chunk_rows))
