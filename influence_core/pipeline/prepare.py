"""Stage 1: the dataset as row-chunked Zarr arrays, fingerprinted by content."""

from __future__ import annotations

from . import storage
from .data import open_source, write_dataset
from .refs import DataRef
from .specs import DatasetSpec, NpyDataset, NpzDataset, ZarrDataset
from .stage import StageCall
from .run_store import RunStore


FILE_SOURCES = (NpzDataset, NpyDataset, ZarrDataset)


def plan(spec: DatasetSpec, store: RunStore) -> StageCall[DataRef]:
    config = spec.key_config()
    if isinstance(spec, FILE_SOURCES):  # replaced files must not hit the cache of the old ones
        config["path_stat"] = storage.stat_token(storage.validate_url(spec.path or "", "dataset.path"), store.options)
    return StageCall("prepare_data", DataRef, config, {}, store)


def run(spec: DatasetSpec, store: RunStore) -> DataRef:
    return plan(spec, store).run(lambda loc: write_dataset(open_source(spec, store.options), loc.path("data.zarr"), store.options, spec.chunk_rows))
