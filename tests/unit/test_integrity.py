"""The content records of stored objects (`store/integrity.py`) against damage made by hand: each kind is found, an
untouched object is trusted from its listing alone, and zarr's crc32c catches a chunk whose stamp was put back."""

from __future__ import annotations

import os

import numpy as np
import pytest

from influence_core.pipeline.store import integrity, storage


def _array(tmp_path, name: str = "a"):
    group = storage.open_group(str(tmp_path / "x.zarr"), {}, mode="a")
    array = storage.create_array(group, name, shape=(40, 5), chunks=(10, 5), dtype="float32", fill_value=np.nan, compressors=None)  # chunks of one size
    array[...] = np.arange(200, dtype=np.float32).reshape(40, 5)
    return array


def test_each_kind_of_damage_is_found_and_an_intact_output_passes(tmp_path):
    _array(tmp_path)
    base = str(tmp_path)
    recorded = integrity.record_listed(base, ["x.zarr"], {})
    assert sorted(recorded) == ["x.zarr/a/c/0/0", "x.zarr/a/c/1/0", "x.zarr/a/c/2/0", "x.zarr/a/c/3/0", "x.zarr/a/zarr.json", "x.zarr/zarr.json"]
    assert integrity.problems(base, recorded, {}) == [] and integrity.problems(base, recorded, {}, deep=True) == []
    chunk = tmp_path / "x.zarr/a/c/2/0"
    original = chunk.read_bytes()
    chunk.write_bytes((tmp_path / "x.zarr/a/c/1/0").read_bytes())  # another chunk's bytes, of the same size
    assert integrity.problems(base, recorded, {}) == ["x.zarr/a/c/2/0 holds other bytes than recorded (sha256 differs)"]
    chunk.write_bytes(original[:20])
    assert integrity.problems(base, recorded, {}) == [f"x.zarr/a/c/2/0 has 20 bytes, not the {len(original)} recorded"]
    chunk.unlink()
    assert integrity.problems(base, recorded, {}) == ["x.zarr/a/c/2/0 is missing"]
    chunk.write_bytes(original)  # the same bytes again, under a new stamp: hashed, and intact
    assert integrity.problems(base, recorded, {}) == []
    assert integrity.content_digest(recorded) == integrity.content_digest(integrity.record_listed(base, ["x.zarr"], {}))


def test_an_unchanged_stamp_is_trusted_unless_deep(tmp_path):
    """The cheap check reads nothing of an object whose size and stamp are unchanged; `deep` hashes every byte."""
    _array(tmp_path)
    recorded = integrity.record_listed(str(tmp_path), ["x.zarr"], {})
    forged = {key: [size, stamp, "0" * 64] for key, (size, stamp, _) in recorded.items()}
    assert integrity.problems(str(tmp_path), forged, {}) == []
    assert len(integrity.problems(str(tmp_path), forged, {}, deep=True)) == len(recorded)


def test_a_checked_file_refuses_other_bytes_and_a_missing_digest(tmp_path):
    url = str(tmp_path / "state.pt")
    integrity.write_checked(url, b"weights" * 100, {})
    assert integrity.read_checked(url, {}, "fit_model", "fix") == b"weights" * 100
    raw = bytearray((tmp_path / "state.pt").read_bytes())
    raw[3] ^= 1
    (tmp_path / "state.pt").write_bytes(bytes(raw))
    with pytest.raises(integrity.DamagedError, match=r"^fit_model: .*state.pt is damaged .* Fix: fix$"):
        integrity.read_checked(url, {}, "fit_model", "fix")
    (tmp_path / "state.pt.sha256").unlink()
    with pytest.raises(integrity.DamagedError, match="has no .sha256 record"):
        integrity.read_checked(url, {}, "fit_model", "fix")
    with pytest.raises(FileNotFoundError):
        integrity.read_checked(str(tmp_path / "absent.pt"), {}, "fit_model", "fix")


def test_a_chunk_damaged_under_its_old_stamp_fails_zarrs_crc32c(tmp_path):
    """A flipped byte whose file keeps its modification time still fails the read that decodes it, as one line."""
    array = _array(tmp_path)
    chunk = tmp_path / "x.zarr/a/c/1/0"
    stamp = chunk.stat()
    raw = bytearray(chunk.read_bytes())
    raw[7] ^= 0xFF
    chunk.write_bytes(bytes(raw))
    os.utime(chunk, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    np.testing.assert_array_equal(array[:10], np.arange(50, dtype=np.float32).reshape(10, 5))  # other chunks read
    with pytest.raises(integrity.DamagedError, match=r"^index_training: a chunk of .* is damaged \(zarr's crc32c"):
        with integrity.chunk_reads("index_training", "the index", "repair it"):
            array[10:20]


def test_markers_of_other_formats_are_left_out(tmp_path):
    good, empty, garbage = (str(tmp_path / name) for name in ("0", "1", "2"))
    storage.write_json(good, {"a/c/0": [4, "s", "d"]}, {})
    storage.write_bytes(empty, b"", {})
    storage.write_bytes(garbage, b"{not json", {})
    assert integrity.read_markers([good, empty, garbage, str(tmp_path / "3")], {}) == {good: {"a/c/0": [4, "s", "d"]}}
