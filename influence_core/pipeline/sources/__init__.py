"""Data sources: arrays, Arrow tables, Python's docstrings and user code by dotted path, streamed into Zarr."""
